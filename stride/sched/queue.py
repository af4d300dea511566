"""The waiting queue: requests ranked by slack (deadline - now), bounded in requests and tokens.

Slack ranking is by deadline alone (``now`` is common to every entry), so a heap keyed on
(deadline, arrival order) gives the order without re-sorting each step. A request's deadline does not
change while it waits. Aborted entries are dropped lazily (when they reach the head) but leave the
counts at once.
"""

from __future__ import annotations

import heapq

from stride.sched.request import Request, RequestStatus


class WaitingQueue:
    """Waiting requests, most urgent first. The bound applies to new arrivals only: a preempted
    sequence always goes back in (refusing it would drop a request already accepted)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._heap: list[tuple[float, int, Request]] = []
        self._members: dict[str, Request] = {}
        self.num_tokens = 0
        """Tokens the waiting requests would have to (re)compute at most (prompt + output)."""

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._members

    def refusal(self, num_tokens: int) -> str | None:
        """Why a new request of ``num_tokens`` would be refused now (None: it fits)."""
        if len(self._members) >= self.max_requests:
            return "queue_full"
        if self.num_tokens + num_tokens > self.max_tokens:
            return "overloaded"
        return None

    def push(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._heap, (req.deadline, req.seq_no, req))
        self._members[req.req_id] = req
        self.num_tokens += req.num_tokens

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the counts; its heap entry is skipped when it surfaces."""
        if self._members.get(req.req_id) is not req:
            return
        del self._members[req.req_id]
        self.num_tokens -= req.num_tokens

    def peek(self) -> Request | None:
        """The most urgent waiting request (least slack), or None."""
        heap = self._heap
        while heap:
            req = heap[0][2]
            if self._members.get(req.req_id) is req:
                return req
            heapq.heappop(heap)
        return None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self.remove(req)
        return req
