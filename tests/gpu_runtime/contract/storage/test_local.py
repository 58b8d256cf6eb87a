"""The local-directory storage backend: keys, atomic writes, trees and location parsing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.contract.storage import LocalStorage, StorageError, open_storage


def test_roundtrip_list_and_bad_keys(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.save("files/t1/a.jsonl", [b"ab", b"cd"]) == 4
    assert b"".join(storage.read_chunks("files/t1/a.jsonl", chunk_size=3)) == b"abcd"
    storage.save("files/t1/b.jsonl", [b"x"])
    assert storage.list_keys("files") == ["files/t1/a.jsonl", "files/t1/b.jsonl"]
    assert storage.list_keys("nothing/here") == []
    storage.delete("files/t1/a.jsonl")
    storage.delete("files/t1/a.jsonl")
    assert not storage.exists("files/t1/a.jsonl")
    with pytest.raises(FileNotFoundError):
        list(storage.read_chunks("files/t1/a.jsonl"))
    for bad in ("../escape", "/abs", "a/./b", "", "a//b", "a\\b"):
        with pytest.raises(StorageError):
            storage.save(bad, [b"x"])


def test_tree_is_invisible_until_complete(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "store")
    source = tmp_path / "ckpt"
    (source / "sub").mkdir(parents=True)
    (source / "adapter_model.safetensors").write_bytes(b"w" * 3000)
    (source / "sub" / "state.pt").write_bytes(b"s")
    with pytest.raises(FileNotFoundError):
        storage.get_tree("checkpoints/j/step-000002", tmp_path / "out")
    keys = storage.put_tree("checkpoints/j/step-000002", source)
    assert keys == [
        "checkpoints/j/step-000002/adapter_model.safetensors",
        "checkpoints/j/step-000002/sub/state.pt",
    ]
    out = storage.get_tree("checkpoints/j/step-000002", tmp_path / "out")
    assert (out / "adapter_model.safetensors").read_bytes() == b"w" * 3000
    assert (out / "sub" / "state.pt").read_bytes() == b"s"
    assert not (out / ".complete").exists()
    # A half-written tree (marker removed while rewriting) reads as absent.
    storage.delete("checkpoints/j/step-000002/.complete")
    with pytest.raises(FileNotFoundError):
        storage.get_tree("checkpoints/j/step-000002", tmp_path / "out2")


def test_open_storage_locations(tmp_path: Path) -> None:
    assert isinstance(open_storage(tmp_path), LocalStorage)
    backend = open_storage(f"file://{tmp_path}")
    assert isinstance(backend, LocalStorage) and backend.root == tmp_path
    with pytest.raises(StorageError, match="unsupported storage location"):
        open_storage("ftp://example/x")
    with pytest.raises(StorageError, match="empty"):
        open_storage("")


def test_a_killed_save_leaves_a_partial_write_that_is_removed_once_stale(tmp_path: Path) -> None:
    import os
    import time

    storage = LocalStorage(tmp_path)

    def killed() -> Iterator[bytes]:
        yield b"half"
        raise KeyboardInterrupt  # a save interrupted mid-way cleans up after itself...

    with pytest.raises(KeyboardInterrupt):
        storage.save("files/t1/a.jsonl", killed())
    assert list((tmp_path / "files" / "t1").iterdir()) == []
    # ...but a process killed with SIGKILL cannot: its partial file stays.
    left = tmp_path / "files" / "t1" / ".upload-dead"
    left.write_bytes(b"half")
    being_written = tmp_path / "files" / "t1" / ".upload-live"
    being_written.write_bytes(b"so far")
    old = time.time() - 7200
    os.utime(left, (old, old))
    assert storage.list_keys("files") == []  # never listed as a key
    assert storage.partial_writes_remove(before=time.time() - 3600) == ["files/t1/.upload-dead"]
    assert not left.exists() and being_written.exists()
    storage.save("files/t1/b.jsonl", [b"x"])
    assert abs(storage.modified_at("files/t1/b.jsonl") - time.time()) < 60
    with pytest.raises(FileNotFoundError):
        storage.modified_at("files/t1/absent.jsonl")
