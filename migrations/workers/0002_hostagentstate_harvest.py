from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="hostagentstate",
            name="harvest",
            field=models.JSONField(default=dict),
        ),
    ]
