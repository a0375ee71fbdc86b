import purerpc
import trio_infer.protobuf._proto.health_pb2 as trio_infer_dot_protobuf_dot__proto_dot_health__pb2


class HealthServicer(purerpc.Servicer):
    async def Check(self, input_message):
        raise NotImplementedError()

    async def Watch(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "grpc.health.v1.Health"
        )
        service_obj.add_method(
            "Check",
            self.Check,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckRequest,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckResponse,
            )
        )
        service_obj.add_method(
            "Watch",
            self.Watch,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_STREAM,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckRequest,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckResponse,
            )
        )
        return service_obj


class HealthStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "grpc.health.v1.Health",
            channel
        )
        self.Check = self._client.get_method_stub(
            "Check",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckRequest,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckResponse,
            )
        )
        self.Watch = self._client.get_method_stub(
            "Watch",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_STREAM,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckRequest,
                trio_infer_dot_protobuf_dot__proto_dot_health__pb2.HealthCheckResponse,
            )
        )