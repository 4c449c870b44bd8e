#!/usr/bin/env bash
# The accelerator check at Qwen3-0.6B's shape (benchmarks/accelerator_check.py), on the GPU or TPU
# jax sees: decode tokens/s against the memory-bandwidth roofline, learner tokens/s and MFU.
# Install the accelerator build first (pip install -e ".[cuda12]" or ".[tpu]"). The tables go to
# stdout and are appended, with the date and commit, to benchmarks/accelerator_check.out; copy
# them into benchmarks/RESULTS.md with this command line.
#   bash benchmarks/accelerator_check.sh [extra flags, e.g. --batches 32,128 --peak_gbs 4800]
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "## $(date -u +%Y-%m-%dT%H:%MZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') bash benchmarks/accelerator_check.sh $*"
  python benchmarks/accelerator_check.py --model 0.6b --dtype bfloat16 "$@"
} | tee -a benchmarks/accelerator_check.out
