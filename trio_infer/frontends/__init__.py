"""Front-ends: each turns what arrives on one entrance into the core's requests and back.

``grpc_service`` serves ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` over the
gRPC transport.

May import: the core, the transport, the protobuf codec and messages. Front-ends never import
one another.
"""
