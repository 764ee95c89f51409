"""Generation admission: a request that could never fit the context or the KV cache is refused up front."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from carpool.runtime.api.admission import ContextLimits, generation_budget
from carpool.runtime.errors import InvalidInput

from .conftest import Running, serve
from .factories import runtime_config
from .fakes import ScriptedGenerator, factory

LIMITS = ContextLimits(max_model_len=512, cache_tokens=640)
SMALL_CACHE = ContextLimits(max_model_len=512, cache_tokens=32)


def test_an_explicit_max_tokens_that_fits_is_kept() -> None:
    assert generation_budget(100, 412, 256, LIMITS) == 412


def test_a_defaulted_max_tokens_is_capped_to_the_room_left() -> None:
    assert generation_budget(10, None, 256, LIMITS) == 256
    assert generation_budget(500, None, 256, LIMITS) == 12


def test_a_prompt_that_fills_the_context_without_max_tokens_is_refused_not_queued() -> None:
    # The old rule took min(default, room) with room <= 0 and let the request through to stall the loop.
    with pytest.raises(InvalidInput, match=r"has 40000 tokens.*at most 512 tokens.*max_model_len is 512"):
        generation_budget(40_000, None, 256, LIMITS)
    with pytest.raises(InvalidInput, match="leaving no room"):
        generation_budget(512, None, 256, LIMITS)


def test_the_kv_cache_bounds_a_sequence_when_it_is_smaller_than_the_context() -> None:
    with pytest.raises(InvalidInput, match=r"has 40 tokens.*KV cache holds 32 tokens"):
        generation_budget(40, None, 256, SMALL_CACHE)
    with pytest.raises(InvalidInput, match=r"together 36, more than the 32 tokens.*at most 28"):
        generation_budget(4, 32, 256, SMALL_CACHE)
    assert generation_budget(4, None, 256, SMALL_CACHE) == 28


def test_an_explicit_max_tokens_over_the_context_names_the_numbers() -> None:
    with pytest.raises(InvalidInput, match=r"has 5 tokens and max_tokens is 600: together 605.*at most 507"):
        generation_budget(5, 600, 256, LIMITS)


@pytest.fixture
def generator() -> Iterator[tuple[Running, ScriptedGenerator]]:
    engine = ScriptedGenerator(max_model_len=512, num_blocks=4, block_size=8)  # 32 tokens of KV cache
    config = runtime_config(model={"name": "fake", "task": "generate"}, warmup={"enabled": False})
    with serve(config, factory(engine)) as running:
        yield running, engine


def test_the_front_refuses_what_the_cache_can_never_hold_and_serves_the_next(
    generator: tuple[Running, ScriptedGenerator],
) -> None:
    """The engine announces its cache size; the front answers 400 with the numbers before sending."""
    server, engine = generator  # the fake tokenizer wraps a text in [CLS] ... [SEP]
    refused = server.client.post("/v1/completions", json={"prompt": "hello " * 40}, timeout=30)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "the prompt has 42 tokens" in message and "KV cache holds 32 tokens" in message
    too_many = server.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 40}, timeout=30)
    assert too_many.status_code == 400 and "lower max_tokens to at most 29" in too_many.text
    assert engine.params == {}, "nothing refused reached the engine"
    served = server.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
