"""Which private memory pool each captured training graph allocates in, and which pool to drop.

Plain bookkeeping (no torch), so the rules are tested exactly on any machine; the graphs and
their pools live in :mod:`gpu_runtime.finetune.graphs`.

By default every graph of a trainer shares one pool, sized by the largest shape captured:
smaller shapes reuse its memory, and the pool goes back to the device only when every graph is
dropped. With a :class:`PoolGroups` grouping (``group_of``), shapes of one group share a pool
and each group can be dropped on its own. :func:`separate_above` keeps the shapes of at most
``rows`` examples in one shared pool (what must fit beside decode's peak) and gives each larger
shape a pool of its own, which the memory side can release between quanta when decode needs
that memory (:meth:`PoolGroups.largest_separate`), and which is captured again when memory
comes back. A separate pool costs what that shape needs on top of the shared pool (the shared
pool stays), so it pays off only for shapes held when memory is plentiful.
:func:`separate_except` names the shared shapes by (rows, recompute) instead: e.g. every shape
with activation recomputation shared (they fit beside decode's peak) and the shape without it
pooled on its own, released when decode grows (the job then recomputes).
:class:`LaunchPoolGroups` places each shape when it is first captured, by whether its launch
was planned against the release plan (the host agent's loop, which has no warm-up plan).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable

from gpu_runtime.finetune.graph_policy import GraphKey

SHARED: Hashable = "shared"
"""The group of shapes that share one pool (every shape, without a grouping)."""

GroupOf = Callable[[GraphKey], Hashable]


def separate_above(rows: int) -> GroupOf:
    """Shapes of at most ``rows`` examples share a pool (:data:`SHARED`); each larger shape
    (by its row count) gets its own."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")

    def group_of(key: GraphKey) -> Hashable:
        return SHARED if key.rows <= rows else ("rows", key.rows)

    return group_of


def separate_except(shared: Collection[tuple[int, bool]]) -> GroupOf:
    """Shapes whose ``(rows, recompute)`` is in ``shared`` share a pool (:data:`SHARED`);
    every other shape gets its own."""
    names = frozenset((int(rows), bool(recompute)) for rows, recompute in shared)

    def group_of(key: GraphKey) -> Hashable:
        shape = (key.rows, key.recompute)
        return SHARED if shape in names else ("shape", *shape)

    return group_of


class PoolGroups:
    """The captured keys of each pool group (the graphs' pools are the caller's)."""

    def __init__(self, group_of: GroupOf | None = None) -> None:
        self.group_of: GroupOf = group_of or (lambda key: SHARED)
        self._keys: dict[Hashable, set[GraphKey]] = {}

    def add(self, key: GraphKey) -> Hashable:
        """``key`` was captured; returns its group."""
        group = self.group_of(key)
        self._keys.setdefault(group, set()).add(key)
        return group

    def remove(self, key: GraphKey) -> Hashable | None:
        """``key``'s graph was dropped; returns its group when that left the group empty (its
        pool can go), else None."""
        group = self.group_of(key)
        keys = self._keys.get(group)
        if keys is None or key not in keys:
            return None
        keys.discard(key)
        if keys:
            return None
        del self._keys[group]
        return group

    def keys_of(self, group: Hashable) -> set[GraphKey]:
        return set(self._keys.get(group, ()))

    def groups(self) -> dict[Hashable, set[GraphKey]]:
        """Every group holding a captured key, with its keys."""
        return {group: set(keys) for group, keys in self._keys.items()}

    def largest_separate(self) -> Hashable | None:
        """The group, other than :data:`SHARED`, whose largest key has the most rows (ties:
        the longest sequence, then a key without recomputation, which holds more): the one to
        release first. None when every captured key is in the shared pool."""
        best: tuple[int, int, bool] | None = None
        found: Hashable | None = None
        for group, keys in self._keys.items():
            if group == SHARED:
                continue
            size = max((key.rows, key.seq_len, not key.recompute) for key in keys)
            if best is None or size > best:
                best, found = size, group
        return found

    def clear(self) -> None:
        self._keys.clear()


class LaunchPoolGroups(PoolGroups):
    """Pool groups decided per launch, for a finetune side that learns only at launch time
    which shapes fit beside decode's peak (the host agent's loop): a shape first captured
    while :attr:`separate_launch` is set (a launch planned against the release plan) gets a
    pool of its own, ``("shape", rows, recompute)`` as :func:`separate_except` names it; any
    other shape goes to the shared pool. A shape keeps its group while any of its keys is
    captured (a pool's graphs must be told apart by the group they were captured in) and is
    placed again at its next capture once they are all dropped."""

    def __init__(self) -> None:
        super().__init__(self._group)
        self.separate_launch = False
        """Whether the micro-batch launched now was planned against the release plan."""
        self._placed: dict[tuple[int, bool], Hashable] = {}

    def _group(self, key: GraphKey) -> Hashable:
        shape = (key.rows, key.recompute)
        placed = self._placed.get(shape)
        if placed is not None:
            return placed
        return ("shape", *shape) if self.separate_launch else SHARED

    def add(self, key: GraphKey) -> Hashable:
        group = super().add(key)
        self._placed[(key.rows, key.recompute)] = group
        return group

    def remove(self, key: GraphKey) -> Hashable | None:
        emptied = super().remove(key)
        shape = (key.rows, key.recompute)
        if shape in self._placed and not any(
            (k.rows, k.recompute) == shape for keys in self._keys.values() for k in keys
        ):
            del self._placed[shape]
        return emptied

    def clear(self) -> None:
        super().clear()
        self._placed.clear()
