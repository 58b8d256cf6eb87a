"""OpenAI-compatible HTTP API over an `EngineLoop`: /v1/models, /v1/completions,
/v1/chat/completions (SSE streaming with `stream: true`, usage, logprobs)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from gpu_runtime.engine.engine import UnknownAdapterError
from gpu_runtime.engine.request import RequestOutput, SamplingParams, SamplingParamsError
from gpu_runtime.server.auth import ApiKeyChecker
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics
from gpu_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _SamplingFields,
)

AdapterLookup = Callable[[str], str | None]
"""Maps a requested model name to an adapter (lora) name, or None when it is not an adapter."""
AdapterNames = Callable[[], list[str]]
"""The adapter (model) names to list in `/v1/models` beside the base model."""


@dataclass
class _Tracked:
    """One prompt's generation: outputs so far and its timings."""

    prompt_tokens: int
    started: float
    first_token: float | None = None
    last: RequestOutput | None = None
    logprobs: list[Any] = field(default_factory=list)


def _delta(text: str, sent: int, finished: bool, holdback: int) -> tuple[str, int]:
    """New text safe to send: hold back a possible stop-string prefix and a partial UTF-8
    character until the request finishes."""
    upto = len(text) if finished else len(text) - holdback
    if not finished:
        while upto > sent and text[upto - 1] == "\ufffd":
            upto -= 1
    upto = max(upto, sent)
    return text[sent:upto], upto


