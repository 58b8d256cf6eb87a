"""Text from a host that reaches a tenant (a failed job's `error` and its event) carries no
storage location: hosts name files by id (`gpu_runtime.agent.job_run`), and anything shaped like a
storage key or an absolute local path that still gets through is replaced here."""

from __future__ import annotations

import re

HIDDEN = "<internal path>"
# The key roots of gpu_runtime.contract.storage.
_STORAGE_ROOTS = ("files", "checkpoints", "adapters", "tokenizers")
_STORAGE_KEY = re.compile(r"\b(?:" + "|".join(_STORAGE_ROOTS) + r")/[^\s'\"(),;]+")
# A path of two or more segments starting at "/" or "~/" or "X:\", not inside a word or URL.
_LOCAL_PATH = re.compile(
    r"(?<![\w:/.])(?:~?/(?:[\w.@+-]+/)+[\w.@+-]*|[A-Za-z]:\\(?:[\w.@+ -]+\\)*[\w.@+-]*)"
)


def without_locations(text: str) -> str:
    """`text` with storage keys and absolute local paths replaced by :data:`HIDDEN`."""
    return _STORAGE_KEY.sub(HIDDEN, _LOCAL_PATH.sub(HIDDEN, text))
