"""The host's training tokenizer: loaded from the model directory, and published to storage so
the control plane can count an example's tokens exactly as this host will (see the protocol
module's "Tokenizers", `gpu_runtime.contract.tokenizer` and
`gpu_runtime.contract.published_tokenizer`)."""

from __future__ import annotations

import logging
from pathlib import Path

from gpu_runtime.contract.chat import ChatTokenizer
from gpu_runtime.contract.published_tokenizer import publish_tokenizer
from gpu_runtime.contract.storage import Storage, StorageError
from gpu_runtime.contract.tokenizer import TokenizerFilesError, load_training_tokenizer

logger = logging.getLogger(__name__)


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