def create_app(
    engine_loop: EngineLoop,
    model_name: str,
    api_key_checker: ApiKeyChecker,
    metrics: MetricsCollector | None = None,
    adapter_lookup: AdapterLookup | None = None,
    adapter_names: AdapterNames | None = None,
) -> FastAPI:
    """The FastAPI app. `engine_loop` must be started by the caller; `api_key_checker` decides
    on the bearer key; `adapter_lookup` routes model names to adapters and `adapter_names`
    lists them. Both default to the engine's LoRA runtime (`engine.lora`: an adapter is served
    under its own name) and to no adapters without one. A `model` that is neither the base
    model nor an adapter gets a 404 `model_not_found`."""
    engine = engine_loop.engine
    lora = engine.lora
    if lora is not None:
        runtime = lora
        if adapter_lookup is None:

            def adapter_lookup(name: str) -> str | None:
                return name if runtime.has(name) else None

        if adapter_names is None:
            adapter_names = runtime.names
    if adapter_names is None:
        adapter_names = list  # no adapters: an empty list
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer")
    max_model_len = engine.config.max_model_len
    collector = metrics or MetricsCollector()
    app = FastAPI(title="Harli inference", version="1")
    app.state.metrics = collector
    app.state.engine_loop = engine_loop

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = (
            f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg"))
        )
        return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)

    def require_key(request: Request) -> None:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        if not api_key_checker(key):
            raise OpenAIError(
                401,
                "Incorrect or missing API key.",
                "invalid_request_error",
                code="invalid_api_key",
            )

    def resolve_model(name: str) -> str | None:
        if name == model_name:
            return None
        lora = adapter_lookup(name) if adapter_lookup else None
        if lora is None:
            raise OpenAIError(
                404, f"The model '{name}' does not exist.", param="model", code="model_not_found"
            )
        return lora

    def sampling(body: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop_strings(),
                logprobs=logprobs,
            )
        except SamplingParamsError as exc:
            raise OpenAIError(400, str(exc)) from exc

    def encode(prompt: str | list[int]) -> list[int]:
        ids = list(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return ids

    def record(rid: str, tracked: _Tracked) -> None:
        out = tracked.last
        if out is None or tracked.first_token is None:
            return
        now = time.perf_counter()
        count = len(out.output_token_ids)
        tpot = (now - tracked.first_token) / (count - 1) if count > 1 else None
        collector.record(
            RequestMetrics(
                rid,
                model_name,
                tracked.prompt_tokens,
                count,
                tracked.first_token - tracked.started,
                tpot,
                now - tracked.started,
                out.finish_reason,
            )
        )

    async def run_one(
        ids: list[int], params: SamplingParams, lora: str | None, tracked: _Tracked
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for out in engine_loop.generate(ids, params, lora):
                if tracked.first_token is None:
                    tracked.first_token = time.perf_counter()
                tracked.last = out
                tracked.logprobs.extend(out.new_logprobs)
                yield out
        except UnknownAdapterError as exc:
            raise OpenAIError(404, str(exc), param="model", code="model_not_found") from exc
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc

    def usage(tracked: list[_Tracked]) -> dict[str, int]:
        prompt = sum(t.prompt_tokens for t in tracked)
        completion = sum(len(t.last.output_token_ids) for t in tracked if t.last)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def token_text(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    def completion_logprobs(tracked: _Tracked) -> dict[str, Any]:
        tokens = [token_text(lp.token_id) for lp in tracked.logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in tracked.logprobs],
            "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in tracked.logprobs],
            "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        }

    def chat_logprobs(items: list[Any]) -> dict[str, Any]:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {
            "content": [
                entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in items
            ]
        }

    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def list_models() -> dict[str, Any]:
        base = {"id": model_name, "object": "model", "created": 0, "owned_by": "harli"}
        adapters = [base | {"id": name, "parent": model_name} for name in adapter_names() or []]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions", dependencies=[Depends(require_key)], response_model=None)
    async def completions(body: CompletionRequest) -> Any:
        lora = resolve_model(body.model)
        try:
            prompts = [encode(p) for p in body.prompts()]
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="prompt") from exc
        params = sampling(body, body.max_tokens or 16, body.logprobs)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        tracked = [_Tracked(len(ids), time.perf_counter()) for ids in prompts]
        holdback = max((len(s) for s in params.stop), default=1) - 1

        if not body.stream:

            async def collect(i: int) -> None:
                async for _ in run_one(prompts[i], params, lora, tracked[i]):
                    pass
                record(cid, tracked[i])

            await asyncio.gather(*(collect(i) for i in range(len(prompts))))
            choices = [
                {
                    "index": i,
                    "text": t.last.text if t.last else "",
                    "logprobs": completion_logprobs(t) if body.logprobs is not None else None,
                    "finish_reason": t.last.finish_reason if t.last else None,
                }
                for i, t in enumerate(tracked)
            ]
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": usage(tracked),
            }

        first_outputs = [run_one(prompts[i], params, lora, tracked[i]) for i in range(len(prompts))]
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
            open_streams = len(prompts)
            try:
                while open_streams:
                    i, out = await merged.get()
                    if out is None:
                        open_streams -= 1
                        record(cid, tracked[i])
                        continue
                    text, sent[i] = _delta(out.text, sent[i], out.finished, holdback)
                    if text or out.finished:
                        yield sse(
                            {
                                "id": cid,
                                "object": "text_completion",
                                "created": created,
                                "model": body.model,
                                "choices": [
                                    {
                                        "index": i,
                                        "text": text,
                                        "logprobs": None,
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
                            "choices": [],
                            "usage": usage(tracked),
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                for task in tasks:
                    task.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        lora = resolve_model(body.model)
        messages = [m.model_dump() for m in body.messages]
        ids = list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        limit = body.max_completion_tokens or body.max_tokens or max(1, max_model_len - len(ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, limit, top)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        tracked = _Tracked(len(ids), time.perf_counter())
        holdback = max((len(s) for s in params.stop), default=1) - 1
        generator = run_one(ids, params, lora, tracked)
        head = await anext(generator)

        if not body.stream:
            last = head
            if not head.finished:
                async for out in generator:
                    last = out
            record(cid, tracked)
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": last.text},
                        "logprobs": chat_logprobs(tracked.logprobs) if body.logprobs else None,
                        "finish_reason": last.finish_reason,
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
                    "choices": [
                        {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    ],
                }
            )

        async def stream() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""}, None)
            sent = 0
            out: RequestOutput | None = head
            while out is not None:
                text, sent = _delta(out.text, sent, out.finished, holdback)
                lps = chat_logprobs(out.new_logprobs) if body.logprobs else None
                if text or lps:
                    yield chunk({"content": text}, None, lps)
                if out.finished:
                    yield chunk({}, out.finish_reason)
                    break
                out = await anext(generator, None)
            record(cid, tracked)
            if body.stream_options and body.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": body.model,
                        "choices": [],
                        "usage": usage([tracked]),
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
