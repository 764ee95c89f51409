"""bench.profile's arithmetic: py-spy's raw samples by thread, cores from /proc ticks, and the report."""

from __future__ import annotations

import pytest
from bench.profile import Process, parse_raw, python_thread_names, report
from bench.server import ServerCpu, thread_cores

RAW = """\
thread (101): MainThread;run (/x/core.py:10);forward (/x/model.py:20);matmul (/x/ops.py:5) 30
thread (101): MainThread;run (/x/core.py:10);forward (/x/model.py:21) 10
thread (0x66): carpool-engine-loop;loop (/x/core.py:40);take (/x/core.py:50) 6
not a stack line
thread (101): MainThread;run (/x/core.py:10);forward (/x/model.py:20);matmul (/x/ops.py:5) 20
"""


def test_samples_add_up_per_thread_and_function() -> None:
    threads = parse_raw(RAW.splitlines())
    assert set(threads) == {101, 0x66}
    main = threads[101]
    assert (main.name, main.total) == ("MainThread", 60)
    assert main.own == {"matmul (ops.py)": 50, "forward (model.py)": 10}  # lines of one function add up
    assert main.within["forward (model.py)"] == 60 and main.within["run (core.py)"] == 60
    assert threads[0x66].name == "carpool-engine-loop"


def test_cores_are_ticks_over_time_for_threads_alive_at_both_snapshots() -> None:
    before = {(1, 1): 100, (1, 2): 50, (1, 3): 7}
    after = {(1, 1): 300, (1, 2): 60, (1, 4): 9}
    assert thread_cores(before, after, seconds=2.0, ticks=100) == {(1, 1): 1.0, (1, 2): 0.05}


def test_a_servers_cores_split_by_the_kernel_names_of_its_processes_and_threads() -> None:
    # supervisor 1; engine 2 (main thread = instance 0, its OpenMP worker, instance 1, loop, ZeroMQ's I/O);
    # fronts 3 and 4 (event loop, tokenizer thread)
    names = {
        (1, 1): "carpool",
        (2, 2): "carpool-engine",
        (2, 5): "carpool-engine",
        (2, 6): "carpool-model-1",
        (2, 7): "carpool-loop",
        (2, 8): "ZMQbg/IO/0",
        (3, 3): "carpool-front",
        (3, 9): "carpool-tokens",
        (4, 4): "carpool-front",
    }
    used = {
        (1, 1): 0.01,
        (2, 2): 0.8,
        (2, 5): 0.05,
        (2, 6): 0.75,
        (2, 7): 0.02,
        (2, 8): 0.004,
        (3, 3): 0.1,
        (3, 9): 0.02,
        (4, 4): 0.03,
        (2, 99): 0.5,  # a thread that ended before the names were read: not the model's
    }
    split = ServerCpu.split(used, names)
    assert split.model == pytest.approx(0.8 + 0.05 + 0.75)
    assert split.engine == pytest.approx(0.02 + 0.004 + 0.5)
    assert split.fronts == pytest.approx(0.1 + 0.02 + 0.03)
    assert split.rest == pytest.approx(0.01)
    assert split.outside_model == pytest.approx(split.engine + split.fronts + split.rest)


def test_the_report_gives_cpu_per_request_and_names_threads() -> None:
    samples = parse_raw(RAW.splitlines())
    engine = Process(7, "engine", {101: 0.8, 0x66: 0.04, 9: 0.02, 10: 0.001}, {9: "ZMQbg/IO/0", 10: "python"})
    idle = Process(8, "supervisor", {11: 0.0})
    text = report([engine, idle], requests_per_s=400.0, seconds=10.0, samples=samples)
    assert "| engine (7) | all | 0.861 | 2.153 |" in text
    assert "| | MainThread | 0.800 | 2.000 |" in text
    assert "| | carpool-engine-loop | 0.040 | 0.100 |" in text
    assert "| | ZMQbg/IO/0 | 0.020 | 0.050 |" in text
    assert "supervisor" not in text and "| python |" not in text  # idle processes and threads left out
    assert "83.3% matmul (ops.py)" in text  # own time of the main thread's heaviest frame


def test_python_thread_names_come_from_py_spy_dump() -> None:
    dump = (
        'Process 7: python -m x\nThread 13740 (idle): "MainThread"\n    run (core.py:10)\n'
        'Thread 13747 (active+gil): "carpool-engine-output"\n'
    )
    assert python_thread_names(dump) == {13740: "MainThread", 13747: "carpool-engine-output"}
