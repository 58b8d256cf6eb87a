"""The training tokenizer of a base model, as the control plane gets it (to count the tokens of a
job's files before it is queued), cached per base model in the process.

Sources, first that has one wins:
1. the registered checkpoint directory (`BaseModel.checkpoint_dir`), when this process can read
   its tokenizer files;
2. the tokenizer a host serving the model published to storage
   (`gpu_runtime.contract.protocol.tokenizer_key`; every host does when it loads a model);
3. for the `tiny` preset, the runtime's deterministic tiny tokenizer, built here.
Each is loaded with `gpu_runtime.contract.tokenizer.load_training_tokenizer`, the loader the hosts
train with, so the counts are the hosts'. Without any source the job is refused with a 409 that
says how to get one. Imports no torch.
"""

from __future__ import annotations

import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from api.errors import ConflictError
from api.models import BaseModel
from api.storage import get_storage
from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.protocol import tokenizer_key
from gpu_runtime.contract.published_tokenizer import published_digest
from gpu_runtime.contract.tokenizer import (
    TokenizerFilesError,
    load_training_tokenizer,
    tokenizer_digest,
)

TINY_PRESET = "tiny"
CACHED_TOKENIZERS = 8
"""Tokenizers kept in the process (least recently used dropped first)."""


class TokenizerCache:
    """Loaded tokenizers by (base model, source, digest): a new digest loads again.

    Loads are one at a time in the process (`get_or_load`): requests that find a tokenizer
    missing at once wait for the one load instead of each building it, and the first import
    of `transformers`, which is not safe from several threads at once (concurrent first
    imports fail with "cannot import name ..."), happens in one thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str, str], ChatTokenizer] = OrderedDict()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    def get_or_load(
        self, key: tuple[str, str, str], load: Callable[[], ChatTokenizer]
    ) -> ChatTokenizer:
        """The cached tokenizer of `key`, else `load()`'s (cached); `load`'s errors propagate
        and nothing is cached."""
        cached = self.get(key)
        if cached is not None:
            return cached
        with self._load_lock:
            cached = self.get(key)  # loaded while this thread waited
            if cached is None:
                cached = load()
                self.put(key, cached)
            return cached

    def get(self, key: tuple[str, str, str]) -> ChatTokenizer | None:
        with self._lock:
            tokenizer = self._items.get(key)
            if tokenizer is not None:
                self._items.move_to_end(key)
            return tokenizer

    def put(self, key: tuple[str, str, str], tokenizer: ChatTokenizer) -> None:
        with self._lock:
            stale = [k for k in self._items if k[0] == key[0]]  # other versions of this model
            for old in stale:
                del self._items[old]
            self._items[key] = tokenizer
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


TOKENIZERS = TokenizerCache(CACHED_TOKENIZERS)


def _checkpoint_digest(base_model: BaseModel) -> str | None:
    if not base_model.checkpoint_dir:
        return None
    try:
        return tokenizer_digest(base_model.checkpoint_dir)
    except (TokenizerFilesError, OSError):
        return None


def _load_published(base_model: BaseModel) -> ChatTokenizer:
    with tempfile.TemporaryDirectory(prefix="harli-tokenizer-") as directory:
        get_storage().get_tree(tokenizer_key(base_model.name), directory)
        return load_training_tokenizer(directory)


def _load_tiny() -> ChatTokenizer:
    from gpu_runtime.contract.tiny_tokenizer import build_tiny_tokenizer

    with tempfile.TemporaryDirectory(prefix="harli-tiny-tokenizer-") as directory:
        build_tiny_tokenizer(directory)
        return load_training_tokenizer(directory)


def base_model_tokenizer(*, base_model: BaseModel) -> ChatTokenizer:
    """The training tokenizer of `base_model` (see the module docstring); ConflictError (409,
    `tokenizer_unavailable`) when no source has one yet."""
    name = base_model.name
    checkpoint = _checkpoint_digest(base_model)
    if checkpoint is not None:
        directory = Path(base_model.checkpoint_dir)
        return TOKENIZERS.get_or_load(
            (name, "checkpoint", checkpoint), lambda: load_training_tokenizer(directory)
        )
    published = published_digest(get_storage(), name)
    if published is not None:
        try:
            return TOKENIZERS.get_or_load(
                (name, "published", published), lambda: _load_published(base_model)
            )
        except FileNotFoundError:  # a host is publishing it again right now
            pass
    if base_model.preset == TINY_PRESET:
        return TOKENIZERS.get_or_load((name, "preset", TINY_PRESET), _load_tiny)
    raise ConflictError(
        f"No host has published the tokenizer of base model {name} yet, and the control plane "
        "cannot read it from the model's checkpoint directory, so the training file's tokens "
        "cannot be counted. Start a host serving this model (it publishes its tokenizer when "
        "it loads the model) and create the job again.",
        code="tokenizer_unavailable",
        param="model",
    )
