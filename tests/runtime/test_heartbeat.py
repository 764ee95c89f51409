"""The engine's heartbeat carries no tokenizer: the text spec (the whole tokenizer JSON, 9 MB for Llama 3's)
goes to each front once, with the first status that has it, and every later heartbeat is a few dozen bytes
whatever the tokenizer's size; a front keeps the spec it was sent.

The engine core, its sockets and threads are the real ones (`engine.core.EngineCore`, as in the engine
process) with a scripted model; one front is a bare PULL socket, to see the bytes on the wire, the other the
front's real client (`api.client.EngineClient`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from carpool.runtime.api.client import EngineClient
from carpool.runtime.engine.core import EngineCore
from carpool.runtime.engine.process import task_core
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import Addresses, Codec, EngineState, Goodbye, Status, TextSpec
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine

HEARTBEATS = 8
"""Heartbeats read after the engine turned ready."""


def tokenizer_json(words: int) -> str:
    """A fast tokenizer of `words` words, serialised as the engine sends it (`Tokenizer.to_str()`'s
    layout; the vocabulary written out directly: to_str and json take seconds for 400,000 words)."""
    layout = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str()
    vocab = ", ".join(f'"word{n:07d}": {n + 1}' for n in range(words))
    text = layout.replace('"vocab":{"[UNK]":0}', f'"vocab":{{"[UNK]":0, {vocab}}}')
    assert text != layout, "the tokenizer's layout changed: the vocabulary went nowhere"
    return text


class BigTokenizerEngine(ScriptedEngine):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.spec = TextSpec(tokenizer_json=text)

    def text_spec(self) -> TextSpec:
        return self.spec


@dataclass
class Frame:
    size: int
    statuses: list[Status]


@contextmanager
def engine_serving(
    folder: Path, engine: ScriptedEngine, fronts: int
) -> Iterator[tuple[Addresses, EngineCore]]:
    """A real engine core in a thread, pushing to `fronts` front sockets; drained and joined at the end."""
    config = runtime_config(model={"name": "fake"}, warmup={"enabled": False})
    folder.mkdir(parents=True, exist_ok=True)
    addresses = Addresses.in_folder(str(folder), fronts)
    metrics = RuntimeMetrics("fake")
    core = EngineCore(addresses, lambda: task_core(engine, config, metrics, core), metrics, heartbeat_s=0.02)
    thread = threading.Thread(target=core.run, name="engine-core", daemon=True)
    thread.start()
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(addresses.input)
    try:
        yield addresses, core
    finally:
        core.request_drain()
        codec = Codec.create()
        for front in range(fronts):
            push.send(codec.encoder.encode([Goodbye(front)]))
        thread.join(timeout=30)
        push.close(linger=0)
        context.term()
    assert not thread.is_alive(), "the engine did not stop after every front said goodbye"


def status_frames(address: str, heartbeats: int) -> list[Frame]:
    """Frames from the engine to one front (a bare PULL socket) until `heartbeats` statuses have come
    after the first READY one."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 30_000)
    pull.bind(address)
    codec = Codec.create()
    frames: list[Frame] = []
    after_ready = -1
    try:
        while after_ready < heartbeats:
            data = pull.recv()
            statuses = [m for m in codec.engine_decoder.decode(data) if isinstance(m, Status)]
            frames.append(Frame(len(data), statuses))
            for status in statuses:
                if after_ready >= 0 or status.state is EngineState.READY:
                    after_ready += 1
    finally:
        pull.close(linger=0)
        context.term()
    return frames


def heartbeat_bytes(tmp_path: Path, text: str) -> tuple[TextSpec, list[TextSpec], list[int]]:
    """(the engine's spec, every spec that reached the front, the bytes of each frame after the first
    that carried the spec)."""
    engine = BigTokenizerEngine(text)
    with engine_serving(tmp_path, engine, 1) as (addresses, _):
        frames = status_frames(addresses.outputs[0], HEARTBEATS)
    sent = [status.text for frame in frames for status in frame.statuses if status.text is not None]
    first = next(i for i, frame in enumerate(frames) if any(s.text is not None for s in frame.statuses))
    return engine.spec, sent, [frame.size for frame in frames[first + 1 :]]


def test_the_tokenizer_goes_once_and_heartbeats_stay_small_whatever_its_size(tmp_path: Path) -> None:
    large = tokenizer_json(400_000)
    assert len(large) > 8_000_000  # a Llama 3 sized tokenizer JSON
    spec, sent, beats = heartbeat_bytes(tmp_path / "large", large)
    assert sent == [spec], "the tokenizer must reach the front exactly once"
    assert len(beats) >= HEARTBEATS
    assert max(beats) < 200, f"heartbeat frames of {beats} bytes: the tokenizer rides along"

    small_spec, small_sent, small_beats = heartbeat_bytes(tmp_path / "small", tokenizer_json(10))
    assert small_sent == [small_spec]
    # Bytes per heartbeat do not depend on the tokenizer at all: the same for 10 words and for 400,000.
    assert set(beats) == set(small_beats), (beats, small_beats)


async def test_a_front_keeps_the_tokenizer_it_was_sent_through_the_heartbeats(tmp_path: Path) -> None:
    engine = BigTokenizerEngine(tokenizer_json(1000))
    with engine_serving(tmp_path, engine, 1) as (addresses, _):
        client = EngineClient(addresses, 0)
        seen: list[Status] = []
        on_status = client._on_status

        def counted(status: Status) -> None:
            seen.append(status)
            on_status(status)

        client._on_status = counted  # type: ignore[method-assign]
        await client.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while sum(s.state is EngineState.READY and s.text is None for s in seen) < HEARTBEATS:
                assert loop.time() < deadline, f"heartbeats did not come: {[s.state for s in seen]}"
                await asyncio.sleep(0.01)
            assert client.status is not None and client.status.state is EngineState.READY
            assert client.status.text == engine.spec
        finally:
            await client.close()
