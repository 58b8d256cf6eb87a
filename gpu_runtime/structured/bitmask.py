"""`TokenBitmask`: the allowed-token bitmask of a step's constrained rows, filled on the host and
applied to the logits on their device.

Bit `t % 32` of word `t // 32` of a row is 1 where token `t` is allowed (xgrammar's layout).
The host buffers (bits and row indices) are pinned on CUDA and used in turn (two sets), so a
fill never overwrites the buffers whose copy to the device the previous step may still have
queued; the copies are asynchronous and the masking is one Triton launch on CUDA
(`mask_kernel`) or a few torch ops on the CPU, on the logits' stream: applying the mask adds no
host sync.
"""

from __future__ import annotations

import torch


class TokenBitmask:
    """Bitmask buffers for at most `max_rows` constrained rows over `vocab_size` tokens."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        if max_rows < 1 or vocab_size < 1:
            raise ValueError(f"max_rows={max_rows} and vocab_size={vocab_size} must be >= 1")
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        """int32 words per row, ceil(V / 32)."""
        self.device = device
        pin = device.type == "cuda"
        self._hosts = [
            torch.zeros(max_rows, self.words, dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._host_rows = [
            torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._parity = 0
        self._device_bits = torch.zeros(max_rows, self.words, dtype=torch.int32, device=device)
        self._device_rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def host_rows(self, rows: int) -> torch.Tensor:
        """The next host buffer's first `rows` rows `[rows, words]` int32, to fill (the one not
        handed out by the previous call)."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows={rows} must be in [1, {self.max_rows}]")
        self._parity ^= 1
        return self._hosts[self._parity][:rows]

    def apply(self, logits: torch.Tensor, host_bits: torch.Tensor, rows: list[int]) -> None:
        """Set `logits[rows[i], t]` to -inf where bit t of `host_bits[i]` is 0, in place.

        logits `[B, V']` (V' <= 32 * words, any float dtype) on `device`; `host_bits`
        `[len(rows), words]` from `host_rows`; `rows`: logits rows, distinct. Other rows are
        not read or written."""
        count = len(rows)
        bits = self._device_bits[:count]
        bits.copy_(host_bits, non_blocking=True)
        host_index = self._host_rows[self._parity][:count]
        host_index.numpy()[:] = rows
        index = self._device_rows[:count]
        index.copy_(host_index, non_blocking=True)
        if self.device.type == "cuda":
            from gpu_runtime.structured.mask_kernel import apply_bitmask_cuda  # needs Triton

            apply_bitmask_cuda(logits, bits, index)
            return
        vocab = logits.shape[1]
        # [count, words, 32] -> [count, 32 * words] bools, token t at column t
        allowed = ((bits[:, :, None] >> self._shifts) & 1).bool().view(count, -1)[:, :vocab]
        picked = logits.index_select(0, index)
        picked.masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, index, picked)
