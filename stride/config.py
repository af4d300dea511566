"""Configuration: frozen dataclasses, one per concern, each field documented and checked on construction.

A launch builds one :class:`StrideConfig` and hands each process the parts it needs (as JSON, never
pickle). Environment variables are read only through :mod:`stride.env`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stride import env


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


ATTENTION_BACKENDS = ("torch", "sdpa", "triton")
"""The attention backends a launch can name (:mod:`stride.workers.backends` builds them): ``torch`` the float32
reference, ``sdpa`` the reference with attention in the run dtype, ``triton`` the kernels."""

KV_DTYPES = ("auto", "fp8")
"""``--kv-dtype`` values: ``auto`` keeps K/V in the run dtype, ``fp8`` in float8_e4m3fn
(:data:`stride.workers.attention.FP8_KV`)."""

QUANTIZE_DEFAULT_GROUP = 128
"""Group of ``--quantize w4a16``: GPTQ's and AWQ's usual size; 0.53 bytes per weight with fp16 scales and mins."""


def quantize_group_size(spec: str) -> int:
    """The group size a ``--quantize`` value asks for, 0 for none: ``''``/``none``, ``w4a16`` (groups of
    :data:`QUANTIZE_DEFAULT_GROUP`) or ``w4a16-g<N>`` (N a power of two of at least 8). ``ValueError`` otherwise."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return 0
    if spec == "w4a16":
        return QUANTIZE_DEFAULT_GROUP
    if spec.startswith("w4a16-g") and spec[7:].isdigit():
        # the kernels' own rule (plain arithmetic), read only here
        from stride.kernels.w4a16_policy import is_group_size

        group = int(spec[7:])
        if is_group_size(group):
            return group
    raise ValueError(f"quantize must be 'none', 'w4a16' or 'w4a16-g<N>' (N a power of two, at least 8), got {spec!r}")


@dataclass(frozen=True)
class IpcConfig:
    """Where one launch's sockets and shared-memory segments live. Every address comes from here."""

    run_dir: str
    """Private runtime directory (mode 0700) holding this launch's ``ipc://`` socket files."""
    launch_id: str
    """Short random id that prefixes every shared-memory segment name of this launch."""

    def __post_init__(self) -> None:
        if not self.launch_id.isalnum():
            raise ValueError(f"launch_id must be alphanumeric, got {self.launch_id!r}")
        if not os.path.isabs(self.run_dir):
            raise ValueError(f"run_dir must be absolute, got {self.run_dir!r}")

    @staticmethod
    def new_launch_id() -> str:
        return secrets.token_hex(4)

    def address(self, name: str) -> str:
        """``ipc://`` address of the socket file ``name`` in this launch's runtime directory."""
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad socket name {name!r}")
        return f"ipc://{self.run_dir}/{name}.sock"

    def shm_name(self, name: str) -> str:
        """POSIX shared-memory name of segment ``name``; all segments of a launch share the prefix."""
        return f"{self.shm_prefix}{name}"

    @property
    def shm_prefix(self) -> str:
        return f"stride-{self.launch_id}-"

    # The design card's sockets, one bound address each (the binder is named in brackets).
    def frontend_address(self) -> str:
        """[frontend binds, PULL] text deltas from the tokenizer pool."""
        return self.address("frontend")

    def client_address(self) -> str:
        """[frontend binds, ROUTER] requests from :mod:`stride.client` (no HTTP)."""
        return self.address("client")

    def tokenizer_address(self, index: int) -> str:
        """[tokenizer ``index`` binds, PULL] new requests from the frontend, token outputs from the scheduler."""
        return self.address(f"tokenizer-{index}")

    def scheduler_address(self) -> str:
        """[scheduler binds, PULL] tokenized requests, aborts, step results from rank 0."""
        return self.address("scheduler")

    def worker_address(self) -> str:
        """[rank 0 binds, PULL] step descriptors from the scheduler."""
        return self.address("worker")

    def worker_rank_address(self, rank: int) -> str:
        """[rank ``rank`` > 0 binds, PULL] the step descriptors rank 0 passes on to the other ranks."""
        return self.address(f"worker-{rank}")

    def tp_rendezvous(self) -> str:
        """``torch.distributed`` init method of the launch's tensor-parallel ranks: a file in the private directory."""
        return f"file://{self.run_dir}/tp-rendezvous"

    def control_address(self) -> str:
        """[launcher binds, PULL] ready and failure reports from every process."""
        return self.address("control")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_runtime_root() -> str:
    return env.RUNTIME_ROOT.get() or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache as the scheduler sees it."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 640
    """Physical blocks in the pool on a CPU and with the simulated backend (a GPU worker sizes its pool with the
    planner from the memory it measures). 640 blocks of 16 are 10,240 tokens: the default model's whole 8,192-token
    context and 2,048 more, 236 MB of bf16 KV for it. The pool's pages become resident only as blocks are written,
    but cached blocks stay, so a served pool ends up whole; with 768 blocks the default model's worker passed 1 GB of
    RSS once it was (1,099 MB after 16 clients' 600-word prompts, against 997 MB with 640: docs/perf-log.md)."""
    enable_prefix_caching: bool = True
    """Share full blocks between requests of one tenant by content address."""
    check_invariants: bool = field(default_factory=env.CHECK_INVARIANTS.get_bool)
    """Cross-check the block manager's counts after every scheduler step (debug and test runs)."""

    def __post_init__(self) -> None:
        _positive(self, "block_size", "num_blocks")


