"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (at the root, not under
``/v1``, as vLLM serves them).

* ``/tokenize`` ``{"model", "prompt", "add_special_tokens" (default true)}`` or ``{"model",
  "messages", "add_generation_prompt" (default true)}`` (the chat template applied, as
  `/v1/chat/completions` applies it), either with ``"return_token_strs"`` (default false) →
  ``{"count", "max_model_len", "tokens"}`` plus ``"token_strs"`` when asked.
* ``/detokenize`` ``{"model", "tokens"}`` → ``{"prompt"}``.

Authorized like the completion routes: the caller's key or grant, and `model` (default: the
base model) must be one it may call, else 404 `model_not_found`; an adapter tokenizes with the
base model's tokenizer. Work is done in a worker thread; a text or token list larger than a
request may carry (`RequestLimits`) is a 400, as are token ids outside the vocabulary and any
field not listed here (named in the error)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body, Depends
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpu_runtime.server.auth import ModelAccess
from gpu_runtime.server.inference import Inference, inference_of, require_access
from gpu_runtime.server.protocol import ChatMessage, OpenAIError

router = APIRouter()


class _ModelField(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None


class TokenizeCompletionRequest(_ModelField):
    """POST /tokenize body for a text prompt (vLLM's `TokenizeCompletionRequest`)."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ModelField):
    """POST /tokenize body for chat messages (vLLM's `TokenizeChatRequest`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_ModelField):
    """POST /detokenize body (vLLM's `DetokenizeRequest`)."""

    tokens: list[int]


async def _check_model(name: str | None, access: ModelAccess, inference: Inference) -> None:
    await inference.resolve_model(name if name is not None else inference.base_name(), access)


def _tokenize_body(raw: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as the chat shape when it has `messages`, else the text shape; a 400 naming
    the first field in error."""
    shape = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
    try:
        return shape.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise OpenAIError(400, f"{param}: {first['msg']}", param=param) from None


@router.post("/tokenize")
async def tokenize(
    raw: dict[str, Any] = Body(),
    access: ModelAccess = Depends(require_access),
    inference: Inference = Depends(inference_of),
) -> dict[str, Any]:
    body = _tokenize_body(raw)
    await _check_model(body.model, access, inference)
    tokenizer = inference.tokenizer()
    max_model_len = inference.engine_loop.engine.config.max_model_len
    if isinstance(body, TokenizeChatRequest):
        messages = [m.model_dump() for m in body.messages]
        add_generation_prompt = body.add_generation_prompt

        def encode() -> list[int]:
            return list(
                tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                )
            )

        param = "messages"
    else:
        prompt, special = body.prompt, body.add_special_tokens

        def encode() -> list[int]:
            return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])

        param = "prompt"
    tokens = await asyncio.to_thread(encode)
    inference.limits.check_prompt_tokens(len(tokens), max_model_len, param)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = list(tokenizer.convert_ids_to_tokens(tokens))
    return out


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest,
    access: ModelAccess = Depends(require_access),
    inference: Inference = Depends(inference_of),
) -> dict[str, Any]:
    await _check_model(body.model, access, inference)
    tokenizer = inference.tokenizer()
    max_model_len = inference.engine_loop.engine.config.max_model_len
    inference.limits.check_prompt_tokens(len(body.tokens), max_model_len, "tokens")
    vocab = len(tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(
            400, f"tokens {bad[:8]} are outside the vocabulary [0, {vocab})", param="tokens"
        )
    tokens = body.tokens
    text = await asyncio.to_thread(lambda: str(tokenizer.decode(tokens)))
    return {"prompt": text}
