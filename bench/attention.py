"""A decoding step's attention alone, per sequence against batched (`models.segments`), over a grid of
sequences and contexts: what `GenerationEngine` measures at load to choose, for one model shape.

    python -m bench.attention [--device cpu] [--dtype float32] [--sequences 4 16 64] [--context 150 512]
                              [--heads 9 --kv-heads 3 --head-dim 64 --layers 30] [--markdown out.md]

Issue 37, item 2. No model is loaded (random queries over a zeroed pool of the right shape; attention's
time does not depend on the values), so it runs in seconds on a GPU as on a CPU. Defaults: SmolLM2-135M's
attention shape. Each cell is `segments.choose` (the calls of 4 layers, one step plan shared by them, best
of 3, twice, alternating); the table gives milliseconds per layer and per step (x --layers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.server import host_facts, loadavg


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from carpool.runtime.models import quant, segments
    from carpool.runtime.models.device import inference

    parser = argparse.ArgumentParser(description="A decoding step's attention, per sequence against batched.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sequences", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[150, 512])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    host = host_facts("python -m bench.attention " + " ".join(sys.argv[1:] if argv is None else argv))
    shape = f"{args.heads} heads ({args.kv_heads} key heads) of {args.head_dim}"
    lines = [
        f"Attention of one decoding step, {shape}, {args.dtype} on {device.type} "
        f"({torch.get_num_threads()} threads); sequences of context/2 to context tokens. "
        f"Load average {loadavg()} at start.",
        "",
        "| sequences | context | per sequence ms/layer | batched ms/layer | per sequence ms/step "
        f"({args.layers} layers) | batched ms/step | batched / per sequence | chosen |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for sequences in args.sequences:
        for context in args.context:
            pool = torch.zeros(
                (sequences * context, args.kv_heads, args.head_dim), dtype=dtype, device=device
            )
            with inference(device):
                choice = segments.choose(
                    pool, pool, args.heads, 4, sequences, context, args.head_dim**-0.5, quant.best_of
                )
            each, batched = choice.per_sequence_s / choice.layers, choice.batched_s / choice.layers
            step_each, step_batched = each * args.layers * 1000, batched * args.layers * 1000
            chosen = "batched" if choice.batched else "per sequence"
            lines.append(
                f"| {sequences} | {context} | {each * 1000:.3f} | {batched * 1000:.3f} | {step_each:.2f} "
                f"| {step_batched:.2f} | {batched / each:.2f} | {chosen} |"
            )
            del pool
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{host['cpu']} ({host['cores']} cores)"
    )
    facts = f"{host['date']}, {where}, torch {host['torch']}"
    lines += ["", f"Load average {loadavg()} at end. {facts}: `{host['command']}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
