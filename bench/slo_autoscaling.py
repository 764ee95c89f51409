"""Autoscaling to a latency target against queue-depth targets, on a step and a ramp trace: a simulation.

What is real: each pod's scheduler (`batching.scheduler`, the dynamic batcher carpool runs) and its
saturation estimator (`batching.saturation`, the signal a latency target scales on), both driven with
simulated time. What is modelled: the device (a batch takes `fixed + per_token x tokens`), arrivals
(Poisson at the trace's rate, each to a random ready pod, as kube-proxy spreads connections), a pod's
start (it counts as a replica, reports 0 and takes no traffic for `startup_s`), and the HPA controller's
algorithm for one Pods metric (kubernetes pkg/controller/podautoscaler: every `sync_s`, `ceil(sum of the
pods' values / target)` outside a 10% tolerance, clamped, scale-up limited per policy period, scale-down
held at the highest recommendation of the stabilization window). The same behaviour for every policy.

This is not the proof the issue asks for (the real HPA controller, prometheus-adapter and Prometheus in
the cluster tier); it is the cheap, repeatable comparison that says what to expect of it, and the tool to
choose the queue-depth targets worth running there.

    python -m bench.slo_autoscaling            # both traces, the latency target and a sweep of queue depths
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.runtime.batching.former import FormationPolicy
from carpool.runtime.batching.queue import RequestQueue
from carpool.runtime.batching.request import WorkItem
from carpool.runtime.batching.saturation import BatchLimits, Objective, SaturationEstimator
from carpool.runtime.batching.scheduler import Scheduler

SATURATION_TARGET = 0.9
"""The operator's HPA target for `carpool_slo_saturation` (`resources.autoscaling`; the bench imports no
operator code)."""


@dataclass(frozen=True)
class Setup:
    fixed_s: float = 0.050
    per_token_s: float = 400e-6
    tokens: int = 100
    """A small encoder on one CPU core: 50 ms a batch plus 40 ms per input of 100 tokens."""
    max_batch_size: int = 32
    objective: Objective = field(default_factory=lambda: Objective(2.0, 0.9))
    startup_s: float = 30.0
    sync_s: float = 15.0
    min_replicas: int = 1
    max_replicas: int = 12
    scale_down_window_s: float = 120.0
    tolerance: float = 0.1


@dataclass
class Pod:
    scheduler: Scheduler
    estimator: SaturationEstimator
    ready_at: float
    leaving: bool = False
    running: list[WorkItem] | None = None
    gone_at: float | None = None


@dataclass
class Outcome:
    policy: str
    requests: int = 0
    met: int = 0
    replica_seconds: float = 0.0
    peak: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 0.0


def new_pod(setup: Setup, now: float, warm: bool, late_after_s: float | None = None) -> Pod:
    scheduler = Scheduler(
        FormationPolicy(max_batch_size=setup.max_batch_size, max_batch_tokens=1 << 20, window_s=0.0),
        RequestQueue(1_000_000, 1, late_after_s),
    )
    estimator = SaturationEstimator(
        setup.objective, BatchLimits(setup.max_batch_size, 1 << 20), lead_s=setup.startup_s + setup.sync_s
    )
    for size in (1, setup.max_batch_size):  # the warm-up's batches
        tokens = size * setup.tokens
        seconds = setup.fixed_s + setup.per_token_s * tokens
        estimator.warmup_batch(tokens, seconds)
        scheduler.throughput.record(tokens, seconds)
    return Pod(scheduler, estimator, now if warm else now + setup.startup_s)


def simulate(
    setup: Setup,
    rate: Callable[[float], float],
    duration: float,
    policy: str,
    target: float,
    seed: int = 1,
    late: str = "yield",
) -> Outcome:
    """`policy`: `latency` (carpool_slo_saturation at 1) or `queue` (carpool_queue_depth at `target`).
    `late`: what the latency target's pods do with requests past the objective (`objective.late_requests`;
    a queue-depth target's pods have no objective, so theirs keep their place)."""
    rng = random.Random(seed)
    late_after_s = setup.objective.latency_s if policy == "latency" and late == "yield" else None
    pods: list[Pod] = [new_pod(setup, 0.0, warm=True, late_after_s=late_after_s)]
    outcome = Outcome(policy if policy == "latency" else f"queue depth {target:g}")
    peak_rate = max(rate(t) for t in range(int(duration) + 1))
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, pod index)
    order = 0

    def push(at: float, kind: str, index: int = -1) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, index))

    push(rng.expovariate(peak_rate), "arrival")
    push(setup.sync_s, "sync")
    recommendations: list[tuple[float, int]] = []
    last_scale_up = -math.inf
    last = 0.0

    def publish(pod: Pod, now: float) -> None:
        """The engine sets its gauges every loop turn (the estimator evaluates 20 times a second at most)."""
        if policy == "latency":
            pod.estimator.update(now, pod.scheduler.backlog_seconds())

    def start(index: int, now: float) -> None:
        pod = pods[index]
        if pod.running is not None:
            return
        batch = pod.scheduler.schedule(now).batch
        if batch:
            pod.running = batch
            push(now + setup.fixed_s + setup.per_token_s * sum(i.length for i in batch), "done", index)

    while events:
        now, _, kind, index = heapq.heappop(events)
        if now > duration and kind != "done":
            continue
        live = [p for p in pods if p.gone_at is None]
        outcome.replica_seconds += len(live) * (now - last)
        last = now
        if kind == "arrival":
            push(now + rng.expovariate(peak_rate), "arrival")
            if rng.random() > rate(now) / peak_rate:
                continue  # thinning: a Poisson stream at the trace's rate
            ready = [
                i for i, p in enumerate(pods) if p.gone_at is None and not p.leaving and p.ready_at <= now
            ]
            chosen = rng.choice(ready)
            pod = pods[chosen]
            pod.scheduler.submit([WorkItem(tokens=[0] * setup.tokens, arrival=now, deadline=math.inf)], now)
            pod.estimator.arrive(now, 1, setup.tokens)
            start(chosen, now)
            publish(pod, now)
        elif kind == "done":
            pod = pods[index]
            assert pod.running is not None
            batch, pod.running = pod.running, None
            seconds = setup.fixed_s + setup.per_token_s * sum(i.length for i in batch)
            pod.scheduler.complete(batch, seconds)
            pod.estimator.batch(sum(i.length for i in batch), seconds)
            for item in batch:
                outcome.requests += 1
                outcome.met += now - item.arrival <= setup.objective.latency_s
            start(index, now)
            publish(pod, now)
            if pod.leaving and pod.running is None and not pod.scheduler.waiting:
                pod.gone_at = now
        else:  # the HPA's sync
            push(now + setup.sync_s, "sync")
            current = [p for p in pods if p.gone_at is None and not p.leaving]
            values = []
            for p in current:
                if p.ready_at > now:
                    values.append(0.0)  # warming: the pod exports 0 for either metric
                elif policy == "latency":
                    values.append(p.estimator.update(now, p.scheduler.backlog_seconds()).saturation)
                else:
                    values.append(float(p.scheduler.waiting))
            ratio = sum(values) / len(values) / target
            wanted = len(current) if abs(1 - ratio) <= setup.tolerance else math.ceil(sum(values) / target)
            wanted = max(setup.min_replicas, min(setup.max_replicas, wanted))
            recommendations = [(t, r) for t, r in recommendations if t > now - setup.scale_down_window_s]
            recommendations.append((now, wanted))
            desired = wanted
            if wanted < len(current):
                desired = max(r for _, r in recommendations)  # the scale-down stabilization window
            if desired > len(current):
                # One wave per startup budget: 100% or 4 pods, whichever is more (the operator's default).
                if now - last_scale_up < setup.startup_s:
                    desired = len(current)
                else:
                    desired = min(desired, max(2 * len(current), len(current) + 4))
                    last_scale_up = now
            for _ in range(desired - len(current)):
                pods.append(new_pod(setup, now, warm=False, late_after_s=late_after_s))
            for p in sorted(current, key=lambda p: -p.ready_at)[: max(0, len(current) - desired)]:
                p.leaving = True  # the newest go first, as a ReplicaSet picks (not-ready before ready)
                if p.running is None and not p.scheduler.waiting:
                    p.gone_at = now
            outcome.timeline.append((now, desired))
            outcome.peak = max(outcome.peak, desired)
    return outcome


