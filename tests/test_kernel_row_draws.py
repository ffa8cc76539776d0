"""kernels/row_draws.py under the Triton interpreter: the argmax of every verification row is torch's, bit for bit
(ties to the first token, any logits dtype, strided rows, a vocabulary not a multiple of the tile), greedy trees'
draws are their argmax, and a sampled tree's draws follow softmax(logits / its temperature), each row on its own
(chi-square against the exact law; a kernel that ignored the temperature or shared numbers between rows fails)."""

import pytest
import torch

from conftest import load_interpreted
from stats import chi2_pvalue

rd = load_interpreted("row_draws")


@pytest.mark.parametrize("dtype,chunk_tiles", [(torch.float32, 4), (torch.bfloat16, 1), (torch.float16, 1)])
def test_every_rows_argmax_is_torchs(triton_interpret, monkeypatch, dtype, chunk_tiles):
    """chunk_tiles 4: one program a row over 700 tokens; 1: two chunks, the tie at 5 and 600 across them."""
    monkeypatch.setattr(rd, "BLOCK_V", 256)  # 3 tiles and a ragged end over 700 tokens (the interpreter is slow)
    monkeypatch.setattr(rd, "CHUNK_TILES", chunk_tiles)
    assert rd.num_chunks(700) == (1 if chunk_tiles == 4 else 2)
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(12, 800, generator=g).to(dtype)
    logits = wide[:, :700]  # rows strided past the vocabulary, as a view of a wider buffer
    logits[1, 5] = logits[1, 600] = 40.0  # a tie across tiles: the first
    logits[2, 300] = logits[2, 301] = 40.0  # a tie inside a tile
    logits[3, :] = float("-inf")
    logits[3, 650] = 0.0  # the last tile's ragged end
    logits[4, :] = -3.0  # every token tied: token 0
    logits[5, 70] = logits[5, 326] = 40.0  # a tie in one lane (token % 64) across quarters and tiles: the first
    rows = torch.tensor([[1, 2, 3], [4, 0, 11], [7, 7, 5]])
    argmax, draws = rd.row_draws(logits, rows, torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 0.5]), 2)
    assert torch.equal(argmax, logits.argmax(-1)[rows]), (argmax, logits.argmax(-1)[rows])
    ref_argmax, ref_draws = rd.row_draws_reference(logits, rows, torch.tensor([0, 1, 2]),
                                                   torch.tensor([1.0, 1.0, 0.5]), 2)
    assert torch.equal(ref_argmax, argmax) and torch.equal(ref_draws[:2], argmax[:2])
    assert argmax[0].tolist() == [5, 300, 650] and int(argmax[1, 0]) == 0
    assert torch.equal(draws[:2], argmax[:2])  # greedy trees: their argmax
    assert ((draws[2] >= 0) & (draws[2] < 700)).all()


def test_a_launch_with_no_sampled_tree_needs_no_temperature(triton_interpret, monkeypatch):
    monkeypatch.setattr(rd, "BLOCK_V", 64)
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([[0, 1], [2, 3]])
    argmax, draws = rd.row_draws(logits, rows, torch.tensor([0, 1]), None, 2)
    assert torch.equal(argmax, logits.argmax(-1)[rows]) and torch.equal(draws, argmax)
    with pytest.raises(ValueError, match="temperature"):
        rd.row_draws(logits, rows, torch.tensor([0, 1]), None, 1)


def test_sampled_rows_follow_the_tempered_softmax_each_on_its_own(triton_interpret, monkeypatch):
    """Two sampled trees of 200 rows each over the same logits row, at temperatures 0.5 and 2 (their own, through
    tree_rows), one launch: each tree's draws against softmax(x / T) by chi-square; the rows of one launch are
    independent (counts would clump if rows shared numbers: the test uses one launch only)."""
    monkeypatch.setattr(rd, "BLOCK_V", 16)  # 6 tokens: one tile
    x = torch.tensor([[1.0, 0.2, -0.5, 0.9, 2.0, -1.0]])
    n = 200
    rows = torch.zeros(2, n, dtype=torch.long)
    temperature = torch.tensor([0.0, 2.0, 9.0, 0.5])  # vLLM's per-request tensor: tree 0 reads row 3, tree 1 row 1
    argmax, draws = rd.row_draws(x, rows, torch.tensor([3, 1]), temperature, 0, seed=(1 << 32) + 12345)
    assert (argmax == 4).all()
    for tree, t in ((0, 0.5), (1, 2.0)):
        p = torch.softmax(x[0] / t, -1)
        seen = torch.bincount(draws[tree], minlength=6)
        assert chi2_pvalue(seen, p) > 1e-3, (t, seen, p * n)
    # the temperature matters: the hot tree's draws are not the cold tree's law
    assert chi2_pvalue(torch.bincount(draws[1], minlength=6), torch.softmax(x[0] / 0.5, -1)) < 1e-6
    # the same key draws the same numbers; another key others
    few = rows[:, :20]
    once, again, other = (rd.row_draws(x, few, torch.tensor([3, 1]), temperature, 0, seed=(1 << 32) + s)[1]
                          for s in (12345, 12345, 777))
    assert torch.equal(once, again) and not torch.equal(other, once)


