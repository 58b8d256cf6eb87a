"""`manage.py predictors train|export|evaluate|list`: a thin wrapper over `predictor_models`.

`train` fits on a profile and prints held-out metrics (writes nothing); `export` fits and writes a
new versioned artifact (`<root>/<gpu>/<model>/<version>/model.onnx` + `metadata.json`);
`evaluate` scores an artifact through onnxruntime; `list` shows the artifacts with their metrics.
Each action runs the pipeline's own command line (`python -m predictor_models`, which loads torch)
in a subprocess and prints its JSON result as tables, so the control plane's processes never load
torch; an option left out takes that command's default (the committed profile, the artifact root).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError

from api.management.base import NounCommand


def _pct(metrics: dict[str, Any], stage: str, predictor: str | None = None) -> str:
    values = metrics.get(stage, {})
    values = values.get(predictor, {}) if predictor else values
    if not values or values.get("n", 0) == 0:
        return "-"
    return f"{100 * values['mape']:.1f}% / {100 * values['p95_ape']:.1f}% (n={values['n']})"


def _options(**options: str | None) -> list[str]:
    """`--name value` for each option given (None leaves the pipeline's default)."""
    return [
        arg for name, value in options.items() if value is not None for arg in (f"--{name}", value)
    ]


class Command(NounCommand):
    help = "Train, export, evaluate and list decode-latency predictor artifacts."

    def add_actions(self, subparsers: Any) -> None:
        for name, text in (
            ("train", "fit and print held-out metrics (writes nothing)"),
            ("export", "fit and write a new versioned artifact"),
        ):
            sub = subparsers.add_parser(name, help=text)
            sub.add_argument("--data", help="profile CSV (default: the committed profile)")
            sub.add_argument("--quick", action="store_true", help="one candidate per stage")
            if name == "export":
                sub.add_argument(
                    "--root", help="artifact root (default: predictor_models/artifacts)"
                )
        evaluate = subparsers.add_parser("evaluate", help="score an artifact on a profile")
        evaluate.add_argument("artifact", help="artifact directory")
        evaluate.add_argument("--data", help="profile CSV (default: the committed profile)")
        listing = subparsers.add_parser("list", help="list artifacts and their metrics")
        listing.add_argument("--root", help="artifact root (default: predictor_models/artifacts)")

    def _pipeline(self, *args: str) -> dict[str, Any]:
        """The JSON result of `python -m predictor_models <args>`; its error as a CommandError."""
        done = subprocess.run(
            [sys.executable, "-m", "predictor_models", *args],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise CommandError(done.stderr.strip() or f"predictor_models exited {done.returncode}")
        if done.stderr:
            self.stderr.write(done.stderr, ending="")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def _metrics(self, metrics: dict[str, Any]) -> None:
        self.table(
            ["stage", "predictor", "MAPE / p95 APE"],
            [
                [stage, who, _pct(metrics, stage, who)]
                for stage in ("stage1", "stage2")
                for who in ("harli", "roofline")
            ],
        )

    def action_train(self, *, data: str | None, quick: bool, **_: Any) -> None:
        quick_flag = ["--quick"] if quick else []
        result = self._pipeline("train", *_options(data=data), *quick_flag)
        self.stdout.write(f"chosen: {result['chosen']}; train rows: {result['n_train']}")
        self._metrics(result["metrics"])

    def action_export(self, *, data: str | None, quick: bool, root: str | None, **_: Any) -> None:
        quick_flag = ["--quick"] if quick else []
        result = self._pipeline("export", *_options(data=data, root=root), *quick_flag)
        self.stdout.write(f"wrote {result['directory']} (chosen: {result['chosen']})")
        self._metrics(result["metrics"])

    def action_evaluate(self, *, artifact: str, data: str | None, **_: Any) -> None:
        out = self._pipeline("evaluate", artifact, *_options(data=data))
        self.stdout.write(f"{out['version']} on {out['scope']} of {out['data']}:")
        self.table(["stage", "MAPE / p95 APE"], [[s, _pct(out, s)] for s in ("stage1", "stage2")])

    def action_list(self, *, root: str | None, **_: Any) -> None:
        listing = self._pipeline("list", *_options(root=root))
        self.table(
            ["gpu", "model", "version", "stage 1 (held-out)", "stage 2 (held-out)", "data"],
            [
                [
                    m["gpu_key"],
                    m["model"],
                    m["version"],
                    _pct(m["metrics"], "stage1", "harli"),
                    _pct(m["metrics"], "stage2", "harli"),
                    m["data_sha256"][:12],
                ]
                for m in listing["artifacts"]
            ],
        )
