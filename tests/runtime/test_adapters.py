"""The adapter registry: device slots with least-recently-used eviction, a bounded host tier that keeps
what requests hold, adapters asked for never evicted, unloading while requests still hold an adapter.
Pure, with stamps for time."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.runtime.adapters import AdapterRegistry
from carpool.runtime.config import ConfigError, LoraConfig
from carpool.runtime.errors import InvalidAdapter, ModelNotFound
from carpool.runtime.sources import SourceKind, resolve_adapter_source
from tests.runtime.factories import runtime_config


def registry(max_loras: int = 2, max_cpu_loras: int = 5, names: str = "abcde") -> AdapterRegistry:
    reg = AdapterRegistry(max_loras, max_cpu_loras)
    for name in names:
        reg.add(name, f"/adapters/{name}", now=0.0)
    return reg


def test_slots_go_to_the_least_recently_used_adapter_not_asked_for() -> None:
    reg = registry()
    first = reg.place({"a", "b"}, now=1.0)
    assert first.load == [("a", 0), ("b", 1)]
    assert reg.place({"a"}, now=2.0).load == []  # resident: nothing to copy
    third = reg.place({"c"}, now=3.0)
    assert third.load == [("c", 1)]  # b was used longest ago
    assert reg.on_device() == {"a": 0, "c": 1}
    fourth = reg.place({"c", "b"}, now=4.0)  # c is asked for: a goes although it was used after b
    assert fourth.load == [("b", 0)] and fourth.slots == {"c": 1, "b": 0}


def test_the_host_tier_keeps_max_cpu_loras_and_says_which_to_read_again() -> None:
    reg = registry(max_loras=1, max_cpu_loras=2, names="")
    reg.add("a", "/a", now=1.0)
    reg.add("b", "/b", now=2.0)
    assert reg.take_dropped() == []
    reg.place({"b"}, now=3.0)
    reg.add("c", "/c", now=4.0)  # three read, two kept: a was used longest ago and is on no slot
    assert reg.take_dropped() == ["a"] and sorted(reg.on_host()) == ["b", "c"]
    assert reg.acquire("a") is False  # the caller reads it again before scheduling its request
    with pytest.raises(ValueError, match="before its weights were read"):
        reg.place({"a"}, now=5.0)
    reg.hosted("a", now=5.0)
    assert reg.take_dropped() == ["c"]  # b is on the device slot, a is held by a request
    assert reg.place({"a"}, now=6.0).load == [("a", 0)]


def test_adapters_held_by_requests_stay_on_the_host_beyond_the_tier() -> None:
    reg = registry(max_loras=1, max_cpu_loras=1, names="")
    reg.add("a", "/a", now=1.0)
    assert reg.acquire("a") is True
    reg.add("b", "/b", now=2.0)
    assert reg.take_dropped() == []  # a's request has not run yet: its weights stay
    reg.release("a")
    reg.add("c", "/c", now=3.0)
    assert sorted(reg.take_dropped()) == ["a", "b"]


def test_a_step_over_max_loras_is_a_bug_the_registry_refuses() -> None:
    with pytest.raises(ValueError, match="more than max_loras"):
        registry().place({"a", "b", "c"}, now=1.0)


def test_unloading_an_adapter_in_use_hides_it_at_once_and_frees_it_after_its_last_request() -> None:
    reg = registry()
    reg.acquire("a")
    reg.place({"a"}, now=1.0)
    assert reg.remove("a") is False
    assert "a" not in reg.names() and "a" not in reg
    with pytest.raises(ModelNotFound):
        reg.acquire("a")
    assert reg.place({"a"}, now=2.0).slots == {"a": 0}  # the running request still runs with it
    with pytest.raises(InvalidAdapter, match="still finishing"):
        reg.add("a", "/elsewhere", now=2.0)
    reg.release("a")
    assert reg.on_device() == {} and reg.take_dropped() == ["a"]
    reg.add("a", "/elsewhere", now=3.0)
    assert reg.source("a") == "/elsewhere"


def test_names_are_unique_and_unknown_names_are_not_found() -> None:
    reg = registry()
    with pytest.raises(InvalidAdapter, match="already loaded"):
        reg.add("a", "/x", now=1.0)
    with pytest.raises(ModelNotFound, match="'zz'"):
        reg.remove("zz")
    assert reg.remove("b") is True and reg.names() == ["a", "c", "d", "e"]


def test_adapters_on_the_device_keep_their_host_copy() -> None:
    reg = registry(max_loras=2, max_cpu_loras=2, names="ab")
    reg.place({"a", "b"}, now=1.0)
    reg.place({"a"}, now=5.0)
    reg.add("c", "/adapters/c", now=6.0)  # b is the least recently used, but on a slot
    assert reg.take_dropped() == []
    assert reg.place({"c"}, now=7.0).dropped == ["b"]  # c took b's slot: now b's host copy goes


def test_config_checks_the_lora_section() -> None:
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be at least lora.max_loras \(4\)"):
        LoraConfig(max_loras=4, max_cpu_loras=2)
    assert LoraConfig(adapters={"a": "/a", "b": "/b"}, max_loras=1).cpu_slots == 2
    with pytest.raises(ValueError, match="without spaces"):
        LoraConfig(adapters={"my adapter": "/a"})
    with pytest.raises(ValueError, match=r"need model\.task 'generate', not 'embed'"):
        runtime_config(lora={"enabled": True})
    with pytest.raises(ValueError, match="'base' is the base model's own name"):
        runtime_config(model={"task": "generate", "name": "base"}, lora={"adapters": {"base": "/a"}})


def test_adapter_sources_resolve_like_model_sources(tmp_path: Path) -> None:
    inner = tmp_path / "wrapped" / "my-adapter"
    inner.mkdir(parents=True)
    (inner / "adapter_config.json").write_text("{}")
    assert resolve_adapter_source(str(tmp_path / "wrapped")).location == str(inner)
    assert resolve_adapter_source("org/some-lora").kind is SourceKind.HUB
    with pytest.raises(ConfigError, match="no installed package 'not_a_package_here'"):
        resolve_adapter_source("pkg:not_a_package_here")
    with pytest.raises(ConfigError, match=r"no adapter_config\.json"):
        resolve_adapter_source(str(tmp_path))
    with pytest.raises(ConfigError, match="neither an existing folder"):
        resolve_adapter_source(str(tmp_path / "missing"))
