"""Rendering chat conversations to text, and finding the assistant spans inside that text.

The tokenizer's own chat template (``tokenizer.apply_chat_template``) is used when the tokenizer
has one. When it has none, a documented fallback is used (ChatML-shaped)::

    {bos}<|im_start|>{role}\\n{content}{end_of_turn}\\n      (one block per message)
    <|im_start|>assistant\\n                                 (generation prompt)

where ``{bos}`` is the tokenizer's BOS token (empty when it has none) and ``{end_of_turn}`` is the
tokenizer's EOS token, or the literal ``<|im_end|>`` when it has none. Ending assistant turns with
EOS teaches a model without a chat template to stop where the decode engine stops.

Assistant spans are found by rendering prefixes of the conversation: the characters that
``render(messages[:i+1])`` adds after ``render(messages[:i], add_generation_prompt=True)`` are the
i-th message's assistant text (its end-of-turn marker included, so the model learns to stop). This
needs the template to be *prefix-stable* (a shorter conversation renders to a prefix of a longer
one), which the Llama 3 and Qwen2 templates are; a template that is not raises
:class:`ChatTemplateError` rather than training on misplaced labels.

Inference renders whole conversations with tools (`render_conversation`): the template gets the
messages as OpenAI dicts (assistant ``tool_calls`` with arguments as objects, ``tool`` messages)
and ``tools=``. Without a template the fallback renders tools and calls in the Hermes style
(the format Qwen2.5 uses, which the server's ``hermes`` parser reads)::

    <|im_start|>system\n{system content}\n\n{TOOLS_PREAMBLE}<tools>\n{tool as JSON}\n...</tools>
    {TOOLS_CALL_FORMAT}{end_of_turn}\n        (a system block of its own when none comes first)
    <|im_start|>{role}[ name={name}]\n{content}{end_of_turn}\n
    <|im_start|>assistant\n[{content}\n]<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    [\n<tool_call>...</tool_call>]{end_of_turn}\n                  (an assistant message's calls)
    <|im_start|>tool\n<tool_response>\n{content}\n</tool_response>{end_of_turn}\n

Tool responses pair with the calls by order (as in Qwen2.5's template): ``tool_call_id`` is not
rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

FALLBACK_TURN_START = "<|im_start|>"
FALLBACK_END_OF_TURN = "<|im_end|>"
CHAT_ROLES = ("system", "user", "assistant")
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to answer. Their signatures, as JSON "
    "schemas, are within <tools></tools>:\n"
)
TOOLS_CALL_FORMAT = (
    "\n\nTo call a function, answer with one block per call:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)


class ChatTemplateError(ValueError):
    """The chat template cannot be used to locate assistant tokens."""


class ChatTokenizer(Protocol):
    """The part of a Hugging Face fast tokenizer the finetune data path uses."""

    chat_template: Any
    bos_token: Any
    eos_token: Any
    eos_token_id: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class ChatMessage:
    """One validated message: ``role`` in :data:`CHAT_ROLES`; ``weight`` 0 excludes an
    assistant message from the loss (OpenAI's per-message ``weight``), 1 includes it."""

    role: str
    content: str
    weight: int = 1


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered to text plus the ``[start, end)`` character spans that train."""

    text: str
    loss_spans: tuple[tuple[int, int], ...]


def has_chat_template(tokenizer: ChatTokenizer) -> bool:
    """Whether the tokenizer carries its own chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _fallback_render(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool
) -> str:
    bos = tokenizer.bos_token or ""
    end_of_turn = tokenizer.eos_token or FALLBACK_END_OF_TURN
    parts = [bos]
    for message in messages:
        parts.append(f"{FALLBACK_TURN_START}{message.role}\n{message.content}{end_of_turn}\n")
    if add_generation_prompt:
        parts.append(f"{FALLBACK_TURN_START}assistant\n")
    return "".join(parts)


def render_chat_text(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool
) -> str:
    """Render messages to one string with the tokenizer's template, or the fallback."""
    if not has_chat_template(tokenizer):
        return _fallback_render(tokenizer, messages, add_generation_prompt)
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    return _apply_template(tokenizer, conversation, add_generation_prompt)


def _apply_template(
    tokenizer: ChatTokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    **kwargs: Any,
) -> str:
    """The tokenizer's own template over `conversation` as text; ChatTemplateError when it
    fails or renders something else."""
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # a template error of any kind (jinja raises its own types)
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    if not isinstance(rendered, str):
        raise ChatTemplateError(f"chat template rendered {type(rendered).__name__}, not text")
    return rendered


def render_chat_with_loss_spans(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage]
) -> RenderedChat:
    """Render a conversation and locate the characters of every trained assistant message."""
    full = render_chat_text(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.role != "assistant" or message.weight == 0:
            continue
        before = render_chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        through = render_chat_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not through.startswith(before) or not full.startswith(through):
            raise ChatTemplateError(
                f"chat template is not prefix-stable at message {i}: rendering a shorter "
                "conversation does not give a prefix of the longer one, so assistant tokens "
                "cannot be located"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return RenderedChat(text=full, loss_spans=tuple(spans))


def render_conversation(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> str:
    """A conversation of OpenAI-shaped message dicts (keys present only when set), with the
    ``tools`` offered (None: no tools), rendered with the tokenizer's template or the
    fallback (module docstring). ChatTemplateError when the template fails (it may refuse a
    conversation: Llama 3.1's refuses more than one call in an assistant message)."""
    if not has_chat_template(tokenizer):
        return _fallback_conversation(tokenizer, messages, tools, add_generation_prompt)
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return _apply_template(tokenizer, [dict(m) for m in messages], add_generation_prompt, **kwargs)


def hermes_call_block(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as the fallback renders it (and the Hermes format writes it)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _fallback_conversation(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    end_of_turn = tokenizer.eos_token or FALLBACK_END_OF_TURN
    parts = [tokenizer.bos_token or ""]
    rest = list(messages)
    if tools:
        system = ""
        if rest and rest[0]["role"] == "system":
            system = f"{rest.pop(0)['content']}\n\n"
        signatures = "".join(f"{json.dumps(t, ensure_ascii=False)}\n" for t in tools)
        parts.append(
            f"{FALLBACK_TURN_START}system\n{system}{TOOLS_PREAMBLE}<tools>\n{signatures}"
            f"</tools>{TOOLS_CALL_FORMAT}{end_of_turn}\n"
        )
    for message in rest:
        role, content = message["role"], message.get("content")
        header = f"{role} name={message['name']}" if message.get("name") else role
        if role == "tool":
            body = f"<tool_response>\n{content}\n</tool_response>"
        else:
            pieces = [content] if content else []
            for call in message.get("tool_calls") or ():
                function = call["function"]
                pieces.append(hermes_call_block(function["name"], function["arguments"]))
            body = "\n".join(pieces)
        parts.append(f"{FALLBACK_TURN_START}{header}\n{body}{end_of_turn}\n")
    if add_generation_prompt:
        parts.append(f"{FALLBACK_TURN_START}assistant\n")
    return "".join(parts)
