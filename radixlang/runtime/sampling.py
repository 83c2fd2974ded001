"""Sampling parameters and batched next-token sampling.

:class:`SamplingParams` mirrors SGLang's sampling parameters (names, defaults, semantics): one
field per row of ``radixlang/sampling_fields.py``'s table, which also gives each field's check.
It validates them up front, so a bad request fails at admission with a message naming the field
rather than deep inside a batch.

:func:`sample` turns one row of logits per running request into one token per request. Per row,
in order: the allowed-token mask and the ``min_new_tokens`` stop-token mask, then repetition,
frequency and presence penalties, then (sampled rows only) temperature, top-k, top-p and min-p
filtering and one draw. Greedy rows take the argmax after masks and penalties and draw nothing.
top-k, top-p and min-p are applied jointly to the temperature-scaled distribution (SGLang's
"joint" order): top-p's mass is that of the full distribution, not renormalised after top-k;
min-p is relative to the most likely token.

Reproducibility: a sampled row consumes exactly one ``torch.rand(1)`` from its generator per
token and picks by inverse CDF over its own filtered distribution, and which computation a row
goes through depends only on its own parameters. So a seeded request yields the same tokens
whether it runs alone or in any batch, at any position.

Logprobs (``return_logprob``, ``top_logprobs_num``) are the log-softmax of the model's RAW logits,
before penalties, masks, temperature or filtering: they describe the model, not the sampler.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import numpy as np
import torch

from radixlang.sampling_fields import (
    FIELDS_BY_NAME,
    SAMPLING_FIELDS,
    STRUCTURED_OUTPUT,
    SamplingField,
    SamplingParamsError,
    check_value,
)

# A top-p row without top-k first samples among this many best tokens (a topk, much cheaper than
# sorting ~50k probabilities); it falls back to a full sort only when the nucleus may be larger.
_NUCLEUS_CANDIDATES = 1024
# On the CPU, vocabularies from this size on try candidates above a threshold before a topk
# (see _sample_candidates): first the tokens above _FIRST_RATIO of the best one; for rows that
# does not settle, a threshold about _THRESHOLD_RANK * vocab / _THRESHOLD_SAMPLE tokens pass
# (~640 of 49,152), judged from a strided sample of _THRESHOLD_SAMPLE probabilities. Rows with
# more than _MAX_CANDIDATES candidates take the topk. A top-p row's candidates must hold
# top_p + _MASS_MARGIN of the mass. Candidates are found in blocks of _BLOCK tokens.
_CANDIDATES_MIN_VOCAB = 4096
_FIRST_RATIO = 2.0**-10
_THRESHOLD_SAMPLE = 1536
_THRESHOLD_RANK = 20
_MAX_CANDIDATES = 2048
_BLOCK = 32
_MASS_MARGIN = 1e-5
_ID_BITS = 24  # a candidate's sort key holds its token id in the low bits
_MAX_ID = (1 << _ID_BITS) - 1
_TOP_BITS = 0x7FFFFFFF


class _SamplingParamsChecks:
    """SamplingParams' checks and helpers; its fields are the table's (sampling_fields.py)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (raising :class:`SamplingParamsError`) and normalise in place."""
        for f in SAMPLING_FIELDS:
            setattr(self, f.name, check_value(f, getattr(self, f.name)))
        p: Any = self
        if not p.min_new_tokens <= p.max_new_tokens:
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens={p.max_new_tokens}], "
                f"got {p.min_new_tokens}"
            )
        given = [name for name in STRUCTURED_OUTPUT if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"give at most one of {', '.join(given)}")
        self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        p: Any = self
        if p.beam_width == 1:
            return
        # Beam search ranks sequences by their raw log-probabilities and draws nothing: a
        # request that asks for anything that would change them is refused, not half obeyed.
        # (Messages start with the field's name, as the server reports them.)
        if p.temperature != 0:
            raise SamplingParamsError(
                f"temperature must be 0 with beam search (beam_width={p.beam_width}), which "
                f"draws nothing; got {p.temperature}"
            )
        unsupported = [
            name
            for name in (
                "repetition_penalty",
                "frequency_penalty",
                "presence_penalty",
                "logit_bias",
                "token_healing",
                "thinking_budget",
                *STRUCTURED_OUTPUT,
            )
            if getattr(self, name) != FIELDS_BY_NAME[name].default
        ]
        if unsupported:
            raise SamplingParamsError(
                f"{', '.join(unsupported)}: not supported with beam search "
                f"(beam_width={p.beam_width})"
            )

    @property
    def structured_output(self) -> tuple[str, str | dict] | None:
        """``(kind, source)`` of the output's constraint, if any (kind as in STRUCTURED_OUTPUT)."""
        for name in STRUCTURED_OUTPUT:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        """Deterministic argmax decoding: no random draw is made for this request."""
        p: Any = self
        return p.temperature == 0 or p.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request's JSON object; unknown keys are rejected, None means default."""
        if not isinstance(d, Mapping):
            raise SamplingParamsError(f"sampling params must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in FIELDS_BY_NAME)
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(FIELDS_BY_NAME)}"
            )
        # JSON clients often send null for "unset": leave the default in place.
        return SamplingParams(**{k: v for k, v in d.items() if v is not None})


