"""The one `openai`-client script the reference tier runs against vLLM's server and ours.

Each case is a request a user would send; its outcome is a JSON-able record: for an answer,
its text, tokens, logprobs, finish reason and usage; for a refusal, its status and `param`.
`run_script` runs every case and returns {case: outcome}; the tier compares two servers'
outcomes (`compare`). By hand, against any OpenAI-compatible server:

    python -m tests.reference.openai_script --base-url http://127.0.0.1:8000/v1 --model tiny \
        [--adapter NAME] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import openai

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
Outcome = dict[str, Any]


def _completion(r: Any) -> Outcome:
    out: Outcome = {"status": 200, "choices": []}
    for c in r.choices:
        lp = c.logprobs
        out["choices"].append(
            {
                "text": c.text,
                "finish_reason": c.finish_reason,
                "tokens": lp.tokens if lp else None,
                "logprobs": lp.token_logprobs if lp else None,
                "top_logprobs": lp.top_logprobs if lp else None,
                "text_offset": lp.text_offset if lp else None,
            }
        )
    out["usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens] if r.usage else None
    return out


def _chat(r: Any) -> Outcome:
    c = r.choices[0]
    content = (c.logprobs.content or []) if c.logprobs else None
    return {
        "status": 200,
        "text": c.message.content,
        "finish_reason": c.finish_reason,
        "tokens": [e.token for e in content] if content is not None else None,
        "logprobs": [e.logprob for e in content] if content is not None else None,
        "top_logprobs": (
            [{t.token: t.logprob for t in e.top_logprobs} for e in content]
            if content is not None
            else None
        ),
        "usage": [r.usage.prompt_tokens, r.usage.completion_tokens],
    }


def _completion_stream(chunks: list[Any]) -> Outcome:
    """A stream's choice 0 put back together: its text and its chunks' logprobs concatenated."""
    text, usage = "", None
    tokens: list[str] = []
    logprobs: list[float] = []
    offsets: list[int] = []
    for chunk in chunks:
        if chunk.usage is not None:
            usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                logprobs += c.logprobs.token_logprobs or []
                offsets += c.logprobs.text_offset or []
    return {
        "status": 200,
        "text": text,
        "tokens": tokens,
        "logprobs": logprobs,
        "text_offset": offsets,
        "usage": usage,
    }


def _chat_stream(chunks: list[Any]) -> Outcome:
    text, usage, finish = "", None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return {"status": 200, "text": text, "finish_reason": finish, "usage": usage}


def _refusal(call: Callable[[], Any]) -> Outcome | None:
    try:
        call()
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return {"status": exc.status_code, "param": body.get("param")}
    return None


def run_script(client: openai.OpenAI, model: str, adapter: str | None) -> dict[str, Outcome]:
    """Every case's outcome against the server behind `client`."""
    # Any: the cases pass their fields as one dict, which the client's overloads cannot type
    cmp: Any = client.completions.create
    chat: Any = client.chat.completions.create
    greedy = {"model": model, "temperature": 0.0, "max_tokens": 8}
    cases: dict[str, Callable[[], Outcome]] = {
        "completion": lambda: _completion(cmp(prompt=PROMPT, logprobs=3, **greedy)),
        "completion_two_prompts": lambda: _completion(cmp(prompt=[PROMPT, "Hello"], **greedy)),
        "completion_token_ids": lambda: _completion(cmp(prompt=[5, 17, 42, 99], **greedy)),
        "completion_stop": lambda: _completion(cmp(prompt=PROMPT, stop=[" do"], **greedy)),
        "completion_stream": lambda: _completion_stream(
            list(
                cmp(
                    prompt=PROMPT,
                    logprobs=2,
                    stream=True,
                    stream_options={"include_usage": True},
                    **greedy,
                )
            )
        ),
        "completion_seeded": lambda: _completion(
            cmp(prompt=PROMPT, model=model, temperature=1.0, seed=7, max_tokens=8)
        ),
        "chat": lambda: _chat(chat(messages=MESSAGES, logprobs=True, top_logprobs=3, **greedy)),
        "chat_max_completion_tokens": lambda: _chat(
            chat(messages=MESSAGES, max_completion_tokens=3, **greedy)
        ),
        "chat_stream": lambda: _chat_stream(
            list(
                chat(
                    messages=MESSAGES,
                    stream=True,
                    stream_options={"include_usage": True},
                    **greedy,
                )
            )
        ),
    }
    if adapter is not None:
        tuned = {**greedy, "model": adapter}
        cases["adapter_completion"] = lambda: _completion(cmp(prompt=PROMPT, logprobs=2, **tuned))
        cases["adapter_chat"] = lambda: _chat(chat(messages=MESSAGES, logprobs=True, **tuned))
    refusals: dict[str, Callable[[], Any]] = {
        "refuse_unknown_model": lambda: cmp(prompt=PROMPT, **{**greedy, "model": "no-such"}),
        "refuse_temperature_range": lambda: cmp(prompt=PROMPT, **{**greedy, "temperature": 3}),
        "refuse_empty_prompt": lambda: cmp(prompt="", **greedy),
        "refuse_top_logprobs_without_logprobs": lambda: chat(
            messages=MESSAGES, top_logprobs=2, **greedy
        ),
        "refuse_stream_options_without_stream": lambda: cmp(
            prompt=PROMPT, stream_options={"include_usage": True}, **greedy
        ),
        "refuse_suffix": lambda: cmp(prompt=PROMPT, suffix=" the end", **greedy),
        "refuse_max_tokens_past_context": lambda: cmp(
            prompt=PROMPT, **{**greedy, "max_tokens": 1000}
        ),
        "unknown_field": lambda: cmp(prompt=PROMPT, extra_body={"no_such_field": 1}, **greedy),
        "unknown_message_field": lambda: chat(
            messages=[{**MESSAGES[0], "no_such_field": 1}],
            **greedy,
        ),
        "presence_penalty": lambda: cmp(prompt=PROMPT, presence_penalty=0.5, **greedy),
        "n": lambda: cmp(prompt=PROMPT, n=2, **greedy),
        "echo": lambda: cmp(prompt=PROMPT, echo=True, **greedy),
        "message_name": lambda: chat(
            messages=[{**MESSAGES[0], "name": "alice"}],
            **greedy,
        ),
    }
    outcomes = {name: case() for name, case in cases.items()}
    for name, call in refusals.items():
        outcomes[name] = _refusal(call) or {"status": 200}
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    print(json.dumps(run_script(client, args.model, args.adapter), indent=1))


if __name__ == "__main__":
    main()
