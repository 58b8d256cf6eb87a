"""Training-file validation, line by line."""

from __future__ import annotations

import pytest

from api.training_files import TrainingFileError, check_training_lines
from gpu_runtime.contract.training_files import MAX_REPORTED_ERRORS, validate_training_lines


def lines(*texts: str) -> list[bytes]:
    return [t.encode() + b"\n" for t in texts]


CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


def test_valid_chat_file_counts_examples_and_skips_blank_lines() -> None:
    report = check_training_lines(lines(CHAT, "", CHAT))
    assert report.format == "chat" and report.example_count == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "each line must be a JSON object"),
        ('{"text": "x"}', "expected a chat example"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": ["hi"]}', "messages[0] must be an object"),
        ('{"messages": [{"role": "assistant", "content": 3}]}', "content must be a string"),
        ('{"messages": [{"role": "assistant", "content": ""}]}', "must not be empty"),
        ('{"prompt": "a"}', "'completion' must be a non-empty string"),
        ('{"prompt": 1, "completion": "b"}', "'prompt' must be a string"),
    ],
)
def test_each_problem_is_reported_on_its_line(line: str, message: str) -> None:
    report = validate_training_lines(lines("", line))
    assert report.errors == [(2, report.errors[0][1])]
    assert message in report.errors[0][1]


def test_invalid_utf8_is_reported() -> None:
    report = validate_training_lines([b"\xff\xfe\n"])
    assert report.errors == [(1, "not valid UTF-8")]


def test_error_list_is_capped_but_counted() -> None:
    with pytest.raises(TrainingFileError) as caught:
        check_training_lines(lines(*["{bad"] * (MAX_REPORTED_ERRORS + 5)))
    report = caught.value.report
    assert report is not None
    assert report.error_count == MAX_REPORTED_ERRORS + 5
    assert len(report.errors) == MAX_REPORTED_ERRORS
    assert "and 5 more" in caught.value.message
