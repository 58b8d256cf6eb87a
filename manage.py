#!/usr/bin/env python
"""Django's command-line utility for the Harli control plane.

With DJANGO_SETTINGS_MODULE unset it runs on `config.settings.production`, which refuses to
start without its environment; the embedded platform (`scripts/run.sh`) chooses
`config.settings.local`. A settings value that cannot be used is printed alone, exit status 1.
"""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
    from django.core.management import execute_from_command_line

    from config.env import EnvError

    try:
        execute_from_command_line(sys.argv)
    except EnvError as exc:
        sys.exit(f"manage.py: {exc}")


if __name__ == "__main__":
    main()
