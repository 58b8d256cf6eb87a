"""`scripts/supervise.py`, the run command's supervisor: a killed process is restarted and
logged, logs are appended, a process that keeps dying is given up on, and SIGTERM (or the
supervisor's own death) leaves no process behind."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE = ROOT / "scripts" / "supervise.py"
# A child that says it is up (with its pid) and then waits to be stopped.
SLEEPER = "import os, time; print('up', os.getpid(), flush=True); time.sleep(600)"


def load_supervise() -> ModuleType:
    spec = importlib.util.spec_from_file_location("supervise", SUPERVISE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["supervise"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def started_pids(log: Path, name: str) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(pid) for pid in re.findall(rf"started {name} \(pid (\d+)\)", text)]


def up_pids(log: Path) -> list[int]:
    """The pids the children printed once running (after exec, not just after fork)."""
    text = log.read_text() if log.exists() else ""
    return [int(pid) for pid in re.findall(r"^up (\d+)$", text, re.MULTILINE)]


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start the supervisor with options and `--proc` groups; its stderr goes to
    tmp_path/supervise.err. Killed at the end if a test left it running."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        err = (tmp_path / "supervise.err").open("a")
        proc = subprocess.Popen(
            [sys.executable, str(SUPERVISE), "--log-dir", str(tmp_path / "log"), *args],
            stdout=err, stderr=err, text=True,
        )  # fmt: skip
        err.close()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_process_is_restarted_logged_and_appended_and_sigterm_stops_all(
    tmp_path: Path, supervise: Callable[..., subprocess.Popen[str]]
) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    web_log, worker_log = log_dir / "web.log", log_dir / "worker.log"
    web_log.write_text("a line from an earlier run\n")
    # The worker starts a grandchild in its process group, as a server's master starts workers.
    worker = f'sleep 600 & echo grandchild $!; exec {sys.executable} -c "{SLEEPER}"'
    sup = supervise(
        "--backoff-s", "0.1",
        "--proc", "web", sys.executable, "-c", SLEEPER,
        "--proc", "worker", "sh", "-c", worker,
    )  # fmt: skip
    wait_until(lambda: len(up_pids(web_log)) == 1 and len(up_pids(worker_log)) == 1, 30, "up")
    (first_web,) = started_pids(web_log, "web")
    assert up_pids(web_log) == [first_web]

    os.kill(first_web, signal.SIGKILL)
    wait_until(lambda: len(up_pids(web_log)) == 2, 30, "web to be restarted")

    text = web_log.read_text()
    assert text.startswith("a line from an earlier run\n")  # appended, not truncated
    restart_line = f"web (pid {first_web}) was killed by SIGKILL; restarting in 0.1 s"
    assert restart_line in text
    assert restart_line in (tmp_path / "supervise.err").read_text()
    second_web = started_pids(web_log, "web")[1]
    assert second_web != first_web and up_pids(web_log)[1] == second_web
    assert started_pids(worker_log, "worker") == up_pids(worker_log)  # the worker ran on
    (grandchild,) = map(int, re.findall(r"grandchild (\d+)", worker_log.read_text()))
    alive = [second_web, *up_pids(worker_log), grandchild]
    assert not any(gone(pid) for pid in alive)

    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    assert [pid for pid in alive if not gone(pid)] == []
    assert "every process stopped" in (tmp_path / "supervise.err").read_text()


def test_a_process_that_keeps_dying_is_given_up_on_and_everything_stops(
    tmp_path: Path, supervise: Callable[..., subprocess.Popen[str]]
) -> None:
    sup = supervise(
        "--backoff-s", "0.05", "--max-restarts", "2", "--window-s", "60",
        "--proc", "steady", sys.executable, "-c", SLEEPER,
        "--proc", "crashy", sys.executable, "-c", "raise SystemExit(3)",
    )  # fmt: skip
    assert sup.wait(timeout=60) == 1
    crashy = (tmp_path / "log" / "crashy.log").read_text()
    assert len(started_pids(tmp_path / "log" / "crashy.log", "crashy")) == 3
    assert crashy.count("exited with status 3; restarting") == 2
    assert "exited with status 3; it exited 3 times within 60 s: giving up" in crashy
    steady = up_pids(tmp_path / "log" / "steady.log")
    assert len(steady) == 1 and gone(steady[0])


def test_a_command_that_cannot_start_counts_as_an_exit(
    tmp_path: Path, supervise: Callable[..., subprocess.Popen[str]]
) -> None:
    sup = supervise(
        "--backoff-s", "0.05", "--max-restarts", "1",
        "--proc", "missing", str(tmp_path / "no-such-program"),
    )  # fmt: skip
    assert sup.wait(timeout=60) == 1
    log = (tmp_path / "log" / "missing.log").read_text()
    assert log.count("missing cannot start") == 2
    assert "giving up" in log


def test_a_process_that_ignores_sigterm_is_killed_after_the_stop_timeout(
    tmp_path: Path, supervise: Callable[..., subprocess.Popen[str]]
) -> None:
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    sup = supervise("--stop-timeout-s", "0.5", "--proc", "stubborn", sys.executable, "-c", stubborn)
    log = tmp_path / "log" / "stubborn.log"
    wait_until(lambda: up_pids(log), 30, "stubborn to be up")
    sup.send_signal(signal.SIGINT)  # Ctrl-C
    assert sup.wait(timeout=30) == 0
    assert "still running after 0.5 s: SIGKILL" in log.read_text()
    assert gone(up_pids(log)[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_processes_stop_when_the_supervisor_itself_is_killed(
    tmp_path: Path, supervise: Callable[..., subprocess.Popen[str]]
) -> None:
    sup = supervise("--proc", "web", sys.executable, "-c", SLEEPER)
    log = tmp_path / "log" / "web.log"
    wait_until(lambda: up_pids(log), 30, "web to be up")
    sup.kill()
    sup.wait()
    wait_until(lambda: gone(up_pids(log)[0]), 30, "web to stop with its supervisor")


def test_the_backoff_doubles_up_to_its_cap_and_bad_policies_are_refused() -> None:
    supervise = load_supervise()
    policy = supervise.Policy(backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(k) for k in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError, match=r"max_backoff_s \(0.5\) must be >= backoff_s \(1.0\)"):
        supervise.Policy(backoff_s=1.0, max_backoff_s=0.5)
    with pytest.raises(ValueError, match="max_restarts must be >= 0, got -1"):
        supervise.Policy(max_restarts=-1)


def test_the_command_line_needs_named_processes() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SUPERVISE), *args], capture_output=True, text=True, timeout=30
        )

    assert "no process given" in run("--log-dir", "x").stderr
    assert "takes a name" in run("--proc", "web").stderr
    assert "unique" in run("--proc", "a", "true", "--proc", "a", "true").stderr
