"""Weight and KV-cache storage formats, with what they really cost in bytes.

A quantized format is never "4 bits per weight": every group of ``group_size`` weights along a row also
stores its scale (and, for asymmetric formats, a zero point or minimum). That overhead is what separates
4.0 from 4.16 (W4A16, group 128) or 4.5 (GGUF Q4_0) bits per weight, and over a 405B model it is gigabytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    """How one 2-D weight matrix is stored.

    Quantized formats apply to the linear layers of the decoder blocks. ``quantize_embeddings`` says
    whether the token embedding and output projection use the format too (GGUF files do; GPTQ/AWQ and FP8
    checkpoints keep them in 16-bit). Norm weights always stay in ``norm_bytes`` per element.
    """

    name: str
    """Name as given to ``--weights``."""
    bits: int
    """Bits per stored weight value."""
    group_size: int = 0
    """Weights per scale group along a row; 0 means one scale per tensor (negligible, not counted)."""
    group_overhead_bits: int = 0
    """Bits each group adds: scale plus zero point / minimum."""
    row_overhead_bits: int = 0
    """Bits each output row adds (per-channel scales)."""
    quantize_embeddings: bool = False
    """Whether embeddings and the output projection are stored in this format (else 16-bit)."""
    norm_bytes: int = 2
    """Bytes per norm weight (GGUF keeps norms in float32)."""

    def __post_init__(self) -> None:
        if self.bits <= 0 or min(self.group_size, self.group_overhead_bits, self.row_overhead_bits) < 0:
            raise ValueError(f"bad weight format {self}")

    @property
    def bits_per_weight(self) -> float:
        """Effective bits per weight including group overhead (rows a multiple of the group; per-row
        overhead, under 0.01 bit for rows of 2k weights, left out)."""
        extra = self.group_overhead_bits / self.group_size if self.group_size else 0.0
        return self.bits + extra

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a ``rows × cols`` matrix quantized along its rows of ``cols`` weights.

        A partial last group still pays a whole group's overhead and is padded to the group size, as
        every block format does; each row is rounded up to whole bytes.
        """
        if not self.group_size:
            return -(-rows * (cols * self.bits + self.row_overhead_bits) // 8)
        groups_per_row = -(-cols // self.group_size)
        bits_per_group = self.group_size * self.bits + self.group_overhead_bits
        # packed zero points fill whole bytes only per row (GPTQ packs 8 per int32 along the row)
        return rows * -(-(groups_per_row * bits_per_group + self.row_overhead_bits) // 8)


BF16 = WeightFormat("bf16", bits=16, quantize_embeddings=True)
_FIXED: dict[str, WeightFormat] = {
    "bf16": BF16,
    "fp16": WeightFormat("fp16", bits=16, quantize_embeddings=True),
    # FP8 E4M3 with per-tensor scales (one float per matrix: not counted).
    "fp8": WeightFormat("fp8", bits=8),
    # W8A16 with one fp16 scale per output channel: a group is a whole row, so it is sized per matrix.
    "int8": WeightFormat("int8", bits=8, row_overhead_bits=16),
    # GGUF block formats: 32 weights per block. Q4_0: fp16 scale; Q4_1: fp16 scale + fp16 minimum;
    # Q8_0: fp16 scale. (ggml-common.h block_q4_0 / block_q4_1 / block_q8_0.)
    "gguf-q4_0": WeightFormat("gguf-q4_0", bits=4, group_size=32, group_overhead_bits=16,
                              quantize_embeddings=True, norm_bytes=4),
    "gguf-q4_1": WeightFormat("gguf-q4_1", bits=4, group_size=32, group_overhead_bits=32,
                              quantize_embeddings=True, norm_bytes=4),
    "gguf-q8_0": WeightFormat("gguf-q8_0", bits=8, group_size=32, group_overhead_bits=16,
                              quantize_embeddings=True, norm_bytes=4),
}
WEIGHT_FORMAT_NAMES: tuple[str, ...] = ("bf16", "fp16", "fp8", "int8", "w4a16", "gguf-q4_0", "gguf-q4_1",
                                        "gguf-q8_0")


def w4a16(group_size: int = 128) -> WeightFormat:
    """GPTQ/AWQ-style 4-bit weights: per group an fp16 scale and a packed 4-bit zero point (20 bits)."""
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"w4a16 group size must be a positive even number, got {group_size}")
    return WeightFormat(f"w4a16-g{group_size}", bits=4, group_size=group_size, group_overhead_bits=20)


def weight_format(name: str, group_size: int = 128) -> WeightFormat:
    """The format called ``name`` (one of :data:`WEIGHT_FORMAT_NAMES`); ``group_size`` applies to w4a16."""
    if name == "w4a16":
        return w4a16(group_size)
    try:
        return _FIXED[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(WEIGHT_FORMAT_NAMES)}") from None


# KV-cache element sizes. FP8 KV uses per-tensor scales (not counted).
KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1}


def kv_dtype_bytes(name: str) -> int:
    try:
        return KV_DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; known: {', '.join(KV_DTYPE_BYTES)}") from None