@dataclass(frozen=True)
class ServiceClass:
    """A latency contract: a request of this class should see its first token within ``ttft_ms`` and
    each later token within ``itl_ms`` of the previous one."""

    name: str
    """Name used in the API field ``service_class``."""
    ttft_ms: float
    """Time-to-first-token target, milliseconds."""
    itl_ms: float
    """Inter-token latency target, milliseconds."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad service class name {self.name!r}")
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError(f"service class {self.name}: targets must be positive")


DEFAULT_SERVICE_CLASSES: tuple[ServiceClass, ...] = (
    ServiceClass("interactive", ttft_ms=500.0, itl_ms=100.0),
    ServiceClass("standard", ttft_ms=5_000.0, itl_ms=250.0),
    ServiceClass("background", ttft_ms=120_000.0, itl_ms=2_000.0),
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step and of the waiting queue."""

    max_num_seqs: int = 256
    """Most sequences running at once (rows of the block-table and batch arrays)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes plus prefill chunks."""
    max_model_len: int = 8192
    """Longest sequence (prompt plus output) in tokens."""
    max_waiting_requests: int = 1024
    """Waiting-queue bound in requests; past it a new request is rejected at once."""
    max_waiting_tokens: int = 1 << 20
    """Waiting-queue bound in prompt tokens."""
    service_classes: tuple[ServiceClass, ...] = DEFAULT_SERVICE_CLASSES
    """Known service classes; a request naming another is refused."""
    default_service_class: str = "standard"
    """Class of a request that names none."""
    trace_path: str = ""
    """Record every input and decision of the scheduler process to this JSON-lines file (``stride replay``);
    empty: no trace."""
    overlap: bool = True
    """Build and send the next step while one runs (its decodes take the running step's tokens on the device), so
    the worker never waits for the scheduler; off: one step in flight at a time."""

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                  "max_waiting_requests", "max_waiting_tokens")
        names = [c.name for c in self.service_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate service class names: {names}")
        if self.default_service_class not in names:
            raise ValueError(f"default service class {self.default_service_class!r} not in {names}")

    def service_class(self, name: str | None) -> ServiceClass:
        """The named class (the default when ``name`` is None); ``ValueError`` naming the known ones."""
        wanted = self.default_service_class if name is None else name
        for c in self.service_classes:
            if c.name == wanted:
                return c
        known = ", ".join(c.name for c in self.service_classes)
        raise ValueError(f"unknown service_class {wanted!r}; known: {known}")


def max_blocks_per_seq(sched: SchedulerConfig, cache: CacheConfig) -> int:
    """Columns of the block-table array: enough blocks for the longest sequence."""
    return -(-sched.max_model_len // cache.block_size)


HEARTBEAT_INTERVAL_S = 0.25
"""How often a serving rank tells the launcher it is alive."""


@dataclass(frozen=True)
class WorkerConfig:
    """What a rank worker loads and where it runs."""

    model: str = ""
    """HF checkpoint directory or GGUF file; empty means the default model (SmolLM2-135M-Instruct GGUF)."""
    tokenizer: str = ""
    """GGUF file or HF directory holding the tokenizer; empty means the model's own."""
    backend: str = "torch"
    """``torch`` (real model) or ``sim`` (simulated step times, deterministic tokens)."""
    device: str = field(default_factory=env.DEVICE.get)
    """``cpu`` or ``cuda``; empty picks CUDA when present."""
    dtype: str = ""
    """Run dtype (float32, bfloat16, float16); empty picks bfloat16 on CUDA and on a CPU with native bf16 (AVX-512
    BF16, AMX) or AVX2, float32 on other CPUs (``stride.workers.runner.resolve_device_dtype``)."""
    kv_dtype: str = "auto"
    """KV cache dtype: ``auto`` (the run dtype) or ``fp8`` (float8_e4m3fn: half a bf16 cache's bytes, so twice the
    blocks and half the decode attention's reads, each value rounded to 3 mantissa bits;
    :data:`stride.workers.attention.FP8_KV`)."""
    tensor_parallel_size: int = 1
    """Ranks (one process per GPU)."""
    gpu: str = "H100-SXM-80GB"
    """GPU name in the planner's catalog, for the simulated backend's cost model."""
    gpu_memory_utilization: float = 0.9
    """Share of the device memory the worker may use for weights, activations and KV cache."""
    num_gpu_blocks: int = 0
    """KV blocks of a CUDA worker's pool: 0 sizes it from the memory left (the planner's formula); a count is taken
    as it is, and refused at start where the memory left does not hold it (a smaller pool than memory allows: a GPU
    shared with other work, or preemption to be seen under a test load)."""
    seed: int = 0
    """Seed of the sampler's default generator."""
    num_threads: int = 0
    """CPU threads of the worker's torch ops; 0: one on a GPU (the host side of a step is bookkeeping, and a
    per-core thread team only contends with the launch's other processes: on an H200 serving an 8B at 256
    concurrent, the step cycle was 1.41x shorter with one), torch's default (one per core) on a CPU. On a small
    shared machine 1 can be much faster on the CPU too: the other processes of the launch need a core."""
    cuda_graphs: bool = True
    """Replay decode-only steps from CUDA graphs (CUDA with the Triton backend, dense models); False runs
    every step eagerly (``--enforce-eager``)."""
    quantize: str = ""
    """``w4a16`` or ``w4a16-g<N>``: quantise the checkpoint's projections to 4 bits at load, in groups of N inputs
    (128 by default), and run them on the W4A16 GEMM; empty or ``none``: as stored."""
    attention_backend: str = field(default_factory=env.ATTENTION_BACKEND.get)
    """``torch`` (the reference), ``sdpa`` (the reference with attention in the run dtype) or ``triton`` (the
    kernels); empty: triton on CUDA, sdpa elsewhere."""
    cpu_int4: bool = field(default_factory=env.CPU_INT4.get_bool)
    """On a CPU in bf16, projections whose weights lie on a 4-bit grid (a GGUF's Q4_1) also keep it packed, and small
    steps (up to 4 rows with native bf16, 64 where it is emulated) run on it (:mod:`stride.workers.cpu_int4`)."""
    cpu_int8_head: bool = field(default_factory=env.CPU_INT8_HEAD.get_bool)
    """On a CPU in bf16, the output projection also keeps an int8 copy with a scale per vocabulary row, and the same
    small steps compute their logits on it (:func:`stride.workers.cpu_int4.attach_head`)."""
    cpu_pack: bool = field(default_factory=env.CPU_PACK.get_bool)
    """On a CPU with native bf16, the bf16 projections whose plain weights no compiled step reads hold them in oneDNN's
    blocked layout instead, the output projection too (then without its int8 copy; a tied one once the embedding
    reads its Q8_0 rows): :func:`stride.workers.cpu_int4.pack_large_steps`."""
    cpu_compile: bool = field(default_factory=env.CPU_COMPILE.get_bool)
    """On a CPU, run decode steps of up to 64 sequences (dense models) through the decode step compiled ahead of time
    (:mod:`stride.workers.cpu_step`): built in the background at the first start (eager steps until it is ready) and
    cached; needs a C++ compiler."""
    w4a16: str = field(default_factory=env.W4A16.get)
    """Keep a GGUF's Q4 projections 4-bit on the W4A16 GEMM: ``1`` on, ``0`` off (dequantised to the run dtype);
    empty: on with the triton backend on CUDA."""
    pdl: bool = field(default_factory=env.PDL.get_bool)
    """Capture the decode graphs of up to 8 sequences with programmatic dependent launch (Hopper and later)."""
    autotune_cache: str = field(default_factory=env.AUTOTUNE_CACHE.get)
    """JSON file of autotuned kernel configurations; empty: ``~/.cache/stride/autotune.json``."""
    hang_timeout_s: float = 3.0
    """A serving rank that sends the launcher no heartbeat (every :data:`HEARTBEAT_INTERVAL_S`) for this long is
    taken as hung (stopped, or stuck holding the interpreter): the launcher kills it and ends the launch, so its
    peers are not left waiting in a collective (``--rank-hang-timeout``)."""

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel_size")
        if self.hang_timeout_s <= 2 * HEARTBEAT_INTERVAL_S:
            raise ValueError(f"hang_timeout_s must exceed two heartbeats ({2 * HEARTBEAT_INTERVAL_S} s)")
        if self.attention_backend not in ("", *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} or empty, "
                             f"got {self.attention_backend!r}")
        if self.w4a16.strip().lower() not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
            raise ValueError(f"w4a16 must be '1', '0' or empty, got {self.w4a16!r}")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        if self.backend not in ("torch", "sim"):
            raise ValueError(f"backend must be 'torch' or 'sim', got {self.backend!r}")
        if self.device not in ("", "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_gpu_blocks < 0:
            raise ValueError(f"num_gpu_blocks must be 0 (from memory) or positive, got {self.num_gpu_blocks}")
        quantize_group_size(self.quantize)  # ValueError for a value it does not know


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP frontend and the tokenizer pool."""

    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = 8000
    """Port the HTTP server listens on."""
    tokenizer_workers: int = 2
    """Processes in the tokenizer pool."""
    api_keys_file: str = ""
    """File of ``KEY TENANT`` lines; empty means no auth and a single tenant."""
    model_name: str = ""
    """Name served under ``/v1/models``; empty derives it from the model path."""
    retry_after_s: int = 1
    """``Retry-After`` seconds sent with 429/503 refusals."""
    max_body_bytes: int = 8 << 20
    """Largest HTTP request body and client-library frame; a larger one is refused (413 / an error reply)
    before it is decoded."""
    max_prompt_chars: int = 0
    """Most characters of a prompt (a chat's message contents together), refused before tokenizing; 0:
    :data:`PROMPT_CHARS_PER_TOKEN` per token of the context, which no prompt that fits the context exceeds."""

    def __post_init__(self) -> None:
        _positive(self, "tokenizer_workers", "retry_after_s", "max_body_bytes")
        if self.max_prompt_chars < 0:
            raise ValueError("max_prompt_chars must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.api_keys_file and not Path(self.api_keys_file).is_file():
            raise ValueError(f"api keys file not found: {self.api_keys_file}")

    def prompt_char_limit(self, max_model_len: int) -> int:
        """:attr:`max_prompt_chars`, or its default for a context of ``max_model_len`` tokens."""
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


PROMPT_CHARS_PER_TOKEN = 16
"""Bounds the prompt's characters per token of context by default: English averages about 4 characters per token and
code about 3; a prompt past 16 per token of the whole context is not one that fits it."""


@dataclass(frozen=True)
class LaunchFacts:
    """What a launch learns from the processes it starts first (the tokenizer pool, rank 0), handed to the ones it
    starts after them (scheduler, frontend). Empty until then."""

    vocab_size: int = 0
    """Rows of the model's embedding and output head: token ids from a client must be below it (0: not known)."""
    eos_token_ids: tuple[int, ...] = ()
    """The tokenizer's end-of-sequence ids."""

    def __post_init__(self) -> None:
        if self.vocab_size < 0:
            raise ValueError("vocab_size must be >= 0")


@dataclass(frozen=True)
class StrideConfig:
    """Everything one launch needs; each process receives it as JSON."""

    ipc: IpcConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    worker: WorkerConfig = WorkerConfig()
    server: ServerConfig = ServerConfig()
    facts: LaunchFacts = LaunchFacts()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> StrideConfig:
        sched = dict(data["scheduler"])
        sched["service_classes"] = tuple(ServiceClass(**c) for c in sched["service_classes"])
        facts = data.get("facts") or dataclasses.asdict(LaunchFacts())
        return StrideConfig(
            ipc=IpcConfig(**data["ipc"]),
            cache=CacheConfig(**data["cache"]),
            scheduler=SchedulerConfig(**sched),
            worker=WorkerConfig(**data["worker"]),
            server=ServerConfig(**data["server"]),
            facts=LaunchFacts(vocab_size=facts["vocab_size"], eos_token_ids=tuple(facts["eos_token_ids"])),
        )
