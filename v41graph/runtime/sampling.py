"""Sampling and lossless speculative verification.

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, stop_ids=(1,), seed=7)
    g = params.make_generator()                    # one torch.Generator per request
    tok = sample(logits_row, params, g)            # greedy when temperature == 0

Every random draw of a request comes from its own `torch.Generator` (seeded from
`SamplingParams.seed`), so a request's tokens do not depend on what else is in the batch.

Speculative verification (MODEL.md §8), both lossless:
  verify_greedy(draft, target_logits)                  accept while draft == argmax(target)
  verify_rejection(draft, draft_probs, target_probs, g)  Leviathan/Chen rejection sampling:
      accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection resample
      from norm(max(p_i - q_i, 0)) and stop; if every draft is accepted sample one bonus token
      from p_k. The output is distributed exactly as sampling from the target p token by token.
Both return the committed tokens (accepted drafts + one correction or bonus token), so every
verification commits between 1 and k + 1 tokens.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy (argmax)
    top_p: float = 1.0                # nucleus sampling mass, (0, 1]
    max_tokens: int = 16              # generated tokens, >= 1
    stop_ids: Sequence[int] = field(default_factory=tuple)   # finish after emitting one of these
    seed: int | None = None           # per-request generator seed (None: drawn from torch's RNG)
    # Stop strings (vLLM's `stop`): the output text ends just before the first one that appears;
    # matched on the detokenized text by runtime/text.py (the engine needs a tokenizer for them).
    stop: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise TypeError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop_ids, (str, bytes, numbers.Number)) or not hasattr(self.stop_ids, "__iter__"):
            raise TypeError(f"SamplingParams.stop_ids must be a sequence of token ids, got {self.stop_ids!r}")
        stop = list(self.stop_ids)
        bad = [t for t in stop if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise TypeError(f"SamplingParams.stop_ids must hold integers, got {bad[0]!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in stop))
        if isinstance(self.stop, str) or not hasattr(self.stop, "__iter__"):
            raise TypeError(f"SamplingParams.stop must be a sequence of strings, got {self.stop!r}")
        stop_strings = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {stop_strings!r}")
        object.__setattr__(self, "stop", stop_strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        seed = self.seed
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        return torch.Generator(device=device).manual_seed(int(seed))


# ---------------------------------------------------------------------------- distributions
def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), restricted to the smallest set
    of most likely tokens whose mass reaches top_p, renormalized. logits [..., V] -> fp32
    probabilities [..., V]. temperature 0 gives the one-hot of the argmax."""
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass strictly before each token
        keep_sorted = before < top_p                      # the first token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
    """One token id from one logits row [V]."""
    if logits.dim() != 1:
        raise ValueError(f"sample takes one logits row [V], got shape {list(logits.shape)}")
    if params.greedy:
        return int(logits.argmax().item())
    return _draw(probs_from_logits(logits, params.temperature, params.top_p), generator)


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of logits [B, V]; greedy rows share one argmax (one host sync)."""
    greedy = logits.argmax(-1).tolist()
    return [greedy[i] if p.greedy else sample(logits[i], p, g)
            for i, (p, g) in enumerate(zip(params, generators))]


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


def verify_rejection(draft_ids: Sequence[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Lossless rejection sampling. draft_ids [k] drawn from draft_probs [k, V] (q);
    target_probs [k + 1, V] (p). Returns the committed tokens (1 .. k + 1)."""
    k = len(draft_ids)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got "
                         f"{draft_probs.shape[0]} and {target_probs.shape[0]}")
    p_all, q_all = target_probs.double(), draft_probs.double()
    out = []
    for i, d in enumerate(draft_ids):
        d = int(d)
        p, q = p_all[i], q_all[i]
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        # accept with probability min(1, p/q)  <=>  u * q < p
        if float(u) * float(q[d]) < float(p[d]):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) <= 0:        # p == q numerically: resample from p itself
            residual = p
        out.append(_draw(residual / residual.sum(), generator))
        return out
    out.append(_draw(p_all[k], generator))   # bonus token
    return out


__all__ = ["SamplingParams", "probs_from_logits", "sample", "sample_batch", "verify_greedy",
           "verify_rejection"]
