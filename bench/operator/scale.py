"""The operator at scale: N BatchedModels on a real kube-apiserver (tests/cluster/controlplane.py), the
chart installed with helm, the operator as a local process with the chart's flags and ServiceAccount,
and one hollow node (tests/cluster/hollownode.py) that marks the models' pods running.

Measured, in one run:
- converge: seconds from one `kubectl apply` of N models to all N Ready (each pod ready, status written);
- the operator's API requests while converging, per reconcile and per model, from the API server's audit
  log (this control plane records reads as well as writes for the chart's ServiceAccounts);
- at rest: its requests per minute once nothing changes;
- a pod-status storm: every pod's container restarts at once (not ready, then ready again): requests,
  reconciles and seconds until every model is Ready again;
- its peak resident memory (VmHWM), against the chart's memory limit.

    .venv/bin/python -m bench.operator.scale --models 100 [--out scale.json]

Needs `make cluster-bin` (the control plane's binaries). Prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator, install_release, start_operator
from tests.cluster.controlplane import ControlPlane, audit_reads_of
from tests.cluster.hollownode import HollowNode
from tests.cluster.scale import (
    BIG_NODE,
    apply_all,
    chart_memory_limit_bytes,
    chart_operator_resources,
    cheap_model,
    count_requests,
    cpu_seconds,
    peak_rss_bytes,
    ready_count,
    rss_bytes,
)

NAMESPACE = "bench"
POOL = "bench"
QUIET_S = 5.0
"""The operator counts as settled once no reconcile has started for this long."""


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _reconciles(operator: Operator) -> float:
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_operator_reconciles_total"
    )


def _settle(api: Api, operator: Operator, models: int, timeout: float) -> float:
    """Wait until every model is Ready and no reconcile started for QUIET_S; returns when all were Ready."""
    wait_for(
        f"{models} models Ready", lambda: ready_count(api, NAMESPACE) == models, timeout=timeout, every=1.0
    )
    ready_at = time.monotonic()
    last, since = _reconciles(operator), time.monotonic()
    while time.monotonic() - since < QUIET_S:
        time.sleep(0.5)
        now = _reconciles(operator)
        if now != last:
            last, since = now, time.monotonic()
    return ready_at


def measure(models: int, rest_s: float, folder: Path) -> dict[str, Any]:
    plane = ControlPlane(
        folder / "control-plane",
        audit_policy=audit_reads_of(groups=["system:serviceaccounts:carpool-system"]),
    )
    plane.start()
    api = Api(plane.server, plane.ssl_context())
    node: HollowNode | None = None
    operator: Operator | None = None
    try:
        env = plane.env()
        release = install_release(plane, api, env)
        operator = start_operator(plane, release, release.operator_args, "operator")
        pid = operator.process.popen.pid
        node = HollowNode(api, "hollow-0", POOL, BIG_NODE, sync_s=2.0).start()
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        wait_for("the default ServiceAccount", lambda: api.get("ServiceAccount", NAMESPACE, "default"))
        idle_rss = rss_bytes(pid)

        bodies = [cheap_model(f"m{i:03d}", NAMESPACE, POOL) for i in range(models)]
        reconciles_before = _reconciles(operator)
        since, started, cpu_before = _stamp(), time.monotonic(), cpu_seconds(pid)
        apply_all(env, bodies)
        ready_at = _settle(api, operator, models, timeout=900)
        converge_s = ready_at - started
        until = _stamp()
        converge_reconciles = _reconciles(operator) - reconciles_before
        converge_cpu = cpu_seconds(pid) - cpu_before
        converging = count_requests(plane.audit_events(), operator.user, since, until)

        rest_from, rest_cpu = _stamp(), cpu_seconds(pid)
        time.sleep(rest_s)
        rest_cpu = cpu_seconds(pid) - rest_cpu
        rest = count_requests(plane.audit_events(), operator.user, rest_from, _stamp())

        storm_reconciles_before = _reconciles(operator)
        storm_from, storm_started, storm_cpu = _stamp(), time.monotonic(), cpu_seconds(pid)
        restarted = node.restart_all()
        storm_ready_at = _settle(api, operator, models, timeout=900)
        storm_s = storm_ready_at - storm_started
        storm = count_requests(plane.audit_events(), operator.user, storm_from, _stamp())
        storm_reconciles = _reconciles(operator) - storm_reconciles_before
        storm_cpu = cpu_seconds(pid) - storm_cpu

        return {
            "models": models,
            "converge_s": round(converge_s, 1),
            "converge_reconciles": int(converge_reconciles),
            "converge_cpu_s": round(converge_cpu, 1),
            "converge_requests": converging.total,
            "converge_by_verb": converging.by_verb,
            "converge_by_resource": converging.by_resource,
            "requests_per_reconcile": round(converging.total / max(1, converge_reconciles), 2),
            "rest_s": rest_s,
            "rest_requests_per_minute": round(rest.total * 60 / rest_s, 1),
            "rest_by_verb": rest.by_verb,
            "rest_cpu_s": round(rest_cpu, 2),
            "storm_pods": restarted,
            "storm_s": round(storm_s, 1),
            "storm_reconciles": int(storm_reconciles),
            "storm_requests": storm.total,
            "storm_by_verb": storm.by_verb,
            "storm_cpu_s": round(storm_cpu, 1),
            "idle_rss_mib": round(idle_rss / 2**20, 1),
            "peak_rss_mib": round(peak_rss_bytes(pid) / 2**20, 1),
            "chart_resources": chart_operator_resources(),
            "chart_memory_limit_mib": round(chart_memory_limit_bytes() / 2**20, 1),
            "load_average": os.getloadavg(),
            "node_errors": node.errors[:5],
        }
    finally:
        if operator is not None:
            operator.stop()
        if node is not None:
            node.lose()
        api.close()
        plane.stop()


def markdown(result: dict[str, Any]) -> str:
    rows = [
        ("models", result["models"]),
        ("converge: apply to all Ready", f"{result['converge_s']} s"),
        ("reconciles while converging", result["converge_reconciles"]),
        ("API requests while converging", f"{result['converge_requests']} ({result['converge_by_verb']})"),
        ("API requests per reconcile", result["requests_per_reconcile"]),
        ("API requests per model", round(result["converge_requests"] / result["models"], 1)),
        ("operator CPU while converging", f"{result['converge_cpu_s']} s"),
        (
            "at rest: API requests per minute",
            f"{result['rest_requests_per_minute']} ({result['rest_by_verb']})",
        ),
        ("pod-status storm: pods restarted", result["storm_pods"]),
        ("storm: seconds until all Ready again", result["storm_s"]),
        ("storm: reconciles", result["storm_reconciles"]),
        ("storm: API requests", f"{result['storm_requests']} ({result['storm_by_verb']})"),
        ("storm: operator CPU", f"{result['storm_cpu_s']} s"),
        ("at rest: operator CPU", f"{result['rest_cpu_s']} s in {result['rest_s']:g} s"),
        ("operator RSS idle / peak", f"{result['idle_rss_mib']} / {result['peak_rss_mib']} MiB"),
        ("chart memory limit", f"{result['chart_memory_limit_mib']} MiB"),
        ("load average (1, 5, 15 min) at the end", result["load_average"]),
    ]
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--rest-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as folder:
        result = measure(args.models, args.rest_seconds, Path(folder))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text + "\n\n" + markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
