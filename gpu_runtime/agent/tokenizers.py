"""The host's training tokenizer: loaded from the model directory, and published to storage so
the control plane can count an example's tokens exactly as this host will (see the protocol
module's "Tokenizers" and `gpu_runtime.contract.tokenizer`)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.protocol import tokenizer_key
from gpu_runtime.contract.tokenizer import (
    TokenizerFilesError,
    load_training_tokenizer,
    tokenizer_digest,
    tokenizer_files,
)
from gpu_runtime.storage import Storage, StorageError

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def published_digest(storage: Storage, base_model: str) -> str | None:
    """The digest of the tokenizer published for `base_model`, or None when there is none."""
    key = tokenizer_key(base_model)
    try:
        if not storage.exists(f"{key}/.complete"):
            return None
        manifest = json.loads(b"".join(storage.read_chunks(f"{key}/{MANIFEST}")))
    except (OSError, ValueError):  # absent, unreadable, or a name no key can hold
        return None
    digest = manifest.get("digest") if isinstance(manifest, dict) else None
    return digest if isinstance(digest, str) else None


def publish_tokenizer(storage: Storage, base_model: str, model_dir: str | Path) -> str:
    """Copy the tokenizer files of `model_dir` under `tokenizer_key(base_model)`, unless the
    same ones are there already; returns their digest. TokenizerFilesError without them."""
    digest = tokenizer_digest(model_dir)
    if published_digest(storage, base_model) == digest:
        return digest
    with tempfile.TemporaryDirectory(prefix="harli-tokenizer-") as staging:
        for path in tokenizer_files(model_dir):
            shutil.copyfile(path, Path(staging) / path.name)
        manifest = {"base_model": base_model, "digest": digest}
        (Path(staging) / MANIFEST).write_text(json.dumps(manifest))
        storage.put_tree(tokenizer_key(base_model), staging)
    logger.info("published the tokenizer of %s (%s)", base_model, digest[:12])
    return digest


def host_training_tokenizer(
    storage: Storage, base_model: str, model_dir: str | Path
) -> ChatTokenizer | None:
    """Load the training tokenizer of `model_dir` and publish its files; None (logged) when the
    directory has none (jobs then fail at setup, naming the missing tokenizer). A failed publish
    is logged: this host still trains, and the control plane answers 409 until one succeeds."""
    try:
        tokenizer = load_training_tokenizer(model_dir)
    except TokenizerFilesError as exc:
        logger.error("base model %s has no training tokenizer: %s", base_model, exc)
        return None
    try:
        publish_tokenizer(storage, base_model, model_dir)
    except (OSError, StorageError) as exc:
        logger.error("could not publish the tokenizer of %s: %s", base_model, exc)
    return tokenizer
