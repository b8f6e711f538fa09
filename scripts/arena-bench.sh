#!/usr/bin/env bash
# Runs the planner's offset assignment on the MiniMalloc challenging instances
# (../shared/bench/minimalloc) and prints one line per instance: arena, lower bound,
# distance to the capacity (the best known arena), time.
# Usage: scripts/arena-bench.sh [BUDGET_MS]   (default 4500)
set -euo pipefail
cd "$(dirname "$0")/.."
budget="${1:-4500}"
cargo build --release -q -p tcc
for f in ../shared/bench/minimalloc/[A-K].*.csv; do
  ./target/release/tcc arena "$f" --budget-ms "$budget"
done
