"""kombu's `filesystem://` transport with atomic message files; every process of one broker uses it.

kombu's stock transport creates a message file under its final name and only then writes it,
so a consumer listing the folder in between claims an empty or partial file and the JSON error
ends its consume loop (celery/kombu#1551). Here:

* a publisher writes each message to a dot-prefixed temporary name in the queue folder (which
  no consumer's name filter matches, stock or ours) and `os.replace`s it to its final name, so
  a visible message file is always complete;
* a consumer claims a file by renaming it to a dot-prefixed name in the same folder (atomic:
  of two consumers exactly one gets it), reads it, and sets a file it cannot decode into a
  message aside in `failed_folder` (logged with its name), then goes on to the next file;
* an exchange's binding table in `control_folder` is created complete (written aside, then
  hard-linked into place, which fails if another process created it first), so a reader never
  sees a half-created table.

Select it with kombu's `transport=` argument (Celery: `broker_transport`) set to
:data:`TRANSPORT`, keeping the `filesystem://` URL. Writes are not fsynced: a message survives
a process crash, not a power loss. Imports neither Django nor torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from contextlib import suppress
from pathlib import Path
from queue import Empty
from time import monotonic_ns
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

logger = logging.getLogger(__name__)

TRANSPORT = "gpu_runtime.agent.fs_transport:Transport"
"""The import path to pass as kombu's `transport` (Celery's `broker_transport`)."""


class CorruptMessageError(ValueError):
    """A queue file that is not a complete kombu message."""


def decode_message_file(raw: bytes) -> dict[str, Any]:
    """The message in a queue file; CorruptMessageError when it is not a whole one."""
    try:
        payload = loads(bytes_to_str(raw))
    except ValueError as exc:  # json.JSONDecodeError: empty, partial or not JSON
        raise CorruptMessageError(f"not JSON ({len(raw)} bytes): {exc}") from exc
    properties = payload.get("properties") if isinstance(payload, dict) else None
    if (
        not isinstance(properties, dict)
        or "delivery_tag" not in properties
        or not isinstance(properties.get("delivery_info"), dict)
    ):
        raise CorruptMessageError(f"not a kombu message: {raw[:200]!r}")
    return payload


class Channel(filesystem.Channel):
    """The stock channel with atomic publishes, atomic claims and corrupt files set aside."""

    # kombu's bases name the payload differently (`message`, `payload`): mypy sees a conflict
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg"  # sorts in publish order
        folder = self.data_folder_out
        temporary = os.path.join(folder, f".{name}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(temporary, os.path.join(folder, name))
        except OSError as exc:
            with suppress(FileNotFoundError):
                os.remove(temporary)
            raise ChannelError(f"Cannot add file {name!r} to {folder!r}") from exc

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        wanted = f"{queue}.msg"
        folder = self.data_folder_in
        for name in sorted(os.listdir(folder)):
            if name.partition(".")[2] != wanted:  # another queue's, or a temporary name
                continue
            claimed = os.path.join(folder, f".claimed-{name}")
            try:
                os.rename(os.path.join(folder, name), claimed)
            except FileNotFoundError:  # another consumer took it
                continue
            try:
                with open(claimed, "rb") as file:
                    raw = file.read()
            except OSError as exc:
                raise ChannelError(f"Cannot read file {claimed!r} from queue.") from exc
            try:
                payload = decode_message_file(raw)
            except CorruptMessageError as exc:
                self._set_aside(claimed, name, queue, exc)
                continue
            if self.store_processed:
                shutil.move(claimed, os.path.join(self.processed_folder, name))
            else:
                os.remove(claimed)
            return payload
        raise Empty()

    def _set_aside(self, claimed: str, name: str, queue: str, error: Exception) -> None:
        failed = Path(self.failed_folder)
        try:
            failed.mkdir(parents=True, exist_ok=True)
            shutil.move(claimed, failed / name)
        except OSError as exc:
            raise ChannelError(f"Cannot move unreadable file {claimed!r} to {failed}") from exc
        logger.error("queue %s: moved unreadable message file %s to %s: %s",
                     queue, name, failed, error)  # fmt: skip

    @property
    def failed_folder(self) -> str:
        """Where unreadable message files go (default: `failed` beside `data_folder_in`)."""
        default = Path(self.data_folder_in).resolve().parent / "failed"
        return str(self.transport_options.get("failed_folder", default))

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        file = self._exchange_file(exchange)
        if not file.exists():
            self.control_folder.mkdir(parents=True, exist_ok=True)
            binding = [filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")]
            temporary = file.with_name(f".{file.name}.{uuid.uuid4()}.tmp")
            try:
                temporary.write_bytes(str_to_bytes(dumps(binding)))
                os.link(temporary, file)  # fails if it exists: then update it as the stock does
                return
            except FileExistsError:
                pass
            except OSError as exc:
                raise ChannelError(f"Cannot create {file}") from exc
            finally:
                with suppress(FileNotFoundError):
                    temporary.unlink()
        super()._queue_bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    """kombu's filesystem transport over :class:`Channel`; `driver_type` stays `filesystem`."""

    Channel = Channel
