from django.apps import AppConfig

UPLOAD_SWEEP_INTERVAL_S = 60.0


class WorkersConfig(AppConfig):
    name = "workers"

    def ready(self) -> None:
        """Install the beat schedule on the Celery app: reconciliation every N seconds, the sweep
        of expired uploads every UPLOAD_SWEEP_INTERVAL_S (access expires them too)."""
        from config.celery import app
        from workers.conf import worker_settings

        app.conf.beat_schedule = {
            "reconcile-fleet": {
                "task": "workers.reconcile",
                "schedule": float(worker_settings().reconcile_interval_s),
                "options": {"expires": float(worker_settings().reconcile_interval_s)},
            },
            "expire-uploads": {
                "task": "workers.expire_uploads",
                "schedule": UPLOAD_SWEEP_INTERVAL_S,
                "options": {"expires": UPLOAD_SWEEP_INTERVAL_S},
            },
        }
