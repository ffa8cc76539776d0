"""`adaspec distill` (the target writes its training text through vLLM) and `adaspec train exit-layer`, end to end
on SmolLM2 with tiny sizes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_adaspec.harness import default_env
from vllm_adaspec.training.distill import load_shards

pytestmark = pytest.mark.engine


def cli(args, workdir, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "vllm_adaspec.cli", *args], capture_output=True, text=True,
                          env=default_env(workdir=str(workdir)), timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, smollm2):
    d = tmp_path_factory.mktemp("distill")
    out = d / "data"
    # (eager, and the stdlib prompts alone: the suite's minutes; the default compiles, as vLLM does, and writes the
    # same shards; ShareGPT's long conversations, the default's three quarters, prefill for a minute more here: the
    # split they come from is tested in test_prompts.py)
    args = ["distill", "--model", smollm2, "--out", str(out), "--enforce-eager", "--source", "stdlib", "--tokens",
            "150", "--max-tokens", "24", "--prompts-per-shard", "6"]
    p = cli(args, d)
    assert p.returncode == 0, p.stderr[-3000:]
    first = {k: v.copy() for k, v in np.load(out / "shard-00000.npz").items()}
    # Resumable: asking for more adds shards and leaves the finished ones alone.
    more = cli(args[:-6] + ["--tokens", "300", "--max-tokens", "24", "--prompts-per-shard", "6"], d)
    assert more.returncode == 0, more.stderr[-3000:]
    return {"dir": d, "out": out, "first": first, "stdout": p.stdout, "more": more.stdout}


def test_distill_shards_are_aligned_resumable_and_seeded(distilled, smollm2):
    out = distilled["out"]
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["seed"] == 0 and manifest["max_tokens"] == 24
    seqs = load_shards(str(out))
    go = seqs.gen_offsets()
    assert go[-1] >= 300 and len(seqs.topk_ids) == go[-1] and seqs.topk_ids.shape[1] == 8
    assert seqs.sampled.any() and (~seqs.sampled).any()  # the greedy / sampled mix
    n_shards = len([f for f in os.listdir(out) if f.startswith("shard-")])
    assert n_shards >= 2
    again = np.load(out / "shard-00000.npz")
    for k, v in distilled["first"].items():
        assert np.array_equal(again[k], v), k
    # Greedy continuations are the target's argmax: generated token j is top-1 of the log-probs recorded for it, or
    # tied with it (the default dtype is the checkpoint's bfloat16, whose coarse logits tie now and then: 3 of 216
    # tokens here, each an exact tie that the top-k listed in another order)
    ties = greedy = 0
    for s in np.nonzero(~seqs.sampled)[0]:
        p, a, b = seqs.prompt_lens[s], seqs.offsets[s], seqs.offsets[s + 1]
        gen, ids, lp = seqs.tokens[a + p:b], seqs.topk_ids[go[s]:go[s + 1]], seqs.topk_logp[go[s]:go[s + 1]]
        top = ids[:, 0] == gen
        tied = (ids == gen[:, None]) & (lp == lp[:, :1])
        assert np.all(top | tied.any(axis=1)), s
        ties, greedy = ties + int((~top).sum()), greedy + len(gen)
    assert ties <= 0.05 * greedy, (ties, greedy)
    # Log-probs are sorted and finite for the top entries.
    lp = seqs.topk_logp.astype(np.float32)
    assert np.all(np.diff(lp[:, :2], axis=1) <= 1e-3)
    # No evaluation prompt leaked into the training text.
    from transformers import AutoTokenizer
    from vllm_adaspec.data.prompts import load_humaneval

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.decode(seqs.tokens)
    assert not any(p.strip()[:120] in text for p in load_humaneval())


def test_distill_refuses_other_settings_in_the_same_folder(distilled, smollm2):
    p = cli(["distill", "--model", smollm2, "--out", str(distilled["out"]), "--tokens", "10", "--max-tokens", "32",
             "--prompts-per-shard", "6"], distilled["dir"])
    assert p.returncode == 2 and "max_tokens" in p.stderr and "other settings" in p.stderr


def test_train_exit_layer_writes_a_checkpoint_that_learned(distilled, smollm2):
    head = distilled["dir"] / "head"
    p = cli(["train", "exit-layer", "--model", smollm2, "--data", str(distilled["out"]), "-N", "2",
             "--out", str(head), "--draft-vocab", "64", "--epochs", "20", "--batch-tokens", "2048", "--lr", "1e-3"],
            distilled["dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout[p.stdout.index("{"):])
    assert report["loss_last"] < report["loss_first"]
    from vllm_adaspec.heads import load_exit_head

    meta, t = load_exit_head(str(head))
    assert meta["exit_layer"] == 2 and meta["draft_vocab_size"] == 64 and meta["lm_head"] == "shared"
    assert 2 in t["draft_vocab"].tolist()  # EOS is always draftable
    assert t["layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert (distilled["out"] / "hidden-N2.npy").exists()  # h_N cached for the next run
    bad = cli(["train", "exit-layer", "--model", smollm2, "--data", str(distilled["out"]), "-N", "30",
               "--out", str(head)], distilled["dir"])
    assert bad.returncode == 2 and "1 <= N < 30" in bad.stderr


def test_train_draft_layer_prefills_features_per_shard_then_trains_an_exit_head(distilled, smollm2, capsys):
    """The two commands a new model's draft layer takes from a corpus: the features' prefill alone (per shard, by
    default the shipped layer's depths: EAGLE-3's low / middle / high and the last), then training on them into an
    exit head EarlyExitProposer loads."""
    out = distilled["out"]
    shards = len([f for f in os.listdir(out) if f.startswith("shard-")])
    p = cli(["train", "draft-layer", "--model", smollm2, "--data", str(out), "--features-only"], distilled["dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout[p.stdout.index("{"):])
    assert report["feature_columns"] == 4 * 576 and report["tokens"] == int(load_shards(str(out)).offsets[-1])
    cache = out / "features-N2+15+27+30"
    assert sorted(os.listdir(cache)) == sorted(f"shard-{i:05d}{e}" for i in range(shards) for e in (".npy", ".labels.npy"))
    from vllm_adaspec.cli import main

    assert main(["train", "draft-layer", "--model", smollm2, "--data", str(out)]) == 2
    assert "--out is required" in capsys.readouterr().err
    head = distilled["dir"] / "draft-layer"
    p = cli(["train", "draft-layer", "--model", smollm2, "--data", str(out), "--out", str(head),
             "--depth", "2", "--draft-vocab", "256", "--epochs", "3"], distilled["dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "target features" not in p.stderr  # the cache served it: no second prefill
    report = json.loads(p.stdout[p.stdout.index("{"):])
    assert report["settings"]["prompt_context"] == 64 and report["steps"] >= 1 and len(report["agreement_after"]) == 2
    from vllm_adaspec.heads import load_exit_head

    meta, t = load_exit_head(str(head))
    assert meta["input"] == "features" and meta["feature_layers"] == [2, 15, 27, 30] and meta["exit_layer"] == 30
    assert not (head / "train-state.pt").exists()


def test_build_corpus_counts_the_distilled_text_for_this_tokenizer(distilled, smollm2):
    from collections import Counter

    from vllm_adaspec.pools.corpus import CorpusTable, find_corpus

    out = distilled["dir"] / "corpus"
    p = cli(["build", "corpus", "--model", smollm2, "--data", str(distilled["out"]), "--no-stdlib", "--out", str(out),
             "--min-count", "2"], distilled["dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "one-token and" in p.stdout and "self-distilled text (data," in p.stdout
    table = CorpusTable.load(str(out / "corpus.npz"))
    assert find_corpus(smollm2, str(out)) == str(out / "corpus.npz")  # built for this tokenizer
    # The table is the counts of the text: recount one context by hand.
    data = load_shards(str(distilled["out"]))
    seqs = [data.tokens[a:b].tolist() for a, b in zip(data.offsets[:-1], data.offsets[1:])]
    after = {}
    for s in seqs:
        for a, b in zip(s, s[1:]):
            after.setdefault(a, Counter())[b] += 1
    ctx = max(after, key=lambda t: sum(after[t].values()))
    ids, probs, n = table.successors(-1, ctx)
    total = sum(after[ctx].values())
    assert n == 1 and ids[0] == min(after[ctx], key=lambda t: (-after[ctx][t], t))
    assert probs[0] == pytest.approx(after[ctx].most_common(1)[0][1] / total, abs=1e-3)
    assert len(table.keys1) == sum(1 for c in after.values() if sum(c.values()) >= 2)
    bad = cli(["build", "corpus", "--model", smollm2, "--data", str(distilled["dir"] / "nope")], distilled["dir"])
    assert bad.returncode == 2 and "no such folder" in bad.stderr


def test_train_medusa_writes_heads_that_learned_and_exports_vllms_layout(distilled, smollm2):
    from vllm_adaspec.heads.medusa import find_medusa, load_medusa

    out, vllm_dir = distilled["dir"] / "medusa", distilled["dir"] / "medusa-vllm"
    args = ["train", "medusa", "--model", smollm2, "--data", str(distilled["out"]), "--out", str(out), "--heads", "3",
            "--draft-vocab", "256", "--epochs", "4", "--batch", "32", "--export-vllm", str(vllm_dir)]
    refused = cli(args, distilled["dir"])  # the default heads read the last token: vLLM's layout cannot hold them
    assert refused.returncode == 2 and "--no-token-input" in refused.stderr and not out.exists(), refused.stderr
    p = cli(args + ["--no-token-input"], distilled["dir"])
    assert p.returncode == 0, p.stderr[-3000:]
    body = p.stdout[p.stdout.index("{"):p.stdout.index("vLLM medusa layout")]
    report = json.loads(body[:body.rindex("}") + 1])
    assert "vLLM medusa layout: " + str(vllm_dir) in p.stdout
    assert report["loss_last"] < report["loss_first"] - 1.0, report  # it learned (from the LM head on h_t)
    meta, t = load_medusa(str(out))
    assert t["w"].shape == (3, 576, 576) and t["draft_vocab"].numel() == 256 and meta["token_input"] is False
    assert len(meta["accuracy_by_rank"]) == 3 and len(meta["accuracy_by_rank"][0]) == 10
    assert find_medusa(json.load(open(f"{smollm2}/config.json")), str(out)) == str(out)  # fits this model
    cfg = json.load(open(vllm_dir / "config.json"))
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3 and (vllm_dir / "model.safetensors").is_file()
    bad = cli(["train", "medusa", "--model", smollm2, "--data", str(distilled["dir"] / "nope"), "--out", str(out)],
              distilled["dir"])
    assert bad.returncode == 2 and "no such folder" in bad.stderr
