from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("api", "0003_deploymentmetric_ttft"),
    ]

    operations = [
        migrations.AddField(
            model_name="finetunejob",
            name="stalled_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
