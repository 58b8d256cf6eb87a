"""Public identifiers of tenant-visible objects, in the OpenAI style (`file-...`, `ftjob-...`).

Identifiers are random (not sequential) so that one tenant cannot enumerate another's objects.
Each generator is a module-level function because migrations reference defaults by import path.
"""

from __future__ import annotations

import secrets
import time

_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_TOKEN_LENGTH = 24
PUBLIC_ID_MAX_LENGTH = 40


def random_token(length: int = _TOKEN_LENGTH) -> str:
    """Return `length` characters drawn uniformly from [a-zA-Z0-9] by a CSPRNG."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(length))


def new_file_id() -> str:
    return f"file-{random_token()}"


def new_job_id() -> str:
    return f"ftjob-{random_token()}"


def new_event_id() -> str:
    """Time-ordered (16 hex digits of nanoseconds, then random), so that events created within
    one clock tick still sort in creation order under `(created_at, id)`."""
    return f"ftevent-{time.time_ns():016x}{random_token(8)}"


def new_checkpoint_id() -> str:
    return f"ftckpt-{random_token()}"


def new_upload_id() -> str:
    return f"upload_{random_token()}"


def new_upload_part_id() -> str:
    return f"part_{random_token()}"
