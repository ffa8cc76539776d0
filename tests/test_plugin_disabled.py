"""The plugin runs in every vLLM process of the environment it is installed in, adaspec configured or not: where it
cannot work it must leave vLLM as it found it. One fresh interpreter (vLLM's plugin loading is once per process):

1. a vLLM release it does not support (its version string changed): `register()` patches nothing and warns once;
2. the supported release with one of its patch targets gone (SamplingParams._validate_spec_decode, as a release
   that renamed it would have it: vLLM's own calls still work, the plugin's class-level lookup finds nothing): vLLM
   loads the plugin itself while a plain `LLM(...)` without speculation starts, nothing is patched, one warning,
   and the engine generates; an engine configured with an adaspec proposer then fails at start-up saying why."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

SCRIPT = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.name == "vllm_adaspec":
            records.append(record.getMessage())
logging.getLogger("vllm_adaspec").addHandler(Keep())

import vllm
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm_adaspec.engine import plugin

def patched():
    return {"config": bool(getattr(VllmConfig.__post_init__, "_adaspec_hook", False)),
            "sampling": bool(getattr(SamplingParams.__dict__["_validate_spec_decode"], "_adaspec_hook", False)),
            "platform": bool(getattr(type(current_platform).register_triton_kernel_overrides, "_adaspec_fix", False))}

out = {}
real = vllm.__version__
vllm.__version__ = "0.99.0"
plugin.register(); plugin.register()
out["version"] = {"patched": patched(), "disabled": plugin.disabled(), "warnings": list(records)}
vllm.__version__, plugin._state["disabled"] = real, None
records.clear()

class InstanceOnly:  # the method for vLLM's own calls on instances; absent to a lookup on the class
    def __init__(self, f):
        self.f = f
    def __get__(self, obj, cls=None):
        if obj is None:
            raise AttributeError("_validate_spec_decode")
        return self.f.__get__(obj, cls)

SamplingParams._validate_spec_decode = InstanceOnly(SamplingParams.__dict__["_validate_spec_decode"])
from vllm import LLM
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=2**28,
          seed=0)
text = llm.generate(["The capital of France is"], vllm.SamplingParams(temperature=0.0, max_tokens=8),
                    use_tqdm=False)[0].outputs[0].text
out["missing"] = {"disabled": plugin.disabled(), "warnings": list(records), "text": text,
                  "config_patched": bool(getattr(VllmConfig.__post_init__, "_adaspec_hook", False)),
                  "platform_patched": patched()["platform"]}
del llm
try:
    LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=2**28,
        speculative_config={"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": 4})
    out["adaspec_engine"] = "started"
except Exception as e:
    out["adaspec_engine"] = f"{type(e).__name__}: {e}"
print("@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def disabled_runs(smollm2, tmp_path_factory) -> dict:
    from vllm_adaspec.harness import default_env

    work = tmp_path_factory.mktemp("disabled")
    p = subprocess.run([sys.executable, "-c", SCRIPT, smollm2], capture_output=True, text=True, timeout=600,
                       env=default_env(workdir=str(work)))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    assert lines, (p.stdout[-2000:], p.stderr[-4000:])
    return json.loads(lines[-1][2:])


def test_on_an_unsupported_vllm_the_plugin_patches_nothing_and_warns_once(disabled_runs):
    got = disabled_runs["version"]
    assert got["patched"] == {"config": False, "sampling": False, "platform": False}, got
    assert "supports vLLM 0.32, 0.33, this is vLLM 0.99.0" in got["disabled"], got
    assert len(got["warnings"]) == 1 and got["warnings"][0].startswith("vllm_adaspec is disabled"), got


def test_with_a_patch_target_missing_plain_vllm_starts_and_generates(disabled_runs):
    got = disabled_runs["missing"]
    assert "_validate_spec_decode" in got["disabled"] and len(got["warnings"]) == 1, got
    assert not got["config_patched"] and not got["platform_patched"], got
    assert got["text"].strip(), got
    # an adaspec engine in that environment fails at its start, naming why
    assert "vllm_adaspec is disabled" in disabled_runs["adaspec_engine"], disabled_runs["adaspec_engine"]
