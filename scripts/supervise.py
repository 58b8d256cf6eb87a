"""Run a set of processes, restart the one that dies, stop them all on SIGINT or SIGTERM.

    python scripts/supervise.py [OPTIONS] --proc NAME CMD [ARG...] [--proc NAME CMD [ARG...]]...

The embedded platform's supervisor (`scripts/run.sh` runs web, worker, beat and the host agent
under it); production leaves this job to systemd (`deploy/systemd/`). Standard library only: it
imports neither Django nor torch.

Rules:
* Each process runs in a session (process group) of its own, with stdin from /dev/null and its
  stdout and stderr appended to `LOG_DIR/NAME.log`, which is never truncated. The supervisor's
  own lines (start, exit, restart, give up, stop) go to its stderr and are appended to that log.
* A process that exits while the supervisor is not stopping is restarted after a backoff of
  `backoff_s * 2**(k - 1)`, at most `max_backoff_s`, where k counts its exits within the last
  `window_s`. Whatever its process group still holds (a server's workers whose master was
  killed) is killed first, so the new one finds its port free.
* A process that exits more than `max_restarts` times within `window_s` is given up on: the
  supervisor stops every process and exits with status 1. A command that cannot be started
  (not found, not executable) counts as an exit.
* SIGINT or SIGTERM: every process gets SIGTERM (its own children are its business, as under
  systemd's KillMode=mixed); what is left of their groups after `stop_timeout_s` gets SIGKILL.
  Exit status 0. A second signal while stopping changes nothing.
* Should the supervisor itself die, the kernel sends each process SIGTERM (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

PROC_FLAG = "--proc"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcSpec:
    """One supervised process: its name (also its log's name) and its command."""

    name: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Policy:
    """When to restart and when to give up; every duration in seconds."""

    backoff_s: float = 1.0
    """Wait before the first restart within a window; doubled for each further exit."""
    max_backoff_s: float = 30.0
    """Longest wait before a restart."""
    max_restarts: int = 5
    """Exits within `window_s` that are restarted; the next one gives up."""
    window_s: float = 60.0
    """How far back exits count toward the backoff and the cap."""
    stop_timeout_s: float = 10.0
    """How long a process has to exit after SIGTERM before its group gets SIGKILL."""

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be > 0, got {value}"
            for name, value in [
                ("backoff_s", self.backoff_s),
                ("window_s", self.window_s),
                ("stop_timeout_s", self.stop_timeout_s),
            ]
            if not value > 0
        ]
        if self.max_backoff_s < self.backoff_s:
            problems.append(
                f"max_backoff_s ({self.max_backoff_s}) must be >= backoff_s ({self.backoff_s})"
            )
        if self.max_restarts < 0:
            problems.append(f"max_restarts must be >= 0, got {self.max_restarts}")
        if problems:
            raise ValueError("; ".join(problems))

    def delay_s(self, recent_exits: int) -> float:
        """The wait before restarting a process that exited `recent_exits` times (>= 1)."""
        return float(min(self.backoff_s * 2 ** (recent_exits - 1), self.max_backoff_s))


