# The agent-state models move to the `api` app (`api.models.agents`, `api.models.metrics`):
# removed from this app's state only; their tables stay, and `api` 0005 takes them over.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0002_hostagentstate_harvest'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='hostagentstate',
                    name='host',
                ),
                migrations.DeleteModel(
                    name='MetricRollup',
                ),
                migrations.RemoveField(
                    model_name='placementdecision',
                    name='placement',
                ),
                migrations.DeleteModel(
                    name='ProcessedReport',
                ),
                migrations.DeleteModel(
                    name='HostAgentState',
                ),
                migrations.DeleteModel(
                    name='PlacementDecision',
                ),
            ],
        ),
    ]
