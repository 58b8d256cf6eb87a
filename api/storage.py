"""Where uploaded file bytes live: the platform's one storage interface,
`gpu_runtime.contract.storage`.

Keys are opaque strings chosen by the caller (e.g. `files/<tenant id>/<file id>.jsonl`). A write
is atomic: the bytes appear under the key whole or not at all. The host agents read training
files and write checkpoints and adapters through the same interface and location.
"""

from __future__ import annotations

from django.conf import settings

from gpu_runtime.contract.storage import LocalStorage, Storage, open_storage

__all__ = ["LocalStorage", "Storage", "get_storage"]


def get_storage() -> Storage:
    """The configured storage (`HARLI_STORAGE_DIR`), read at call time so tests can override it."""
    return open_storage(settings.HARLI_STORAGE_DIR)
