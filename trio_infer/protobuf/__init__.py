"""The Open Inference Protocol's protobuf messages and their conversion to numpy.

``_proto`` is generated from ``protos/`` (see ``protos/generate.py``); ``codec`` converts tensors
and parameters between messages and numpy, for the server's gRPC front-end and for the client.

May import: protobuf, numpy, ``trio_infer.datatypes``, ``trio_infer.buffers`` and
``trio_infer.errors``.
"""
