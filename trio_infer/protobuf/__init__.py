"""The Open Inference Protocol's protobuf messages and their conversion to numpy.

``_proto`` is generated from ``protos/`` (see ``protos/generate.py``); ``codec`` converts tensors
and parameters between messages and numpy, for the server's gRPC front-end and for the client;
``wire`` is the view of a request whose typed tensor contents numpy decodes from their bytes;
``field_count`` counts a message's fields from its bytes, before it is parsed;
``triton_types`` names the datatypes as Triton's model configuration does (``TYPE_FP32``);
``triton_json`` writes a message as Triton's HTTP endpoint does (64-bit integers as numbers).
The generated messages are registered in ``_pool``'s private descriptor pool rather than
protobuf's default one, so that tritonclient, MLServer or grpcio-health-checking, which register
the same full names there, can be imported into the same process in either order.

May import: protobuf, numpy, ``trio_infer.datatypes``, ``trio_infer.buffers`` and
``trio_infer.errors``.
"""