def capacity(setup: Setup) -> float:
    """Inputs per second one pod serves at the objective (what the estimator computes)."""
    pod = new_pod(setup, 0.0, warm=True)
    pod.estimator.arrive(0.0, 1, setup.tokens)
    rate, _ = pod.estimator.sustainable_rate(0.0)
    assert rate is not None
    return rate


def traces(per_pod: float) -> dict[str, tuple[Callable[[float], float], float]]:
    def step(t: float) -> float:
        return per_pod * (4.0 if 60 <= t < 420 else 0.5)

    def ramp(t: float) -> float:
        return per_pod * (0.3 + 5.0 * min(t, 480.0) / 480.0)

    return {
        "step (0.5 -> 4 -> 0.5 pods' load)": (step, 600.0),
        "ramp (0.3 -> 5.3 pods' load over 8 min)": (ramp, 600.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue-targets", default="1,2,4,8,16,32,64")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only-latency", action="store_true")
    parser.add_argument(
        "--late",
        choices=("yield", "fifo"),
        default="yield",
        help="objective.late_requests of the latency target",
    )
    args = parser.parse_args()
    setup = Setup()
    per_pod = capacity(setup)
    print(
        f"model: {setup.fixed_s * 1000:g} ms + {setup.per_token_s * 1e6:g} us/token, "
        f"{setup.tokens} tokens per input, batches of {setup.max_batch_size}; "
        f"objective p{setup.objective.percentile * 100:g} <= "
        f"{setup.objective.latency_s * 1000:g} ms; one pod at the objective: {per_pod:.0f} inputs/s"
    )
    for name, (rate, duration) in traces(per_pod).items():
        print(f"\n### {name}\n")
        print("| policy | requests | met the objective | replica-seconds | peak replicas |")
        print("|---|---|---|---|---|")
        results = [simulate(setup, rate, duration, "latency", SATURATION_TARGET, args.seed, args.late)]
        for target in (float(t) for t in args.queue_targets.split(",") if not args.only_latency):
            results.append(simulate(setup, rate, duration, "queue", target, args.seed))
        for r in results:
            met = f"{100 * r.attainment:.1f}%"
            print(f"| {r.policy} | {r.requests} | {met} | {r.replica_seconds:.0f} | {r.peak} |")


if __name__ == "__main__":
    main()
