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


def target_expectations(model_dir: str, prompt: str, samples: list[list[int]], temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None, chunk: int = 256):
    """What the target model expects at each sampled position, given each sample's own prefix: (expected, var),
    both [L, V] float64: expected[j, v] = sum over samples i of p(v | prompt, sample_i[:j]) and var the sum of
    p (1 - p), under `temperature` / `top_k` / `top_p` as vLLM applies them. Computed in plain torch (transformers,
    float32) from the samples themselves, so no second sampled run is needed as a reference and the test compares
    with the exact distribution (one-sample: twice the power of comparing two sampled runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = tok(prompt).input_ids
    length = len(samples[0])
    assert all(len(s) == length for s in samples), "every sample needs the same length (ignore_eos)"
    expected = var = None
    for at in range(0, len(samples), chunk):
        part = torch.tensor([prompt_ids + s[:-1] for s in samples[at:at + chunk]])
        with torch.no_grad():
            logits = model(part).logits[:, len(prompt_ids) - 1:].double()  # [n, L, V]: position j predicts s[j]
        p = torch.softmax(_top_k_top_p(logits / temperature, top_k, top_p), dim=-1)
        e, v = p.sum(0), (p * (1 - p)).sum(0)
        expected, var = (e, v) if expected is None else (expected + e, var + v)
    return expected, var


def _top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """vLLM's rule: the k largest logits stay; then the smallest set of the most probable tokens whose probability
    reaches top_p (the most probable always stays)."""
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        srt, idx = logits.sort(dim=-1, descending=False)
        cum = torch.softmax(srt, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def sampled_positions_pvalues(samples: list[list[int]], expected: torch.Tensor, var: torch.Tensor,
                              min_expected: float = 5.0) -> list[float]:
    """Per sampled position: is it drawn from the target's conditional distribution (target_expectations)?
    Two tests, Bonferroni-combined: Pearson's chi-square over tokens (rare ones pooled into one cell), and the
    largest standardised deviation of any one token's count (|O - E| / sd, Bonferroni over tokens), which catches
    a 5-point shift in any single token's probability with 2000 samples. Tokens the target gives probability 0
    (outside top-k / top-p) must never be sampled: p = 0 if one is."""
    out = []
    counts = torch.zeros_like(expected)
    for j in range(expected.shape[0]):
        for s in samples:
            counts[j, s[j]] += 1
    for j in range(expected.shape[0]):
        o, e, v = counts[j], expected[j], var[j]
        if o[e <= 0].sum() > 0:
            out.append(0.0)
            continue
        common = e >= min_expected
        cells_o = torch.cat([o[common], o[~common].sum()[None]])
        cells_e = torch.cat([e[common], e[~common].sum()[None]])
        cells_v = torch.cat([v[common], v[~common].sum()[None]])
        keep = cells_e > 0
        cells_o, cells_e, cells_v = cells_o[keep], cells_e[keep], cells_v[keep]
        stat = ((cells_o - cells_e) ** 2 / cells_e).sum()
        dof = len(cells_e) - 1
        p_chi = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2)) if dof else 1.0
        z = ((cells_o - cells_e).abs() / cells_v.clamp(min=1e-12).sqrt()).max()
        p_z = min(1.0, len(cells_e) * float(torch.special.erfc(z / 2 ** 0.5)))
        out.append(min(1.0, 2 * min(p_chi, p_z)))
    return out
