"""What a worker keeps for token-tree verification, on the device's KV layout: a step's tree plan, tree attention's
rows, accepted nodes' KV moved into place (compaction). `base.TreeRuntime` is the part every device shares (planning,
the step's bookkeeping, the draft mask of tree drafting); `cpu.CPUTreeRuntime` attends through per-request KV copies
with SDPA on vLLM's CPU layout (`cpu_kv`); `gpu.GPUTreeRuntime` plans on the host in one copy and attends, verifies
and compacts with the Triton kernels (kernels/) on vLLM's GPU layout (`gpu_kv`). No vLLM: engine/ (the glue) builds
the runtime, hands it vLLM's few ops and drives it from vLLM's runner, backends and sampler."""
