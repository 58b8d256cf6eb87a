"""Every write the control plane does, as typed functions named `noun_verb` (STYLE.md).

Views, CLI commands and Celery tasks call these; none of them writes models directly.
"""
