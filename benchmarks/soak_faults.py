"""A soak of `adaspec serve` under faults: README's server (MultiBranchProposer's defaults, vLLM's default compiled
mode) for --minutes with 16 concurrent clients sending a mix of requests (greedy, seeded sampling, a JSON grammar,
logit_bias banning the request's own top token, min_p, penalties, bad words, logprobs, stop strings, n = 2), 4
clients that vanish mid-stream, the 8 malformed requests of the suite's soak, and faults injected at every failpoint
the server's drafter and tree path pass through (faults.py), at random passes.

Checks: every request answered (no hang: a client timeout counts as lost), each greedy one with exactly the text a
plain server (no speculation, same settings) gives it, no banned token or bad word, the JSON parses, n = 2 gives two
completions, malformed ones a 4xx; at the end nothing running and no live per-request drafter state, the server
still exact. Resident memory (server and its engine processes) is sampled every 30 s.

    .venv/bin/python benchmarks/soak_faults.py --minutes 10 --out benchmarks/out/soak_faults.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# failpoints a MultiBranchProposer server with default pools passes, and how many passes each may see in a soak
# (faults land at random passes below that: some in the first minutes, some late)
FAILPOINT_PASSES = {"context": 4000, "suffix": 4000, "corpus": 4000, "medusa": 4000, "trie": 4000,
                    "tree_plan": 4000, "tree_verify": 20000, "tree_only": 6000, "compaction": 4000}
FAULTS_PER_PLACE = 20


def injection(seed: int) -> str:
    rng = random.Random(seed)
    return ",".join(f"{place}@{n}" for place, top in FAILPOINT_PASSES.items()
                    for n in sorted(rng.sample(range(1, top), FAULTS_PER_PLACE)))


def mix(model: str) -> list[dict]:
    """The requests clients cycle through: {"kind", "body", "stream", "check"}; greedy ones are compared with the
    plain server's text."""
    from conftest import BANNED_FIRST, JSON_SCHEMA, MAX_TOKENS, PROMPTS

    out = []
    for i in range(len(PROMPTS)):
        out.append({"kind": "greedy", "body": {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i]}})
    for i, tok in BANNED_FIRST.items():
        out.append({"kind": "logit_bias", "banned": tok,
                    "body": {"prompt": PROMPTS[i], "max_tokens": 48, "logit_bias": {str(tok): -100}}})
    out += [
        {"kind": "min_p", "body": {"prompt": PROMPTS[5], "max_tokens": 48, "min_p": 0.3}},
        {"kind": "json", "body": {"prompt": "<|im_start|>user\nGive a person as JSON with name and age.<|im_end|>\n"
                                            "<|im_start|>assistant\n", "max_tokens": 48,
                                  "structured_outputs": {"json": JSON_SCHEMA}}},
        {"kind": "penalties", "body": {"prompt": PROMPTS[3], "max_tokens": 48, "repetition_penalty": 1.3,
                                       "presence_penalty": 0.4}},
        {"kind": "bad_words", "words": [" the", " village"],
         "body": {"prompt": PROMPTS[8], "max_tokens": 48, "bad_words": [" the", " village"]}},
        {"kind": "logprobs", "body": {"prompt": PROMPTS[0], "max_tokens": 32, "logprobs": 3}},
        {"kind": "stop", "body": {"prompt": PROMPTS[3], "max_tokens": 64, "stop": ["\n\n"]}},
    ]
    for r in out:
        r["body"] = {"model": model, "temperature": 0.0, **r["body"]}
    out += [{"kind": "sampled", "body": {"model": model, "prompt": PROMPTS[k], "max_tokens": 48, "temperature": 0.8,
                                         "top_p": 0.95, "seed": 100 + k}} for k in (2, 6, 8)]
    out.append({"kind": "n=2", "body": {"model": model, "prompt": PROMPTS[2], "max_tokens": 32, "temperature": 1.0,
                                        "n": 2, "seed": 7}})
    for j, r in enumerate(out):
        r["stream"] = r["kind"] not in ("logprobs", "n=2") and j % 3 == 0
        r["key"] = j
    return out


