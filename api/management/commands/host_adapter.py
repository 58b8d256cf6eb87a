"""`manage.py host_adapter load --host H --model NAME | unload --host H --model NAME |
list --host H`: serve or stop serving a fine-tuned model on one host now, without restarting
it (`api.services.host_adapters`), and read what the host serves and how the last orders went."""

from __future__ import annotations

from typing import Any

from api.management.base import NounCommand
from api.services.host_adapters import host_adapter_list, host_adapter_load, host_adapter_unload


class Command(NounCommand):
    help = "Load or unload a fine-tuned model on a host at run time; list a host's models."

    def add_actions(self, subparsers: Any) -> None:
        for action, text in (
            ("load", "serve a fine-tuned model (a finished adapter or a checkpoint) on the host"),
            ("unload", "stop serving a model on the host (running requests finish)"),
        ):
            parser = subparsers.add_parser(action, help=text)
            parser.add_argument("--host", required=True, help="the host's name")
            parser.add_argument("--model", required=True, help="the model's name")
        listing = subparsers.add_parser("list", help="what the host serves, orders, failures")
        listing.add_argument("--host", required=True)

    def action_load(self, *, host: str, model: str, **_: Any) -> None:
        host_adapter_load(host_name=host, model=model)
        self.stdout.write(
            f"Sent load_adapter {model} to host {host}; `host_adapter list --host {host}` "
            "shows it served after the host's next heartbeat, or why it failed."
        )

    def action_unload(self, *, host: str, model: str, **_: Any) -> None:
        host_adapter_unload(host_name=host, model=model)
        self.stdout.write(
            f"Sent unload_adapter {model} to host {host}; heartbeats no longer offer it there "
            "until it is loaded again."
        )

    def action_list(self, *, host: str, **_: Any) -> None:
        rows = [
            (
                e.name,
                "yes" if e.served else "no",
                e.order,
                e.failure or None,
                e.failed_at.isoformat(timespec="seconds") if e.failed_at else None,
            )
            for e in host_adapter_list(host_name=host)
        ]
        self.table(["MODEL", "SERVED", "ORDER", "FAILURE", "FAILED AT"], rows)
