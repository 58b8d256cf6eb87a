"""Control-plane benchmark: placement and reconciliation time against the queue's length."""
