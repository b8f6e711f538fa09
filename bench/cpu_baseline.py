#!/usr/bin/env python3
"""CPU baselines for the rows of scripts/cpu-bench.sh (issue 28): PyTorch CPU and NumPy
(OpenBLAS) on the same shapes as the tcc benchmarks, at a given thread count.

Rows (same math and sizes as the TDSL files named):
  convs  bench/cpu/convs.tdsl   five 3x3 convs 32->32 (padding 1) + relu on 8x32x28x28, forward
  cnn    examples/cnn.tdsl      training step at B=8 C=16 S=32 (bench/torch_bench.py's model,
                                SGD with momentum; PyTorch eager; channels_last as its own row)
  mlp    examples/mlp.tdsl      training step at B=256 (bench/torch_bench.py's model; NumPy's in
                                bench/numpy_mlp.py)
  gemm   bench/cpu/gemm.tdsl    1024^3 f32 matmul (NumPy and PyTorch)
  gelu   bench/cpu/gelu.tdsl    gelu(x + b) over 16M f32, tanh form (NumPy and PyTorch)
  copy   bench/cpu/copy.tdsl    -x over 16M f32 (NumPy: the bandwidth the gelu row is read against)
  softmax bench/cpu/softmax.tdsl softmax over the rows of 16384x1024 f32 (NumPy and PyTorch)

Prints one line per row and library: `row lib ms` (median of --steps timed runs after
--warmup runs). Thread counts are set before the libraries load (OMP/OpenBLAS/MKL variables
and torch.set_num_threads).

    python3 bench/cpu_baseline.py --threads 1 [--rows convs,cnn,...] [--steps 5]
"""
import argparse
import os
import statistics
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
p.add_argument("--rows", default="convs,cnn,mlp,gemm,gelu,copy,softmax")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
a = p.parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(a.threads)
import numpy as np  # noqa: E402  (after the thread count)

try:
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402

    torch.set_num_threads(a.threads)
except ImportError:
    torch = None
    print("# PyTorch is not installed: its rows are skipped (pip install torch)", file=sys.stderr)


def median_ms(fn):
    for _ in range(a.warmup):
        fn()
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def report(row, lib, fn):
    print(f"{row} {lib} {median_ms(fn):.3f}", flush=True)


def torch_step(name, channels_last=False, **shape):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_bench  # noqa: E402

    torch.manual_seed(0)
    loss_fn, inputs, opt, _ = torch_bench.MODELS[name]("cpu", **shape)
    if channels_last:
        inputs = tuple(
            x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
            for x in inputs
        )

    def step():
        loss = loss_fn(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


rows = a.rows.split(",")
rng = np.random.default_rng(0)
f32 = np.float32
if "convs" in rows and torch is not None:
    x = torch.randn(8, 32, 28, 28)
    ws = [torch.randn(32, 32, 3, 3) * 0.08 for _ in range(5)]

    def convs(x=x):
        with torch.no_grad():
            for w in ws:
                x = F.relu(F.conv2d(x, w, padding=1))
        return x

    report("convs", "torch", convs)
    xc = x.contiguous(memory_format=torch.channels_last)
    report("convs", "torch_cl", lambda: convs(xc))
if "cnn" in rows and torch is not None:
    report("cnn", "torch", torch_step("cnn", B=8, C=16, S=32))
    report("cnn", "torch_cl", torch_step("cnn", channels_last=True, B=8, C=16, S=32))
if "mlp" in rows and torch is not None:
    report("mlp", "torch", torch_step("mlp", B=256, D=1024, L=2))
if "gemm" in rows:
    ga = rng.standard_normal((1024, 1024)).astype(f32)
    gb = rng.standard_normal((1024, 1024)).astype(f32)
    gc = np.empty_like(ga)
    report("gemm", "numpy", lambda: np.matmul(ga, gb, out=gc))
    if torch is not None:
        ta, tb = torch.from_numpy(ga), torch.from_numpy(gb)
        tc = torch.empty(1024, 1024)
        report("gemm", "torch", lambda: torch.matmul(ta, tb, out=tc))
if "gelu" in rows or "copy" in rows:
    x = rng.standard_normal((16384, 1024)).astype(f32)
    b = rng.standard_normal(1024).astype(f32)
    y = np.empty_like(x)
    if "gelu" in rows:
        c = f32(np.sqrt(2.0 / np.pi))

        def gelu_np():
            t = np.add(x, b, out=y)
            u = t * t
            u *= t
            u *= f32(0.044715)
            u += t
            u *= c
            np.tanh(u, out=u)
            u += f32(1.0)
            u *= f32(0.5)
            np.multiply(t, u, out=y)

        report("gelu", "numpy", gelu_np)
        if torch is not None:
            tx, tb = torch.from_numpy(x), torch.from_numpy(b)
            report("gelu", "torch", lambda: F.gelu(tx + tb, approximate="tanh"))
    if "copy" in rows:
        report("copy", "numpy", lambda: np.negative(x, out=y))
if "softmax" in rows:
    sx = rng.standard_normal((16384, 1024)).astype(f32)
    sy = np.empty_like(sx)

    def softmax_np():
        np.subtract(sx, sx.max(axis=1, keepdims=True), out=sy)
        np.exp(sy, out=sy)
        np.divide(sy, sy.sum(axis=1, keepdims=True), out=sy)

    report("softmax", "numpy", softmax_np)
    if torch is not None:
        tsx = torch.from_numpy(sx)
        report("softmax", "torch", lambda: torch.softmax(tsx, dim=1))
