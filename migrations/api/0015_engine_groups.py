"""Engine groups and tensor parallelism: `Deployment.tensor_parallel_size`; `EngineGroup` (a
deployment on a range of a host's GPUs) replaces `GpuHost.deployment`, each existing host's
deployment becoming its group 0 at GPU 0 (its placements and decode metrics that group's, its
agent's last heartbeat that group's entry, so placement need not wait for the next one);
per-group and per-GPU metrics."""

from typing import Any

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


def hosts_to_groups(apps: Any, schema_editor: Any) -> None:
    GpuHost = apps.get_model("api", "GpuHost")
    EngineGroup = apps.get_model("api", "EngineGroup")
    Placement = apps.get_model("api", "Placement")
    DeploymentMetric = apps.get_model("api", "DeploymentMetric")
    HostAgentState = apps.get_model("api", "HostAgentState")
    for host in GpuHost.objects.exclude(deployment=None).order_by("pk"):
        group = EngineGroup.objects.create(
            host_id=host.pk, deployment_id=host.deployment_id, index=0, first_gpu=0
        )
        Placement.objects.filter(host_id=host.pk).update(engine_group=group)
        DeploymentMetric.objects.filter(host_id=host.pk, deployment_id=host.deployment_id).update(
            engine_group=group
        )
        state = HostAgentState.objects.filter(host_id=host.pk).first()
        if state is not None:
            state.engine_groups = [
                {
                    "index": 0,
                    "base_model": state.base_model,
                    "tensor_parallel_size": 1,
                    "gpu_indices": [0],
                    "free_bytes": state.free_bytes,
                    "free_bytes_per_gpu": state.free_bytes,
                    "harvestable_tokens_per_s": state.harvestable_tokens_per_s,
                    "harvest": state.harvest,
                    "placements": state.placements,
                    "predictor_version": host.predictor_version,
                }
            ]
            state.save(update_fields=["engine_groups"])


def groups_to_hosts(apps: Any, schema_editor: Any) -> None:
    GpuHost = apps.get_model("api", "GpuHost")
    EngineGroup = apps.get_model("api", "EngineGroup")
    for group in EngineGroup.objects.order_by("host_id", "index"):
        GpuHost.objects.filter(pk=group.host_id, deployment=None).update(
            deployment_id=group.deployment_id
        )


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0014_host_adapter_order"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="tensor_parallel_size",
            field=models.PositiveSmallIntegerField(
                default=1,
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(8),
                ],
            ),
        ),
        migrations.AddConstraint(
            model_name="deployment",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("tensor_parallel_size__gte", 1), ("tensor_parallel_size__lte", 8)
                ),
                name="deployment_tensor_parallel_size_range",
            ),
        ),
        migrations.CreateModel(
            name="EngineGroup",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),  # fmt: skip
                ("index", models.PositiveSmallIntegerField()),
                ("first_gpu", models.PositiveSmallIntegerField()),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "deployment",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="engine_groups",
                        to="api.deployment",
                    ),
                ),
                (
                    "host",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="engine_groups",
                        to="api.gpuhost",
                    ),
                ),
            ],
            options={"ordering": ["host_id", "index"]},
        ),
        migrations.AddConstraint(
            model_name="enginegroup",
            constraint=models.UniqueConstraint(
                fields=("host", "index"), name="engine_group_index_unique"
            ),
        ),
        migrations.AddConstraint(
            model_name="enginegroup",
            constraint=models.UniqueConstraint(
                fields=("host", "first_gpu"), name="engine_group_first_gpu_unique"
            ),
        ),
        migrations.AddField(
            model_name="placement",
            name="engine_group",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="placements",
                to="api.enginegroup",
            ),
        ),
        migrations.AddField(
            model_name="deploymentmetric",
            name="engine_group",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="deployment_metrics",
                to="api.enginegroup",
            ),
        ),
        migrations.AddField(
            model_name="hostagentstate", name="engine_groups", field=models.JSONField(default=list)
        ),
        migrations.AddField(
            model_name="hostagentstate", name="gpus", field=models.JSONField(default=list)
        ),
        migrations.AddField(
            model_name="hostmetric", name="gpus", field=models.JSONField(default=list)
        ),
        migrations.RunPython(hosts_to_groups, groups_to_hosts),
        migrations.RemoveField(model_name="gpuhost", name="deployment"),
        migrations.CreateModel(
            name="EngineGroupMetric",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),  # fmt: skip
                ("ts", models.DateTimeField()),
                ("kv_used_bytes", models.BigIntegerField(default=0)),
                ("finetune_lent_bytes", models.BigIntegerField(default=0)),
                ("free_bytes", models.BigIntegerField(default=0)),
                ("finetune_tokens_per_s", models.FloatField(default=0.0)),
                ("gpus", models.JSONField(default=list)),
                (
                    "engine_group",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="metrics",
                        to="api.enginegroup",
                    ),
                ),
            ],
            options={
                "ordering": ["-ts", "-id"],
                "indexes": [
                    models.Index(
                        fields=["engine_group", "-ts"], name="api_engineg_engine__0e53fa_idx"
                    )
                ],
            },
        ),
    ]
