"""The control plane's side of host message signing (`gpu_runtime.contract.message_auth`).

A host's message key is derived from its host key, which is derived from the fleet's gateway
secret (`settings.GATEWAY_SECRET`) and its name: nothing per host is stored, and the agent holds
the same host key (`manage.py hosts key NAME`, its HARLI_HOST_KEY).
"""

from __future__ import annotations

from django.conf import settings

from gpu_runtime.contract.grants import host_key
from gpu_runtime.contract.message_auth import message_key


def host_message_key(host_name: str) -> bytes:
    """The key `host_name`'s reports and commands are signed with; ValueError without a
    gateway secret."""
    return message_key(host_key(str(settings.GATEWAY_SECRET), host_name))
