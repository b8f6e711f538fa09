"""The short table `scripts/gpu-check.sh device` prints last: tcc against PyTorch eager and
torch.compile per case (median step ms from CUDA events, peak device memory), with ratios.

    python3 bench/summary.py LOG_DIR    (LOG_DIR holds tcc-<case>.txt and torch.json; for the
    --amp table, tcc-<case>-<dtype>.txt and torch-<dtype>.json)
"""
import json
import os
import re
import sys

log = sys.argv[1] if len(sys.argv) > 1 else ".gpu/log"
torch = {}
ref = {}
try:
    with open(os.path.join(log, "torch.json")) as f:
        data = json.load(f)
    for r in data.get("runs", []):
        torch[(r["case"], r["mode"])] = r
    ref = data.get("reference", {})
except (OSError, ValueError):
    pass


def tcc(case):
    try:
        text = open(os.path.join(log, f"tcc-{case}.txt")).read()
    except OSError:
        return None, None
    ms = re.search(r"device step time .*?median ([0-9.]+) ms", text)
    arena = re.search(r"arena ([0-9.]+) (KiB|MiB|GiB)", text)
    return (float(ms.group(1)) if ms else None), mib_of(arena)


def mib_of(m):
    if not m:
        return None
    v = float(m.group(1))
    return v / 1024 if m.group(2) == "KiB" else v * 1024 if m.group(2) == "GiB" else v


def device_mib(case):
    """Device memory in use while tcc ran (cuMemGetInfo): arena + context + module."""
    try:
        text = open(os.path.join(log, f"tcc-{case}.txt")).read()
    except OSError:
        return None
    return mib_of(re.search(r"device memory in use: ([0-9.]+) (KiB|MiB|GiB)", text))


def session_mib(case):
    """Device memory of the session (cuMemGetInfo's drop after the context was made):
    arena + runtime overhead (module, CUDA graph, events)."""
    try:
        text = open(os.path.join(log, f"tcc-{case}.txt")).read()
    except OSError:
        return None
    return mib_of(re.search(r"device memory of this session: ([0-9.]+) (KiB|MiB|GiB)", text))


def fmt(x, d=2):
    return "n/a" if x is None else f"{x:.{d}f}"


print("| case | tcc ms | eager ms | compile ms | tcc/eager time | tcc arena MiB | tcc session MiB | tcc device MiB | eager peak MiB | tcc/eager memory |")
print("|---|---|---|---|---|---|---|---|---|---|")
for case in ["mlp", "cnn", "cnn-remat", "gpt", "gpt-remat", "gelu"]:
    ms, mib = tcc(case)
    if ms is None and mib is None:
        continue
    base = case.replace("-remat", "")
    e = torch.get((base, "eager"), {})
    c = torch.get((base, "compile"), {})
    em, cm, ep = e.get("median_ms"), c.get("median_ms"), e.get("peak_alloc_mib")
    rt = ms / em if ms and em else None
    sm = session_mib(case)
    ours = sm if sm else mib
    rm = ours / ep if ours and ep else None
    print(f"| {case} | {fmt(ms, 3)} | {fmt(em, 3)} | {fmt(cm, 3)} | {fmt(rt)} | {fmt(mib, 1)} | {fmt(sm, 1)} | {fmt(device_mib(case), 0)} | {fmt(ep, 1)} | {fmt(rm)} |")
print("(-remat: built with --mem-budget, recomputing activations; tcc session MiB: arena + runtime "
      "overhead (module, CUDA graph, events), the drop of cuMemGetInfo's free memory after the CUDA "
      "context was made; tcc device MiB: all memory in use while running, CUDA context included; "
      "eager peak: torch.cuda.max_memory_allocated, which leaves PyTorch's context out; "
      "tcc/eager memory: session MiB over eager peak)")
if "copy_gbps" in ref:
    ms, _ = tcc("gelu")
    gbps = 2 * 65536 * 1024 * 4 / (ms * 1e-3) / 1e9 if ms else None
    print(f"\ngelu(x + b) over 64M f32: {fmt(gbps, 0)} GB/s = {fmt(gbps / ref['copy_gbps'] * 100 if gbps else None, 0)}% of a device-to-device copy ({ref['copy_gbps']:.0f} GB/s)")

# GEMM M=N=K=4096 (bench/gemm_*.tdsl) against cuBLAS at the same precision.
if any(k.startswith("gemm_") for k in ref):
    n = ref.get("gemm_mnk", 4096)
    print(f"\n| GEMM {n}³ | tcc ms | tcc TFLOP/s | cuBLAS TFLOP/s | % of cuBLAS |")
    print("|---|---|---|---|---|")
    for case, key, what in [("gemm_f32", "gemm_f32_tflops", "f32 (FFMA, TF32 off)"),
                            ("gemm_tf32", "gemm_f32_tf32_tflops", "f32 with TF32"),
                            ("gemm_bf16", "gemm_bf16_tflops", "bf16 (f32 accumulation)")]:
        ms, _ = tcc(case)
        tf = 2 * n ** 3 / (ms * 1e-3) / 1e12 if ms else None
        cb = ref.get(key)
        pct = tf / cb * 100 if tf and cb else None
        print(f"| {what} | {fmt(ms, 3)} | {fmt(tf, 1)} | {fmt(cb, 1)} | {fmt(pct, 0)} |")

# Mixed precision (`scripts/gpu-check.sh device-amp`): tcc --amp against PyTorch autocast
# (fused optimizers; f16 with GradScaler), from tcc-<case>-<dtype>.txt and torch-<dtype>.json.
amp_runs = {}
for dtype in ["bf16", "f16"]:
    try:
        with open(os.path.join(log, f"torch-{dtype}.json")) as f:
            for r in json.load(f).get("runs", []):
                amp_runs[(dtype, r["case"], r["mode"])] = r
    except (OSError, ValueError):
        pass
if amp_runs:
    print("\n| case --amp | tcc ms | tcc session MiB | eager ms | compile ms | eager channels_last ms | eager peak MiB | tcc/best time | tcc/eager memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in ["bf16", "f16"]:
        for case in ["mlp", "cnn", "gpt"]:
            name = f"{case}-{dtype}"
            ms, mib = tcc(name)
            if ms is None and mib is None:
                continue
            sm = session_mib(name) or mib
            e, c, cl = (amp_runs.get((dtype, case, m), {}) for m in ("eager", "compile", "eager_cl"))
            em, cm, clm, ep = e.get("median_ms"), c.get("median_ms"), cl.get("median_ms"), e.get("peak_alloc_mib")
            best = min([x for x in (em, cm, clm) if x], default=None)
            print(f"| {case} {dtype} | {fmt(ms, 3)} | {fmt(sm, 1)} | {fmt(em, 3)} | {fmt(cm, 3)} | {fmt(clm, 3)} | {fmt(ep, 1)} "
                  f"| {fmt(ms / best if ms and best else None)} | {fmt(sm / ep if sm and ep else None)} |")
