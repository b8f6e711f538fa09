#!/usr/bin/env bash
# Rematerialization on Checkmate's training graphs (../shared/bench/remat): added
# recomputation at 90/70/50 % of the no-remat peak, against sqrt(n) checkpointing.
# Usage: scripts/remat-bench.sh [TIME_MS]   (default 2000 per graph and budget)
set -euo pipefail
cd "$(dirname "$0")/.."
t="${1:-2000}"
cargo build --release -q -p tcc
./target/release/tcc remat ../shared/bench/remat/checkmate_graphs/*_train.json --time-ms "$t"
