"""Sampling: per-request parameters, the batched on-device sampler, lossless speculative verification.

    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            max_tokens=32, stop_token_ids=(1,), seed=7, n=2, logprobs=5)
    sampler = BatchSampler(vocab_size, num_slots, device)      # the engine owns one
    out = sampler.sample(logits, params_list, slots, prompts, num_generated)   # [B, V] -> B tokens

`SamplingParams` follows vLLM's semantics where they apply:
  * penalties (vLLM's order and formulas): repetition_penalty r over the tokens of prompt AND
    output: a seen token's logit l becomes l / r if l > 0 else l * r; then frequency_penalty f and
    presence_penalty p over the OUTPUT tokens only: l -= f * count + p * (count > 0). Greedy rows
    are penalized too (their argmax is taken after the penalties).
  * then temperature, then min_p (mask tokens whose probability is below min_p * the row's
    largest probability), then top_k (keep the k largest logits, ties with the k-th kept), then
    top_p (the smallest set of most likely tokens whose mass reaches top_p, computed on the
    top-k-renormalized distribution), then one draw. temperature 0 is greedy: exactly the argmax.
  * n: n independent samples of one prompt; `samples()` gives each its own params (n=1, and with
    a seed, seed + index, as vLLM does). The engine runs each as its own request (its own prefill).
  * logprobs=k: per generated token, the sampled token's logprob and the k most likely tokens'.
    Like vLLM's default (`logprobs_mode="raw_logprobs"`), they are the model's raw distribution
    (log_softmax of the logits, before penalties / temperature / filters);
    `logprobs_mode="processed_logprobs"` reports the distribution actually sampled from
    (after penalties, temperature, min_p, top_k, top_p; filtered tokens are -inf).
  * stop_token_ids (alias stop_ids): finish after emitting one of these.
  * seed: the request's draws depend on its seed and its own position only, never on the batch.

Batched sampling (`sample_logits`, driven by `BatchSampler`): one call for the whole [B, V] batch,
all on the device, one host copy at the end (the ids and logprobs packed into one tensor). Per-row
parameters are tensors (`SamplingTensors`, built from the rows' params with one host-to-device
copy). The draw is an exponential race (equivalently Gumbel-max): token = argmax_i p_i / E_i with
E_i = -log(u_i) i.i.d. Exp(1), which picks i with probability p_i / sum(p). The uniforms u are a
counter-based hash of (row key, vocabulary index): a seeded row's key is a hash of (seed, number
of tokens the request generated so far), so its sample depends only on its own seed, its own
position and its own logits -- not on which row it is, nor on what else is in the batch; an
unseeded row's key is drawn on the device from the sampler's torch.Generator. The hash is a
32-bit integer mixer (Wellons' "lowbias32": xor-shift / multiply rounds) written in int64 torch
ops with every product kept below 2^48 (so it is exact on every backend; torch has no uint32
arithmetic for this), giving 24-bit uniforms. Written by hand because torch's generators are one
stream per torch.Generator: per-row seeded draws with them need a Python loop over the rows.
Cost: about 15 int64 elementwise passes over [B, V] when some row samples (greedy-only batches
skip the noise); a fused kernel (Triton's counter-based RNG) would make it one pass: not done.

Speculative verification (MODEL.md §8), both lossless:
  verify_greedy(draft, target_logits)                  accept while draft == argmax(target)
  accept_rejection(drafts, q, p, keys, cap)            Leviathan/Chen rejection sampling, rows:
      accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection resample
      from norm(max(p_i - q_i, 0)) and stop; if every draft is accepted sample one bonus token
      from p_k. The output is distributed exactly as sampling from the target p token by token.
  accept_greedy(drafts, target_logits, cap)            verify_greedy of a batch of rows
Both return the committed tokens (accepted drafts + one correction or bonus token), so every
verification commits between 1 and k + 1 tokens. Speculative decoding draws from
`params_logits` (the same transform: temperature, min_p, top_k, top_p, as the batched sampler)
with the counter-based noise ("speculative draws" below); penalties are not supported with
speculation (the engine refuses them); its logprobs come from `token_logprobs` over the
verification's target rows.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

import torch

from v41graph.model.metadata import upload

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _is_integer(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def _token_ids(name: str, value) -> tuple:
    if isinstance(value, (str, bytes, numbers.Number)) or not hasattr(value, "__iter__"):
        raise TypeError(f"SamplingParams.{name} must be a sequence of token ids, got {value!r}")
    ids = list(value)
    bad = [t for t in ids if not _is_integer(t)]
    if bad:
        raise TypeError(f"SamplingParams.{name} must hold integers, got {bad[0]!r}")
    if any(t < 0 for t in ids):
        raise ValueError(f"SamplingParams.{name} must hold token ids >= 0, got {min(ids)}")
    return tuple(int(t) for t in ids)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy (argmax)
    top_p: float = 1.0                # nucleus sampling mass, (0, 1]
    max_tokens: int = 16              # generated tokens, >= 1
    stop_ids: Sequence[int] | None = None     # alias of stop_token_ids
    seed: int | None = None           # per-request seed (None: the engine's generator)
    top_k: int = 0                    # keep the k most likely tokens; 0 or -1: all
    min_p: float = 0.0                # drop tokens below min_p * the largest probability, [0, 1]
    repetition_penalty: float = 1.0   # > 0; 1 = off (prompt + output tokens)
    presence_penalty: float = 0.0     # [-2, 2]; 0 = off (output tokens)
    frequency_penalty: float = 0.0    # [-2, 2]; 0 = off (output tokens)
    n: int = 1                        # independent samples of the prompt
    logprobs: int | None = None       # None: none; k >= 0: sampled token's + the top k per token
    stop_token_ids: Sequence[int] | None = None   # finish after emitting one of these
    # Stop strings (vLLM's `stop`): the output text ends just before the first one that appears;
    # matched on the detokenized text by runtime/text.py (the engine needs a tokenizer for them).
    stop: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be finite, got {value!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not _is_integer(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_integer(self.top_k):
            raise TypeError(f"SamplingParams.top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be >= 1, or 0 / -1 for all tokens, got {self.top_k}")
        if not _is_integer(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be a positive integer, got {self.n!r}")
        if self.logprobs is not None and (not _is_integer(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and not _is_integer(self.seed):
            raise TypeError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        stop = None if self.stop_token_ids is None else _token_ids("stop_token_ids", self.stop_token_ids)
        alias = None if self.stop_ids is None else _token_ids("stop_ids", self.stop_ids)
        if stop is not None and alias is not None and stop != alias:
            raise ValueError(f"SamplingParams.stop_ids is an alias of stop_token_ids: give one, or the "
                             f"same ids to both (got {list(alias)} and {list(stop)})")
        stop = stop if stop is not None else (alias if alias is not None else ())
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "stop_ids", stop)
        if isinstance(self.stop, str) or not hasattr(self.stop, "__iter__"):
            raise TypeError(f"SamplingParams.stop must be a sequence of strings, got {self.stop!r}")
        stop_strings = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {stop_strings!r}")
        object.__setattr__(self, "stop", stop_strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def samples(self) -> list:
        """The params of each of the n samples: n=1 and, with a seed, seed + index (vLLM's rule),
        so the samples differ and each is reproducible."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        seed = self.seed
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        return torch.Generator(device=device).manual_seed(int(seed) % 2 ** 64)


# ---------------------------------------------------------------------------- the transforms
def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits [B, V] fp32; prompt_mask [B, V] bool (token in the prompt);
    output_counts [B, V] (times generated so far); the penalties [B]."""
    seen = prompt_mask | (output_counts > 0)
    r = torch.where(seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  min_p: torch.Tensor, use_min_p: bool = True, use_top_k_p: bool = True) -> torch.Tensor:
    """logits [B, V] fp32 (penalized) -> the logits sampling draws from: divided by temperature
    (rows with temperature 0 by 1: their result is only used for processed logprobs), then
    min_p, top_k (0 = all), top_p, filtered tokens set to -inf. Per-row parameters [B].
    use_min_p / use_top_k_p=False skip those steps (the caller knows no row uses them)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits / t[:, None]
    if use_min_p:
        probs = torch.softmax(x, -1)
        floor = min_p[:, None] * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < floor, -math.inf)
    if use_top_k_p:
        v = x.shape[-1]
        sx, order = x.sort(dim=-1, descending=True, stable=True)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).clamp(1, v)
        kth = sx.gather(1, (k - 1)[:, None])
        sx = sx.masked_fill(sx < kth, -math.inf)
        ps = torch.softmax(sx, -1)
        before = ps.cumsum(-1) - ps                      # mass strictly before each token
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)   # the first token is always kept
        sx = sx.masked_fill(drop, -math.inf)
        x = torch.empty_like(x).scatter_(1, order, sx)
    return x


