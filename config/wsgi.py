"""WSGI entry point; with DJANGO_SETTINGS_MODULE unset, `config.settings.production` (which
refuses to start without its environment). The production server is ASGI: `config/asgi.py`."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
application = get_wsgi_application()
