# The agent-state models, moved from the `workers` app: added to this app's state only, over
# the tables `workers` created (their `db_table` keeps those names).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0003_agent_state_from_workers'),
        ('api', '0004_finetune_product'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='HostAgentState',
                    fields=[
                        ('host', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='agent_state', serialize=False, to='api.gpuhost')),
                        ('base_model', models.CharField(blank=True, max_length=64)),
                        ('server_url', models.CharField(blank=True, max_length=255)),
                        ('draining', models.BooleanField(default=False)),
                        ('total_bytes', models.BigIntegerField(default=0)),
                        ('free_bytes', models.BigIntegerField(default=0)),
                        ('harvestable_tokens_per_s', models.FloatField(default=0.0)),
                        ('harvest', models.JSONField(default=dict)),
                        ('placements', models.JSONField(default=list)),
                        ('adapters', models.JSONField(default=list)),
                        ('reported_at', models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        'db_table': 'workers_hostagentstate',
                    },
                ),
                migrations.CreateModel(
                    name='PlacementDecision',
                    fields=[
                        ('placement', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='decision', serialize=False, to='api.placement')),
                        ('reasons', models.JSONField()),
                        ('resume_step', models.PositiveIntegerField(blank=True, null=True)),
                        ('dispatch_count', models.PositiveIntegerField(default=0)),
                        ('last_dispatched_at', models.DateTimeField(blank=True, null=True)),
                    ],
                    options={
                        'db_table': 'workers_placementdecision',
                    },
                ),
                migrations.CreateModel(
                    name='MetricRollup',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('series', models.CharField(choices=[('host', 'host'), ('deployment', 'deployment'), ('job', 'job')], max_length=16)),
                        ('key', models.CharField(max_length=160)),
                        ('minute', models.DateTimeField()),
                        ('samples', models.PositiveIntegerField(default=0)),
                        ('sums', models.JSONField(default=dict)),
                        ('maxima', models.JSONField(default=dict)),
                    ],
                    options={
                        'db_table': 'workers_metricrollup',
                        'ordering': ['series', 'key', 'minute'],
                        'constraints': [models.UniqueConstraint(fields=('series', 'key', 'minute'), name='rollup_unique_minute')],
                    },
                ),
                migrations.CreateModel(
                    name='ProcessedReport',
                    fields=[
                        ('message_id', models.CharField(max_length=64, primary_key=True, serialize=False)),
                        ('kind', models.CharField(max_length=32)),
                        ('host', models.CharField(max_length=64)),
                        ('processed_at', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'workers_processedreport',
                        'indexes': [models.Index(fields=['processed_at'], name='workers_pro_process_19e30f_idx')],
                    },
                ),
            ],
        ),
    ]
