"""The OpenAI-compatible server as README starts it (`adaspec serve`, MultiBranchProposer's defaults, vLLM's
default compiled mode): completions equal the offline output, /metrics shows speculation and our drafting, and a
soak of concurrent, vanishing and malformed clients leaves every output exact and nothing running."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ENGINE, MAX_TOKENS, PROMPTS, TREE_MIX
from vllm_adaspec.harness import default_env

pytestmark = pytest.mark.engine

N = 2  # prompts checked through the server
DRAFTING = (7, 3)  # prompts whose drafts pay (a count, code that repeats itself): the step cost model drafts there


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.loads(r.read())
        chunks = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
        return chunks


@contextlib.contextmanager
def serving(model, work, speculative: dict, additional: dict | None = None, env: dict | None = None,
            eager: bool = True):
    """`adaspec serve MODEL` as README says (vllm serve itself dies on the CPU build), float32, on a free loopback
    port; yields (base url, server process). Stopped by SIGTERM to its PID. speculative None: a plain server.
    env: added to the server's. eager=False:
    vLLM's default compiled mode (README's command as written; inductor and the profile run at start-up)."""
    port = free_port()
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "adaspec"), "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", ENGINE["dtype"], *(["--enforce-eager"] if eager else []),
        "--max-model-len", str(ENGINE["max_model_len"]), "--seed", "0", "--kv-cache-memory-bytes", str(2**30),
    ] + (["--speculative-config", json.dumps(speculative)] if speculative else []) + (
        ["--additional-config", json.dumps(additional)] if additional else [])
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**default_env(multiprocess=True, workdir=str(work)), **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, "server exited:\n" + (work / "server.log").read_text()[-4000:]
            assert time.time() < deadline, "server did not become healthy:\n" + (work / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield base, proc
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # stop the server by its PID
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


# The module's server: README's `adaspec serve` command as written, MultiBranchProposer with every default (trees on
# this CPU) in vLLM's default compiled mode, whose start-up profile run sends dummy drafts through our tree sampler
# (it died there once, the README's own examples with it). It also meets faults injected in a pool, the trie and
# tree planning (vllm_adaspec/faults.py): each is contained, every output stays exact and /metrics counts them.
# (Early exit over HTTP: the same glue; its trees in compiled mode: test_engine_trees.py.)
README_SERVE = ({"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": 16}, None)
SOAK_FAULTS = {"suffix": 3, "tree_plan": 4, "trie": 10}


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    env = {"VLLM_ADASPEC_INJECT_FAULTS": ",".join(f"{k}@{n}" for k, n in SOAK_FAULTS.items())}
    with serving(smollm2, tmp_path_factory.mktemp("server"), *README_SERVE, env=env, eager=False) as (base, _):
        yield base, smollm2


def test_completions_equal_offline_output(server, plain_greedy):
    base, model = server
    for i in range(N):
        body = {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0.0}
        want_text = plain_greedy["mixed"]["texts"][i]
        full = post(base + "/v1/completions", body)
        assert full["choices"][0]["text"] == want_text, i
        assert full["usage"]["completion_tokens"] == len(plain_greedy["mixed"]["token_ids"][i])
        chunks = post(base + "/v1/completions", {**body, "stream": True}, stream=True)
        assert len(chunks) > 1
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want_text, i


def test_metrics_show_speculation(server):
    base, model = server
    before = scrape(base, "vllm:spec_decode_num_")  # whatever ran before: this test reads its own request's share
    post(base + "/v1/completions", {"model": model, "prompt": PROMPTS[7], "max_tokens": 32, "temperature": 0.0})
    time.sleep(0.6)  # vLLM's counters reach /metrics with the front end's next stats update
    values = scrape(base, "vllm:spec_decode_num_")
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert values.get(name, 0) > before.get(name, 0), (name, before, values)


def scrape(base, prefix):
    """/metrics families starting with prefix, each summed over its labels."""
    from soak import scrape as samples, total

    found = samples(base, prefix)
    return {name: total(found, name) for name in {k.split("{")[0] for k in found}}


def test_metrics_show_adaspec_drafting(server):
    base, model = server
    from soak import scrape as samples

    before = scrape(base, "vllm:adaspec_")  # counters of whatever ran before: this test reads differences only
    steps_before = samples(base, "vllm:adaspec_decode_steps_total")  # by label
    for i in DRAFTING:
        post(base + "/v1/completions", {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i],
                                        "temperature": 0.0})
    # A request's own statistics land when the engine next steps (it learns of finished requests then), and the
    # drafter's snapshot is at most 0.5 s old: step twice more after a pause.
    for _ in range(2):
        time.sleep(0.6)
        post(base + "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0})
    after = scrape(base, "vllm:adaspec_")
    v = {k: after[k] - before.get(k, 0) for k in after}
    steps = {k: x - steps_before.get(k, 0) for k, x in samples(base, "vllm:adaspec_decode_steps_total").items()}
    verified, accepted = v.get("vllm:adaspec_verified_drafts_total", 0), v.get("vllm:adaspec_accepted_drafts_total", 0)
    assert verified > 0 and 0 < accepted <= verified, v
    assert v.get("vllm:adaspec_draft_rounds_total", 0) > 0, v
    assert v.get("vllm:adaspec_draft_seconds_total", 0) > 0, v
    drafting = sum(x for k, x in steps.items() if 'drafting="1"' in k)
    assert drafting > 0, steps  # decode steps that drafted
    # the requests above have finished (the last short one may not be counted yet); those that drafted are in the
    # per-request histograms
    assert v.get("vllm:adaspec_requests_finished_total", 0) >= len(DRAFTING) + 1, v
    assert v.get("vllm:adaspec_request_acceptance_rate_count", 0) >= 1, v
    assert v.get("vllm:adaspec_request_drafts_per_round_count", 0) == v["vllm:adaspec_request_acceptance_rate_count"]
    rate = v["vllm:adaspec_request_acceptance_rate_sum"] / v["vllm:adaspec_request_acceptance_rate_count"]
    assert 0 < rate <= 1, v


# --- soak: many concurrent clients, some vanishing, some malformed ---------------------------------------------

MALFORMED = [
    (b"{not json", "bad JSON"),
    ({"prompt": "Hi", "max_tokens": -1}, "negative max_tokens"),
    ({"prompt": "Hi", "temperature": -1.0}, "negative temperature"),
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens not an integer"),
    # per-request speculation controls (vllm_adaspec/controls.py): a bad value is a 400 naming the field
    ({"prompt": "Hi", "vllm_xargs": {"adaspec_speculation": "sometimes"}}, "adaspec_speculation"),
    ({"prompt": "Hi", "vllm_xargs": {"adaspec_max_drafts": 500}}, "adaspec_max_drafts"),
    ({"prompt": "one two " * 1100, "max_tokens": 4}, "prompt longer than max_model_len"),
    ({"model": "no-such-model", "prompt": "Hi"}, "unknown model"),
]


def soak_jobs(model):
    """(jobs, what each is) for one soak round."""
    from conftest import EDGE_PROMPT, FEATURE_NAMES, FEATURES

    jobs, kinds = [], []
    for i in list(range(len(PROMPTS))) + [3, 4, 5, 6, 3, 4]:  # the repeats hit the prefix cache (3/4 share a prefix)
        body = {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0.0}
        jobs.append({"body": body, "stream": len(jobs) % 2 == 0})
        kinds.append(("greedy", i))
    for j in range(4):  # clients that vanish mid-stream
        jobs.append({"body": {"model": model, "prompt": PROMPTS[7], "max_tokens": 200, "temperature": 0.0},
                     "stream": True, "drop_after": 2 + j})
        kinds.append(("dropped", 7))
    for j in range(2):  # requests aborted by their client (non-streaming, gives up after a second)
        jobs.append({"body": {"model": model, "prompt": PROMPTS[8], "max_tokens": 400, "temperature": 0.0,
                              "ignore_eos": True}, "timeout": 1.0})
        kinds.append(("aborted", 8))
    # up to the last position max_model_len allows (1011 prompt tokens + 13 = 1024; the completions API turns a null
    # max_tokens into its default 16, and asking for more than fits is a 400): drafts are cut at the limit
    jobs.append({"body": {"model": model, "prompt": EDGE_PROMPT, "temperature": 0.0, "max_tokens": 13}, "stream": True})
    kinds.append(("max_model_len", None))
    for body, what in MALFORMED:
        jobs.append({"body": body if isinstance(body, bytes) else {"model": model, **body}})
        kinds.append(("malformed", what))
    # what vLLM refuses under speculation (min_p, logit_bias) and per-request controls, served exactly
    for name in ("logit_bias", "min_p"):
        _, prompt, params = FEATURES[FEATURE_NAMES.index(name)]
        jobs.append({"body": {"model": model, "prompt": prompt, "temperature": 0.0, **params}})
        kinds.append(("feature", name))
    # greedy rows with a repetition penalty (each tree row sees its own path's penalty state) and seeded sampling
    # beside them (conftest.TREE_MIX)
    for i in (2, 3, 4):
        jobs.append({"body": {"model": model, "prompt": TREE_MIX["prompts"][i], **TREE_MIX["params"][i]}})
        kinds.append(("tree_mix", i))
    for i, xargs in ((3, {"adaspec_speculation": "off"}), (5, {"adaspec_speculation": "tree", "adaspec_max_drafts": 2}),
                     (0, {"adaspec_speculation": "chain"})):
        jobs.append({"body": {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0.0,
                              "vllm_xargs": xargs}})
        kinds.append(("greedy", i))
    return jobs, kinds


def soak_round(base, model, plain_greedy) -> dict:
    """One soak round against a running server, and the checks that follow it. Returns /metrics after it."""
    from conftest import FEATURE_NAMES
    from soak import run_jobs, scrape, total

    edge_text = plain_greedy["features"]["texts"][FEATURE_NAMES.index("max_model_len")]
    jobs, kinds = soak_jobs(model)
    before = scrape(base)
    results = run_jobs(base, jobs)
    for (kind, what), res in zip(kinds, results):
        if kind == "greedy":  # equal to the same request served alone (plain decoding, float32)
            assert res["status"] == 200 and res["text"] == plain_greedy["mixed"]["texts"][what], (kind, what, res)
        elif kind == "tree_mix":  # penalised greedy rows as plain decoding; the sampled row served
            assert res["status"] == 200 and res["text"], (kind, what, res)
            if TREE_MIX["params"][what]["temperature"] == 0.0:
                assert res["text"] == plain_greedy["tree_mix"]["texts"][what], (kind, what, res)
        elif kind == "max_model_len":
            assert res["status"] == 200 and res["finish_reason"] == "length" and res["text"] == edge_text, res
        elif kind == "malformed":
            assert res["status"] is not None and 400 <= res["status"] < 500, (what, res)
            if what.startswith("adaspec_"):
                assert res["status"] == 400 and what in json.dumps(res["error"]), (what, res)
        elif kind == "feature":
            want = plain_greedy["features"]["texts"][FEATURE_NAMES.index(what)]
            assert res["status"] == 200 and res["text"] == want, (what, res)
        elif kind == "dropped":
            assert res["status"] == 200 and res["dropped"], res
        else:
            assert res["error"] == "client timeout", res
    # Nothing left running or waiting once the engine has noticed the vanished clients, and the drafter holds no
    # per-request state (its snapshot is written when requests finish).
    deadline = time.time() + 30
    while True:
        m = scrape(base)
        running, waiting = total(m, "vllm:num_requests_running"), total(m, "vllm:num_requests_waiting")
        live = {k: v for k, v in m.items() if k.startswith("vllm:adaspec_live_state")}
        if (running == waiting == 0 and live and not any(live.values())) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert running == 0 and waiting == 0, m
    assert live and not any(live.values()), live
    # the server still serves, and still exactly
    res = run_jobs(base, [{"body": {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS[1],
                                    "temperature": 0.0}}])[0]
    assert res["status"] == 200 and res["text"] == plain_greedy["mixed"]["texts"][1], res
    # and the round was speculative: our drafts were verified and accepted (not plain decoding under another name)
    m = scrape(base)
    for name in ("vllm:adaspec_accepted_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert total(m, name) > total(before, name), (name, total(before, name), total(m, name))
    return m


def test_soak_outputs_exact_bad_requests_4xx_nothing_left_running(server, plain_greedy):
    from soak import total

    base, model = server
    m = soak_round(base, model, plain_greedy)
    # the injected faults were contained (the server served every request exactly) and counted
    assert total(m, "vllm:adaspec_drafter_faults_total") == len(SOAK_FAULTS), m
    assert total(m, "vllm:adaspec_drafting_off") == 0, m
