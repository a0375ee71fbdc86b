"""Triton's ModelConfig and ModelStatistics answers, built from the core's.

The core describes a model's configuration (:class:`~trio_infer.core.model_config.
ModelConfiguration`) and its request statistics (:class:`~trio_infer.core.types.ModelStatistics`)
without a wire format; these pure functions put them into Triton's messages, field by field,
for :class:`~trio_infer.frontends.grpc_service.GrpcService`, and for
:class:`~trio_infer.frontends.http_service.HttpService`, which writes them as JSON.

What has no counterpart here stays at protobuf's default (empty), rather than be made up:

- ModelConfig: the version policy is Triton's default (the latest version, one served);
  ``runtime``, ``optimization``, ``batch_input`` / ``batch_output``, ``model_warmup``,
  ``default_model_filename``, the response cache, repository agents and metrics overrides have
  no setting; instances are CPU processes, with no GPUs, rate limiter or secondary devices.
- ModelStatistics: ``memory_usage`` and the per-response ``response_stats`` of decoupled
  models (not recorded). The durations not measured are there with zero counts, as Triton
  writes every one of them: ``compute_input`` and ``compute_output`` (the worker measures the
  model's own code, reported as ``compute_infer``, not the moves of tensors around it) and the
  cache's hits and misses (no response cache).
"""

from __future__ import annotations

from collections.abc import Iterable

from trio_infer.core.model_config import ModelConfiguration
from trio_infer.core.types import ModelStatistics, TensorSpec
from trio_infer.errors import StatusCode
from trio_infer.protobuf._proto import grpc_predict_v2_pb2 as pb
from trio_infer.protobuf._proto import model_config_pb2 as mc
from trio_infer.protobuf.triton_types import TRITON_DATA_TYPES

__all__ = ["model_config_response", "model_statistics_response"]


def model_config_response(config: ModelConfiguration) -> pb.ModelConfigResponse:
    """Triton's ``ModelConfigResponse`` for a model's configuration."""
    message = mc.ModelConfig(
        name=config.name,
        platform=config.platform,
        backend=config.backend,
        # The one version served is the latest: Triton's default policy says so.
        version_policy=mc.ModelVersionPolicy(latest=mc.ModelVersionPolicy.Latest(num_versions=1)),
        max_batch_size=config.max_batch_size,
        input=[
            mc.ModelInput(name=spec.name, data_type=_data_type(spec), dims=spec.shape)
            for spec in config.inputs
        ],
        output=[
            mc.ModelOutput(name=spec.name, data_type=_data_type(spec), dims=spec.shape)
            for spec in config.outputs
        ],
        # Every worker process loads every model: one group of CPU instances, named as Triton
        # names a group the config leaves unnamed.
        instance_group=[
            mc.ModelInstanceGroup(
                name=f"{config.name}_0",
                kind=mc.ModelInstanceGroup.KIND_CPU,
                count=config.instance_count,
            )
        ],
        parameters={
            name: mc.ModelParameter(string_value=value) for name, value in config.parameters.items()
        },
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=config.decoupled),
    )
    if config.dynamic_batching is not None:
        batching = config.dynamic_batching
        message.dynamic_batching.CopyFrom(
            mc.ModelDynamicBatching(
                max_queue_delay_microseconds=batching.max_queue_delay_microseconds,
                priority_levels=batching.priority_levels,
                default_priority_level=batching.default_priority_level,
                default_queue_policy=mc.ModelQueuePolicy(max_queue_size=batching.max_queue_size),
            )
        )
    if config.sequence_batching is not None:
        message.sequence_batching.max_sequence_idle_microseconds = (
            config.sequence_batching.max_sequence_idle_microseconds
        )
    return pb.ModelConfigResponse(config=message)


def model_statistics_response(
    statistics: Iterable[ModelStatistics],
) -> pb.ModelStatisticsResponse:
    """Triton's ``ModelStatisticsResponse`` for models' statistics, in the order given."""
    return pb.ModelStatisticsResponse(model_stats=[_model_statistics(s) for s in statistics])


def _model_statistics(statistics: ModelStatistics) -> pb.ModelStatistics:
    requests = statistics.requests
    failed = sum(count for code, count in requests.items() if code != StatusCode.OK)
    queue, compute = statistics.queue_duration, statistics.compute_duration
    return pb.ModelStatistics(
        name=statistics.name,
        version=statistics.version,
        last_inference=round(statistics.last_inference * 1000),
        inference_count=statistics.inferences,
        execution_count=statistics.executions,
        inference_stats=pb.InferStatistics(
            success=_duration(requests[StatusCode.OK], statistics.success_seconds),
            fail=_duration(failed, statistics.failure_seconds),
            queue=_duration(queue.count, queue.sum),
            compute_input=pb.StatisticDuration(),
            compute_infer=_duration(compute.count, compute.sum),
            compute_output=pb.StatisticDuration(),
            cache_hit=pb.StatisticDuration(),
            cache_miss=pb.StatisticDuration(),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=rows,
                compute_input=pb.StatisticDuration(),
                compute_infer=_duration(count, seconds),
                compute_output=pb.StatisticDuration(),
            )
            for rows, (count, seconds) in statistics.batch_sizes.items()
        ],
    )


def _duration(count: int, seconds: float) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=count, ns=round(seconds * 1e9))


def _data_type(spec: TensorSpec) -> mc.DataType:
    # Settings accept only the protocol's datatypes, each of which Triton names.
    return TRITON_DATA_TYPES[spec.datatype]
