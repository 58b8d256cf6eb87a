"""Automatic prefix caching in plain integers (no torch): block hashes and the cache's index.

A full KV block is named by `hash_block_tokens(parent, tokens, extra)`: a SHA-256 digest of its
parent block's digest (None for a sequence's first block), its `block_size` token ids and the
extra key (the adapter name; None for the base model). Two blocks with the same digest hold the
same KV: the same tokens at the same positions after the same prefix, under the same weights.
Only full blocks are named; a sequence's last partial block is never cached.

`PrefixCache` is the block manager's index: digest -> block id for cached blocks, and the cached
blocks no request holds (ref count 0) in least-recently-freed order, which are the blocks
evicted, oldest first, when no empty block is left. It holds ids only; `BlockManager` owns ref
counts and the empty free blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

BlockHash = bytes
"""A full block's digest (32 bytes)."""


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: str | None
) -> BlockHash:
    """The digest of a full block of `token_ids` after the block named `parent`, under the
    extra key `extra` (adapter name). Token ids are hashed as signed 64-bit integers; the
    extra key is length-prefixed so no (tokens, extra) pair collides with another."""
    digest = hashlib.sha256()
    digest.update(parent if parent is not None else b"\0" * 32)
    key = b"" if extra is None else extra.encode()
    digest.update(len(key).to_bytes(4, "little") + (b"\1" if extra is not None else b"\0") + key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    extra: str | None,
    offset: int = 0,
) -> None:
    """Append to `hashes` (the digests of a sequence's first blocks, in order) the digests of
    every further block that lies wholly within its first `num_tokens` tokens. `token_ids` are
    the sequence's tokens from position `offset` on (`offset` at most `len(hashes) *
    block_size`, so a caller passes only the tokens of the blocks still to hash)."""
    parent = hashes[-1] if hashes else None
    first = len(hashes)
    if offset > first * block_size:
        raise ValueError(f"offset {offset} is past block {first}'s first token")
    for index in range(first, num_tokens // block_size):
        start = index * block_size - offset
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)


class PrefixCache:
    """Which blocks hold which digest, and which cached blocks are evictable (held by no
    request), least recently freed first.

    A block is cached when it carries a digest. A cached block is either held (ref count >= 1,
    owned by the block manager) or evictable (in `evictable_ids()`). A digest names at most
    one block: a second block computed with the same content is left uncached.
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a digest (held or evictable)."""
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks held by no request."""
        return len(self._evictable)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The digest `block_id` carries; None when it is not cached."""
        return self._hash_of.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        """True when `block_id` is cached and held by no request."""
        return block_id in self._evictable

    def evictable_ids(self) -> Iterator[int]:
        """Evictable blocks in eviction order (least recently freed first)."""
        return iter(self._evictable)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `hashes` that is cached (stops at the first miss)."""
        out: list[int] = []
        by_hash = self._by_hash
        for block_hash in hashes:
            block_id = by_hash.get(block_hash)
            if block_id is None:
                break
            out.append(block_id)
        return out

    # ---- changes ----------------------------------------------------------------------------
    def insert(self, block_id: int, block_hash: BlockHash) -> bool:
        """Name the held block `block_id` by `block_hash`; False (nothing changes) when that
        digest already names a block or `block_id` already carries one."""
        if block_hash in self._by_hash or block_id in self._hash_of:
            return False
        self._by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """The cached block `block_id` is held no more: it becomes the newest evictable one."""
        if block_id not in self._hash_of:
            raise ValueError(f"block {block_id} is not cached")
        self._evictable[block_id] = None

    def unpark(self, block_id: int) -> None:
        """An evictable block is held again (a cache hit): it leaves the evictable set."""
        del self._evictable[block_id]

    def evict_oldest(self) -> int:
        """Drop the least recently freed evictable block's digest; returns its id."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block_id)]
        return block_id

    def drop(self, block_id: int) -> None:
        """Forget the evictable block `block_id` (its storage leaves the block manager)."""
        del self._evictable[block_id]
        del self._by_hash[self._hash_of.pop(block_id)]
