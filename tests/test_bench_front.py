"""bench.front's accounting: CPU of a server's process tree, and of the processes that listen on its port
(the fronts) apart from the others (an engine process); its flags for several front processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

from bench.front import FrontRun, serve_flags, table
from bench.server import ServerProcess, free_port

# A "server" that listens on the port and burns 0.2 s of CPU, with a child that does not listen and
# burns 0.4 s; each prints when done and then idles until killed.
SERVER = textwrap.dedent(
    """
    import socket, subprocess, sys, time
    def burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    child = subprocess.Popen([sys.executable, "-c", '''
    import sys, time
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass
    print("child done", flush=True)
    time.sleep(60)
    '''], stdout=sys.stdout)
    print(f"child {child.pid}", flush=True)
    sock = socket.socket()
    sock.bind(("127.0.0.1", int(sys.argv[1])))
    sock.listen()
    burn(0.2)
    print("parent done", flush=True)
    child.wait()
    """
)


def test_cpu_of_the_tree_and_of_the_listening_fronts() -> None:
    port = free_port()
    server = ServerProcess([], port=port)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE)
    server._proc = proc  # measured as if `carpool serve` had started it
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline().split()[1])
        seen = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert seen == {b"parent done", b"child done"}
        total, fronts = server.tree_cpu_seconds()
        assert total >= 0.6  # parent and child
        assert 0.2 <= fronts < total - 0.3  # the parent only: the child does not listen
    finally:
        if child:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait(30)


def test_flags_and_table() -> None:
    assert serve_flags(1) == ["--model.engine", "zeros", "--warmup.enabled", "false", "--server.workers", "1"]
    assert serve_flags(2, ["--x"])[-3:] == ["--server.workers", "2", "--x"]
    runs = [
        FrontRun(1, 16, 10.0, 5000, 0, 2.0, 1.75, 0.1, 0.2),
        FrontRun(1, 16, 10.0, 4000, 0, 2.0, 2.0, 0.1, 0.2),
    ]
    text = table(runs, "after")
    assert (
        "| after: 1 front process, 16 clients | 450 (runs: 500, 400) | 0.425 ms (runs: 0.350, 0.500)" in text
    )
