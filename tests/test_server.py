"""The OpenAI-compatible server with the adaspec config: completions equal the offline output."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ENGINE, MAX_TOKENS, PROMPTS, SPEC
from vllm_adaspec.harness import default_env

pytestmark = pytest.mark.engine

N = 2  # prompts checked through the server


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


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    work = tmp_path_factory.mktemp("server")
    port = free_port()
    # Started as README says: `adaspec serve MODEL [vllm serve flags]` (vllm serve itself dies on the CPU build).
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "adaspec"), "serve", smollm2,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", ENGINE["dtype"], "--enforce-eager",
        "--max-model-len", str(ENGINE["max_model_len"]), "--seed", "0", "--kv-cache-memory-bytes", str(2**30),
        "--speculative-config", json.dumps({"model": SPEC, "num_speculative_tokens": 3}),
        # the shipped head drafts every step (the guard would settle on plain decoding at batch 1 on this CPU)
        "--additional-config", json.dumps({"adaspec": {"speed_guard": False}}),
    ]
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=default_env(multiprocess=True, workdir=str(work)))
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
        yield base, smollm2
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # stop the server by its PID
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


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
    base, _ = server
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0) + value
    assert values.get("vllm:spec_decode_num_drafts_total", 0) > 0, values
    assert values.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, values


def scrape(base, prefix):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0) + value
    return values


def test_metrics_show_adaspec_drafting(server):
    base, model = server
    before = scrape(base, "vllm:adaspec_")  # counters of whatever ran before: this test reads differences only
    for i in range(N):
        post(base + "/v1/completions", {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i],
                                        "temperature": 0.0})
    # A request's own statistics land when the engine next steps (it learns of finished requests then), and the
    # drafter's snapshot is at most 0.5 s old: step twice more after a pause.
    for _ in range(2):
        time.sleep(0.6)
        post(base + "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0})
    after = scrape(base, "vllm:adaspec_")
    v = {k: after[k] - before.get(k, 0) for k in after}
    verified, accepted = v.get("vllm:adaspec_verified_drafts_total", 0), v.get("vllm:adaspec_accepted_drafts_total", 0)
    assert verified > 0 and 0 < accepted <= verified, v
    assert v.get("vllm:adaspec_draft_rounds_total", 0) > 0, v
    assert v.get("vllm:adaspec_draft_seconds_total", 0) > 0, v
    assert "vllm:adaspec_speed_guard_steps_total" in after, after  # the family is served (0 with the guard off)
    # the N requests above have finished (the last short one may not be counted yet); those that drafted are in
    # the per-request histograms
    assert v.get("vllm:adaspec_requests_finished_total", 0) >= N + 1, v
    assert v.get("vllm:adaspec_request_acceptance_rate_count", 0) >= 1, v
    assert v.get("vllm:adaspec_request_drafts_per_round_count", 0) == v["vllm:adaspec_request_acceptance_rate_count"]
    rate = v["vllm:adaspec_request_acceptance_rate_sum"] / v["vllm:adaspec_request_acceptance_rate_count"]
    assert 0 < rate <= 1, v
