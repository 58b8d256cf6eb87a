"""`python -m predictor_models train|export|evaluate|list`: fit, export, score and list
decode-latency predictor artifacts, each action's result printed as one JSON object.

`train` fits on a profile and prints held-out metrics (writes nothing); `export` fits and writes a
new versioned artifact (`<root>/<gpu>/<model>/<version>/model.onnx` + `metadata.json`);
`evaluate` scores an artifact through onnxruntime; `list` describes the artifacts under a root.
A profile or artifact that cannot be read exits with status 1 and its message on stderr. The
control plane's `manage.py predictors` runs this in a subprocess (so no torch enters its
processes) and prints the results as tables.

Output, by action (metrics are `{stage: {predictor: {"mape", "p95_ape", "n"}}}`):

* `train`: `{"chosen", "n_train", "metrics"}`;
* `export`: `{"directory", "chosen", "metrics"}`;
* `evaluate`: `{"artifact", "version", "scope", "data", "stage1", "stage2", ...}` (per-stage
  `{"mape", "p95_ape", "n"}`, also per kind of step);
* `list`: `{"artifacts": [{"gpu_key", "model", "version", "metrics", "data_sha256"}, ...]}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpu_runtime.predictor.artifact import ArtifactError, list_artifacts
from predictor_models.dataset import DatasetError
from predictor_models.pipeline import (
    DEFAULT_DATA,
    DEFAULT_ROOT,
    evaluate_artifact,
    fit,
    fit_and_export,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m predictor_models", description=__doc__)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (
        ("train", "fit and print held-out metrics (writes nothing)"),
        ("export", "fit and write a new versioned artifact"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--data", default=str(DEFAULT_DATA), help="profile CSV")
        sub.add_argument("--quick", action="store_true", help="one candidate per stage")
        if name == "export":
            sub.add_argument("--root", default=str(DEFAULT_ROOT), help="artifact root")
    evaluate = actions.add_parser("evaluate", help="score an artifact on a profile")
    evaluate.add_argument("artifact", help="artifact directory")
    evaluate.add_argument("--data", default=str(DEFAULT_DATA), help="profile CSV")
    listing = actions.add_parser("list", help="list artifacts and their metrics")
    listing.add_argument("--root", default=str(DEFAULT_ROOT), help="artifact root")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The result of one action (see the module docstring); DatasetError or ArtifactError."""
    if args.action == "train":
        _profile, result = fit(args.data, args.quick)
        return {"chosen": result.chosen, "n_train": result.n_train, "metrics": result.metrics}
    if args.action == "export":
        directory, result = fit_and_export(args.data, args.root, args.quick)
        return {"directory": str(directory), "chosen": result.chosen, "metrics": result.metrics}
    if args.action == "evaluate":
        return {**evaluate_artifact(args.artifact, args.data), "data": args.data}
    return {
        "artifacts": [
            {
                "gpu_key": m.gpu_key,
                "model": m.model,
                "version": m.version,
                "metrics": m.metrics,
                "data_sha256": m.raw["data"].get("sha256", ""),
            }
            for m in list_artifacts(args.root)
        ]
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = run(args)
    except (ArtifactError, DatasetError) as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(1) from exc
    print(json.dumps(result))
