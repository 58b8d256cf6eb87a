"""`manage.py predictors` (thin wrapper): listing, evaluating, and its errors."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from predictor_models.dataset import load_profile
from predictor_models.export import write_artifact
from predictor_models.model import LatencyModel
from predictor_models.pipeline import DEFAULT_DATA
from predictor_models.roofline import H200, RooflineBaseline
from predictor_models.train import TrainResult, evaluate


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact root holding the untrained (roofline-prior) model of the committed data."""
    data = load_profile(DEFAULT_DATA)
    model = LatencyModel(data.shape, H200, (4,), ()).eval()
    baseline = RooflineBaseline(data.shape, H200)
    result = TrainResult(
        model=model,
        baseline=baseline,
        chosen={"stage1": "mlp4"},
        metrics=evaluate(model, baseline, data),
    )
    directory = tmp_path_factory.mktemp("artifacts")
    write_artifact(result, data, directory, "profile.csv", version="v20260101T000000Z")
    return directory


def test_list_shows_versions_and_metrics(root: Path) -> None:
    out = StringIO()
    call_command("predictors", "list", root=str(root), stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:3] == ["gpu", "model", "version"]
    assert lines[1].startswith("h200  llama3-8b  v20260101T000000Z")
    assert "%" in lines[1]


def test_evaluate_on_its_training_data_uses_held_out_configurations(root: Path) -> None:
    out = StringIO()
    artifact = root / "h200" / "llama3-8b" / "v20260101T000000Z"
    call_command("predictors", "evaluate", str(artifact), data=str(DEFAULT_DATA), stdout=out)
    text = out.getvalue()
    assert "held-out configurations" in text
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["stage1", "stage2"]


def test_errors_are_command_errors(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="does not exist"):
        call_command("predictors", "evaluate", str(tmp_path / "missing"))
    with pytest.raises(CommandError, match="profile data .* does not exist"):
        call_command("predictors", "train", data=str(tmp_path / "none.csv"))
