"""The Triton attention backend: the kernels of ``stride/kernels/paged_decode.py`` behind the worker's seam.

Imported only when the ``triton`` backend is asked for (``get_backend``), so a CPU-only process never loads
Triton, and never has ``kernels`` switch on the interpreter behind its back. On a machine without CUDA,
importing ``kernels`` turns on ``TRITON_INTERPRET`` and the same kernels run on CPU tensors (the CPU tests
compare this backend with the torch one that way).

K/V reach the cache from the fused RoPE launch (``Rope.rotate_into_cache``: the model layers run fused beside
this backend), with the bits the torch backend's ``write_kv`` (one index_put per tensor, inherited here) writes;
then ``paged_decode`` attends when every sequence of the step decodes (split-K over long contexts); in a step with
prefill chunks, ``paged_decode`` takes the decodes at its head and ``paged_extend`` the rest (run together, the
extend kernel read each decode's keys once per query head: a 255-decode step with a 1,793-token chunk spent 70 of
its 110 ms there on the H200). The step's maxima come from the host
(:class:`AttentionMetadata`), so nothing here waits on the device. On CUDA both launches take the autotuned
config of their shape bucket (:mod:`stride.workers.kernel_configs`), or the launcher's default where none is
cached.
"""

from __future__ import annotations

import torch

from stride.kernels.paged_decode import paged_decode
from stride.kernels.paged_extend import paged_extend
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
        configs = for_device(q.device)
        # Tuned decode configs are for caches in q's dtype (the tuner's problems); an 8-bit cache takes the launcher's
        # own default, made for it (paged_decode.default_decode_config), not one tuned over 16-bit caches.
        tuned_decode = k_cache.dtype == q.dtype
        if meta.max_query_len == 1:
            config = configs.decode(
                num_seqs, num_heads, num_kv_heads, head_dim, block_size, meta.max_context_len, q.dtype
            ) if tuned_decode else None
            return paged_decode(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len,
                config=config,
            )
        out = torch.empty_like(q)
        d, starts = meta.num_decodes, meta.query_start_loc
        if d:
            # The decodes at the step's head as a decode-only step: one program per KV head's group reads each
            # key once, where the extend kernel would read it once per head for a block of mostly masked rows.
            max_ctx = int(meta.context_lens_cpu[:d].max())
            paged_decode(
                q[:d], k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d], scale, max_ctx,
                config=configs.decode(d, num_heads, num_kv_heads, head_dim, block_size, max_ctx, q.dtype)
                if tuned_decode else None,
                out=out[:d],
            )
            assert meta.extend_start_loc is not None
            starts = meta.extend_start_loc
        config = configs.extend(
            num_seqs - d, num_heads, num_kv_heads, head_dim, block_size, meta.max_query_len,
            int(meta.context_lens_cpu[d:].max()) if d else meta.max_context_len, q.dtype,
        )
        paged_extend(
            q[d:],
            k_cache,
            v_cache,
            meta.block_tables[d:],
            starts,
            meta.context_lens[d:],
            scale,
            meta.max_query_len,
            config=config,
            out=out[d:],
        )
        return out
