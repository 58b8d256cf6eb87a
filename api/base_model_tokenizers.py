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
    """Loaded tokenizers by (base model, source, digest): a new digest loads again."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str, str], ChatTokenizer] = OrderedDict()
        self._lock = threading.Lock()

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
        key = (name, "checkpoint", checkpoint)
        cached = TOKENIZERS.get(key)
        if cached is None:
            cached = load_training_tokenizer(Path(base_model.checkpoint_dir))
            TOKENIZERS.put(key, cached)
        return cached
    published = published_digest(get_storage(), name)
    if published is not None:
        key = (name, "published", published)
        cached = TOKENIZERS.get(key)
        if cached is None:
            try:
                cached = _load_published(base_model)
            except FileNotFoundError:  # a host is publishing it again right now
                cached = None
            else:
                TOKENIZERS.put(key, cached)
        if cached is not None:
            return cached
    if base_model.preset == TINY_PRESET:
        key = (name, "preset", TINY_PRESET)
        cached = TOKENIZERS.get(key)
        if cached is None:
            cached = _load_tiny()
            TOKENIZERS.put(key, cached)
        return cached
    raise ConflictError(
        f"No host has published the tokenizer of base model {name} yet, and the control plane "
        "cannot read it from the model's checkpoint directory, so the training file's tokens "
        "cannot be counted. Start a host serving this model (it publishes its tokenizer when "
        "it loads the model) and create the job again.",
        code="tokenizer_unavailable",
        param="model",
    )
