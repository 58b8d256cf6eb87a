#!/usr/bin/env bash
# Install and run the platform on this machine. With DATABASE_URL and CELERY_BROKER_URL unset it
# uses embedded defaults (SQLite, a local Celery transport) and needs no service.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export DJANGO_SETTINGS_MODULE=${DJANGO_SETTINGS_MODULE:-config.settings.local}
python manage.py migrate --no-input
exec python manage.py runserver "${HARLI_BIND:-127.0.0.1:8000}"
