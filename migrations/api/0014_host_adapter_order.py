"""HostAdapterOrder: an operator's load or unload of a model on a host, and the host's last
failure to load it."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0013_job_event_fleet_detail"),
    ]

    operations = [
        migrations.CreateModel(
            name="HostAdapterOrder",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                (
                    "action",
                    models.CharField(
                        choices=[("load", "Load"), ("unload", "Unload")], max_length=8
                    ),
                ),
                ("failure", models.TextField(blank=True)),
                ("failed_at", models.DateTimeField(blank=True, null=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                (
                    "host",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="adapter_orders",
                        to="api.gpuhost",
                    ),
                ),
            ],
            options={
                "ordering": ["name"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("host", "name"), name="host_adapter_order_unique"
                    )
                ],
            },
        ),
    ]
