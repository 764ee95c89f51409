"""The engine's generation core keeps a backstop behind the fronts' admission check: a sequence that
outgrows the whole KV cache ends (finish reason `length`, or refused if it produced nothing) instead of
waiting forever for blocks that can never free up."""

from __future__ import annotations

from carpool.runtime.engine.generation import GenerationCore
from carpool.runtime.engine.tasks import Output
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.wire import ErrorOutput, GenerateRequest, TokenOutput

from .factories import runtime_config
from .fakes import ScriptedGenerator, token_of


def core(engine: ScriptedGenerator) -> GenerationCore:
    config = runtime_config(
        model={"source": "fake", "task": "generate"},
        generation={"max_running_sequences": 4, "max_step_tokens": 64},
        warmup={"enabled": False},
    )
    return GenerationCore(engine, config, RuntimeMetrics("fake"), clock=lambda: 0.0)


def run_to_end(generation: GenerationCore, turns: int = 100) -> list[Output]:
    """Schedule and run steps inline until nothing is left, as the engine's busy loop would."""
    outputs: list[Output] = []
    for _ in range(turns):
        answered, launch, _ = generation.schedule(0.0)
        outputs += answered
        if launch is None:
            if not generation.busy:
                return outputs
            continue
        try:
            sampled = launch.run()
        except BaseException as exc:
            outputs += launch.complete(None, exc)
        else:
            outputs += launch.complete(sampled, None)
    raise AssertionError(f"the core still had work after {turns} turns: {outputs}")


def request(rid: int, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, 7, prompt, SamplingParams(max_tokens=max_tokens), 0, 0.0, 1e9)


def test_a_prompt_larger_than_the_whole_cache_is_refused_by_the_engine() -> None:
    engine = ScriptedGenerator(max_model_len=512, num_blocks=4, block_size=8)  # 32 tokens of cache
    generation = core(engine)
    assert generation.submit(request(1, [token_of("hello")] * 40, 4), 0.0) == []
    outputs = run_to_end(generation)
    assert len(outputs) == 1
    front, message = outputs[0]
    assert front == 7 and isinstance(message, ErrorOutput)
    assert message.kind == "InvalidInput" and "more than the KV cache holds (32 tokens)" in message.message


def test_a_sequence_that_outgrows_the_cache_ends_by_length_and_the_next_is_served() -> None:
    engine = ScriptedGenerator(max_model_len=512, num_blocks=4, block_size=8)
    generation = core(engine)
    generation.submit(request(1, [token_of("hello")] * 20, 100), 0.0)
    generation.submit(request(2, [token_of("hello")] * 4, 3), 0.0)
    outputs = run_to_end(generation)
    by_rid: dict[int, list[TokenOutput]] = {}
    for _, message in outputs:
        assert isinstance(message, TokenOutput), message
        by_rid.setdefault(message.rid, []).append(message)
    first = by_rid[1]
    assert first[-1].finish == "length"
    # 32 cache tokens hold the prompt and 12 outputs; the 13th is sampled but never needs a slot.
    assert sum(len(m.ids) for m in first) == 32 - 20 + 1
    second = by_rid[2]
    assert second[-1].finish == "length" and sum(len(m.ids) for m in second) == 3


def test_a_running_sequence_is_stopped_at_its_deadline_and_its_cache_freed() -> None:
    engine = ScriptedGenerator()
    generation = core(engine)
    running = GenerateRequest(1, 7, [token_of("hello")] * 4, SamplingParams(max_tokens=100), 0, 0.0, 10.0)
    assert generation.submit(running, 0.0) == []
    outputs: list[Output] = []
    for _ in range(5):  # prefill and four decodes, all before the deadline
        answered, launch, _ = generation.schedule(9.0)
        assert launch is not None
        outputs += answered + launch.complete(launch.run(), None)
    assert [len(m.ids) for _, m in outputs if isinstance(m, TokenOutput)] == [1] * 5
    seq = generation.scheduler.running[0]
    assert generation.scheduler.allocator.used > 0
    answered, launch, _ = generation.schedule(10.0)  # the deadline
    assert launch is None and not generation.busy
    ((front, message),) = answered
    assert front == 7 and isinstance(message, ErrorOutput) and message.rid == 1
    assert message.kind == "DeadlineExceeded" and "after generating 5 tokens" in message.message
    assert generation.scheduler.running == [] and generation.scheduler.allocator.used == 0
    assert seq.seq in engine.forgotten
    # A sequence that never ran keeps the queue's answer: 504, never run.
    waiting = GenerateRequest(2, 7, [token_of("hello")] * 4, SamplingParams(max_tokens=4), 0, 10.0, 11.0)
    generation.submit(waiting, 10.0)
    ((_, expired),) = generation.schedule(11.0)[0]
    assert isinstance(expired, ErrorOutput) and "was not run" in expired.message


def _texts(outputs: list[Output]) -> tuple[list[int], str | None]:
    ids = [i for _, m in outputs if isinstance(m, TokenOutput) for i in m.ids]
    finishes = [m.finish for _, m in outputs if isinstance(m, TokenOutput) and m.finish is not None]
    assert len(finishes) == 1, outputs
    return ids, finishes[0]


def test_a_stop_token_ends_the_sequence_as_end_of_text_does_once_min_tokens_are_out() -> None:
    """vLLM's `stop_token_ids` and `min_tokens` (the scripted engine says t0, t1, t2, ...)."""
    third = token_of("t2")
    stop = SamplingParams(max_tokens=10, stop_token_ids=(third,))
    generation = core(ScriptedGenerator())
    generation.submit(GenerateRequest(1, 7, [token_of("hello")], stop, 0, 0.0, 1e9), 0.0)
    ids, finish = _texts(run_to_end(generation))
    assert (ids, finish) == ([token_of("t0"), token_of("t1")], "stop")  # the stop token is not in the answer
    # Not before min_tokens: this engine does not hold the token back as the real sampler does, so the
    # core's own check is what lets it through.
    late = SamplingParams(max_tokens=4, stop_token_ids=(third,), min_tokens=4)
    generation = core(ScriptedGenerator())
    generation.submit(GenerateRequest(2, 7, [token_of("hello")], late, 0, 0.0, 1e9), 0.0)
    ids, finish = _texts(run_to_end(generation))
    assert len(ids) == 4 and third in ids and finish == "length"


def test_ignore_eos_goes_on_past_end_of_text_to_max_tokens() -> None:
    prompt = [token_of("bye")]  # the scripted engine says end of text after two tokens
    generation = core(ScriptedGenerator())
    generation.submit(GenerateRequest(1, 7, prompt, SamplingParams(max_tokens=5), 0, 0.0, 1e9), 0.0)
    ids, finish = _texts(run_to_end(generation))
    assert (len(ids), finish) == (2, "stop")
    generation = core(ScriptedGenerator())
    past = SamplingParams(max_tokens=5, ignore_eos=True)
    generation.submit(GenerateRequest(2, 7, prompt, past, 0, 0.0, 1e9), 0.0)
    ids, finish = _texts(run_to_end(generation))
    assert (len(ids), finish) == (5, "length")
