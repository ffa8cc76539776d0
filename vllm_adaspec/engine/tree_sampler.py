"""Tree rows' sampling: which requests may be verified as trees, and the runner's rejection sampler wrapped so
that tree requests are verified node by node (trees/verify.py) while chain requests keep vLLM's result."""

from __future__ import annotations

import torch

from vllm_adaspec.trees import DraftTree, verify_greedy, verify_sample_match, verify_typical


def tree_compatible(sp) -> bool:
    """Trees are verified from raw logits with temperature / top-k / top-p only. Anything vLLM's sampler applies
    on top (penalties, logits processors, grammars, logprobs) is chain-only: such requests draft chains."""
    if sp is None:
        return False
    return (sp.presence_penalty == 0 and sp.frequency_penalty == 0 and sp.repetition_penalty == 1
            and sp.min_p == 0 and sp.min_tokens == 0 and sp.logprobs is None and sp.prompt_logprobs is None
            and not sp.logit_bias and not sp.allowed_token_ids and not sp.bad_words
            and sp.structured_outputs is None and not getattr(sp, "watermarking", None)
            and getattr(sp, "thinking_token_budget", None) is None and not getattr(sp, "logprob_token_ids", None))


def verify_tree_request(tree: DraftTree, logits: torch.Tensor, temperature: float, top_k: int | None,
                        top_p: float | None, generator: torch.Generator | None,
                        acceptance=None) -> tuple[list[int], int]:
    """logits [n + 1, V] at the request's verification rows -> (accepted nodes, bonus token).

    Sampling uses sample-and-match, not recursive rejection sampling: the drafters pick a node's children
    deterministically (top-k), and for a fixed set S of distinct children no lossless rule can move on with
    probability above p(S), which sample-and-match reaches. RRS (trees.verify_rrs) pays only for children drawn
    i.i.d. from the draft distribution."""
    if temperature <= 0:  # vLLM's greedy marker
        return verify_greedy(tree, logits.argmax(dim=-1))
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = logits.float() / temperature
    rows = x.shape[0]
    k = None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((rows,), top_p, dtype=torch.float32)
    if k is not None or p is not None:
        x = apply_top_k_top_p(x, k, p)
    if acceptance is not None and acceptance.name == "typical":
        return verify_typical(tree, torch.softmax(x, dim=-1), acceptance.epsilon, acceptance.delta, generator)
    return verify_sample_match(tree, torch.softmax(x, dim=-1), generator)


def accept_one_more(tree: DraftTree, path: list[int], bonus: int, logits: torch.Tensor) -> tuple[list[int], int]:
    """NOT lossless, on purpose (the sampling tests' negative control): accept the first child of the last accepted
    node that verification rejected, and take the argmax of its row as the bonus."""
    last = path[-1] if path else -1
    kids = [j for j, parent in enumerate(tree.parents.tolist()) if parent == last]
    if not kids:
        return path, bonus
    return path + [kids[0]], int(logits[kids[0] + 1].argmax())


class TreeRejectionSampler:
    """Stands in for the runner's rejection sampler: vLLM's for chain rows, tree verification for tree rows (the
    tree runtime's step), then KV compaction. `on_logits(logits, metadata)`: every verified row's logits, after
    verification (for drafters that read them)."""

    def __init__(self, stock, runtime, acceptance=None, on_logits=None):
        self.stock = stock
        self.runtime = runtime  # engine/tree_runtime.TreeRuntime, or None (chains only)
        self.acceptance = acceptance  # config.Acceptance: "exact" (lossless) or "typical" (lossy, opt-in)
        self.on_logits = on_logits

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        out = self.stock(metadata, draft_probs, logits, sampling_metadata)
        step = self.runtime.take_step() if self.runtime is not None else None
        if step is not None:
            self._verify_trees(step, out.sampled_token_ids, metadata, logits, sampling_metadata)
        if self.on_logits is not None:
            self.on_logits(logits, metadata)
        return out

    def __getattr__(self, name):  # everything else (warm-up hooks, logprobs helpers) is vLLM's
        return getattr(self.stock, name)

    def _verify_trees(self, step, tokens, metadata, logits, sampling_metadata) -> None:
        """tokens [B, max_spec_len + 1] int32, -1 padded: vLLM's result, rewritten for the tree rows.

        Faults are contained (faults.py). A request whose verification fails keeps only vLLM's first token: its root
        row attends to the prefix and itself alone, so that token is the one plain decoding samples there (the chain
        verdict on its other rows is not: they were computed under the tree mask). A fault in compaction turns every
        tree request of the step into that: positions past root + 1 are then scratch, whatever was moved there."""
        cu = metadata.cu_num_draft_tokens.tolist()
        target_idx, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        temps = sampling_metadata.temperature
        faults = self.runtime.faults
        results = {}
        for r in step.requests:
            i = r.row
            try:
                faults.point("tree_verify")
                first = cu[i - 1] if i else 0
                rows = torch.cat([target_idx[first:cu[i]], bonus_idx[i:i + 1]])
                t = 0.0 if sampling_metadata.all_greedy or temps is None else float(temps[i])
                k = None if sampling_metadata.top_k is None else int(sampling_metadata.top_k[i])
                p = None if sampling_metadata.top_p is None else float(sampling_metadata.top_p[i])
                m = r.num_verified  # the verified nodes; rows past them are draft branches, only read
                tree = r.tree if m == len(r.tree) else DraftTree(r.tree.tokens[:m], r.tree.parents[:m])
                generator = sampling_metadata.generators.get(i)
                path, bonus = verify_tree_request(tree, logits[rows[:m + 1]], t, k, p, generator, self.acceptance)
                if faults.biased(generator):  # the sampling tests' negative control only (faults.py)
                    path, bonus = accept_one_more(tree, path, bonus, logits[rows[:m + 1]])
                predicted = logits[rows[m + 1:]].argmax(dim=-1).tolist() if m < len(r.tree) else []
                row = torch.tensor(r.tree.tokens[path].tolist() + [bonus], dtype=tokens.dtype)
            except Exception as e:  # vLLM's first token stands, nothing more
                faults.record(f"verifying request {r.req_id}'s token tree", e)
                path, row, predicted = [], tokens[i, :1].clone(), []
            tokens[i].fill_(-1)
            tokens[i, :len(row)] = row
            results[i] = (path, int(row[-1]), predicted)
        try:
            self.runtime.finish_step(step, results)
        except Exception as e:
            faults.record("compacting the accepted tree nodes' KV", e)
            for r in step.requests:
                tokens[r.row, 1:] = -1
            self.runtime.drop([r.req_id for r in step.requests])  # their copies are rebuilt from the paged cache
            self.runtime.results = {r.row: ([], int(tokens[r.row, 0]), []) for r in step.requests}
            self.runtime.kv_moves = 0
