from django.apps import AppConfig
from django.conf import settings

from api.dispatch import dispatch_register
from api.fleet_settings import fleet_settings
from config.celery import app

UPLOAD_SWEEP_INTERVAL_S = 60.0


class WorkersConfig(AppConfig):
    """The control plane's messaging and tasks: registers the domain's host dispatch and
    installs the beat schedule."""

    name = "workers"

    def ready(self) -> None:
        """Register `workers.commands.CeleryHostDispatch` as the domain's `api.dispatch` (the
        module imports the tasks, which import models: only importable once the apps are
        loaded), and install the beat schedule on the Celery app: reconciliation every N
        seconds, the sweep of expired uploads every UPLOAD_SWEEP_INTERVAL_S (access expires
        them too), the janitor every HARLI_JANITOR_INTERVAL_S."""
        from workers.commands import CeleryHostDispatch

        dispatch_register(dispatch=CeleryHostDispatch())
        app.conf.beat_schedule = {
            "reconcile-fleet": {
                "task": "workers.reconcile",
                "schedule": float(fleet_settings().reconcile_interval_s),
                "options": {"expires": float(fleet_settings().reconcile_interval_s)},
            },
            "expire-uploads": {
                "task": "workers.expire_uploads",
                "schedule": UPLOAD_SWEEP_INTERVAL_S,
                "options": {"expires": UPLOAD_SWEEP_INTERVAL_S},
            },
            "janitor": {
                "task": "workers.janitor",
                "schedule": float(settings.HARLI_JANITOR_INTERVAL_S),
                "options": {"expires": float(settings.HARLI_JANITOR_INTERVAL_S)},
            },
        }
