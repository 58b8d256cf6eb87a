"""Console test fixtures: a seeded fleet, and a client signed in as its operator."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from django.test import Client
from pytest_django.fixtures import Settings

if TYPE_CHECKING:
    from tests.console.seed import Seeded


@pytest.fixture(autouse=True)
def storage_dir(settings: Settings, tmp_path: Path) -> Path:
    settings.HARLI_STORAGE_DIR = tmp_path / "storage"
    return tmp_path / "storage"


@pytest.fixture
def seeded(db: None) -> Seeded:
    from tests.console.seed import seed_console

    return seed_console()


@pytest.fixture
def operator_client(seeded: Seeded) -> Client:
    from tests.console.seed import OPERATOR

    client = Client()
    assert client.login(username=OPERATOR[0], password=OPERATOR[1])
    return client
