#!/usr/bin/env bash
# The torch.distributed backend: installs torch from PyPI into a virtual environment of its
# own (once; the wheels are cached), builds and installs ./ffi/torch into it as README says
# (pip install --no-build-isolation), and runs the pytest suite (2-4 processes, CPU tensors).
#
# ROCCL_TORCH_VENV: the environment (default ~/.cache/roccl/torch-venv);
# ROCCL_TORCH_WHEELS: the wheel cache (default ~/.cache/roccl/torch-wheels).
set -euo pipefail
cd "$(dirname "$0")/../../.."
torch_version=2.15.0
venv=${ROCCL_TORCH_VENV:-$HOME/.cache/roccl/torch-venv}
wheels=${ROCCL_TORCH_WHEELS:-$HOME/.cache/roccl/torch-wheels}
py="$venv/bin/python"

have_torch() {
  [ -x "$py" ] && "$py" -c "import torch, torch.distributed as d, pytest, numpy, expecttest
assert torch.__version__.split('+')[0] == '$torch_version' and d.is_available()" 2>/dev/null
}

if ! have_torch; then
  echo "-- installing torch $torch_version into $venv (wheels cached in $wheels)"
  mkdir -p "$wheels"
  # PyPI's Linux wheel of torch is its CUDA build: it loads the CUDA libraries it links
  # (nvidia-* wheels, about 2.5 GB) even on a machine without a GPU, so they are installed
  # too; triton (only for torch.compile on GPUs) is not.
  # (expecttest: torch's own test suite imports it, see torch_suite/.)
  if [ ! -e "$wheels/.complete-$torch_version-2" ]; then
    python3 -m pip download --quiet --only-binary=:all: -d "$wheels" \
      "torch==$torch_version" pytest numpy ninja "setuptools>=77" wheel expecttest
    touch "$wheels/.complete-$torch_version-2"
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  find "$wheels" -name 'triton-*.whl' -delete
  "$py" -m pip install --quiet --no-index --no-deps "$wheels"/*.whl
  have_torch || { echo "torch did not install into $venv"; exit 1; }
fi
echo "-- $("$py" -c 'import torch; print("torch", torch.__version__)')"

echo "-- pip install --no-build-isolation ./ffi/torch"
start=$(date +%s)
PATH="$venv/bin:$PATH" "$py" -m pip install --quiet --no-build-isolation --no-deps ./ffi/torch
echo "built and installed in $(($(date +%s) - start)) s"

echo "-- pytest ffi/torch/tests"
(cd ffi/torch/tests && PATH="$venv/bin:$PATH" "$py" -m pytest -q -p no:cacheprovider --ignore=torch_suite .)

echo "-- torch's own distributed test suite (the part chosen for CI; all of it: torch_suite/run.sh all)"
PATH="$venv/bin:$PATH" ffi/torch/tests/torch_suite/run.sh ci
