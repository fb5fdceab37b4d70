#!/usr/bin/env bash
# The GPU check as run on a lent machine: bash benchmarks/gpu/run.sh [check.py options]
# Writes gpu_check.json, gpu_check.md and gpu_check.log into $OUT (default /tmp/gpu_check).
# PYTHON picks the interpreter (default python3: on the GPU image, the one with torch).
set -uo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

"$python" -c 'import sys, torch, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),",
      f"transformers {transformers.__version__}, GPU: {gpu}")'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

# check.py stops starting new work at 480 s; the timeout is the backstop
timeout 540 "$python" benchmarks/gpu/check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
