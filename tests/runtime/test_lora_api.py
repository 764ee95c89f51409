"""LoRA adapters over real HTTP, with two fronts on one engine (a tiny random Llama, so it loads in a
second): addressing by `model` and by the v2 path, listing on every front, loading and unloading while
serving through either front, refusals that say why, re-reading an adapter that left host memory,
per-adapter metrics."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from carpool.runtime.api.app import create_app
from carpool.runtime.api.client import EngineClient
from carpool.runtime.api.frontend import Frontend
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.engine.process import build_core, load_engine
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import Addresses, EngineState
from tests.runtime.conftest import Running, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.lora_helpers import tiny_generator, write_tiny_adapter

BASE = "tiny"
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "attn": write_tiny_adapter(folder / "attn", 8, ["q_proj", "v_proj", "o_proj"], seed=1),
        "mlp": write_tiny_adapter(folder / "mlp", 16, ["gate_proj", "up_proj", "down_proj"], seed=2),
        "late": write_tiny_adapter(folder / "late", 8, ["o_proj", "up_proj"], seed=3),
        "wide": write_tiny_adapter(folder / "wide", 32, ["q_proj"], seed=4),
    }


@contextmanager
def serve_fronts(config: RuntimeConfig, fronts: int) -> Iterator[list[Running]]:
    """The engine core and `fronts` HTTP fronts (threads of this process), each on its own port, over
    the real wire: as `server.workers` fronts, without the processes."""
    folder = tempfile.mkdtemp(prefix="carpool-test-")
    addresses = Addresses.in_folder(folder, fronts)
    metrics = RuntimeMetrics(config.served_name())
    core = build_core(config, addresses, load_engine, metrics)
    engine = threading.Thread(target=core.run, name="engine-core", daemon=True)
    engine.start()
    running: list[Running] = []
    threads: list[threading.Thread] = []
    sockets: list[socket.socket] = []
    try:
        for front in range(fronts):
            service = Frontend(config, EngineClient(addresses, front), metrics)
            app = create_app(service)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
            thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
            thread.start()
            threads.append(thread)
            running.append(Running(f"http://127.0.0.1:{sock.getsockname()[1]}", service, core, server, app))
        for each in running:
            wait_for(lambda each=each: each.server.started, what="server start")  # type: ignore[misc]
            wait_for(
                lambda each=each: each.service.state in (EngineState.READY, EngineState.FAILED),  # type: ignore[misc]
                120,
                "model ready",
            )
            assert each.service.state is EngineState.READY, each.service.failure
        yield running
    finally:
        core.request_drain()
        for each in running:
            each.client.close()
            each.server.should_exit = True
        for thread in threads:
            thread.join(timeout=30)
        engine.join(timeout=30)
        for sock in sockets:
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def fronts(adapters: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Running]]:
    model = tiny_generator(tmp_path_factory.mktemp("tiny-model") / "model")
    config = runtime_config(
        model={"source": str(model), "task": "generate", "name": BASE, "dtype": "float32"},
        generation={"max_running_sequences": 8, "max_step_tokens": 128, "kv_cache_tokens": 2048},
        lora={
            "adapters": {"attn": adapters["attn"], "mlp": adapters["mlp"]},
            "max_loras": 2,
            "max_cpu_loras": 2,
            "max_rank": 16,
            "runtime_updates": True,
        },
        batching={"default_timeout_s": 600},  # a busy CI machine must not turn slow steps into 504s
        warmup={"enabled": False},
    )
    with serve_fronts(config, 2) as running:
        yield running


def complete(front: Running, model: str, max_tokens: int = 8) -> httpx.Response:
    return front.client.post(
        "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    )


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def listed(front: Running) -> dict[str, Any]:
    return {m["id"]: m.get("parent") for m in front.client.get("/v1/models").json()["data"]}


def load(front: Running, name: str, path: str) -> httpx.Response:
    return front.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_models_lists_the_adapters_with_their_parent_and_requests_address_them(
    fronts: list[Running],
) -> None:
    first, second = fronts
    assert listed(first) == listed(second) == {BASE: None, "attn": BASE, "mlp": BASE}
    texts = {}
    for model in (BASE, "attn", "mlp"):
        response = complete(second, model)
        assert response.json()["model"] == model
        texts[model] = text(response)
        assert text(complete(first, model)) == texts[model]
    assert len(set(texts.values())) == 3  # each adapter answers differently from the base
    missing = complete(first, "nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert "'nope'" in missing.json()["error"]["message"] and "'attn'" in missing.json()["error"]["message"]
    v2 = second.client.post(
        "/v2/models/attn/infer",
        json={
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
            "parameters": {"max_tokens": 8, "temperature": 0},
        },
    )
    assert v2.status_code == 200, v2.text
    assert v2.json()["model_name"] == "attn" and v2.json()["outputs"][0]["data"] == [texts["attn"]]
    assert second.client.get("/v2/models/attn").json()["parameters"]["parent"] == BASE
    assert second.client.get("/v2/models/attn/ready").status_code == 200
    assert second.client.get("/v2/models/nope/ready").status_code == 404
    assert first.metric("carpool_lora_requests_total", model=BASE, adapter="attn") >= 3
    assert first.metric("carpool_lora_generated_tokens_total", model=BASE, adapter="mlp") >= 16
    assert first.metric("carpool_lora_adapters_loaded", model=BASE) == 2


def lora_info(front: Running) -> list[dict[str, str]]:
    """The labels of every `vllm:lora_requests_info` series, latest (largest value) first."""
    text = front.client.get("/metrics").text
    found = [
        (sample.value, sample.labels)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:lora_requests_info"
    ]
    return [labels for _, labels in sorted(found, key=lambda item: -item[0])]


def test_the_endpoint_pickers_lora_series_names_the_adapters_running_and_the_slots(
    fronts: list[Running],
) -> None:
    """vLLM's `vllm:lora_requests_info` from carpool's own engine: what the Gateway API Inference
    Extension's endpoint picker reads for LoRA affinity (the series with the largest value: a time)."""
    first, second = fronts
    body = {"model": "mlp", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    with second.client.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        wait_for(
            lambda: any(s["running_lora_adapters"] == "mlp" for s in lora_info(first)),
            what="a series naming the running adapter",
        )
        answer.read()
    assert {s["max_lora"] for s in lora_info(first)} == {"2"}  # lora.max_loras
    latest = lora_info(first)[0]
    assert latest["running_lora_adapters"] == latest["waiting_lora_adapters"] == ""  # all done


def test_bad_adapters_get_400_saying_why_and_change_nothing(
    fronts: list[Running], adapters: dict[str, str], tmp_path: Path
) -> None:
    front = fronts[0]
    before = text(complete(front, "attn"))
    (tmp_path / "empty").mkdir()
    config = json.loads(Path(adapters["late"], "adapter_config.json").read_text())
    dora = tmp_path / "dora"
    shutil.copytree(adapters["late"], dora)
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    other = tmp_path / "other"
    write_tiny_adapter(other, 8, ["q_proj"], seed=5)
    weights = (other / "adapter_model.safetensors").read_bytes()
    (other / "adapter_model.safetensors").write_bytes(weights.replace(b"q_proj", b"x_proj"))
    cases = {
        adapters["wide"]: "rank 32 on model.layers.0.self_attn.q_proj, over this server's limit of 16",
        str(tmp_path / "empty"): "no adapter_config.json",
        str(tmp_path / "missing"): "neither an existing folder",
        str(dora): "DoRA",
        str(other): "x_proj, which is not a linear layer of this base model",
    }
    for path, reason in cases.items():
        response = load(front, "bad", path)
        assert response.status_code == 400, response.text
        assert reason in response.json()["error"]["message"]
    taken = load(front, "attn", adapters["late"])
    assert taken.status_code == 400 and "already loaded" in taken.text
    assert load(front, BASE, adapters["late"]).status_code == 400
    spaced = load(front, "two words", adapters["late"])
    assert spaced.status_code == 400 and "without spaces" in spaced.text
    assert listed(front) == {BASE: None, "attn": BASE, "mlp": BASE}
    assert text(complete(front, "attn")) == before


def test_load_and_unload_while_serving_through_either_front(
    fronts: list[Running], adapters: dict[str, str]
) -> None:
    """A third adapter loads through front 0 while requests of the others run (two slots: it swaps in)
    and is served at once through front 1; unloading it while its request runs lets that request
    finish; then its name is unknown on both fronts. With two adapters in host memory at most, the
    adapter it pushed out is read again when next asked for, and answers as before."""
    first, second = fronts
    base_text = text(complete(first, BASE, 64))
    attn_text = text(complete(first, "attn", 64))
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(complete, first, m, 64) for m in ("attn", "mlp", BASE)]
        loaded = load(first, "late", adapters["late"])
        assert loaded.status_code == 200, loaded.text
        assert listed(first)["late"] == BASE
        late = pool.submit(complete, second, "late", 64)
        wait_for(
            lambda: first.metric("carpool_lora_requests_total", model=BASE, adapter="late") == 1,
            what="late queued",
        )
        unloaded = second.client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert unloaded.status_code == 200, unloaded.text
        assert late.result().status_code == 200, late.result().text  # admitted before the unload: it ends
        assert [text(f.result()) for f in busy][::2] == [attn_text, base_text]
    for front in fronts:
        assert complete(front, "late").status_code == 404
        assert "late" not in listed(front)
    again = first.client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404
    assert text(complete(second, "attn", 64)) == attn_text  # read again from its folder if it had left


def test_run_time_loading_is_refused_with_403_unless_the_server_allows_it(
    adapters: dict[str, str], tmp_path: Path
) -> None:
    """Off by default: no caller can make the server read a path, or unload an adapter others use."""
    model = tiny_generator(tmp_path / "model")
    config = runtime_config(
        model={"source": str(model), "task": "generate", "name": BASE, "dtype": "float32"},
        lora={"adapters": {"attn": adapters["attn"]}},
        warmup={"enabled": False},
    )
    with serve(config, load_engine) as front:
        refusals = [
            load(front, "late", adapters["late"]),
            front.client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}),
        ]
        for refused in refusals:
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert "lora.runtime_updates" in error["message"] and error["type"] == "permission_error"
        assert listed(front) == {BASE: None, "attn": BASE}
        assert complete(front, "attn").status_code == 200
        paths = front.client.get("/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
