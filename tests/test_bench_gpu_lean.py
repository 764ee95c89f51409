"""The short-lease GPU run's parts that run anywhere: the random-weight stand-ins (bench.gpu.models) take
the real model packages' place with the real shapes, and the embeddings peer (bench.peer) answers
OpenAI embedding requests as the benchmarks send them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from bench.gpu.models import ENCODER_PACKAGE, GENERATOR_PACKAGE, build, prepare

from carpool.runtime.sources import resolve_source


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(out)
    return out


def _shadowed(target: Path, package: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    return Path(resolve_source(f"pkg:{package}").location)


def test_nothing_but_configs_and_tokenizers_is_prepared(prepared: Path) -> None:
    files = [p for p in prepared.rglob("*") if p.is_file()]
    assert {p.parent.name for p in files if p.name == "tokenizer.json"} == {"minilm", "smollm2"}
    assert not [p for p in files if p.suffix in (".safetensors", ".gguf", ".bin")]
    assert sum(p.stat().st_size for p in files) < 8_000_000  # travels beside the wheels in 64 MiB


@pytest.mark.parametrize(("variant", "hidden", "layers"), [("minilm", 384, 6), ("bert-base", 768, 12)])
def test_encoder_stand_ins_take_the_real_packages_place_in_their_shape(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, hidden: int, layers: int
) -> None:
    real = Path(resolve_source(f"pkg:{ENCODER_PACKAGE}").location)
    build(prepared, variant, tmp_path)
    folder = _shadowed(tmp_path, ENCODER_PACKAGE, monkeypatch)
    assert folder.is_relative_to(tmp_path) and not folder.is_relative_to(real)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (hidden, layers)
    assert (folder / "model.safetensors").read_bytes() != (real / "model.safetensors").read_bytes()
    assert (folder / "tokenizer.json").read_bytes() == (real / "tokenizer.json").read_bytes()


def test_the_generator_stand_in_is_a_folder_with_the_chat_template(
    prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    build(prepared, "smollm2", tmp_path)
    source = resolve_source(f"pkg:{GENERATOR_PACKAGE}")
    assert source.gguf_file is not None  # the real package: a GGUF file
    folder = _shadowed(tmp_path, GENERATOR_PACKAGE, monkeypatch)
    assert resolve_source(f"pkg:{GENERATOR_PACKAGE}").gguf_file is None
    config = AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (576, 30, 3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in chat and chat != "hi"


def test_the_peer_answers_openai_embedding_requests() -> None:
    from bench.peer import SOURCE, app
    from fastapi.testclient import TestClient

    with TestClient(app(SOURCE, "float32")) as client:
        one = client.post("/v1/embeddings", json={"input": "a short text"})
        two = client.post("/v1/embeddings", json={"input": ["first", "second"], "model": "m"})
        bad = client.post("/v1/embeddings", json={"inputs": "misspelt"})
    assert one.status_code == 200 and two.status_code == 200
    assert len(one.json()["data"]) == 1 and len(one.json()["data"][0]["embedding"]) == 384
    assert [d["index"] for d in two.json()["data"]] == [0, 1] and two.json()["model"] == "m"
    assert bad.status_code == 422
