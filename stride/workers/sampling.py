"""Sampling on the device, vectorised over the batch.

The :class:`Sampler` keeps per-slot state (parameters, penalty counts, seeded generators) in tensors indexed
by sequence slot, so one ``sample`` call runs a fixed handful of batched ops whatever the mix of parameters.
Host-side decisions (does any row need top-p? are all rows greedy?) come from a numpy mirror of the
parameter table, so they never wait on the device.

Order of operations on a row's logits, all in float32:

1. logprobs: ``log_softmax`` of the *raw* logits, before penalties and temperature (vLLM's default "raw
   logprobs"), so a token's reported logprob does not depend on how it was sampled;
2. ``logit_bias`` added (OpenAI's: the bias goes on the model's logits, before anything else acts on them);
3. repetition penalty (CTRL): for tokens seen in the prompt or output, positive logits are divided by the
   penalty, negative ones multiplied;
4. presence / frequency penalties (OpenAI), over output tokens only:
   ``logit -= presence * (count > 0) + frequency * count``;
5. greedy rows (temperature 0) take the argmax here; the rest are divided by their temperature;
6. top-k, then top-p on the distribution renormalised after top-k, then min-p (``p >= min_p * p_max``,
   which is scale-free, so it is the same before or after renormalising);
7. one draw per row by an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks index ``i``
   with probability ``p_i``. Rows without a seed draw ``E`` from the sampler's generator in one call; rows
   with a seed draw theirs from their own generator, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stride.params import SamplingParams

# Columns of the per-slot parameter table.
_TEMP, _TOP_K, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION, _NUM_LOGPROBS = range(8)
_NUM_COLS = 8


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` (float, [n, vocab]) with every token not allowed by ``bitmask[j]`` at ``-inf`` in row ``rows[j]``; a
    new tensor, ``x`` untouched. ``bitmask``: int32 [len(rows), >= vocab / 32], bit ``t % 32`` of word ``t // 32``
    set where token ``t`` is allowed (llguidance's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = (bitmask.to(device=x.device, dtype=torch.int32).unsqueeze(-1) >> shifts) & 1
    ok = bits.reshape(bitmask.shape[0], -1)[:, : x.shape[1]].bool()
    return x.index_put((rows,), x[rows].masked_fill(~ok, float("-inf")))


@dataclass(frozen=True)
class SampleResult:
    """One sampled token per row, on the sampler's device.

    ``logprobs``/``top_ids``/``top_logprobs`` are None unless some row asked for logprobs; then the top
    columns number the largest ``logprobs`` asked for in the batch, and a row that asked for fewer uses
    only its first ones (``Sampler.num_logprobs``). ``is_stop`` marks tokens that end the sequence: the
    model's end-of-sequence ids (unless ``ignore_eos``) or the request's ``stop_token_ids``.
    """

    token_ids: torch.Tensor  # [num_seqs] int64
    is_stop: torch.Tensor  # [num_seqs] bool
    logprobs: torch.Tensor | None = None  # [num_seqs] float32, of the sampled token
    top_ids: torch.Tensor | None = None  # [num_seqs, n] int64
    top_logprobs: torch.Tensor | None = None  # [num_seqs, n] float32


def upload(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy of a host array on ``device`` that does not wait for the stream. A plain copy from pageable memory
    synchronises with the stream, so the host work after it (the rest of the sampler) would start only once the
    forward had finished; through pinned memory it is queued behind the forward and the host goes on (the caching
    host allocator keeps the pinned block until the copy is done). The copy is taken now: ``arr`` may change."""
    host = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)  # pin_memory copies


