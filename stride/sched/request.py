"""One request's scheduling state: its tokens, its service class and deadline, where it runs.

The scheduler owns every :class:`Request`; nothing else mutates one. Times are logical seconds passed in
by the caller (the scheduler process reads the clock once per step), never read here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stride.config import ServiceClass
from stride.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    """In the waiting queue: new, or preempted (its tokens kept, its blocks released)."""
    RUNNING = "running"
    """Holds a slot and blocks for all of its tokens; prefilling or decoding."""
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence as the scheduler sees it. ``num_computed_tokens`` counts tokens whose KV has been
    scheduled (written by a step already sent); the rest of :attr:`token_ids` still has to run."""

    req_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    service_class: ServiceClass
    arrival_time: float
    seq_no: int
    """Arrival order; breaks ties so every ranking is deterministic."""
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int = -1
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission (reported to the client)."""
    num_preemptions: int = 0
    deadline: float = 0.0
    """When the next thing this request waits for is due: its first token (arrival + TTFT target)
    until it has one, then its next token (last token + ITL target)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    max_len: int = 0
    """Total tokens (prompt + output) at which the request ends with ``length``."""

    def __post_init__(self) -> None:
        self.deadline = self.arrival_time + self.service_class.ttft_ms / 1000.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def record_token(self, token_id: int, now: float) -> None:
        """Append a sampled token; the next one is due one ITL target later."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.deadline = now + self.service_class.itl_ms / 1000.0

    def slack(self, now: float) -> float:
        return self.deadline - now
