"""Statistics the sampling tests share."""
from __future__ import annotations

import torch


def chi2_pvalue(counts, probs) -> float:
    """p-value of Pearson's chi-square test of draw `counts` against the distribution `probs`
    (tokens with no expected mass must have no draws)."""
    counts, probs = torch.as_tensor(counts).double().flatten(), torch.as_tensor(probs).double().flatten()
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "samples where the target has no mass"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
