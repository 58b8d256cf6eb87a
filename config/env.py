"""Every environment variable the control plane reads is parsed here, and only here."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """An integer; with `minimum`, one below it is refused."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={raw!r} is below its minimum {minimum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def local_secret(path: Path) -> str:
    """A random secret kept in `path` (created on first use, mode 0600), for the embedded
    default only: production reads its secrets from the environment."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    return value


REDIS_URL_SCHEMES = ("redis", "rediss", "unix")


def env_redis_url(name: str) -> str:
    """A Redis URL (`redis://`, `rediss://` or `unix://`), or "" when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return ""
    parts = urlsplit(raw)
    if parts.scheme not in REDIS_URL_SCHEMES or not (parts.netloc or parts.path):
        schemes = ", ".join(f"{scheme}://" for scheme in REDIS_URL_SCHEMES)
        raise EnvError(f"{name}={raw!r} is not a Redis URL (use {schemes})")
    return raw
