"""OpenAI-compatible HTTP API over an `EngineLoop`: /v1/models, /v1/completions,
/v1/chat/completions (SSE streaming with `stream: true`, usage, logprobs)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from gpu_runtime.engine.engine import UnknownAdapterError
from gpu_runtime.engine.request import RequestOutput, SamplingParams, SamplingParamsError
from gpu_runtime.server.auth import ApiKeyChecker, KeyGrant
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics
from gpu_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _SamplingFields,
)
from gpu_runtime.server.responses import (
    Tracked,
    chat_logprobs,
    completion_logprobs,
    sse,
    text_delta,
    usage,
)

AdapterLookup = Callable[[str], str | None]
"""Maps a requested model name to an adapter (lora) name, or None when it is not an adapter."""
AdapterNames = Callable[[], list[str]]
"""The adapter (model) names to list in `/v1/models` beside the base model."""


class ModelLoader(Protocol):
    """Serves, on demand, models a key may call that the host does not list (checkpoints)."""

    def claims(self, name: str) -> bool:
        """Whether `name` is one this loader could serve (cheap; no I/O)."""
        ...

    def load(self, name: str) -> str | None:
        """Make `name` servable and return its adapter name, or None when it cannot be served
        here. Blocks (the server calls it from a worker thread)."""
        ...


def create_app(
    engine_loop: EngineLoop,
    model_name: str | Callable[[], str],
    api_key_checker: ApiKeyChecker,
    metrics: MetricsCollector | None = None,
    adapter_lookup: AdapterLookup | None = None,
    adapter_names: AdapterNames | None = None,
    model_loader: ModelLoader | None = None,
) -> FastAPI:
    """The FastAPI app. `engine_loop` must be started by the caller. `model_name` is the base
    model's name (or a callable giving it now, for a host that may load another base model).
    `api_key_checker` turns the bearer key into a `KeyGrant` (None: 401); models outside the
    grant read as nonexistent. `adapter_lookup` routes model names to adapters and
    `adapter_names` lists them; both default to the engine's LoRA runtime (`engine.lora`, read
    per request: an adapter is served under its own name), and to no adapters without one. A
    `model` that is neither the base model nor an adapter gets a 404 `model_not_found`, unless
    `model_loader` claims it, the grant allows it by name (`KeyGrant.allows_unlisted`) and the
    loader can serve it (a checkpoint, loaded on its first request). The engine (tokenizer,
    limits) is read from the loop per request too."""
    if engine_loop.engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer")
    collector = metrics or MetricsCollector()
    app = FastAPI(title="Harli inference", version="1")
    app.state.metrics = collector
    app.state.engine_loop = engine_loop

    def base_name() -> str:
        return model_name if isinstance(model_name, str) else model_name()

    def lookup(name: str) -> str | None:
        if adapter_lookup is not None:
            return adapter_lookup(name)
        lora = engine_loop.engine.lora
        return name if lora is not None and lora.has(name) else None

    def served_adapters() -> list[str]:
        if adapter_names is not None:
            return list(adapter_names())
        lora = engine_loop.engine.lora
        return list(lora.names()) if lora is not None else []

    def tokenizer() -> Any:
        return engine_loop.engine.tokenizer

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

    def require_key(request: Request) -> KeyGrant:
        """A sync dependency: FastAPI runs it in a worker thread, so a checker may block."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        grant = api_key_checker(key or None)
        if grant is None:
            raise OpenAIError(
                401,
                "Incorrect or missing API key.",
                "invalid_request_error",
                code="invalid_api_key",
            )
        return grant

    async def resolve_model(name: str, grant: KeyGrant) -> str | None:
        """The adapter to use for `name` (None: the base model); 404 for anything else."""
        listed = grant.allows(name)
        if listed and name == base_name():
            return None
        lora = lookup(name) if listed else None
        if lora is not None:
            return lora
        if model_loader is not None and model_loader.claims(name):
            if await asyncio.to_thread(grant.allows_unlisted, name):
                lora = lookup(name) or await asyncio.to_thread(model_loader.load, name)
                if lora is not None:
                    return lora
        raise OpenAIError(
            404, f"The model '{name}' does not exist.", param="model", code="model_not_found"
        )

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
        ids = list(tokenizer()(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return ids

    def record(rid: str, model: str, tracked: Tracked) -> None:
        out = tracked.last
        if out is None or tracked.first_token is None:
            return
        now = time.perf_counter()
        count = len(out.output_token_ids)
        tpot = (now - tracked.first_token) / (count - 1) if count > 1 else None
        collector.record(
            RequestMetrics(
                rid,
                model,
                tracked.prompt_tokens,
                count,
                tracked.first_token - tracked.started,
                tpot,
                now - tracked.started,
                out.finish_reason,
            )
        )

    async def run_one(
        ids: list[int], params: SamplingParams, lora: str | None, tracked: Tracked
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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness, no key: the base model and how many adapters are served (their names are
        tenants' models: only a key's grant shows them, through `/v1/models`)."""
        return {"status": "ok", "base_model": base_name(), "adapters": len(served_adapters())}

    @app.get("/v1/models")
    async def list_models(grant: KeyGrant = Depends(require_key)) -> dict[str, Any]:
        """The base model, then each adapter (`parent` = the base model), as far as the key's
        grant reaches."""
        name = base_name()
        base: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "harli"}
        entries = [base] + [base | {"id": a, "parent": name} for a in served_adapters()]
        return {"object": "list", "data": [m for m in entries if grant.allows(str(m["id"]))]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, grant: KeyGrant = Depends(require_key)) -> Any:
        lora = await resolve_model(body.model, grant)
        try:
            prompts = [encode(p) for p in body.prompts()]
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="prompt") from exc
        params = sampling(body, body.max_tokens or 16, body.logprobs)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        tracked = [Tracked(len(ids), time.perf_counter()) for ids in prompts]
        holdback = max((len(s) for s in params.stop), default=1) - 1

        if not body.stream:

            async def collect(i: int) -> None:
                async for _ in run_one(prompts[i], params, lora, tracked[i]):
                    pass
                record(cid, body.model, tracked[i])

            await asyncio.gather(*(collect(i) for i in range(len(prompts))))
            choices = [
                {
                    "index": i,
                    "text": t.last.text if t.last else "",
                    "logprobs": (
                        completion_logprobs(tokenizer(), t) if body.logprobs is not None else None
                    ),
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
                        record(cid, body.model, tracked[i])
                        continue
                    text, sent[i] = text_delta(out.text, sent[i], out.finished, holdback)
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

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, grant: KeyGrant = Depends(require_key)
    ) -> Any:
        lora = await resolve_model(body.model, grant)
        messages = [m.model_dump() for m in body.messages]
        ids = list(
            tokenizer().apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        room = max(1, engine_loop.engine.config.max_model_len - len(ids))
        limit = body.max_completion_tokens or body.max_tokens or room
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, limit, top)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        tracked = Tracked(len(ids), time.perf_counter())
        holdback = max((len(s) for s in params.stop), default=1) - 1
        generator = run_one(ids, params, lora, tracked)
        head = await anext(generator)

        if not body.stream:
            last = head
            if not head.finished:
                async for out in generator:
                    last = out
            record(cid, body.model, tracked)
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": last.text},
                        "logprobs": (
                            chat_logprobs(tokenizer(), tracked.logprobs) if body.logprobs else None
                        ),
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
                text, sent = text_delta(out.text, sent, out.finished, holdback)
                lps = chat_logprobs(tokenizer(), out.new_logprobs) if body.logprobs else None
                if text or lps:
                    yield chunk({"content": text}, None, lps)
                if out.finished:
                    yield chunk({}, out.finish_reason)
                    break
                out = await anext(generator, None)
            record(cid, body.model, tracked)
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
