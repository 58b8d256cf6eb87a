"""The stream relay: whole events, the usage chunk taken (and passed on only when asked)."""

from __future__ import annotations

import json

from api.gateway.relay import StreamRelay, error_event


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


CHUNK = event({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


def test_events_leave_whole_however_the_bytes_arrive() -> None:
    relay = StreamRelay(forward_usage=True)
    stream = CHUNK + CHUNK + USAGE + DONE
    out = b"".join(relay.feed(stream[i : i + 5]) for i in range(0, len(stream), 5))
    assert out == stream
    assert relay.done and relay.content_events == 2
    usage = relay.account(None)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.exact) == (7, 3, True)


def test_the_usage_chunk_is_dropped_when_the_client_did_not_ask_for_it() -> None:
    relay = StreamRelay(forward_usage=False)
    assert relay.feed(CHUNK + USAGE + DONE) == CHUNK + DONE
    assert relay.account(None).completion_tokens == 3


def test_a_partial_event_waits_for_its_end() -> None:
    relay = StreamRelay(forward_usage=True)
    assert relay.feed(CHUNK[:-1]) == b""
    assert relay.feed(b"\n") == CHUNK


def test_a_cut_off_stream_is_accounted_from_the_header_and_the_events_sent() -> None:
    relay = StreamRelay(forward_usage=False)
    relay.feed(CHUNK * 4)
    usage = relay.account("12")
    assert (usage.prompt_tokens, usage.completion_tokens, usage.exact) == (12, 4, False)
    assert not relay.done
    assert relay.account("not-a-number").prompt_tokens == 0


def test_a_content_chunk_that_mentions_usage_in_its_text_is_content() -> None:
    relay = StreamRelay(forward_usage=False)
    text = event({"choices": [{"index": 0, "text": '"usage"', "finish_reason": None}]})
    assert relay.feed(text) == text
    assert relay.usage is None and relay.content_events == 1


def test_error_events_have_openais_shape() -> None:
    body = json.loads(error_event("boom", "upstream_error").removeprefix(b"data: "))
    assert body == {"error": {"message": "boom", "type": "server_error", "param": None,
                              "code": "upstream_error"}}  # fmt: skip
