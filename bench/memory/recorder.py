"""The rows of `python -m bench.memory mechanism`'s result file: one per measured value or
check; a section that fails records its error and the run goes on. Sizes the measurements use."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
PAGE = 2 * MIB


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Recorder:
    """Rows of one result file; a failing section records its error and the run goes on."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def value(
        self, section: str, measure: str, value: float | None, unit: str, **extra: Any
    ) -> None:
        self.rows.append(
            {"section": section, "measure": measure, "value": value, "unit": unit, **extra}
        )

    def check(self, section: str, name: str, passed: bool, detail: str = "") -> None:
        self.rows.append(
            {"section": section, "check": name, "passed": bool(passed), "detail": detail}
        )

    def run(self, section: str, body: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            body()
        except Exception as exc:  # a section's failure is a result, not the end of the run
            self.check(section, "section completed", False, f"{type(exc).__name__}: {exc}")
        else:
            self.check(section, "section completed", True)
        print(f"[{section}] {time.perf_counter() - start:.1f} s", flush=True)
