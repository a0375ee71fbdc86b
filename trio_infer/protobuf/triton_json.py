"""A protobuf message as the JSON object Triton's HTTP endpoint writes for it.

Triton answers its model configuration and statistics extensions over REST with the JSON of
the same messages its gRPC endpoint sends (``ModelConfig``, ``ModelStatistics``): protobuf's
JSON mapping with the field names of the ``.proto`` files, every field that has no presence
written even at its default, and 64-bit integers as JSON numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

__all__ = ["message_json"]

#: The field types protobuf's JSON mapping writes as strings: the 64-bit integers.
_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def message_json(message: Message) -> dict[str, Any]:
    """``message`` as a JSON object: protobuf's JSON mapping (``.proto`` field names, every
    field without presence written, defaults included), but with 64-bit integers as numbers.

    protobuf's default writes an int64 or uint64 as a string (its mapping's choice for
    JavaScript, whose numbers hold 53 bits); Triton's HTTP endpoint writes them as numbers,
    and code written for it does arithmetic on ``config["dims"]`` or ``stats["inference_count"]``
    without a conversion. Map keys stay strings (JSON's keys are). The messages served have no
    well-known types (``Any``, ``Timestamp``...), whose JSON is not an object of fields.
    """
    document = json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    # The stubs type DESCRIPTOR as the pure-Python class or upb's, which have the same fields.
    descriptor = cast("Descriptor", message.DESCRIPTOR)
    _integers_as_numbers(descriptor.fields, document)
    return document


def _integers_as_numbers(fields: Iterable[FieldDescriptor], document: dict[str, Any]) -> None:
    """Turn the 64-bit integers of ``document`` (the JSON of a message with ``fields``) into
    numbers, in place, in its nested messages, repeated fields and map values too."""
    for field in fields:
        value = document.get(field.name)
        if value is None:
            continue
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            for key, item in value.items():
                value[key] = _as_number(value_field, item)
        elif field.is_repeated:
            value[:] = [_as_number(field, item) for item in value]
        else:
            document[field.name] = _as_number(field, value)


def _as_number(field: FieldDescriptor, value: Any) -> Any:
    """One value of ``field`` with its 64-bit integers as numbers."""
    if field.type in _INT64_TYPES:
        return int(value)
    if field.message_type is not None:
        _integers_as_numbers(field.message_type.fields, value)
    return value
