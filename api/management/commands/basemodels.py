"""`manage.py basemodels register NAME [--checkpoint DIR | --preset P] | list`."""

from __future__ import annotations

from typing import Any

from api.management.base import NounCommand
from api.models import Architecture, Dtype
from api.presets import PRESETS
from api.selectors import base_model_list
from api.services.fleet import base_model_register


class Command(NounCommand):
    help = "Register and list base models (a local checkpoint, or a preset with random weights)."

    def add_actions(self, subparsers: Any) -> None:
        register = subparsers.add_parser("register", help="register a base model")
        register.add_argument("name", help="model name, e.g. tiny or llama3-8b (no ':')")
        source = register.add_mutually_exclusive_group(required=True)
        source.add_argument("--checkpoint", metavar="DIR", help="directory of HF safetensors")
        source.add_argument(
            "--preset",
            choices=sorted(PRESETS),
            help="known architecture with random weights (tiny runs anywhere)",
        )
        register.add_argument(
            "--architecture",
            help="the config's model_type (default: DIR/config.json's); other than "
            f"{'/'.join(Architecture.values)}: served by vLLM deployments only",
        )
        register.add_argument("--dtype", choices=Dtype.values, default=Dtype.BFLOAT16)
        register.add_argument(
            "--context-length",
            type=int,
            help="required with --checkpoint unless DIR/config.json gives it",
        )
        subparsers.add_parser("list", help="list base models")

    def action_register(
        self,
        *,
        name: str,
        checkpoint: str | None,
        preset: str | None,
        architecture: str | None,
        dtype: str,
        context_length: int | None,
        **_: Any,
    ) -> None:
        base_model = base_model_register(
            name=name,
            checkpoint_dir=checkpoint or "",
            preset=preset or "",
            architecture=architecture,
            dtype=dtype,
            context_length=context_length,
        )
        source = f"preset {base_model.preset}" if base_model.preset else base_model.checkpoint_dir
        self.stdout.write(
            f"Registered base model {base_model.name} ({base_model.architecture}, {source}, "
            f"{base_model.dtype}, context {base_model.context_length})."
        )

    def action_list(self, **_: Any) -> None:
        rows = [
            (
                m.name,
                m.architecture,
                f"preset:{m.preset}" if m.preset else m.checkpoint_dir,
                m.dtype,
                m.context_length,
            )
            for m in base_model_list()
        ]
        self.table(["NAME", "ARCH", "WEIGHTS", "DTYPE", "CONTEXT"], rows)
