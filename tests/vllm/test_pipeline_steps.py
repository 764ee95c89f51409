"""carpool's vLLM backend under pipeline parallelism, in vLLM's environment, with a stand-in engine core.

With `pipeline_parallel_size > 1` vLLM's `EngineCore` keeps a batch queue (one batch per stage) and its
step function, `step_with_batch_queue`, returns `None` for a step that only queued a batch, while requests
may already have left the scheduler for a batch in flight. The real thing needs two engine processes
joined over gloo (one start of about two minutes each: run by hand, README "What is proven where"), too
costly for the suite; so a stand-in core with vLLM's attribute names (`scheduler.has_requests()`,
`batch_queue`, `step_fn`, `post_step`) drives `VllmBackend.run` here, imported from vLLM's environment.
"""

from __future__ import annotations

import subprocess

from carpool.runtime.vllm.launch import engine_env
from tests.vllm.conftest import vllm_python

SCRIPT = """
from collections import deque

from carpool.runtime.vllm.backend import VllmBackend


class Scheduler:
    def has_requests(self):
        return False  # every request is in a batch in flight


class Core:
    scheduler = Scheduler()

    def __init__(self):
        self.batch_queue = deque(["batch of stage 0"])
        self.steps = 0

    def step_fn(self):
        self.steps += 1
        return None, True  # this step only moved the batch queue on

    def post_step(self, model_executed):
        pass


backend = VllmBackend.__new__(VllmBackend)  # no engine start: only the step loop is under test
backend._core = core = Core()
assert backend.has_work(), "a batch in flight is work"
result = backend.run([], [], [])
assert core.steps == 1, f"the step ran {core.steps} times"
assert result.deltas == [] and result.refused == [], result
print("ok")
"""


def test_a_batch_in_flight_is_stepped_and_a_step_without_outputs_yields_none() -> None:
    done = subprocess.run(
        [vllm_python(), "-c", SCRIPT],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]
