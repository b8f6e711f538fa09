#!/usr/bin/env python3
"""Real architectures through `tcc`'s ONNX importer (issue 30, item 5).

Exports torchvision `resnet18` and `mobilenet_v2` and a 4-layer `transformers` GPT-2 (random
weights, seeded; nothing is downloaded) at batch 8 with `torch.onnx.export`, then for each:

- ONNX Runtime (CPU provider): the reference outputs and its CPU inference time;
- PyTorch eager inference on the GPU, when there is one (`torch.no_grad()`, CUDA events,
  `max_memory_allocated` after `reset_peak_memory_stats`, weights included);
- `tcc run model.onnx` on each `--targets` entry (`cuda`, `cpu`): the outputs written by
  `--save-outputs` are compared with ONNX Runtime's, and the median step time, the arena and
  the session's memory are read from its report.

    python3 bench/onnx_models.py [--tcc target/release/tcc] [--targets cuda,cuda-tf32,cpu]
        [--models resnet18,mobilenet_v2,gpt2] [--batch 8] [--steps 20] [--out DIR]

`cuda-tf32` runs tcc with `--allow-tf32`; PyTorch runs with TF32 off and on (its default for
convolutions). The model `gpt2-tiny` (one layer of width 64) is for quick checks.

Needs torch, torchvision, transformers, onnx, onnxruntime (and onnxscript for GPT-2's
export). Prints one table; `--json FILE` keeps the numbers. Errors are reported per model and
the run goes on.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np


def export(name, batch, out):
    import torch

    torch.manual_seed(0)
    path = os.path.join(out, f"{name.replace('-', '_')}.onnx")
    if name in ("resnet18", "mobilenet_v2"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None).eval()
        x = torch.randn(batch, 3, 224, 224)
        torch.onnx.export(model, (x,), path, input_names=["input"], output_names=["logits"],
                          opset_version=17, dynamo=False)
        return model, {"input": x.numpy()}, path
    if name in ("gpt2", "gpt2-tiny"):
        from transformers import GPT2Config, GPT2LMHeadModel

        # gpt2-tiny: one layer of width 64 over 1000 tokens, for quick checks.
        cfg = GPT2Config(n_layer=4) if name == "gpt2" else GPT2Config(
            n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
        lm = GPT2LMHeadModel(cfg).eval()

        class Logits(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, ids):
                return self.m(input_ids=ids, use_cache=False).logits

        model = Logits(lm).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, 128 if name == "gpt2" else 16))
        # The TorchScript exporter has no aten::diff (transformers' mask code): the dynamo one.
        prog = torch.onnx.export(model, (ids,), input_names=["input_ids"], output_names=["logits"],
                                 opset_version=18, dynamo=True)
        prog.save(path)
        return model, {"input_ids": ids.numpy()}, path
    raise SystemExit(f"unknown model {name}")


def ort_run(path, feeds, runs):
    import onnxruntime as ort

    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    outs = s.run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return outs, float(np.median(times))


def torch_gpu(model, feeds, runs, tf32):
    import torch

    if not torch.cuda.is_available():
        return None
    # PyTorch's default runs f32 convolutions on TF32 tensor cores (cudnn.allow_tf32) and f32
    # matmuls without; both are measured with TF32 off and on.
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    m = model.cuda()
    args = [torch.from_numpy(v).cuda() for v in feeds.values()]
    with torch.no_grad():
        for _ in range(3):
            m(*args)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            m(*args)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        peak = torch.cuda.max_memory_allocated()
    model.cpu()
    torch.cuda.empty_cache()
    return {"ms": float(np.median(times)), "peak_mib": peak / 2**20}


def tdsl_names(tdsl):
    """The imported program's input names (in graph order) and its output names."""
    ins = re.findall(r"^\s*input\s+(\w+):", tdsl, re.M)
    outs = re.search(r"^\s*output\s+(.+)$", tdsl, re.M)
    return ins, [o.strip() for o in outs.group(1).split(",")] if outs else []


def mib(text, label):
    m = re.search(label + r"[^0-9]*([0-9.]+) (B|KiB|MiB|GiB)", text)
    if not m:
        return None
    scale = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10}[m.group(2)]
    return float(m.group(1)) * scale


