"""The benchmark: how close the server comes to the model's own limits, in one run.

    python -m bench.run [--quick] [--out results.json]
    python -m bench.run --front-only [--workers 1 2] [--quick]   (the front alone: see `bench.front`)

Phases, in order, so that nothing competes for the two cores with what is being measured:

1. The corpus, its token lengths checked with the model's tokenizer.
2. In this process, before any server exists: the offline limit (full length-sorted batches straight
   into `engine.forward`) and the model's own single-request latency. The model is then dropped.
3. `carpool serve` as a subprocess on 127.0.0.1; once ready, over HTTP:
   saturation throughput (closed loop, many clients, after a warm-up), latency at 1 client (closed
   loop), and latency at 30% and 70% of the measured saturation rate (open loop, Poisson arrivals).
   The server's /metrics are scraped around the saturation phase for its batch sizes and padding.
4. After the server stops, the offline limit again: the machine's speed drifts by 10% or more over
   minutes (other tenants of the host), so the saturation ratio is taken against the mean of the limit
   measured before and after the server phase, both shown.
5. One markdown report with the bars: saturation >= 93% of the offline limit; 1-client p50 within 3 ms
   of the model's single-request p50; p99 at 70% of saturation < 5x the model's single-request p50.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/run.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loadgen
from bench.corpus import MAX_TOKENS, MIN_TOKENS, corpus, length_histogram
from bench.loadgen import LoadResult, embedding_payloads
from bench.offline import (
    LatencyResult,
    OfflineResult,
    cost_points,
    load_embedding_engine,
    offline_limit,
    single_request_latency,
)
from bench.queueing import CostModel, ideal_p99
from bench.server import (
    HOST,
    CpuMeter,
    CpuUse,
    ServerProcess,
    ServerWindow,
    host_facts,
    log,
    scrape,
    wait_quiet,
)
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.engine.instances import instance_pool

SATURATION_SHARE = 0.93
SINGLE_CLIENT_SLACK_S = 0.003
P99_FACTOR = 5.0
LOW_LOAD_P99_S = 0.100
"""Issue 46: p99 at 30% of saturation, where most embedding services run."""


@dataclass
class Plan:
    """Sizes and durations of every phase (the defaults take about four minutes)."""

    corpus_size: int = 2048
    latency_samples: int = 300
    clients: int = 128
    warmup_s: float = 5.0
    saturation_s: float = 25.0
    single_client_s: float = 20.0
    open_loop_s: float = 25.0
    offline_passes: int = 2
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    server_flags: list[str] = field(default_factory=list)
    dtype: str = "auto"
    """`model.dtype` of the offline phases and the server."""
    instances: int | None = None
    """`model.instances` of the offline limit and the server (None: the runtime's default)."""
    servers: list[tuple[str, Path | None]] = field(default_factory=lambda: [("", None)])
    """The server phases, in order, each (label, the checkout whose runtime it runs; None: this
    environment's): `--baseline` alternates a before and this tree's after, sharing the offline phases."""

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            corpus_size=512,
            latency_samples=60,
            clients=32,
            warmup_s=1.0,
            saturation_s=4.0,
            single_client_s=3.0,
            open_loop_s=4.0,
            offline_passes=1,
        )

    def config(self) -> RuntimeConfig:
        """The runtime config of the offline phases: the server's model settings."""
        return RuntimeConfig.model_validate({"model": {"dtype": self.dtype, "instances": self.instances}})

    def all_server_flags(self) -> list[str]:
        return [
            "--model.dtype",
            self.dtype,
            "--batching.max-batch-size",
            str(self.max_batch_size),
            "--batching.max-batch-tokens",
            str(self.max_batch_tokens),
            *(["--model.instances", str(self.instances)] if self.instances is not None else []),
            *self.server_flags,
        ]


