#!/usr/bin/env bash
# The device checks of a session lent a GPU, as one command (the `device` tool runs it first; about 7 minutes on an
# H100: give it timeout_s 600): the tree kernel on the device, no compile after start-up, the step's pieces without a
# device wait and their times (benchmarks/device_check.py), then the kernel against FlashAttention and the
# verification cost curves (benchmarks/bench_tree_attention.py), then the launch's host cost with and without the
# compiled-kernel path (benchmarks/kernel_sweep.py --launch), then the kernel's launch options
# (benchmarks/kernel_sweep.py), then the cascade design against both (bench_tree_attention.py --cascade, last: what
# ran before is kept if the 600 s run out). What it prints goes into benchmarks/RESULTS.md.
#   bash benchmarks/device_check.sh            # results also under $OUT (the device tool's folder) if set
set -uo pipefail
# python -u: what a script printed before a timeout stops it is kept (block-buffered output to a file or a pipe is lost
# with the process: two device_check.py runs on an H100 were lost that way, each stopped at 100 s:
# benchmarks/device_runs/2026-11-27-h100-b). device_check.py compiles every kernel variant of 6 head shapes x 3 dtypes
# on a bare machine: 157 s on an H100 (11 s with Triton's cache warm; benchmarks/device_runs/2026-11-27-h100-c), stopped
# there once at 150 s: 240 s now
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
timeout 240 python -u benchmarks/device_check.py 2>&1 | tee "$out/device_check.txt"; a=${PIPESTATUS[0]}
timeout 180 python -u benchmarks/bench_tree_attention.py --cost-curve --out "$out/tree_attention.json" 2>&1 \
  | tee "$out/bench_tree_attention.txt"; b=${PIPESTATUS[0]}
timeout 90 python -u benchmarks/kernel_sweep.py --launch --out "$out/launch.json" 2>&1 | tee "$out/launch.txt"
c=${PIPESTATUS[0]}
# the launch options around the defaults, the old loop, the fused reduction (about a minute)
timeout 100 python -u benchmarks/kernel_sweep.py --deadline 60 --out "$out/kernel_sweep.json" 2>&1 \
  | tee "$out/kernel_sweep.txt"; e=${PIPESTATUS[0]}
# the cascade (kernels/tree_cascade.py: FlashAttention over the prefix with its log-sum-exp, the tree kernel over the
# trees' own keys, one merge) beside the kernel and the anchor, shape by shape, for 90 s (about 1.5 minutes)
timeout 130 python -u benchmarks/bench_tree_attention.py --cascade --deadline 90 --out "$out/tree_cascade.json" 2>&1 \
  | tee "$out/tree_cascade.txt"; f=${PIPESTATUS[0]}
echo "device_check.py exit $a, bench_tree_attention.py exit $b, kernel_sweep.py --launch exit $c, kernel_sweep.py exit $e," \
  "bench_tree_attention.py --cascade exit $f"
exit $(( a != 0 || b != 0 || c != 0 || e != 0 || f != 0 ))
