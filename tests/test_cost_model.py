"""The step cost model (policies/cost_model.py): fits the engine's step times by rows, per batch-size bucket."""

import random

import pytest

from vllm_adaspec.policies.cost_model import PER_REQUEST_PRIOR, DraftCost, StepCostModel, prior_curve

PRIOR = {1: 1.0, 2: 1.07, 3: 1.14, 4: 1.29, 5: 1.38, 8: 1.47, 16: 1.79, 32: 2.4, 64: 4.17, 136: 7.45}


def machine(rows: float, batch: int = 1) -> float:
    """A made-up engine unlike the prior: 20 ms flat up to 4 rows, a jump at 5, then 1.5 ms per row."""
    return 0.020 + (0.008 if rows >= 5 else 0.0) + 0.0015 * max(0, rows - 5) + 0.001 * (batch - 1)


def test_prior_curve_interpolates_and_extends_the_last_slope():
    f = prior_curve({1: 1.0, 3: 2.0, 5: 2.5})
    assert f(1) == 1.0 and f(2) == pytest.approx(1.5) and f(7) == pytest.approx(3.0)


def test_before_any_step_the_prior_shape_decides():
    m = StepCostModel(PRIOR)
    assert m.predict(1, 16) / m.predict(1, 1) == pytest.approx(1.79, rel=1e-6)
    per = 7 * PER_REQUEST_PRIOR  # batch 8: seven requests more than the prior's unit step
    assert m.predict(8, 64) / m.predict(8, 8) == pytest.approx((4.17 + per) / (1.47 + per), rel=1e-6)


def test_fit_recovers_a_curve_unlike_the_prior_where_steps_were_seen():
    rng = random.Random(0)
    m = StepCostModel(PRIOR)
    for _ in range(600):
        rows = rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 17])
        m.observe(1, rows, machine(rows) * rng.uniform(0.97, 1.03))
    for rows in (1, 2, 3, 4, 5, 6, 8, 12, 17):
        assert m.predict(1, rows) == pytest.approx(machine(rows), rel=0.04), rows
    # the jump at 5 rows is learned: 4 -> 5 costs far more than 3 -> 4 (the prior has it the other way round)
    c = m.curve(1)
    assert c(5) - c(4) > 3 * (c(4) - c(3))


def test_outliers_do_not_bend_the_curve():
    rng = random.Random(1)
    m = StepCostModel(PRIOR)
    for k in range(800):
        rows = rng.choice([1, 2, 3, 4, 6])
        t = machine(rows) * rng.uniform(0.98, 1.02)
        m.observe(1, rows, t * 10 if k % 20 == 7 else t)  # 5% of steps stalled (a collection, the OS)
    for rows in (1, 2, 3, 4, 6):
        assert m.predict(1, rows) == pytest.approx(machine(rows), rel=0.06), rows


def test_buckets_are_fitted_apart_and_a_new_bucket_starts_from_the_prior_at_the_machines_scale():
    m = StepCostModel(PRIOR)
    for _ in range(300):
        m.observe(1, 1, 0.030)
        m.observe(1, 3, 0.031)
    # batch 8 has no data: the prior's shape at the scale batch 1 measured (30 ms for its 1-row step)
    assert m.predict(8, 8) == pytest.approx(0.030 * (1.47 + 7 * PER_REQUEST_PRIOR), rel=0.05)
    for _ in range(300):
        m.observe(8, 8, 0.080)
        m.observe(8, 16, 0.090)
    assert m.predict(8, 8) == pytest.approx(0.080, rel=0.03)
    assert m.predict(1, 1) == pytest.approx(0.030, rel=0.03)  # batch 1 unchanged by batch 8's steps


def test_tree_rows_are_priced_apart_from_chain_rows():
    rng = random.Random(2)
    m = StepCostModel(PRIOR)
    for _ in range(600):
        rows = rng.choice([1, 3, 5, 9])
        tree = rows > 1 and rng.random() < 0.5
        extra = (0.004 + 0.0005 * (rows - 1)) if tree else 0.0  # per tree request + per tree row
        m.observe(1, rows, machine(rows) + extra, tree_requests=int(tree), tree_rows=(rows - 1) if tree else 0)
    assert m.tree_extra(1, 1, 8) == pytest.approx(0.004 + 0.0005 * 8, rel=0.2)
    assert m.predict(1, 9) == pytest.approx(machine(9), rel=0.05)