def complete(base: str, job: dict, timeout: float = 300) -> dict:
    """POST a completion (streamed or not): {"status", "texts" (one per choice), "tokens" (choice 0's token ids,
    when asked), "error"}."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {**job["body"], "stream": job.get("stream", False), "return_token_ids": True}
    out = {"status": None, "texts": {}, "tokens": [], "error": None}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = r.read()[:300].decode(errors="replace")
            return out
        if not body["stream"]:
            doc = json.loads(r.read())
            for c in doc["choices"]:
                out["texts"][c["index"]] = c["text"]
                if c["index"] == 0:
                    out["tokens"] = list(c.get("token_ids") or [])
            return out
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                out["texts"][c["index"]] = out["texts"].get(c["index"], "") + c.get("text", "")
                if c["index"] == 0:
                    out["tokens"] += list(c.get("token_ids") or [])
    except (OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def references(base: str, jobs: list[dict]) -> dict:
    """Each greedy job's text from the plain server, {key: text}."""
    from concurrent.futures import ThreadPoolExecutor

    greedy = [j for j in jobs if j["body"]["temperature"] == 0.0]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: complete(base, {**j, "stream": False}), greedy))
    bad = [(j["kind"], g) for j, g in zip(greedy, got) if g["status"] != 200]
    if bad:
        raise RuntimeError(f"the plain server failed: {bad[:3]}")
    return {j["key"]: g["texts"][0] for j, g in zip(greedy, got)}


def check(job: dict, res: dict, want: dict) -> str | None:
    """Why a result is wrong, or None."""
    if res["status"] != 200:
        return f"status {res['status']}: {res['error']}"
    text = res["texts"].get(0, "")
    if job["key"] in want and text != want[job["key"]]:
        return f"text differs from the plain server's: {text[:80]!r} vs {want[job['key']][:80]!r}"
    if job["kind"] == "logit_bias" and job["banned"] in res["tokens"]:
        return f"banned token {job['banned']} committed"
    if job["kind"] == "json":
        try:
            json.loads(text)
        except ValueError:
            return f"not JSON: {text[:80]!r}"
    if job["kind"] == "bad_words":
        toks = res["tokens"]
        for ids in job["word_ids"]:
            if any(toks[j:j + len(ids)] == ids for j in range(len(toks))):
                return f"bad word {ids} in {text[:80]!r}"
    if job["kind"] == "n=2" and len(res["texts"]) != 2:
        return f"{len(res['texts'])} completions for n = 2"
    if not text and job["kind"] != "n=2":
        return "empty completion"
    return None


