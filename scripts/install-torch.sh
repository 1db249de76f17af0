#!/usr/bin/env bash
# Installs torch into the given interpreter's environment unless it is already there.
# Machines without CUDA get the CPU build of torch 2.13.0 (a local wheel on the project's
# machines, the PyTorch CPU index elsewhere); machines with CUDA get the default build.
set -euo pipefail
py="$1"
if "$py" -c "import torch" >/dev/null 2>&1; then
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.4"
elif ! "$py" -m pip install -q "torch==2.13.0" 2>/dev/null; then
    "$py" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
