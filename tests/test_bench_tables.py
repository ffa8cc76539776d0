"""The interleaved benchmark's comparison of methods (benchmarks/bench_e2e.py): paired by round, over the mix."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e  # noqa: E402


def cell(rounds: list[float], tau: float = 2.0) -> dict:
    return {"speedup_rounds": rounds, "speedup": sorted(rounds)[len(rounds) // 2], "tau": tau, "tok_s": 10.0,
            "identical": 2, "n": 2}


def results() -> dict:
    # round 2's prompts are easy for every method (2x over round 1): ours stays 10% over suffix on translation in
    # every round, and 0.95x / 1.0x / 1.05x on math
    return {
        "plain": {"translation|1": cell([1.0, 1.0, 1.0]), "math|1": cell([1.0, 1.0, 1.0])},
        "suffix": {"translation|1": cell([1.5, 3.0, 1.6]), "math|1": cell([1.2, 2.4, 1.3])},
        "ours": {"translation|1": cell([1.65, 3.3, 1.76]), "math|1": cell([1.14, 2.4, 1.365])},
    }


def test_paired_ratios_divide_out_each_rounds_prompts():
    r = results()
    assert bench_e2e.paired_ratios(r, "ours", "suffix", ["translation|1"]) == pytest.approx([1.1, 1.1, 1.1])
    assert bench_e2e.paired_ratios(r, "ours", "suffix", ["math|1"]) == pytest.approx([0.95, 1.0, 1.05])
    mix = bench_e2e.paired_ratios(r, "ours", "suffix", ["translation|1", "math|1"])
    assert mix == pytest.approx([math.sqrt(1.1 * x) for x in (0.95, 1.0, 1.05)])
    # the medians over plain hide it: ours' ranges over plain (1.65-3.3) swallow suffix's (1.5-3.0)
    assert min(r["ours"]["translation|1"]["speedup_rounds"]) < max(r["suffix"]["translation|1"]["speedup_rounds"])


def test_paired_ratios_need_every_round():
    r = results()
    r["ours"]["math|1"]["speedup_rounds"] = [1.0, 1.0]
    assert bench_e2e.paired_ratios(r, "ours", "suffix", ["translation|1", "math|1"]) == []


def test_merged_rounds_divide_each_round_by_its_own_plain_run():
    """Round 1's rows become the merged rows: plain's median must not replace its round-1 rate before the other
    methods' round-1 ratios are taken (it once did: round 1 was divided by plain's median)."""
    def row(tok_s):
        return {"tok_s": tok_s, "identical": 2}
    per_round = [{"plain": {"rag|1": row(p)}, "ours": {"rag|1": row(1.5 * p)}} for p in (2.0, 4.0, 3.0)]
    merged = bench_e2e.merge_rounds(per_round, {"plain": {}, "ours": {}})
    assert merged["ours"]["rag|1"]["speedup_rounds"] == pytest.approx([1.5, 1.5, 1.5])
    assert merged["ours"]["rag|1"]["speedup"] == pytest.approx(1.5)
    assert merged["plain"]["rag|1"]["tok_s_rounds"] == [2.0, 4.0, 3.0]
    assert merged["plain"]["rag|1"]["tok_s"] == 3.0


def test_mix_table_reports_the_paired_ratio_and_the_worst_type():
    table = bench_e2e.mix_table(results())
    row = next(line for line in table.splitlines() if line.startswith("| vs vLLM suffix, paired"))
    ours = row.split(" | ")[-1]
    assert ours.startswith(f"{math.sqrt(1.1):.2f}x ({math.sqrt(1.1 * 0.95):.2f}-{math.sqrt(1.1 * 1.05):.2f}); 1.00x (math)")
    assert "| translation | 1.10x (1.10-1.10) |" in table


def test_mix_table_pairs_each_of_ours_rows_with_ours_default():
    """The promise "never below one of its own parts": every other multibranch row over the default, paired by round."""
    r = results()
    r["multibranch default B=16"], r["multibranch suffix B=16"] = r.pop("ours"), r.pop("suffix")
    r["suffix"] = r["multibranch suffix B=16"]
    table = bench_e2e.mix_table(r)
    part = table[table.index("ours' default (multibranch default B=16)"):]
    assert "| translation | 0.91x (0.91-0.91) |" in part  # 1 / 1.1 in every round
    assert f"| **mix** | {1 / math.sqrt(1.1):.2f}x ({1 / math.sqrt(1.1 * 1.05):.2f}-{1 / math.sqrt(1.1 * 0.95):.2f}) |" in part


def test_the_tree_kernel_summary_counts_the_targets_of_a_saved_device_run():
    """bench_tree_attention.py --summary, on a device run kept in the repository (an H100's last, 2026-11-27-h100-b):
    the counts RESULTS quotes (13 of 46 shapes within 1.2x FlashAttention at nodes <= 16, ...), recomputed from the
    file."""
    import bench_tree_attention

    path = Path(__file__).resolve().parents[1] / "benchmarks/device_runs/2026-11-27-h100-b/run3/tree_attention.json"
    import json
    s = bench_tree_attention.summarize(json.loads(path.read_text())["results"])
    assert (s["shapes"], s["small"], s["big"], s["long"]) == (69, 46, 23, 22)
    assert (s["small_within_1.2"], s["big_within_1.5"], s["long_kv_within_1.5"]) == (13, 4, 4)
    assert round(s["geomean_over_anchor"], 2) == 1.62 and round(s["small_median"], 2) == 1.41


def test_the_tree_kernel_summary_over_gpu_alone_times_of_a_saved_device_run():
    """--summary over the GPU-alone (CUDA graph) columns of an H200's last run (2026-11-27-h200), the counts RESULTS
    quotes; a run saved without them (2026-11-27-h100-b) has no GPU-alone summary."""
    import json

    import bench_tree_attention

    root = Path(__file__).resolve().parents[1] / "benchmarks/device_runs"
    results = json.loads((root / "2026-11-27-h200/run4/tree_attention.json").read_text())["results"]
    s = bench_tree_attention.summarize(results, gpu=True)
    assert (s["small_within_1.2"], s["big_within_1.5"], s["long_kv_within_1.5"]) == (28, 10, 6)
    assert round(s["geomean_over_anchor"], 2) == 1.25 and round(s["small_median"], 2) == 1.07
    assert bench_tree_attention.summarize(results)["small_within_1.2"] == 30  # the eager column differs
    old = json.loads((root / "2026-11-27-h100-b/run3/tree_attention.json").read_text())["results"]
    assert bench_tree_attention.summarize(old, gpu=True) == {}


def test_the_summary_of_the_cascade_and_of_the_faster_of_the_two_per_shape():
    """--cascade rows: the cascade's column and the faster of kernel and cascade per shape are counted against the
    same targets, eager and GPU alone; rows without a cascade time (a shape whose cascade was not timed) are left
    out of those two, not counted as passing."""
    import bench_tree_attention as bta

    def row(nodes, prefix, kernel, cascade, gpu_kernel, gpu_cascade):
        r = {"nodes": nodes, "prefix": prefix, "over_anchor": kernel, "over_one_kv_read": kernel,
             "gpu_over_anchor": gpu_kernel, "gpu_over_one_kv_read": gpu_kernel}
        if cascade is not None:
            r.update(cascade_over_anchor=cascade, cascade_over_one_kv_read=cascade,
                     gpu_cascade_over_anchor=gpu_cascade, gpu_cascade_over_one_kv_read=gpu_cascade)
        return r

    rows = [row(16, 512, 1.8, 1.1, 1.9, 1.15), row(16, 8192, 1.0, 1.3, 1.1, 1.4), row(64, 512, 2.2, 1.4, 2.3, 1.6),
            row(16, 2048, 1.5, None, 1.5, None)]
    k, c, b = (bta.summarize(rows, column=x) for x in ("kernel", "cascade", "best"))
    assert (k["shapes"], k["small_within_1.2"], k["big_within_1.5"]) == (4, 1, 0)
    assert (c["shapes"], c["small_within_1.2"], c["big_within_1.5"]) == (3, 1, 1)
    assert (b["shapes"], b["small_within_1.2"], b["big_within_1.5"], b["long_kv_within_1.5"]) == (3, 2, 1, 1)
    g = bta.summarize(rows, gpu=True, column="best")
    assert (g["small_within_1.2"], g["big_within_1.5"]) == (2, 0)
    assert round(g["geomean_over_anchor"], 3) == round((1.15 * 1.1 * 1.6) ** (1 / 3), 3)
    assert "cascade / anchor" in bta.summary_line(c, "cascade")


def test_the_host_profile_counts_the_critical_path_and_keeps_the_rest_apart():
    import host_profile

    d, t, s = "vllm_adaspec/proposers/driver.py", "vllm_adaspec/runtime/base.py", "vllm_adaspec/pools/suffix.py"
    raw = [
        f"replay (host_replay.py:400);Driver.propose ({d}:233);SuffixPool.speculate ({s}:86) 6",
        f"replay (host_replay.py:400);Driver.propose ({d}:233);Driver._propose ({d}:349) 2",
        f"replay (host_replay.py:440);plan_step ({t}:120) 2",
        f"replay (host_replay.py:400);Driver.propose ({d}:233);MedusaPool.propose (m.py:117);"
        "ranked_on_device (host_replay.py:150) 5",
        f"replay (host_replay.py:450);Driver.while_forward ({d}:175);PoolSet.start (p.py:240) 7",
        "replay (host_replay.py:470);accepted_path (host_replay.py:330) 9",
    ]
    agg = host_profile.aggregate(raw)
    assert (agg["total"], agg["behind"], agg["device"]) == (10, 7, 5)
    assert agg["inclusive"][("Driver.propose", d)] == 8
    assert agg["own"][("SuffixPool.speculate", s, 86)] == 6
    table = host_profile.report(agg, 5)
    assert "| 80.0% | Driver.propose (vllm_adaspec/proposers/driver.py) |" in table
    assert "| 60.0% | SuffixPool.speculate (vllm_adaspec/pools/suffix.py:86) |" in table
