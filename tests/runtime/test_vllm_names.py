"""vLLM's metric names from carpool's own engines (`vllm_metrics`): the series the Gateway API Inference
Extension's endpoint picker reads from a model server (`vllm:num_requests_waiting`, the KV-cache use,
`vllm:lora_requests_info`, `vllm:cache_config_info`), with vLLM's labels, read from /metrics while a
scripted engine holds a step so the queue and the running batch are known. vLLM's own engine exports
vLLM's series itself (tests/vllm/test_metrics.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from carpool.runtime.vllm_metrics import CACHE_CONFIG_LABELS, VllmNames
from tests.runtime.conftest import ANSWER_S, Running, serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, factory

EPP_NAMES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def samples(text: str) -> dict[str, list[Sample]]:
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def scrape(running: Running) -> dict[str, list[Sample]]:
    return samples(running.client.get("/metrics").text)


def one(found: dict[str, list[Sample]], name: str) -> Sample:
    assert name in found, f"{name} is not exported"
    (sample,) = found[name]
    return sample


@pytest.fixture
def generator() -> Iterator[tuple[Running, ScriptedGenerator]]:
    engine = ScriptedGenerator(num_blocks=64, block_size=8)
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        generation={"max_running_sequences": 1},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine)) as running:
        yield running, engine
        engine.gate.set()


def test_carpools_generation_engine_exports_the_epps_names_with_vllms_labels(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    server, engine = generator
    engine.gate.clear()  # the first step holds: one sequence runs, the next two wait
    body = {"prompt": "hello there", "max_tokens": 2}
    with ThreadPoolExecutor(3) as pool:
        try:
            answers = [pool.submit(server.client.post, "/v1/completions", json=body, timeout=ANSWER_S)]
            wait_for(lambda: server.metric("vllm:num_requests_running") == 1, what="one sequence running")
            answers += [
                pool.submit(server.client.post, "/v1/completions", json=body, timeout=ANSWER_S)
                for _ in range(2)
            ]
            wait_for(lambda: server.metric("vllm:num_requests_waiting") == 2, what="two sequences waiting")
            found = scrape(server)
        finally:
            engine.gate.set()
        assert all(a.result().status_code == 200 for a in answers)
    for name in EPP_NAMES:
        assert one(found, name).labels == {"model_name": "fake", "engine": "0"}, name
    assert one(found, "vllm:num_requests_running").value == 1
    usage = one(found, "carpool_kv_cache_usage_ratio").value
    assert usage > 0  # the running sequence holds blocks
    assert one(found, "vllm:kv_cache_usage_perc").value == usage
    assert one(found, "vllm:gpu_cache_usage_perc").value == usage
    info = one(found, "vllm:cache_config_info")
    assert info.value == 1 and set(info.labels) == set(CACHE_CONFIG_LABELS)
    assert info.labels["block_size"] == "8" and info.labels["num_gpu_blocks"] == "64"
    assert info.labels["engine"] == "0"
    assert "vllm:lora_requests_info" not in found  # as vLLM: only with LoRA adapters on
    wait_for(lambda: server.metric("vllm:num_requests_running") == 0, what="the batch emptied")
    assert server.metric("vllm:num_requests_waiting") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0


def test_carpools_encoders_export_their_queue_and_running_inputs_and_no_kv_cache() -> None:
    engine = ScriptedEngine()
    config = runtime_config(
        model={"name": "fake", "task": "embed"}, batching={"max_batch_size": 2}, warmup={"enabled": False}
    )
    with serve(config, factory(engine)) as server, ThreadPoolExecutor(4) as pool:
        engine.gate.clear()
        try:
            post = server.client.post
            first = pool.submit(post, "/v1/embeddings", json={"input": ["a", "b"]}, timeout=ANSWER_S)
            assert engine.entered.acquire(timeout=10)
            wait_for(lambda: server.metric("vllm:num_requests_running") == 2, what="a batch of two running")
            second = pool.submit(post, "/v1/embeddings", json={"input": ["c", "d", "e"]}, timeout=ANSWER_S)
            wait_for(lambda: server.metric("vllm:num_requests_waiting") == 3, what="three inputs waiting")
            found = scrape(server)
        finally:
            engine.gate.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
        wait_for(lambda: server.metric("vllm:num_requests_running") == 0, what="no batch running")
    for name in EPP_NAMES:
        assert one(found, name).labels == {"model_name": "fake", "engine": "0"}, name
    assert one(found, "vllm:kv_cache_usage_perc").value == 0
    assert one(found, "vllm:gpu_cache_usage_perc").value == 0
    assert "vllm:cache_config_info" not in found  # no KV cache to describe


def test_lora_info_is_one_series_per_set_of_adapters_stamped_with_the_time_of_its_last_update() -> None:
    registry = CollectorRegistry()
    names = VllmNames("m", registry)
    names.lora(["a"], [])  # before enable_lora: nothing (vLLM: no LoRA config, no series)
    assert "vllm:lora_requests_info" not in samples(generate_latest(registry).decode())
    names.enable_lora(4)
    names.lora(["b", "a", None, "a"], ["c"])
    names.lora([], [])
    found = samples(generate_latest(registry).decode())["vllm:lora_requests_info"]
    series = {(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s for s in found}
    assert set(series) == {("a,b", "c"), ("", "")}
    assert all(s.labels["max_lora"] == "4" for s in found)
    # The EPP takes the series with the largest value (the latest) among those naming an adapter.
    assert series["", ""].value >= series["a,b", "c"].value > 0


WRITE = """
import sys
from carpool.runtime.metrics import RuntimeMetrics
RuntimeMetrics("m").vllm_names().publish(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
"""


def test_several_engine_processes_make_one_series_per_pod(tmp_path: Path) -> None:
    """`model.processes`: the EPP reads one series per name; waiting and running add up over the
    engine processes, the KV-cache use is the largest."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for waiting, running, usage in ((3, 1, 0.5), (4, 2, 0.2)):
        args = [str(waiting), str(running), str(usage)]
        subprocess.run([sys.executable, "-c", WRITE, *args], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    found = samples(generate_latest(registry).decode())
    assert one(found, "vllm:num_requests_waiting").value == 7
    assert one(found, "vllm:num_requests_running").value == 3
    assert one(found, "vllm:kv_cache_usage_perc").value == 0.5
    assert one(found, "vllm:gpu_cache_usage_perc").value == 0.5


def test_the_scrape_parses_as_the_epps_text_parser_requires_one_type_line_per_family(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    """The EPP parses the whole scrape with Prometheus' text parser: a family declared twice (the same
    name from two registries) fails every metric of the pod."""
    server, _ = generator
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(set(declared)), sorted(n for n in declared if declared.count(n) > 1)
    assert {"vllm:num_requests_waiting", "vllm:cache_config_info"} <= set(declared)
