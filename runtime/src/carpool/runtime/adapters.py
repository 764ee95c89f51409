"""Which LoRA adapters exist, which sit on the device and which on the host: pure bookkeeping.

Three tiers, as in S-LoRA and vLLM: every *known* adapter has a source (a folder) it can be read from;
at most `max_cpu_loras` have their weights in host memory (more only while requests in flight hold
them: those stay); at most `max_loras` of those sit in a device slot, where a step can use them.
`place(names, now)` is asked before each step for the adapters of the running sequences: it keeps those
already in a slot and gives each other one a free slot or the slot of the least recently used adapter
not asked for; adapters asked for are never evicted (the scheduler keeps the running sequences within
`max_loras` distinct adapters, see `batching.lora_admission`). An adapter pushed off the device stays on
the host until the host tier is full too; then it is read from its source again when a request names it
(`acquire` says so), before that request is scheduled, so no step ever waits on a disk.

Requests hold a reference on their adapter from submission to their end (`acquire`/`release`).
Unloading an adapter that requests still hold makes its name unknown at once (new requests get 404)
and forgets it when the last one ends, so nothing running is disturbed.

No torch, no clock, no threads: the engine's busy loop owns it (`engine.adapters` carries out the
`Placement`); `now` stamps last use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.runtime.errors import InvalidAdapter, ModelNotFound


@dataclass
class _Entry:
    source: str
    refs: int = 0
    retiring: bool = False
    on_host: bool = False
    slot: int | None = None
    last_used: float = float("-inf")


@dataclass
class Placement:
    """What the engine must do before a step, and where each of the step's adapters sits."""

    slots: dict[str, int] = field(default_factory=dict)
    """The device slot of each adapter asked for."""
    load: list[tuple[str, int]] = field(default_factory=list)
    """(adapter, slot): copy the adapter's host weights into the slot."""
    dropped: list[str] = field(default_factory=list)
    """Adapters whose host weights to free (the host tier was full, or they were unloaded)."""


class AdapterRegistry:
    """Known adapters and the device and host tiers they occupy."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras}): "
                "every adapter on the device is also held on the host"
            )
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._free_slots = list(range(max_loras))
        self._pending_drop: list[str] = []

    # -- what exists ----------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Adapters requests may name, in the order they were added."""
        return [name for name, entry in self._entries.items() if not entry.retiring]

    def source(self, name: str) -> str:
        return self._entries[name].source

    def __contains__(self, name: object) -> bool:
        entry = self._entries.get(name) if isinstance(name, str) else None
        return entry is not None and not entry.retiring

    def holds(self, name: str) -> bool:
        """Known, or unloaded but still held by requests."""
        return name in self._entries

    def add(self, name: str, source: str, now: float) -> None:
        """Register an adapter whose weights were just read onto the host (they count as used now)."""
        if name in self:
            raise InvalidAdapter(f"adapter {name!r} is already loaded; unload it first to replace it")
        if name in self._entries:
            raise InvalidAdapter(
                f"adapter {name!r} is still finishing requests since it was unloaded; retry shortly"
            )
        self._entries[name] = _Entry(source, on_host=True, last_used=now)
        self._pending_drop.extend(self._trim_host(keep={name}))

    def remove(self, name: str) -> bool:
        """Unload: the name is unknown from now on; True if it was forgotten at once, False when requests
        still hold it (it is forgotten when the last ends)."""
        entry = self._entries.get(name)
        if entry is None or entry.retiring:
            raise ModelNotFound(f"no LoRA adapter named {name!r} is loaded")
        if entry.refs:
            entry.retiring = True
            return False
        self._forget(name)
        return True

    # -- requests -------------------------------------------------------------------------------

    def acquire(self, name: str) -> bool:
        """A request holds `name` until `release`; True if its weights are on the host, False if they
        must be read from its source first (then `hosted`)."""
        if name not in self:
            raise ModelNotFound(f"no LoRA adapter named {name!r} is loaded")
        entry = self._entries[name]
        entry.refs += 1
        return entry.on_host

    def release(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs <= 0 and entry.retiring:
            self._forget(name)

    def hosted(self, name: str, now: float) -> None:
        """`name`'s weights were read onto the host again."""
        entry = self._entries.get(name)
        if entry is None:
            self._pending_drop.append(name)  # forgotten while it was read: free them again
            return
        entry.on_host = True
        entry.last_used = now
        self._pending_drop.extend(self._trim_host(keep={name}))

    def refs(self, name: str) -> int:
        entry = self._entries.get(name)
        return entry.refs if entry is not None else 0

    # -- tiers ----------------------------------------------------------------------------------

    def on_device(self) -> dict[str, int]:
        return {name: e.slot for name, e in self._entries.items() if e.slot is not None}

    def on_host(self) -> list[str]:
        return [name for name, e in self._entries.items() if e.on_host]

    def place(self, names: set[str], now: float) -> Placement:
        """Put every adapter of `names` in a device slot; see the module docstring."""
        if len(names) > self.max_loras:
            raise ValueError(f"a step uses {len(names)} adapters, more than max_loras ({self.max_loras})")
        plan = Placement(dropped=self.take_dropped())
        # Those already resident first, so that a newcomer never takes the slot of one asked for.
        for name in sorted(names, key=lambda n: (self._entries[n].slot is None, n)):
            entry = self._entries[name]  # KeyError: a sequence outlived its reference (a bug)
            if not entry.on_host:
                raise ValueError(f"adapter {name!r} was scheduled before its weights were read")
            entry.last_used = now
            if entry.slot is None:
                entry.slot = self._free_slot(names)
                plan.load.append((name, entry.slot))
            plan.slots[name] = entry.slot
        plan.dropped.extend(self._trim_host(keep=names))
        return plan

    def take_dropped(self) -> list[str]:
        """Adapters whose host weights to free now (host tier full, or unloaded)."""
        dropped, self._pending_drop = self._pending_drop, []
        return dropped

    def _free_slot(self, busy: set[str]) -> int:
        if self._free_slots:
            return self._free_slots.pop(0)
        victims = [(e.last_used, n) for n, e in self._entries.items() if e.slot is not None and n not in busy]
        _, victim = min(victims)  # non-empty: at most max_loras adapters are asked for
        entry = self._entries[victim]
        slot = entry.slot
        assert slot is not None
        entry.slot = None
        return slot

    def _trim_host(self, keep: set[str]) -> list[str]:
        """Free host weights, least recently used first, of adapters on no slot and held by no request."""
        dropped: list[str] = []
        held = [(e.last_used, n) for n, e in self._entries.items() if e.on_host]
        excess = len(held) - self.max_cpu_loras
        for _, name in sorted(held):
            if excess <= 0:
                break
            entry = self._entries[name]
            if entry.slot is not None or entry.refs > 0 or name in keep:
                continue
            entry.on_host = False
            dropped.append(name)
            excess -= 1
        return dropped

    def _forget(self, name: str) -> None:
        entry = self._entries.pop(name)
        if entry.slot is not None:
            self._free_slots.append(entry.slot)
            self._free_slots.sort()
        if entry.on_host:
            self._pending_drop.append(name)
