"""Kernel names for carpool's processes and threads.

Python 3.11 leaves every thread of a process with the executable's name (`python`), so `top -H`,
`ps -L`, `pidstat -t` and /proc cannot tell the model's threads from the loop's. Each long-lived thread
names itself here (Linux's 15-byte `comm`; nothing elsewhere):

    carpool-front    a front process's event loop           carpool-tokens   its tokenizer thread
    carpool-engine   the engine's main thread (model instance 0, which also loads and warms up)
    carpool-model-N  model instance N's thread               carpool-loop     the engine's busy loop
    carpool-input    the engine's input socket thread        carpool-output   its output socket thread

Threads that native code starts (OpenMP's workers, ZeroMQ's `ZMQbg/...`) take the name of the thread
that started them, so the model's OpenMP workers are `carpool-engine` too: `MODEL_THREADS` names every
thread whose CPU is the model's own. `bench.run` and `bench.profile` split a server's CPU by these names.
"""

from __future__ import annotations

import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor

FRONT = "carpool-front"
TOKENIZER = "carpool-tokens"
ENGINE = "carpool-engine"
LOOP = "carpool-loop"
INPUT = "carpool-input"
OUTPUT = "carpool-output"
LORA_READER = "carpool-lora"
_MODEL_PREFIX = "carpool-model-"

_PR_SET_NAME = 15
_MAX_BYTES = 15


def model_thread(instance: int) -> str:
    """The kernel name of model instance `instance`'s thread (instance 0 is the engine's main thread)."""
    return ENGINE if instance == 0 else f"{_MODEL_PREFIX}{instance}"


def is_model_thread(name: str) -> bool:
    """Whether a thread of that kernel name runs the model (its OpenMP workers included)."""
    return name == ENGINE or name.startswith(_MODEL_PREFIX)


def name_thread(name: str) -> None:
    """Give the calling thread `name` (cut to 15 bytes) as its kernel name; nothing where the kernel has no
    such call. The thread's Python name (`threading`) is left as it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):  # no libc symbols (a static interpreter): keep the old name
        pass


def one_thread_pool(python_name: str, kernel_name: str) -> ThreadPoolExecutor:
    """An executor of one thread, named `python_name` for Python and `kernel_name` for the kernel."""
    return ThreadPoolExecutor(
        1, thread_name_prefix=python_name, initializer=name_thread, initargs=(kernel_name,)
    )
