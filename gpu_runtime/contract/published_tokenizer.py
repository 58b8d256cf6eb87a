"""The training tokenizer a host publishes to shared storage, in the form both halves read.

Under :func:`~gpu_runtime.contract.protocol.tokenizer_key` a host puts the tokenizer files of
its model directory (:data:`~gpu_runtime.contract.tokenizer.TOKENIZER_FILES`, those present)
and :data:`MANIFEST`, `{"base_model", "digest"}` with the digest of
:func:`~gpu_runtime.contract.tokenizer.tokenizer_digest`; the tree is written whole or not at
all (:meth:`~gpu_runtime.contract.storage.Storage.put_tree`). The control plane reads the digest
to know which tokenizer it loaded is current; equal digests, equal tokenizers.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from gpu_runtime.contract.protocol import tokenizer_key
from gpu_runtime.contract.storage import COMPLETE_MARKER, Storage
from gpu_runtime.contract.tokenizer import tokenizer_digest, tokenizer_files

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def published_digest(storage: Storage, base_model: str) -> str | None:
    """The digest of the tokenizer published for `base_model`, or None when there is none."""
    key = tokenizer_key(base_model)
    try:
        if not storage.exists(f"{key}/{COMPLETE_MARKER}"):
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
