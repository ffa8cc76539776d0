"""A long soak of the OpenAI server: the suite's soak round (tests/test_server.py: concurrent greedy streams and
plain requests, vanishing clients, aborts, a max_model_len edge, malformed requests) repeated for --rounds, with the
server's resident memory (server + engine processes) after each round, the drafter's live per-request state and
whether anything is left running. Resident memory should be flat after the first rounds (warm-up).

    .venv/bin/python benchmarks/soak_server.py --rounds 20 --out benchmarks/out/soak_mb.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--speculative-config", default='{"model": "vllm_adaspec.MultiBranchProposer", '
                                                   '"num_speculative_tokens": 16}')
    p.add_argument("--additional-config", default=None)
    p.add_argument("--out", default="benchmarks/out/soak_server.json")
    args = p.parse_args(argv)

    import tempfile

    import psutil
    from soak import run_jobs, scrape, total
    from test_server import serving, soak_jobs

    from vllm_adaspec.models import fetch_model

    model = str(fetch_model("smollm2-135m-instruct"))
    rows = []
    with tempfile.TemporaryDirectory() as work, serving(model, Path(work), json.loads(args.speculative_config),
                                                        json.loads(args.additional_config)
                                                        if args.additional_config else None) as (base, proc):
        for r in tqdm(range(args.rounds), desc="soak rounds", file=sys.stderr):
            jobs, kinds = soak_jobs(model)
            t0 = time.perf_counter()
            results = run_jobs(base, jobs)
            seconds = time.perf_counter() - t0
            bad = sum(1 for (kind, _), res in zip(kinds, results)
                      if (kind in ("greedy", "tree_mix", "max_model_len", "dropped") and res["status"] != 200)
                      or (kind == "malformed" and not (res["status"] and 400 <= res["status"] < 500)))
            time.sleep(2.0)  # the engine notices vanished clients, the drafter writes its snapshot
            m = scrape(base)
            live = sum(v for k, v in m.items() if k.startswith("vllm:adaspec_live_state"))
            pp = psutil.Process(proc.pid)
            rss = sum(q.memory_info().rss for q in [pp] + pp.children(recursive=True)) / 2**20
            rows.append({"round": r + 1, "seconds": round(seconds, 1), "rss_mib": round(rss, 1),
                         "running": total(m, "vllm:num_requests_running"),
                         "waiting": total(m, "vllm:num_requests_waiting"), "live_state": live, "unexpected": bad})
            tqdm.write(json.dumps(rows[-1]), file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rounds": rows}, indent=1))
    warm = [x["rss_mib"] for x in rows[len(rows) // 4:]]
    print(f"resident memory after warm-up (rounds {len(rows) // 4 + 1}-{len(rows)}): {min(warm):.0f}-{max(warm):.0f} "
          f"MiB; first round {rows[0]['rss_mib']:.0f} MiB; unexpected statuses {sum(x['unexpected'] for x in rows)}; "
          f"left running {max(x['running'] for x in rows)}, live state max {max(x['live_state'] for x in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