def test_each_launch_draws_its_key_from_torchs_generator_on_the_device():
    """[1] int64 on the logits' device (the kernel reads it: one compiled variant, no wait), from torch's default
    generator: seeded alike, two engines (or two tensor-parallel ranks) draw the same keys; keys differ launch to
    launch."""
    torch.manual_seed(3)
    a = [int(rd.new_seed("cpu")) for _ in range(50)]
    torch.manual_seed(3)
    b = rd.new_seed("cpu")
    assert b.dtype == torch.int64 and b.shape == (1,) and int(b) == a[0] and len(set(a)) == 50


def test_the_draws_do_not_depend_on_how_the_vocabulary_is_chunked(triton_interpret, monkeypatch):
    """Philox counts (row, token / 4): one program a row or nine chunks of it draw the same tokens under one key, and
    the chunks' combination keeps the first maximum (the argmax) and the race's winner."""
    monkeypatch.setattr(rd, "BLOCK_V", 16)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=g)
    logits[0, 3] = logits[0, 290] = 30.0
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])
    got = {}
    for tiles in (1000, 2):
        monkeypatch.setattr(rd, "CHUNK_TILES", tiles)
        got[tiles] = rd.row_draws(logits, rows, torch.tensor([0, 1]), torch.tensor([1.0, 1.5]), 1, seed=(1 << 32) + 9)
    assert rd.num_chunks(300) == 9
    assert torch.equal(got[1000][0], logits.argmax(-1)[rows]) and torch.equal(got[2][0], got[1000][0])
    assert torch.equal(got[2][1], got[1000][1]) and int(got[2][0][0, 0]) == 3


def test_a_sampled_rows_draw_is_the_first_maximum_of_its_race(triton_interpret, monkeypatch):
    """The kernel keeps each lane's best and reduces the lanes once a chunk: its draw must still be the first token
    maximizing x / T - log(-log U) over the row, U the launch's Philox uniforms (row, token / 4), here written out by
    a second interpreted kernel with the same counters and arithmetic, over one program a row and four chunks; a
    row of equal logits (the uniforms alone decide) and one whose later tiles and chunks are -inf (never drawn)."""
    import triton
    import triton.language as tl

    @triton.jit
    def race_scores(x, out, inv_t, seed_ptr, vocab, Q: tl.constexpr):
        i = tl.program_id(0)
        seed = tl.load(seed_ptr)
        t = tl.load(inv_t + i)
        offs = tl.arange(0, Q)
        for start in range(0, vocab, 4 * Q):
            r0, r1, r2, r3 = tl.randint4x(seed, i.to(tl.int64) * vocab + start // 4 + offs)
            for k, r in ((0, r0), (1, r1), (2, r2), (3, r3)):
                v = start + k * Q + offs
                xv = tl.load(x + i * vocab + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
                tl.store(out + i * vocab + v, xv * t - tl.log(-tl.log(tl.uint_to_uniform_float(r))), mask=v < vocab)

    monkeypatch.setattr(rd, "BLOCK_V", 16)  # 150 tokens: 9 whole tiles and a ragged one
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 150, generator=g)
    logits[1, :] = 0.0  # every token tied: the race alone decides
    logits[2, 60:] = float("-inf")  # the last tiles and chunks can never win
    rows = torch.tensor([[0, 1, 2], [3, 4, 5], [1, 1, 1]])
    tree_rows = torch.tensor([2, 0, 1])
    temperature = torch.tensor([0.7, 1.3, 0.4])
    seed = torch.tensor([(1 << 40) + 99])
    flat = rows.flatten()
    inv_t = (1.0 / temperature[tree_rows]).repeat_interleave(rows.shape[1])
    scores = torch.empty(len(flat), 150)
    race_scores[(len(flat),)](logits[flat].contiguous(), scores, inv_t, seed, 150, Q=4)
    want = scores.argmax(-1).view_as(rows)  # torch's first maximum
    for tiles in (1000, 2):  # one program a row, then four chunks
        monkeypatch.setattr(rd, "CHUNK_TILES", tiles)
        argmax, draws = rd.row_draws(logits, rows, tree_rows, temperature, 0, seed=seed)
        assert torch.equal(draws, want), (tiles, draws, want)
        assert torch.equal(argmax, logits.argmax(-1)[rows])
    assert rd.num_chunks(150) == 4
    assert (draws[0, 2] < 60) and len(set(draws[2].tolist())) == 3  # rows drawn apart: their own numbers


def test_the_compiled_loop_reduces_nothing_and_loads_in_vectors():
    """The kernel compiled for an H100 (sm_90; Triton lowers it without a GPU) as a launch over Llama-3's logits
    specializes it (benchmarks/kernel_ir.py): the loop over a chunk's whole tiles holds no reduction (each was a trip
    through shared memory with barriers, 16 a tile in benchmarks/baselines/row_draws_block_reductions.py) and its loads
    are 16-byte vectors (the rows' stride and the chunk known multiples of 16). In a fresh process: this one's Triton
    library is interpreted."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import kernel_ir as k\n"
            "print(json.dumps(k.row_draws_ir(k.compile_row_draws(128256))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["loops"]) == 1 and got["loops"][0]["reductions"] == 0, got
    assert got["vector_loads"] >= 4, got  # x0..x3 of a whole tile, one vector load each
