"""What Triton makes of the tree-attention split kernel for a GPU, on a machine without one: compile it for sm_90
(Triton's NVIDIA backend needs no device to lower a kernel to TTGIR and PTX) with the arguments and specialization a
real launch gets, and read the prefix loop's software pipelining off the TTGIR.

Why: a loop whose K / V addresses depend on a load of the same iteration (the page table) is compiled with an
`async_wait {num = 0}` at its top: every copy waited on before each tile, one tile in flight, the loop bound by memory
latency (the kernel at 1.4-3.5x FlashAttention on an H100: benchmarks/device_runs/2026-11-27-h100-b). Loading a tile's
pages a tile ahead (PREFETCH) lets the pipeliner keep num_stages - 1 tiles in flight (`num = 2` at 3 stages). This tool
shows which.

    python benchmarks/kernel_ir.py                       # the engine's default variant, 8 trees x 16 nodes
    python benchmarks/kernel_ir.py --no-prefetch --stages 2 --heads 9,3,64
    python benchmarks/kernel_ir.py --ptx out.ptx         # also write the PTX
    python benchmarks/kernel_ir.py --reduce              # the reduction's registers

Per loop of the kernel (the prefix loops, then the tree-key loop): the `num` of its async_wait (None: no copy is
asynchronous), the asynchronous copies and the plain loads in the loop; then ptxas's registers and spills. Checked
against Triton 3.6 (the H100's) and 3.9 (this machine's): the same pipelining.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

use_checkout()

import torch  # noqa: E402

from vllm_adaspec.kernels import tree_attention as ta  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}


def compile_kernel(args: dict, capability: int = 90, name: str = "split"):
    """Compile the split kernel (name "split") or the reduction ("reduce") for `capability` with `args`
    (split_kernel_args' or reduce_kernel_args' dict: CPU tensors will do) as a launch specializes them, by the rules
    kernels/tree_attention.py's `_arg_key` holds (constexprs by value; a 16-byte aligned pointer and an integer that
    is a multiple of 16, outside do_not_specialize, known as divisible by 16; an integer equal to 1 a constant).
    Returns Triton's CompiledKernel (its .asm: ttgir, ptx)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = ta._tree_attention_split_kernel if name == "split" else ta._tree_attention_reduce_kernel
    options = {k: args[k] for k in ("num_warps", "num_stages") if k in args}
    signature, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(kernel.arg_names):
        value = args[arg]
        key = ta._arg_key(arg, value, name)
        if arg.isupper():
            signature[arg], constexprs[arg] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[arg] = "*" + TYPES[value.dtype]
            if key[2]:  # 16-byte aligned
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[arg] = "fp32"
        elif len(key) == 4 and key[2]:  # equal to 1: Triton makes it a constant
            signature[arg], constexprs[arg] = "constexpr", 1
        else:
            signature[arg] = key[1]
            if len(key) == 4 and key[3]:  # a multiple of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", capability, 32), options=options)


def loop_bodies(ttgir: str) -> list[str]:
    """The body of each scf.for of a kernel's TTGIR, in order (nested loops' bodies inside their parents')."""
    bodies, lines = [], ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        depth, body = 0, []
        for inner in lines[i:]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth <= 0:
                break
        bodies.append("\n".join(body[1:]))
    return bodies


def loops(ttgir: str) -> list[dict]:
    """Each scf.for of the kernel, in order: the `num` of its first async_wait (None where it copies nothing
    asynchronously), its asynchronous copies and its plain loads (tt.load: waited on where used)."""
    found = []
    for text in loop_bodies(ttgir):
        wait = re.search(r"ttg\.async_wait[^{]*\{num = (\d+)", text)
        found.append({"async_wait_num": int(wait.group(1)) if wait else None,
                      "async_copies": text.count("ttg.async_copy_global_to_local"),
                      "plain_loads": len(re.findall(r"= tt\.load ", text))})
    return found


