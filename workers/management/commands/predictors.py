"""`manage.py predictors train|export|evaluate|list`: a thin wrapper over `predictor_models`.

`train` fits on a profile and prints held-out metrics (writes nothing); `export` fits and writes a
new versioned artifact (`<root>/<gpu>/<model>/<version>/model.onnx` + `metadata.json`);
`evaluate` scores an artifact through onnxruntime; `list` shows the artifacts with their metrics.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from api.management.base import NounCommand


def _pct(metrics: dict[str, Any], stage: str, predictor: str | None = None) -> str:
    values = metrics.get(stage, {})
    values = values.get(predictor, {}) if predictor else values
    if not values or values.get("n", 0) == 0:
        return "-"
    return f"{100 * values['mape']:.1f}% / {100 * values['p95_ape']:.1f}% (n={values['n']})"


class Command(NounCommand):
    help = "Train, export, evaluate and list decode-latency predictor artifacts."

    def add_actions(self, subparsers: Any) -> None:
        from predictor_models.pipeline import DEFAULT_DATA, DEFAULT_ROOT

        for name, text in (
            ("train", "fit and print held-out metrics (writes nothing)"),
            ("export", "fit and write a new versioned artifact"),
        ):
            sub = subparsers.add_parser(name, help=text)
            sub.add_argument("--data", default=str(DEFAULT_DATA), help="profile CSV")
            sub.add_argument("--quick", action="store_true", help="one candidate per stage")
            if name == "export":
                sub.add_argument("--root", default=str(DEFAULT_ROOT), help="artifact root")
        evaluate = subparsers.add_parser("evaluate", help="score an artifact on a profile")
        evaluate.add_argument("artifact", help="artifact directory")
        evaluate.add_argument("--data", default=str(DEFAULT_DATA), help="profile CSV")
        listing = subparsers.add_parser("list", help="list artifacts and their metrics")
        listing.add_argument("--root", default=str(DEFAULT_ROOT), help="artifact root")

    def _metrics(self, metrics: dict[str, Any]) -> None:
        self.table(
            ["stage", "predictor", "MAPE / p95 APE"],
            [
                [stage, who, _pct(metrics, stage, who)]
                for stage in ("stage1", "stage2")
                for who in ("harli", "roofline")
            ],
        )

    def action_train(self, *, data: str, quick: bool, **_: Any) -> None:
        from predictor_models.dataset import DatasetError
        from predictor_models.pipeline import fit

        try:
            _profile, result = fit(data, quick)
        except DatasetError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"chosen: {result.chosen}; train rows: {result.n_train}")
        self._metrics(result.metrics)

    def action_export(self, *, data: str, quick: bool, root: str, **_: Any) -> None:
        from predictor_models.dataset import DatasetError
        from predictor_models.pipeline import fit_and_export

        try:
            directory, result = fit_and_export(data, root, quick)
        except DatasetError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"wrote {directory} (chosen: {result.chosen})")
        self._metrics(result.metrics)

    def action_evaluate(self, *, artifact: str, data: str, **_: Any) -> None:
        from gpu_runtime.predictor.artifact import ArtifactError
        from predictor_models.dataset import DatasetError
        from predictor_models.pipeline import evaluate_artifact

        try:
            out = evaluate_artifact(artifact, data)
        except (ArtifactError, DatasetError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{out['version']} on {out['scope']} of {data}:")
        self.table(["stage", "MAPE / p95 APE"], [[s, _pct(out, s)] for s in ("stage1", "stage2")])

    def action_list(self, *, root: str, **_: Any) -> None:
        from gpu_runtime.predictor.artifact import list_artifacts

        self.table(
            ["gpu", "model", "version", "stage 1 (held-out)", "stage 2 (held-out)", "data"],
            [
                [
                    m.gpu_key,
                    m.model,
                    m.version,
                    _pct(m.metrics, "stage1", "harli"),
                    _pct(m.metrics, "stage2", "harli"),
                    m.raw["data"].get("sha256", "")[:12],
                ]
                for m in list_artifacts(root)
            ],
        )
