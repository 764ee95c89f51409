"""The last mile without a cluster: what the operator creates, run for real, end to end.

One BatchedModel (the CPU variant of examples/embedding-hpa.yaml) is rendered by the operator's builders;
two replicas of its pod run as local processes (tests/e2e/pods.py says exactly what is substituted);
a kubelet stand-in runs the rendered probes; Debian's Prometheus scrapes the pods with the job the
chart's PodMonitor stands for and evaluates the chart's rules; the bench load generator drives load.

The tests run in file order and share the replicas: warm-up gating, then queue depth through Prometheus
and the HPA algorithm, then a drain under load (which ends replica 0), then overload on replica 1.
Every wait is a poll with a deadline; the assertions are about behaviour, never about speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench import loadgen
from bench.corpus import corpus
from prometheus_client.parser import text_string_to_metric_families

from carpool.operator.resources import Children
from tests.e2e import monitoring
from tests.e2e.conftest import record
from tests.e2e.pods import (
    PROBE_MARK,
    Kubelet,
    LocalPod,
    PodTemplate,
    ProbeResult,
    cpu_body,
    first_index,
    render,
    wait_until,
)
from tests.e2e.service import Service

pytestmark = pytest.mark.slow

NAMESPACE = "ml"
REPLICAS = 2
CLIENTS_PER_POD = 48
"""Closed-loop clients per pod for "above saturation": three batches' worth (max batch 16), so inputs
keep waiting in the queue, yet fewer than the queue limit (64), so none is refused."""
RULES_INTERVAL = "2s"
TEXTS = corpus(1024, seed=5)


def scrape(pod: LocalPod) -> dict[str, float]:
    """/metrics of a pod as {name or name{labels other than model and protocol}: value}."""
    text = httpx.get(pod.url("/metrics"), timeout=10, trust_env=False).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k not in ("model", "protocol")
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            values[key] = values.get(key, 0.0) + float(sample.value)
    return values


@dataclass
class Cluster:
    children: Children
    template: PodTemplate
    pods: list[LocalPod]
    kubelets: dict[str, Kubelet]
    prometheus: monitoring.Prometheus
    adapter_rule: dict[str, Any]
    gating: dict[str, list[tuple[ProbeResult, dict[str, float]]]] = field(default_factory=dict)
    """Per pod: every readiness probe up to the first success, with /metrics scraped right after it."""

    @property
    def hpa(self) -> dict[str, Any]:
        found = self.children.find("HorizontalPodAutoscaler")
        assert found is not None
        return found

    def alive(self) -> list[LocalPod]:
        return [pod for pod in self.pods if pod.proc is not None and pod.proc.poll() is None]

    def queue_depth(self, pods: list[LocalPod]) -> dict[str, float]:
        """The adapter's answer to the HPA: queue depth per pod, through Prometheus."""
        query = monitoring.adapter_pods_query(self.adapter_rule, NAMESPACE, [p.name for p in pods])
        return {labels["pod"]: value for labels, value in self.prometheus.query(query)}


@pytest.fixture(scope="module")
def cluster(workdir: Path, chart: list[dict[str, Any]], prometheus_binary: str) -> Iterator[Cluster]:
    children = render(cpu_body())
    template = PodTemplate.of(children, NAMESPACE)
    # Pod names as a Deployment's ReplicaSet would give them: <deployment>-<template hash>-<suffix>.
    prefix = f"{template.name}-{children.config_hash[:10]}"
    pods = [LocalPod(template, f"{prefix}-{i}", workdir) for i in range(REPLICAS)]
    adapter_rule = next(
        rule for rule in monitoring.adapter_rules(chart) if rule["name"]["as"] == "carpool_queue_depth"
    )
    pod_monitor = monitoring.one(chart, "PodMonitor")
    config = {
        "global": {"scrape_interval": RULES_INTERVAL, "evaluation_interval": RULES_INTERVAL},
        "scrape_configs": monitoring.scrape_configs(pod_monitor, pods),
    }
    prometheus = monitoring.Prometheus(prometheus_binary, workdir, config, monitoring.rule_groups(chart))
    state = Cluster(children, template, pods, {}, prometheus, adapter_rule)
    try:
        prometheus.start()
        for pod in pods:
            pod.start()
            state.gating[pod.name] = []
            kubelet = Kubelet(pod, on_readiness=_gating_recorder(state, pod))
            state.kubelets[pod.name] = kubelet
            kubelet.start()
        yield state
    finally:
        for kubelet in state.kubelets.values():
            kubelet.stop()
        for pod in pods:
            code = pod.stop(timeout_s=template.termination_grace_s)
            record("pods", **{f"{pod.name} exit code": code})
        prometheus.stop()


