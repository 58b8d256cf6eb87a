"""`PrefixKeys`: the block digests of a scheduler's live requests, the cache hits they find and
the registration of their computed blocks in the block manager's prefix cache (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.prefix_cache import BlockHash, extend_block_hashes
from gpu_runtime.engine.request import Request, RequestStatus


@dataclass
class _RequestKeys:
    hashes: list[BlockHash] = field(default_factory=list)
    """Digests of the request's first full blocks, in order (computed once, on demand)."""
    registered: int = 0
    """Blocks of its current table already offered to the cache."""


class PrefixKeys:
    """Digests per live request (extra key: its `lora_name`) over `block_manager`'s cache.

    - `hits(request)`: the cached blocks holding its longest cached prefix of whole blocks,
      never its last token (a full hit still computes that token, so its logits exist).
    - `admit(request, hits)`: the admission of a waiting request with an empty table takes
      those blocks (`BlockManager.touch`) and starts its `num_computed_tokens` after them.
    - `computed(request)`: after a step, every block wholly within its `num_computed_tokens`
      is offered to the cache (`BlockManager.cache_blocks`).
    - `released(request_id)` when its table is freed (preempted: it keeps its digests),
      `forget(request_id)` when it ends.
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._keys: dict[str, _RequestKeys] = {}

    def _of(self, request: Request) -> _RequestKeys:
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys = self._keys[request.request_id] = _RequestKeys()
        return keys

    def _extend(self, request: Request, keys: _RequestKeys, num_blocks: int) -> None:
        """Digests of `request`'s first `num_blocks` blocks, hashing only the missing ones
        (their tokens sliced from the prompt and the output, not the whole sequence)."""
        if len(keys.hashes) >= num_blocks:
            return
        size = self.block_manager.block_size
        start, end = len(keys.hashes) * size, num_blocks * size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        split = len(prompt)
        if end <= split:
            window = prompt[start:end]
        elif start >= split:
            window = output[start - split : end - split]
        else:
            window = prompt[start:] + output[: end - split]
        extend_block_hashes(keys.hashes, window, end, size, request.lora_name, offset=start)

    def hits(self, request: Request) -> list[int]:
        """Cached blocks of `request`'s first `(num_schedulable_tokens - 1) // block_size`
        blocks, the longest prefix found; none while it still needs prompt logprobs (a cached
        position is never computed, so its logprob would not exist)."""
        wanted = request.prompt_logprobs
        if wanted is not None and len(wanted) < len(request.prompt_token_ids):
            return []
        keys = self._of(request)
        limit = (request.num_schedulable_tokens - 1) // self.block_manager.block_size
        self._extend(request, keys, limit)
        return self.block_manager.cache.lookup(keys.hashes[:limit])

    def admit(self, request: Request, hits: list[int]) -> None:
        """Start the waiting `request` (empty table) on the cached blocks `hits` (a prefix
        `hits(request)` found and that is still cached); a new request records them as
        `num_cached_tokens`. RuntimeError when they no longer hold its first blocks."""
        if request.block_table:
            raise RuntimeError(f"request {request.request_id!r} already holds blocks")
        bm = self.block_manager
        keys = self._of(request)
        if bm.cache.lookup(keys.hashes[: len(hits)]) != hits:
            raise RuntimeError(f"cache hit of {request.request_id!r} was evicted before admission")
        bm.touch(hits)
        request.block_table.extend(hits)
        request.num_computed_tokens = len(hits) * bm.block_size
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = request.num_computed_tokens
        keys.registered = len(hits)

    def computed(self, request: Request) -> None:
        """Offer `request`'s newly computed full blocks to the cache."""
        keys = self._of(request)
        full = request.num_computed_tokens // self.block_manager.block_size
        start = keys.registered
        if full <= start:
            return
        self._extend(request, keys, full)
        self.block_manager.cache_blocks(request.block_table[start:full], keys.hashes[start:full])
        keys.registered = full

    def released(self, request_id: str) -> None:
        """`request_id`'s table was freed; its digests stay (a preempted request's recompute
        looks them up)."""
        keys = self._keys.get(request_id)
        if keys is not None:
            keys.registered = 0

    def forget(self, request_id: str) -> None:
        """`request_id` ended: drop its digests."""
        self._keys.pop(request_id, None)