def tcc_run(tcc, path, feeds, names, target, steps, out):
    d = os.path.join(out, f"{os.path.basename(path)[:-5]}-{target}")
    os.makedirs(d, exist_ok=True)
    args = [tcc, "run", path, "--target", target.split("-")[0], "--steps", str(steps), "--every", str(steps),
            "--save-outputs", d]
    if target.endswith("-tf32"):
        args.append("--allow-tf32")
    for tname, (k, v) in zip(names[0], feeds.items()):
        f = os.path.join(out, f"{k}.npy")
        np.save(f, v)
        args += ["--input", f"{tname}={f}"]
    t = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t
    text = p.stdout + p.stderr
    if p.returncode != 0:
        return {"error": text.strip().splitlines()[-1] if text.strip() else f"exit {p.returncode}"}
    m = re.search(r"device step time[^\n]*median ([0-9.]+) ms", text) or re.search(
        r"step time: median ([0-9.]+) ms", text)
    outs = [np.load(os.path.join(d, f"{o}.npy")) for o in names[1]]
    return {
        "ms": float(m.group(1)) if m else None,
        "arena_mib": mib(text, r"arena:"),
        "session_mib": mib(text, r"device memory of this session:"),
        "wall_s": wall,
        "outs": outs,
        "report": [l for l in text.splitlines() if re.match(r"(model|arena|step time|device)", l)],
    }


def rel_err(got, want):
    """max |got - want| / max |want| over all elements of all outputs."""
    e = 0.0
    for g, w in zip(got, want):
        w = np.asarray(w, np.float64)
        e = max(e, float(np.max(np.abs(np.asarray(g, np.float64) - w)) / max(np.max(np.abs(w)), 1e-30)))
    return e


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tcc", default="target/release/tcc")
    ap.add_argument("--targets", default="cuda,cuda-tf32,cpu")
    ap.add_argument("--models", default="resnet18,mobilenet_v2,gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/tcc-onnx-models")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        row = {"model": name}
        rows.append(row)
        try:
            t = time.perf_counter()
            model, feeds, path = export(name, a.batch, a.out)
            row["export_s"] = time.perf_counter() - t
            want, row["ort_cpu_ms"] = ort_run(path, feeds, a.cpu_steps)
            row["torch_gpu"] = torch_gpu(model, feeds, a.steps, False)
            row["torch_gpu_tf32"] = torch_gpu(model, feeds, a.steps, True)
            stem = os.path.basename(path)[:-5]
            imp = subprocess.run([a.tcc, "import", path, "-o", os.path.join(a.out, stem), "-q"],
                                 capture_output=True, text=True)
            if imp.returncode != 0:
                row["error"] = "import: " + (imp.stderr.strip().splitlines() or ["?"])[-1]
                continue
            tdsl = open(os.path.join(a.out, stem, f"{stem}.tdsl")).read()
            names = tdsl_names(tdsl)
            for target in a.targets.split(","):
                steps = a.steps if target == "cuda" else a.cpu_steps
                r = tcc_run(a.tcc, path, feeds, names, target, steps, a.out)
                if "outs" in r:
                    r["rel_err"] = rel_err(r.pop("outs"), want)
                row[f"tcc_{target}"] = r
        except Exception as e:  # one model's failure must not hide the others'
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row, default=str), file=sys.stderr)
    print()
    print("GPU times: device step (CUDA events) for tcc, CUDA events around the forward for PyTorch;")
    print("memory: tcc's session (arena + module), PyTorch's max_memory_allocated (weights included).")
    print("| model | max rel. error vs ONNX Runtime | tcc GPU ms f32 / tf32 | PyTorch GPU ms f32 / tf32 | "
          "tcc GPU memory (arena / session) | PyTorch peak | session / PyTorch | tcc CPU ms | ORT CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    f = lambda v, s="{:.2f}": "-" if v is None else s.format(v)  # noqa: E731
    for r in rows:
        if "error" in r and not any(k.startswith("tcc_") for k in r):
            print(f"| {r['model']} | error: {r['error']} | | | | | | | |")
            continue
        g, g2, c = r.get("tcc_cuda", {}), r.get("tcc_cuda-tf32", {}), r.get("tcc_cpu", {})
        t, t2 = r.get("torch_gpu") or {}, r.get("torch_gpu_tf32") or {}
        errs = [f"{k[4:]} {v['rel_err']:.1e}" for k, v in r.items()
                if k.startswith("tcc_") and "rel_err" in v]
        errs += [f"{k[4:]}: {v['error']}" for k, v in r.items() if k.startswith("tcc_") and "error" in v]
        ratio = (g.get("session_mib") / t["peak_mib"]) if g.get("session_mib") and t.get("peak_mib") else None
        print(f"| {r['model']} | {'; '.join(errs)} | {f(g.get('ms'), '{:.3f}')} / {f(g2.get('ms'), '{:.3f}')} | "
              f"{f(t.get('ms'), '{:.3f}')} / {f(t2.get('ms'), '{:.3f}')} | "
              f"{f(g.get('arena_mib'), '{:.1f}')} / {f(g.get('session_mib'), '{:.1f}')} MiB | "
              f"{f(t.get('peak_mib'), '{:.1f}')} MiB | {f(ratio, '{:.2f}x')} | {f(c.get('ms'), '{:.1f}')} | "
              f"{f(r.get('ort_cpu_ms'), '{:.1f}')} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
