"""bench/common/provenance.py: the result file every benchmark writes (bench/README.md's shape)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from bench.common.provenance import gpu_slug, write_result
from tests.bench.script_runs import RESULT_HEAD


def test_gpu_slug() -> None:
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_slug("cpu") == "cpu"
    assert gpu_slug("Some GPU (rev 2)") == "some-gpu--rev-2"


def test_write_result_names_the_file_and_holds_the_required_keys(tmp_path: Path) -> None:
    path = write_result(
        "decode-attention",
        tmp_path / "out",
        "NVIDIA H200",
        "2.11.0",
        "abc1234",
        config={"batches": [1, 8]},
        rows=[{"batch": 1, "us_per_layer_p50": 5.3}],
    )
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert path == tmp_path / "out" / f"decode-attention-h200-{day}.json"
    document = json.loads(path.read_text())
    assert list(document)[:6] == RESULT_HEAD
    assert document["name"] == "decode-attention" and document["commit"] == "abc1234"
    assert document["config"] == {"batches": [1, 8]}
    assert document["rows"] == [{"batch": 1, "us_per_layer_p50": 5.3}]
    assert datetime.datetime.fromisoformat(document["created"]).tzinfo is not None
