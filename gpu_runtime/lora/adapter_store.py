"""Finished adapters by name: a registry on disk, an LRU in host memory, and GPU slots.

:class:`AdapterManager` is what the decode engine calls:

* ``register(name, directory)`` — a PEFT adapter directory becomes servable as ``name``
  (listed by :meth:`names`, for ``/v1/models``);
* ``acquire(name) -> slot`` when a request for ``name`` is admitted, ``release(name)`` when it
  finishes. An adapter already in a slot is reused (reference-counted); otherwise it goes to a
  free slot, or evicts the least recently used slot that no running request holds. When every
  slot is held, :class:`NoFreeAdapterSlotError` tells the scheduler to keep the request waiting.
* Host copies (pinned on CUDA) of at most ``max_host_adapters`` adapters are kept in LRU order,
  so a re-acquired adapter is copied to the GPU without touching the disk.
* ``unregister(name)`` — ``name`` is no longer servable: it leaves :meth:`names` and host
  memory at once, so no new request acquires it; requests holding its slot keep it until they
  release it, and the slot is then cleared and freed.

The manager holds plain bookkeeping; the tensors live in :class:`StackedLoraWeights`. On a
tensor-parallel rank every rank runs the same calls in the same order (the engine's followers
mirror rank 0's), so slots agree across ranks; each rank's host copy is its own slice.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from gpu_runtime.lora.host_adapter import HostAdapter
from gpu_runtime.lora.stacked import StackedLoraWeights


class UnknownAdapterError(KeyError):
    """No adapter is registered under that name."""


class NoFreeAdapterSlotError(RuntimeError):
    """Every GPU slot holds an adapter that running requests use."""


class AdapterManager:
    """Registry + host LRU + GPU slot table for one decode engine (see the module docstring)."""

    def __init__(self, weights: StackedLoraWeights, max_host_adapters: int = 32) -> None:
        if max_host_adapters < 1:
            raise ValueError(f"max_host_adapters must be >= 1, got {max_host_adapters}")
        self.weights = weights
        self.max_host_adapters = max_host_adapters
        self._directories: dict[str, Path] = {}
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()  # oldest first
        self._slot_of: dict[str, int] = {}
        self._name_in_slot: list[str | None] = [None] * weights.num_slots
        self._refs: list[int] = [0] * weights.num_slots
        self._slot_lru: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(weights.num_slots)
        )
        self.disk_loads = 0
        self._retired: set[str] = set()  # unregistered while requests still held its slot

    def register(self, name: str, directory: str | Path) -> None:
        """Make ``name`` servable (read and checked now, so a bad adapter fails here)."""
        if name in self._directories:
            raise ValueError(f"adapter {name!r} is already registered")
        self._directories[name] = Path(directory)
        try:
            self._host_adapter(name)
        except BaseException:
            del self._directories[name]  # a bad adapter is not left half-registered
            raise
        self._retired.discard(name)  # served again: a slot it still holds stays its own

    def unregister(self, name: str) -> bool:
        """Stop serving ``name`` (see the module docstring); False when it was not registered."""
        if name not in self._directories:
            return False
        del self._directories[name]
        self._host.pop(name, None)
        slot = self._slot_of.get(name)
        if slot is not None:
            if self._refs[slot] == 0:
                self._free_slot(name, slot)
            else:
                self._retired.add(name)
        return True

    def _free_slot(self, name: str, slot: int) -> None:
        del self._slot_of[name]
        self._name_in_slot[slot] = None
        self.weights.clear_slot(slot)
        self._slot_lru.move_to_end(slot, last=False)  # the first one a new adapter takes

    def names(self) -> list[str]:
        return sorted(self._directories)

    def has(self, name: str) -> bool:
        """Whether ``name`` is registered (one dict lookup: safe from any thread)."""
        return name in self._directories

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def resident(self) -> list[str]:
        """Servable adapters in GPU slots now, in slot order (one unregistered while requests
        still hold its slot is left out: it takes no new request)."""
        return [n for n in self._name_in_slot if n is not None and n not in self._retired]

    def held_slots(self) -> int:
        """Slots that running requests hold; any other slot can take a new adapter."""
        return sum(1 for refs in self._refs if refs)

    def host_names(self) -> list[str]:
        """Adapters in host memory, least recently used first."""
        return list(self._host)

    def _host_adapter(self, name: str) -> HostAdapter:
        if name not in self._directories:
            raise UnknownAdapterError(name)
        if name in self._host:
            self._host.move_to_end(name)
            return self._host[name]
        adapter = HostAdapter.from_directory(
            name,
            self._directories[name],
            self.weights.config,
            pin=self.weights.device.type == "cuda",
            shard=self.weights.shard if self.weights.shard.size > 1 else None,
        )
        self.disk_loads += 1
        self._host[name] = adapter
        while len(self._host) > self.max_host_adapters:
            self._host.popitem(last=False)
        return adapter

    def has_free_slot(self) -> bool:
        """Whether some slot is held by no running request (so it can take a new adapter)."""
        return any(refs == 0 for refs in self._refs)

    def acquire(self, name: str) -> int:
        """The slot serving ``name`` for one more request, loading it if needed."""
        if name not in self._directories:
            raise UnknownAdapterError(name)
        slot = self._slot_of.get(name)
        if slot is None:
            free = [s for s in self._slot_lru if self._refs[s] == 0]
            if not free:
                raise NoFreeAdapterSlotError(
                    f"all {self.weights.num_slots} adapter slots are in use; {name!r} must wait"
                )
            slot = free[0]
            self.weights.write_slot(slot, self._host_adapter(name))  # checks before it writes
            evicted = self._name_in_slot[slot]
            if evicted is not None:
                del self._slot_of[evicted]
            self._name_in_slot[slot] = name
            self._slot_of[name] = slot
        self._refs[slot] += 1
        self._slot_lru.move_to_end(slot)
        return slot

    def release(self, name: str) -> None:
        """One request for ``name`` finished."""
        slot = self._slot_of.get(name)
        if slot is None or self._refs[slot] == 0:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        self._refs[slot] -= 1
        if self._refs[slot] == 0 and name in self._retired:
            self._retired.discard(name)
            self._free_slot(name, slot)