def filter_logits_uniform(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                          min_p: float = 0.0) -> torch.Tensor:
    """`filter_logits` with one set of parameters for every row of logits [N, V] (fp32), the
    steps no row uses skipped."""
    rows = logits.float()
    n = rows.shape[0]

    def full(value, dtype=torch.float32):
        return torch.full((n,), value, dtype=dtype, device=rows.device)
    return filter_logits(rows, full(float(temperature)), full(float(top_p)), full(int(top_k), torch.int64),
                         full(float(min_p)), use_min_p=min_p > 0, use_top_k_p=top_k > 0 or top_p < 1.0)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                      min_p: float = 0.0) -> torch.Tensor:
    """The distribution one request samples from (no penalties): `filter_logits` with these
    parameters for every row, softmaxed. logits [..., V] -> fp32 probabilities [..., V].
    temperature 0 gives the one-hot of the argmax."""
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = filter_logits_uniform(logits.reshape(-1, logits.shape[-1]), temperature, top_p, top_k, min_p)
    return torch.softmax(x, -1).reshape(logits.shape)


def params_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the filtered logits a request samples from (temperature, min_p, top_k,
    top_p; its penalties are not applied)."""
    return filter_logits_uniform(logits, params.temperature, params.top_p, params.top_k, params.min_p)


def params_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """probs_from_logits with a request's parameters (its penalties are not applied)."""
    return probs_from_logits(logits, params.temperature, params.top_p, params.top_k, params.min_p)