@dataclass
class Report:
    plan: Plan
    environment: dict[str, str]
    lengths: list[int]
    offline: OfflineResult
    """The offline limit before the server phase."""
    offline_after: OfflineResult | None
    """The same, after the server phase (None: not measured)."""
    single: LatencyResult
    cost: CostModel
    """The model's cost per forward pass, fitted in this run (for the ideal batcher's latency)."""
    server_command: list[str]
    ready_s: float
    saturation: LoadResult
    server: ServerWindow
    one_client: LoadResult
    open_loops: dict[str, LoadResult]
    cpu: dict[str, CpuUse]
    """Cores busy per phase: "offline", "saturation", "1 client", "30%", "70%"."""

    @property
    def limit(self) -> float:
        """Inputs/s the saturation phase is held against: the mean of the offline limit before and after."""
        if self.offline_after is None:
            return self.offline.inputs_per_s
        return (self.offline.inputs_per_s + self.offline_after.inputs_per_s) / 2

    def bars(self) -> list[tuple[str, str, str, bool]]:
        """(bar, target, measured, passed)."""
        ratio = self.saturation.inputs_per_s / self.limit
        gap = self.one_client.p50 - self.single.p50
        high = self.open_loops["70%"]
        low = self.open_loops["30%"]
        factor = high.p99 / self.single.p50
        return [
            (
                "saturation vs offline limit",
                f">= {SATURATION_SHARE:.0%}",
                f"{ratio:.1%}",
                ratio >= SATURATION_SHARE,
            ),
            (
                "1-client p50 - model single-request p50",
                f"<= {SINGLE_CLIENT_SLACK_S * 1e3:.0f} ms",
                f"{gap * 1e3:+.2f} ms",
                gap <= SINGLE_CLIENT_SLACK_S,
            ),
            (
                "p99 at 70% of saturation / model single-request p50",
                f"< {P99_FACTOR:.0f}x",
                f"{factor:.2f}x",
                factor < P99_FACTOR,
            ),
            (
                "p99 at 30% of saturation (issue 46)",
                f"<= {LOW_LOAD_P99_S * 1e3:.0f} ms",
                f"{_ms(low.p99)}",
                low.p99 <= LOW_LOAD_P99_S,
            ),
        ]

    def _after_rows(self) -> list[tuple[str, str, str]]:
        after = self.offline_after
        if after is None:
            return []
        note = f"best of {self.plan.offline_passes} passes{self._background('offline after')}"
        return [("Offline limit again, after the server phase", f"{after.inputs_per_s:.1f} inputs/s", note)]

    @property
    def cores(self) -> int:
        return int(self.environment["cores"])

    def outside_model(self) -> dict[str, float] | None:
        """CPU seconds per input served at saturation outside the model's threads, by whom (fronts, the
        engine's loop and socket threads, the supervisor, this process's load generator); None where the
        server's threads could not be told apart (not Linux)."""
        use = self.cpu.get("saturation")
        rate = self.saturation.inputs_per_s
        if use is None or use.split is None or rate <= 0:
            return None
        split = use.split
        parts = {"fronts": split.fronts, "engine": split.engine, "supervisor": split.rest, "client": use.own}
        return {name: cores / rate for name, cores in parts.items()}

    def ceiling(self) -> float | None:
        outside = self.outside_model()
        return None if outside is None else saturation_ceiling(self.limit, sum(outside.values()), self.cores)

    def _ceiling_rows(self) -> list[tuple[str, str, str]]:
        outside, ceiling = self.outside_model(), self.ceiling()
        use = self.cpu["saturation"]
        if outside is None or ceiling is None or use.split is None:
            return []
        c = sum(outside.values())
        model = use.split.model / self.saturation.inputs_per_s
        budget = outside_budget(self.limit, SATURATION_SHARE, self.cores)
        return [
            (
                "CPU per input outside the model, saturation (per thread, /proc)",
                f"{c * 1e3:.3f} ms",
                f"fronts {outside['fronts'] * 1e3:.3f}, engine's loop and socket threads "
                f"{outside['engine'] * 1e3:.3f}, supervisor {outside['supervisor'] * 1e3:.3f}, "
                f"load generator {outside['client'] * 1e3:.3f} ms; the model's threads "
                f"{model * 1e3:.3f} ms an input ({use.split.model:.2f} cores) against "
                f"{self.cores / self.limit * 1e3:.3f} ms offline (cores / offline limit)",
            ),
            (
                "Ceiling on server / offline at that CPU",
                f"{ceiling:.1%}",
                f"1 / (1 + L c / cores), L = {self.limit:.1f} inputs/s, {self.cores} cores: the model keeps "
                f"the cores the rest leaves it; {SATURATION_SHARE:.0%} needs c <= {budget * 1e3:.3f} ms",
            ),
        ]

    def _limit_note(self) -> str:
        if self.offline_after is None:
            return ""
        return f"against the mean of the two offline limits, {self.limit:.1f} inputs/s"

    def markdown(self) -> str:
        off, sat, one, srv = self.offline, self.saturation, self.one_client, self.server
        single_p50 = self.single.p50
        rows = [
            (
                "Offline limit (engine.forward, length-sorted full batches)",
                f"{off.inputs_per_s:.1f} inputs/s",
                f"best of {self.plan.offline_passes} passes; {off.inputs} inputs in {off.batches} batches, "
                f"mean size {off.mean_batch_size:.1f}, "
                f"padding {off.padding_ratio:.1%}{self._background('offline')}",
            ),
            (
                "Model single-request latency (tokenize + forward, 1 input)",
                f"p50 {_ms(single_p50)}, p99 {_ms(self.single.p99)}",
                f"{len(self.single.latencies)} inputs{self._background('single')}",
            ),
            (
                f"Server saturation (closed loop, {sat.clients} clients, {sat.window_s:.0f} s)",
                f"{sat.inputs_per_s:.1f} inputs/s",
                f"p50 {_ms(sat.p50)}, p99 {_ms(sat.p99)}; {_statuses(sat)}{self._background('saturation')}",
            ),
            *self._after_rows(),
            ("Ratio server / offline", f"{sat.inputs_per_s / self.limit:.1%}", self._limit_note()),
            (
                "Server batches during saturation (/metrics)",
                f"mean size {srv.mean_batch_size:.1f}, padding {srv.mean_padding_ratio:.1%}",
                f"{srv.batches:.0f} batches, {_ms(srv.mean_batch_seconds)} each, model instances busy "
                f"{srv.model_busy:.2f}, {srv.model_inputs_per_s:.1f} inputs per batch-second, "
                f"queue wait {_ms(srv.mean_queue_wait_seconds)}",
            ),
            (
                "CPU during saturation (cores busy)",
                f"server {self.cpu['saturation'].server:.2f}, client {self.cpu['saturation'].own:.2f}",
                "",
            ),
            *self._ceiling_rows(),
            (
                f"1 client (closed loop, {one.window_s:.0f} s)",
                f"p50 {_ms(one.p50)}, p99 {_ms(one.p99)}",
                f"p50 {_ms(one.p50 - single_p50, signed=True)} vs model; {one.requests_per_s:.1f} req/s; "
                f"{_statuses(one)}{self._background('1 client')}",
            ),
        ]
        for share, result in self.open_loops.items():
            rows.append(
                (
                    f"{share} of saturation (open loop, Poisson {result.rate:.1f} req/s, "
                    f"{result.window_s:.0f} s)",
                    f"p50 {_ms(result.p50)}, p95 {_ms(result.p95)}, p99 {_ms(result.p99)}",
                    f"p50 {result.p50 / single_p50:.2f}x, p99 {result.p99 / single_p50:.2f}x model p50; "
                    f"{result.requests_per_s:.1f} req/s answered; {_statuses(result)}; server "
                    f"{self._server_cores(share)} cores{self._background(share)}",
                )
            )
        for share in ("30%", "70%"):  # the floors of issue 46's bar (30%) and of the p99 bar (70%)
            loop = self.open_loops.get(share)
            if loop is None or loop.rate is None:
                continue
            ideal = self.ideal_p99(loop.rate)
            rows.append(
                (
                    f"Ideal batcher at {share} (simulated: no overhead, arrival order, this run's costs)",
                    f"p99 {_ms(ideal)}",
                    f"p99 {ideal / single_p50:.2f}x model p50; forward pass = {_ms(self.cost.fixed_s)} + "
                    f"{self.cost.per_token_s * 1e6:.1f} us/token (fitted) on each of {self.cost.instances} "
                    f"model instance(s) at once; a floor for the p99 bar at {share}",
                )
            )
        lines = ["| Measurement | Result | Notes |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines += ["", "| Bar | Target | Measured | Result |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {'PASS' if ok else 'FAIL'} |" for a, b, c, ok in self.bars()]
        return "\n".join(lines)

    def ideal_p99(self, rate: float) -> float:
        return ideal_p99(self.lengths, rate, self.cost, self.plan.max_batch_size, self.plan.max_batch_tokens)

    def _server_cores(self, phase: str) -> str:
        use = self.cpu.get(phase)
        return f"{use.server:.2f}" if use is not None else "?"

    def _background(self, phase: str) -> str:
        use = self.cpu.get(phase)
        return f"; other processes {use.background:.2f} cores" if use is not None else ""

    def header(self) -> str:
        env = self.environment
        command = self.server_command
        # `carpool serve FLAGS`, or the command as run where there is no console script (`python -m ...`)
        shown = (
            "carpool serve " + " ".join(command[command.index("serve") + 1 :])
            if "serve" in command
            else " ".join(command)
        )
        return "\n".join(
            [
                f"- Command: `{env['command']}`",
                f"- Date: {env['date']}",
                f"- CPU: {env['cpu']} ({env['cores']} cores); torch {env['torch']} "
                f"({env['torch_threads']} threads); "
                f"Python {env['python']}",
                f"- Server: `{shown}` (HF_HUB_OFFLINE=1), ready in {self.ready_s:.1f} s",
                f"- Corpus: {len(self.lengths)} texts, {min(self.lengths)}-{max(self.lengths)} tokens, "
                f"mean {sum(self.lengths) / len(self.lengths):.1f}",
            ]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "plan": self.plan.__dict__,
            "server_command": self.server_command,
            "corpus": {
                "texts": len(self.lengths),
                "min_tokens": min(self.lengths),
                "max_tokens": max(self.lengths),
                "mean_tokens": sum(self.lengths) / len(self.lengths),
            },
            "offline": self.offline.summary(),
            "offline_after": None if self.offline_after is None else self.offline_after.summary(),
            "limit_inputs_per_s": self.limit,
            "single_request": self.single.summary(),
            "cost_model": self.cost.__dict__,
            "saturation": self.saturation.summary(),
            "server_window": self.server.__dict__,
            "cpu": {phase: asdict(use) for phase, use in self.cpu.items()},
            "outside_model_s_per_input": self.outside_model(),
            "ceiling": self.ceiling(),
            "one_client": self.one_client.summary(),
            "open_loop": {share: result.summary() for share, result in self.open_loops.items()},
            "bars": [{"bar": a, "target": b, "measured": c, "pass": ok} for a, b, c, ok in self.bars()],
        }


def saturation_ceiling(limit: float, outside_s: float, cores: float) -> float:
    """The most the server's saturation can reach against the offline limit `limit` (inputs/s) when each
    input also takes `outside_s` of CPU outside the model's threads, on `cores` cores that everything
    shares: the model, at the offline limit's cost of cores / limit per input, keeps what the rest leaves,
    R (cores / limit + c) <= cores, so R / limit <= 1 / (1 + limit c / cores)."""
    return 1.0 / (1.0 + limit * outside_s / cores)


def outside_budget(limit: float, share: float, cores: float) -> float:
    """The CPU per input outside the model that still lets saturation reach `share` of `limit`."""
    return cores * (1.0 / share - 1.0) / limit


def _ms(seconds: float, signed: bool = False) -> str:
    return f"{seconds * 1e3:+.2f} ms" if signed else f"{seconds * 1e3:.2f} ms"


def _statuses(result: LoadResult) -> str:
    counts = result.status_summary()
    return ", ".join(f"{code}: {n}" for code, n in counts.items() if n or code == "200")


def environment(argv: Sequence[str]) -> dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, timeout=5
        ).stdout.strip()
    except OSError:
        commit = ""
    return {**host_facts(" ".join(["python -m bench.run", *argv])), "commit": commit}


