from pathlib import Path

from django.apps import AppConfig
from django.conf import settings


class ApiConfig(AppConfig):
    name = "api"

    def ready(self) -> None:
        from api import schema  # noqa: F401  (registers the OpenAPI auth extension)

        # Uploads spool here (FILE_UPLOAD_TEMP_DIR); Django's check refuses a missing folder.
        Path(settings.HARLI_UPLOAD_SPOOL_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
