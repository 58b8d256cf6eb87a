"""The completion routes: ``/v1/completions`` and ``/v1/chat/completions``, each answered in
full or streamed as server-sent events (``stream: true``; usage with
``stream_options.include_usage``), with logprobs when asked. A chat with ``tools`` is planned,
constrained and answered with ``tool_calls`` by `tool_calls`, `tool_constraints` and
`tool_stream`.

Every successful answer carries `PROMPT_TOKENS_HEADER`: the request's prompt tokens (summed
over the prompts of a multi-prompt completion), known before the first token, so whoever relays
a stream can account its prompt even when the stream is cut off before its usage chunk."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import StreamingResponse

from gpu_runtime.contract.grants import PROMPT_TOKENS_HEADER
from gpu_runtime.engine.request import RequestOutput
from gpu_runtime.server.auth import ModelAccess
from gpu_runtime.server.inference import Inference, inference_of, require_access
from gpu_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from gpu_runtime.server.responses import (
    Tracked,
    chat_logprobs,
    completion_logprobs,
    sse,
    text_delta,
    text_length,
    usage,
)
from gpu_runtime.server.tool_calls import assistant_message, plan_tools
from gpu_runtime.server.tool_constraints import constrain_to_calls
from gpu_runtime.server.tool_stream import ToolCallStream

logger = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest,
    response: Response,
    access: ModelAccess = Depends(require_access),
    inference: Inference = Depends(inference_of),
) -> Any:
    try:
        texts = body.prompts()
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from exc
    inference.limits.check_prompt_count(len(texts))  # before loading a model or tokenizing
    lora = await inference.resolve_model(body.model, access)
    try:
        prompts = await inference.encode_prompts(texts)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from exc
    params = inference.sampling(body, body.max_tokens or 16, body.logprobs)
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    fingerprint = inference.system_fingerprint()
    _log_user(cid, body.user)
    tracked = [Tracked(len(ids), time.perf_counter()) for ids in prompts]
    holdback = max((len(s) for s in params.stop), default=1) - 1
    prompt_tokens = {PROMPT_TOKENS_HEADER: str(sum(len(ids) for ids in prompts))}

    if not body.stream:

        async def collect(i: int) -> None:
            async for _ in inference.run_one(prompts[i], params, lora, tracked[i], access):
                pass
            inference.record(cid, body.model, tracked[i])

        await asyncio.gather(*(collect(i) for i in range(len(prompts))))
        choices = [
            {
                "index": i,
                "text": t.last.text if t.last else "",
                "logprobs": (
                    completion_logprobs(inference.tokenizer(), t.logprobs)
                    if body.logprobs is not None
                    else None
                ),
                "finish_reason": t.last.finish_reason if t.last else None,
            }
            for i, t in enumerate(tracked)
        ]
        response.headers.update(prompt_tokens)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage(tracked),
        }

    first_outputs = [
        inference.run_one(prompts[i], params, lora, tracked[i], access) for i in range(len(prompts))
    ]
    # Surface request errors (bad length, unknown adapter) before the stream starts.
    heads = [await anext(gen) for gen in first_outputs]

    async def stream() -> AsyncIterator[str]:
        merged: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            await merged.put((i, heads[i]))
            async for out in first_outputs[i]:
                await merged.put((i, out))
            await merged.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        sent = [0] * len(prompts)
        offsets = [0] * len(prompts)  # characters of each prompt's tokens sent in logprobs
        open_streams = len(prompts)
        try:
            while open_streams:
                i, out = await merged.get()
                if out is None:
                    open_streams -= 1
                    inference.record(cid, body.model, tracked[i])
                    continue
                text, sent[i] = text_delta(out.text, sent[i], out.finished, holdback)
                lps = None
                if body.logprobs is not None and out.new_logprobs:
                    lps = completion_logprobs(inference.tokenizer(), out.new_logprobs, offsets[i])
                    offsets[i] += text_length(lps)
                if text or lps or out.finished:
                    yield sse(
                        {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": body.model,
                            "system_fingerprint": fingerprint,
                            "choices": [
                                {
                                    "index": i,
                                    "text": text,
                                    "logprobs": lps,
                                    "finish_reason": out.finish_reason,
                                }
                            ],
                        }
                    )
            if body.stream_options and body.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": body.model,
                        "system_fingerprint": fingerprint,
                        "choices": [],
                        "usage": usage(tracked),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    return StreamingResponse(stream(), media_type="text/event-stream", headers=prompt_tokens)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    response: Response,
    access: ModelAccess = Depends(require_access),
    inference: Inference = Depends(inference_of),
) -> Any:
    plan = plan_tools(
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        body.messages,
        inference.tokenizer().chat_template,
    )
    lora = await inference.resolve_model(body.model, access)
    messages = [m.template_dict() for m in body.messages]
    ids = await inference.encode_chat(messages, plan.template_tools() if plan else None)
    room = max(1, inference.engine_loop.engine.config.max_model_len - len(ids))
    limit = body.max_completion_tokens or body.max_tokens or room
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = await constrain_to_calls(
        plan, inference.sampling(body, limit, top), inference.engine_loop.engine.structured
    )
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    fingerprint = inference.system_fingerprint()
    _log_user(cid, body.user)
    tracked = Tracked(len(ids), time.perf_counter())
    holdback = max((len(s) for s in params.stop), default=1) - 1
    prompt_tokens = {PROMPT_TOKENS_HEADER: str(len(ids))}
    generator = inference.run_one(ids, params, lora, tracked, access)
    head = await anext(generator)

    if not body.stream:
        last = head
        if not head.finished:
            async for out in generator:
                last = out
        inference.record(cid, body.model, tracked)
        response.headers.update(prompt_tokens)
        message, finish_reason = assistant_message(plan, last.text, last.finish_reason)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": fingerprint,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": (
                        chat_logprobs(inference.tokenizer(), tracked.logprobs)
                        if body.logprobs
                        else None
                    ),
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage([tracked]),
        }

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> str:
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "system_fingerprint": fingerprint,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    async def stream() -> AsyncIterator[str]:
        tool_stream = ToolCallStream(plan) if plan is not None and plan.parses else None
        # content stays null in an answer of only calls: its first chunk says no content
        yield chunk({"role": "assistant", "content": None if tool_stream else ""}, None)
        sent = 0
        out: RequestOutput | None = head
        while out is not None:
            lps = chat_logprobs(inference.tokenizer(), out.new_logprobs) if body.logprobs else None
            if tool_stream is not None:
                deltas = tool_stream.deltas(out.text, out.finished, holdback)
                for delta in deltas:
                    yield chunk(delta, None, lps)
                    lps = None
                if lps:
                    yield chunk({}, None, lps)
            else:
                text, sent = text_delta(out.text, sent, out.finished, holdback)
                if text or lps:
                    yield chunk({"content": text}, None, lps)
            if out.finished:
                reason = out.finish_reason
                yield chunk({}, tool_stream.finish_reason(reason) if tool_stream else reason)
                break
            out = await anext(generator, None)
        inference.record(cid, body.model, tracked)
        if body.stream_options and body.stream_options.include_usage:
            yield sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model,
                    "system_fingerprint": fingerprint,
                    "choices": [],
                    "usage": usage([tracked]),
                }
            )
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers=prompt_tokens)


def _log_user(cid: str, user: str | None) -> None:
    """OpenAI's `user` (the caller's end-user id, for abuse monitoring): one INFO line with the
    response id; the request-id middleware adds the request's `x-request-id`."""
    if user is not None:
        logger.info("%s: end user %r", cid, user)