def _gating_recorder(state: Cluster, pod: LocalPod) -> Any:
    def on_readiness(result: ProbeResult) -> None:
        seen = state.gating[pod.name]
        if seen and seen[-1][0].ok:
            return  # only up to the first success
        try:
            metrics = scrape(pod)
        except httpx.HTTPError:
            metrics = {}
        seen.append((result, metrics))

    return on_readiness


def test_each_replica_turns_ready_only_after_its_warm_up(cluster: Cluster) -> None:
    startup = cluster.template.probe("startupProbe")
    readiness = cluster.template.probe("readinessProbe")
    # The kubelet's budget: the startup probe's, then one readiness period (capped: the run must end).
    budget = min(startup.budget_s + readiness.period_s, 300.0)

    def all_ready() -> bool:
        for pod in cluster.pods:
            kubelet = cluster.kubelets[pod.name]
            assert pod.proc is not None and pod.proc.poll() is None, f"{pod.name} exited:\n{pod.log_tail()}"
            assert not kubelet.startup_failed, f"{pod.name} failed its startup probe:\n{pod.log_tail()}"
        return all(k.ready_at is not None for k in cluster.kubelets.values())

    wait_until(all_ready, budget, "both replicas ready by their readiness probes", poll_s=0.2)

    for pod in cluster.pods:
        kubelet = cluster.kubelets[pod.name]
        assert kubelet.ready_at is not None and kubelet.started_ok_at is not None
        probes = cluster.gating[pod.name]
        first_ok = next(i for i, (result, _) in enumerate(probes) if result.ok)
        assert all(result.status == 503 for result, _ in probes[:first_ok]), probes
        # Right after the first 200, the pod's own metrics say warm-up ran and finished (the duration is
        # set once, after the last dummy batch) and that it is ready.
        metrics = probes[first_ok][1]
        assert metrics.get("carpool_warmup_batches_total", 0) > 0, metrics
        assert metrics.get("carpool_warmup_seconds", 0) > 0, metrics
        assert metrics.get("carpool_ready") == 1, metrics
        # One log file orders the runtime's lines and the kubelet's mark of the first 200 (O_APPEND).
        lines = pod.messages()
        batches = [i for i, line in enumerate(lines) if line.startswith("warm-up batch")]
        finished = first_index(lines, lambda line: line.startswith("warm-up finished"))
        serving = first_index(lines, lambda line: line.startswith("ready: serving"))
        marked = first_index(lines, lambda line: line.startswith(PROBE_MARK) and "answered 200" in line)
        assert batches and finished is not None and serving is not None and marked is not None, lines
        assert max(batches) < finished < serving < marked, lines
        assert not kubelet.restart_needed
        # The init container (`carpool fetch`) ran to completion before the runtime, which then
        # started offline from what it fetched (the startup budget timed load and warm-up only).
        assert [name for name, _, _ in pod.init_commands] == ["fetch"]
        assert "ready at" in (pod.dir / "init-fetch.log").read_text()
        assert pod.env["HF_HUB_OFFLINE"] == "1"
        record(
            f"replica {pod.name}",
            **{
                "time to ready (s, process start to the readiness probe's first 200)": kubelet.ready_at
                - pod.started_at,
                "warm-up (s, carpool_warmup_seconds)": metrics["carpool_warmup_seconds"],
                "warm-up batches": int(metrics["carpool_warmup_batches_total"]),
                "readiness probes answered 503 before the first 200": first_ok,
                "order in the log": "warm-up batches < warm-up finished < ready: serving < probe 200",
            },
        )


