"""The control plane's Celery side: thin tasks (placement, report ingestion, reconciliation,
the upload sweep) and the messaging to the hosts' queues.

Tasks take ids or messages and call one `api` service; every write is there. The messaging
(`workers.commands`) is the domain's `api.dispatch.HostDispatch`, registered at start-up, and
tasks run under `celery -A config worker` (see config/celery.py for the broker and queues).
"""
