"""Where a decoding step's time goes: wall time per engine step, split into its parts, for any speculative method.

Runs one engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), wraps the functions a step goes through with
timers (inclusive wall time; nested parts are inside their callers), generates a warm-up batch, then the measured
batch, and prints milliseconds per engine step for each part, in vLLM's default (compiled) mode unless --eager. Methods in one call run one after another in fresh
processes; compare them at equal work (same prompts, same tokens). Run alone: timings of a shared CPU mean nothing.

    .venv/bin/python benchmarks/profile_step.py --methods suffix '{"pools": ["suffix"]}' --batch-size 1
    .venv/bin/python benchmarks/profile_step.py --methods plain default --datasets mix --num-prompts 1

A method is "plain", "suffix" (vLLM's), "ngram" (vLLM's), "default" (MultiBranchProposer's defaults), a JSON
object of MultiBranchProposer settings (K = the tree budget, default 16), or "early-exit" / "early-exit:K"
(EarlyExitProposer: its defaults, or K drafts fixed with the cost model off; --exit-head names its head; a suffix
":float" or ":int8" sets a draft layer's weights).

    .venv/bin/python benchmarks/profile_step.py --methods plain early-exit early-exit:1 --datasets translation \
        --exit-head vllm_adaspec/heads/smollm2-135m-instruct-draft-layer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

HEADS = "              medusa heads' tensor work (device work on a GPU)"
# (label, import path of the class, method): the parts of a step, outermost first
PARTS = [
    ("engine step", "vllm.v1.engine.core:EngineCore", "step"),
    ("  schedule", "vllm.v1.core.sched.scheduler:Scheduler", "schedule"),
    ("  update from output", "vllm.v1.core.sched.scheduler:Scheduler", "update_from_output"),
    ("  execute_model", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "execute_model"),
    ("    update states", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_update_states"),
    ("    prepare inputs", None, "_prepare_inputs"),  # instance attribute: adaspec wraps it per runner
    ("    model forward", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_model_forward"),
    ("      attention (all layers)", "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl", "forward"),
    # (after vLLM's kernel, in the tree backend's forward: beside the line above, not inside it)
    ("      tree rows' attention (all layers)", "vllm_adaspec.runtime.cpu:CPUTreeRuntime", "verify_attention"),
    ("        of which their KV copies' upkeep", "vllm_adaspec.runtime.cpu:CPUTreeRuntime", "sequence_kv"),
    ("  sample_tokens", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "sample_tokens"),
    ("    sample / verify", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_sample"),
    ("      tree sampler (trees and chains)", "vllm_adaspec.engine.tree_sampler:TreeRejectionSampler", "__call__"),
    ("      tree KV compaction", "vllm_adaspec.runtime.cpu:CPUTreeRuntime", "finish_step"),
    ("    bookkeeping", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_bookkeeping_sync"),
    ("    propose (drafter)", None, "propose_draft_token_ids"),
    ("      adaspec propose", "vllm_adaspec.proposers.driver:Driver", "propose"),
    ("        drafter observe", "vllm_adaspec.proposers.drafter:Drafter", "observe"),
    ("        drafter draft", "vllm_adaspec.proposers.drafter:Drafter", "draft"),
    ("          draft layer / exit passes", "vllm_adaspec.engine.drafting:TargetPrefix", "forward"),
    ("        draft layer KV upkeep", "vllm_adaspec.engine.drafting:TargetPrefix", "feed"),
    ("          pools propose", "vllm_adaspec.pools:PoolSet", "propose"),
    ("            context pool", "vllm_adaspec.pools.context:ContextPool", "propose"),
    ("            suffix pool", "vllm_adaspec.pools.suffix:SuffixPool", "propose"),
    ("            corpus pool", "vllm_adaspec.pools.corpus:CorpusPool", "propose"),
    ("            medusa pool", "vllm_adaspec.pools.medusa:MedusaPool", "propose"),
    (HEADS, "vllm_adaspec.pools.medusa:ranked_tokens", None),
    ("          the node choice (merge, rank, price, lay out; compiled)", "vllm_adaspec.proposers.multi_branch:choose_compiled",
     None),
    ("          trie merge (the Python choice)", "vllm_adaspec.proposers.multi_branch:merge", None),
    ("          cost model: the step's price list", "vllm_adaspec.proposers.driver:Driver", "step_seconds"),
    ("        cost model: learning the last step", "vllm_adaspec.proposers.driver:Driver", "_observe_step"),
    ("  adaspec on_schedule", "vllm_adaspec.proposers.driver:Driver", "on_schedule"),
    # (once the forward is launched: on a GPU behind it; inside "adaspec propose" where nothing ran it before)
    ("  adaspec while_forward", "vllm_adaspec.proposers.driver:Driver", "while_forward"),
]


def method_config(spec: str, budget_default: int = 16, exit_head: str = "auto") -> dict:
    if spec == "plain":
        return {}
    if spec == "suffix":  # vLLM's defaults (K = 24, 10000 cached responses)
        return {"speculative_config": {"method": "suffix"}}
    if spec == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}}
    if spec.startswith("early-exit"):  # early-exit[:K][:int8|float] (the draft layer's weights)
        parts = spec.split(":")[1:]
        weights = [p for p in parts if p in ("int8", "float")]
        k = next((p for p in parts if p.isdigit()), "")
        extra = {"cost_model": "off"} if k else {}
        if weights:
            extra["draft_weights"] = weights[0]
        return {"speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": int(k or 3)},
                "additional_config": {"adaspec": {"exit_head": exit_head, **extra}}}
    settings = {} if spec == "default" else json.loads(spec)
    k = settings.get("tree", {}).get("budget", budget_default)
    return {"speculative_config": {"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": k},
            "additional_config": {"adaspec": settings}}


def _timed(fn, label, acc):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[label][0] += time.perf_counter() - t0
            acc[label][1] += 1

    wrapper._adaspec_timed = True
    return wrapper


def install(acc, parts=PARTS) -> None:
    """Wrap each part's function with a timer adding to acc[label] (parts: (label, where, method) as PARTS)."""
    import importlib

    for label, where, name in parts:
        if where is None:
            continue
        mod, cls = where.split(":")
        module = importlib.import_module(mod)
        if name is None:  # a module-level function, timed where it is looked up
            if hasattr(module, cls):  # (an older tree, `host_replay.py --against`, may not have it: 0 there)
                setattr(module, cls, _timed(getattr(module, cls), label, acc))
            continue
        if cls == "Drafter":  # the interface: time every drafter's own method
            for klass in _drafter_classes():
                if name in vars(klass):
                    setattr(klass, name, _timed(vars(klass)[name], label, acc))
            continue
        klass = getattr(module, cls)
        if hasattr(klass, name):  # (as above: an older tree may not have it)
            setattr(klass, name, _timed(getattr(klass, name), label, acc))


