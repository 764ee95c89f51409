"""Does a live object already hold everything the operator wants? (applied only when it differs)

The API server adds defaults (probe schemes, `terminationMessagePath`, volume modes, ...), so the
comparison is *desired is a subset of live*: every field the operator sets must be there with the same
value; fields the server or other controllers add are left alone. Lists compare item by item and must
have the same length, because the operator owns the lists it sets (containers, env, ports, volumes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def differences(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths where `live` does not hold what `desired` says; empty when nothing needs applying."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        found: list[str] = []
        for key, value in desired.items():
            found += differences(value, live.get(key), f"{path}.{key}")
        return found
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        found = []
        for index, (want, have) in enumerate(zip(desired, live, strict=True)):
            found += differences(want, have, f"{path}[{index}]")
        return found
    if desired == live:
        return []
    # Quantities and int-or-string values may come back as strings ("1" for 1).
    if isinstance(desired, int | float) and not isinstance(desired, bool) and str(desired) == str(live):
        return []
    return [path]
