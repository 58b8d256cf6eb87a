#!/usr/bin/env bash
# Install and run the platform on this machine. With DATABASE_URL and CELERY_BROKER_URL unset it
# uses embedded defaults (SQLite under var/, Celery's in-memory transport with tasks run inline)
# and needs no service. Seeds a demo tenant, key, the `tiny` model, a deployment and an operator,
# prints how to reach them, then serves on HARLI_BIND (default 127.0.0.1:8000). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export DJANGO_SETTINGS_MODULE=${DJANGO_SETTINGS_MODULE:-config.settings.local}
bind=${HARLI_BIND:-127.0.0.1:8000}
host=${bind%:*}
case "$host" in 0.0.0.0|"") host=127.0.0.1 ;; esac
python manage.py migrate --no-input -v 0
python manage.py seed_demo --url "http://${host}:${bind##*:}"
# --noreload: one process, so Ctrl-C (SIGINT) stops the server at once and leaves nothing behind.
exec python manage.py runserver --noreload "$bind"
