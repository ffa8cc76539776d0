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
