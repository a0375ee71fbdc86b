import purerpc
import trio_infer.protobuf._proto.grpc_predict_v2_pb2 as trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2
import trio_infer.protobuf._proto.model_config_pb2 as trio_infer_dot_protobuf_dot__proto_dot_model_config__pb2


class GRPCInferenceServiceServicer(purerpc.Servicer):
    async def ServerLive(self, input_message):
        raise NotImplementedError()

    async def ServerReady(self, input_message):
        raise NotImplementedError()

    async def ModelReady(self, input_message):
        raise NotImplementedError()

    async def ServerMetadata(self, input_message):
        raise NotImplementedError()

    async def ModelMetadata(self, input_message):
        raise NotImplementedError()

    async def ModelInfer(self, input_message):
        raise NotImplementedError()

    async def ModelStreamInfer(self, input_messages):
        raise NotImplementedError()

    async def ModelConfig(self, input_message):
        raise NotImplementedError()

    async def ModelStatistics(self, input_message):
        raise NotImplementedError()

    async def RepositoryIndex(self, input_message):
        raise NotImplementedError()

    async def RepositoryModelLoad(self, input_message):
        raise NotImplementedError()

    async def RepositoryModelUnload(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "inference.GRPCInferenceService"
        )
        service_obj.add_method(
            "ServerLive",
            self.ServerLive,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerLiveRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerLiveResponse,
            )
        )
        service_obj.add_method(
            "ServerReady",
            self.ServerReady,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerReadyRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerReadyResponse,
            )
        )
        service_obj.add_method(
            "ModelReady",
            self.ModelReady,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelReadyRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelReadyResponse,
            )
        )
        service_obj.add_method(
            "ServerMetadata",
            self.ServerMetadata,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerMetadataRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerMetadataResponse,
            )
        )
        service_obj.add_method(
            "ModelMetadata",
            self.ModelMetadata,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelMetadataRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelMetadataResponse,
            )
        )
        service_obj.add_method(
            "ModelInfer",
            self.ModelInfer,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferResponse,
            )
        )
        service_obj.add_method(
            "ModelStreamInfer",
            self.ModelStreamInfer,
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStreamInferResponse,
            )
        )
        service_obj.add_method(
            "ModelConfig",
            self.ModelConfig,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelConfigRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelConfigResponse,
            )
        )
        service_obj.add_method(
            "ModelStatistics",
            self.ModelStatistics,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStatisticsRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStatisticsResponse,
            )
        )
        service_obj.add_method(
            "RepositoryIndex",
            self.RepositoryIndex,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryIndexRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryIndexResponse,
            )
        )
        service_obj.add_method(
            "RepositoryModelLoad",
            self.RepositoryModelLoad,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelLoadRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelLoadResponse,
            )
        )
        service_obj.add_method(
            "RepositoryModelUnload",
            self.RepositoryModelUnload,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelUnloadRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelUnloadResponse,
            )
        )
        return service_obj


class GRPCInferenceServiceStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "inference.GRPCInferenceService",
            channel
        )
        self.ServerLive = self._client.get_method_stub(
            "ServerLive",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerLiveRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerLiveResponse,
            )
        )
        self.ServerReady = self._client.get_method_stub(
            "ServerReady",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerReadyRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerReadyResponse,
            )
        )
        self.ModelReady = self._client.get_method_stub(
            "ModelReady",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelReadyRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelReadyResponse,
            )
        )
        self.ServerMetadata = self._client.get_method_stub(
            "ServerMetadata",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerMetadataRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ServerMetadataResponse,
            )
        )
        self.ModelMetadata = self._client.get_method_stub(
            "ModelMetadata",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelMetadataRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelMetadataResponse,
            )
        )
        self.ModelInfer = self._client.get_method_stub(
            "ModelInfer",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferResponse,
            )
        )
        self.ModelStreamInfer = self._client.get_method_stub(
            "ModelStreamInfer",
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelInferRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStreamInferResponse,
            )
        )
        self.ModelConfig = self._client.get_method_stub(
            "ModelConfig",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelConfigRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelConfigResponse,
            )
        )
        self.ModelStatistics = self._client.get_method_stub(
            "ModelStatistics",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStatisticsRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.ModelStatisticsResponse,
            )
        )
        self.RepositoryIndex = self._client.get_method_stub(
            "RepositoryIndex",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryIndexRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryIndexResponse,
            )
        )
        self.RepositoryModelLoad = self._client.get_method_stub(
            "RepositoryModelLoad",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelLoadRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelLoadResponse,
            )
        )
        self.RepositoryModelUnload = self._client.get_method_stub(
            "RepositoryModelUnload",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelUnloadRequest,
                trio_infer_dot_protobuf_dot__proto_dot_grpc_predict_v2__pb2.RepositoryModelUnloadResponse,
            )
        )