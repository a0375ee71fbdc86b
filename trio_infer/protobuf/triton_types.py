"""The protocol's datatypes in Triton's model configuration: ``"FP32"`` -> ``TYPE_FP32``.

Triton's ``ModelConfig`` names a tensor's element type with its ``DataType`` enum
(``model_config.proto``) rather than the protocol's datatype strings. The names match but for
the prefix, and for BYTES, which Triton calls ``TYPE_STRING``.
"""

from __future__ import annotations

from collections.abc import Mapping

from trio_infer.protobuf._proto import model_config_pb2 as mc

__all__ = ["TRITON_DATA_TYPES"]

#: Triton's ``DataType`` of each of the protocol's datatypes (the keys of
#: :data:`trio_infer.datatypes.DATATYPES`).
TRITON_DATA_TYPES: Mapping[str, mc.DataType] = {
    "BOOL": mc.TYPE_BOOL,
    "UINT8": mc.TYPE_UINT8,
    "UINT16": mc.TYPE_UINT16,
    "UINT32": mc.TYPE_UINT32,
    "UINT64": mc.TYPE_UINT64,
    "INT8": mc.TYPE_INT8,
    "INT16": mc.TYPE_INT16,
    "INT32": mc.TYPE_INT32,
    "INT64": mc.TYPE_INT64,
    "FP16": mc.TYPE_FP16,
    "FP32": mc.TYPE_FP32,
    "FP64": mc.TYPE_FP64,
    "BYTES": mc.TYPE_STRING,
}
