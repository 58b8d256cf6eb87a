"""The agent's durable outbox: reports on local disk until the broker confirmed them.

One file per report in the outbox directory, named by a sequence number that orders them
(`<seq, 16 digits>.<message id>.json`). :meth:`DiskOutbox.put` writes a report's Celery task
message exactly as it was built (headers, properties, body: a resend is byte for byte the first
send, signature included) to a dot-prefixed temporary file, fsyncs it, renames it into place
and fsyncs the directory, all before it returns, so a report the runtime handed over survives
a crash of the agent (and of the machine) from then on. The sender publishes entries in
sequence order and calls :meth:`DiskOutbox.remove` only once the broker confirmed one; a
restarted agent's :meth:`DiskOutbox.recover` hands back what was left, oldest first, and new
entries continue the sequence after them. A crash between the broker's confirmation and the
removal sends that report again: the control plane applies a message id once
(`ProcessedReport`), so the copy is a no-op.

Bounds (`max_messages`, `max_bytes`) hold the reports that can be lost without harm: when the
outbox is full, a new `job_progress` (a later checkpoint report carries every step since the
previous one, `recent_steps`) or `metrics` report is refused, counted in `dropped` and logged.
The job lifecycle reports (:data:`KEPT_KINDS`) are written past the bound (a few per job),
counted in `over_bound` and logged; when the disk refuses a write (full, read-only) they are
kept in memory only (`unpersisted`, logged at ERROR) and still sent: never dropped.

Heartbeats never enter the outbox: a heartbeat is a snapshot of the host that the next one
(every `--heartbeat-s`) supersedes, and one from a previous process would name placements and
adapters the restarted agent no longer has; the sender keeps only the newest in memory.

Costs two fsyncs per report on the caller's thread (about 0.5 ms on a local SSD); reports come
per optimizer step at most, not per decode iteration. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEPT_KINDS = frozenset({"job_started", "checkpoint", "job_succeeded", "job_failed", "job_stopped"})
"""Reports written past the outbox's bounds: the control plane cannot recover them otherwise."""
DROPPABLE_KINDS = frozenset({"job_progress", "metrics"})
"""Reports refused when the outbox is full (a checkpoint's `recent_steps` re-reports steps)."""
VOLATILE_KINDS = frozenset({"heartbeat"})
"""Reports never written (see the module docstring)."""

DEFAULT_MAX_MESSAGES = 10_000
DEFAULT_MAX_BYTES = 64 * 2**20
LOCK_FILE = "lock"
"""Held (`flock`) by the one process that owns the outbox; the kernel frees it when that
process dies, however it dies."""
CORRUPT_FOLDER = "corrupt"
"""Subfolder where a file that is not a whole entry is set aside (logged) at recovery."""
_NAME = re.compile(r"(\d{16})\.([0-9A-Za-z_-]{1,64})\.json")


@dataclass(frozen=True)
class OutboxEntry:
    """One report as it will be published."""

    seq: int
    """Position in the outbox's order (increasing across restarts)."""
    kind: str
    message_id: str
    task: dict[str, Any]
    """The Celery task message as built: `{"headers", "properties", "body"}` (JSON values)."""
    size: int
    """Bytes of its file (of its encoding, when it has none)."""
    path: Path | None
    """Its file; None when held in memory only (a heartbeat, or a write the disk refused)."""


@dataclass
class OutboxStats:
    """Counters and gauges of one outbox (what the agent's metrics export)."""

    depth: int = 0
    """Entries on disk now."""
    bytes: int = 0
    """Bytes of those entries."""
    persisted: int = 0
    removed: int = 0
    recovered: int = 0
    """Entries a previous process left, handed back by `recover`."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Refused reports per kind (outbox full, or the disk refused a droppable one)."""
    over_bound: int = 0
    """Kept reports written while the outbox was at its bound."""
    unpersisted: int = 0
    """Kept reports the disk refused, sent from memory only."""
    corrupt: int = 0
    """Files set aside at recovery as not a whole entry."""


class OutboxBusyError(RuntimeError):
    """Another live process owns the outbox directory (two agents must not share one)."""


