"""ASGI entry point (`uvicorn config.asgi:application`): Django behind the inference gateway
(`api.gateway.asgi`), which answers `/v1/completions` and `/v1/chat/completions` itself.
With DJANGO_SETTINGS_MODULE unset, `config.settings.production`, which refuses to start without
its environment."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
django_application = get_asgi_application()

from api.gateway.asgi import with_gateway  # noqa: E402  (needs Django set up)

application = with_gateway(django_application)