class Sampler:
    """Per-slot sampling state for up to ``max_num_seqs`` concurrent sequences.

    A slot is the sequence's row in the worker's tables; ``add_sequence`` claims it, ``remove`` frees it.
    ``sample`` records the sampled tokens as output tokens (for the penalties) unless told not to.
    """

    def __init__(self, max_num_seqs: int, vocab_size: int, *, eos_token_ids: Sequence[int] = (),
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self._params: list[SamplingParams | None] = [None] * max_num_seqs
        self._table = np.zeros((max_num_seqs, _NUM_COLS), dtype=np.float32)
        self._table_dev = torch.zeros((max_num_seqs, _NUM_COLS), dtype=torch.float32, device=self.device)
        self._table_dirty = False
        self._generators: dict[int, torch.Generator] = {}
        self._default_gen = torch.Generator(device=self.device)
        self._default_gen.manual_seed(seed)
        # Penalty state is [max_num_seqs, vocab]; allocated on the first sequence that needs it.
        self._output_counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._has_penalty = np.zeros(max_num_seqs, dtype=bool)
        # logit_bias per slot, sparse: (token ids, biases) on the device, for the slots that have one.
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._in_use = np.zeros(max_num_seqs, dtype=bool)
        self._seeded = np.zeros(max_num_seqs, dtype=bool)
        self._wants_logprobs = np.zeros(max_num_seqs, dtype=bool)
        # Stop ids per slot, padded with -1; widened when a request brings more stop ids.
        self._stop_ids = torch.full((max_num_seqs, max(1, len(self.eos_token_ids))), -1, dtype=torch.int64,
                                    device=self.device)

    # ------------------------------------------------------------------ per-slot state

    def add_sequence(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int],
                     output_token_ids: Sequence[int] = ()) -> None:
        """Claim ``slot`` for a sequence. ``output_token_ids`` restores the penalty counts of a sequence
        that resumes (after preemption) with tokens it already generated."""
        if self._params[slot] is not None:
            raise ValueError(f"slot {slot} is in use")
        biased = [b.token_id for b in params.logit_bias if b.token_id >= self.vocab_size]
        if biased:
            raise ValueError(f"logit_bias names token {biased[0]}, outside the vocabulary of {self.vocab_size}")
        self._params[slot] = params
        self._in_use[slot] = True
        self._wants_logprobs[slot] = params.logprobs is not None
        self._table[slot] = (params.temperature, params.top_k, params.top_p, params.min_p,
                             params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                             params.logprobs or 0)
        self._table_dirty = True
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[slot] = gen
            self._seeded[slot] = True
        self._set_stop_ids(slot, params)
        if params.logit_bias:
            ids = [b.token_id for b in params.logit_bias]
            self._bias[slot] = (torch.tensor(ids, dtype=torch.int64, device=self.device),
                                torch.tensor([b.bias for b in params.logit_bias], dtype=torch.float32,
                                             device=self.device))
        needs_penalty = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                         or params.repetition_penalty != 1.0)
        self._has_penalty[slot] = needs_penalty
        if needs_penalty:
            counts, prompt_mask = self._penalty_state()
            counts[slot].zero_()
            prompt_mask[slot].zero_()
            if len(prompt_token_ids):
                prompt_mask[slot, torch.as_tensor(list(prompt_token_ids), device=self.device)] = True
            if len(output_token_ids):
                self.record([slot] * len(output_token_ids), list(output_token_ids))

    def remove(self, slot: int) -> None:
        """Free ``slot``; its state is forgotten."""
        self._params[slot] = None
        self._in_use[slot] = self._seeded[slot] = self._wants_logprobs[slot] = False
        self._table[slot] = 0.0
        self._table_dirty = True
        self._generators.pop(slot, None)
        self._has_penalty[slot] = False
        self._bias.pop(slot, None)
        self._stop_ids[slot] = -1

    def params(self, slot: int) -> SamplingParams | None:
        return self._params[slot]

    def num_logprobs(self, slot: int) -> int | None:
        """How many top alternatives ``slot`` asked for (None: no logprobs at all)."""
        params = self._params[slot]
        return None if params is None else params.logprobs

    def record(self, slots: Sequence[int], token_ids: Sequence[int] | torch.Tensor) -> None:
        """Count ``token_ids[i]`` as an output token of ``slots[i]`` (for the penalties)."""
        slot_arr = np.asarray(slots, dtype=np.int64)
        keep = self._has_penalty[slot_arr]
        if not keep.any() or self._output_counts is None:
            return
        tokens = torch.as_tensor(token_ids, device=self.device).long()
        idx = self.upload(slot_arr)
        if not keep.all():
            sel = self.upload(np.flatnonzero(keep))
            idx, tokens = idx[sel], tokens[sel]
        ones = torch.ones_like(tokens, dtype=self._output_counts.dtype)
        self._output_counts.index_put_((idx, tokens), ones, accumulate=True)

    def _penalty_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._output_counts is None or self._prompt_mask is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self._output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._output_counts, self._prompt_mask

    def _set_stop_ids(self, slot: int, params: SamplingParams) -> None:
        ids = [] if params.ignore_eos else list(self.eos_token_ids)
        ids += [t for t in params.stop_token_ids if t not in ids]
        if len(ids) > self._stop_ids.shape[1]:
            wider = torch.full((self.max_num_seqs, len(ids)), -1, dtype=torch.int64, device=self.device)
            wider[:, : self._stop_ids.shape[1]] = self._stop_ids
            self._stop_ids = wider
        self._stop_ids[slot] = -1
        if ids:
            self._stop_ids[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int64)

    # ------------------------------------------------------------------ sampling

    def sample(self, logits: torch.Tensor, slots: Sequence[int] | torch.Tensor, *,
               record: bool = True, allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleResult:
        """Sample one token per row of ``logits`` [num_seqs, vocab]; row ``i`` belongs to ``slots[i]``.

        ``allowed``: (rows, bitmask) for rows held to a grammar (structured outputs): row ``rows[j]`` may take
        only the tokens whose bit is set in ``bitmask[j]`` (int32 words, bit ``t % 32`` of word ``t // 32``),
        after its logit bias and penalties and before temperature, top-k/p and greedy. Other rows are untouched.

        ``logits`` is not modified. A slot may appear in several rows only if it has no seed and no
        penalties (its rows are then independent draws, which the statistical tests use)."""
        slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        slot_arr = np.asarray(slot_list, dtype=np.int64)
        if logits.dim() != 2 or logits.shape[0] != len(slot_arr):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(slot_arr)} slots")
        if not self._in_use[slot_arr].all():
            raise KeyError(f"sampling a free slot among {slot_list}")
        host = self._table[slot_arr]
        self._sync_table()
        slot_idx = self.upload(slot_arr)
        cols = self._table_dev[slot_idx]

        result_logprobs = top_ids = top_logprobs = None
        max_logprobs = int(host[:, _NUM_LOGPROBS].max()) if len(host) else 0
        wants_logprobs = bool(self._wants_logprobs[slot_arr].any())
        if wants_logprobs:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        x = self._penalized(logits, slot_arr, slot_idx, cols)
        if allowed is not None and len(allowed[0]):
            x = apply_bitmask(x, *allowed)

        greedy = host[:, _TEMP] == 0.0
        if greedy.all():
            token_ids = x.argmax(dim=-1)
        else:
            sampled = self._draw(x, slot_arr, host, cols)
            if greedy.any():
                greedy_dev = self.upload(greedy)
                token_ids = torch.where(greedy_dev, x.argmax(dim=-1), sampled)
            else:
                token_ids = sampled

        if wants_logprobs:
            result_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            top_logprobs, top_ids = raw_logprobs.topk(max_logprobs, dim=-1)
        is_stop = (self._stop_ids[slot_idx] == token_ids[:, None]).any(dim=-1)
        if record:
            self.record(slot_list, token_ids)
        return SampleResult(token_ids, is_stop, result_logprobs, top_ids, top_logprobs)

    def penalized_logits(self, logits: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """A float32 copy of ``logits`` with each row's logit bias and repetition, presence and frequency penalties
        applied (what greedy takes the argmax of and temperature divides); for tests and debugging."""
        slot_arr = np.asarray(list(slots), dtype=np.int64)
        self._sync_table()
        slot_idx = self.upload(slot_arr)
        return self._penalized(logits, slot_arr, slot_idx, self._table_dev[slot_idx])

    def _sync_table(self) -> None:
        if self._table_dirty:
            self._table_dev.copy_(self.upload(self._table))
            self._table_dirty = False

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` on this sampler's device, queued without waiting for the stream (:func:`upload`)."""
        return upload(arr, self.device)

    def _penalized(self, logits: torch.Tensor, slot_arr: np.ndarray, slot_idx: torch.Tensor,
                   cols: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float32, copy=True)
        if self._bias:
            self._add_bias(x, slot_arr)
        if not self._has_penalty[slot_arr].any():
            return x
        counts, prompt_mask = self._penalty_state()
        row_counts = counts[slot_idx]
        seen = prompt_mask[slot_idx] | (row_counts > 0)
        rep = cols[:, _REPETITION, None]
        # CTRL: shrink towards zero when positive, push away when negative; rows at 1.0 are unchanged.
        penalised = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(seen, penalised, x))
        x.sub_(cols[:, _PRESENCE, None] * (row_counts > 0) + cols[:, _FREQUENCY, None] * row_counts)
        return x

    def _add_bias(self, x: torch.Tensor, slot_arr: np.ndarray) -> None:
        """Each biased row's ``logit_bias`` added in place, in one scatter over the batch."""
        rows = [(row, self._bias[int(slot)]) for row, slot in enumerate(slot_arr.tolist()) if int(slot) in self._bias]
        if not rows:
            return
        row_idx = torch.cat([torch.full_like(ids, row) for row, (ids, _) in rows])
        col_idx = torch.cat([ids for _, (ids, _) in rows])
        values = torch.cat([vals for _, (_, vals) in rows])
        x.index_put_((row_idx, col_idx), values, accumulate=True)

    def _draw(self, x: torch.Tensor, slot_arr: np.ndarray, host: np.ndarray,
              cols: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k/top-p/min-p and one exponential-race draw per row (greedy rows: ignored)."""
        temp = cols[:, _TEMP, None]
        x.div_(torch.where(temp > 0, temp, torch.ones_like(temp)))
        vocab = x.shape[1]
        if (host[:, _TOP_P] < 1.0).any():
            self._top_k_top_p_sorted(x, cols)
        elif (host[:, _TOP_K] > 0).any():
            # top-k alone: topk of the largest k in the batch is cheaper than a full sort.
            top_k = cols[:, _TOP_K].long()
            k_max = min(int(host[:, _TOP_K].max()), vocab)
            kth = x.topk(k_max, dim=-1).values
            k_row = torch.where(top_k > 0, top_k.clamp(max=k_max), torch.full_like(top_k, k_max)) - 1
            threshold = kth.gather(1, k_row[:, None])
            threshold = torch.where(top_k[:, None] > 0, threshold, torch.full_like(threshold, -torch.inf))
            x.masked_fill_(x < threshold, -torch.inf)
        if (host[:, _MIN_P] > 0.0).any():
            # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p), no softmax needed.
            floor = x.max(dim=-1, keepdim=True).values + torch.log(cols[:, _MIN_P, None])
            x.masked_fill_(x < floor, -torch.inf)
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self._default_gen)
        # The one per-row loop: a seeded row draws from its own generator, so only those rows pay for it.
        for row in np.flatnonzero(self._seeded[slot_arr]).tolist():
            noise[row].exponential_(generator=self._generators[int(slot_arr[row])])
        # An Exp(1) draw can underflow to 0; 0/0 would be NaN and could win the argmax.
        return probs.div_(noise.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p_sorted(x: torch.Tensor, cols: torch.Tensor) -> None:
        """Mask ``x`` in place to each row's top-k, then top-p of the renormalised remainder."""
        vocab = x.shape[1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        top_k = cols[:, _TOP_K, None].long()
        drop = (top_k > 0) & (rank >= top_k)
        sorted_x.masked_fill_(drop, -torch.inf)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = cols[:, _TOP_P, None]
        # Keep the smallest prefix reaching top_p; rank 0 always stays; top_p == 1 keeps everything.
        drop |= (mass_before >= top_p) & (top_p < 1.0) & (rank > 0)
        x.masked_fill_(torch.zeros_like(drop).scatter_(1, order, drop), -torch.inf)
