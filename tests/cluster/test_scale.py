"""100 BatchedModels on the real API server: they all converge (every model Ready, its pod running on
a hollow node), and the operator's peak memory stays within the chart's memory limit (what the kubelet
would OOM-kill it at). No timing is asserted: bench/operator/scale.py measures how long it takes, the
requests it costs and a pod-status storm (bench/RESULTS.md)."""

from __future__ import annotations

import sys
import time

from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.firstmonth import Pool, pool
from tests.cluster.scale import (
    BIG_NODE,
    apply_all,
    chart_memory_limit_bytes,
    cheap_model,
    peak_rss_bytes,
    ready_count,
)

__all__ = ["pool"]

MODELS = 100


def test_100_models_converge_within_the_chart_s_memory_limit(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, pool: Pool
) -> None:
    pool.add(1, BIG_NODE, sync_s=2.0)
    started = time.monotonic()
    apply_all(admin_env, [cheap_model(f"m{i:03d}", namespace, pool.name) for i in range(MODELS)])
    try:
        wait_for(
            f"{MODELS} models Ready",
            lambda: ready_count(api, namespace) == MODELS or None,
            timeout=900,
            every=2.0,
        )
        peak, limit = peak_rss_bytes(operator.process.popen.pid), chart_memory_limit_bytes()
        sys.stderr.write(
            f"\n{MODELS} models converged in {time.monotonic() - started:.0f} s; operator peak RSS "
            f"{peak / 2**20:.0f} MiB of the chart's {limit / 2**20:.0f} MiB limit\n"
        )
        assert peak < limit, f"operator peak RSS {peak / 2**20:.0f} MiB over the chart's limit"
        assert not pool.errors(), pool.errors()
    finally:
        # Delete them while the hollow node still runs (it removes the deleted pods), so the garbage
        # collection of 100 models does not run on into the next tests.
        api.delete("Namespace", None, namespace)
        wait_for(
            "the namespace gone",
            lambda: api.get("Namespace", None, namespace) is None,
            timeout=300,
            every=2.0,
        )
