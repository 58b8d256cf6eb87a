"""The door from the domain to the control plane's messaging: what a service asks to be sent.

Services never publish themselves: once their transaction commits (`transaction.on_commit`),
they ask the registered :class:`HostDispatch` to queue a task or send a host command. The
messaging app (`workers`) registers its implementation when Django starts (its
`AppConfig.ready`), so the domain never imports it and a process without it fails loudly at
the first send instead of dropping messages.
"""

from __future__ import annotations

from typing import Any, Protocol


class HostDispatch(Protocol):
    """Sends to the broker. Every method publishes and returns; none touches the database."""

    def job_place_queue(self, *, job_id: str) -> None:
        """Queue the placement task of a queued job (it picks a host after its own commit)."""

    def host_command_send(self, *, host_name: str, command: str, **fields: Any) -> dict[str, Any]:
        """Publish one command to the host's queue `host.<host_name>`; returns the message."""

    def placement_stop_send(
        self, *, host_name: str, placement_id: int, job_id: str, command: str
    ) -> bool:
        """Send `command` ("pause" or "cancel") for a placement; False (logged) when the broker
        did not take it: the heartbeats' stale-placement check sends it again."""

    def model_unload_send(self, *, host_name: str, name: str) -> bool:
        """Send `unload_adapter` for `name`; False (logged) when the broker did not take it:
        the heartbeats that still name it send it again."""


class DispatchNotRegisteredError(RuntimeError):
    """No messaging is registered: the `workers` app is not installed in this process."""


class _Registry:
    """The one registered dispatch of this process."""

    def __init__(self) -> None:
        self.dispatch: HostDispatch | None = None


_registry = _Registry()


def dispatch_register(*, dispatch: HostDispatch) -> None:
    """Install the process's messaging (called once, by the messaging app's `ready`)."""
    _registry.dispatch = dispatch


def host_dispatch() -> HostDispatch:
    """The registered messaging; DispatchNotRegisteredError when there is none."""
    if _registry.dispatch is None:
        raise DispatchNotRegisteredError(
            "no host dispatch is registered; add 'workers' to INSTALLED_APPS"
        )
    return _registry.dispatch