def _field(f: SamplingField) -> Any:
    if isinstance(f.default, list | dict):
        return field(default_factory=lambda: copy.copy(f.default))
    return field(default=f.default)


# Per-request sampling parameters (SGLang's names and semantics): a dataclass with one field
# per row of sampling_fields.SAMPLING_FIELDS (type, default; checked at construction).
SamplingParams = make_dataclass(
    "SamplingParams",
    [(f.name, f.annotation, _field(f)) for f in SAMPLING_FIELDS],
    bases=(_SamplingParamsChecks,),
    namespace={
        "__doc__": "Per-request sampling parameters (SGLang names and semantics), one field per "
        "row of ``radixlang.sampling_fields.SAMPLING_FIELDS``; checked and normalised at "
        "construction (``stop`` may be a str, ``top_k`` 0 becomes -1).",
        "__module__": __name__,
    },
)


@dataclass
class SamplingRow:
    """One request's row in a :func:`sample` call."""

    params: SamplingParams
    prompt_ids: Sequence[int]  # for repetition_penalty
    output_ids: Sequence[int]  # generated so far: penalties, min_new_tokens
    # EOS + stop_token_ids: masked (-inf) while len(output_ids) < params.min_new_tokens.
    stop_ids: frozenset[int]
    # Per-request generator (seeded requests); None: the shared generator passed to sample().
    generator: torch.Generator | None
    # Optional bool [vocab]: only these tokens may be chosen (greedy rows included).
    allowed_mask: torch.Tensor | None = None


@dataclass
class SampleOutput:
    """One token per row, plus logprobs (of the RAW logits) where the row asked for them."""

    token_ids: list[int]
    logprobs: list[float | None]  # logprob of the chosen token; None unless return_logprob
    # top_logprobs_num (id, logprob) pairs, best first; None unless return_logprob and num > 0.
    top_logprobs: list[list[tuple[int, float]] | None]


def _stop_masked(row: SamplingRow) -> bool:
    return bool(row.stop_ids) and len(row.output_ids) < row.params.min_new_tokens


def uses_penalties(p: SamplingParams) -> bool:
    """Whether ``p`` penalises tokens already seen (so a row's logits depend on its output)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _needs_sort(p: SamplingParams) -> bool:
    return p.top_p < 1.0 or p.top_k > 0


def _check_ids(ids: Sequence[int], vocab: int, what: str, row: int) -> None:
    # Out-of-range indices are a device-side assert on CUDA; fail here with a readable message.
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"row {row}: {what} holds a token id outside [0, {vocab})")


def _apply_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: add each row's logit_bias (before masks, which then still forbid outright)."""
    vocab = x.shape[1]
    bias_rows: list[int] = []
    bias_toks: list[int] = []
    bias_vals: list[float] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            _check_ids(list(bias), vocab, "logit_bias", i)
            bias_rows += [i] * len(bias)
            bias_toks += list(bias)
            bias_vals += list(bias.values())
    if bias_toks:
        r = torch.tensor(bias_rows, device=x.device)
        t = torch.tensor(bias_toks, device=x.device)
        x[r, t] += torch.tensor(bias_vals, dtype=x.dtype, device=x.device)