# ---------------------------------------------------------------------------- counter-based noise
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), in two 16-bit halves of c: every product stays
    below 2^48, so no int64 overflow on any backend."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (Wellons' lowbias32) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys in [0, 2^32) of (seed, step)."""
    return _mix32(_mix32(_mix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ step)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [B] -> [B, V] fp32 uniforms in (0, 1) (24 bits), element (b, i) = a hash of
    (keys[b], i) only: mix32(mix32(i) ^ key). One mixer round per element (the column's own
    hash is [V], computed once per call); lowbias32 avalanches fully, so rows of different keys
    look independent (tested: chi-square of joint draws)."""
    col = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=keys.device))
    h = _mix32(col[None, :] ^ keys[:, None])
    return ((h >> 8).float() + 0.5) * (2.0 ** -24)


def noise_race(logp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One draw per row of [B, V] log-weights (-inf = excluded) with the rows' noise keys [B]:
    the exponential race, argmax log(p / E) with E = -log(u)."""
    return (logp - torch.log(-torch.log(uniform_noise(keys, logp.shape[-1])))).argmax(-1)


def split_seed(seed: int) -> tuple[int, int]:
    """A Python int seed (any size, any sign) -> its 64 bits as (low, high) 32-bit halves."""
    s = int(seed) % 2 ** 64
    return s & _M32, s >> 32


# ---------------------------------------------------------------------------- batched sampling
@dataclass
class SamplingTensors:
    """Per-row parameters of one batch on the device ([B] each), plus what the host knows about
    the batch (which steps some row needs), so the sampler can skip the rest without a sync."""
    temperature: torch.Tensor          # fp32
    top_p: torch.Tensor                # fp32
    top_k: torch.Tensor                # int64, 0 = all
    min_p: torch.Tensor                # fp32
    repetition_penalty: torch.Tensor   # fp32
    presence_penalty: torch.Tensor     # fp32
    frequency_penalty: torch.Tensor    # fp32
    keys: torch.Tensor                 # [B] int64: the rows' noise keys (seeded or drawn)
    prompt_mask: torch.Tensor | None = None      # [B, V] bool, when some row is penalized
    output_counts: torch.Tensor | None = None    # [B, V] int32, when some row is penalized
    all_greedy: bool = False
    use_min_p: bool = True
    use_top_k_p: bool = True
    num_logprobs: int | None = None    # the most any row asked for (None: no row)
    penalty_slots: torch.Tensor | None = None    # [B] the rows' slots in the PenaltyState


@dataclass
class SampleOutput:
    """Device tensors of one batched draw: ids [B] int64; with logprobs: logprob [B] of the
    sampled token, top_ids / top_logprobs [B, K]."""
    ids: torch.Tensor
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample_logits(logits: torch.Tensor, st: SamplingTensors,
                  logprobs_mode: str = "raw_logprobs") -> SampleOutput:
    """One token for every row of logits [B, V], all on the device, no host sync: penalties,
    greedy argmax for temperature-0 rows, temperature / min_p / top_k / top_p and the
    exponential race for the others; logprobs if some row wants them."""
    raw = logits.float()
    x = raw
    if st.prompt_mask is not None:
        x = apply_penalties(x, st.prompt_mask, st.output_counts, st.repetition_penalty,
                            st.presence_penalty, st.frequency_penalty)
    ids = x.argmax(-1)
    filtered = None
    if not st.all_greedy or (st.num_logprobs is not None and logprobs_mode == "processed_logprobs"):
        filtered = filter_logits(x, st.temperature, st.top_p, st.top_k, st.min_p,
                                 st.use_min_p, st.use_top_k_p)
    if not st.all_greedy:
        ids = torch.where(st.temperature > 0, noise_race(filtered, st.keys), ids)
    out = SampleOutput(ids)
    if st.num_logprobs is not None:
        lp = torch.log_softmax(raw if logprobs_mode == "raw_logprobs" else filtered, -1)
        out.logprob = lp.gather(1, ids[:, None])[:, 0]
        if st.num_logprobs > 0:
            out.top_logprobs, out.top_ids = lp.topk(st.num_logprobs, -1)
    return out


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict | None = None       # {token id: logprob}: the sampled token first, then the top k


def _logprob_dict(token: int, logprob: float, top_ids: Sequence, top_logprobs: Sequence, k: int) -> dict:
    """{token id: logprob}: the chosen token first, then the k most likely (vLLM's layout)."""
    out = {token: logprob}
    for t, v in zip(top_ids[:k], top_logprobs[:k]):
        out.setdefault(int(t), v)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], params: SamplingParams,
                   logprobs_mode: str = "raw_logprobs") -> list:
    """One {token id: logprob} per row of logits [m, V] for the token chosen at that row, by the
    rule `sample_logits` reports with (no penalties: speculation, which calls this for its
    committed tokens, refuses them)."""
    x = logits.float()
    if logprobs_mode == "processed_logprobs":
        x = params_logits(x, params)
    lp = torch.log_softmax(x, -1)
    k = params.logprobs or 0
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    top_lp, top_ids = lp.topk(k, -1) if k else (lp[:, :0], lp[:, :0].long())
    return [_logprob_dict(t, c, i, v, k) for t, c, i, v in
            zip(token_ids, chosen, top_ids.tolist(), top_lp.tolist())]


