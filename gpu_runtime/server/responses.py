"""OpenAI response pieces the server builds: per-prompt tracking, usage, the prompt-tokens
header, logprobs, SSE framing and the streamed text delta."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from gpu_runtime.engine.request import RequestOutput, TokenLogprob

"""Response header of every successful completion: the request's prompt tokens."""


@dataclass
class Tracked:
    """One generated sequence (a choice, or a `best_of` candidate): outputs so far and its
    timings (`time.perf_counter`)."""

    prompt_tokens: int
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last: RequestOutput | None = None
    logprobs: list[Any] = field(default_factory=list)


def text_delta(text: str, sent: int, finished: bool, holdback: int) -> tuple[str, int]:
    """New text safe to send; returns the piece and the new sent offset. Until the request
    finishes, trailing U+FFFDs (a character whose bytes have not all arrived) are held back,
    then `holdback` more characters (where a stop string could start: a match found later
    cuts the final text there, so sent text is never cut). Costs O(unsent text), not O(text).
    """
    if finished:
        upto = len(text)
    else:
        upto = sent + len(text[sent:].rstrip("\ufffd")) - holdback
    upto = max(upto, sent)
    return text[sent:upto], upto


def usage(prompts: list[list[Tracked]]) -> dict[str, Any]:
    """OpenAI's `usage` of one response, over each prompt's sequences: every prompt counted
    once, the tokens of every sequence generated (`best_of` candidates not returned
    included); `prompt_tokens_details.cached_tokens` counts the prompt tokens the engine's
    prefix cache served (once per prompt)."""
    prompt = sum(seqs[0].prompt_tokens for seqs in prompts if seqs)
    tracked = [t for seqs in prompts for t in seqs]
    completion = sum(len(t.last.output_token_ids) for t in tracked if t.last)
    cached = sum(
        max((t.last.num_cached_tokens for t in seqs if t.last), default=0) for seqs in prompts
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def completion_logprobs(
    tokenizer: Any,
    items: list[Any],
    offset: int = 0,
    prompt_ids: list[int] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
) -> dict[str, Any]:
    """`choices[i].logprobs` of a text completion, or of one streamed chunk: `items` are the
    tokens' logprobs (`RequestOutput.new_logprobs`), `offset` the characters of the tokens
    before them (a chunk's `text_offset` continues the previous chunk's), so a stream's chunks
    concatenated equal the whole response's logprobs. With echo, the prompt's tokens come
    first (`prompt_ids`, their `prompt_logprobs`: the first token's logprob and top are null)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt_ids is not None:
        if prompt_logprobs is None or len(prompt_logprobs) != len(prompt_ids):
            raise ValueError("echo with logprobs needs one prompt logprob per prompt token")
        for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=True):
            tokens.append(_token_text(tokenizer, token_id))
            values.append(entry.logprob if entry is not None else None)
            tops.append(
                {_token_text(tokenizer, t): v for t, v in entry.top} if entry is not None else None
            )
    for lp in items:
        tokens.append(_token_text(tokenizer, lp.token_id))
        values.append(lp.logprob)
        tops.append({_token_text(tokenizer, t): v for t, v in lp.top})
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset))[
            : len(tokens)
        ],
    }


def text_length(logprobs: dict[str, Any]) -> int:
    """Characters of the tokens of `completion_logprobs`'s answer (the next chunk's offset)."""
    return sum(len(t) for t in logprobs["tokens"])


def chat_logprobs(tokenizer: Any, items: list[Any]) -> dict[str, Any]:
    """`choices[0].logprobs` of a chat completion (or one chunk of it)."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {
        "content": [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


def usage_chunk(
    cid: str, kind: str, created: int, model: str, fingerprint: str, prompts: list[list[Tracked]]
) -> str:
    """The stream's last chunk before `[DONE]` when `stream_options.include_usage` asks for
    it: no choices, the request's `usage` over `prompts`."""
    return sse(
        {
            "id": cid,
            "object": kind,
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": [],
            "usage": usage(prompts),
        }
    )


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"
