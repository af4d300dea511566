"""Paged attention against dense attention, chunked prefill against one-shot, mixed batches against
sequences run alone (CPU, float32); in bf16/fp16, attention is the float32 result rounded once."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from worker_helpers import make_runner

from stride.workers import attention
from stride.workers.attention import FP8_KV, AttentionMetadata, SdpaPagedAttention, TorchPagedAttention
from stride.workers.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """float64 softmax attention of q (L, H, D) over k/v (S, KVH, D), key j visible to a query at position p
    when j <= p. Written independently of the backend (repeat KV heads, explicit mask)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def _paged_case(seed: int, ctx_lens: list[int], q_lens: list[int], block_size: int = 16):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 6, 2, 32
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous physical blocks
    tables = torch.full((len(ctx_lens), max(need) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    full_k = [torch.randn(c, kv_heads, dim, generator=gen) for c in ctx_lens]
    full_v = [torch.randn(c, kv_heads, dim, generator=gen) for c in ctx_lens]
    backend = TorchPagedAttention()
    # Earlier tokens are already cached (written by an earlier "step"); this step writes the last q_lens.
    prior_q = [c - q for c, q in zip(ctx_lens, q_lens, strict=True)]
    if any(prior_q):
        idx = [i for i, p in enumerate(prior_q) if p]
        pos = torch.cat([torch.arange(prior_q[i]) for i in idx])
        lens = np.array([prior_q[i] for i in idx])
        meta = AttentionMetadata.build(pos, lens, lens, tables[idx], block_size)
        backend.write_kv(torch.cat([full_k[i][: prior_q[i]] for i in idx]),
                         torch.cat([full_v[i][: prior_q[i]] for i in idx]), k_cache, v_cache, meta)
    pos = torch.cat([torch.arange(p, c) for p, c in zip(prior_q, ctx_lens, strict=True)])
    meta = AttentionMetadata.build(pos, np.array(q_lens), np.array(ctx_lens), tables, block_size)
    backend.write_kv(torch.cat([k[p:] for k, p in zip(full_k, prior_q, strict=True)]),
                     torch.cat([v[p:] for v, p in zip(full_v, prior_q, strict=True)]), k_cache, v_cache, meta)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    scale = dim**-0.5
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    expected = torch.cat([dense_attention(q[starts[i]:starts[i + 1]], full_k[i], full_v[i],
                                          pos[starts[i]:starts[i + 1]], scale) for i in range(len(ctx_lens))])
    return backend, q, k_cache, v_cache, meta, scale, expected


def test_metadata_counts_the_decodes_at_a_mixed_steps_head() -> None:
    def build(q_lens: list[int]) -> AttentionMetadata:
        ctx = np.array(q_lens) + 3
        pos = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx, strict=True)])
        return AttentionMetadata.build(pos, np.array(q_lens), ctx, torch.zeros(len(q_lens), 4, dtype=torch.int32), 4)

    mixed = build([1, 1, 5, 1, 3])
    assert mixed.num_decodes == 2 and mixed.extend_start_loc is not None
    assert mixed.extend_start_loc.tolist() == [0, 5, 6, 9]  # the chunks' rows, from 0
    assert mixed.query_start_loc.tolist() == [0, 1, 2, 7, 8, 11]
    # Decode-only steps, and steps that do not lead with a decode, are not split.
    for q_lens in ([1, 1, 1], [5, 1, 1], [4]):
        meta = build(q_lens)
        assert meta.num_decodes == 0 and meta.extend_start_loc is None, q_lens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_equals_dense_over_shuffled_blocks(seed: int) -> None:
    # Decodes (q_len 1) up to 64 pages, a prefill chunk on a cached prefix, a fresh prefill, odd lengths.
    ctx_lens = [1024, 1, 17, 300, 64 * 16 - 5, 40]
    q_lens = [1, 1, 1, 33, 1, 40]
    backend, q, k_cache, v_cache, meta, scale, expected = _paged_case(seed, ctx_lens, q_lens)
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    assert (out.double() - expected).abs().max().item() <= 1e-5


def test_paged_attention_notices_a_wrong_block_table() -> None:
    # Negative control: one table entry pointing at another sequence's block must change the output.
    # (Swapping two entries of one table would not: without RoPE, attention over fully visible keys is
    # order-invariant.)
    backend, q, k_cache, v_cache, meta, scale, expected = _paged_case(0, [300, 200], [1, 10])
    tables = meta.block_tables.clone()
    tables[0, 5] = tables[1, 0]
    meta.block_tables = tables
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    assert (out.double() - expected).abs().max().item() > 1e-2


