"""The protocol-neutral Open Inference Protocol core.

``types`` holds the request, response and context every front-end builds; ``validation`` checks a
decoded request against its model (pure functions); ``model_config`` describes a model in
Triton's terms (its ``ModelConfig``); ``service`` runs the operations.

May import: scheduling, workers, the repository, the model API, ``trio_infer.datatypes`` and
``trio_infer.errors``. Never a transport, a front-end or protobuf: a gRPC call, a stream message
and a REST request reach it as the same :class:`~trio_infer.core.types.InferenceRequest`.
"""
