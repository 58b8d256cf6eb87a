"""The host's OpenAI-compatible inference server (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`, non-streaming), served by uvicorn in its own thread.

Every request needs `Authorization: Bearer <tenant key>`, checked by :class:`KeyVerifier`
(control plane, TTL cache). `model` is the base model this host serves, or an adapter
(`ft:...`) that this host serves and the key's tenant owns; anything else is a 404, so another
tenant's adapter reads as nonexistent. Requests go to the engine loop thread as `Generation`s;
the handler awaits the future the loop resolves. Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gpu_runtime.agent.auth import KeyGrant, KeyRejected, KeyVerifier
from gpu_runtime.agent.runtime import Generation, HostRuntime
from gpu_runtime.engine import RequestOutput, SamplingParams, SamplingParamsError

REQUEST_TIMEOUT_S = 300.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def _error(exc: ApiError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    body = {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop") or ()
    try:
        return SamplingParams(
            max_tokens=int(body.get("max_tokens") or 16),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            seed=body.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
    except (SamplingParamsError, TypeError, ValueError) as exc:
        raise ApiError(400, str(exc), "invalid_sampling_params") from exc


def build_app(runtime: HostRuntime, verifier: KeyVerifier) -> FastAPI:
    """The FastAPI app over one runtime."""
    app = FastAPI(title="Harli host inference", docs_url=None, redoc_url=None)

    async def grant_of(request: Request) -> KeyGrant:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Missing bearer API key.", "invalid_api_key")
        try:
            return await asyncio.to_thread(verifier.check, key.strip())
        except KeyRejected as exc:
            raise ApiError(401, str(exc), "invalid_api_key") from exc

    def allowed(grant: KeyGrant) -> list[str]:
        return [name for name in runtime.served_models() if name in grant.models]

    async def generate(request: Request, prompt_of: Any, shape: Any) -> JSONResponse:
        try:
            grant = await grant_of(request)
            try:
                body = await request.json()
            except ValueError as exc:
                raise ApiError(400, "The body must be JSON.", "invalid_json") from exc
            if not isinstance(body, dict):
                raise ApiError(400, "The body must be a JSON object.", "invalid_json")
            model = body.get("model")
            if not isinstance(model, str) or model not in allowed(grant):
                raise ApiError(404, f"The model {model!r} does not exist.", "model_not_found",
                               "model")  # fmt: skip
            generation = Generation(model=model, prompt=prompt_of(body), params=_sampling(body))
            future = runtime.submit_generation(generation)
            try:
                output = await asyncio.wait_for(asyncio.wrap_future(future), REQUEST_TIMEOUT_S)
            except ValueError as exc:
                raise ApiError(400, str(exc), "invalid_prompt", "prompt") from exc
            except TimeoutError as exc:
                raise ApiError(504, "Generation timed out.", "timeout") from exc
            return JSONResponse(shape(model, output))
        except ApiError as exc:
            return _error(exc)

    def completion_prompt(body: dict[str, Any]) -> Any:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise ApiError(400, "prompt must be a non-empty string or token ids.", "invalid_prompt",
                       "prompt")  # fmt: skip

    def chat_prompt(body: dict[str, Any]) -> Any:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list.", "invalid_messages",
                           "messages")  # fmt: skip
        try:
            return runtime.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise ApiError(400, f"cannot render messages: {exc}", "invalid_messages") from exc

    def usage(output: RequestOutput) -> dict[str, int]:
        completion = len(output.output_token_ids)
        return {
            "prompt_tokens": output.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": output.num_prompt_tokens + completion,
        }

    def completion_body(model: str, output: RequestOutput) -> dict[str, Any]:
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": output.text,
                    "logprobs": None,
                    "finish_reason": output.finish_reason,
                }  # fmt: skip
            ],
            "usage": usage(output),
        }

    def chat_body(model: str, output: RequestOutput) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": output.text},
                    "finish_reason": output.finish_reason,
                }
            ],
            "usage": usage(output),
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        base_model, *adapters = runtime.served_models()
        return {"status": "ok", "base_model": base_model, "adapters": adapters}

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            grant = await grant_of(request)
        except ApiError as exc:
            return _error(exc)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "harli"}
            for name in allowed(grant)
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await generate(request, completion_prompt, completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await generate(request, chat_prompt, chat_body)

    return app


class InferenceServer:
    """uvicorn serving :func:`build_app` in a daemon thread."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="inference-http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the inference server did not start")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
