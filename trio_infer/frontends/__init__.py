"""Front-ends: each turns what arrives on one entrance into the core's requests and back.

``grpc_service`` serves ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` over the
gRPC transport; ``http_service`` the Open Inference Protocol's REST endpoints over the HTTP
transport (and the REST codec, :mod:`trio_infer.rest`). ``triton_messages`` builds Triton's
ModelConfig and ModelStatistics answers for both: gRPC sends them, REST writes them as JSON.

May import: the core (its types re-export what a front-end needs of admission and the settings),
the transport, the protobuf codec and messages. Never scheduling, the workers or the repository
directly: everything a request does goes through the core. Front-ends never import one
another; both import ``triton_messages``, a module of messages, not a front-end.
"""
