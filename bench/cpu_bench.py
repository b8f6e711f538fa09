#!/usr/bin/env python3
"""The CPU back end against PyTorch CPU and NumPy, side by side in one run (issue 28).

For each thread count, runs every row of bench/cpu_baseline.py with tcc (`tcc run ...
--threads N`, the median step time it prints) and with the baselines, then prints one
markdown table: tcc's time, each baseline's, and tcc / the best baseline. The copy row is the
bandwidth the fused pointwise row is read against (tcc's gelu as a percentage of tcc's copy).

    python3 bench/cpu_bench.py [--tcc target/release/tcc] [--threads 1,2] [--steps 5]

scripts/cpu-bench.sh builds tcc and installs NumPy and PyTorch first.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = {
    "convs": ["bench/cpu/convs.tdsl"],
    "cnn": ["examples/cnn.tdsl", "--set", "B=8", "--set", "C=16", "--set", "S=32"],
    "mlp": ["examples/mlp.tdsl"],
    "gemm": ["bench/cpu/gemm.tdsl"],
    "gelu": ["bench/cpu/gelu.tdsl"],
    "copy": ["bench/cpu/copy.tdsl"],
    "softmax": ["bench/cpu/softmax.tdsl"],
}
DESCRIBE = {
    "convs": "five 3×3 convs 32→32 + relu, 8×32×28×28, forward",
    "cnn": "cnn.tdsl training step, B=8 C=16 S=32",
    "mlp": "mlp.tdsl training step, B=256",
    "gemm": "GEMM 1024³",
    "gelu": "gelu(x + b), 16M f32",
    "copy": "-x, 16M f32 (copy bandwidth)",
    "softmax": "softmax over rows, 16384×1024 f32",
}

p = argparse.ArgumentParser()
p.add_argument("--tcc", default=os.path.join(ROOT, "target", "release", "tcc"))
p.add_argument("--threads", default="1,2")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--rows", default=",".join(ROWS))
a = p.parse_args()


def tcc_ms(row, threads):
    cmd = [a.tcc, "run", *ROWS[row], "--threads", str(threads), "--steps", str(a.steps + 1),
           "--every", str(a.steps + 1), "-q"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    m = re.search(r"step time: median ([0-9.]+) ms", out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        sys.exit(f"tcc failed on {row}: {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    return float(m.group(1))


def baselines(rows, threads):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "cpu_baseline.py"), "--threads",
           str(threads), "--rows", ",".join(rows), "--steps", str(a.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    res = {}
    for line in out.stdout.splitlines():
        row, lib, ms = line.split()
        res.setdefault(row, {})[lib] = float(ms)
    return res


rows = [r for r in a.rows.split(",") if r in ROWS]
for t in [int(x) for x in a.threads.split(",")]:
    base = baselines(rows, t)
    mine = {r: tcc_ms(r, t) for r in rows}
    print(f"\n### {t} thread{'s' if t > 1 else ''}\n")
    print("| work | tcc ms | baselines ms | tcc / best baseline |")
    print("|---|---|---|---|")
    for r in rows:
        b = base.get(r, {})
        libs = ", ".join(f"{k} {v:.2f}" for k, v in sorted(b.items()))
        ratio = f"{mine[r] / min(b.values()):.2f}×" if b else "n/a"
        print(f"| {DESCRIBE[r]} | {mine[r]:.2f} | {libs or 'n/a'} | {ratio} |")
    if "gelu" in mine and "copy" in mine:
        print(f"\ntcc's gelu runs at {100 * mine['copy'] / mine['gelu']:.0f} % of tcc's copy "
              f"(same bytes read and written).")
