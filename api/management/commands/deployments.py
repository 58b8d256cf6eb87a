"""`manage.py deployments create NAME --base-model M --tpot-slo-ms X --ttft-slo-ms Y
[--tensor-parallel-size T] [--engine harli|vllm] | list`."""

from __future__ import annotations

from typing import Any

from api.management.base import NounCommand
from api.models import Engine
from api.selectors import deployment_list
from api.services.fleet import base_model_get, deployment_create


class Command(NounCommand):
    help = "Create and list serving deployments (a base model with a TPOT/TTFT SLO)."

    def add_actions(self, subparsers: Any) -> None:
        create = subparsers.add_parser("create", help="create a deployment")
        create.add_argument("name")
        create.add_argument("--base-model", required=True, help="a registered base model")
        create.add_argument("--tpot-slo-ms", type=float, required=True, help="time per token SLO")
        create.add_argument("--ttft-slo-ms", type=float, required=True, help="time to first token")
        create.add_argument(
            "--attainment-target-pct",
            type=float,
            default=99.0,
            help="share of decode iterations that must meet the TPOT SLO, in %% (default 99)",
        )
        create.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="GPUs each engine group shards the model over (1-8; must suit its shape)",
        )
        create.add_argument(
            "--engine",
            choices=Engine.values,
            default=Engine.HARLI,
            help="what serves it: harli (default; trains too) or vllm (any architecture)",
        )
        subparsers.add_parser("list", help="list deployments")

    def action_create(
        self,
        *,
        name: str,
        base_model: str,
        tpot_slo_ms: float,
        ttft_slo_ms: float,
        attainment_target_pct: float,
        tensor_parallel_size: int,
        engine: str,
        **_: Any,
    ) -> None:
        deployment = deployment_create(
            name=name,
            base_model=base_model_get(name=base_model),
            tpot_slo_ms=tpot_slo_ms,
            ttft_slo_ms=ttft_slo_ms,
            slo_attainment_target_pct=attainment_target_pct,
            tensor_parallel_size=tensor_parallel_size,
            engine=engine,
        )
        self.stdout.write(
            f"Created deployment {deployment.name}: {base_model}, TPOT <= {tpot_slo_ms} ms, "
            f"TTFT <= {ttft_slo_ms} ms, target {attainment_target_pct}%, tensor parallel "
            f"{deployment.tensor_parallel_size}, engine {deployment.engine}."
        )

    def action_list(self, **_: Any) -> None:
        rows = [
            (
                d.name,
                d.base_model.name,
                d.tpot_slo_ms,
                d.ttft_slo_ms,
                d.slo_attainment_target_pct,
                d.tensor_parallel_size,
                d.engine,
            )
            for d in deployment_list()
        ]
        self.table(["NAME", "BASE MODEL", "TPOT MS", "TTFT MS", "TARGET %", "TP", "ENGINE"], rows)
