"""The mlp training step of examples/mlp.tdsl in NumPy (OpenBLAS), for comparing CPU step
times with `tcc run examples/mlp.tdsl --target cpu`.

Same sizes and math: x f32[256, 784], 784-1024-1024-1024-10 with ReLU, softmax
cross-entropy, plain SGD lr 0.05; forward, backward and update, all f32. Prints the median
step time over --steps steps after one warm-up step.

    python3 bench/numpy_mlp.py [--steps 10] [--threads N]
"""
import argparse
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--threads", type=int, default=0, help="OpenBLAS threads (0: its default)")
a = p.parse_args()
if a.threads:
    os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)
import numpy as np  # noqa: E402  (after setting the thread count)

B, D, C, LR = 256, 1024, 10, 0.05
rng = np.random.default_rng(0)
f = np.float32
w_in = (rng.standard_normal((784, D)) * 0.05).astype(f)
b_in = np.zeros(D, f)
w_h = [(rng.standard_normal((D, D)) * 0.044).astype(f) for _ in range(2)]
b_h = [np.zeros(D, f) for _ in range(2)]
w_out = (rng.standard_normal((D, C)) * 0.044).astype(f)
b_out = np.zeros(C, f)
x = rng.standard_normal((B, 784)).astype(f)
labels = rng.integers(0, C, B)


def step():
    global w_in, b_in, w_out, b_out
    h0 = np.maximum(x @ w_in + b_in, 0)
    hs = [h0]
    for w, b in zip(w_h, b_h):
        hs.append(np.maximum(hs[-1] @ w + b, 0))
    logits = hs[-1] @ w_out + b_out
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - logits[np.arange(B), labels]))
    dlogits = e / s
    dlogits[np.arange(B), labels] -= 1
    dlogits /= B
    dh = dlogits @ w_out.T
    w_out = w_out - LR * (hs[-1].T @ dlogits)
    b_out = b_out - LR * dlogits.sum(0)
    for i in (1, 0):
        dz = dh * (hs[i + 1] > 0)
        dh = dz @ w_h[i].T
        w_h[i] = w_h[i] - LR * (hs[i].T @ dz)
        b_h[i] = b_h[i] - LR * dz.sum(0)
    dz = dh * (h0 > 0)
    w_in = w_in - LR * (x.T @ dz)
    b_in = b_in - LR * dz.sum(0)
    return loss


step()
times = []
for _ in range(a.steps):
    t = time.perf_counter()
    loss = step()
    times.append((time.perf_counter() - t) * 1e3)
times.sort()
print(f"numpy mlp step: median {times[len(times) // 2]:.2f} ms, min {times[0]:.2f} ms over {a.steps} steps (loss {loss:.4f})")
