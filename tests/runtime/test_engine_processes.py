"""Several engine processes behind the fronts (`model.processes`): `carpool serve` with two, each front
spreading its requests over both, every request answered, and a drain that stops every process cleanly.
The null engine (`model.engine zeros`: MiniLM's tokenizer, no model) keeps it quick; the path through the
fronts, the wire and each engine's scheduler is the real one."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from bench.host import process_inputs
from bench.server import HOST, ServerProcess, kernel_names, process_tree, role

pytestmark = pytest.mark.slow


def test_two_engine_processes_share_the_requests_and_drain_cleanly() -> None:
    server = ServerProcess(
        [
            "--model.engine",
            "zeros",
            "--model.processes",
            "2",
            "--server.workers",
            "2",
            "--warmup.enabled",
            "false",
        ]
    )
    server.start()
    try:
        asyncio.run(server.wait_ready(120))
        pids = process_tree(server.pid)
        names = kernel_names(pids)
        engines = [pid for pid in pids if role(pid, names) == "engine"]
        assert len(engines) == 2, server.log_tail()

        def embed(k: int) -> httpx.Response:
            with httpx.Client(base_url=f"http://{HOST}:{server.port}", timeout=30) as http:
                return http.post("/v1/embeddings", json={"input": [f"text number {k}", "and another"]})

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(embed, range(200)))
        assert [a.status_code for a in answers] == [200] * 200
        assert all(len(a.json()["data"]) == 2 for a in answers)
        ran = [process_inputs(pid) for pid in engines]
        assert sum(ran) == 400, ran
        assert min(ran) >= 40, ran  # both took a share (each front balances what it has outstanding)
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