def registers(ptx: str, capability: int = 90) -> str | None:
    """ptxas -v's verdict on the PTX (registers a thread, spill bytes), with the newest ptxas Triton ships that
    reads this PTX version (Triton 3.9's `ptxas` is older than the PTX it emits; `ptxas-blackwell` reads it); None
    where none does."""
    import subprocess
    import tempfile

    import triton

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            if not (bins / name).exists():
                continue
            proc = subprocess.run([str(bins / name), "-v", "--gpu-name", f"sm_{capability}a", str(src), "-o",
                                   str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
            if proc.returncode == 0:
                lines = [x.split("info    : ")[-1].strip() for x in proc.stderr.splitlines()
                         if "registers" in x or "spill" in x]
                return "; ".join(lines)
    return None


def default_plan(heads=(32, 8, 128), batch: int = 8, prefix: int = 8192, nodes: int = 16, dtype=torch.bfloat16,
                 **plan_options) -> tuple:
    """(case, plan): a batch of trees in vLLM's layouts (CPU tensors, bench_tree_attention.make_case) and the
    engine's launch plan of it."""
    from bench_tree_attention import make_case, plan_inputs

    case = make_case(batch, prefix, nodes, *heads, dtype, device="cpu")
    plan_args, kw = plan_inputs(case, batch, prefix, nodes, *heads)
    return case, ta.plan_launch(*plan_args, **kw, **plan_options)


def default_case(heads=(32, 8, 128), batch: int = 8, prefix: int = 8192, nodes: int = 16, dtype=torch.bfloat16,
                 **plan_options) -> dict:
    """split_kernel_args for a batch of trees in vLLM's layouts (CPU tensors) with the engine's plan."""
    case, plan = default_plan(heads, batch, prefix, nodes, dtype, **plan_options)
    q, k_cache, v_cache, table = case[:4]
    return ta.split_kernel_args(plan, q, k_cache, v_cache, table, heads[2] ** -0.5, torch.empty_like(q))


def compile_reduce_kernel(heads=(32, 8, 128), batch: int = 8, prefix: int = 8192, nodes: int = 16,
                          dtype=torch.bfloat16, capability: int = 90):
    """The reduction compiled for `capability` at a step of `batch` trees split in 2 (as its launch specializes it)."""
    case, plan = default_plan(heads, batch, prefix, nodes, dtype, splits=2, fused=False)
    return compile_kernel(ta.reduce_kernel_args(plan, torch.empty_like(case[0])), capability, name="reduce")


def compile_row_draws(vocab: int = 128256, stride: int | None = None, dtype=torch.float32, capability: int = 90):
    """kernels/row_draws.py's kernel compiled for `capability` as a launch over logits [*, vocab] rows `stride` apart
    (default: vocab) specializes it: every pointer 16-byte aligned, the row stride and the chunk (always a multiple
    of BLOCK_V) known divisible by 16 where they are, the per-step integers not specialized."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_adaspec.kernels import row_draws as rd

    kernel = rd._row_draws_kernel
    stride = vocab if stride is None else stride
    chunks = rd.num_chunks(vocab)
    chunk = rd._cdiv(rd._cdiv(vocab, chunks), rd.BLOCK_V) * rd.BLOCK_V  # (the launcher's)
    ints = {"stride_l": stride, "vocab": vocab, "per_tree": 17, "first_sampled": 4, "chunk": chunk}
    pointers = {"logits": "*" + TYPES[dtype], "logit_rows": "*i64", "tree_rows": "*i64", "temperature": "*fp32",
                "argmax_out": "*i64", "draws_out": "*i64", "partial": "*fp32", "counters": "*i32", "seed_ptr": "*i64"}
    plain = set(kernel.do_not_specialize) | {kernel.arg_names[i] for i in kernel.do_not_specialize
                                             if isinstance(i, int)}
    signature, constexprs, attrs = {}, {"BLOCK_V": rd.BLOCK_V, "BLOCK_C": rd.MAX_CHUNKS}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = "i32"
            if arg not in plain and ints[arg] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": rd.NUM_WARPS})


def row_draws_ir(compiled) -> dict:
    """What one tile of the row-draw kernel's loop costs, read off its TTGIR and PTX: reductions and layout
    conversions inside the loop (each a trip through shared memory with barriers), its loads, and the PTX's global
    loads by width and barriers (the whole kernel)."""
    ptx = compiled.asm["ptx"]
    return {"loops": [{"reductions": b.count('"tt.reduce"') + b.count("tt.reduce("),
                       "layout_conversions": b.count("ttg.convert_layout"), "loads": b.count("tt.load")}
                      for b in loop_bodies(compiled.asm["ttgir"])],
            "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]\.", ptx)),
            "scalar_loads": len(re.findall(r"ld\.global(?:\.(?!v[24])\w+)*\.b(?:16|32)\s", ptx)),
            "barriers": ptx.count("bar.sync")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="32,8,128")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefix", type=int, default=8192)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--block-n", type=int, default=ta.BLOCK_N)
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--no-even", action="store_true")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="the split programs combine their partials (default: as plan_launch, fused at 2 chunks)")
    p.add_argument("--ptx", default=None, help="write the PTX here")
    p.add_argument("--reduce", action="store_true", help="the reduction (its registers) instead of the split kernel")
    p.add_argument("--row-draws", action="store_true",
                   help="kernels/row_draws.py's kernel instead: its loop's reductions and loads, over --vocab")
    p.add_argument("--vocab", type=int, default=128256)
    a = p.parse_args(argv)
    if a.row_draws:
        for stride in (a.vocab, a.vocab + 8 if a.vocab % 16 == 0 else a.vocab):
            for dtype in (torch.float32, torch.bfloat16):
                got = row_draws_ir(compile_row_draws(a.vocab, stride, dtype))
                print(f"row draws, {dtype}, rows {stride} tokens apart: {got['loops']} (per tile), global loads "
                      f"{got['vector_loads']} vector / {got['scalar_loads']} scalar, {got['barriers']} barriers")
        return 0
    heads = tuple(int(x) for x in a.heads.split(","))
    if a.reduce:
        compiled = compile_reduce_kernel(heads, a.batch, a.prefix, a.nodes, getattr(torch, a.dtype))
        print(f"reduction, heads {a.heads}, {a.dtype}, BLOCK_S {ta.REDUCE_BLOCK_S}, {compiled.metadata.num_warps} "
              f"warps: ptxas: {registers(compiled.asm['ptx']) or 'no ptxas here reads this PTX'}")
        return 0
    args = default_case(heads, a.batch, a.prefix, a.nodes, getattr(torch, a.dtype), block_n=a.block_n,
                        num_stages=a.stages, num_warps=a.warps, prefetch=not a.no_prefetch, even=not a.no_even,
                        fused=a.fused, splits=2)
    compiled = compile_kernel(args)
    print(f"split kernel, heads {a.heads}, {a.dtype}, BLOCK_N {args['BLOCK_N']}, tile {args['BLOCK_Q']} rows x "
          f"{args['GROUP']} heads in {args['BLOCK_M']}, {args['num_warps']} warps, {args['num_stages']} stages, "
          f"even {args['EVEN']}, prefetch {args['PREFETCH']}, fused {args['FUSED']}: shared memory "
          f"{compiled.metadata.shared} bytes")
    for i, loop in enumerate(loops(compiled.asm["ttgir"])):
        print(f"  loop {i}: async_wait num {loop['async_wait_num']}, {loop['async_copies']} asynchronous copies, "
              f"{loop['plain_loads']} plain loads")
    print(f"  ptxas: {registers(compiled.asm['ptx']) or 'no ptxas here reads this PTX'}")
    if a.ptx:
        Path(a.ptx).write_text(compiled.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