def _drafter_classes():
    import vllm_adaspec.proposers.early_exit  # noqa: F401
    import vllm_adaspec.proposers.multi_branch  # noqa: F401
    from vllm_adaspec.proposers.drafter import Drafter

    return Drafter.__subclasses__()


def shadow_gpu_planning(acc, model: str) -> None:
    """Also plan every tree step as the GPU runtime would (GPUTreeRuntime.prepare on CPU tensors: ancestor words,
    the padded trees, the kernel's plan, the staging copies), timed apart as "GPU tree plan (shadow)": with the
    drafter's own time it is the host side of a GPU tree step, measured on this CPU. Its time is inside the engine
    step here (subtract it for the CPU engine's own step)."""
    import json as _json

    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime
    from vllm_adaspec.kernels.tree_attention import tile_rows
    from vllm_adaspec.trees import step_plan

    with open(os.path.join(model, "config.json")) as f:
        cfg = _json.load(f)
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    shadow = GPUTreeRuntime("cpu", plain=lambda r: "greedy", max_rows=65)
    shadow.heads, shadow.block_q = (hq, hkv, cfg["hidden_size"] // hq), tile_rows(65, hq, hkv)
    if step_plan.compiled():
        step_plan.warm_up()  # as an engine's start-up does: no compile inside the measured steps
    base = TreeRuntime.prepare

    def prepare(self, step):
        if step is not None and type(self) is TreeRuntime:
            t0 = time.perf_counter()
            try:
                shadow.prepare(step)
            except Exception as e:  # a benchmark bug: say it, and keep the CPU step untouched
                print(f"[profile] GPU plan failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            acc[SHADOW][0] += time.perf_counter() - t0
            acc[SHADOW][1] += 1
            step.device = None
        return base(self, step)

    TreeRuntime.prepare = prepare


SHADOW = "GPU tree plan (shadow, host)"
# an 8B step on an H100 by batch size (the reference table the GPU tree path's targets are stated against:
# Llama-3-8B, one row per request, CUDA graphs)
STEP_8B_MS = {1: 6.61, 8: 7.17, 32: 8.21}


def child(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_adaspec.data.prompts import WORKLOAD_MIX, load_prompts
    from vllm_adaspec.models import resolve_model

    acc = defaultdict(lambda: [0.0, 0])
    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    sets = [d for ds in args.datasets for d in (WORKLOAD_MIX if ds == "mix" else [ds])]
    # the warm-up runs other prompts than the measured ones: vLLM's suffix cache and our suffix pool remember the
    # outputs of earlier requests, and a measured prompt seen in the warm-up would be drafted from its own output
    extra = -(-args.batch_size // len(sets))
    loaded = [load_prompts(ds, args.num_prompts + extra, tokenizer=tok) for ds in sets]
    prompts = [p for got in loaded for p in got[:args.num_prompts]]
    warm = [p for got in loaded for p in got[args.num_prompts:]][:args.batch_size]
    install(acc)
    if args.gpu_plan:
        shadow_gpu_planning(acc, model)
    # vLLM's default mode (compiled) unless --eager
    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0, kv_cache_memory_bytes=2**30,
              disable_log_stats=False, **({"enforce_eager": True} if args.eager else {}),
              **method_config(args.method, exit_head=args.exit_head))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    for label, where, name in PARTS:
        if where is None:
            setattr(runner, name, _timed(getattr(runner, name), label, acc))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(warm, params, use_tqdm=False)  # warm-up
    acc.clear()
    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), args.batch_size):
        outs = llm.generate(prompts[i:i + args.batch_size], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.cprofile)
    steps = acc["engine step"][1]
    return {"method": args.method, "wall": wall, "tokens": tokens, "steps": steps,
            "parts": {label: [1e3 * acc[label][0] / max(1, steps), acc[label][1] / max(1, steps)]
                      for label in [p[0] for p in PARTS] + [SHADOW]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", nargs="+", default=["suffix", '{"pools": ["suffix"]}'])
    p.add_argument("--datasets", nargs="+", default=["mix"])
    p.add_argument("--num-prompts", type=int, default=1, help="prompts per dataset")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON of every method's parts")
    p.add_argument("--cprofile", default=None, help="also write a cProfile of the measured generate to this file")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode)")
    p.add_argument("--gpu-plan", action="store_true",
                   help="also time the GPU runtime's planning of every tree step (host side of a GPU tree step)")
    p.add_argument("--exit-head", default="auto", help="EarlyExitProposer's exit_head (default: auto)")
    p.add_argument("--method", help=argparse.SUPPRESS)  # child side
    args = p.parse_args()
    if args.method is not None:
        print("@@" + json.dumps(child(args)), flush=True)
        return
    results = []
    for m in args.methods:
        cmd = [sys.executable, __file__, "--method", m, "--model", args.model, "--datasets", *args.datasets,
               "--num-prompts", str(args.num_prompts), "--batch-size", str(args.batch_size),
               "--max-tokens", str(args.max_tokens), "--exit-head", args.exit_head] \
            + (["--eager"] if args.eager else []) \
            + (["--gpu-plan"] if args.gpu_plan else [])
        if args.cprofile:
            cmd += ["--cprofile", f"{args.cprofile}.{len(results)}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("@@")), None)
        if line is None:
            sys.exit(f"{m} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[2:]))
        print(f"[profile] {m}: {results[-1]['tokens']} tokens in {results[-1]['wall']:.1f} s", file=sys.stderr)
    head = "| part (ms per engine step) | " + " | ".join(r["method"] for r in results) + " |"
    print(head + "\n|---|" + "---|" * len(results))
    for label, _, _ in PARTS:
        indent = len(label) - len(label.lstrip())
        print(f"| {'. ' * (indent // 2)}{label.strip()} | "
              + " | ".join(f"{r['parts'][label][0]:.2f}" for r in results) + " |")
    if args.gpu_plan:
        print(f"| {SHADOW} | " + " | ".join(f"{r['parts'][SHADOW][0]:.2f}" for r in results) + " |")
        host = [r["parts"]["      adaspec propose"][0] + r["parts"]["  adaspec on_schedule"][0] + r["parts"][SHADOW][0]
                for r in results]
        # the Medusa heads' matmuls, softmax and top-k run on the device of a GPU engine: not host time there
        device = [r["parts"][HEADS][0] for r in results]
        ref = STEP_8B_MS.get(args.batch_size)
        for label, vals in (("propose + on_schedule + GPU plan", host),
                            ("the same less the Medusa heads' tensor work", [h - d for h, d in zip(host, device)])):
            print(f"| host side of a GPU tree step: {label} | " + " | ".join(f"{h:.2f}" for h in vals) + " |")
            if ref:
                print(f"| ... of an H100 Llama-3-8B step at batch {args.batch_size} ({ref} ms) | "
                      + " | ".join(f"{100 * h / ref:.0f}%" for h in vals) + " |")
    print("| tokens / s | " + " | ".join(f"{r['tokens'] / r['wall']:.1f}" for r in results) + " |")
    print("| tokens / engine step | " + " | ".join(f"{r['tokens'] / max(1, r['steps']):.2f}" for r in results) + " |")
    print("| engine steps | " + " | ".join(str(r["steps"]) for r in results) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