class PenaltyState:
    """Per cache slot, on the device: the tokens of the request's prompt (mask) and how often it
    generated each token (counts), kept across steps so a step uploads nothing for them.
    Allocated on the first penalized request ([slots, V] int32 + bool)."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.prompt_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, upload(torch.tensor(list(prompt), dtype=torch.int64), self.prompt_mask.device)] = True
        self.output_counts[slot] = 0


class BatchSampler:
    """Samples one token per row for the engine: builds the rows' `SamplingTensors` (one upload),
    runs `sample_logits`, updates the penalty counts on the device and copies the result to the
    host once. Unseeded rows draw their noise keys from `generator` (on the device)."""

    def __init__(self, vocab_size: int, num_slots: int, device, logprobs_mode: str = "raw_logprobs",
                 generator: torch.Generator | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.vocab_size, self.num_slots = vocab_size, num_slots
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(
                int(torch.randint(0, 2 ** 62, (1,)).item()))
        self.generator = generator
        self.penalties: PenaltyState | None = None

    def tensors(self, params: Sequence[SamplingParams], slots: Sequence[int], prompts: Sequence,
                num_generated: Sequence[int]) -> SamplingTensors:
        """The rows' parameters as device tensors. num_generated[i]: tokens row i's request has
        generated so far (its seeded noise position); a penalized row with 0 starts its
        penalty state from prompts[i]."""
        b, dev = len(params), self.device
        host = []
        for p, n in zip(params, num_generated):
            lo, hi = split_seed(0 if p.seed is None else p.seed)
            host.append([p.temperature, p.top_p, p.top_k if p.top_k > 0 else 0, p.min_p,
                         p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                         lo, hi, n & _M32, p.seed is not None])
        cols = upload(torch.tensor(host, dtype=torch.float64), dev).unbind(1)   # one upload, exact
        f32 = [c.float() for c in cols[:7]]
        lo, hi, step, seeded = (c.long() for c in cols[7:])
        keys = row_keys(lo, hi, step)
        if not all(p.seed is not None for p in params):
            drawn = torch.randint(0, 2 ** 32, (b,), generator=self.generator, device=dev)
            keys = torch.where(seeded.bool(), keys, drawn)
        st = SamplingTensors(*f32[:2], cols[2].long(), *f32[3:], keys=keys,
                             all_greedy=all(p.greedy for p in params),
                             use_min_p=any(p.min_p > 0 for p in params),
                             use_top_k_p=any((p.top_k > 0 or p.top_p < 1.0) for p in params),
                             num_logprobs=max((p.logprobs for p in params if p.logprobs is not None),
                                              default=None))
        if any(p.penalized for p in params):
            if self.penalties is None:
                self.penalties = PenaltyState(self.num_slots, self.vocab_size, dev)
            for p, slot, prompt, n in zip(params, slots, prompts, num_generated):
                if p.penalized and n == 0:
                    self.penalties.start(slot, prompt)
            rows = upload(torch.tensor(list(slots), dtype=torch.int64), dev)
            st.prompt_mask = self.penalties.prompt_mask.index_select(0, rows)
            st.output_counts = self.penalties.output_counts.index_select(0, rows)
            st.penalty_slots = rows
        return st

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], slots: Sequence[int],
               prompts: Sequence, num_generated: Sequence[int]) -> list:
        """One `SampledToken` per row of logits [B, V] (see `tensors` for the other arguments)."""
        if all(p.greedy and p.logprobs is None and not p.penalized for p in params):
            # argmax only (sample_logits's greedy rows): no parameter upload, which costs ~1 ms
            # of small copies and launches per step on the H200 (scripts/bench_sampling.py)
            return [SampledToken(t) for t in logits.float().argmax(-1).tolist()]
        st = self.tensors(params, slots, prompts, num_generated)
        out = sample_logits(logits, st, self.logprobs_mode)
        if st.prompt_mask is not None:       # count the new tokens (rows without penalties too:
            self.penalties.output_counts.index_put_(      # their slot is reset when one starts)
                (st.penalty_slots, out.ids), torch.ones_like(out.ids, dtype=torch.int32), accumulate=True)
        if out.logprob is None:
            return [SampledToken(t) for t in out.ids.tolist()]
        parts = [out.ids[:, None].double(), out.logprob[:, None].double()]
        if out.top_ids is not None:
            parts += [out.top_ids.double(), out.top_logprobs.double()]
        rows = torch.cat(parts, 1).tolist()           # the one device-to-host copy
        k = 0 if out.top_ids is None else out.top_ids.shape[1]
        result = []
        for p, row in zip(params, rows):
            tok = int(row[0])
            if p.logprobs is None:
                result.append(SampledToken(tok))
                continue
            result.append(SampledToken(tok, _logprob_dict(tok, row[1], row[2:2 + k], row[2 + k:], p.logprobs)))
        return result


# ---------------------------------------------------------------------------- one row
def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D distribution (inverse CDF with one uniform draw)."""
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True).item())
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:      # guard against landing on a zero-mass tail token
        idx -= 1
    return idx


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from one logits row [V] with a torch.Generator (no penalties; the
    speculative decoder's draws)."""
    if logits.dim() != 1:
        raise ValueError(f"sample takes one logits row [V], got shape {list(logits.shape)}")
    if params.greedy:
        return int(logits.argmax().item())
    return _draw(params_probs(logits, params), generator)


# ---------------------------------------------------------------------------- verification
def verify_greedy(draft_ids: Sequence[int], target_logits: torch.Tensor) -> list[int]:
    """draft_ids [k]; target_logits [k + 1, V] (row i scores the token after draft i - 1, i.e.
    row 0 the position of draft 0). Accept drafts while they equal the target's argmax, then
    add the target's own token (correction, or the bonus when all k are accepted)."""
    k = len(draft_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} target rows, got {target_logits.shape[0]}")
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(draft_ids):
        if int(d) != best[i]:
            break
        out.append(int(d))
    out.append(best[len(out)])
    return out


# ---------------------------------------------------------------------------- speculative draws
# Speculative decoding draws with the same counter-based noise as the batched sampler: a step
# key per row = row_keys(seed, tokens generated so far), and a tag per draw of that step (draft
# j: DRAFT_TAG + j, the acceptance of draft j: ACCEPT_TAG + j, the final correction / bonus
# token: FINAL_TAG) mixed into it. So the reference decoder (speculative.py) and the static
# step (speculative_graph.py) make the same draws from the same logits, and a seeded request's
# tokens never depend on its batch. Unseeded requests get one seed drawn from their generator.
DRAFT_TAG, ACCEPT_TAG, FINAL_TAG = 1, 17, 33


def noise_tag(keys: torch.Tensor, tag: int) -> torch.Tensor:
    """The keys [B] of one draw of the step (see above)."""
    return _mix32(keys ^ tag)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor, cap: torch.Tensor):
    """drafts [B, k]; target_logits [B, k + 1, V]; cap [B] (most drafts that may commit).
    -> (committed [B, k + 1] (-1 after the last), count [B] = accepted + 1). verify_greedy of
    every row at once."""
    k = drafts.shape[1]
    best = target_logits.argmax(-1)                                          # [B, k + 1]
    ok = (drafts == best[:, :k]) & (torch.arange(k, device=drafts.device) < cap[:, None])
    m = ok.to(torch.int64).cumprod(1).sum(1)                                 # leading accepts
    return _commit(drafts, best.gather(1, m[:, None])[:, 0], m)


