"""The GPU worker must not import vLLM's CPU worker: that module replaces torch functions process-wide on import
(torch.cuda.Event, streams, synchronize, pin_memory, the memory query) and vLLM's buffers, which in a CUDA worker
means no stream synchronization and a KV cache sized from host memory. Each check runs in a fresh interpreter."""

import json
import subprocess
import sys

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
cls = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
after = names()
print(json.dumps({"class": cls.__name__, "changed": sorted(k for k in before if after[k] is not before[k])}))
"""


def imported(module: str, cls: str) -> dict:
    p = subprocess.run([sys.executable, "-c", SNAPSHOT, module, cls], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_gpu_worker_leaves_torch_and_vllms_buffers_alone():
    """The class the plugin installs on GPUs, imported as vLLM imports it (by its qualified name)."""
    got = imported(*OUR_WORKERS["gpu"].rsplit(".", 1))
    assert got == {"class": "AdaspecGPUWorker", "changed": []}, got


def test_the_check_sees_the_cpu_workers_patches():
    """The same check on the CPU worker: it must see vLLM's patches (else it could never fail)."""
    got = imported(*OUR_WORKERS["cpu"].rsplit(".", 1))
    assert {"torch.cuda.Event", "torch.Tensor.pin_memory", "vllm UvaBuffer"} <= set(got["changed"]), got
