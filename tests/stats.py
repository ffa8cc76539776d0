"""Goodness-of-fit helper shared by the distribution tests (no scipy)."""

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of `counts` against `probs`; outcomes of probability 0 must never occur."""
    counts, probs = counts.double(), probs.double()
    impossible = probs <= 0
    if counts[impossible].sum() > 0:
        return 0.0
    counts, probs = counts[~impossible], probs[~impossible]
    expected = probs / probs.sum() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0, dtype=torch.float64), stat / 2))


def two_sample_chi2_pvalue(a: list, b: list, min_count: int = 5) -> float:
    """Do samples `a` and `b` (hashable outcomes) come from one distribution? Rare outcomes pooled."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    common = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    rows = [[ca[k] for k in common] + [len(a) - sum(ca[k] for k in common)],
            [cb[k] for k in common] + [len(b) - sum(cb[k] for k in common)]]
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))
