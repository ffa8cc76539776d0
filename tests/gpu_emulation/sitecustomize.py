"""The GPU tree path inside a real vLLM engine on this CPU machine (tests only): with ADASPEC_EMULATE_GPU=1 and this
folder on PYTHONPATH, an engine process runs vLLM's Triton attention backend, on its GPU paged KV layout, in place
of the CPU one, and an adaspec worker with trees takes the GPU tree path: the tree subclass of that backend
(engine/gpu_tree_backend.py), the GPU tree runtime (runtime/gpu.py, the Triton kernel run by Triton's
interpreter), batched greedy verification and compaction on the GPU layout.

What stands in for the GPU, and why: Triton has no CPU backend (the interpreter runs kernels on CPU tensors, and
vLLM only uses Triton when a backend is registered: a placeholder one is); vLLM's KV-cache write asks the device's
compute capability (an H100's is answered); and vLLM's two kernels of the backend, the KV write and the attention
of every row (their interpreted runs take seconds per step), and its sampler's top-k / top-p kernel (met in the
profile run) are replaced by plain torch that computes the same
(test_gpu_trees.py runs vLLM's real ones, interpreted, on a small batch). As on a GPU, the engine's start runs
vLLM's profile run (a dummy forward, dummy drafts through the rejection sampler). Nothing of vllm_adaspec is
replaced but the CPU worker's choice of tree path."""

import os

if os.environ.get("ADASPEC_EMULATE_GPU") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
    import types

    import torch
    import triton.backends

    # a backend vLLM sees (its CPU build uses Triton only then) that no one can select: Triton and torch look for
    # active drivers, and it is not one
    triton.backends.backends["cpu"] = types.SimpleNamespace(driver=types.SimpleNamespace(is_active=lambda: False))
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                          block_table, **kw):
        """vLLM's attention of every row over the paged cache (k, v [blocks, block_size, Hkv, D]), causal."""
        hq, hkv, bs = q.shape[1], k.shape[2], k.shape[1]
        cu, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
        for b in range(len(cu) - 1):
            r0, r1 = cu[b], cu[b + 1]
            if r1 <= r0:
                continue
            pos = torch.arange(lens[b])
            blocks, offs = block_table[b, pos // bs].long(), pos % bs
            kk = k[blocks, offs].repeat_interleave(hq // hkv, 1).float()
            vv = v[blocks, offs].repeat_interleave(hq // hkv, 1).float()
            s = torch.einsum("ihd,jhd->hij", q[r0:r1].float(), kk) * softmax_scale
            visible = pos[None, :] <= lens[b] - (r1 - r0) + torch.arange(r1 - r0)[:, None]
            s = s.masked_fill(~visible[None], float("-inf"))
            out[r0:r1] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv).to(out.dtype)

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        """vLLM's KV write: each token's K, V at its slot (negative slots: padding, skipped)."""
        n = slot_mapping.shape[0]
        ok = slot_mapping >= 0
        slots = slot_mapping[ok].long()
        bs = key_cache.shape[1]
        key_cache[slots // bs, slots % bs] = key[:n][ok].to(key_cache.dtype)
        value_cache[slots // bs, slots % bs] = value[:n][ok].to(value_cache.dtype)

    triton_attn.unified_attention = unified_attention
    triton_attn.triton_reshape_and_cache_flash = reshape_and_cache
    # vLLM's Triton top-k / top-p kernel (its sampler's, met in the profile run's dummy sampler run) does not run
    # under the interpreter: its torch op computes the same
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False
    register_backend(AttentionBackendEnum.CPU_ATTN, "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend")

    # vLLM's GPU worker runs its profile run at every start (the CPU worker only in compiled mode): dummy drafts for
    # an empty batch through the rejection sampler (ours), a dummy forward through the tree backend
    from vllm.v1.worker import cpu_model_runner
    from vllm.v1.worker import cpu_worker as vllm_cpu_worker

    def warming_up_model(self):
        with cpu_model_runner._set_global_compilation_settings(self.vllm_config):
            self.profile_run()

    cpu_model_runner.CPUModelRunner.warming_up_model = warming_up_model
    vllm_cpu_worker.CPUWorker._should_warm_up_model = lambda self: True

    from vllm_adaspec.engine import cpu_worker

    def tree_runtime(self, observers, faults):
        from vllm.v1.attention import selector

        from vllm_adaspec.runtime.gpu import GPUTreeRuntime, tree_kernel_shape
        from vllm_adaspec.engine.tree_backend import GPU_TREE_BACKENDS

        register_backend(AttentionBackendEnum.CPU_ATTN, dict(GPU_TREE_BACKENDS)["TRITON_ATTN"])
        selector._cached_get_attn_backend.cache_clear()
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        return GPUTreeRuntime(self.model_runner.device, observers, faults=faults, top_k_top_p=apply_top_k_top_p,
                              **tree_kernel_shape(self.vllm_config))

    cpu_worker.AdaspecCPUWorker.tree_runtime = tree_runtime
