"""How big a finetune quantum fits a memory budget, and whether it recomputes activations.

A quantum's shape is a :class:`QuantumShape`: whole examples per micro-batch (a power of two, so
few CUDA-graph shapes and reusable allocator blocks) and whether the micro-batch recomputes its
activations in the backward (``LoraTrainer.step_quantum(recompute=...)``). Its footprint is the
job's live state (``resident_bytes``: adapters, grads, optimizer) plus activation bytes per
token of its mode times its tokens, divided by a safety factor (the estimate); once a shape's
CUDA graphs are captured, what finetuning held after that capture (``footprints``, measured): a
replay allocates nothing more.

**Choice order** (:meth:`QuantumFit.choose`): the largest shape without recomputation that
fits; else the largest with recomputation; else nothing (the job pauses). A smaller micro-batch
without recomputation goes before a larger one with it: recomputation runs every decoder layer's
forward twice per micro-batch, while more whole examples per micro-batch add little to a LoRA
job's tokens/s, and nothing once one example is already a long sequence (the figures are in
``docs/decisions/0017-recompute-and-graph-release.md``).

Plain arithmetic (no torch): the memory bench (``python -m bench.memory``) and a co-location
policy size quanta with it against `EngineMemory.finetune_budget_bytes()` and, for shapes whose
graph pool is released between quanta, `finetune_release_plan_bytes()`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QuantumShape:
    """One quantum's micro-batch: examples and whether it recomputes activations."""

    examples: int
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.examples < 1:
            raise ValueError(f"a quantum needs >= 1 example, got {self.examples}")

    @property
    def label(self) -> str:
        """``"2"`` or ``"2r"`` (recomputing): keys of the bench's JSON."""
        return f"{self.examples}{'r' if self.recompute else ''}"

    @property
    def rank(self) -> tuple[bool, int]:
        """Sort key of the choice order: lower goes first."""
        return (self.recompute, -self.examples)


def best(shapes: Iterable[QuantumShape | None]) -> QuantumShape | None:
    """The first of ``shapes`` in the choice order (None when there is none)."""
    found = [s for s in shapes if s is not None]
    return min(found, key=lambda s: s.rank, default=None)


@dataclass
class QuantumFit:
    """What the finetune side knows to size a quantum (see the module docstring)."""

    resident_bytes: int
    """Live state kept between quanta (bytes)."""
    bytes_per_token: float
    """Activation bytes per token without recomputation."""
    max_examples: int
    """Most examples per micro-batch."""
    recompute_bytes_per_token: float | None = None
    """Activation bytes per token with recomputation; None: recomputation is not offered."""
    safety: float = 0.9
    """Estimates are divided by this (shrunk after an out-of-memory error)."""
    only_recompute: bool = False
    """Offer only shapes with recomputation (a job that must always recompute)."""
    footprints: dict[QuantumShape, int] = field(default_factory=dict)
    """Shape -> what finetuning held once that shape's graphs were captured."""

    def __post_init__(self) -> None:
        if self.max_examples < 1:
            raise ValueError(f"max_examples must be >= 1, got {self.max_examples}")
        if self.only_recompute and self.recompute_bytes_per_token is None:
            raise ValueError("only_recompute needs recompute_bytes_per_token")

    def shapes(self) -> list[QuantumShape]:
        """Every shape offered, in the choice order."""
        sizes = []
        n = 1
        while n <= self.max_examples:
            sizes.append(n)
            n *= 2
        modes = [] if self.only_recompute else [False]
        if self.recompute_bytes_per_token is not None:
            modes.append(True)
        return [QuantumShape(n, mode) for mode in modes for n in reversed(sizes)]

    def estimate_bytes(self, shape: QuantumShape, seq_len: int) -> int:
        """Resident state plus the mode's activation bytes for ``shape`` of ``seq_len``-token
        examples, divided by the safety factor."""
        per_token = self.recompute_bytes_per_token if shape.recompute else self.bytes_per_token
        if per_token is None:
            raise ValueError(f"no bytes per token for {shape}")
        return self.resident_bytes + int(per_token * shape.examples * seq_len / self.safety)

    def record_capture(self, shape: QuantumShape, held_bytes: int) -> None:
        """Finetuning holds ``held_bytes`` once ``shape``'s graphs are captured."""
        self.footprints[shape] = max(self.footprints.get(shape, 0), held_bytes)

    def fits(
        self,
        shape: QuantumShape,
        budget_bytes: int,
        seq_len: int,
        captured: Collection[QuantumShape] = (),
    ) -> bool:
        """By its measured footprint when its graphs are held (in ``captured``), else (or
        also) by the estimate."""
        held = self.footprints.get(shape)
        if shape in captured and held is not None and held <= budget_bytes:
            return True
        return self.estimate_bytes(shape, seq_len) <= budget_bytes

    def choose(
        self,
        budget_bytes: int,
        seq_len: int,
        captured: Collection[QuantumShape] = (),
        among: Collection[QuantumShape] | None = None,
    ) -> QuantumShape | None:
        """The first shape (of ``among``, default every shape offered) in the choice order
        that fits ``budget_bytes``; None when none does."""
        for shape in self.shapes():
            if among is not None and shape not in among:
                continue
            if self.fits(shape, budget_bytes, seq_len, captured):
                return shape
        return None

    def choose_measured(
        self,
        budget_bytes: int,
        among: Collection[QuantumShape],
        *,
        refused: Collection[QuantumShape] = (),
        captured: Collection[QuantumShape] = (),
        margin: float = 1.0,
    ) -> QuantumShape | None:
        """The first shape of ``among`` in the choice order whose measured footprint fits
        ``budget_bytes``, that footprint times ``margin`` for a shape not in ``captured`` (it
        would be captured again); measured shapes only (captured again only where their
        capture fitted before); ``refused``: shapes whose capture ran out of memory."""
        for shape in self.shapes():
            held = self.footprints.get(shape)
            if shape not in among or shape in refused or held is None:
                continue
            if held * (1.0 if shape in captured else margin) <= budget_bytes:
                return shape
        return None

    def warm_plan(
        self, budget_bytes: int, seq_len: int, release_bytes: int | None = None
    ) -> tuple[set[QuantumShape], list[QuantumShape]]:
        """(the shapes that share one graph pool, the shapes to capture, in order) for a job
        warming up with ``budget_bytes`` to plan for. Shared: the shape :meth:`choose` picks
        (else the smallest offered) and the smaller ones of its mode. To capture: those of them
        that fit by the estimate, smallest estimate first (the shared pool grows once per new
        largest), then, with ``release_bytes`` (graph pools releasable per shape), each shape
        the choice order puts before the shared ones that fits ``release_bytes``, each in a
        pool of its own."""
        offered = self.shapes()
        top = self.choose(budget_bytes, seq_len) or offered[-1]
        shared = {s for s in offered if s.recompute == top.recompute and s.examples <= top.examples}

        def estimate(shape: QuantumShape) -> int:
            return self.estimate_bytes(shape, seq_len)

        order = sorted((s for s in shared if estimate(s) <= budget_bytes), key=estimate)
        if release_bytes is not None:
            larger = [s for s in offered if s.rank < top.rank and s not in shared]
            order += sorted((s for s in larger if estimate(s) <= release_bytes), key=estimate)
        return shared, order
