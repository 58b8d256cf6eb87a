"""`StructuredCompiler`: one engine's grammar compiler over its tokenizer (xgrammar).

Thread-safe: the server compiles a request's grammar in a worker thread before the request
reaches the engine loop (`compile`), and the engine's `add_request` then finds it in the cache,
so a slow compile never stalls decode. The tokenizer's vocabulary is read once, on first use
(a 128k vocabulary takes a fraction of a second).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpu_runtime.structured.params import StructuredOutputError, StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar as xgr

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


def _message(exc: Exception) -> str:
    """xgrammar's error text without its log prefix (time, source file and line)."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


class StructuredCompiler:
    """Compiles `StructuredOutputParams` for one tokenizer and vocabulary; caches by params.

    JSON (`json_object`, `json_schema`) compiles in xgrammar's strict mode with one fixed
    layout (`any_whitespace=False`: separators `", "` and `": "`, no free whitespace), so a
    model cannot spend its tokens on whitespace and every output parses as JSON text with
    `json.loads`.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 8,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's vocabulary:
        padding ids are never allowed); `stop_token_ids`: the tokens that end a request (the
        engine's eos ids), allowed only where the grammar is complete."""
        if tokenizer is None:
            raise StructuredOutputError("structured output needs the engine's tokenizer")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1")
        if not stop_token_ids:
            raise ValueError("structured output needs at least one stop token id")
        if cache_size < 1:
            raise ValueError(f"cache_size={cache_size} must be >= 1")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self._max_threads = max_threads
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[StructuredOutputParams, xgr.CompiledGrammar] = OrderedDict()

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr  # only engines that serve a constrained request load it

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids),
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._compiler

    def cached(self, params: StructuredOutputParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of `params` if compiled before (no compile)."""
        with self._lock:
            grammar = self._cache.get(params)
            if grammar is not None:
                self._cache.move_to_end(params)
            return grammar

    def compile(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params` (from the cache when compiled before); raises
        `StructuredOutputError` naming the kind and xgrammar's reason when it cannot be
        compiled. May take long (a large schema): call it off the engine thread."""
        grammar = self.cached(params)
        if grammar is not None:
            return grammar
        compiler = self._grammar_compiler()
        try:
            grammar = _compile(compiler, params)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors
            raise StructuredOutputError(
                f"invalid {params.kind.replace('_', ' ')}: {_message(exc)}"
            ) from None
        with self._lock:
            self._cache[params] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar


def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputParams) -> xgr.CompiledGrammar:
    kind, spec = params.kind, params.spec
    if kind == "json_object":
        return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    return compiler.compile_structural_tag(spec)
