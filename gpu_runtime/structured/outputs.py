"""`StructuredOutputs`: one engine's grammar matchers, one per constrained request, and the
masking of their rows' logits.

Life of a constrained request: `admit` (at `Engine.add_request`) creates its matcher from the
compiled grammar (compiled before by the server in a worker thread, else here); each step that
samples it, `constrain` fills its row of the bitmask from the matcher and masks its logits
before sampling; once the step's token is read back, `accept` advances the matcher with it;
`release` drops the matcher when the request finishes or is aborted.

The matcher is keyed by request id and lives outside the runner's per-request state, so a
preempted request (recomputed from its prompt and output tokens) keeps it as it was: its
output tokens were each accepted once when sampled, and the recompute samples only the next
token. A step without constrained rows costs one dict-emptiness check.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpu_runtime.structured.bitmask import TokenBitmask
from gpu_runtime.structured.compiler import StructuredCompiler
from gpu_runtime.structured.params import StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar as xgr


class Acceptance(enum.Enum):
    """What a sampled token did to its request's matcher."""

    CONTINUE = "continue"
    """Accepted; the grammar goes on."""
    TERMINATED = "terminated"
    """Accepted, and the matcher has ended (it accepted a stop token): the request stops."""
    REJECTED = "rejected"
    """Not accepted (cannot happen to a token sampled under the mask)."""


class StructuredOutputs:
    """Matchers and the bitmask of one engine (`max_rows`: the most rows a step samples)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_rows: int,
        device: torch.device,
        fill_threads: int = 8,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._tokenizer = tokenizer
        self._stop_token_ids = tuple(stop_token_ids)
        self._max_rows = max_rows
        self._fill_threads = fill_threads
        self._compiler: StructuredCompiler | None = None
        self._bitmask: TokenBitmask | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self.num_constrained_steps = 0
        """Steps that masked at least one row."""

    @property
    def compiler(self) -> StructuredCompiler:
        """The engine's compiler (built on first use; `StructuredOutputError` without a
        tokenizer). Thread-safe: the server compiles through it off the engine thread."""
        if self._compiler is None:
            self._compiler = StructuredCompiler(
                self._tokenizer, self.vocab_size, self._stop_token_ids
            )
        return self._compiler

    def admit(self, request_id: str, params: StructuredOutputParams) -> None:
        """Create `request_id`'s matcher (compiling `params` unless cached). Raises
        `StructuredOutputError` when it cannot be compiled; nothing is kept then."""
        import xgrammar as xgr  # only engines that serve a constrained request load it

        grammar = self.compiler.compile(params)
        self._matchers[request_id] = xgr.GrammarMatcher(grammar)

    def release(self, request_id: str) -> None:
        """Drop the request's matcher (no-op for an unconstrained or unknown id)."""
        self._matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        """True while `request_id` has a matcher."""
        return request_id in self._matchers

    def any_constrained(self, request_ids: Sequence[str] | Any) -> bool:
        """True when one of `request_ids` (any iterable of ids) has a matcher."""
        matchers = self._matchers
        return bool(matchers) and any(rid in matchers for rid in request_ids)

    @property
    def num_matchers(self) -> int:
        """Constrained requests held."""
        return len(self._matchers)

    def constrain(self, logits: torch.Tensor, row_ids: Sequence[str]) -> None:
        """Mask, in place, the logits rows of constrained requests to the tokens their grammar
        allows next; rows of other requests are untouched. logits `[len(row_ids), V]`;
        `row_ids[i]` is row i's request. Each matcher must have accepted every token sampled
        for its request before (a step launched ahead over constrained rows defers its
        sampling until then: `ModelRunner.sample_deferred`)."""
        matchers = self._matchers
        if not matchers:
            return
        rows: list[int] = []
        picked: list[xgr.GrammarMatcher] = []
        for row, rid in enumerate(row_ids):
            matcher = matchers.get(rid)
            if matcher is not None:
                rows.append(row)
                picked.append(matcher)
        if not rows:
            return
        bitmask = self._bitmask
        if bitmask is None:
            import xgrammar as xgr

            bitmask = self._bitmask = TokenBitmask(self._max_rows, self.vocab_size, self.device)
            self._batch = xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
        host = bitmask.host_rows(len(rows))
        assert self._batch is not None
        self._batch.batch_fill_next_token_bitmask(picked, host)
        bitmask.apply(logits, host, rows)
        self.num_constrained_steps += 1

    def accept(self, request_id: str, token_id: int) -> Acceptance:
        """Advance the request's matcher with its sampled token (CONTINUE for an
        unconstrained request)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return Acceptance.CONTINUE
        if not matcher.accept_token(int(token_id)):
            return Acceptance.REJECTED
        return Acceptance.TERMINATED if matcher.is_terminated() else Acceptance.CONTINUE
