"""What users install: a wheel built from the checkout holds every module and the shipped data, and the installed
copy (the source tree nowhere on sys.path) runs an adaspec proposer through vLLM."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_adaspec.harness import default_env

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib, json, os, pkgutil, sys
target, root, model = json.loads(sys.stdin.read())
if __name__ == "__main__":
    # an entry that makes the checkout's own vllm_adaspec/ importable (its .venv may live inside the checkout)
    leaked = [p for p in sys.path
              if os.path.realpath(os.path.join(p or os.getcwd(), "vllm_adaspec")) == os.path.realpath(
                  os.path.join(root, "vllm_adaspec"))]
    # Plain vLLM usage first: this script has not imported vllm_adaspec, so vLLM must find the installed plugin
    # through the wheel's entry point and install our worker and scheduler by itself (vLLM loads plugins the same
    # way in every process it starts; a multiprocess engine adds ~20 s here and tests nothing more of ours).
    imported_before = "vllm_adaspec" in sys.modules
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=2**28,
              seed=0, speculative_config={"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": 2},
              additional_config={"adaspec": {"cost_model": "off"}})
    vc = llm.llm_engine.vllm_config
    classes = [vc.parallel_config.worker_cls, vc.scheduler_config.scheduler_cls]
    outs = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    stats = llm.collective_rpc("adaspec_stats")[0]
    import vllm_adaspec
    names = sorted(m.name for m in pkgutil.walk_packages(vllm_adaspec.__path__, "vllm_adaspec."))
    files = {n: importlib.import_module(n).__file__ for n in ["vllm_adaspec"] + names}
    print("@@" + json.dumps({"leaked": leaked, "files": files, "tokens": list(outs[0].outputs[0].token_ids),
                             "drafts": stats["draft_tokens"], "exit_head": stats["config"]["exit_head"],
                             "imported_before": imported_before,
                             "classes": classes}), flush=True)
    os._exit(0)
"""


def source_modules(pkg: Path, name: str = "vllm_adaspec") -> set[str]:
    return {".".join((name, *p.relative_to(pkg).with_suffix("").parts)).removesuffix(".__init__")
            for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}


def checkout_modules() -> set[str]:
    """The package's modules in the checkout: vllm_adaspec/ and the top-level kernels/ (setup.py installs it as
    vllm_adaspec.kernels)."""
    return source_modules(ROOT / "vllm_adaspec") | source_modules(ROOT / "kernels", "vllm_adaspec.kernels")


def test_wheel_holds_every_module_and_runs_outside_the_checkout(tmp_path, smollm2):
    src = tmp_path / "src"  # build from a copy: pip writes build/ and egg-info next to pyproject.toml
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "tests", "benchmarks"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("vllm_adaspec-*.whl")
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)

    assert source_modules(site / "vllm_adaspec") == checkout_modules()
    assert (site / "vllm_adaspec" / "kernels" / "tree_attention.py").is_file() and not (site / "kernels").exists()
    shipped = [*(ROOT / "vllm_adaspec" / "heads").glob("*/*"), *(ROOT / "vllm_adaspec" / "corpus").glob("*/*")]
    assert any(f.name == "medusa.safetensors" for f in shipped) and any(f.name == "corpus.npz" for f in shipped)
    for f in shipped:  # exit heads, predictors, Medusa heads, corpus tables: package data
        assert (site / f.relative_to(ROOT)).is_file(), f

    env = default_env(workdir=str(tmp_path))
    env["PYTHONPATH"] = str(site)  # ahead of the checkout's editable install (a finder appended to sys.meta_path)
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps([str(site), str(ROOT), smollm2]),
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("@@")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[2:])
    assert got["leaked"] == [], got["leaked"]
    outside = [n for n, f in got["files"].items() if not f.startswith(str(site) + os.sep)]
    assert outside == [], outside
    assert len(got["files"]) == len(checkout_modules())
    assert len(got["tokens"]) == 16 and got["drafts"] > 0
    assert got["exit_head"].startswith(str(site)), got["exit_head"]  # the shipped head came from the wheel
    # found by vLLM through the wheel's entry point (README's LLM(...) example needs nothing else)
    assert got["imported_before"] is False
    assert got["classes"] == ["vllm_adaspec.engine.cpu_worker.AdaspecCPUWorker",
                              "vllm_adaspec.engine.scheduler.AdaspecScheduler"], got["classes"]
