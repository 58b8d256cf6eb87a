"""The Celery app of the control plane (`celery -A config worker`).

Configuration comes from Django settings with the `CELERY_` prefix (config/settings/base.py);
with DJANGO_SETTINGS_MODULE unset, `config.settings.production` (which refuses to start without
its environment).
With `CELERY_BROKER_URL` unset the broker is kombu's in-memory transport `memory://`, which only
reaches consumers in the same process; config.settings.local then runs tasks eagerly, so the
platform needs no broker on one machine. Set `CELERY_BROKER_URL` (Redis or RabbitMQ) to run
separate worker and host-agent processes. Tasks go to the `control` queue unless routed to a
host's queue `host.<name>`.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

app = Celery("harli")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

import config.celery_request_ids  # noqa: E402,F401  (connects the request-id signals)
