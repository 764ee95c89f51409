"""A closed-loop load generator for KServe v2 over gRPC, the counterpart of `loadgen.closed_loop` (HTTP).

Each client has one call in flight; by default each has its own channel (its own HTTP/2 connection: a
local subchannel pool, so channels to one target are not merged), as the HTTP load generator gives each
client its own keep-alive connection. Requests are `ModelInferRequest`s serialized once, as
tritonclient builds them with its defaults (the text in `raw_input_contents`), and sent as bytes with the
answers left undecoded: the load generator's own CPU stays small beside the server's, as the HTTP load
generator's does with its prepared bodies. Results land in a `loadgen.LoadResult`, with each call's
status as the HTTP status its gRPC code stands for (OK 200, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
anything else 500; no answer at all is an error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import numpy as np

from bench.loadgen import Clock, LoadResult, _check_bounds, drive_closed_loop

INFER = "/inference.GRPCInferenceService/ModelInfer"
_STATUS = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503}


def infer_payloads(model: str, texts: Sequence[str]) -> list[bytes]:
    """One serialized ModelInferRequest per text, as `tritonclient.grpc` sends it by default."""
    import tritonclient.grpc as triton

    payloads = []
    for text in texts:
        tensor = triton.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        request = triton.service_pb2.ModelInferRequest(model_name=model)
        request.inputs.append(tensor._get_tensor())
        request.raw_input_contents.append(tensor._get_content())
        payloads.append(request.SerializeToString())
    return payloads


async def closed_loop(
    target: str,
    payloads: Sequence[bytes],
    clients: int,
    duration_s: float | None = None,
    requests: int | None = None,
    drain_timeout_s: float = 30.0,
    clock: Clock = time.perf_counter,
    channels: int | None = None,
) -> LoadResult:
    """`clients` calls in flight, one per client, over `channels` channels (default: one per client; fewer
    share them, as the clients of one `tritonclient.grpc.aio` object share its channel), payloads taken
    in order (cycling); the window as in `loadgen.closed_loop`."""
    _check_bounds(duration_s, requests)
    if clients < 1 or not payloads:
        raise ValueError("need at least one client and one payload")
    opened = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels or clients)
    ]
    calls = [opened[slot % len(opened)].unary_unary(INFER) for slot in range(clients)]
    result = LoadResult(mode="closed", window_s=0.0, clients=clients, connections=len(opened))

    async def exchange(slot: int, index: int) -> tuple[int | None, int, bytes | None]:
        try:
            await calls[slot](payloads[index], timeout=60)
        except grpc.aio.AioRpcError as error:
            return _STATUS.get(error.code(), 500), 1, None
        return 200, 1, None

    try:
        return await drive_closed_loop(
            exchange, len(payloads), clients, result, duration_s, requests, drain_timeout_s, clock
        )
    finally:
        await asyncio.gather(*(channel.close() for channel in opened))
