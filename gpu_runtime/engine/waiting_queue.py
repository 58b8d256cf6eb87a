"""The scheduler's waiting queue: admission order fair across tenants.

Requests wait in two groups, walked in this order:

1. preempted requests, most recently preempted first (they already ran: recomputing them
   comes before anything new, as under FCFS);
2. new requests, one at a time from each tenant in turn (round-robin over the tenants that
   have a request waiting, each tenant's own requests in arrival order).

A tenant joins the end of the rotation when its first request arrives and leaves it when it has
none waiting. Admitting the first request of the order moves its tenant to the end of the
rotation, so the order after it is the order before it less that request: a step that admits
several requests takes a prefix of the order, and the next step goes on where it stopped.

Bound: a request that arrives while `m` other tenants have requests waiting has at most `m`
new requests ahead of it (one of each), plus the preempted ones, whatever the size of the
others' queues; under FIFO it would have every request queued before it ahead of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from gpu_runtime.engine.request import Request


class WaitingQueue:
    """Waiting and preempted requests in admission order (see the module docstring). Plain
    Python, O(1) per add and per admission; iterating walks the order lazily."""

    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()
        self._by_tenant: dict[str, deque[Request]] = {}
        self._rotation: deque[str] = deque()
        """Tenants with new requests waiting; the first one's turn is next."""
        self._members: set[Request] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __contains__(self, request: object) -> bool:
        return request in self._members

    def __iter__(self) -> Iterator[Request]:
        """The admission order: preempted requests, then new ones round-robin by tenant."""
        yield from self._preempted
        queues = [iter(self._by_tenant[tenant]) for tenant in self._rotation]
        while queues:
            still = []
            for queue in queues:
                request = next(queue, None)
                if request is not None:
                    yield request
                    still.append(queue)
            queues = still

    def add(self, request: Request) -> None:
        """Queue a new request behind its tenant's others (`request.tenant`)."""
        queue = self._by_tenant.get(request.tenant)
        if queue is None:
            queue = self._by_tenant[request.tenant] = deque()
            self._rotation.append(request.tenant)
        queue.append(request)
        self._members.add(request)

    def add_preempted(self, request: Request) -> None:
        """Queue a preempted request ahead of everything (the latest preempted first)."""
        self._preempted.appendleft(request)
        self._members.add(request)

    def pop_first(self) -> Request:
        """Take the first request of the admission order (IndexError when empty); its tenant's
        turn passes to the next tenant."""
        if self._preempted:
            request = self._preempted.popleft()
        else:
            tenant = self._rotation.popleft()
            queue = self._by_tenant[tenant]
            request = queue.popleft()
            if queue:
                self._rotation.append(tenant)
            else:
                del self._by_tenant[tenant]
        self._members.discard(request)
        return request

    def remove(self, request: Request) -> None:
        """Take `request` out wherever it waits (ValueError when it does not); the rotation's
        order is kept."""
        if request not in self._members:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        self._members.discard(request)
        if request in self._preempted:
            self._preempted.remove(request)
            return
        queue = self._by_tenant[request.tenant]
        queue.remove(request)
        if not queue:
            del self._by_tenant[request.tenant]
            self._rotation.remove(request.tenant)
