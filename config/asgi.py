"""ASGI entry point (`uvicorn config.asgi:application`): Django behind the inference gateway
(`api.gateway.asgi`), which answers `/v1/completions` and `/v1/chat/completions` itself.
With DJANGO_SETTINGS_MODULE unset, `config.settings.production`, which refuses to start without
its environment. Django serves at most `HARLI_WEB_REQUESTS_IN_FLIGHT` requests at once per
process, the others wait (`api.request_slots`): that bounds the process's database
connections."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402

from api.gateway.asgi import with_gateway  # noqa: E402  (needs Django set up)
from api.request_slots import SlottedASGIHandler  # noqa: E402

django_application = SlottedASGIHandler(settings.HARLI_WEB_REQUESTS_IN_FLIGHT)

application = with_gateway(django_application)
