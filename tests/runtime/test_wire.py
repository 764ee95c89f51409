"""The wire between fronts and engine: every message survives its encoding, encoder rows travel as one
buffer, errors come back as the domain errors (and HTTP statuses) they were; `server.workers: auto`."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from carpool.runtime import errors
from carpool.runtime.api.errors import status_of
from carpool.runtime.config import Task
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.server import resolve_workers
from carpool.runtime.wire import (
    Abort,
    AdapterDone,
    AdapterInfo,
    Codec,
    EncodeOutput,
    EncodeRequest,
    EngineInfo,
    EngineState,
    ErrorOutput,
    GenerateRequest,
    Goodbye,
    LoadAdapter,
    Status,
    TextSpec,
    TokenLogprobs,
    TokenOutput,
    UnloadAdapter,
    error_from,
    error_output,
)


def test_front_messages_round_trip_in_one_frame_in_order() -> None:
    codec = Codec.create()
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3, stop=("\n",))
    messages = [
        EncodeRequest(4097, 1, [[1, 5, 2], [1, 2]], 2, 10.5, 40.5),
        GenerateRequest(8193, 1, [1, 2, 3], params, 0, 1.0, 31.0),
        Abort([4097, 8193]),
        Goodbye(1),
    ]
    assert codec.front_decoder.decode(codec.encoder.encode(messages)) == messages


def test_engine_messages_round_trip_and_rows_are_one_buffer() -> None:
    codec = Codec.create()
    rows = np.arange(6, dtype="<f4").reshape(2, 3)
    info = EngineInfo("m", Task.EMBED, 256, "cpu", "float32", "pkg:x", dimensions=3, packed=True)
    batch = [
        EncodeOutput(1, "<f4", (2, 3), rows.tobytes()),
        TokenOutput(2, [5, 6], None),
        TokenOutput(2, [], "stop"),
        ErrorOutput(3, "QueueFull", "queue full", 2.0),
        Status(EngineState.READY, 123, info, TextSpec("{}", eos_ids=[2], max_model_len=512)),
    ]
    encoded = codec.encoder.encode(batch)
    decoded = codec.engine_decoder.decode(encoded)
    assert decoded == batch
    first = decoded[0]
    assert isinstance(first, EncodeOutput)
    assert np.array_equal(np.frombuffer(first.data, dtype=first.dtype).reshape(first.shape), rows)
    big = np.ones((32, 384), dtype="<f4")
    one = codec.encoder.encode([EncodeOutput(1, "<f4", (32, 384), big.tobytes())])
    assert len(one) < big.nbytes + 32  # raw bytes, not one object per number


def test_token_logprobs_travel_as_two_buffers_and_a_message_of_the_old_shape_still_decodes() -> None:
    codec = Codec.create()
    ids = np.array([[7, 7, 9, 4], [3, 8, 3, 1]])
    values = np.array([[-0.1, -0.1, -2.5, -3.0], [-1.5, -0.2, -1.5, -4.0]])
    output = TokenOutput(2, [7, 3], None, TokenLogprobs.of(ids, values))
    (back,) = codec.engine_decoder.decode(codec.encoder.encode([output]))
    assert isinstance(back, TokenOutput) and back.logprobs is not None
    got_ids, got_values = back.logprobs.arrays()
    assert got_ids.tolist() == ids.tolist() and np.allclose(got_values, values)
    assert back.logprobs.head(1, 2).arrays()[0].tolist() == [[7, 7]]
    wide = np.zeros((1, 21))
    encoded = codec.encoder.encode([TokenOutput(2, [7], None, TokenLogprobs.of(wide, wide))])
    assert len(encoded) < 2 * wide.size * 4 + 32  # raw bytes, not one object per number
    # Without logprobs the message is as before the field was added, and the old shape decodes.
    plain = codec.encoder.encode([TokenOutput(2, [7], None)])
    old = msgspec.msgpack.encode([["tokens", 2, [7], None]])
    assert codec.engine_decoder.decode(old) == codec.engine_decoder.decode(plain) == [TokenOutput(2, [7])]
    assert GenerateRequest(1, 0, [1], SamplingParams(), 0, 0.0, 1.0).params.logprobs is None


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.QueueFull("queue full: 4 waiting", 3.0), 429),
        (errors.DeadlineExceeded("waited past its deadline"), 504),
        (errors.NotReady("shutting down", 1.0), 503),
        (errors.OutOfMemory("out of memory"), 500),
        (errors.BatchFailed("the model exploded"), 500),
        (errors.InvalidInput("priority 9 is outside 0..2"), 400),
    ],
)
def test_errors_cross_as_the_same_domain_error(error: errors.CarpoolError, status: int) -> None:
    codec = Codec.create()
    (back,) = codec.engine_decoder.decode(codec.encoder.encode([error_output(7, error)]))
    assert isinstance(back, ErrorOutput)
    again = error_from(back)
    assert type(again) is type(error) and again.message == error.message
    assert again.retry_after_s == error.retry_after_s
    assert status_of(again) == status


def test_an_unknown_error_kind_is_a_batch_failure() -> None:
    assert isinstance(error_from(ErrorOutput(1, "SomethingNew", "?")), errors.BatchFailed)


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (2.5, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_auto_workers_leave_the_engine_a_core(cpus: float, workers: int) -> None:
    assert resolve_workers("auto", cpus) == workers
    assert resolve_workers(3, cpus) == 3


def test_lora_messages_round_trip_and_an_older_generate_request_still_decodes() -> None:
    codec = Codec.create()
    params = SamplingParams(max_tokens=7)
    for message in (
        GenerateRequest(8193, 1, [1, 2, 3], params, 0, 1.0, 31.0, "sql"),
        LoadAdapter(4097, 1, "sql", "/adapters/sql"),
        UnloadAdapter(4097, 1, "sql"),
    ):
        assert codec.front_decoder.decode(codec.encoder.encode([message])) == [message]
    older = msgspec.msgpack.encode([["generate", 8193, 1, [1, 2], params, 0, 1.0, 31.0]])  # before `adapter`
    (decoded,) = codec.front_decoder.decode(older)
    assert isinstance(decoded, GenerateRequest) and decoded.adapter is None
    status = Status(EngineState.READY, 7, adapters=(AdapterInfo("sql", "base", "/adapters/sql"),))
    replies = [AdapterDone(4097, "sql", "loaded"), status]
    assert codec.engine_decoder.decode(codec.encoder.encode(replies)) == replies
    refused = error_from(error_output(4097, errors.InvalidAdapter("rank 64 over the limit")))
    assert isinstance(refused, errors.InvalidAdapter) and status_of(refused) == 400