async def _poll(interval_s: float, until: asyncio.Event) -> None:
    """Sleep one poll interval, or less if `until` is set (a poll cadence, not a stand-in for a
    condition)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(until.wait(), interval_s)


async def test_prometheus_reports_queue_depth_and_the_hpa_would_scale(cluster: Cluster) -> None:
    pods = cluster.pods
    names = {pod.name for pod in pods}
    prometheus = cluster.prometheus
    await asyncio.to_thread(
        wait_until, lambda: prometheus.targets_up() == dict.fromkeys(names, True), 30, "both targets up"
    )
    # What the adapter discovers with its seriesQuery: one series per pod, with namespace and pod.
    rule = cluster.adapter_rule
    series = await asyncio.to_thread(prometheus.series, rule["seriesQuery"])
    assert {(s["namespace"], s["pod"]) for s in series} == {(NAMESPACE, name) for name in names}, series
    assert all(re.match(rule["name"]["matches"], s["__name__"]) for s in series)
    assert {s.get("batchedmodel") for s in series} == {cluster.template.name}  # the PodMonitor relabeling

    hpa = cluster.hpa
    decisions: list[monitoring.HpaDecision] = []
    depths: dict[str, list[float]] = {name: [] for name in names}
    load_done = asyncio.Event()

    async def watch() -> None:
        while not load_done.is_set():
            per_pod = await asyncio.to_thread(cluster.queue_depth, pods)
            if set(per_pod) == names:
                for name, value in per_pod.items():
                    depths[name].append(value)
                decisions.append(monitoring.hpa_desired_replicas(hpa, len(pods), per_pod))
            await _poll(1.0, load_done)

    watcher = asyncio.create_task(watch())
    payloads = {p.name: loadgen.embedding_payloads(TEXTS, "127.0.0.1", p.port) for p in pods}
    results = await asyncio.gather(
        *(loadgen.closed_loop("127.0.0.1", p.port, payloads[p.name], CLIENTS_PER_POD, 20.0) for p in pods)
    )
    load_done.set()
    await watcher
    recorded = await asyncio.to_thread(
        prometheus.query, f'carpool:queue_depth:sum{{namespace="{NAMESPACE}"}}'
    )
    for result in results:
        assert result.errors == 0 and set(result.statuses) == {200}, result.summary()
    assert decisions, "Prometheus never reported the queue depth of both pods during the load"
    peak = max(decisions, key=lambda d: d.desired)
    assert peak.desired > len(pods), decisions
    assert all(max(values) > 0 for values in depths.values()), depths
    assert recorded and recorded[0][0]["model"] == cluster.children.spec.model.name

    # After the load: the next scrapes show empty queues and the recommendation falls to minReplicas.
    after: list[monitoring.HpaDecision] = []

    def drained() -> bool:
        per_pod = cluster.queue_depth(pods)
        if set(per_pod) != names or any(per_pod.values()):
            return False
        after.append(monitoring.hpa_desired_replicas(hpa, len(pods), per_pod))
        return True

    await asyncio.to_thread(wait_until, drained, 30, "queue depth 0 on both pods in Prometheus", 0.5)
    minimum = hpa["spec"]["minReplicas"]
    assert after[-1].recommended <= minimum and after[-1].desired == minimum, after
    ready = await asyncio.to_thread(prometheus.query, "carpool:ready_replicas:sum")
    assert [value for _, value in ready] == [float(len(pods))]

    target = hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
    record(
        "autoscaling signal (Prometheus, the adapter's PromQL, the HPA algorithm)",
        **{
            "load": f"closed loop, {CLIENTS_PER_POD} clients per pod for 20 s",
            "saturation throughput (requests/s per pod)": [round(r.requests_per_s, 1) for r in results],
            "queue depth seen per pod (max / median)": {
                name: f"{max(v):.0f} / {statistics.median(v):.0f}" for name, v in sorted(depths.items())
            },
            "HPA target averageValue": target,
            "desired replicas under load (peak; current 2)": f"{peak.desired} (ratio {peak.usage_ratio:.2f}, "
            f"recommendation {peak.recommended}, maxReplicas {hpa['spec']['maxReplicas']})",
            "desired replicas after the load": f"{after[-1].desired} (minReplicas {minimum}; the real HPA "
            "holds the higher count for its scaleDown stabilization window, 300 s)",
        },
    )
    record("requests", **{"load phase: answered 200": sum(r.statuses[200] for r in results)})


async def test_sigterm_under_load_answers_every_accepted_request(cluster: Cluster) -> None:
    leaving, staying = cluster.pods
    template = cluster.template
    grace = template.termination_grace_s
    exit_budget = grace - template.pre_stop_sleep_s  # the kubelet's grace period includes the preStop hook
    service = Service([leaving, staying], TEXTS)
    stop = asyncio.Event()
    load = asyncio.create_task(service.run(CLIENTS_PER_POD, stop))

    def answered(pod: LocalPod) -> int:
        return sum(1 for o in service.answered_by(pod) if o.status == 200)

    deadline = time.monotonic() + 60
    while min(answered(leaving), answered(staying)) < 2 * CLIENTS_PER_POD:
        assert time.monotonic() < deadline and not load.done(), "the load did not get going"
        await asyncio.sleep(0.05)

    # Pod deletion: the endpoint controller takes the pod out of the Service and the kubelet runs the
    # preStop hook (`sleep 5`, whose only purpose is to let that removal propagate; it is not replayed
    # here), then sends SIGTERM. The requests already sent to the pod are still in flight: the engine is
    # paused (SIGSTOP) until the probe below has seen readiness fail and sent a request after the signal,
    # as a slow batch would hold them. Without the pause the drain can end within a probe interval and
    # the late request finds nothing listening (seen once in CI, 2026-11-26).
    engine = leaving.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    service.remove(leaving)
    sigterm_at = time.monotonic()
    leaving.sigterm()
    first_503: float | None = None
    late: httpx.Response | None = None
    try:
        fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per probe, as the kubelet's
        client = httpx.AsyncClient(base_url=leaving.url(), timeout=10, trust_env=False, limits=fresh)
        async with client as probe:
            while leaving.proc is not None and leaving.proc.poll() is None:
                assert time.monotonic() - sigterm_at < exit_budget, "the pod outlived its grace period"
                with contextlib.suppress(httpx.HTTPError):
                    if first_503 is None and (await probe.get("/v2/health/ready")).status_code == 503:
                        first_503 = time.monotonic()
                        late = await probe.post("/v1/embeddings", json={"input": "a request after SIGTERM"})
                        os.kill(engine, signal.SIGCONT)
                await asyncio.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)
    exited_at = time.monotonic()
    exit_code = leaving.wait(5)
    cluster.kubelets[leaving.name].stop()
    # The load goes on, on the remaining pod, until it has answered some more.
    more = answered(staying) + CLIENTS_PER_POD
    deadline = time.monotonic() + 60
    while answered(staying) < more:
        assert time.monotonic() < deadline and not load.done(), "the remaining pod stopped answering"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(load, 120)

    log = leaving.messages()
    assert exit_code == 0, leaving.log_tail()
    assert exited_at - sigterm_at <= exit_budget
    assert first_503 is not None and first_503 < exited_at, "readiness never answered 503 before exit"
    assert late is not None and late.status_code == 503 and int(late.headers["retry-after"]) >= 1
    assert not any("drain timed out" in line for line in log), log
    # each front's own count (the Python fronts', and the native front's where it serves the port)
    inflight = sum(int(line.split()[1]) for line in log if line.startswith("draining:"))

    to_leaving = [o for o in service.outcomes if o.pod == leaving.name]
    lost = [o for o in service.outcomes if o.error is not None and o.error.startswith("lost")]
    assert lost == [], lost
    assert all(o.sent < sigterm_at for o in to_leaving)  # nothing new was routed to it
    assert {o.status for o in to_leaving} <= {200, 503}, {o.status for o in to_leaving}
    finished_after = [o for o in to_leaving if o.status == 200 and o.done > sigterm_at]
    # Every request the runtime held at SIGTERM (its own count) came back 200 after the signal.
    assert inflight > 0 and len(finished_after) >= inflight, (inflight, len(finished_after))
    assert all(o.status == 200 for o in service.outcomes if o.pod == staying.name)
    refused = sum(1 for o in to_leaving if o.status == 503)
    accepted = sum(1 for o in service.outcomes if o.status == 200)
    record(
        "drain under load (SIGTERM to one replica)",
        **{
            "requests in flight at SIGTERM (runtime's log)": inflight,
            "answered 200 after SIGTERM": len(finished_after),
            "refused 503 (reached it after SIGTERM)": refused,
            "readiness 503 after SIGTERM (s)": first_503 - sigterm_at,
            "exit code / seconds after SIGTERM": f"{exit_code} / {exited_at - sigterm_at:.2f} "
            f"(budget {exit_budget:.0f} = grace {grace} - preStop {template.pre_stop_sleep_s:.0f})",
            "lost": len(lost),
        },
    )
    record(
        "requests",
        **{
            "drain phase: accepted / rejected / lost": f"{accepted} / {refused} / {len(lost)}",
        },
    )


async def test_overload_refuses_with_429_and_completes_what_it_accepted(cluster: Cluster) -> None:
    (pod,) = cluster.alive()
    payloads = loadgen.embedding_payloads(TEXTS, "127.0.0.1", pod.port)
    saturation = await loadgen.closed_loop("127.0.0.1", pod.port, payloads, CLIENTS_PER_POD, 8.0)
    assert saturation.errors == 0 and set(saturation.statuses) == {200}, saturation.summary()
    rate = 3 * saturation.requests_per_s
    before = await asyncio.to_thread(scrape, pod)
    baseline_rss = pod.rss_bytes()
    peak_rss = baseline_rss
    done = asyncio.Event()

    async def sample_rss() -> None:
        nonlocal peak_rss
        while not done.is_set():
            peak_rss = max(peak_rss, pod.rss_bytes())
            await _poll(0.2, done)

    samplers = [asyncio.create_task(sample_rss())]
    result = await loadgen.open_loop(
        "127.0.0.1", pod.port, payloads, rate, duration_s=30.0, max_connections=1024, drain_timeout_s=60
    )
    done.set()
    await asyncio.gather(*samplers)
    after = await asyncio.to_thread(scrape, pod)

    def served(status: int) -> int:
        key = f'carpool_requests_total{{status="{status}"}}'
        return round(after.get(key, 0) - before.get(key, 0))

    # Offered at 3x saturation with up to 1024 connections, the 64-input queue fills: the load generator's
    # own answers hold 429s, each with its Retry-After, and every accepted request completed.
    statuses = result.statuses
    assert result.errors == 0, result.summary()  # every request got an answer
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0 and statuses[200] > 0, statuses
    assert result.refused_without_retry_after == 0, result.summary()
    # The server's own count of what it accepted and answered equals what the clients received.
    assert served(200) == statuses[200] and served(429) == statuses[429], (served(200), served(429), statuses)
    limits = cluster.template.container["resources"]["limits"]
    limit = monitoring.quantity(limits["memory"])
    assert peak_rss < limit, f"peak RSS {peak_rss} over the pod's memory limit {limit}"
    assert peak_rss - baseline_rss < limit / 4, (baseline_rss, peak_rss)
    assert not any(k.restart_needed for k in cluster.kubelets.values()), "a liveness probe failed 3 times"
    record(
        "overload (3x saturation, open loop, 30 s)",
        **{
            "saturation (requests/s, closed loop)": saturation.requests_per_s,
            "offered (requests/s)": rate,
            "answered 200 / 429": f"{statuses[200]} / {statuses[429]}",
            "p99 of accepted requests (s)": result.p99,
            "RSS baseline / peak (MiB)": f"{baseline_rss / 2**20:.0f} / {peak_rss / 2**20:.0f} "
            f"(limit {limit / 2**20:.0f})",
            "lost": result.errors,
        },
    )
    counts = f"{statuses[200]} / {statuses[429]} / {result.errors}"
    record("requests", **{"overload phase: accepted / rejected / lost": counts})
