"""The Triton attention backend: the kernels of ``kernels/paged_decode.py`` behind the worker's seam.

Imported only when the ``triton`` backend is asked for (``get_backend``), so a CPU-only process never loads
Triton, and never has ``kernels`` switch on the interpreter behind its back. On a machine without CUDA,
importing ``kernels`` turns on ``TRITON_INTERPRET`` and the same kernels run on CPU tensors (the CPU tests
compare this backend with the torch one that way).

K/V reach the cache from the fused RoPE launch (``Rope.rotate_into_cache``: the model layers run fused beside
this backend), with the bits the torch backend's ``write_kv`` (one index_put per tensor, inherited here) writes;
then one launch attends: ``paged_decode`` when every sequence of the step decodes (split-K over long contexts),
``paged_extend`` otherwise (prefill chunks and decode rows together). The step's maxima come from the host
(:class:`AttentionMetadata`), so nothing here waits on the device. On CUDA both launches take the autotuned
config of their shape bucket (:mod:`stride.workers.kernel_configs`), or the launcher's default where none is
cached.
"""

from __future__ import annotations

import torch

from kernels.paged_decode import paged_decode
from kernels.paged_extend import paged_extend
from stride.workers.attention import AttentionMetadata, TorchPagedAttention
from stride.workers.kernel_configs import for_device


class TritonPagedAttention(TorchPagedAttention):
    """Attends with the Triton kernels; K/V come from the fused RoPE launch (``write_kv`` is the reference's)."""

    name = "triton"
    fused_layers = True
    """The model layers use the fused RMSNorm(+residual), RoPE and SiLU-mul kernels alongside this backend."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_seqs, (block_size, num_kv_heads) = meta.context_lens.shape[0], k_cache.shape[1:3]
        if meta.max_query_len == 1:
            config = for_device(q.device).decode(
                num_seqs, num_heads, num_kv_heads, head_dim, block_size, meta.max_context_len, q.dtype
            )
            return paged_decode(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len,
                config=config,
            )
        config = for_device(q.device).extend(
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, meta.max_query_len, meta.max_context_len, q.dtype
        )
        return paged_extend(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            scale,
            meta.max_query_len,
            config=config,
        )