def _apply_masks(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: restrict to allowed tokens and forbid stop tokens before min_new_tokens."""
    vocab = x.shape[1]
    masked_rows: list[int] = []
    allow_idx: list[int] = []
    allow_masks: list[torch.Tensor] = []
    stop_rows: list[int] = []
    stop_toks: list[int] = []
    for i, row in enumerate(rows):
        if row.allowed_mask is not None:
            m = row.allowed_mask
            if m.dtype != torch.bool or m.shape != (vocab,):
                raise ValueError(
                    f"row {i}: allowed_mask must be a bool tensor of shape ({vocab},), "
                    f"got {m.dtype} {tuple(m.shape)}"
                )
            allow_idx.append(i)
            allow_masks.append(m)
            masked_rows.append(i)
        if _stop_masked(row):
            # A stop id the logits cannot produce is already impossible: skip it.
            toks = [t for t in row.stop_ids if 0 <= t < vocab]
            stop_rows.extend([i] * len(toks))
            stop_toks.extend(toks)
            masked_rows.append(i)
    if allow_idx:
        idx = torch.tensor(allow_idx, device=x.device)
        # Stacked where the masks are (the host, from the grammar engine), then moved in one
        # copy: a copy per row cost a transfer each on a GPU.
        if len({m.device for m in allow_masks}) > 1:
            allow_masks = [m.to(x.device) for m in allow_masks]
        allowed = torch.stack(allow_masks).to(x.device)
        x[idx] = x[idx].masked_fill(~allowed, -math.inf)
    if stop_toks:
        x[
            torch.tensor(stop_rows, device=x.device),
            torch.tensor(stop_toks, device=x.device),
        ] = -math.inf
    if masked_rows:
        idx = torch.tensor(sorted(set(masked_rows)), device=x.device)
        alive = (x[idx] > -math.inf).any(dim=1).tolist()
        for i, ok in zip(idx.tolist(), alive, strict=True):
            if not ok:
                raise ValueError(f"row {i}: every token is masked; nothing can be sampled")


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: repetition penalty, then frequency/presence penalties, on the rows using them."""
    vocab = x.shape[1]
    dev = x.device
    rep_rows: list[int] = []
    rep_toks: list[int] = []
    rep_vals: list[float] = []
    fp_idx: list[int] = []
    fp_rows: list[int] = []  # local index into fp_idx, one per generated token
    fp_toks: list[int] = []
    freq: list[float] = []
    pres: list[float] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            _check_ids(row.prompt_ids, vocab, "prompt_ids", i)
            _check_ids(row.output_ids, vocab, "output_ids", i)
            # Each seen token is penalised once, however often it occurred (the set also
            # keeps the scatter below small for long prompts).
            toks = list(set(row.prompt_ids) | set(row.output_ids))
            rep_rows.extend([i] * len(toks))
            rep_toks.extend(toks)
            rep_vals.extend([p.repetition_penalty] * len(toks))
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_ids:
            _check_ids(row.output_ids, vocab, "output_ids", i)
            fp_rows.extend([len(fp_idx)] * len(row.output_ids))
            fp_toks.extend(row.output_ids)
            fp_idx.append(i)
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
    if rep_toks:
        r = torch.tensor(rep_rows, device=dev)
        t = torch.tensor(rep_toks, device=dev)
        pen = torch.tensor(rep_vals, dtype=x.dtype, device=dev)
        vals = x[r, t]
        x[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
    if fp_toks:
        k = len(fp_idx)
        flat = torch.tensor(fp_rows, device=dev) * vocab + torch.tensor(fp_toks, device=dev)
        counts = torch.bincount(flat, minlength=k * vocab).view(k, vocab).to(x.dtype)
        f = torch.tensor(freq, dtype=x.dtype, device=dev).unsqueeze(1)
        pr = torch.tensor(pres, dtype=x.dtype, device=dev).unsqueeze(1)
        idx = torch.tensor(fp_idx, device=dev)
        x[idx] = x[idx] - (f * counts + pr * (counts > 0).to(x.dtype))


def _rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x restricted to rows idx; no copy when that is every row in order (the common case)."""
    if len(idx) == x.shape[0]:
        return x
    return x[torch.tensor(idx, device=x.device)]


def _probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled softmax; subtracting the row max first keeps tiny temperatures finite.

    softmax (not exp on the flat tensor) on purpose: its kernel works row by row, so a row's
    probabilities are bit-identical whatever the batch around it.
    """
    if x.device.type != "cpu":
        z = x - x.amax(dim=1, keepdim=True)
    else:  # into a reused buffer: a fresh [rows, vocab] allocation page-faults on the CPU
        z = torch.sub(x, x.amax(dim=1, keepdim=True), out=_scratch("z", x))
    if any(p.temperature != 1.0 for p in params):
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
        z.div_(temp.unsqueeze(1))
    if x.device.type != "cpu":
        return torch.softmax(z, dim=1)
    return torch._softmax(z, 1, False, out=_scratch("probs", x))  # what torch.softmax runs


_SCRATCH = threading.local()
_SCRATCH_MAX_ELEMENTS = 1 << 26  # 256 MiB of float32: larger ones are allocated each time


def _scratch(name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU buffer shaped like ``like`` (of ``dtype``, by default its own), kept per thread
    and name and reused by later calls.

    Only for values used within one :func:`sample` call: the next call overwrites them.
    """
    dtype = like.dtype if dtype is None else dtype
    numel = like.numel()
    if numel > _SCRATCH_MAX_ELEMENTS:
        return torch.empty(like.shape, dtype=dtype)
    buffers = _SCRATCH.__dict__
    buf = buffers.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = buffers[name] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(like.shape)


def _pick(cdf: torch.Tensor, last: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative mass exceeds u * last.

    Scaling u by the row's own total avoids renormalising. The target is kept strictly below
    the total (u * last can round up to it), so a position where the cdf does not rise, i.e. a
    zero-probability token, can never be the first to exceed it.
    """
    target = torch.minimum(u.unsqueeze(1) * last, torch.nextafter(last, torch.zeros_like(last)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _sample_unsorted(
    x: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Rows without top-k/top-p: min-p in place, then inverse CDF in vocab order (no sort)."""
    probs = _probs(x, params)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=x.device)
        threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
        probs.masked_fill_(probs < threshold, 0.0)
    cdf = torch.cumsum(probs, dim=1)
    return _pick(cdf, cdf[:, -1:], u).clamp_(max=x.shape[1] - 1)


def _sample_prefix(
    probs: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample among each row's k most likely tokens, with top-k, top-p and min-p applied.

    Returns the tokens and, per row, whether the filters provably cut inside those k tokens
    (always true with top_k set or k == vocab). top-p is measured on the full distribution,
    jointly with top-k (SGLang's "joint" order), not renormalised after top-k.
    """
    vocab, dev = probs.shape[1], probs.device
    if k >= vocab:
        # Stable, so tied tokens keep vocab order and the result never depends on the batch.
        vals, idx = torch.sort(probs, dim=1, descending=True, stable=True)
    else:
        vals, idx = torch.topk(probs, k, dim=1)  # best first
    cdf = torch.cumsum(vals, dim=1)
    # top-k, top-p and min-p each keep the first n tokens of the best-first order, so
    # filtering is just the smallest n: no masking pass and no second cumsum.
    keep = torch.tensor([min(p.top_k, k) if p.top_k > 0 else k for p in params], device=dev)
    if any(p.top_p < 1.0 for p in params):
        # Nucleus: keep a token while the mass strictly before it is below top_p (so the best
        # token always stays); top_p == 1 keeps all, whatever float drift the cumsum has.
        top_p = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
        within = (cdf - vals) < torch.tensor(top_p, dtype=vals.dtype, device=dev).unsqueeze(1)
        keep = torch.minimum(keep, within.sum(dim=1))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=vals.dtype, device=dev)
        keep = torch.minimum(keep, (vals >= vals[:, :1] * min_p.unsqueeze(1)).sum(dim=1))
    last_pos = (keep.clamp(min=1) - 1).unsqueeze(1)
    pick = torch.minimum(_pick(cdf, cdf.gather(1, last_pos), u), last_pos.squeeze(1))
    tokens = idx.gather(1, pick.unsqueeze(1)).squeeze(1)
    capped = torch.tensor([p.top_k > 0 or k >= vocab for p in params], device=dev)
    return tokens, capped | (keep < k)


def _sample_sorted(
    x: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Rows with top-k or top-p, without sorting the whole vocab where that can be avoided.

    A top-k row only looks at its top_k best tokens (topk, far cheaper than a sort). A top-p
    row first tries its _NUCLEUS_CANDIDATES best; only if the nucleus may reach past them is
    the row fully sorted. Both choices depend on the row alone, never on its batch.

    On the CPU, where a topk over the vocab costs most of a millisecond per row, the rows are
    first tried on a few hundred candidates (see :func:`_sample_candidates`); the rows it
    cannot settle exactly as the topk would go the topk way.
    """
    vocab = x.shape[1]
    probs = _probs(x, params)
    tokens = torch.empty(len(params), dtype=torch.long, device=x.device)
    todo = list(range(len(params)))
    if probs.device.type == "cpu" and vocab >= _CANDIDATES_MIN_VOCAB:
        picked, settled = _sample_candidates(probs, params, u)
        tokens.copy_(picked)
        todo = [j for j, ok in enumerate(settled.tolist()) if not ok]
    if not todo:
        return tokens
    groups: dict[int, list[int]] = {}
    for j in todo:
        p = params[j]
        k = p.top_k if p.top_k > 0 else _NUCLEUS_CANDIDATES
        groups.setdefault(min(k, vocab), []).append(j)
    retry: list[int] = []
    for k, js in groups.items():
        sel = torch.tensor(js, device=x.device)
        picked, done = _sample_prefix(_rows(probs, js), [params[j] for j in js], u[sel], k)
        tokens[sel] = picked
        retry += [j for j, ok in zip(js, done.tolist(), strict=True) if not ok]
    if retry:
        sel = torch.tensor(retry, device=x.device)
        picked, _ = _sample_prefix(probs[sel], [params[j] for j in retry], u[sel], vocab)
        tokens[sel] = picked
    return tokens


def _sample_candidates(
    probs: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_sample_sorted` picks, found among each row's tokens above a threshold.

    Returns the tokens and, per row, whether the token is provably the one the topk way
    picks; the other rows' tokens are meaningless.

    Why it is exact. Each row keeps every token whose probability is at least a threshold
    ``t``. Sorted, those ``m`` tokens are exactly the first ``m`` values of the topk's
    best-first order (ties aside, below), and ``cumsum`` accumulates each row sequentially,
    so their cdf is the topk's cdf to position ``m``. The cut (top-k, top-p, min-p) and the
    inverse-CDF pick then agree with the topk's if either the row has at least ``k``
    candidates (its topk's ``k``: the candidates hold the topk's whole window), or it is a
    top-p row whose candidates already hold ``top_p`` of the mass with a margin (no later
    position can be inside the nucleus). Rows the topk would send on to a full sort are not
    settled. Ties: the topk orders equal probabilities in no documented way, so a row settles
    only if the picked probability is not shared with a neighbour. Rows with NaNs have no
    candidates and do not settle either.

    The thresholds: first ``_FIRST_RATIO`` of the row's best probability (a real model's
    nucleus at temperature 0.7 and top_p 0.9 is a handful of tokens, and that level keeps a
    few dozen); for the rows that does not settle, a level about ``_THRESHOLD_RANK * vocab /
    _THRESHOLD_SAMPLE`` tokens pass (~640 of 49,152), judged from a strided sample of the row;
    a top-p row's threshold is never above the level under which the whole tail cannot hold
    ``1 - top_p`` of the mass. Tokens are found a block of ``_BLOCK`` at a time: only the
    blocks whose maximum reaches the threshold are scanned.
    """
    n, vocab = probs.shape
    tokens = np.zeros(n, dtype=np.int64)
    settled = np.zeros(n, dtype=bool)
    if probs.dtype != torch.float32 or vocab > _MAX_ID + 1 or vocab < _BLOCK:
        return torch.from_numpy(tokens), torch.from_numpy(settled)
    probs = probs.contiguous()
    table = probs.detach().numpy()
    blocks = vocab // _BLOCK
    block_max = probs.as_strided((n, blocks, _BLOCK), (vocab, _BLOCK, 1)).amax(dim=2)
    if vocab % _BLOCK:  # a last, shorter block
        block_max = torch.cat([block_max, probs[:, blocks * _BLOCK :].amax(1, keepdim=True)], 1)
    block_max = block_max.numpy()
    floor = np.asarray(
        [(1.0 - p.top_p - 2 * _MASS_MARGIN) / vocab if p.top_p < 1.0 else 0.0 for p in params],
        dtype=np.float32,
    )
    floor = np.maximum(floor, np.finfo(np.float32).tiny)  # never the underflowed zeros
    args = (table, block_max, params, u.numpy(), tokens, settled)
    _settle(np.maximum(block_max.max(axis=1) * np.float32(_FIRST_RATIO), floor), *args)
    todo = np.flatnonzero(~settled)
    if len(todo):
        columns = np.arange(0, vocab, max(1, vocab // _THRESHOLD_SAMPLE))
        sample = table[todo[:, None], columns[None, :]]
        rank = len(columns) - min(_THRESHOLD_RANK, len(columns))
        t = np.full(n, np.inf, dtype=np.float32)
        t[todo] = np.maximum(np.partition(sample, rank, axis=1)[:, rank], floor[todo])
        _settle(t, *args)
    return torch.from_numpy(tokens), torch.from_numpy(settled)


def _settle(
    t: np.ndarray,
    table: np.ndarray,
    block_max: np.ndarray,
    params: Sequence[SamplingParams],
    u: np.ndarray,
    tokens: np.ndarray,
    settled: np.ndarray,
) -> None:
    """One pass of :func:`_sample_candidates` at thresholds ``t`` (inf: skip the row): the
    rows it settles get their token in ``tokens`` and ``settled``."""
    n, vocab = table.shape
    # numpy throughout: its compare, nonzero and sort on small arrays cost a fraction of
    # torch's per-call overhead.
    blocks = vocab // _BLOCK
    hit_rows, hit_blocks = np.nonzero(block_max[:, :blocks] >= t[:, None])
    slabs = table[:, : blocks * _BLOCK] if vocab % _BLOCK else table
    values = np.lib.stride_tricks.as_strided(
        slabs, (n, blocks, _BLOCK), (table.strides[0], _BLOCK * 4, 4), writeable=False
    )[hit_rows, hit_blocks]
    which, col = np.nonzero(values >= t[hit_rows][:, None])
    owner = hit_rows[which]  # candidates come row by row
    ids = hit_blocks[which] * _BLOCK + col
    vals = values[which, col]
    if vocab % _BLOCK:  # the last, shorter block
        rest = table[:, blocks * _BLOCK :]
        rest_rows, rest_col = np.nonzero(rest >= t[:, None])
        owner = np.concatenate([owner, rest_rows])
        ids = np.concatenate([ids, rest_col + blocks * _BLOCK])
        vals = np.concatenate([vals, rest[rest_rows, rest_col]])
        order = np.argsort(owner, kind="stable")  # row by row again
        owner, ids, vals = owner[order], ids[order], vals[order]
    if not len(owner):
        return
    counts = np.bincount(owner, minlength=n)
    crowded = counts > _MAX_CANDIDATES  # a flat row: the topk way
    if crowded.any():
        keep = ~crowded[owner]
        owner, ids, vals = owner[keep], ids[keep], vals[keep]
        counts[crowded] = 0
    width = int(counts.max())
    if width == 0:
        return
    # Each candidate as one int64: its probability's bits inverted (positive floats order as
    # their bits), then its id; sorted ascending per row, that is best first. Padding sorts last.
    slot = np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]
    bits = vals.view(np.int32).astype(np.int64)
    keys = np.full((n, width), np.iinfo(np.int64).max)
    keys.reshape(-1)[owner * width + slot] = ((_TOP_BITS - bits) << _ID_BITS) | ids
    keys.sort(axis=1)
    vals = np.zeros((n, width + 1), dtype=np.float32)  # a zero column after
    vals[:, :width] = (_TOP_BITS - (keys >> _ID_BITS)).astype(np.int32).view(np.float32)
    vals[:, :width][np.arange(width) >= counts[:, None]] = 0.0  # zeros never tie
    sorted_ids = keys & _MAX_ID
    # The cdf as torch.cumsum computes it on the CPU: each row added up in order in float64,
    # every partial sum rounded to float32.
    cdf = np.cumsum(vals, axis=1, dtype=np.float64).astype(np.float32)

    # As _sample_prefix, on the numpy arrays (its float32 arithmetic, the same results).
    vocab_k = [min(p.top_k if p.top_k > 0 else _NUCLEUS_CANDIDATES, vocab) for p in params]
    k, m = np.asarray(vocab_k), counts
    window = np.minimum(m, k)  # positions < window are the topk's, exactly
    keep_n = window
    top_p = [p.top_p for p in params]
    in_window = np.arange(width + 1)[None, :] < window[:, None]
    if any(p < 1.0 for p in top_p):
        limit = np.asarray([p if p < 1.0 else math.inf for p in top_p], dtype=np.float32)
        within = ((cdf - vals) < limit[:, None]) & in_window
        keep_n = np.minimum(keep_n, within.sum(axis=1))
    if any(p.min_p > 0 for p in params):
        min_p = np.asarray([p.min_p for p in params], dtype=np.float32)
        kept = (vals >= vals[:, :1] * min_p[:, None]) & in_window
        keep_n = np.minimum(keep_n, kept.sum(axis=1))
    rows = np.arange(n)
    last_pos = np.maximum(keep_n, 1) - 1
    last = cdf[rows, last_pos]
    # _pick: the first position whose cdf exceeds the target (the rows are sorted).
    target = np.minimum(u * last, np.nextafter(last, np.float32(0)))
    pick = np.minimum((cdf <= target[:, None]).sum(axis=1), last_pos)

    # Settled: the window is the topk's (all k candidates, or the top-p mass past its reach)...
    mass = cdf[rows, np.maximum(m - 1, 0)]
    reach = np.asarray([p + _MASS_MARGIN if p < 1.0 else math.inf for p in top_p], np.float32)
    done = (m >= 1) & ((m >= k) | (mass >= reach))
    # ... the topk would not go on to a full sort ...
    capped = np.asarray([p.top_k > 0 or kk >= vocab for p, kk in zip(params, vocab_k, strict=True)])
    done &= capped | (keep_n < k)
    # ... and the picked probability is nobody else's.
    value = vals[rows, pick]
    tied = ((pick > 0) & (vals[rows, np.maximum(pick - 1, 0)] == value)) | (
        vals[rows, pick + 1] == value
    )
    done &= ~tied & ~settled
    tokens[done] = sorted_ids[rows, np.minimum(pick, width - 1)][done]
    settled |= done


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` (the first maximum; NaN counts as the maximum, as in torch).

    On the CPU numpy's vectorised argmax is used: torch's scalar loop took 6 ms for 64 rows of
    49,152 logits, numpy's under 1 ms, with the same tie and NaN rules.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.numel():
        return torch.from_numpy(x.detach().numpy().argmax(axis=1))
    return x.argmax(dim=1)


def _draw(rows: Sequence[SamplingRow], shared: torch.Generator | None) -> torch.Tensor:
    """One uniform per row, each from the row's own generator (or the shared one, in row order).

    Consecutive rows on the same CPU generator take their draws in one call: a CPU generator
    fills a tensor element by element, so ``rand(n)`` is ``n`` calls of ``rand(1)``.
    """
    draws = []
    run_gen: torch.Generator | None = None
    run = 0

    def flush() -> None:
        if run:
            draws.append(torch.rand(run, generator=run_gen))

    for row in rows:
        g = row.generator if row.generator is not None else shared
        if g is not None and g.device.type != "cpu":
            flush()
            run_gen, run = None, 0
            draws.append(torch.rand(1, generator=g, device=g.device).cpu())
            continue
        if run and g is not run_gen:
            flush()
            run = 0
        run_gen = g  # None: torch's default generator
        run += 1
    flush()
    return draws[0] if len(draws) == 1 else torch.cat(draws)


def _plain(row: SamplingRow) -> bool:
    """A row that only needs its logits: no mask, penalty, bias or logprob."""
    p = row.params
    return (
        row.allowed_mask is None
        and not p.return_logprob
        and not p.logit_bias
        and not uses_penalties(p)
        and not _stop_masked(row)
    )


def all_plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Whether every row is greedy and needs nothing but its logits (no mask, penalty, bias
    or logprob): :func:`sample` is then one argmax."""
    return all(_plain(r) and r.params.is_greedy for r in rows)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
    *,
    plain_greedy: bool = False,
) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[len(rows), vocab]``); ``logits`` is not modified.

    Rows whose ``generator`` is None draw from ``generator`` (in row order), or torch's default
    generator if that is None too. Returned logprobs are those of the raw ``logits``.
    ``plain_greedy``: the caller has found :func:`all_plain_greedy` true for ``rows`` (on
    another thread, overlapped with the device's work), so the per-row checks are skipped.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
        )
    n = logits.shape[0]
    if n == 0:
        return SampleOutput([], [], [])
    if plain_greedy:
        return SampleOutput(_argmax(logits).tolist(), [None] * n, [None] * n)
    params = [r.params for r in rows]
    plain = all(_plain(r) for r in rows)

    # Fast path (the common decode step): plain argmax, one host transfer.
    if plain and all(p.is_greedy for p in params):
        return SampleOutput(_argmax(logits).tolist(), [None] * n, [None] * n)

    greedy = [p.is_greedy for p in params]
    raw = logits if logits.dtype == torch.float32 else logits.float()
    x = raw if plain else processed_logits(raw, rows)

    greedy_idx = [i for i in range(n) if greedy[i]]
    sampled_idx = [i for i in range(n) if not greedy[i]]
    if not sampled_idx:
        tokens = _argmax(x)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=x.device)
        if greedy_idx:
            tokens[torch.tensor(greedy_idx, device=x.device)] = _argmax(_rows(x, greedy_idx)).to(
                x.device
            )
        # Draws are taken in row order before splitting, so the shared generator's sequence
        # follows the batch order; each row still takes exactly one.
        u_all = _draw([rows[i] for i in sampled_idx], generator).to(x.device)
        # The sort path is taken per row, by the row's own parameters, never the batch's.
        for use_sort in (False, True):
            pos = [j for j, i in enumerate(sampled_idx) if _needs_sort(params[i]) == use_sort]
            if not pos:
                continue
            idx = [sampled_idx[j] for j in pos]
            u = u_all if len(pos) == len(u_all) else u_all[torch.tensor(pos, device=x.device)]
            fn = _sample_sorted if use_sort else _sample_unsorted
            picked = fn(_rows(x, idx), [params[i] for i in idx], u)
            if len(idx) == n:
                tokens = picked
            else:
                tokens[torch.tensor(idx, device=x.device)] = picked

    return with_logprobs(raw, params, tokens)


def processed_logits(raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``raw`` (float32 ``[len(rows), vocab]``) with each row's logit bias, masks and penalties
    applied: a copy where any row has one, else ``raw`` itself."""
    if not any(
        r.allowed_mask is not None
        or _stop_masked(r)
        or uses_penalties(r.params)
        or bool(r.params.logit_bias)
        for r in rows
    ):
        return raw
    x = raw.clone()  # the caller's logits and the raw logprobs stay untouched
    _apply_bias(x, rows)
    _apply_masks(x, rows)
    _apply_penalties(x, rows)
    return x


def with_logprobs(
    raw: torch.Tensor, params: Sequence[SamplingParams], tokens: torch.Tensor
) -> SampleOutput:
    """The chosen ``tokens`` (one per row of ``raw``), with the logprobs of the RAW logits
    (and the top ones) for the rows that asked for them."""
    n, vocab = raw.shape
    token_ids = tokens.tolist()
    logprobs: list[float | None] = [None] * n
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * n
    lp_idx = [i for i in range(n) if params[i].return_logprob]
    if lp_idx:
        lp = torch.log_softmax(_rows(raw, lp_idx), dim=1)
        chosen_ids = _rows(tokens.unsqueeze(1), lp_idx)
        chosen = lp.gather(1, chosen_ids).squeeze(1).tolist()
        for i, v in zip(lp_idx, chosen, strict=True):
            logprobs[i] = v
        k_max = min(max(params[i].top_logprobs_num for i in lp_idx), vocab)
        if k_max > 0:
            top_v, top_i = lp.topk(k_max, dim=1)
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp_idx):
                k = min(params[i].top_logprobs_num, vocab)
                if k > 0:
                    top_logprobs[i] = list(zip(top_i[j][:k], top_v[j][:k], strict=True))
    return SampleOutput(token_ids, logprobs, top_logprobs)


def target_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row of ``x`` (processed logits: see
    :func:`processed_logits`) draws from: temperature, then top-k, top-p and min-p applied
    jointly as :func:`sample` applies them, the tokens they cut at zero. Rows are not
    renormalised (a pick scales by the row's total). A new tensor, float32 ``[rows, vocab]``."""
    probs = _probs(x, params).clone()  # _probs may hand back a reused buffer
    vocab = probs.shape[1]
    for i, p in enumerate(params):
        if not (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0):
            continue
        row = probs[i]
        # The k best first (a full sort only when the nucleus may reach past the candidates).
        k = min(p.top_k if p.top_k > 0 else _NUCLEUS_CANDIDATES, vocab)
        vals, idx = torch.topk(row, k)
        keep = k
        if p.top_p < 1.0:
            cdf = torch.cumsum(vals, 0)
            keep = min(keep, int(((cdf - vals) < p.top_p).sum()))
            if keep == k and p.top_k <= 0 and k < vocab:
                vals, idx = torch.sort(row, descending=True, stable=True)
                cdf = torch.cumsum(vals, 0)
                keep = int(((cdf - vals) < p.top_p).sum())
        if p.min_p > 0:
            keep = min(keep, int((vals >= vals[0] * p.min_p).sum()))
        keep = max(keep, 1)
        cut = torch.zeros_like(row)
        cut[idx[:keep]] = vals[:keep]
        probs[i] = cut
    return probs


def draw_uniform(rows: Sequence[SamplingRow], shared: torch.Generator | None) -> torch.Tensor:
    """One uniform in [0, 1) per row, from each row's own generator or ``shared``."""
    return _draw(rows, shared)


def pick_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocab order: per row of ``probs`` (not necessarily normalised, some mass
    in each) the token where the cumulative mass first exceeds ``u`` times the row's total."""
    cdf = torch.cumsum(probs, dim=1)
    return _pick(cdf, cdf[:, -1:], u.to(probs.device)).clamp_(max=probs.shape[1] - 1)
