"""`python -m tests.runtime.serve_fake CONFIG_JSON`: `carpool serve` (the real supervisor, engine process
and front processes) with the scripted engine built inside the engine process."""

from __future__ import annotations

import json
import sys

from carpool.runtime.config import RuntimeConfig
from carpool.runtime.server import run

if __name__ == "__main__":
    sys.exit(
        run(RuntimeConfig.model_validate(json.loads(sys.argv[1])), "tests.runtime.fakes:scripted_engine")
    )
