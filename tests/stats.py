"""Goodness-of-fit helpers shared by the distribution tests (no scipy)."""

import copy
import math

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


def target_topk(model_dir: str, prompt: str, samples: list[list[int]], temperature: float, top_k: int,
                top_p: float | None = None, chunk: int = 256, min_p: float = 0.0, allowed=None):
    """The target's distribution at every sampled position, given each sample's own prefix, under `temperature` /
    `min_p` / `top_k` / `top_p` as vLLM applies them, after a grammar's mask when `allowed` is given (sample ->
    [L, V] bool, the tokens its grammar allows at each position): (ids, probs), both [N, L, top_k] (probabilities
    outside the top-k are 0). Plain torch (transformers, float32): the prompt's KV is computed once and each chunk
    of samples runs only its own tokens on top of it; distinct samples only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = torch.tensor([tok(prompt).input_ids])
    length = len(samples[0])
    assert all(len(s) == length for s in samples), "every sample needs the same length (ignore_eos)"
    distinct = sorted(set(map(tuple, samples)))
    where = {s: i for i, s in enumerate(distinct)}
    with torch.no_grad():
        out = model(prompt_ids, use_cache=True)
        first = out.logits[0, -1]  # [V]: the first sampled position, the same for every sample
        ids, probs = [], []
        for at in range(0, len(distinct), chunk):
            part = torch.tensor([s[:-1] for s in distinct[at:at + chunk]])  # [n, L - 1]
            cache = copy.deepcopy(out.past_key_values)
            cache.batch_repeat_interleave(len(part))
            later = model(part, past_key_values=cache, use_cache=True).logits  # [n, L - 1, V]
            logits = torch.cat([first.expand(len(part), 1, -1), later], dim=1)  # [n, L, V]
            if allowed is not None:  # vLLM applies the grammar's bitmask before its sampler
                mask = torch.stack([allowed(list(s)) for s in distinct[at:at + chunk]])
                logits = logits.masked_fill(~mask[..., :logits.shape[-1]], -math.inf)
            logits = logits / temperature
            if min_p:  # after temperature, before top-k (vLLM's MinPLogitsProcessor)
                p = torch.softmax(logits, dim=-1)
                logits = logits.masked_fill(p < p.amax(dim=-1, keepdim=True) * min_p, -math.inf)
            top, idx = logits.topk(top_k, dim=-1)  # vLLM: top-k first, then top-p among what is left
            p = torch.softmax(top.double(), dim=-1)
            if top_p is not None:  # keep the most probable tokens until their mass reaches top_p
                before = p.cumsum(dim=-1) - p  # mass of the more probable tokens
                p = torch.where(before < top_p, p, 0.0)
                p = p / p.sum(dim=-1, keepdim=True)
            ids.append(idx)
            probs.append(p)
    ids, probs = torch.cat(ids), torch.cat(probs)
    rows = torch.tensor([where[tuple(s)] for s in samples])
    return ids[rows], probs[rows]


def expectations(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, var) [L, V]: per position, the sum over samples of p(v | its prefix) and of p (1 - p)."""
    n, length, _ = ids.shape
    expected = torch.zeros(length, vocab, dtype=torch.float64)
    var = torch.zeros(length, vocab, dtype=torch.float64)
    for j in range(length):
        expected[j].index_add_(0, ids[:, j].reshape(-1), probs[:, j].reshape(-1))
        var[j].index_add_(0, ids[:, j].reshape(-1), (probs[:, j] * (1 - probs[:, j])).reshape(-1))
    return expected, var


def sampled_positions_pvalues(samples: list[list[int]], expected: torch.Tensor, var: torch.Tensor,
                              min_expected: float = 5.0) -> list[float]:
    """Per sampled position: is it drawn from the target's conditional distribution (target_expectations)?
    Two tests, Bonferroni-combined: Pearson's chi-square over tokens (rare ones pooled into one cell), and the
    largest standardised deviation of any one token's count (|O - E| / sd, Bonferroni over tokens), which catches
    a 5-point shift in any single token's probability with 2000 samples. Tokens the target gives probability 0
    (outside top-k / top-p) must never be sampled: p = 0 if one is."""
    out = []
    counts = torch.zeros_like(expected)
    for j, column in enumerate(torch.tensor(samples).T):
        counts[j].index_add_(0, column, torch.ones(len(column), dtype=counts.dtype))
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


def regex_masks(model_dir: str, regex: str, vocab: int):
    """sample -> [L, vocab] bool: what the regex (xgrammar, vLLM's default structured-output backend) allows at
    each position of the sample, given the tokens before it."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_regex(regex)

    def allowed(sample: list[int]) -> torch.Tensor:
        matcher = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(len(sample), vocab)
        for j, tok in enumerate(sample):
            matcher.fill_next_token_bitmask(bits, j)
            assert matcher.accept_token(tok), (sample, j)  # every sample follows its grammar
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(sample), -1)[:, :vocab]

    return allowed
