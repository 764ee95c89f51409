"""KServe v2 over gRPC: the `inference.GRPCInferenceService` of KServe's `grpc_predict_v2.proto`, which
Triton's `tritonclient.grpc` and KServe's `InferenceGRPCClient` call, and `grpc.health.v1.Health`.

- `grpc_predict_v2.proto`: the protocol, KServe's file (license header kept); `grpc_predict_v2_pb2*.py`
  are generated from it by `generate` (`python -m carpool.runtime.api.grpc.generate`), never edited,
  and kept out of ruff and mypy.
- `tensors`: requests and responses to and from `api.v2_infer`'s terms (pure).
- `status`: domain errors as gRPC status codes.
- `service`: the servicer, on the front's `Frontend` (the HTTP routes' engine client, admission and
  batches).
- `security`: API keys (metadata `authorization: Bearer`) and TLS, with the HTTP port's files.
- `server`: the front's `grpc.aio` server on `server.grpc_port`, health included.
"""