def measure_offline(
    plan: Plan, texts: list[str], cpu: dict[str, CpuUse]
) -> tuple[list[int], OfflineResult, LatencyResult, CostModel]:
    """Phase 2: the model alone, in this process. Returns (token lengths, limit, single latency, cost)."""
    engine = load_embedding_engine(plan.config())
    token_lists = engine.tokenize(texts)
    lengths = [len(ids) for ids in token_lists]
    outside = [n for n in lengths if not MIN_TOKENS <= n <= MAX_TOKENS]
    if outside:
        raise SystemExit(
            f"{len(outside)} corpus texts fall outside {MIN_TOKENS}..{MAX_TOKENS} tokens "
            f"(e.g. {outside[:5]}): the corpus no longer matches the model's tokenizer"
        )
    log(f"corpus: {len(texts)} texts, token lengths (special tokens included):")
    for row in length_histogram(lengths):
        print(f"    {row}")
    log(
        f"offline limit: full length-sorted batches (<= {plan.max_batch_size} inputs, "
        f"size x longest <= {plan.max_batch_tokens} tokens); "
        f"{instance_pool(engine, plan.instances).plan.describe()}..."
    )
    meter = CpuMeter()
    meter.start()
    offline = offline_limit(
        engine,
        token_lists,
        plan.max_batch_size,
        plan.max_batch_tokens,
        passes=plan.offline_passes,
        instances=plan.instances,
    )
    cpu["offline"] = meter.stop()
    log(
        f"  {offline.inputs_per_s:.1f} inputs/s ({offline.inputs} inputs, {offline.seconds:.1f} s); "
        f"other processes {cpu['offline'].background:.2f} cores"
    )
    log(f"model single-request latency over {plan.latency_samples} texts...")
    # The same texts, in the same order, as the 1-client phase sends first.
    meter.start()
    single = single_request_latency(engine, texts[: plan.latency_samples])
    cpu["single"] = meter.stop()
    log(
        f"  p50 {_ms(single.p50)}, p99 {_ms(single.p99)}; "
        f"other processes {cpu['single'].background:.2f} cores"
    )
    pool = instance_pool(engine, plan.instances)
    cost = CostModel.fit(cost_points(engine, token_lists, pool=pool), instances=pool.plan.count)
    log(
        f"cost model: {_ms(cost.fixed_s)} per forward pass + {cost.per_token_s * 1e6:.1f} us per token, "
        f"on one of {cost.instances} model instance(s) running at once"
    )
    del engine
    gc.collect()
    return lengths, offline, single, cost


