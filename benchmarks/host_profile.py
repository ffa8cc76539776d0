"""Where the host side of a GPU tree step goes, by function and by line: a sampling profile (py-spy) of
`host_replay.py`'s replays, the critical path's share of each part.

cProfile cannot answer this: it charges a caller with whatever C it calls that is not a builtin (numba's compiled
passes, arctic-inference's suffix trees, tensor ops), and its own hooks cost more than the small functions they
time. A sampling profiler attributes native time to the Python line that called it. This runs `--replays` replays
of one batch size in one process (host_replay's driver, pools, cost model and GPU plan, the simulated 8B clock)
under `py-spy record`, keeps the samples inside the host side's critical path (Driver.propose, Driver.on_schedule,
plan_step, GPUTreeRuntime.prepare) and prints each function's inclusive share of it and the lines where the time is
spent. What runs behind the forward (Driver.while_forward) and the Medusa heads' stand-in (device work on a GPU) are
counted apart, not in the shares. Needs py-spy (the `dev` extra installs it). Shares, not milliseconds: the sampler
slows the process; `host_replay.py` measures the time.

    .venv/bin/python benchmarks/host_profile.py --batch-size 8 --replays 50
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (the frame's function, its file): where the critical path enters our code, and what is kept apart
CRITICAL = [("Driver.propose", "vllm_adaspec/proposers/driver.py"),
            ("Driver.on_schedule", "vllm_adaspec/proposers/driver.py"),
            ("plan_step", "vllm_adaspec/runtime/base.py"),
            ("GPUTreeRuntime.prepare", "vllm_adaspec/runtime/gpu.py")]
BEHIND = ("Driver.while_forward", "vllm_adaspec/proposers/driver.py")
DEVICE = "ranked_on_device"  # host_replay's stand-in for the Medusa heads' device work
FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>.+?):(?P<line>\d+)\)$")


def parse(frame: str) -> tuple[str, str, int]:
    """py-spy's "func (file:line)" -> (func, file, line)."""
    m = FRAME.match(frame)
    return (m["func"], m["file"], int(m["line"])) if m else (frame, "", 0)


def aggregate(lines) -> dict:
    """py-spy raw output (one "frame;frame;... count" per line, outermost first) -> the critical path's samples: the
    total, each function's inclusive samples, each line's self samples (the innermost frame of our code or of a
    library: native time is the calling line's), and the samples behind the forward and of the device stand-in."""
    total = behind = device = 0
    inclusive, own = Counter(), Counter()
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        n = int(count)
        frames = [parse(f) for f in stack.split(";")]
        root = next((j for j, (func, file, _) in enumerate(frames)
                     if any(func == c and file.endswith(p) for c, p in CRITICAL)), None)
        if root is None:
            if any(func == BEHIND[0] and file.endswith(BEHIND[1]) for func, file, _ in frames):
                behind += n
            continue
        path = frames[root:]
        if any(func == DEVICE for func, _, _ in path):
            device += n
            continue
        total += n
        for key in {(func, file) for func, file, _ in path}:
            inclusive[key] += n
        func, file, line = path[-1]
        own[(func, file, line)] += n
    return {"total": total, "inclusive": inclusive, "own": own, "behind": behind, "device": device}


def short(file: str) -> str:
    for mark in ("vllm_adaspec/", "kernels/", "site-packages/", "benchmarks/"):
        if mark in file:
            return file[file.index(mark) + (len(mark) if mark == "site-packages/" else 0):]
    return file


def report(agg: dict, top: int) -> str:
    total = max(1, agg["total"])
    out = [f"critical path: {agg['total']} samples; behind the forward (while_forward, apart): {agg['behind']}; "
           f"Medusa heads' device stand-in (apart): {agg['device']}", "",
           "| share of the critical path | function (inclusive) |", "|---|---|"]
    for (func, file), n in agg["inclusive"].most_common(top):
        out.append(f"| {100 * n / total:.1f}% | {func} ({short(file)}) |")
    out += ["", "| share | line (self: native time counted at the line that called it) |", "|---|---|"]
    for (func, file, line), n in agg["own"].most_common(top):
        out.append(f"| {100 * n / total:.1f}% | {func} ({short(file)}:{line}) |")
    return "\n".join(out)


def child(batch_size: int, replays: int, num_prompts: int, max_tokens: int, model_name: str) -> None:
    """The replays, in the process py-spy samples (host_replay's set-up without its timers)."""
    from collections import defaultdict

    sys.path.insert(0, str(HERE))
    import host_replay as hr

    model, data, heads_once = hr.replay_inputs(model_name, ["mix"], num_prompts, max_tokens, heads_on_host=False)
    acc = defaultdict(lambda: [0.0, 0])
    for k in range(replays):
        r = hr.replay(data, batch_size, {}, model, 0, acc, max_tokens, heads_once)
        print(f"[profile] replay {k + 1}/{replays}: {r['steps']} steps, host {sum(r['host_ms']) / r['steps']:.3f} "
              f"ms a step (sampled: slower than host_replay.py's)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--replays", type=int, default=50, help="replays in the sampled process (~185 steps, ~0.5 s each)")
    p.add_argument("--rate", type=int, default=1000, help="samples a second")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--raw", default=None, help="aggregate this py-spy raw file instead of recording one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.batch_size, args.replays, args.num_prompts, args.max_tokens, args.model)
        return
    raw = args.raw
    if raw is None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not os.path.exists(spy):
            sys.exit("host_profile.py needs py-spy: .venv/bin/pip install py-spy")
        raw = os.path.join(tempfile.mkdtemp(), "host_profile.raw")
        cmd = [spy, "record", "--nonblocking", "-r", str(args.rate), "-f", "raw", "-o", raw, "--",
               sys.executable, __file__, "--child", "--batch-size", str(args.batch_size), "--replays",
               str(args.replays), "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--model", args.model]
        subprocess.run(cmd, check=True)
    with open(raw) as f:
        print(report(aggregate(f), args.top))


if __name__ == "__main__":
    main()
