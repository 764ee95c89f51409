"""`python tests/runtime/kserve_client.py TARGET MODEL KEY TEXT...`: KServe's `InferenceGRPCClient` against a
carpool gRPC port, run in KServe's own virtual environment (`make kserve`; see the Makefile for why), by
tests/runtime/test_grpc_clients.py. Prints one JSON object: the embeddings as the client decodes them
(tensors sent raw, as `set_data_from_numpy` sends them, and in `contents`, as `InferInput(data=...)`
does), readiness, and the status code of each call that must fail. KEY is `-` for none.

Only the kserve package and the standard library here: this file never imports carpool.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


async def main(target: str, model: str, key: str | None, texts: list[str]) -> dict[str, Any]:
    import grpc
    import numpy as np
    from kserve import InferenceGRPCClient, InferInput, InferRequest

    headers = (("authorization", f"Bearer {key}"),) if key else None
    client = InferenceGRPCClient(url=target, timeout=60, retries=0)

    def request(name: str, values: list[str], raw: bool = True) -> InferRequest:
        if raw:
            tensor = InferInput(name="text", shape=[len(values)], datatype="BYTES")
            tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=np.object_))
        else:
            tensor = InferInput(name="text", shape=[len(values)], datatype="BYTES", data=values)
        return InferRequest(model_name=name, infer_inputs=[tensor], request_id="kserve-1")

    async def code_of(call: Any) -> str:
        try:
            await call
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return "OK"

    try:
        raw = await client.infer(request(model, texts), headers=headers)
        typed = await client.infer(request(model, texts, raw=False), headers=headers)
        result: dict[str, Any] = {
            "raw": raw.outputs[0].as_numpy().tolist(),
            "contents": typed.outputs[0].as_numpy().tolist(),
            "id": raw.id,
            "server_ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model, headers=headers),
            "unknown_model": await code_of(client.infer(request("no-such-model", texts), headers=headers)),
            "empty_text": await code_of(client.infer(request(model, ["fine", ""]), headers=headers)),
        }
        if key:
            result["without_key"] = await code_of(client.infer(request(model, texts)))
            result["wrong_key"] = await code_of(
                client.infer(request(model, texts), headers=(("authorization", "Bearer wrong"),))
            )
        return result
    finally:
        await client.close()


if __name__ == "__main__":
    target, model, key, *texts = sys.argv[1:]
    print(json.dumps(asyncio.run(main(target, model, None if key == "-" else key, texts))))