class DiskOutbox:
    """The outbox directory (see the module docstring), owned by one process at a time
    (OutboxBusyError otherwise). Not thread-safe: the caller serializes calls."""

    def __init__(
        self,
        directory: Path,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.stats = OutboxStats()
        self._next_seq = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise OutboxBusyError(
                f"outbox {self.directory} is in use by another process (one per host)"
            ) from None

    def close(self) -> None:
        """Release the directory (what it holds stays for the next owner)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def recover(self) -> list[OutboxEntry]:
        """The entries on disk, oldest first; removes temporary files of writes a crash cut
        short (their `put` never returned) and sets aside files that are not whole entries."""
        entries: list[OutboxEntry] = []
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(".") and path.is_file():
                path.unlink(missing_ok=True)
                continue
            match = _NAME.fullmatch(path.name)
            if match is None or not path.is_file():
                continue
            try:
                data = path.read_bytes()
                record = json.loads(data)
                entry = OutboxEntry(
                    seq=int(match.group(1)), kind=str(record["kind"]),
                    message_id=match.group(2), task=_task(record["task"]),
                    size=len(data), path=path,
                )  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._set_aside(path, exc)
                continue
            entries.append(entry)
        entries.sort(key=lambda e: e.seq)
        self._next_seq = entries[-1].seq + 1 if entries else self._next_seq
        self.stats.depth = len(entries)
        self.stats.bytes = sum(e.size for e in entries)
        self.stats.recovered += len(entries)
        if entries:
            logger.info(
                "outbox %s: %d report(s) left by a previous run, sent first",
                self.directory, len(entries),
            )  # fmt: skip
        return entries

    def full(self, size: int) -> bool:
        return self.stats.depth + 1 > self.max_messages or self.stats.bytes + size > self.max_bytes

    def put(self, kind: str, message_id: str, task: dict[str, Any]) -> OutboxEntry | None:
        """Persist one report before it is sent; the entry, or None when it was refused
        (a droppable kind while full, or the disk failed on one). A heartbeat is returned
        unwritten (`path` None)."""
        record = {"kind": kind, "message_id": message_id, "task": task}
        data = json.dumps(record, separators=(",", ":"), allow_nan=False).encode()
        stored = _task(json.loads(data)["task"])  # what a recovery reads back
        seq = self._next_seq
        self._next_seq += 1
        if kind in VOLATILE_KINDS:
            return OutboxEntry(seq, kind, message_id, stored, len(data), None)
        if self.full(len(data)):
            if kind not in KEPT_KINDS:
                self._drop(kind, "the outbox is full")
                return None
            self.stats.over_bound += 1
            logger.warning(
                "outbox %s full (%d reports, %d bytes): %s %s written past the bound",
                self.directory, self.stats.depth, self.stats.bytes, kind, message_id,
            )  # fmt: skip
        if _NAME.fullmatch(f"{seq:016d}.{message_id}.json") is None:
            raise ValueError(f"message id {message_id!r} cannot name an outbox file")
        path = self.directory / f"{seq:016d}.{message_id}.json"
        try:
            _write_durably(path, data)
        except OSError as exc:
            if kind not in KEPT_KINDS:
                self._drop(kind, f"the disk refused it ({exc})")
                return None
            self.stats.unpersisted += 1
            logger.error(
                "outbox %s: cannot write %s %s (%s); it is sent from memory only",
                self.directory, kind, message_id, exc,
            )  # fmt: skip
            return OutboxEntry(seq, kind, message_id, stored, len(data), None)
        self.stats.persisted += 1
        self.stats.depth += 1
        self.stats.bytes += len(data)
        return OutboxEntry(seq, kind, message_id, stored, len(data), path)

    def remove(self, entry: OutboxEntry) -> None:
        """Forget an entry the broker confirmed. Not fsynced: a removal lost to a power cut
        only sends the report again, which the control plane skips by its message id."""
        if entry.path is None:
            return
        try:
            entry.path.unlink()
        except FileNotFoundError:
            return
        self.stats.removed += 1
        self.stats.depth -= 1
        self.stats.bytes -= entry.size

    def _drop(self, kind: str, why: str) -> None:
        self.stats.dropped[kind] = self.stats.dropped.get(kind, 0) + 1
        total = sum(self.stats.dropped.values())
        # every refusal counts; the log says so for the first and then every 100th
        if total == 1 or total % 100 == 0:
            logger.warning(
                "outbox %s: %s report refused: %s (%d refused so far: %s)",
                self.directory, kind, why, total, self.stats.dropped,
            )  # fmt: skip

    def _set_aside(self, path: Path, exc: Exception) -> None:
        self.stats.corrupt += 1
        folder = self.directory / CORRUPT_FOLDER
        folder.mkdir(exist_ok=True)
        logger.error("outbox %s: %s is not a whole report (%s); set aside in %s",
                     self.directory, path.name, exc, folder)  # fmt: skip
        os.replace(path, folder / path.name)


def _task(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not {"headers", "properties", "body"} <= set(value):
        raise ValueError("an outbox task has headers, properties and body")
    return value


def _write_durably(path: Path, data: bytes) -> None:
    """`data` at `path`, complete or not at all, on disk when this returns."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