def accept_rejection(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, keys: torch.Tensor,
                     cap: torch.Tensor):
    """Rejection sampling of every row: drafts [B, k] drawn from q [B, k, V]; p [B, k + 1, V]
    the target's distributions; keys [B] the rows' step keys; cap [B]. -> (committed, count).
    Distributed exactly as sampling p token by token."""
    b, k = drafts.shape
    dev = drafts.device
    if k == 0:           # nothing to verify: one draw from p
        return _commit(drafts, noise_race(p[:, 0].log(), noise_tag(keys, FINAL_TAG)),
                       torch.zeros(b, dtype=torch.int64, device=dev))
    j = torch.arange(k, device=dev)
    qd = q.gather(2, drafts[..., None])[..., 0].double()
    pd = p[:, :k].gather(2, drafts[..., None])[..., 0].double()
    u = torch.stack([uniform_noise(noise_tag(keys, ACCEPT_TAG + i), 1)[:, 0] for i in range(k)], 1).double()
    ok = (u * qd < pd) & (j < cap[:, None])
    m = ok.to(torch.int64).cumprod(1).sum(1)
    rejected = m < cap.clamp_max(k)              # stopped at a rejection, not at the cap
    pm = p.gather(1, m[:, None, None].expand(b, 1, p.shape[2]))[:, 0]        # [B, V]
    qm = q.gather(1, m.clamp_max(k - 1)[:, None, None].expand(b, 1, q.shape[2]))[:, 0]
    residual = (pm - qm).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pm)  # p == q: from p
    final = noise_race(torch.where(rejected[:, None], residual, pm).log(), noise_tag(keys, FINAL_TAG))
    return _commit(drafts, final, m)


def _commit(drafts: torch.Tensor, final: torch.Tensor, m: torch.Tensor):
    """The committed tokens [B, k + 1] (m accepted drafts, then `final`, then -1) and their count."""
    b, k = drafts.shape
    j = torch.arange(k + 1, device=drafts.device)
    toks = torch.cat([drafts, final[:, None]], 1)
    committed = torch.where(j < m[:, None], toks, torch.where(j == m[:, None], final[:, None], -1))
    return committed, m + 1


__all__ = ["ACCEPT_TAG", "DRAFT_TAG", "FINAL_TAG", "accept_greedy", "accept_rejection", "noise_race",
           "noise_tag", "BatchSampler", "LOGPROBS_MODES", "SampleOutput", "SampledToken", "SamplingParams", "SamplingTensors",
           "apply_penalties", "filter_logits", "params_probs", "probs_from_logits", "sample", "sample_logits",
           "token_logprobs", "uniform_noise", "verify_greedy"]
