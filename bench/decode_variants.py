"""The engine variants ``bench/decode.py`` times (``--variants``), by name.

- ``sync`` / ``async``: `EngineConfig.async_scheduling` off / on, on the run's first graphs;
- ``skinny`` / ``skinny-all``: async with the split-K Triton GEMMs for q|k|v and o (all four
  projections) at batch <= 64, on re-captured graphs;
- ``prefetch-<targets>[-el]``: async with L2 prefetch of `<targets>` (``+``-joined
  `prefetch_plan.PREFETCH_TARGETS`, e.g. ``prefetch-o+kv``), ``-el`` with L2's evict-last
  priority, on re-captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_runtime.engine.prefetch_plan import L2Prefetch

SKINNY_MAX_ROWS = 64


@dataclass(frozen=True)
class Variant:
    """How one variant sets the engine up."""

    name: str
    async_scheduling: bool = True
    skinny_rows: int = 0
    skinny_projections: frozenset[str] = frozenset(("qkv", "o"))
    prefetch: L2Prefetch = field(default_factory=L2Prefetch)

    @property
    def recaptured(self) -> bool:
        """Whether the variant's decode graphs differ from the run's first ones."""
        return self.skinny_rows > 0 or self.prefetch.enabled

    def runs(self, batch: int) -> bool:
        """Whether the variant times this batch (the skinny GEMMs exist up to 64 rows)."""
        return self.skinny_rows == 0 or batch <= self.skinny_rows


def parse_variant(name: str) -> Variant:
    """The variant named `name`; a clear ValueError for any other name."""
    if name in ("sync", "async"):
        return Variant(name, async_scheduling=name == "async")
    if name in ("skinny", "skinny-all"):
        projections = ("qkv", "o", "gate_up", "down") if name == "skinny-all" else ("qkv", "o")
        return Variant(name, skinny_rows=SKINNY_MAX_ROWS, skinny_projections=frozenset(projections))
    if name.startswith("prefetch-"):
        spec = name.removeprefix("prefetch-")
        evict_last = spec.endswith("-el")
        targets = frozenset(spec.removesuffix("-el").split("+"))
        try:
            prefetch = L2Prefetch(targets=targets, evict_last=evict_last)
        except ValueError as exc:
            raise ValueError(f"variant {name!r}: {exc}") from None
        return Variant(name, prefetch=prefetch)
    raise ValueError(
        f"unknown variant {name!r}: sync, async, skinny, skinny-all or prefetch-<targets>[-el]"
    )
