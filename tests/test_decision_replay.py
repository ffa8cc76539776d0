"""benchmarks/decision_replay.py: the offline replay of decoding that judges drafting decisions on this CPU's step
costs against vLLM's `suffix`. Its numbers mean something only if verification is replayed exactly (every method
commits exactly the known continuation), every forward is counted, and the simulated step is the measured one."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decision_replay as dr  # noqa: E402


def synthetic(n: int = 3) -> list[dict]:
    """Requests whose continuation copies a phrase of the prompt twice, then runs on with fresh tokens; in between it
    starts the phrase and leaves it at once (a one-token match: the suffix cache drafts a wrong first token)."""
    out = []
    for k in range(n):
        phrase = [100 + 10 * k + j for j in range(12)]
        prompt = [1, 2, 3] + phrase + [4, 5] + phrase[:3]
        cont = phrase[3:] + [7, phrase[0], 6] + phrase + [900 + k * 50 + j for j in range(20)]
        out.append({"prompt": prompt, "cont": cont})
    return out


def run(method, data, batch, max_tokens=40, unit=0.02):
    return dr.run_queue(data, list(range(len(data))), batch, max_tokens, method.draft, method, dr.cpu_step(unit))


@pytest.mark.parametrize("batch", [1, 2])
def test_plain_and_suffix_commit_the_continuation_and_count_every_forward(batch):
    data = synthetic()
    plain = run(dr.Plain(data), data, batch)
    suffix = run(dr.VllmSuffix(data, [f"r{k}" for k in range(len(data))]), data, batch)
    for c in (plain, suffix):
        for k, out in c["output"].items():
            assert out == data[k]["cont"][:len(out)] and len(out) >= 40
        assert c["tokens"] == sum(map(len, c["output"].values()))
    assert plain["tokens"] == plain["forwards"] and plain["drafted"] == 0  # tau 1: one token a forward
    # the copied phrase is drafted by the suffix cache and accepted: fewer forwards for the same tokens
    assert suffix["drafted"] > 0 and 0 < suffix["accepted"] <= suffix["drafted"]
    assert suffix["tokens"] == suffix["forwards"] + suffix["accepted"]
    assert suffix["forwards"] < plain["forwards"]
    assert suffix["seconds"] < plain["seconds"]


def test_engine_seconds_add_the_prefills_and_the_host_work_to_the_steps():
    data = synthetic()
    other = lambda requests, prompt_tokens: 1e-3 * requests + 1e-4 * prompt_tokens  # noqa: E731
    c = run(dr.VllmSuffix(data, [f"r{k}" for k in range(len(data))]), data, 2)
    method = dr.VllmSuffix(data, [f"s{k}" for k in range(len(data))])
    e = dr.run_queue(data, list(range(len(data))), 2, 40, method.draft, method, dr.cpu_step(0.02), other)
    assert c["engine_seconds"] == pytest.approx(c["seconds"])  # nothing else counted by default
    prompts = sum(len(d["prompt"]) for d in data)
    decoding = e["forwards"] - len(data)  # (each request's first forward is its prefill's)
    assert e["engine_seconds"] == pytest.approx(e["seconds"] + 1e-3 * decoding + 1e-4 * prompts)


def test_the_simulated_step_is_this_machines_measured_curve():
    step = dr.cpu_step(1.0)
    assert step(1, 1) == pytest.approx(1.0)
    assert step(1, 8) == pytest.approx(1.12)  # batch 1, 8 rows (measured on 2026-11-27: 1.14)
    b8 = step(8, 8)
    assert step(8, 32) / b8 == pytest.approx(2.04, abs=0.06)  # batch 8, 4 rows a request (measured: 2.04)
    assert step(8, 128) / b8 == pytest.approx(6.13, abs=0.25)  # 16 rows a request (6.13; 8 rows from batch 1)
    assert step(1, 8, 1, 7) - step(1, 8) == pytest.approx(0.15 + 7 * 0.005)  # a tree request's extra
    assert step(1, 8, att=2.0) > step(1, 8)  # attention grows with context
    prior = dr.cpu_step(1.0, "prior")
    assert prior(1, 8) == pytest.approx(1.08)  # the cost model's own prior (VERIFY_COST)


def test_ours_replays_the_engine_driver_losslessly():
    """MultiBranchProposer's real driver, pools, calibration and cost model on the replay's port: every request
    commits exactly its continuation, and the copies are drafted and accepted."""
    from vllm_adaspec.models import resolve_model

    data = synthetic()
    names = [f"r{k}" for k in range(len(data))]
    got = dr.replay_ours(data, {"synthetic": list(range(len(data)))}, names, {"pools": ["context", "suffix"]},
                         resolve_model("smollm2-135m-instruct"), 2, 40, dr.cpu_step(0.02), heads=None)
    c = got["synthetic"]
    for k, out in c["output"].items():
        assert out == data[k]["cont"][:len(out)] and len(out) >= 40
    assert c["accepted"] > 0 and c["tokens"] == c["forwards"] + c["accepted"]
    assert c["proposals"] > 0


def test_oracle_selection_drafts_only_what_the_target_accepts():
    """`"oracle": true` scores candidates by the continuation: every drafted node is accepted (a node off the
    continuation is never worth its row), and it commits no fewer tokens a forward than the calibrated scores."""
    from vllm_adaspec.models import resolve_model

    data = synthetic()
    names = [f"r{k}" for k in range(len(data))]
    model = resolve_model("smollm2-135m-instruct")
    got = {}
    for oracle in (False, True):
        out = dr.replay_ours(data, {"synthetic": list(range(len(data)))}, names,
                             {"pools": ["context", "suffix"], "oracle": oracle}, model, 2, 40, dr.cpu_step(0.02),
                             heads=None)
        got[oracle] = out["synthetic"]
    c = got[True]
    for k, out in c["output"].items():
        assert out == data[k]["cont"][:len(out)]
    assert c["drafted"] > 0 and c["accepted"] == c["drafted"]
    assert got[False]["accepted"] < got[False]["drafted"]  # the calibrated scores do draft wrong tokens here
    assert c["forwards"] <= got[False]["forwards"]


def test_pools_started_at_scheduling_draft_as_pools_started_at_the_first_propose(monkeypatch):
    """The worker hands new requests' prompts over at scheduling and their pools start while the forward runs
    (Driver.while_forward, off a GPU step's critical path); a request first met in propose (no prompt ids: prompt
    embeddings) starts there. Every draft is the same either way (the replay's clock is simulated)."""
    from vllm_adaspec.models import resolve_model
    from vllm_adaspec.proposers.driver import Driver

    data = synthetic(5)
    names = [f"r{k}" for k in range(len(data))]
    model = resolve_model("smollm2-135m-instruct")
    settings = {"pools": ["context", "suffix", "corpus", "recycled"]}
    started = []
    start = Driver.while_forward

    def counted(self):
        started.extend(r for kind, what in self._pending if kind == "start" for r in what)
        return start(self)

    monkeypatch.setattr(Driver, "while_forward", counted)
    at_schedule = dr.replay_ours(data, {"synthetic": list(range(len(data)))}, names, settings, model, 2, 40,
                                 dr.cpu_step(0.02), heads=None)
    assert started == names[2:]  # (the first batch's prefill is not replayed: it starts in propose)
    on_schedule = Driver.on_schedule
    monkeypatch.setattr(Driver, "on_schedule", lambda self, s, sp, f, prompts=None: on_schedule(self, s, sp, f))
    at_propose = dr.replay_ours(data, {"synthetic": list(range(len(data)))}, names, settings, model, 2, 40,
                                dr.cpu_step(0.02), heads=None)
    assert len(started) == 3
    for key in ("output", "forwards", "drafted", "accepted", "proposals", "seconds"):
        assert at_schedule["synthetic"][key] == at_propose["synthetic"][key], key
    assert at_schedule["synthetic"]["accepted"] > 0
