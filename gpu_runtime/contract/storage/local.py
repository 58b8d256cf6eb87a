"""The local-directory backend: keys map to relative paths under one root directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

from gpu_runtime.contract.storage.base import COMPLETE_MARKER, Storage, StorageError, validate_key

PARTIAL_PREFIX = ".upload-"
"""The name prefix of a file being written by :meth:`LocalStorage.save` (renamed when done)."""


class LocalStorage:
    """A directory on the local file system (shared by processes that see the same path)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """Where `key` lives on disk (the backend's own detail; callers use keys)."""
        return self.root.joinpath(*validate_key(key))

    def save(self, key: str, chunks: Iterable[bytes]) -> int:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=PARTIAL_PREFIX)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    written += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return written

    def read_chunks(self, key: str, chunk_size: int = 64 * 1024) -> Iterator[bytes]:
        with self.path(key).open("rb") as src:
            while chunk := src.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def size(self, key: str) -> int:
        path = self.path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no key {key!r} in {self!r}")
        return path.stat().st_size

    def list_keys(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        return sorted(
            f"{prefix}/{p.relative_to(base).as_posix()}"
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(PARTIAL_PREFIX)
        )

    def modified_at(self, key: str) -> float:
        path = self.path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no key {key!r} in {self!r}")
        return path.stat().st_mtime

    def partial_writes_remove(self, *, before: float) -> list[str]:
        if not self.root.is_dir():
            return []
        removed = []
        for path in self.root.rglob(f"{PARTIAL_PREFIX}*"):
            try:
                if path.is_file() and path.stat().st_mtime < before:
                    path.unlink()
                    removed.append(path.relative_to(self.root).as_posix())
            except FileNotFoundError:  # finished (renamed) or removed meanwhile
                continue
        return sorted(removed)

    def put_tree(self, prefix: str, directory: str | Path) -> list[str]:
        source = Path(directory)
        if not source.is_dir():
            raise FileNotFoundError(f"{source} is not a directory")
        self.delete(f"{prefix}/{COMPLETE_MARKER}")
        keys = []
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(source).as_posix()}"
            self.save(key, _file_chunks(path))
            keys.append(key)
        self.save(f"{prefix}/{COMPLETE_MARKER}", [b"ok"])
        return keys

    def get_tree(self, prefix: str, directory: str | Path) -> Path:
        if not self.exists(f"{prefix}/{COMPLETE_MARKER}"):
            raise FileNotFoundError(f"no complete tree stored under {prefix!r} in {self!r}")
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for key in self.list_keys(prefix):
            relative = key[len(prefix) + 1 :]
            if relative == COMPLETE_MARKER:
                continue
            out = target.joinpath(*relative.split("/"))
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path(key), out)
        return target

    def delete_tree(self, prefix: str) -> None:
        base = self.path(prefix)
        self.delete(f"{prefix}/{COMPLETE_MARKER}")
        shutil.rmtree(base, ignore_errors=True)


def _file_chunks(path: Path, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_size):
            yield chunk


def open_storage(location: str | Path) -> Storage:
    """The backend for `location`: `file:///abs/dir` or a plain directory path.

    Raises StorageError for any other scheme (an S3 backend would plug in here).
    """
    text = str(location)
    if not text:
        raise StorageError("storage location is empty")
    parsed = urlparse(text)
    if parsed.scheme == "file":
        return LocalStorage(Path(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and text[1:3] in {":\\", ":/"}):
        return LocalStorage(Path(text))
    raise StorageError(f"unsupported storage location {text!r} (use a directory or file:///...)")
