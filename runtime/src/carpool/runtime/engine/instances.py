"""Model instances: batches an encoder runs at once, and the CPU threads each one gets.

Like Triton's instance group (`count` per device), with the weights shared: each instance is a thread
of the engine process that runs one batch at a time. On CPU, torch splits every operator of a forward
pass across its intra-op threads, which then wait for each other at the end of it; on this project's
2-core reference host, MiniLM in bfloat16 made 650-740 inputs/s offline as one batch on two threads and
800-860 as two batches on one thread each (`bench.offline --instances`). The waiting also makes a
multi-threaded forward pass fragile in a server: a front's thread that preempts one of its threads
stalls the other. A batch that starts while no other runs gets every thread, on the engine's main
thread (`engine.core` launches there whenever it is free), so one request alone runs as fast as with one
instance; with several running, each has its share.

Only the main thread ever takes every thread; a batch on another instance's thread gets its share even
when it starts alone (the moment the main thread has finished but the loop has not yet seen it). GNU
OpenMP, which torch's CPU wheels use, keeps the workers of a thread's team for as long as that thread
lives, and once it manages more threads than there are CPUs it stops spinning between parallel regions:
every region of the main thread's team then waits for its worker to wake up. Measured on the 2-core
reference host (MiniLM, bfloat16, one input at a time on the main thread with 2 threads): 6.3 ms, and
14.9-15.3 ms while a second live thread has once run a 2-thread team (back to 6.3 ms when that thread
ends; a thread that only ever ran 1 thread changes nothing). In the server that thread is a model
instance, which lives as long as the engine: one such batch doubled every lone request's latency after
a burst of load.

Where a batch runs and on how many threads is decided when the busy loop launches it (`InstancePlan.
may_start`, `InstancePlan.threads_for`, pure), from what runs already and the work
queued behind it:
- a batch that starts while nothing runs and nothing waits behind it runs alone, on the main thread, on
  every thread, whatever its size. (A rule that left a lone batch under 256 computed tokens on its share,
  to spare the core an OpenMP worker spins on, made the 1-client p50 9.6 ms worse and the p99 at 70% of
  saturation 792 -> 1,351 ms on the 2-core reference host, bench/RESULTS.md: a lone request is latency);
- while a batch holding every thread runs, no other starts beside it: a second batch's thread would take
  a core that team waits for at every operator's end (the lockstep stall above), and both would run at
  a fraction of their speed. What arrives meanwhile waits for it and forms the next batch;
- otherwise (work queued behind the batch, or another batch running on its share) the batches run side
  by side, each on its share: throughput, as at saturation.

`InstancePool` applies the chosen count in the thread that runs the batch (never more than its share
off the main thread); `instance_pool` builds plan and pool for an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from carpool.runtime.models.base import CpuThreads, Engine

AUTO_CPU_INSTANCES = 2


@dataclass(frozen=True)
class InstancePlan:
    count: int
    """Batches that run at once."""
    threads: int
    """CPU threads of the engine (0: not a CPU engine; thread counts are then left alone)."""

    @property
    def each(self) -> int:
        """Threads of a batch running beside others (never below one)."""
        return max(1, self.threads // self.count)

    def share(self, running: int, main: bool = True) -> int:
        """Threads of a batch that starts while `running` others run, on the main thread or not (0: leave
        them alone). Every thread only for a batch alone on the main thread (see the module's docstring)."""
        if not self.threads:
            return 0
        return self.threads if running == 0 and main else self.each

    def may_start(self, running: Sequence[int]) -> bool:
        """Whether a batch may start beside the batches running on `running` threads each: not while
        one of them holds every thread (nor with every instance busy)."""
        if len(running) >= self.count:
            return False
        return not (self.threads and self.count > 1 and any(n > self.each for n in running))

    def threads_for(self, running: Sequence[int], waiting: int) -> int:
        """Threads of a batch that starts beside batches running on `running` threads each, with `waiting`
        inputs left queued behind it (0: leave them alone, not a CPU engine). Every thread for a batch
        that starts alone with nothing behind it; its share when another runs or will start beside it."""
        if not self.threads:
            return 0
        if self.count == 1:
            return self.threads
        return self.each if running or waiting else self.threads

    def describe(self) -> str:
        if self.count == 1:
            return "1 model instance (one batch at a time)"
        if not self.threads:
            return f"{self.count} model instances (batches run at once)"
        return (
            f"{self.count} model instances (batches run at once): {self.each} CPU thread(s) each while "
            f"several run, {self.threads} for one running alone"
        )


def plan_instances(requested: int | None, device: str, cpu_threads: int) -> InstancePlan:
    """How many batches an encoder runs at once. `cpu_threads`: the intra-op threads of a CPU engine
    whose thread count can be set per thread, else 0 (a CUDA engine, a fake, the null engine).

    Default: `AUTO_CPU_INSTANCES` on such a CPU engine with at least that many threads, else 1."""
    on_cuda = device.startswith("cuda")
    if requested is not None and requested > 1 and on_cuda:
        raise ValueError(
            f"model.instances {requested} on {device}: one instance per GPU (a second would share its "
            "stream and its CUDA graphs); for more batches at once run more engine processes "
            "(model.processes: each has a stream, graphs and an interpreter lock of its own)"
        )
    threads = 0 if on_cuda else cpu_threads
    if requested is not None:
        return InstancePlan(requested, threads)
    if threads >= AUTO_CPU_INSTANCES:
        return InstancePlan(AUTO_CPU_INSTANCES, threads)
    return InstancePlan(1, threads)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class InstancePool:
    """Counts the running batches and gives each one its thread share as it starts (any thread)."""

    def __init__(
        self,
        plan: InstancePlan,
        use_threads: Callable[[int], None],
        on_main: Callable[[], bool] = on_main_thread,
    ) -> None:
        self.plan = plan
        self._use_threads = use_threads
        """Sets the calling thread's intra-op threads (`torch.set_num_threads`)."""
        self._on_main = on_main
        """Whether the calling thread is the one torch was initialised in (it alone takes every thread)."""
        self._lock = threading.Lock()
        self._running = 0

    @contextmanager
    def slot(self, threads: int | None = None) -> Iterator[int]:
        """Around one batch, in the thread that runs it: sets and yields its thread count (`threads`, as
        the busy loop chose it with `InstancePlan.threads_for`, never more than the share off the main
        thread; None: by what runs now, `InstancePlan.share`), and puts the engine's count back after it
        (so the thread's torch reads the engine's count between batches, as a caller that asks
        `torch.get_num_threads()` expects; no team is made until a batch runs)."""
        main = self._on_main()
        with self._lock:
            if threads is None:
                threads = self.plan.share(self._running, main)
            elif not main and threads > self.plan.each:
                threads = self.plan.each
            self._running += 1
        try:
            if threads:
                self._use_threads(threads)
            yield threads
        finally:
            with self._lock:
                self._running -= 1
            if threads and threads != self.plan.threads:
                self._use_threads(self.plan.threads)


def instance_pool(engine: Engine, requested: int | None) -> InstancePool:
    """The instances an encoder engine runs with `model.instances: requested` (None: the default), with
    their thread shares: the engine's (`engine.encoder`) and the offline limit's (`bench.offline`)."""
    threaded = engine if isinstance(engine, CpuThreads) else None
    plan = plan_instances(requested, engine.info.device, threaded.cpu_threads() if threaded else 0)
    return InstancePool(plan, threaded.use_cpu_threads if threaded else lambda threads: None)
