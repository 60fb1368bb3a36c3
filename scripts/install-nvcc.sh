#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler wheels (requirements-cuda.txt) into .toolchain/cuda-venv,
# where build.rs finds nvcc without any further setting. No GPU and no CUDA install are needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.toolchain/cuda-venv"
if [ ! -x "$venv/bin/python3" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python3" -m pip install -q --disable-pip-version-check -r "$root/requirements-cuda.txt"
nvcc=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
"$nvcc" --version | tail -n 2
echo "nvcc installed at $nvcc"
