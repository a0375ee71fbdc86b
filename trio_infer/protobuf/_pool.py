"""The private descriptor pool that the generated modules in ``_proto`` register their protos in.

Protobuf's generated code adds each ``.proto`` file to the process-wide default pool, which
refuses a second definition of a full name (``inference.ModelInferRequest``) from another file.
tritonclient, MLServer and grpcio-health-checking each ship their own copy of the protocol under
the same package, message and service names (the names the wire format and the gRPC paths are
made of), so in the default pool whichever copy is imported second fails to load, and with it the
whole library. ``protos/generate.py`` rewrites our ``_pb2`` modules to add their files to
:data:`POOL` instead; the names, numbers and bytes on the wire are unchanged.

What works from a message's class or descriptor is unaffected: ``SerializeToString`` and
``FromString``, ``DESCRIPTOR.fields_by_name``, ``json_format`` and ``text_format``, and the grpcio
and purerpc stubs, which only hold the classes. What looks a type up by name in the default pool
or the default symbol database does not find ours: ``descriptor_pool.Default()`` finds another
library's copy of ``inference.ModelInferRequest`` or nothing. Unpickling a nested message is such
a look-up (protobuf pickles it as its full name, to be found in the default symbol database), so
:func:`pickle_nested_by_class` makes our nested messages pickle as top-level ones do, by class.

Only protobuf's upb backend, the default wherever protobuf ships a binary wheel, keeps the
default pool untouched. Under the pure-Python backend (``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION
=python``) protobuf's generated-code builder also records every message class in the default
pool, so there the collision with another copy of the protocol remains; our modules still work
on their own.

Invariant: every file added here has all its dependencies here too. Our protos import nothing
outside ``protos/`` (``protos/generate.py`` refuses any that do), so no well-known type has to
be copied in from the default pool.
"""

from __future__ import annotations

import copyreg
from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

__all__ = ["POOL", "pickle_nested_by_class"]

#: Holds exactly the files of ``trio_infer/protobuf/_proto/``; nothing else adds to it.
POOL = descriptor_pool.DescriptorPool()


def _reduce_by_class(message: Message) -> tuple[type[Message], tuple[()], Any]:
    # The same state protobuf's own __reduce__ uses (the message serialized), but the class is
    # pickled by reference (module and qualified name), which resolves to this very class.
    return type(message), (), message.__getstate__()


def _register_nested(cls: type[Message]) -> None:
    for nested in cls.DESCRIPTOR.nested_types:
        nested_cls: type[Message] = getattr(cls, nested.name)
        copyreg.pickle(nested_cls, _reduce_by_class)
        _register_nested(nested_cls)


def pickle_nested_by_class(file: FileDescriptor, module_globals: Mapping[str, Any]) -> None:
    """Make every nested message class of a generated module pickle by class, not by name.

    Protobuf pickles a nested message as a call that finds its class by full name in the default
    symbol database, where ours are not (or another library's class of that name is). A
    ``copyreg`` reducer takes precedence over ``__reduce__``. Top-level messages already pickle
    by class and are left alone.

    Args:
        file: The generated module's ``DESCRIPTOR``.
        module_globals: The generated module's globals, holding its top-level message classes.
    """
    for name in file.message_types_by_name:
        _register_nested(module_globals[name])
