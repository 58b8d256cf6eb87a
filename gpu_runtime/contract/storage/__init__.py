"""One storage interface for training files, checkpoints and adapters (no Django import).

The control plane (`api.storage`) and the host agents use the same :class:`Storage`. Keys are
`/`-separated relative names chosen by the caller:

* `files/<tenant id>/<file id>.jsonl` — an uploaded training file;
* `checkpoints/<job id>/step-<NNNNNN>/...` — a trainer checkpoint (a directory tree);
* `adapters/<job id>/...` — a finished PEFT adapter (a directory tree).
* `tokenizers/<base model>/...` — the training tokenizer a host published (a directory tree).

:func:`open_storage` picks the backend from a URL or path; today that is a local directory
(`file:///abs/path` or a plain path), which every process of one machine, or of hosts sharing a
network file system, sees alike.
"""

from gpu_runtime.contract.storage.base import COMPLETE_MARKER, Storage, StorageError, validate_key
from gpu_runtime.contract.storage.local import LocalStorage, open_storage

__all__ = [
    "COMPLETE_MARKER",
    "LocalStorage",
    "Storage",
    "StorageError",
    "open_storage",
    "validate_key",
]