def test_it_follows_the_machine_when_its_speed_changes():
    m = StepCostModel(PRIOR)
    for _ in range(400):
        m.observe(1, 2, 0.020)
    for _ in range(1500):  # the machine became 1.5x slower
        m.observe(1, 2, 0.030)
    assert m.predict(1, 2) == pytest.approx(0.030, rel=0.05)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_meaningless_steps_are_ignored(bad):
    m = StepCostModel(PRIOR)
    m.observe(1, 2, bad)
    m.observe(0, 2, 0.02)
    m.observe(4, 2, 0.02)  # fewer rows than requests
    assert m.observations == 0 and m.unit is None


def test_decisions_are_optimistic_only_where_steps_were_not_seen():
    rng = random.Random(3)
    m = StepCostModel(PRIOR)
    for _ in range(400):
        rows = rng.choice([1, 2, 3])
        m.observe(1, rows, machine(rows) * rng.uniform(0.95, 1.05))
    c = m.curve(1)
    assert c(2) == pytest.approx(m.predict(1, 2), rel=0.02)  # seen often: the fit itself
    assert c(16) < 0.97 * m.predict(1, 16)  # never seen: priced lower than the fit, so that it gets tried


def test_attention_over_long_contexts_is_priced_per_row():
    """Rows of a request deep into a long document cost more than rows of a short chat: the fit separates what
    attention reads (rows x context) from the matrix products (rows)."""
    rng = random.Random(4)
    m = StepCostModel(PRIOR)
    for _ in range(800):
        rows, context = rng.choice([2, 4, 8]), rng.choice([200, 1000, 2000])
        load = rows * context / 1000
        m.observe(2, rows, machine(rows, 2) + 0.0015 * load, attention=load)
    assert m.attention_seconds(2) == pytest.approx(0.0015, rel=0.15)
    assert m.predict(2, 8, attention=16) - m.predict(2, 8, attention=1.6) == pytest.approx(0.0015 * 14.4, rel=0.15)


def test_a_cuda_engine_starts_from_the_measured_gpu_curve_for_its_size():
    """CUDA engines start from GPU_VERIFY_COST (forwards captured in CUDA graphs on an H100), between its two
    measured model sizes by log(parameters); CPU engines from the CPU curve. The driver picks by the engine's device
    and its model's config (what a CUDA engine's drafter is built with)."""
    from types import SimpleNamespace

    from vllm_adaspec.policies.cost_model import GPU_VERIFY_COST, VERIFY_COST, model_parameters, prior_for
    from vllm_adaspec.proposers.driver import engine_prior

    llama8b = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=128, intermediate_size=14336, vocab_size=128256)
    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    assert 7.9e9 < model_parameters(llama8b) < 8.2e9 and 1.2e8 < model_parameters(smol) < 1.5e8

    def config(device, hf):
        return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                               model_config=SimpleNamespace(hf_text_config=hf))

    big = engine_prior(config("cuda", llama8b))
    assert big.curve == pytest.approx(GPU_VERIFY_COST[8.0e9]) and big.tree_request < 0.05
    small = engine_prior(config("cuda", smol))  # below the smallest measured size: its curve, not extrapolated
    assert small.curve == pytest.approx(GPU_VERIFY_COST[1.5e9])
    mid = prior_for("cuda", 3.5e9)
    assert GPU_VERIFY_COST[8.0e9][2] < mid.curve[2] < GPU_VERIFY_COST[1.5e9][2]
    assert engine_prior(config("cpu", smol)).curve == VERIFY_COST
    # a CUDA engine's model prices 64 rows near its one-row step; the CPU's prices them at several steps
    gpu, cpu = StepCostModel(big), StepCostModel(engine_prior(config("cpu", smol)))
    assert gpu.predict(1, 64) / gpu.predict(1, 1) < 1.25 < 3.0 < cpu.predict(1, 64) / cpu.predict(1, 1)


def test_a_cuda_engine_on_an_h200_starts_from_the_h200s_curve(monkeypatch):
    """The card's measured curve where there is one (its CUDA device name), the H100's for any other card."""
    from types import SimpleNamespace

    import torch

    from vllm_adaspec.policies.cost_model import GPU_VERIFY_COST, GPU_VERIFY_COST_BY_CARD
    from vllm_adaspec.proposers.driver import engine_prior

    llama8b = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=128, intermediate_size=14336, vocab_size=128256)
    config = SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"),
                             model_config=SimpleNamespace(hf_text_config=llama8b))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in (("NVIDIA H200", GPU_VERIFY_COST_BY_CARD["H200"][8.0e9]), ("NVIDIA H100 80GB HBM3",
                                                                               GPU_VERIFY_COST[8.0e9])):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert engine_prior(config).curve == pytest.approx(want), name
    assert GPU_VERIFY_COST_BY_CARD["H200"][8.0e9][128] > GPU_VERIFY_COST[8.0e9][128] + 0.2


