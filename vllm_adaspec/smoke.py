"""`adaspec smoke`: the first thing to run on a new machine (a GPU above all), whose output can be pasted into an
issue as it is.

1. What the machine has: vLLM, torch, Triton, the device.
2. On CUDA, the tree-attention kernel compiled and checked against its reference in fp32, fp16 and bf16 for the
   model's heads (kernels/tree_attention.warm_up: every variant an engine launches).
3. Two engines in vLLM's default mode (compiled; CUDA graphs on a GPU): the model without speculation, then with
   MultiBranchProposer at its defaults (token trees where the platform verifies them), the same greedy requests;
   the tokens compared request by request, with each engine's time, tokens per target forward and the tree path's
   counters (trees verified, in one device batch, kernel launches not compiled at start-up, faults).

Exit code 0 when every output is identical and nothing faulted, 1 otherwise.
"""

from __future__ import annotations

import json
import platform
import time

SMOKE_PROMPTS = [
    "def fibonacci(n):",
    "<|im_start|>user\nExplain what a hash table is in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "The following Python function reverses a list in place:\n\ndef reverse(items):\n",
    "<|im_start|>user\nTranslate to French: The cat sleeps on the warm windowsill.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders",
]


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("vllm", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 (reported, not fatal)
            info[mod] = f"not importable ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
    else:
        info["device"] = "cpu"
    return info


def kernel_check(heads: tuple[int, int, int], k: int) -> list[dict]:
    """The tree kernel on this GPU for these heads, every dtype: largest error against the reference, seconds."""
    import torch

    from vllm_adaspec.kernels import tree_attention as ta

    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t0 = time.perf_counter()
        try:
            err = ta.warm_up("cuda", dtype, *heads, max_rows=k + 1)
            ok = err <= ta.TOLERANCE[dtype]
            rows.append({"dtype": str(dtype), "error": err, "ok": ok, "seconds": time.perf_counter() - t0})
        except Exception as e:  # noqa: BLE001
            rows.append({"dtype": str(dtype), "error": f"{type(e).__name__}: {e}", "ok": False,
                         "seconds": time.perf_counter() - t0})
    return rows


def compare(plain: list, spec: list) -> list[int]:
    """Indices of the requests whose tokens differ."""
    return [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b] + list(range(min(len(plain), len(spec)),
                                                                                 max(len(plain), len(spec))))


def run_smoke(model: str, dtype: str = "float32", max_tokens: int = 64, k: int = 16, eager: bool = False) -> dict:
    from vllm_adaspec.harness import FORWARDS, run_engine

    report = {"machine": machine()}
    with open(f"{model}/config.json") as f:
        hf = json.load(f)
    hq = hf["num_attention_heads"]
    heads = (hq, hf.get("num_key_value_heads", hq), hf.get("head_dim", hf["hidden_size"] // hq))
    if report["machine"]["device"] != "cpu":
        report["kernel"] = kernel_check(heads, k)
    engine = {"dtype": dtype, "max_model_len": 2048, "seed": 0, **({"enforce_eager": True} if eager else {})}
    batch = {"prompts": SMOKE_PROMPTS, "params": [{"temperature": 0.0, "max_tokens": max_tokens}]}
    runs = {}
    for name, extra in (("plain", {}), ("multibranch", {"speculative_config": {
            "model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": k}})):
        t0 = time.perf_counter()
        try:
            res = run_engine({"model": model, "engine": {**engine, **extra}, "batches": [batch]}, timeout=3600)
            run = res["batches"][0]["runs"][0]
            tokens = sum(map(len, run["token_ids"]))
            runs[name] = {"token_ids": run["token_ids"], "seconds": run["seconds"], "tokens": tokens,
                          "tau": tokens / max(1, run["metrics"].get(FORWARDS, 0)),
                          "start_seconds": time.perf_counter() - t0 - run["seconds"],
                          **{key: run["adaspec"].get(key) for key in (
                              "tree_verified", "tree_batched", "tree_kernel_cold", "tree_kernel_fallbacks",
                              "drafter_faults", "accepted_drafts") if key in run["adaspec"]}}
        except Exception as e:  # noqa: BLE001 (the report says what failed)
            runs[name] = {"error": str(e)[-4000:]}
    report["engines"] = runs
    if all("token_ids" in r for r in runs.values()):
        report["differ"] = compare(runs["plain"]["token_ids"], runs["multibranch"]["token_ids"])
    return report


def print_report(report: dict) -> bool:
    """Prints the report; whether everything passed."""
    print("## adaspec smoke")
    for key, value in report["machine"].items():
        print(f"- {key}: {value}")
    ok = True
    for row in report.get("kernel", []):
        err = row["error"] if isinstance(row["error"], str) else f"{row['error']:.2e}"
        print(f"- tree kernel {row['dtype']}: max error {err} ({'ok' if row['ok'] else 'FAILED'}), "
              f"compiled and checked in {row['seconds']:.1f} s")
        ok &= row["ok"]
    for name, run in report["engines"].items():
        if "error" in run:
            print(f"- {name}: FAILED\n```\n{run['error']}\n```")
            ok = False
            continue
        extra = ", ".join(f"{k} {v}" for k, v in run.items()
                          if k not in ("token_ids", "seconds", "tokens", "tau", "start_seconds"))
        print(f"- {name}: start {run['start_seconds']:.0f} s, {run['tokens']} tokens in {run['seconds']:.2f} s "
              f"({run['tokens'] / run['seconds']:.1f} tok/s), tau {run['tau']:.2f}" + (f"; {extra}" if extra else ""))
        ok &= not run.get("drafter_faults") and not run.get("tree_kernel_cold") and not run.get("tree_kernel_fallbacks")
    if "differ" in report:
        n = len(report["engines"]["plain"]["token_ids"])
        print(f"- greedy outputs identical: {n - len(report['differ'])} of {n}"
              + (f" (differ: {report['differ']})" if report["differ"] else ""))
        ok &= not report["differ"]
    print(f"- result: {'PASS' if ok else 'FAIL'}")
    return ok
