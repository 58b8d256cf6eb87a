"""Host engines: a deployment's `engine` (harli | vllm), the agent state's reported `engine`,
`capabilities` and `engine_state`; `BaseModel.architecture` takes any model type name."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0015_engine_groups"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="engine",
            field=models.CharField(
                choices=[("harli", "Harli"), ("vllm", "vLLM")], default="harli", max_length=16
            ),
        ),
        migrations.AddField(
            model_name="hostagentstate",
            name="capabilities",
            field=models.JSONField(default=dict),
        ),
        migrations.AddField(
            model_name="hostagentstate",
            name="engine",
            field=models.CharField(default="harli", max_length=16),
        ),
        migrations.AddField(
            model_name="hostagentstate",
            name="engine_state",
            field=models.JSONField(default=dict),
        ),
        migrations.AlterField(
            model_name="basemodel",
            name="architecture",
            field=models.CharField(max_length=64),
        ),
    ]
