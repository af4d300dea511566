"""Every wire message, grouped by the process that receives it.

Messages carry small control records (ids, offsets, lengths, step numbers). Per-step token ids, positions,
block tables and sampled ids live in shared memory (:mod:`stride.ipc.layouts`); a step message only names
the step. A prompt's token ids travel once, when the request enters the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stride.ipc.codec import Decoder, Message
from stride.params import Constraint, SamplingParams

# ---------------------------------------------------------------- to the tokenizer pool


@dataclass(frozen=True)
class GenerateRequest(Message):
    """Frontend → tokenizer: one sequence to generate. Exactly one of ``prompt``, ``prompt_token_ids``
    and ``messages`` is set."""

    TAG = "generate"
    req_id: str
    tenant: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    service_class: str | None = None
    add_generation_prompt: bool = True
    constraint: Constraint | None = None
    """What the output must match (structured outputs); compiled by the tokenizer into ``grammar``."""
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call, rendered into the chat prompt (OpenAI's ``tools``, checked)."""


@dataclass(frozen=True)
class TokenOutput:
    """New tokens of one request in one step (scheduler → tokenizer, inside :class:`StepOutputs`)."""

    req_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``stop`` (EOS or stop token), ``length``, ``abort`` or ``error``; None while running."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    """Log-probability of each token in ``token_ids`` (when asked for)."""
    top_logprobs: list[list[list[float]]] | None = None
    """Per token, the top alternatives as ``[token_id, logprob]`` pairs (when asked for)."""
    error: str | None = None


@dataclass(frozen=True)
class StepOutputs(Message):
    """Scheduler → tokenizer ``i``: this step's outputs for the requests that tokenizer owns."""

    TAG = "step_outputs"
    outputs: list[TokenOutput]


@dataclass(frozen=True)
class ReleaseRequest(Message):
    """Scheduler → tokenizer: forget a request's detokenizer state (the scheduler refused it)."""

    TAG = "release"
    req_id: str


@dataclass(frozen=True)
class AbortRequest(Message):
    """Frontend → tokenizer → scheduler: stop a request and free what it holds (client gone); tokenizer →
    scheduler also for a stop string. The frontend sends it to the tokenizer it sent the request to, which passes
    it on, so it reaches the scheduler after the request, wherever the request was when it was sent."""

    TAG = "abort"
    req_id: str
    reason: str = "abort"


TO_TOKENIZER = (GenerateRequest, StepOutputs, ReleaseRequest, AbortRequest)

# ---------------------------------------------------------------- to the scheduler


@dataclass(frozen=True)
class TokenizedRequest(Message):
    """Tokenizer → scheduler: a request ready to schedule; its outputs go back to ``tokenizer_index``."""

    TAG = "tokenized"
    req_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer_index: int
    service_class: str | None = None
    grammar: str | None = None
    """The llguidance grammar its output is held to (compiled and checked by the tokenizer), or None."""


@dataclass(frozen=True)
class SequenceFailure:
    """One sequence the worker could not serve in a step (its sampling state could not be set up, say)."""

    req_id: str
    error: str


@dataclass(frozen=True)
class StepDone(Message):
    """Rank 0 → scheduler: step ``step`` ran; its sampled ids are in the step-output segment. ``error``: the
    step as a whole failed (the launch ends); ``failed``: sequences that failed alone (their rows sampled
    nothing; the scheduler ends them with an error and the rest of the batch goes on)."""

    TAG = "step_done"
    step: int
    error: str | None = None
    failed: list[SequenceFailure] = field(default_factory=list)
    worker_s: float = 0.0
    """Rank 0's wall time on the step, from taking the descriptor (or, with early launch, from answering the step
    before, if that came later) to answering."""
    device_s: float = 0.0
    """Of that, the device's span (CUDA events around the forward and the sampling; on the CPU the same as
    ``worker_s`` less the message handling)."""
    graphed: bool = False
    """The forward replayed a decode graph, or on a CPU ran the compiled decode step (else it ran eagerly: a step
    with prefill, or past the graphs' or the compiled step's sizes)."""
    early: bool = False
    """Launched before the step before it was reported, its placeholder tokens taken on the device (early launch:
    the device did not wait for rank 0's host side between the two)."""


TO_SCHEDULER = (TokenizedRequest, AbortRequest, StepDone)

