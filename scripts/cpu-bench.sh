#!/usr/bin/env bash
# The CPU back end against PyTorch CPU and NumPy on this machine (issue 28): builds tcc in
# release, installs NumPy and PyTorch with pip if they are missing, and prints the table of
# bench/cpu_bench.py (1 and 2 threads by default; arguments are passed on to it).
#
#   bash scripts/cpu-bench.sh [--threads 1,2] [--rows convs,cnn,mlp,gemm,gelu,copy,softmax] [--steps 5]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tcc
python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch
exec python3 bench/cpu_bench.py "$@"