def measure_offline_again(plan: Plan, texts: list[str], cpu: dict[str, CpuUse]) -> OfflineResult:
    """Phase 4: the offline limit once more, after the server stopped (the machine's speed drifts)."""
    log("offline limit again, after the server phase...")
    engine = load_embedding_engine(plan.config())
    meter = CpuMeter()
    meter.start()
    offline = offline_limit(
        engine,
        engine.tokenize(texts),
        plan.max_batch_size,
        plan.max_batch_tokens,
        passes=plan.offline_passes,
        instances=plan.instances,
    )
    cpu["offline after"] = meter.stop()
    log(
        f"  {offline.inputs_per_s:.1f} inputs/s ({offline.inputs} inputs, {offline.seconds:.1f} s); "
        f"other processes {cpu['offline after'].background:.2f} cores"
    )
    del engine
    gc.collect()
    return offline


async def measure_server(
    plan: Plan, texts: list[str], server: ServerProcess, cpu: dict[str, CpuUse]
) -> dict[str, Any]:
    """Phase 3, against a ready server."""
    payloads = embedding_payloads(texts, HOST, server.port)
    # Saturation and the open loops start at different corpus offsets than the 1-client phase, but all
    # cycle through the same shuffled corpus, so they see the same length mix.
    shifted = payloads[len(payloads) // 2 :] + payloads[: len(payloads) // 2]
    meter = CpuMeter(server)
    log(f"saturation: warm-up {plan.warmup_s:.0f} s with {plan.clients} clients...")
    await loadgen.closed_loop(HOST, server.port, shifted, plan.clients, duration_s=plan.warmup_s)
    before = await scrape(server.port)
    log(f"saturation: {plan.saturation_s:.0f} s closed loop with {plan.clients} clients...")
    meter.start()
    saturation = await loadgen.closed_loop(
        HOST, server.port, payloads, plan.clients, duration_s=plan.saturation_s
    )
    use = cpu["saturation"] = meter.stop()
    window = ServerWindow.between(before, await scrape(server.port), saturation.window_s)
    log(
        f"  {saturation.inputs_per_s:.1f} inputs/s, p50 {_ms(saturation.p50)}, p99 {_ms(saturation.p99)}, "
        f"{saturation.status_summary()}; server mean batch {window.mean_batch_size:.1f}, padding "
        f"{window.mean_padding_ratio:.1%}, model instances busy {window.model_busy:.2f}; cores busy: server "
        f"{use.server:.2f}, client {use.own:.2f}, other processes {use.background:.2f}"
    )
    log(f"1 client: {plan.single_client_s:.0f} s closed loop...")
    meter.start()
    one_client = await loadgen.closed_loop(HOST, server.port, payloads, 1, duration_s=plan.single_client_s)
    cpu["1 client"] = meter.stop()
    log(
        f"  p50 {_ms(one_client.p50)}, p99 {_ms(one_client.p99)}; "
        f"other processes {cpu['1 client'].background:.2f} cores"
    )
    open_loops: dict[str, LoadResult] = {}
    for share in (0.3, 0.7):
        rate = share * saturation.requests_per_s
        name = f"{share:.0%}"
        log(f"{name} of saturation: open loop at {rate:.1f} req/s for {plan.open_loop_s:.0f} s...")
        meter.start()
        result = await loadgen.open_loop(
            HOST,
            server.port,
            shifted,
            rate,
            duration_s=plan.open_loop_s,
            seed=random.Random(share).randrange(1 << 30),
        )
        cpu[name] = meter.stop()
        open_loops[name] = result
        log(
            f"  p50 {_ms(result.p50)}, p99 {_ms(result.p99)}, {result.status_summary()}, "
            f"{result.connections} connections; other processes {cpu[name].background:.2f} cores"
        )
    return {"saturation": saturation, "server": window, "one_client": one_client, "open_loops": open_loops}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--front-only" in argv:
        from bench import front

        return front.main([arg for arg in argv if arg != "--front-only"])
    parser = argparse.ArgumentParser(description="Benchmark carpool against the model's offline limits.")
    parser.add_argument(
        "--front-only",
        action="store_true",
        help="measure the HTTP front alone with the null engine instead (`bench.front`, its own options)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few seconds per phase")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the markdown report here")
    parser.add_argument("--clients", type=int, help="closed-loop clients for saturation (default 128)")
    parser.add_argument(
        "--phase-seconds",
        type=float,
        metavar="SECONDS",
        help="length of the saturation, 1-client and open-loop phases (default 25, 20, 25; a short lease)",
    )
    parser.add_argument("--max-batch-size", type=int, default=32, help="server and offline (default 32)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="server and offline (default 8192)"
    )
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra `carpool serve` flag, repeatable (e.g. --server-flag=--batching.max-padding-ratio=0.2)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="first wait up to this long for other processes to leave the CPU idle (default 60)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also serve the runtime of this checkout (a worktree of the commit before a change): its "
        "server phases alternate with this tree's, against the same offline limits (before/after in one run)",
    )
    parser.add_argument(
        "--pairs", type=int, default=1, help="with --baseline: before/after server phases (default 1 pair)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--instances",
        type=int,
        help="model.instances of the offline limit and the server (default: the runtime's, 2 on a CPU)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["auto"],
        metavar="DTYPE",
        help="model.dtype of each full run, in order (e.g. --dtypes float32 auto: float32 is the baseline "
        "of a comparison table)",
    )
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    plan.max_batch_size = args.max_batch_size
    plan.max_batch_tokens = args.max_batch_tokens
    plan.server_flags = list(args.server_flag)
    plan.instances = args.instances
    if args.clients:
        plan.clients = args.clients
    if args.phase_seconds:
        plan.saturation_s = plan.single_client_s = plan.open_loop_s = args.phase_seconds

    texts = corpus(plan.corpus_size, args.seed)
    env = environment(argv)
    if args.wait_quiet > 0:
        quiet = loadgen.run(wait_quiet(args.wait_quiet))
        log(f"other processes use {quiet.background:.2f} cores before the run")
    if args.baseline is not None:
        plan.servers = [("before", args.baseline.resolve()), ("after", None)] * args.pairs
    reports: list[tuple[str, Report]] = []
    servers: list[tuple[str, Report]] = []
    for dtype in args.dtypes:
        plan.dtype = dtype
        log(f"model.dtype {dtype}")
        runs = run_once(replace(plan), texts, env)
        servers += [(f"{dtype} {label}".strip(), report) for label, report in runs]
        reports.append((dtype, runs[-1][1]))
    text = "\n\n".join(f"### model.dtype {name}\n\n{r.header()}\n\n{r.markdown()}" for name, r in servers)
    if len(servers) > 1:
        text += "\n\n" + comparison(servers)
    if len(reports) > 1:
        text += "\n\n" + dtype_comparison(reports)
    print()
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.out:
        payload = {name: r.to_json() for name, r in servers}
        args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


