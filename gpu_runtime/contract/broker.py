"""The broker connection both halves build from one rule: the kombu transport of a broker URL
and its transport options, so the control plane and the host agents meet in the same folders.

A `filesystem://` broker keeps every queue's messages in one `queue/` folder under the broker
directory, consumed ones in `processed/`, exchange bindings in `control/` and message files that
could not be read in `failed/`; it is served in every process by the runtime's atomic transport
(`gpu_runtime.agent.fs_transport`, loaded by kombu from :data:`FILESYSTEM_TRANSPORT`), never by
kombu's stock filesystem transport. Other URLs keep their own transport and need no options.
"""

from __future__ import annotations

from pathlib import Path

FILESYSTEM_TRANSPORT = "gpu_runtime.agent.fs_transport:Transport"
"""The import path kombu loads the `filesystem://` transport from (Celery's `broker_transport`)."""

FILESYSTEM_FOLDER_OPTIONS = {
    "data_folder_in": "queue",
    "data_folder_out": "queue",
    "processed_folder": "processed",
    "control_folder": "control",
    "failed_folder": "failed",
}
"""Each kombu transport option of a `filesystem://` broker that names a folder, and that
folder's name under the broker directory."""


def broker_transport_options(broker_url: str, broker_dir: Path | None) -> dict[str, object]:
    """Transport options for `broker_url`: the folders of a `filesystem://` broker (created),
    else none. ValueError for a `filesystem://` broker without a directory."""
    if not broker_url.startswith("filesystem://"):
        return {}
    if broker_dir is None:
        raise ValueError("a filesystem:// broker needs a broker directory")
    folders = {
        option: Path(broker_dir) / name for option, name in FILESYSTEM_FOLDER_OPTIONS.items()
    }
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return {
        **{option: str(folder) for option, folder in folders.items()},
        "store_processed": False,
    }


def broker_transport(broker_url: str) -> str | None:
    """The kombu transport for `broker_url` (Celery's `broker_transport`): None keeps the URL's."""
    if broker_url.startswith("filesystem://"):
        return FILESYSTEM_TRANSPORT
    return None
