"""A fresh web process that receives several job creations at once loads the base model's
tokenizer once, and none of them fails: the first import of `transformers` from several threads
at once raised "cannot import name 'PreTrainedTokenizerFast'" (500s on the first job creations
after each uvicorn worker started, seen by `python -m bench.api_load`'s warm-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THREADS = 8

# Run in a new interpreter: this process has imported transformers already.
SCRIPT = f"""
import json, threading
import django
django.setup()
from api import base_model_tokenizers
from api.base_model_tokenizers import base_model_tokenizer
from api.models import BaseModel

loads = []
original = base_model_tokenizers._load_tiny
def counted():
    loads.append(1)
    return original()
base_model_tokenizers._load_tiny = counted
model = BaseModel(name="tiny", preset="tiny", checkpoint_dir="")
barrier = threading.Barrier({THREADS})
errors, tokenizers = [], []
def create():
    barrier.wait()
    try:
        tokenizers.append(base_model_tokenizer(base_model=model))
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=create) for _ in range({THREADS})]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({{"errors": errors, "loads": len(loads),
                  "distinct": len({{id(t) for t in tokenizers}})}}))
"""


def test_concurrent_first_loads_in_a_fresh_process_succeed_and_load_once(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "HARLI_STORAGE_DIR": str(tmp_path / "storage"),
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"errors": [], "loads": 1, "distinct": 1}, found
