"""Request ids and the log lines that carry them (`gpu_runtime.contract.request_id`,
`log_format`): which ids a client may choose, contexts that never leak between threads or
tasks, and the JSON and text lines every process writes."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading

import pytest

from gpu_runtime.contract.log_format import JsonLogFormatter, TextLogFormatter, logging_config
from gpu_runtime.contract.protocol import ProtocolError, check_command
from gpu_runtime.contract.request_id import (
    LogContextFilter,
    bind_log_context,
    bound_log_context,
    current_request_id,
    log_context,
    new_request_id,
    request_id_or_new,
    reset_log_context,
    valid_request_id,
)


@pytest.mark.parametrize("good", ["a", "req_0123", "x" * 128, "A.b:c-d_e", "01HZY3"])
def test_valid_ids_are_kept(good: str) -> None:
    assert valid_request_id(good) == good == request_id_or_new(good)


@pytest.mark.parametrize(
    "bad", ["", "x" * 129, "a b", "a\nb", "a\x00b", "é", "a/b", "a;b", "<x>", None, 12, b"ab"]
)
def test_invalid_ids_are_replaced_by_fresh_ones(bad: object) -> None:
    assert valid_request_id(bad) is None
    fresh = request_id_or_new(bad)
    assert fresh.startswith("req_") and valid_request_id(fresh) == fresh
    assert new_request_id() != new_request_id()


def test_a_bound_context_is_restored_and_stays_in_its_thread() -> None:
    assert log_context().request_id is None
    seen: list[str | None] = []
    with bound_log_context(request_id="outer", tenant="acme"):
        token = bind_log_context(job_id="ftjob-1")
        assert log_context().tenant == "acme" and log_context().job_id == "ftjob-1"
        with bound_log_context(request_id="inner", tenant=None):  # None keeps what is bound
            assert (current_request_id(), log_context().tenant) == ("inner", "acme")
        thread = threading.Thread(target=lambda: seen.append(current_request_id()))
        thread.start()
        thread.join()
        reset_log_context(token)
        assert log_context().job_id is None and current_request_id() == "outer"
    assert seen == [None] and current_request_id() is None


def test_concurrent_tasks_keep_their_own_ids() -> None:
    async def one(name: str) -> list[str | None]:
        with bound_log_context(request_id=name):
            ids = []
            for _ in range(3):
                await asyncio.sleep(0)
                ids.append(current_request_id())
            return ids

    async def both() -> list[list[str | None]]:
        return list(await asyncio.gather(one("a"), one("b")))

    assert asyncio.run(both()) == [["a"] * 3, ["b"] * 3]


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(LogContextFilter())
    logger = logging.getLogger(f"harli.test.{type(formatter).__name__}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_a_json_line_names_its_context_and_carries_the_traceback() -> None:
    logger, stream = _logger(JsonLogFormatter())
    with bound_log_context(request_id="r-1", tenant="acme", job_id="ftjob-9"):
        try:
            raise ValueError("bad value")
        except ValueError:
            logger.exception("it failed: %s", "here", extra={"placement_id": 3})
    logger.info("outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert list(first)[:7] == [
        "timestamp", "level", "logger", "message", "request_id", "tenant", "job_id",
    ]  # fmt: skip
    assert first["level"] == "ERROR" and first["message"] == "it failed: here"
    assert (first["request_id"], first["tenant"], first["job_id"]) == ("r-1", "acme", "ftjob-9")
    assert first["placement_id"] == 3 and first["timestamp"].endswith("+00:00")
    assert (
        first["exception"].startswith("Traceback") and "ValueError: bad value" in first["exception"]
    )
    assert second["request_id"] is None and "exception" not in second


def test_an_explicit_extra_wins_over_the_context() -> None:
    logger, stream = _logger(JsonLogFormatter())
    with bound_log_context(request_id="r-1", job_id="ftjob-1"):
        logger.info("about another job", extra={"job_id": "ftjob-2"})
    line = json.loads(stream.getvalue())
    assert line["job_id"] == "ftjob-2" and line["request_id"] == "r-1"


def test_a_text_line_names_the_request_or_a_dash() -> None:
    logger, stream = _logger(TextLogFormatter())
    with bound_log_context(request_id="r-2"):
        logger.info("inside")
    logger.info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith("INFO harli.test.TextLogFormatter [r-2] inside")
    assert outside.endswith("[-] outside")


def test_an_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        logging_config(log_format="xml", level="INFO", loggers=[])


def test_a_command_with_an_invalid_request_id_is_malformed() -> None:
    command = {"command": "drain", "command_id": "c1"}
    assert check_command(command | {"request_id": "ok-1"})["request_id"] == "ok-1"
    with pytest.raises(ProtocolError, match="invalid request_id"):
        check_command(command | {"request_id": "not ok"})
