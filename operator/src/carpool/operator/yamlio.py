"""YAML output people read: multi-line strings (descriptions, the runtime config) as literal blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=110)


def dump_all(documents: Iterable[Any]) -> str:
    return yaml.dump_all(list(documents), Dumper=_Dumper, sort_keys=False, width=110)