def dtype_comparison(reports: list[tuple[str, Report]]) -> str:
    """Saturation of each dtype against the first one's (the baseline), and against its own offline limit."""
    base_dtype, base = reports[0]
    lines = [
        f"| model.dtype | offline limit (mean) | saturation | vs {base_dtype} saturation "
        "| vs its own offline limit |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype, report in reports:
        sat = report.saturation.inputs_per_s
        lines.append(
            f"| {dtype} | {report.limit:.1f} inputs/s | {sat:.1f} inputs/s | "
            f"{sat / base.saturation.inputs_per_s:.2f}x | {sat / report.limit:.3f}x |"
        )
    return "\n".join(lines)


def run_once(plan: Plan, texts: list[str], env: dict[str, str]) -> list[tuple[str, Report]]:
    """Offline limit, the server phases (one per `plan.servers`) and the offline limit again, for one
    `plan.dtype`: a report per server phase, all against the same offline limits."""
    shared: dict[str, CpuUse] = {}
    lengths, offline, single, cost = measure_offline(plan, texts, shared)
    phases = []
    for label, source in plan.servers:
        cpu = dict(shared)
        server = ServerProcess(plan.all_server_flags(), source=source)
        log(f"starting{f' ({label})' if label else ''}: {' '.join(server.command)}")
        server.start()
        try:
            ready_s = loadgen.run(server.wait_ready(600))  # a loaded host can take minutes
            log(f"ready after {ready_s:.1f} s")
            measured = loadgen.run(measure_server(plan, texts, server, cpu))
        finally:
            code = server.stop()
            log(f"server stopped (exit {code})")
        phases.append((label, server.command, ready_s, cpu, measured))
    after: dict[str, CpuUse] = {}
    offline_after = measure_offline_again(plan, texts, after)
    reports = []
    for label, command, ready_s, cpu, measured in phases:
        report = Report(
            plan=plan,
            environment=env,
            lengths=lengths,
            offline=offline,
            offline_after=offline_after,
            single=single,
            cost=cost,
            server_command=command,
            ready_s=ready_s,
            cpu={**cpu, **after},
            **measured,
        )
        reports.append((label, report))
    return reports


def comparison(reports: list[tuple[str, Report]]) -> str:
    """The server phases of one run side by side: saturation and latency at 30% and 70% of it."""
    lines = [
        "| server | saturation | 30%: p50 / p95 / p99 | 30%: server cores | 70%: p50 / p95 / p99 "
        "| 70%: server cores |",
        "|---|---:|---|---:|---|---:|",
    ]
    for label, report in reports:
        low, high = report.open_loops["30%"], report.open_loops["70%"]
        lines.append(
            f"| {label} | {report.saturation.inputs_per_s:.1f} inputs/s | "
            f"{_ms(low.p50)} / {_ms(low.p95)} / {_ms(low.p99)} | {report._server_cores('30%')} | "
            f"{_ms(high.p50)} / {_ms(high.p95)} / {_ms(high.p99)} | {report._server_cores('70%')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
