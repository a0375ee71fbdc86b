"""The Open Inference Protocol's REST messages and their conversion to numpy.

``codec`` turns a ``POST /v2/models/{name}/infer`` body (a JSON object, optionally followed by
binary tensor data as Triton's binary tensor data extension lays it out) into numpy arrays and
parameters, and a model's outputs back into the buffers of a response body. It is pure
conversion: bytes in, values out, and the other way; the HTTP server and front-end do the I/O.

May import: orjson, numpy, ``trio_infer.datatypes``, ``trio_infer.buffers`` and
``trio_infer.errors``. Never trio, the transport, protobuf, the core,
scheduling or the workers: a REST body converts the same whoever serves it.
"""
