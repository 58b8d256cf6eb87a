"""A stored PEFT adapter as a downloadable `.tar.gz`, streamed from storage.

The archive holds one directory, named after the model, with the two files
`peft.PeftModel.from_pretrained` reads: `adapter_config.json` and `adapter_model.safetensors`.
A checkpoint's trainer state (optimizer, schedule, RNG) stays in storage. The config's
`base_model_name_or_path` is the platform's base model name, not the host's local path the
trainer wrote. The tar stream is built block by block (headers, file chunks, padding) and
compressed as it goes, so an adapter of any size is sent without being held in memory.
"""

from __future__ import annotations

import json
import re
import tarfile
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from api.errors import NotFoundError
from api.storage import get_storage
from gpu_runtime.contract.storage import COMPLETE_MARKER, Storage

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BLOCK = tarfile.BLOCKSIZE  # 512


@dataclass(frozen=True)
class AdapterArchive:
    """What a download response needs: its file name and its compressed bytes, lazily."""

    filename: str
    chunks: Iterator[bytes]


def archive_directory_name(model_name: str) -> str:
    """A file-system-safe name for `model_name` (`:` and other odd characters become `-`)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-.") or "adapter"


def adapter_archive(*, storage_key: str, model_name: str, base_model_name: str) -> AdapterArchive:
    """The archive of the PEFT tree stored under `storage_key`, served as `model_name`.

    Raises NotFoundError (checked before any byte is sent) when no complete tree is stored
    there, without naming the storage location.
    """
    storage = get_storage()
    weights_key = f"{storage_key}/{ADAPTER_WEIGHTS}"
    config_key = f"{storage_key}/{ADAPTER_CONFIG}"
    complete = bool(storage_key) and storage.exists(f"{storage_key}/{COMPLETE_MARKER}")
    if not complete or not storage.exists(weights_key) or not storage.exists(config_key):
        raise NotFoundError(
            f"The weights of {model_name!r} are not stored any more.",
            param="model",
            code="adapter_not_stored",
        )
    config = json.loads(b"".join(storage.read_chunks(config_key)))
    config["base_model_name_or_path"] = base_model_name
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    directory = archive_directory_name(model_name)
    members = [
        (f"{directory}/{ADAPTER_CONFIG}", len(config_bytes), iter([config_bytes])),
        (
            f"{directory}/{ADAPTER_WEIGHTS}",
            storage.size(weights_key),
            _lazy_chunks(storage, weights_key),
        ),
    ]
    return AdapterArchive(filename=f"{directory}.tar.gz", chunks=_gzip(_tar(directory, members)))


def _lazy_chunks(storage: Storage, key: str) -> Iterator[bytes]:
    yield from storage.read_chunks(key, chunk_size=1 << 20)


def _tar(directory: str, members: list[tuple[str, int, Iterator[bytes]]]) -> Iterator[bytes]:
    """A ustar stream: the directory entry, then each member's header, bytes and padding."""
    now = int(time.time())
    folder = tarfile.TarInfo(directory)
    folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, now
    yield folder.tobuf(format=tarfile.PAX_FORMAT)
    for name, size, chunks in members:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, now
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        for chunk in chunks:
            sent += len(chunk)
            yield chunk
        if sent != size:  # changed under us: a short member would corrupt the archive
            raise OSError(f"{name}: expected {size} bytes, read {sent}")
        if size % BLOCK:
            yield b"\0" * (BLOCK - size % BLOCK)
    yield b"\0" * (2 * BLOCK)  # end of archive


def _gzip(chunks: Iterable[bytes]) -> Iterator[bytes]:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # gzip framing
    for chunk in chunks:
        out = compressor.compress(chunk)
        if out:
            yield out
    yield compressor.flush()
