#!/usr/bin/env bash
# Build time of long unrolled loops (issue 32's scaling targets: 2,000 steps in <= 2 s,
# 10,000 in <= 10 s on a 2-core machine). Writes a trained loop `h = tanh(h @ w) + h`
# unrolled N times, builds it for the CPU (the larger artifact) and prints the wall time,
# peak memory and the stage times `tcc build` reports.
# Usage: scripts/build-time.sh [N ...]   (default: 250 2000 10000)
# The artifact goes to $TCC_BUILD_TIME_DIR (default: a temporary directory), so a slow
# disk's write and fsync can be told from the compiler's own time.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p tcc
if [ -n "${TCC_BUILD_TIME_DIR:-}" ]; then
  dir="$TCC_BUILD_TIME_DIR"
else
  dir="$(mktemp -d)"
  trap 'rm -rf "$dir"' EXIT
fi
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(250 2000 10000)
for n in "${sizes[@]}"; do
  cat > "$dir/loop$n.tdsl" <<EOF
const N = $n
model m {
    input x: f32[8, 16]
    param w: f32[16, 16] = normal(0.0, 0.1)
    let h = x
    for i in 0..N {
        h = tanh(h @ w) + h
    }
    let loss = mean(h * h)
    output loss
    train sgd(lr: 0.01) minimize loss
}
EOF
  start=$(date +%s.%N)
  if ! log=$(/usr/bin/env time -f "%M" ./target/release/tcc build "$dir/loop$n.tdsl" -o "$dir/loop$n.tcc" 2>&1); then
    echo "N=$n: the build failed (GNU time is needed):"; echo "$log"; exit 1
  fi
  end=$(date +%s.%N)
  rss=$(tail -1 <<<"$log")
  printf 'N=%-6s %6.2f s  %5d MiB peak RSS\n' "$n" "$(awk "BEGIN{print $end - $start}")" "$((rss / 1024))"
  grep -E '^compiled' <<<"$log" | sed 's/^/    /'
  rm -f "$dir/loop$n.tcc" "$dir/loop$n.tdsl"
done
