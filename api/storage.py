"""Where uploaded file bytes live, behind a small interface (a local directory for now).

Keys are opaque strings chosen by the caller (e.g. `files/<tenant id>/<file id>.jsonl`). A write
is atomic: the bytes appear under the key whole or not at all.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from django.conf import settings


class Storage(Protocol):
    def save(self, key: str, chunks: Iterable[bytes]) -> int:
        """Store the bytes under `key`, replacing any; return the number of bytes written."""
        ...

    def read_chunks(self, key: str, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        """Yield the stored bytes; FileNotFoundError when the key is absent."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key; no error when it is absent."""
        ...

    def exists(self, key: str) -> bool: ...


class LocalStorage:
    """A directory on the local file system; keys map to relative paths under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if any(part in {"", ".", ".."} for part in parts):
            raise ValueError(f"invalid storage key {key!r}")
        return self.root.joinpath(*parts)

    def save(self, key: str, chunks: Iterable[bytes]) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return written

    def read_chunks(self, key: str, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        with self._path(key).open("rb") as src:
            while chunk := src.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


def get_storage() -> Storage:
    """The configured storage (`HARLI_STORAGE_DIR`), read at call time so tests can override it."""
    return LocalStorage(Path(settings.HARLI_STORAGE_DIR))