def test_the_audit_records_predictions_against_outcomes():
    """observers.CostAudit (VLLM_ADASPEC_AUDIT=1, benchmarks/audit_cost_model.py): steps as (shape, predicted,
    measured), proposals as (expected tokens, committed, nodes, tree), nodes binned by calibrated probability per
    pool and for all pools."""
    import os

    from vllm_adaspec.observers import CostAudit, from_env

    a = CostAudit()
    a.step_cost((1, 5, 1, 4, 0.3), 0.031, 0.029)
    a.proposal_outcome("r", 2.2, 3, [(0.95, ("context",), True), (0.62, ("context", "suffix"), True),
                                     (0.05, ("suffix",), False)], True)
    st = a.stats()
    assert st["audit_steps"] == [[1, 5, 1, 4, 0.3, 0.031, 0.029]]
    assert st["audit_rounds"] == {"r": [[2.2, 3, 3, True]]}
    rel = st["audit_reliability"]
    assert rel["all"][9] == [1, 1] and rel["all"][6] == [1, 1] and rel["all"][0] == [1, 0]
    assert rel["suffix"][6] == [1, 1] and rel["suffix"][0] == [1, 0] and rel["context"][9] == [1, 1]
    os.environ["VLLM_ADASPEC_AUDIT"] = "1"
    try:
        assert any(isinstance(o, CostAudit) for o in from_env())
    finally:
        del os.environ["VLLM_ADASPEC_AUDIT"]


def test_decisions_read_a_fit_at_most_refit_steps_old_and_statistics_never_move_them():
    """A solve costs ~0.1 ms in the engine: decisions (curve, attention, tree extra) re-solve a bucket only every
    REFIT_STEPS observations, statistics (predict, table) see every observation. Reading statistics must not move
    decisions: tensor-parallel ranks read them at different times and must draft alike (test_engine_parallel.py)."""
    from vllm_adaspec.policies.cost_model import REFIT_STEPS

    read, quiet = StepCostModel(PRIOR), StepCostModel(PRIOR)  # the same steps; only `read` is asked for statistics
    for m in (read, quiet):
        for _ in range(100):
            m.observe(1, 3, 0.020)
    decisions, predictions = [], []
    for _ in range(3 * REFIT_STEPS):  # the machine turned slower
        for m in (read, quiet):
            m.observe(1, 3, 0.040)
        predictions.append(read.predict(1, 3))
        read.table()
        decisions.append(read.curve(1)(3))
        assert decisions[-1] == quiet.curve(1)(3) and read.attention_seconds(1) == quiet.attention_seconds(1)
    assert all(b > a for a, b in zip(predictions, predictions[1:]))  # statistics: every step
    assert 2 <= len(set(decisions)) <= 4 and decisions[-1] > decisions[0]  # decisions: every REFIT_STEPS steps
    fresh = quiet.curve(1, plus=0.001)
    assert fresh(3) - 0.001 == pytest.approx(quiet.predict(1, 3), rel=0.05)  # at most REFIT_STEPS - 1 steps behind


def test_a_draft_pass_is_priced_from_its_own_timing_even_when_every_step_drafts_the_same_depth():
    # A drafter that drafts 3 passes every step: a regression of its time on the pass count has no spread to read a
    # slope from (it priced every pass at 0, so the sizing drafted the deepest chains where one draft paid).
    d = DraftCost()
    for _ in range(50):
        d.observe(1, 3, 0.002 + 3 * 0.0035, pass_seconds=3 * 0.0035)
    assert d.per_pass(1) == pytest.approx(0.0035)
    assert d.predict(1, 0) == pytest.approx(0.002)
    assert d.predict(1, 1) == pytest.approx(0.0055)
    # model-free steps (no passes) move the fixed part only; batch buckets are apart
    for _ in range(200):
        d.observe(1, 0, 0.001)
    assert d.per_pass(1) == pytest.approx(0.0035) and d.predict(1, 0) == pytest.approx(0.001, rel=0.05)
    assert d.predict(8, 2) == 0.0 and d.per_pass(8) == 0.0
    d.observe(1, 1, float("nan"), 0.001)  # a broken timing is dropped
    assert d.per_pass(1) == pytest.approx(0.0035)


def test_a_first_pass_that_compiles_does_not_price_drafting_out():
    d = DraftCost()
    d.observe(1, 1, 1.5, pass_seconds=1.5)  # the process' first draft pass: caches cold, a compile
    for _ in range(4):
        d.observe(1, 2, 0.01, pass_seconds=0.006)
    assert d.per_pass(1) == pytest.approx(0.003)
