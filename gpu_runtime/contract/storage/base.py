"""The storage contract shared by every backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

COMPLETE_MARKER = ".complete"
"""The key under a tree's prefix that :meth:`Storage.put_tree` writes last."""


class StorageError(ValueError):
    """A bad key or a storage URL no backend understands."""


def validate_key(key: str) -> list[str]:
    """Split `key` into its parts; raise StorageError for empty, `.` or `..` parts."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"invalid storage key {key!r}: empty")
    parts = key.split("/")
    if any(part in {"", ".", ".."} for part in parts) or "\\" in key or "\x00" in key:
        raise StorageError(f"invalid storage key {key!r}")
    return parts


class Storage(Protocol):
    """Bytes under keys. A write is atomic: a key holds the old bytes or the new ones, whole."""

    def save(self, key: str, chunks: Iterable[bytes]) -> int:
        """Store the bytes under `key`, replacing any; return the number of bytes written."""
        ...

    def read_chunks(self, key: str, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        """Yield the stored bytes; FileNotFoundError when the key is absent."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key; no error when it is absent."""
        ...

    def exists(self, key: str) -> bool:
        """True when `key` holds bytes."""
        ...

    def size(self, key: str) -> int:
        """The number of bytes under `key`; FileNotFoundError when the key is absent."""
        ...

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under the directory-like `prefix`, sorted; [] when there is none."""
        ...

    def modified_at(self, key: str) -> float:
        """When `key` was last written (POSIX seconds); FileNotFoundError when it is absent."""
        ...

    def partial_writes_remove(self, *, before: float) -> list[str]:
        """Remove what interrupted writes left (a process killed during :meth:`save`) that
        was last touched before `before` (POSIX seconds); return what was removed, by name.
        A write still in progress is touched as it goes, so a past `before` spares it."""
        ...

    def put_tree(self, prefix: str, directory: str | Path) -> list[str]:
        """Copy every file under `directory` to `prefix/<relative path>`; return the keys.

        The tree appears complete or not at all to :meth:`get_tree`: a marker key
        `prefix/.complete` is written last.
        """
        ...

    def get_tree(self, prefix: str, directory: str | Path) -> Path:
        """Copy a complete tree written by :meth:`put_tree` into `directory`; return it.

        FileNotFoundError when no complete tree is stored under `prefix`.
        """
        ...

    def delete_tree(self, prefix: str) -> None:
        """Remove every key under `prefix`, the completion marker first (so :meth:`get_tree`
        refuses the tree at once); no error when there is none."""
        ...
