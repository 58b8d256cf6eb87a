"""The shared rules import neither torch nor Django, the control plane's use of them (the
job-file check, a tokenizer built and used) pulls no torch into the web process, and no module
of the control plane's packages loads torch at all."""

from __future__ import annotations

import subprocess
import sys

CONTRACT = """
import importlib, json, pkgutil, sys, tempfile
import gpu_runtime.contract
for info in pkgutil.walk_packages(gpu_runtime.contract.__path__, "gpu_runtime.contract."):
    importlib.import_module(info.name)
from gpu_runtime.contract import tiny_tokenizer, tokenizer, training_data
with tempfile.TemporaryDirectory() as d:
    tiny_tokenizer.build_tiny_tokenizer(d)
    tok = tokenizer.load_training_tokenizer(d)
line = json.dumps({"prompt": "Q: hi", "completion": " A: there"})
assert training_data.tokenize_training_lines([line], tok, 64, "f").examples
print(sorted(m for m in ("torch", "django") if m in sys.modules))
"""
CONTROL_PLANE = """
import os, sys
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
django.setup()
import api.file_tokens, api.services.jobs, workers.commands, api.services.reports.jobs
from api.base_model_tokenizers import base_model_tokenizer
from api.models import BaseModel
base_model_tokenizer(base_model=BaseModel(name="tiny", preset="tiny", context_length=512))
print("torch" in sys.modules)
"""

EVERY_MODULE = """
import importlib, os, pkgutil, sys
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
django.setup()
names = []
for package in ("config", "api", "console", "workers"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name != "config.settings.production":  # it needs its environment
            names.append(info.name)
loaded = [n for n in names if importlib.import_module(n) and "torch" in sys.modules]
print(len(names), ",".join(sorted(names)), loaded[:1])
"""


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip().splitlines()[-1]


def test_the_contract_imports_neither_torch_nor_django() -> None:
    assert _run(CONTRACT) == "[]"


def test_the_control_planes_file_check_imports_no_torch() -> None:
    assert _run(CONTROL_PLANE) == "False"


def test_no_module_of_the_control_plane_loads_torch() -> None:
    count, walked, first = _run(EVERY_MODULE).split(" ", 2)
    assert int(count) > 90  # every module was walked (api, console, workers and config)
    names = set(walked.split(","))
    # apps, management commands, migrations-free settings and the Celery app are among them
    for name in (
        "api.apps",
        "workers.apps",
        "console.apps",
        "config.celery",
        "config.urls",
        "config.settings.test",
        "workers.management.commands.predictors",
        "workers.tasks",
        "workers.commands",
        "api.services.reports.heartbeat",
    ):
        assert name in names, f"{name} was not walked"
    assert any(n.startswith("api.management.commands.") for n in names)
    assert first == "[]", f"{first} loads torch"
