"""Training files as the API sees them: the upload check's verdict as an API error, and the
formats a job's method trains on. The rules themselves are the contract's
(`gpu_runtime.contract.training_files`, `gpu_runtime.contract.training_data`).
"""

from __future__ import annotations

from collections.abc import Iterable

from api.errors import HarliError
from gpu_runtime.contract.training_files import (
    METHOD_FORMATS,
    TrainingFileReport,
    validate_training_lines,
)


class TrainingFileError(HarliError):
    """The uploaded file is not a valid training file; the message lists bad lines by number."""

    def __init__(self, report: TrainingFileReport | None, message: str | None = None) -> None:
        if message is None:
            assert report is not None
            listed = "; ".join(f"line {n}: {m}" for n, m in report.errors)
            more = report.error_count - len(report.errors)
            message = f"Invalid training file ({report.error_count} bad line(s)): {listed}" + (
                f"; and {more} more" if more > 0 else ""
            )
        super().__init__(message, code="invalid_file_format", param="file")
        self.report = report


def check_training_lines(lines: Iterable[bytes]) -> TrainingFileReport:
    """Validate and raise `TrainingFileError` unless every line is a valid example of one format."""
    report = validate_training_lines(lines)
    if report.errors:
        raise TrainingFileError(report)
    if report.example_count == 0:
        raise TrainingFileError(report, "The training file contains no examples.")
    return report


def check_method_format(*, method: str, file_format: str, file_id: str, param: str) -> None:
    """Raise a 400 unless a `method` job can train on a file of `file_format`."""
    if file_format in METHOD_FORMATS[method]:
        return
    if method == "dpo":
        message = (
            f"File {file_id} is in {file_format or 'an unknown'} format; a DPO job needs a "
            "preference file (lines with 'input', 'preferred_output', 'non_preferred_output')."
        )
    else:
        message = (
            f"File {file_id} holds preference pairs, which only a DPO job trains on; give "
            "method={'type': 'dpo', ...} or a chat or prompt/completion file."
        )
    raise HarliError(message, param=param, code="invalid_file_format")
