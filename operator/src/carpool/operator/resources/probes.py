"""Probes of the runtime container, on the runtime's health contract (ARCHITECTURE.md).

- startup probe on /v2/health/ready: the runtime answers 200 there only after the model is loaded and
  warm-up has finished, so `startupTimeoutSeconds` (= `failureThreshold x periodSeconds`) is really
  enforced: a hung download or a warm-up that never ends gets the container restarted, instead of a
  pod that stays unready forever. (Probing liveness here would pass as soon as the server listens.)
- readiness on /v2/health/ready: 503 until warm-up has finished and again while draining;
- liveness on /v2/health/live: 200 while the fronts serve and the engine runs. It only starts after the
  startup probe has passed, so a long load never counts against it.

All three probe the serving port, with `scheme: HTTPS` when `spec.tls` is set (`access.probe_target`).
"""

from __future__ import annotations

import math
from typing import Any

from carpool.operator.resources.access import probe_target
from carpool.operator.spec import BatchedModelSpec

READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
STARTUP_PERIOD_SECONDS = 5


def startup_failure_threshold(spec: BatchedModelSpec) -> int:
    return math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)


def probes(spec: BatchedModelSpec) -> dict[str, Any]:
    """The container's `startupProbe`, `readinessProbe` and `livenessProbe`."""
    target = probe_target(spec)
    return {
        "startupProbe": {
            "httpGet": {"path": READY_PATH, **target},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 3,
            "failureThreshold": startup_failure_threshold(spec),
        },
        "readinessProbe": {
            "httpGet": {"path": READY_PATH, **target},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": LIVE_PATH, **target},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }
