"""CLI tests store uploaded bytes in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from pytest_django.fixtures import Settings


@pytest.fixture(autouse=True)
def storage_dir(settings: Settings, tmp_path: Path) -> Path:
    settings.HARLI_STORAGE_DIR = tmp_path / "storage"
    return tmp_path / "storage"
