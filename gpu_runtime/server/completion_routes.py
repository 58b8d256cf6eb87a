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
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import StreamingResponse

from gpu_runtime.contract.grants import PROMPT_TOKENS_HEADER
from gpu_runtime.engine.request import RequestOutput
from gpu_runtime.server.auth import ModelAccess
from gpu_runtime.server.choices import PromptRun, best, merge_streams
from gpu_runtime.server.inference import Inference, inference_of, require_access
from gpu_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from gpu_runtime.server.responses import (
    chat_logprobs,
    completion_logprobs,
    sse,
    text_delta,
    text_length,
    usage,
    usage_chunk,
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
    sequences = body.sequences()  # 400 naming best_of before any work
    inference.limits.check_prompt_count(len(texts))  # before loading a model or tokenizing
    lora = await inference.resolve_model(body.model, access)
    try:
        prompts = await inference.encode_prompts(texts)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="prompt") from exc
    # best_of ranks candidates by cumulative logprob: the engine reports the sampled ones
    logprobs = body.logprobs if body.logprobs is not None or sequences == body.n else 0
    echo_logprobs = body.logprobs if body.echo else None
    params = inference.sampling(body, body.max_tokens or 16, logprobs, sequences, echo_logprobs)
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    fingerprint = inference.system_fingerprint()
    _log_user(cid, body.user)
    tokenizer = inference.tokenizer()
    runs = [
        PromptRun.start(ids, sequences, _echo_text(tokenizer, text, ids) if body.echo else "")
        for text, ids in zip(texts, prompts, strict=True)
    ]
    holdback = max((len(s) for s in params.stop), default=1) - 1
    prompt_tokens = {PROMPT_TOKENS_HEADER: str(sum(len(ids) for ids in prompts))}
    n = body.n

    if not body.stream:

        async def collect(run: PromptRun) -> None:
            async for _ in inference.run_one(run.ids, params, lora, run.sequences, access):
                pass
            for seq in run.sequences:
                inference.record(cid, body.model, seq)

        await asyncio.gather(*(collect(run) for run in runs))
        choices = [
            {
                "index": i * n + j,
                "text": run.echo + (seq.last.text if seq.last else ""),
                "logprobs": (
                    completion_logprobs(
                        tokenizer,
                        seq.logprobs,
                        0,
                        run.ids if body.echo else None,
                        run.prompt_logprobs() if body.echo else None,
                    )
                    if body.logprobs is not None
                    else None
                ),
                "finish_reason": seq.last.finish_reason if seq.last else None,
            }
            for i, run in enumerate(runs)
            for j, seq in enumerate(best(run.sequences, n))
        ]
        response.headers.update(prompt_tokens)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage([run.sequences for run in runs]),
        }

    first_outputs = [
        inference.run_one(run.ids, params, lora, run.sequences, access) for run in runs
    ]
    # Surface request errors (bad length, unknown adapter) before the stream starts.
    heads = [await anext(gen) for gen in first_outputs]

    async def stream() -> AsyncIterator[str]:
        sent: dict[int, int] = {}  # choice index -> characters sent
        offsets: dict[int, int] = {}  # choice index -> characters of its tokens' logprobs sent
        async with aclosing(merge_streams(heads, first_outputs)) as merged:
            async for i, out in merged:
                if out is None:
                    for seq in runs[i].sequences:
                        inference.record(cid, body.model, seq)
                    continue
                index = i * n + out.index
                first = index not in sent
                echo = runs[i].echo if first else ""
                text, sent[index] = text_delta(out.text, sent.get(index, 0), out.finished, holdback)
                logprobs = None
                if body.logprobs is not None and (out.new_logprobs or (first and body.echo)):
                    echoed = first and body.echo
                    logprobs = completion_logprobs(
                        tokenizer,
                        out.new_logprobs,
                        offsets.get(index, 0),
                        runs[i].ids if echoed else None,
                        out.prompt_logprobs if echoed else None,
                    )
                    offsets[index] = offsets.get(index, 0) + text_length(logprobs)
                if text or echo or logprobs or out.finished:
                    yield sse(
                        {
                            "id": cid,
                            "object": "text_completion",
                            "created": created,
                            "model": body.model,
                            "system_fingerprint": fingerprint,
                            "choices": [
                                {
                                    "index": index,
                                    "text": echo + text,
                                    "logprobs": logprobs,
                                    "finish_reason": out.finish_reason,
                                }
                            ],
                        }
                    )
        if body.stream_options and body.stream_options.include_usage:
            header = (cid, "text_completion", created, body.model, fingerprint)
            yield usage_chunk(*header, [run.sequences for run in runs])
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers=prompt_tokens)


def _echo_text(tokenizer: Any, text: str | list[int], ids: list[int]) -> str:
    """The prompt as echo returns it: the text sent, or the decoded token ids."""
    return text if isinstance(text, str) else str(tokenizer.decode(ids))


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
    run = PromptRun.start(ids, body.n, "")
    holdback = max((len(s) for s in params.stop), default=1) - 1
    prompt_tokens = {PROMPT_TOKENS_HEADER: str(len(ids))}
    generator = inference.run_one(ids, params, lora, run.sequences, access)
    head = await anext(generator)

    if not body.stream:
        async for _ in generator:
            pass
        for seq in run.sequences:
            inference.record(cid, body.model, seq)
        response.headers.update(prompt_tokens)
        choices = []
        for j, seq in enumerate(run.sequences):
            assert seq.last is not None  # every sequence finished
            message, finish_reason = assistant_message(plan, seq.last.text, seq.last.finish_reason)
            logprobs = chat_logprobs(inference.tokenizer(), seq.logprobs) if body.logprobs else None
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage([run.sequences]),
        }

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> str:
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "system_fingerprint": fingerprint,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    async def stream() -> AsyncIterator[str]:
        parses = plan is not None and plan.parses
        tool_streams = [
            ToolCallStream(plan) if plan is not None and parses else None for _ in range(body.n)
        ]
        for j in range(body.n):
            # content stays null in an answer of only calls: its first chunk says no content
            yield chunk(j, {"role": "assistant", "content": None if parses else ""}, None)
        sent = [0] * body.n
        out: RequestOutput | None = head
        while out is not None:
            j, tool_stream = out.index, tool_streams[out.index]
            lps = chat_logprobs(inference.tokenizer(), out.new_logprobs) if body.logprobs else None
            if tool_stream is not None:
                deltas = tool_stream.deltas(out.text, out.finished, holdback)
                for delta in deltas:
                    yield chunk(j, delta, None, lps)
                    lps = None
                if lps:
                    yield chunk(j, {}, None, lps)
            else:
                text, sent[j] = text_delta(out.text, sent[j], out.finished, holdback)
                if text or lps:
                    yield chunk(j, {"content": text}, None, lps)
            if out.finished:
                reason = out.finish_reason
                yield chunk(j, {}, tool_stream.finish_reason(reason) if tool_stream else reason)
            out = await anext(generator, None)
        for seq in run.sequences:
            inference.record(cid, body.model, seq)
        if body.stream_options and body.stream_options.include_usage:
            header = (cid, "chat.completion.chunk", created, body.model, fingerprint)
            yield usage_chunk(*header, [run.sequences])
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers=prompt_tokens)


def _log_user(cid: str, user: str | None) -> None:
    """OpenAI's `user` (the caller's end-user id, for abuse monitoring): one INFO line with the
    response id; the request-id middleware adds the request's `x-request-id`."""
    if user is not None:
        logger.info("%s: end user %r", cid, user)
