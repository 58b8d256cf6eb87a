from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"

    def ready(self) -> None:
        """Install the beat schedule on the Celery app (reconciliation every N seconds)."""
        from config.celery import app
        from workers.conf import worker_settings

        app.conf.beat_schedule = {
            "reconcile-fleet": {
                "task": "workers.reconcile",
                "schedule": float(worker_settings().reconcile_interval_s),
                "options": {"expires": float(worker_settings().reconcile_interval_s)},
            }
        }