def resident_mib(proc) -> float:
    import psutil

    p = psutil.Process(proc.pid)
    return sum(q.memory_info().rss for q in [p] + p.children(recursive=True)) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the faults' random passes")
    p.add_argument("--settings", default="{}", help="adaspec settings over the defaults, JSON (e.g. "
                   "'{\"suffix_cache_requests\": 24}': the suffix cache bounded early, to see memory level off)")
    p.add_argument("--out", default="benchmarks/out/soak_faults.json")
    args = p.parse_args(argv)

    import tempfile

    from soak import request, scrape, total
    from test_server import MALFORMED, README_SERVE, serving
    from tqdm import tqdm

    from vllm_adaspec.models import fetch_model

    from transformers import AutoTokenizer

    model = str(fetch_model("smollm2-135m-instruct"))
    jobs = mix(model)
    tok = AutoTokenizer.from_pretrained(model)
    for job in jobs:  # a bad word is its token sequence (as vLLM bans it), not a substring of the text
        if job["kind"] == "bad_words":
            job["word_ids"] = [tok.encode(w, add_special_tokens=False) for w in job["words"]]
    spec, additional = README_SERVE
    faults = injection(args.seed)
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        with serving(model, Path(work) / "plain", None, eager=False) as (base, _):
            want = references(base, jobs)
        print(f"plain server: {len(want)} greedy references in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        # faults stay contained; drafting never stops for them
        settings = {"adaspec": {"fault_limit": 10 ** 6, **json.loads(args.settings)}}
        env = {"VLLM_ADASPEC_INJECT_FAULTS": faults}
        with serving(model, Path(work) / "spec", spec, settings, env=env, eager=False) as (base, proc):
            results, lock = [], threading.Lock()
            stop_at = time.time() + 60 * args.minutes
            order = itertools.cycle(random.Random(1).sample(jobs, len(jobs)))

            def client():
                while time.time() < stop_at:
                    with lock:
                        job = next(order)
                    t = time.perf_counter()
                    res = complete(base, job)
                    with lock:
                        results.append({"kind": job["kind"], "seconds": round(time.perf_counter() - t, 2),
                                        "problem": check(job, res, want)})

            vanished = []

            def vanishing(j):
                while time.time() < stop_at - 10:
                    res = request(base, "/v1/completions", {"model": model, "prompt": jobs[7]["body"]["prompt"],
                                                            "max_tokens": 200, "temperature": 0.0}, stream=True,
                                  drop_after=2 + j)
                    with lock:
                        vanished.append(res["status"] == 200 and res["dropped"])
                    time.sleep(5)

            malformed = []

            def bad_requests():
                for body, what in MALFORMED:
                    time.sleep(60 * args.minutes / (len(MALFORMED) + 1))
                    res = request(base, "/v1/completions", body if isinstance(body, bytes) else {"model": model, **body})
                    with lock:
                        malformed.append({"what": what, "status": res["status"]})

            threads = ([threading.Thread(target=client) for _ in range(args.clients)]
                       + [threading.Thread(target=vanishing, args=(j,)) for j in range(4)]
                       + [threading.Thread(target=bad_requests)])
            for t in threads:
                t.start()
            memory = []
            with tqdm(total=int(60 * args.minutes), desc="soak (s)", file=sys.stderr) as bar:
                start = time.time()
                while time.time() < stop_at:
                    time.sleep(30)
                    m = scrape(base)
                    with lock:
                        done = len(results)
                    memory.append({"minute": round((time.time() - start) / 60, 1), "rss_mib": round(resident_mib(proc)),
                                   "requests_done": done,
                                   "faults": total(m, "vllm:adaspec_drafter_faults_total"),
                                   "accepted_drafts": total(m, "vllm:adaspec_accepted_drafts_total")})
                    bar.update(min(30, bar.total - bar.n))
                    tqdm.write(json.dumps(memory[-1]), file=sys.stderr)
            for t in threads:
                t.join(timeout=400)
            hung = sum(t.is_alive() for t in threads)
            # idle: nothing running, no live drafter state; still exact
            deadline = time.time() + 60
            while True:
                m = scrape(base)
                running, waiting = total(m, "vllm:num_requests_running"), total(m, "vllm:num_requests_waiting")
                live = sum(v for k, v in m.items() if k.startswith("vllm:adaspec_live_state"))
                if (running == waiting == live == 0) or time.time() > deadline:
                    break
                time.sleep(1)
            final = check(jobs[1], complete(base, jobs[1]), want)
            m = scrape(base)
    problems = [r for r in results if r["problem"]]
    by_kind = {}
    for r in results:
        k = by_kind.setdefault(r["kind"], {"requests": 0, "wrong": 0, "seconds": []})
        k["requests"] += 1
        k["wrong"] += bool(r["problem"])
        k["seconds"].append(r["seconds"])
    for k in by_kind.values():
        s = sorted(k.pop("seconds"))
        k["p50_s"], k["max_s"] = s[len(s) // 2], s[-1]
    warm = [x["rss_mib"] for x in memory[len(memory) // 3:]] or [0]
    summary = {
        "minutes": args.minutes, "settings": json.loads(args.settings), "clients": args.clients, "requests": len(results), "wrong": len(problems),
        "hung_threads": hung, "vanished_clients": len(vanished), "vanished_ok": sum(vanished),
        "malformed": malformed, "malformed_4xx": sum(1 for x in malformed if x["status"] and 400 <= x["status"] < 500),
        "faults_contained": total(m, "vllm:adaspec_drafter_faults_total"),
        "faults_injected_max": len(FAILPOINT_PASSES) * FAULTS_PER_PLACE,
        "drafting_off": total(m, "vllm:adaspec_drafting_off"),
        "accepted_drafts": total(m, "vllm:adaspec_accepted_drafts_total"),
        "left_running": running, "left_waiting": waiting, "live_state_after": live, "final_request_problem": final,
        "rss_mib_first": memory[0]["rss_mib"] if memory else None,
        "rss_mib_after_warm_up": [min(warm), max(warm)], "by_kind": by_kind, "first_problems": problems[:5],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "faults": faults, "summary": summary,
                               "memory": memory}, indent=1))
    print(json.dumps(summary, indent=1))
    ok = (not problems and not hung and final is None and running == waiting == live == 0
          and summary["malformed_4xx"] == len(MALFORMED) and summary["vanished_ok"] == len(vanished))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