def test_the_traceable_decode_step_equals_dense_attention() -> None:
    """AttentionMetadata.decode_only (the compiled CPU step's, built from tensors alone): the step's K/V written at
    the slots its positions name, and attention over whole blocks, masked past each context, equal to dense
    attention; other blocks (a negative control) are not."""
    gen = torch.Generator().manual_seed(4)
    block_size, heads, kv_heads, dim = 16, 6, 2, 32
    ctx_lens = [1, 17, 300, 64]
    nb = max(-(-c // block_size) for c in ctx_lens)
    blocks = torch.randperm(len(ctx_lens) * nb + 3, generator=gen)[: len(ctx_lens) * nb].view(len(ctx_lens), nb)
    k_cache = torch.zeros(len(ctx_lens) * nb + 3, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    full_k = [torch.randn(c, kv_heads, dim, generator=gen) for c in ctx_lens]
    full_v = [torch.randn(c, kv_heads, dim, generator=gen) for c in ctx_lens]
    for i, c in enumerate(ctx_lens):  # the earlier tokens, cached by earlier steps
        for j in range(c - 1):
            k_cache[blocks[i, j // block_size], j % block_size] = full_k[i][j]
            v_cache[blocks[i, j // block_size], j % block_size] = full_v[i][j]
    positions = torch.tensor(ctx_lens) - 1
    meta = AttentionMetadata.decode_only(positions, blocks, block_size)
    backend = TorchPagedAttention()
    backend.write_kv(torch.stack([k[-1] for k in full_k]), torch.stack([v[-1] for v in full_v]), k_cache, v_cache, meta)
    q = torch.randn(len(ctx_lens), heads, dim, generator=gen)
    expected = torch.cat([dense_attention(q[i : i + 1], full_k[i], full_v[i], positions[i : i + 1], dim**-0.5)
                          for i in range(len(ctx_lens))])
    out = backend.attend(q, k_cache, v_cache, meta, dim**-0.5)
    assert (out.double() - expected).abs().max().item() <= 1e-5
    wrong = AttentionMetadata.decode_only(positions, blocks.flip(0), block_size)
    assert (backend.attend(q, k_cache, v_cache, wrong, dim**-0.5).double() - expected).abs().max().item() > 1e-2


def sdpa_16bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
               exact: bool = True):
    """The reference's attention as it was: SDPA in the run dtype, which rounds inside (negative control)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=allowed[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_attention_is_float32_rounded_once(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Decodes over up to 64 pages and prefill chunks; the float32 path is checked against dense attention
    # above, so a 16-bit run that equals it rounded once is exact up to that rounding.
    ctx_lens, q_lens = [1024, 1, 17, 300, 64 * 16 - 5, 40], [1, 1, 1, 33, 1, 40]
    backend, q, k_cache, v_cache, meta, scale, _ = _paged_case(0, ctx_lens, q_lens)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    want = backend.attend(q.float(), k_cache.float(), v_cache.float(), meta, scale).to(dtype)
    got = backend.attend(q, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype and torch.equal(got, want)
    # Negative control: a 16-bit SDPA (rounding inside) leaves far more than 1% of the elements different
    # (about a third, measured on this CPU).
    monkeypatch.setattr(attention, "_sdpa", sdpa_16bit)
    inside = backend.attend(q, k_cache, v_cache, meta, scale)
    assert (inside == want).double().mean().item() < 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_sdpa_backend_is_the_reference_in_the_run_dtype(dtype: torch.dtype) -> None:
    # Decodes (grouped heads, one query each) and prefill chunks, as above: within a few 16-bit roundings of the
    # float32 reference, yet not the reference's once-rounded result (it does round inside), and the reference
    # itself when the run dtype is float32.
    ctx_lens, q_lens = [1024, 1, 17, 300, 64 * 16 - 5, 40], [1, 1, 1, 33, 1, 40]
    reference, q, k_cache, v_cache, meta, scale, _ = _paged_case(0, ctx_lens, q_lens)
    fast = SdpaPagedAttention()
    exact = reference.attend(q, k_cache, v_cache, meta, scale)
    assert torch.equal(fast.attend(q, k_cache, v_cache, meta, scale), exact)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    want = reference.attend(q, k_cache, v_cache, meta, scale)
    got = fast.attend(q, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(0.25)
    assert ((got.float() - want.float()).abs() <= 4 * ulp).all()
    assert (got == want).double().mean().item() < 0.99
    # An 8-bit cache (V stored keys-inner, as stride/workers/kv_cache.py lays it out): its values are exact in the
    # run dtype, so the same bound holds.
    k8 = k_cache.to(FP8_KV)
    v8 = v_cache.to(FP8_KV).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert not v8.is_contiguous()
    want8 = reference.attend(q, k8, v8, meta, scale)
    got8 = fast.attend(q, k8, v8, meta, scale)
    ulp8 = torch.finfo(dtype).eps * want8.float().abs().clamp_min(0.25)
    assert ((got8.float() - want8.float()).abs() <= 4 * ulp8).all()
    assert not torch.equal(want8, want)
    # Negative control: one table entry pointing at another sequence's block is far outside those roundings.
    tables = meta.block_tables.clone()
    tables[3, 5] = tables[0, 0]
    meta.block_tables, meta.memo = tables, {}
    wrong = fast.attend(q, k_cache, v_cache, meta, scale)
    assert not ((wrong.float() - want.float()).abs() <= 4 * ulp).all()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    out = make["write_checkpoint"](make["PRESETS"]["tiny-llama"], tmp_path_factory.mktemp("tiny-llama"),
                                   torch.float32, seed=1)
    return make_runner(str(out), device="cpu", dtype="float32", num_blocks=256, block_size=16)


class Pager:
    """A test stand-in for the scheduler: hands out shuffled blocks and keeps block tables and lengths."""

    def __init__(self, runner: ModelRunner, max_seqs: int = 8, seed: int = 0) -> None:
        self.runner = runner
        self.free = np.random.default_rng(seed).permutation(runner.num_blocks).tolist()
        self.block_tables = np.full((max_seqs, 64), -1, dtype=np.int32)
        self.lens = [0] * max_seqs

    def share(self, dst: int, src: int, num_blocks: int) -> None:
        """Point ``dst``'s first blocks at ``src``'s (a prefix-cache hit): ``dst`` skips those tokens."""
        self.block_tables[dst, :num_blocks] = self.block_tables[src, :num_blocks]
        self.lens[dst] = num_blocks * self.runner.block_size

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        bs = self.runner.block_size
        for slot, toks in chunks.items():
            for b in range(-(-self.lens[slot] // bs), -(-(self.lens[slot] + len(toks)) // bs)):
                self.block_tables[slot, b] = self.free.pop()
        slots = list(chunks)
        token_ids = np.concatenate([np.array(chunks[s], dtype=np.int32) for s in slots])
        positions = np.concatenate([np.arange(self.lens[s], self.lens[s] + len(chunks[s]), dtype=np.int32)
                                    for s in slots])
        q_lens = np.array([len(chunks[s]) for s in slots], dtype=np.int32)
        for s in slots:
            self.lens[s] += len(chunks[s])
        ctx = np.array([self.lens[s] for s in slots], dtype=np.int32)
        logits = self.runner.forward(token_ids, positions, np.array(slots, dtype=np.int32), q_lens, ctx,
                                     self.block_tables)
        return dict(zip(slots, logits, strict=True))


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def test_chunked_prefill_equals_one_shot(tiny_llama: ModelRunner) -> None:
    prompt = _prompt(0, 137)  # crosses the llama3 original context (64), uneven chunks
    one_shot = Pager(tiny_llama, seed=1).step({0: prompt})[0]
    pager = Pager(tiny_llama, seed=2)
    cuts = [0, 1, 9, 16, 17, 40, 64, 65, 100, 128, 137]
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        chunked = pager.step({0: prompt[lo:hi]})[0]
    assert (chunked - one_shot).abs().max().item() <= 1e-5
    # Negative control: the same tokens one position later (slot 0 of the cache left unwritten) disagree.
    wrong = Pager(tiny_llama, seed=3)
    wrong.block_tables[0, 0] = wrong.free.pop()
    wrong.lens[0] = 1
    assert (wrong.step({0: prompt})[0] - one_shot).abs().max().item() > 1e-3


def test_mixed_batch_equals_each_sequence_alone(tiny_llama: ModelRunner) -> None:
    p = {i: _prompt(10 + i, n) for i, n in enumerate([7, 21, 30, 40])}
    shared = p[1][:16] + _prompt(99, 9)  # starts with seq 1's first full block
    alone = {i: Pager(tiny_llama, seed=20 + i).step({0: toks})[0] for i, toks in p.items()}
    alone[4] = Pager(tiny_llama, seed=30).step({0: shared})[0]
    pager = Pager(tiny_llama, seed=5)
    pager.step({1: p[1][:-1], 2: p[2][:12]})  # earlier steps: seq 1 prefilled, seq 2 partly
    pager.step({3: p[3][:16]})
    pager.share(4, 3, 0)
    pager.share(4, 1, 1)  # seq 4 reuses seq 1's block 0 in the same step that decodes seq 1
    out = pager.step({0: p[0], 1: p[1][-1:], 2: p[2][12:], 3: p[3][16:], 4: shared[16:]})
    for i in range(5):
        assert (out[i] - alone[i]).abs().max().item() <= 1e-5, f"sequence {i}"
    # Negative control: sequences differ from each other by far more than the tolerance.
    assert (alone[0] - alone[1]).abs().max().item() > 1e-2


def test_forward_rejects_block_outside_pool(tiny_llama: ModelRunner) -> None:
    pager = Pager(tiny_llama)
    pager.block_tables[0, 0] = tiny_llama.num_blocks
    with pytest.raises(ValueError, match="outside"):
        tiny_llama.forward(np.array([1, 2], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32),
                           np.array([2], np.int32), np.array([2], np.int32), pager.block_tables)