# ---------------------------------------------------------------- to rank workers


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker has not seen: its slot and sampling parameters (sent once)."""

    slot: int
    req_id: str
    params: SamplingParams
    prompt_len: int


@dataclass(frozen=True)
class StepDescriptor(Message):
    """Scheduler → rank 0: run step ``step``. Batch layout, token ids, positions and block tables are in
    shared memory; this message carries only counts and the changes since the last step."""

    TAG = "step"
    step: int
    num_seqs: int
    num_tokens: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    finished_slots: list[int] = field(default_factory=list)
    """Slots whose sequences ended since the last step (the worker drops their sampler state)."""
    masked_rows: list[int] = field(default_factory=list)
    """Rows (indices into this step's sequences) that sample under a token bitmask (structured outputs). Their
    masks are written after this descriptor is sent; rank 0 waits for :class:`MasksReady` before sampling."""
    bank: int = 0
    """Which bank of the step arrays holds this step (:mod:`stride.ipc.layouts`)."""
    ahead: bool = False
    """Built while step ``step - 1`` ran: an input token ``-1 - r`` is the token that step's row ``r`` samples."""


@dataclass(frozen=True)
class MasksReady(Message):
    """Scheduler → rank 0: the bitmask rows of step ``step``'s ``masked_rows`` are written."""

    TAG = "masks_ready"
    step: int


@dataclass(frozen=True)
class Shutdown(Message):
    """Launcher or scheduler → any process: finish what is in hand and exit."""

    TAG = "shutdown"
    reason: str = ""


TO_WORKER = (StepDescriptor, MasksReady, Shutdown)

# ---------------------------------------------------------------- to the frontend


@dataclass(frozen=True)
class TextDelta(Message):
    """Tokenizer → frontend: the next piece of one request's text (UTF-8-safe), and the end when it ends."""

    TAG = "delta"
    req_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    """Per token: ``{"token", "logprob", "bytes", "top_logprobs"}`` (OpenAI chat shape)."""


@dataclass(frozen=True)
class TextDeltas(Message):
    """Tokenizer → frontend: the deltas of one step's outputs, every request of this tokenizer's at once (one
    message per step per tokenizer, not one per request)."""

    TAG = "deltas"
    deltas: list[TextDelta]


@dataclass(frozen=True)
class RequestFailed(Message):
    """Any process → frontend: a request cannot be served; ``status`` is the HTTP status to answer with."""

    TAG = "failed"
    req_id: str
    status: int
    message: str
    code: str = ""


@dataclass(frozen=True)
class SchedulerStats(Message):
    """Scheduler → frontend, now and then: gauges the frontend exports on ``/metrics``."""

    TAG = "sched_stats"
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_blocks_live: int = 0
    num_blocks_cached: int = 0
    num_blocks_free: int = 0
    num_preemptions: int = 0
    """Preemptions since the scheduler started (a running total, exported as a counter)."""
    steps: int = 0
    """The step timeline, running totals (:class:`stride.sched.stats.StepTimeline`): steps answered, and seconds
    of the device, of rank 0, of the round trip (descriptor sent to answer back) and of the scheduler's gap
    (answer back to the next descriptor sent, when there was a next)."""
    step_device_s: float = 0.0
    step_worker_s: float = 0.0
    step_round_trip_s: float = 0.0
    step_gap_s: float = 0.0
    graph_steps: int = 0
    """Of the steps, those whose forward replayed a decode graph, and their device seconds."""
    graph_step_device_s: float = 0.0
    early_steps: int = 0
    """Of the steps, those launched early (:attr:`StepDone.early`)."""
    grammars_built: int = 0
    """Structured outputs: grammars the scheduler built into a matcher (each distinct one once while it is kept)."""


TO_FRONTEND = (TextDelta, TextDeltas, RequestFailed, SchedulerStats)
"""A ``RequestFailed`` with code ``worker_dead`` also turns ``/health`` unhealthy; with an empty ``req_id``
it fails every request in flight."""

# ---------------------------------------------------------------- to and from the client library


@dataclass(frozen=True)
class ClientGenerate(Message):
    """:mod:`stride.client` → frontend (DEALER → ROUTER at ``client_address``): one sequence to generate.

    ``req_id`` is the client's own (unique per connection). Exactly one of ``prompt``, ``prompt_token_ids``
    and ``messages`` is set. ``params`` uses the OpenAI field names (``max_tokens``, ``temperature``,
    ``stop``, ``seed``, ``logprobs`` as an int, ``service_class``...) and is validated like an HTTP body."""

    TAG = "client_generate"
    req_id: str
    api_key: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientAbort(Message):
    """:mod:`stride.client` → frontend: stop one of this connection's requests."""

    TAG = "client_abort"
    req_id: str


TO_CLIENT_SERVER = (ClientGenerate, ClientAbort)


@dataclass(frozen=True)
class ClientOutput(Message):
    """Frontend → :mod:`stride.client`: the next piece of a request (like :class:`TextDelta`), or its
    failure (``status`` != 200, ``error`` set; always the last message of that request)."""

    TAG = "client_output"
    req_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    status: int = 200
    error: str | None = None


TO_CLIENT = (ClientOutput,)

# ---------------------------------------------------------------- to the launcher


@dataclass(frozen=True)
class ProcessReady(Message):
    """Any process → launcher: started and serving, with what it learned that the launcher shows or passes on to
    the processes it starts later (each role fills its own fields; the rest keep their defaults)."""

    TAG = "ready"
    role: str
    index: int = 0
    num_blocks: int = 0
    """Rank 0: KV blocks it sized (on a GPU from measured free memory); the scheduler: the pool it manages."""
    vocab_size: int = 0
    """Rank 0: rows of the model's embedding; a tokenizer: its own vocabulary."""
    eos_token_ids: list[int] = field(default_factory=list)
    """A tokenizer: the model's end-of-sequence ids."""
    port: int = 0
    """The frontend: the HTTP port it bound."""
    model: str = ""
    """The frontend: the model name it serves."""


@dataclass(frozen=True)
class Progress(Message):
    """Any process → launcher: a step of a long start (weights loading)."""

    TAG = "progress"
    role: str
    message: str
    fraction: float = 0.0


@dataclass(frozen=True)
class ProcessFailed(Message):
    """Any process → launcher: it cannot go on; the launcher shuts the launch down."""

    TAG = "process_failed"
    role: str
    error: str
    index: int = 0


@dataclass(frozen=True)
class Heartbeat(Message):
    """A serving rank → launcher, every ``HEARTBEAT_INTERVAL_S``: alive, and its interpreter runs."""

    TAG = "heartbeat"
    role: str
    index: int = 0


TO_LAUNCHER = (ProcessReady, Progress, ProcessFailed, Heartbeat)

ALL_MESSAGES = tuple(dict.fromkeys(TO_TOKENIZER + TO_SCHEDULER + TO_WORKER + TO_FRONTEND + TO_LAUNCHER
                                   + TO_CLIENT_SERVER + TO_CLIENT))


def decoder_for(classes: tuple[type[Message], ...]) -> Decoder[Message]:
    return Decoder(classes)
