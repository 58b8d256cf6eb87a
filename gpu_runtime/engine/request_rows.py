"""The runner's request states and the block table of each request row.

A state is built from the scheduler's full data (`NewRequestData`) once, then updated by its
diffs (`CachedRequestData`) and dropped with the finished ids; each live request holds one row
of the host block table, which the step paths read (`DecodePath`, `GeneralPath`).
"""

from __future__ import annotations

import torch

from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.runner_types import _RequestState
from gpu_runtime.engine.scheduler import SchedulerOutput
from gpu_runtime.lora.protocol import LoraRuntime


class RequestRows:
    """`max_num_seqs + 1` rows (one spare: a request finishing as another arrives)."""

    def __init__(self, config: EngineConfig, lora: LoraRuntime | None, pin: bool) -> None:
        """`lora`: the runtime whose slot each adapter request's state records; `pin`: the
        host block table is pinned (CUDA)."""
        rows = config.max_num_seqs + 1
        self.lora = lora
        self.states: dict[str, _RequestState] = {}
        """Live requests' states by id."""
        self._free_rows = list(range(rows - 1, -1, -1))
        self.table_cpu = torch.zeros(
            rows, config.max_blocks_per_seq, dtype=torch.int32, pin_memory=pin
        )
        """Block table per row `[rows, max_blocks_per_seq]` int32 (host)."""
        self.table_np = self.table_cpu.numpy()
        """A numpy view of `table_cpu` (shared memory) for vectorised reads and writes."""

    def sync(self, output: SchedulerOutput) -> None:
        """Apply one step's plan: drop finished states (their rows free again), build new
        ones, extend block tables by the cached requests' new blocks."""
        states, table = self.states, self.table_np
        for request_id in output.finished_request_ids:
            state = states.pop(request_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for new in output.new_requests:
            if not self._free_rows:
                raise RuntimeError("more live requests than max_num_seqs + 1 rows")
            row = self._free_rows.pop()
            state = _RequestState(
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
                new.num_output_tokens,
                row,
                new.lora_name,
            )
            if new.lora_name is not None and self.lora is not None:
                state.lora_slot = self.lora.slot_of_request(new.request_id)
            states[new.request_id] = state
            table[row, : len(state.block_ids)] = state.block_ids
        for cached in output.cached_requests:
            state = states[cached.request_id]
            if cached.new_block_ids:
                start = len(state.block_ids)
                state.block_ids.extend(cached.new_block_ids)
                table[state.row, start : len(state.block_ids)] = cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
