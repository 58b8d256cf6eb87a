"""What the inference routes share: one `Inference` per app, on ``app.state.inference``.

It authorizes each request (`auth.RequestAuth`: the gateway's grant or a bearer key), resolves
a requested model to the base model or an adapter within the request's `ModelAccess`, builds
sampling parameters and prompt ids (OpenAI errors for bad input), holds each request to its
`RequestLimits`, runs a request on the `EngineLoop` under its caller (the engine admits callers
in turn) while tracking its latency, and records each finished request in the metrics
collector and in the Prometheus metrics (`prometheus.ServerMetrics`). The engine (tokenizer,
limits, LoRA runtime) is read from the loop on each use: a host may load another base model
between requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import Request

from gpu_runtime.contract.chat import ChatTemplateError, render_conversation
from gpu_runtime.engine.engine import UnknownAdapterError
from gpu_runtime.engine.request import RequestOutput, SamplingParams, SamplingParamsError
from gpu_runtime.lora.errors import AdapterConfigError
from gpu_runtime.server.auth import AccessDenied, ModelAccess, RequestAuth
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.fingerprint import system_fingerprint
from gpu_runtime.server.limits import RequestLimits
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics
from gpu_runtime.server.prometheus import ServerMetrics
from gpu_runtime.server.protocol import OpenAIError, _SamplingFields
from gpu_runtime.server.responses import Tracked
from gpu_runtime.structured import StructuredOutputError

logger = logging.getLogger(__name__)
AdapterLookup = Callable[[str], str | None]
"""Maps a requested model name to an adapter (lora) name, or None when it is not an adapter."""
AdapterNames = Callable[[], list[str]]
"""The adapter (model) names to list in `/v1/models` beside the base model."""


class ModelLoader(Protocol):
    """Serves, on demand, models a request may call that the host does not list
    (checkpoints)."""

    def claims(self, name: str) -> bool:
        """Whether `name` is one this loader could serve (cheap; no I/O)."""
        ...

    def load(self, name: str) -> str | None:
        """Make `name` servable and return its adapter name, or None when it cannot be served
        here; `AdapterConfigError` when its adapter uses an option that is not served. Blocks
        (the server calls it from a worker thread)."""
        ...


class Inference:
    """The inference side of one app (see `create_app` for the arguments)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        model_name: str | Callable[[], str],
        auth: RequestAuth,
        metrics: MetricsCollector,
        adapter_lookup: AdapterLookup | None,
        adapter_names: AdapterNames | None,
        model_loader: ModelLoader | None,
        limits: RequestLimits,
        prometheus: ServerMetrics,
    ) -> None:
        self.engine_loop = engine_loop
        self._model_name = model_name
        self._auth = auth
        self.metrics = metrics
        self._adapter_lookup = adapter_lookup
        self._adapter_names = adapter_names
        self._model_loader = model_loader
        self.limits = limits
        self.prometheus = prometheus
        self._fingerprint: tuple[int, str, str] | None = None

    def base_name(self) -> str:
        name = self._model_name
        return name if isinstance(name, str) else name()

    def lookup(self, name: str) -> str | None:
        if self._adapter_lookup is not None:
            return self._adapter_lookup(name)
        lora = self.engine_loop.engine.lora
        return name if lora is not None and lora.has(name) else None

    def served_adapters(self) -> list[str]:
        if self._adapter_names is not None:
            return list(self._adapter_names())
        lora = self.engine_loop.engine.lora
        return list(lora.names()) if lora is not None else []

    def system_fingerprint(self) -> str:
        """The responses' `system_fingerprint` for the engine and base model now
        (`fingerprint.system_fingerprint`; kept until either changes)."""
        engine, name = self.engine_loop.engine, self.base_name()
        if self._fingerprint is None or self._fingerprint[:2] != (id(engine), name):
            self._fingerprint = (id(engine), name, system_fingerprint(engine, name))
        return self._fingerprint[2]

    def tokenizer(self) -> Any:
        return self.engine_loop.engine.tokenizer

    async def authorize(self, request: Request) -> ModelAccess:
        """The request's access (401 in OpenAI's shape when refused, the reason logged)."""
        try:
            access = await self._auth.access(request.headers)
        except AccessDenied as exc:
            logger.warning("refused %s %s: %s", request.method, request.url.path, exc)
            raise OpenAIError(
                401,
                "Incorrect or missing API key.",
                "invalid_request_error",
                code="invalid_api_key",
            ) from None
        logger.debug(
            "%s %s: request %s of tenant %s",
            request.method,
            request.url.path,
            access.request_id or "-",
            access.tenant or "-",
        )
        return access

    async def resolve_model(self, name: str, access: ModelAccess) -> str | None:
        """The adapter to use for `name` (None: the base model); 404 for anything else, and
        for what `access` does not allow; 400 naming the option for a model the loader found
        but cannot serve (its adapter is refused at registration)."""
        listed = access.allows(name)
        if listed and name == self.base_name():
            return None
        lora = self.lookup(name) if listed else None
        if lora is not None:
            return lora
        loader = self._model_loader
        if loader is not None and loader.claims(name):
            if await asyncio.to_thread(access.allows_unlisted, name):
                try:
                    lora = self.lookup(name) or await asyncio.to_thread(loader.load, name)
                except AdapterConfigError as exc:  # refused at registration, nothing kept
                    raise OpenAIError(
                        400, str(exc), param="model", code="unsupported_adapter"
                    ) from exc
                if lora is not None:
                    return lora
        raise OpenAIError(
            404, f"The model '{name}' does not exist.", param="model", code="model_not_found"
        )

    def sampling(
        self,
        body: _SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        sequences: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's parameters; 400 naming the field for values out of range or token
        ids outside the vocabulary. `sequences`: how many to generate from each prompt
        (`body.n` unless given: `best_of`), `prompt_logprobs`: for echo with logprobs."""
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop_strings(),
                logprobs=logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=body.logit_bias_pairs(),
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                n=sequences or body.n,
                prompt_logprobs=prompt_logprobs,
                structured_output=(
                    body.response_format.structured_output() if body.response_format else None
                ),
            )
            params.check_vocab(self.engine_loop.engine.model_config.vocab_size)
        except StructuredOutputError as exc:
            raise OpenAIError(400, str(exc), param="response_format") from exc
        except SamplingParamsError as exc:
            raise OpenAIError(400, str(exc), param=_param_of(str(exc))) from exc
        return params

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """`encode` of each prompt, in a worker thread: a long prompt's tokenization must not
        stall the event loop (every other stream, `/health`). 400 for too many prompts (checked
        before tokenizing any) or too many tokens in all (`RequestLimits`)."""
        self.limits.check_prompt_count(len(prompts))
        ids = await asyncio.to_thread(lambda: [self.encode(p) for p in prompts])
        self._check_tokens(sum(len(p) for p in ids), "prompt")
        return ids

    async def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The conversation rendered (`contract.chat.render_conversation`: the chat template
        with `tools`, or the fallback) and tokenized, in a worker thread (see
        `encode_prompts`); 400 when the template refuses the conversation, ignores a message's
        `name` (the conversation renders the same without it: it would be accepted and
        dropped), or it holds more tokens than a request may."""

        def render() -> list[int]:
            tokenizer = self.tokenizer()
            text = render_conversation(tokenizer, messages, tools)
            named = [i for i, m in enumerate(messages) if m.get("name")]
            if named:
                unnamed = [{k: v for k, v in m.items() if k != "name"} for m in messages]
                if render_conversation(tokenizer, unnamed, tools) == text:
                    raise OpenAIError(
                        400,
                        "this model's chat template does not render a message's name: "
                        "leave it out or put it in the content",
                        param=f"messages.{named[0]}.name",
                    )
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        try:
            ids = await asyncio.to_thread(render)
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        self._check_tokens(len(ids), "messages")
        return ids

    def _check_tokens(self, tokens: int, param: str) -> None:
        max_model_len = self.engine_loop.engine.config.max_model_len
        self.limits.check_prompt_tokens(tokens, max_model_len, param)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer()(prompt)["input_ids"])
        else:
            ids = list(prompt)
        if not ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return ids

    def record(self, rid: str, model: str, tracked: Tracked) -> None:
        """Record a finished sequence's latencies (nothing for one that produced no token)."""
        out = tracked.last
        if out is None or tracked.first_token is None:
            return
        now = time.perf_counter()
        count = len(out.output_token_ids)
        tpot = (now - tracked.first_token) / (count - 1) if count > 1 else None
        self.metrics.record(
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
        self,
        ids: list[int],
        params: SamplingParams,
        lora: str | None,
        tracked: list[Tracked],
        access: ModelAccess,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine loop produces them, sequence `out.index`
        tracked in `tracked[out.index]` (`params.n` of them); the engine queues it under
        `access.caller`. Its end is counted in `prometheus` under its outcome: the last finish
        reason, `rejected` (the engine refused it), `error` (the engine failed), or
        `cancelled` (the consumer stopped before every sequence finished). A structured
        output's grammar is compiled first, in a worker thread (the engine finds it in its
        compiler's cache): 400 with param `response_format` when it cannot be."""
        if len(tracked) != params.n:
            raise ValueError(f"{len(tracked)} trackers for n={params.n}")
        outcome = "cancelled"
        open_sequences = params.n
        try:
            if params.structured_output is not None:
                compiler = self.engine_loop.engine.structured.compiler
                await asyncio.to_thread(compiler.compile, params.structured_output)
            generate = self.engine_loop.generate(ids, params, lora, tenant=access.caller)
            # closing this generator closes the engine's at once: its request is aborted
            async with aclosing(generate) as outputs:
                async for out in outputs:
                    seq = tracked[out.index]
                    if seq.first_token is None:
                        seq.first_token = time.perf_counter()
                        if all(t.first_token is None or t is seq for t in tracked):
                            self.prometheus.first_token(seq.first_token - seq.started)
                    seq.last = out
                    seq.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        open_sequences -= 1
                        if open_sequences == 0:
                            outcome = out.finish_reason or "stop"
                    yield out
        except UnknownAdapterError as exc:
            outcome = "rejected"
            raise OpenAIError(404, str(exc), param="model", code="model_not_found") from exc
        except StructuredOutputError as exc:
            outcome = "rejected"
            raise OpenAIError(400, str(exc), param="response_format") from exc
        except ValueError as exc:
            outcome = "rejected"
            runtime = self.engine_loop.engine.lora
            if lora is not None and runtime is not None and not runtime.has(lora):
                # unloaded between the request's resolution and its admission: as after it
                raise OpenAIError(
                    404,
                    f"The model '{lora}' is no longer served.",
                    param="model",
                    code="model_not_found",
                ) from exc
            raise OpenAIError(400, str(exc)) from exc
        except Exception:
            outcome = "error"
            raise
        finally:
            self._count(tracked, lora, access, outcome)

    def _count(
        self, tracked: list[Tracked], lora: str | None, access: ModelAccess, outcome: str
    ) -> None:
        """One engine request's end: tokens of all its sequences; TPOT of the longest."""
        now = time.perf_counter()
        counts = [len(t.last.output_token_ids) if t.last is not None else 0 for t in tracked]
        longest = max(counts)
        firsts = [t.first_token for t in tracked if t.first_token is not None]
        first = min(firsts) if firsts else None
        self.prometheus.finished(
            tenant=access.caller,
            adapter=lora or "",
            outcome=outcome,
            duration_s=now - tracked[0].started,
            tpot_s=(now - first) / (longest - 1) if first is not None and longest > 1 else None,
            prompt_tokens=tracked[0].prompt_tokens,
            completion_tokens=sum(counts),
        )


def _param_of(message: str) -> str | None:
    """The request field a `SamplingParamsError` message names (it starts with it)."""
    head = message.replace("[", "=").replace(" ", "=").split("=", 1)[0]
    return head if head in _SamplingFields.model_fields or head == "logprobs" else None


def app_inference(request: Request) -> Inference:
    """The `Inference` of the app serving `request`."""
    inference: Inference = request.app.state.inference
    return inference


async def inference_of(request: Request) -> Inference:
    """The app's `Inference`, as a dependency (async: no worker thread for a lookup)."""
    return app_inference(request)


async def require_access(request: Request) -> ModelAccess:
    """The request's `ModelAccess`, as a dependency (401 when refused)."""
    return await app_inference(request).authorize(request)