@dataclass
class Child:
    spec: ProcSpec
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    exits: collections.deque[float] = field(default_factory=collections.deque)
    """Monotonic times of its exits within the policy's window."""
    restart_at: float | None = None


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """The child's pre-exec step: SIGTERM when the supervisor dies (Linux), or exit at once if
    it already has."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class Supervisor:
    """Runs `specs` under `policy` until a signal or a process given up on (module docstring)."""

    def __init__(
        self,
        specs: list[ProcSpec],
        *,
        log_dir: Path,
        policy: Policy,
        out: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [spec.name for spec in specs]
        if not specs or len(set(names)) != len(names):
            raise ValueError(f"process names must be given and unique, got {names}")
        self.policy = policy
        self.out = out
        self.clock = clock
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children = [Child(spec, log_dir / f"{spec.name}.log") for spec in specs]
        self._signalled: int | None = None
        self._given_up = False
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)

    # The supervisor's own lines: on its stderr and in the process's log.
    def say(self, child: Child | None, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} harli-supervise: {message}\n"
        self.out.write(line)
        self.out.flush()
        if child is not None:
            with child.log_path.open("a", encoding="utf-8") as log:
                log.write(line)

    def run(self) -> int:
        previous = self._install_signals()
        try:
            for child in self.children:
                self._start(child)
            status = self._supervise()
            self._stop_all()
            return status
        finally:
            self._restore_signals(previous)

    # --- the loop ---------------------------------------------------------------------------

    def _supervise(self) -> int:
        """Restart what exits until a signal (0) or a process is given up on (1)."""
        while self._signalled is None and not self._given_up:
            for child in self.children:
                if child.popen is not None and child.popen.poll() is not None:
                    self._reaped(child)
            now = self.clock()
            for child in self.children:
                if child.restart_at is not None and child.restart_at <= now:
                    self._start(child)
            if self._given_up:
                break
            due = [c.restart_at for c in self.children if c.restart_at is not None]
            self._wait(max(0.0, min(due) - self.clock()) if due else None)
        if self._given_up:
            return 1
        assert self._signalled is not None
        self.say(None, f"received {signal.Signals(self._signalled).name}; stopping")
        return 0

    def _reaped(self, child: Child) -> None:
        assert child.popen is not None and child.popen.returncode is not None
        pid, returncode = child.popen.pid, child.popen.returncode
        self._kill_group(pid)  # what the process left in its group
        child.popen = None
        self._exited(child, f"{child.spec.name} (pid {pid}) {describe_status(returncode)}")

    def _exited(self, child: Child, what: str) -> None:
        """Count an exit and schedule the restart, or give up (module docstring)."""
        now = self.clock()
        child.exits.append(now)
        while child.exits and child.exits[0] < now - self.policy.window_s:
            child.exits.popleft()
        window = f"{self.policy.window_s:g} s"
        if len(child.exits) > self.policy.max_restarts:
            self.say(
                child,
                f"{what}; it exited {len(child.exits)} times within {window}: giving up, "
                "stopping everything",
            )
            self._given_up = True
            return
        delay = self.policy.delay_s(len(child.exits))
        self.say(
            child,
            f"{what}; restarting in {delay:g} s (exit {len(child.exits)} within {window}; "
            f"more than {self.policy.max_restarts} gives up)",
        )
        child.restart_at = now + delay

    def _start(self, child: Child) -> None:
        child.restart_at = None
        with child.log_path.open("ab") as log:
            try:
                child.popen = subprocess.Popen(
                    child.spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent(os.getpid()),
                )
            except OSError as exc:
                self._exited(child, f"{child.spec.name} cannot start ({exc})")
                return
        self.say(child, f"started {child.spec.name} (pid {child.popen.pid})")

    # --- stopping ----------------------------------------------------------------------------

    def _stop_all(self) -> None:
        running = [c for c in self.children if c.popen is not None and c.popen.poll() is None]
        for child in running:
            assert child.popen is not None
            self.say(child, f"stopping {child.spec.name} (pid {child.popen.pid}): SIGTERM")
            child.popen.send_signal(signal.SIGTERM)
        deadline = self.clock() + self.policy.stop_timeout_s
        while any(c.popen is not None and c.popen.poll() is None for c in running):
            left = deadline - self.clock()
            if left <= 0:
                break
            self._wait(left)
        for child in self.children:
            if child.popen is None:
                continue
            pid = child.popen.pid
            if child.popen.poll() is None:
                self.say(
                    child,
                    f"{child.spec.name} (pid {pid}) still running after "
                    f"{self.policy.stop_timeout_s:g} s: SIGKILL",
                )
            self._kill_group(pid)
            child.popen.wait()
            child.popen = None
        self.say(None, "every process stopped")

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # --- signals -----------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, object]:
        previous: dict[int, object] = {}

        def on_stop(signum: int, frame: object) -> None:
            if self._signalled is None:
                self._signalled = signum

        for signum, handler in [
            (signal.SIGINT, on_stop),
            (signal.SIGTERM, on_stop),
            (signal.SIGCHLD, lambda signum, frame: None),  # only to wake the loop
        ]:
            previous[signum] = signal.signal(signum, handler)
        previous[-1] = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        return previous

    def _restore_signals(self, previous: dict[int, object]) -> None:
        wakeup = previous.pop(-1)
        assert isinstance(wakeup, int)
        signal.set_wakeup_fd(wakeup)
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._wake_r.close()
        self._wake_w.close()

    def _wait(self, timeout_s: float | None) -> None:
        """Until a signal arrives (a child's exit among them) or `timeout_s` passes."""
        readable, _, _ = select.select([self._wake_r], [], [], timeout_s)
        if readable:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[ProcSpec]]:
    parser = argparse.ArgumentParser(
        prog="python scripts/supervise.py",
        usage="%(prog)s [OPTIONS] --proc NAME CMD [ARG...] [--proc NAME CMD [ARG...]]...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-dir", type=Path, default=Path("var/log"))
    defaults = Policy()
    parser.add_argument("--backoff-s", type=float, default=defaults.backoff_s)
    parser.add_argument("--max-backoff-s", type=float, default=defaults.max_backoff_s)
    parser.add_argument("--max-restarts", type=int, default=defaults.max_restarts)
    parser.add_argument("--window-s", type=float, default=defaults.window_s)
    parser.add_argument("--stop-timeout-s", type=float, default=defaults.stop_timeout_s)
    if PROC_FLAG not in argv:
        parser.error(f"no process given ({PROC_FLAG} NAME CMD [ARG...])")
    first = argv.index(PROC_FLAG)
    options = parser.parse_args(argv[:first])
    specs: list[ProcSpec] = []
    group: list[str] = []
    for arg in [*argv[first + 1 :], PROC_FLAG]:
        if arg != PROC_FLAG:
            group.append(arg)
            continue
        if len(group) < 2 or not NAME_PATTERN.fullmatch(group[0]):
            parser.error(f"{PROC_FLAG} takes a name ([A-Za-z0-9_.-]) and a command, got {group}")
        specs.append(ProcSpec(group[0], tuple(group[1:])))
        group = []
    return options, specs


def main(argv: list[str] | None = None) -> int:
    options, specs = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        policy = Policy(
            backoff_s=options.backoff_s,
            max_backoff_s=options.max_backoff_s,
            max_restarts=options.max_restarts,
            window_s=options.window_s,
            stop_timeout_s=options.stop_timeout_s,
        )
        supervisor = Supervisor(specs, log_dir=options.log_dir, policy=policy)
    except ValueError as exc:
        print(f"supervise.py: {exc}", file=sys.stderr)
        return 2
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
