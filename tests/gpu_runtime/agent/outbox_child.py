"""A report sender in its own process, for the outbox tests to kill with SIGKILL.

`python -m tests.gpu_runtime.agent.outbox_child BROKER_URL OUTBOX_DIR FIRST COUNT [HOLD]` opens
the outbox (sending first what it holds), starts the sender, then sends COUNT `job_progress`
reports for steps FIRST.., printing `queued <step>` once each is on disk. With HOLD, the
sender stops right after the broker confirmed the report of step HOLD, before the outbox
forgets it: it prints `published <step>` and waits to be killed. Otherwise it prints `flushed`
once everything left and waits to be stopped.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from gpu_runtime.agent.channel import ReportSender
from gpu_runtime.agent.outbox import DiskOutbox, OutboxEntry
from gpu_runtime.contract.protocol import report

HOST = "h1"


def progress(step: int) -> dict[str, object]:
    return report("job_progress", HOST, placement_id=1, job_id="ftjob-1", step=step,
                  train_loss=1.0 / step)  # fmt: skip


class HoldingSender(ReportSender):
    """Blocks forever after the broker confirmed the report of step `hold`."""

    hold: int | None = None

    def _publish(self, entry: OutboxEntry) -> None:
        super()._publish(entry)
        step = entry.task["body"][0][0]["step"]
        if step == self.hold:
            print(f"published {step}", flush=True)
            threading.Event().wait()


def main() -> None:
    url, directory, first, count = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:5])
    HoldingSender.hold = int(sys.argv[5]) if len(sys.argv) > 5 else None
    sender = HoldingSender(url, {}, None, DiskOutbox(directory))
    sender.start()
    for step in range(first, first + count):
        sender.send(progress(step))
        print(f"queued {step}", flush=True)
    sender.stop(timeout=60)
    if sender.pending() == 0:
        print("flushed", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
