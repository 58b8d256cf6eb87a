"""Celery tasks of the control plane: placement, reconciliation, metrics ingestion.

Tasks are thin (ids in, rows loaded, one service called), queued with `transaction.on_commit`,
and run by `celery -A config worker` (see config/celery.py for the broker and queues).
"""
