#!/usr/bin/env python3
"""PyTorch baseline for "tcc vs PyTorch eager and torch.compile on the same models and sizes".

The models are the repo's TDSL examples, transcribed op for op (same shapes, same math, same
initialiser distributions, same optimizer and hyper-parameters):

  mlp   examples/mlp.tdsl   B=256, 784-1024-1024-1024-10, relu, cross_entropy, SGD(lr=0.05)
  cnn   examples/cnn.tdsl   ResNet-18-style CIFAR-10, B=128 C=64 S=32, bias-free 3x3 convs,
                            training-mode batch norm (batch statistics, biased variance, no
                            running stats), 1x1 stride-2 projection shortcuts, avg_pool2d(S/8),
                            SGD(lr=0.1, momentum=0.9, weight_decay=5e-4) on every param
  gpt   examples/gpt.tdsl   L=12 D=768 H=12 T=512 B=8 V=8192, pre-norm RMSNorm (no biases, no
                            positional embedding), causal attention, tanh-GELU MLP 4D, final
                            RMSNorm, logits tied to the embedding (x @ wte^T), Adam(lr=3e-4)
  gelu  bench/gelu.tdsl     y = gelu(x + b), x f32[65536, 1024], b f32[1024], forward only

The prelude ops (compiler/src/front/prelude.tdsl) run as PyTorch's own kernels by default
(--impl native: F.cross_entropy, F.batch_norm(training=True), F.scaled_dot_product_attention,
F.gelu(approximate="tanh"), F.rms_norm): the baseline a PyTorch user would write. --impl
prelude instead transcribes every prelude function op by op (max-subtracted softmax, masked
where(tril) attention, ...), i.e. exactly the graph tcc differentiates. Both compute the same
math; with the same params and inputs, both give the losses of tcc's eager interpreter
(`tcc run --eager`) to 6 digits over 3 training steps of every model. Params are separate
tensors per layer (tcc stacks some along a first axis: same math, same sizes); the inputs are
fixed random tensors drawn once (class ids as int64, PyTorch's index dtype; tcc's are i32).

Modes. eager: the plain training step (forward, loss.backward(), opt.step(), zero_grad).
compile: torch.compile (default mode) of that whole step function. Dynamo breaks the graph at
loss.backward() (and skips Optimizer.zero_grad), so forward and its AOTAutograd backward are
one compiled pair and opt.step() is compiled as graph(s) of its own; the note gives Dynamo's
graph and graph-break counts. If that fails, only the loss function is compiled (noted).

Measured per case and mode, on CUDA: median (and min/mean) step time in ms over --steps timed
steps after --warmup warm-up steps, each step bracketed by CUDA events after a synchronize
(so a step's time includes its own launch overhead). Both modes first make 3 extra untimed
calls, so that both take the same number of steps; under torch.compile these compile, and
their wall time is reported as compile_s. Memory: torch.cuda.reset_peak_memory_stats() before
the timed steps, torch.cuda.max_memory_allocated() (peak) and memory_reserved() after;
"resident" is memory_allocated() before the timed steps (params, optimizer state, inputs).
The allocator cache is emptied before every run. f32 everywhere; TF32 is OFF for matmul and
cuDNN unless --tf32. cudnn.benchmark is on (fixed shapes) unless --no-cudnn-benchmark.
References: cuBLAS GEMM M=N=K=4096 via torch.matmul in f32 (TF32 per the flag) and bf16, in
TFLOP/s (2MNK/t); device-to-device copy of 256 MiB (dst.copy_(src)), in GB/s counting bytes
read + written (2 x 256 MiB / t, GB = 1e9 bytes). Both: median of 20 samples, each sample 5
back-to-back calls between two CUDA events (so launch gaps do not count), after 5 warm-ups.

--device cpu runs everything on the CPU (time.perf_counter, memory n/a); --small shrinks every
case (SIZES below; gemm 256, copy 4 MiB) for a smoke test. Seeds are fixed (--seed, default 0).
The first training step's loss ("loss first", about ln 10 = 2.30 for mlp and cnn, ln V for
gpt) and the last timed step's are reported as a sanity check.

Mixed precision (--amp bf16|f16): each model's loss runs under torch.autocast with that dtype
(f32 params: master weights), f16 with torch.amp.GradScaler (PyTorch's defaults), and the
optimizer is the fused one (fused=True), as a user training in 16 bits would run it. Mode
eager_cl (cnn only) is eager with the images and conv weights in channels_last. Mode ckpt is
eager with PyTorch's per-block activation checkpointing (torch.utils.checkpoint, non-reentrant)
around every block: gpt's transformer layers, the cnn's residual blocks, the mlp's hidden
layers; tcc's `--mem-budget` at its peak is compared with it.

  python3 bench/torch_bench.py [--cases mlp,cnn,gpt,gelu,gemm,copy] [--modes eager,compile,eager_cl,ckpt]
      [--amp off|bf16|f16]
      [--warmup 5] [--steps 20] [--json out.json] [--small] [--device cuda|cpu] [--tf32]
      [--impl native|prelude]
"""
import argparse, gc, json, math, statistics, sys, time, traceback

try:
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint
except ImportError:
    sys.exit("error: PyTorch is not installed (pip install torch)")

IMPL = "native"  # set from --impl; read by the prelude functions below
CKPT = False  # set by mode ckpt; read by block() below
MIB = 1 << 20

# ---- the prelude (compiler/src/front/prelude.tdsl) --------------------------------------


def softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def log_softmax(x):
    s = x - x.amax(-1, keepdim=True)
    return s - torch.log(torch.exp(s).sum(-1, keepdim=True))


def rms_norm(x, g, eps=1e-5):
    if IMPL == "native" and hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), g, eps)
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * g


def batch_norm(x, g, b, eps=1e-5):  # training-mode statistics over N, H, W; biased variance
    if IMPL == "native":
        return F.batch_norm(x, None, None, g, b, training=True, eps=eps)
    c = x - x.mean((0, 2, 3), keepdim=True)
    v = (c * c).mean((0, 2, 3), keepdim=True)
    return c * torch.rsqrt(v + eps) * g.reshape(-1, 1, 1) + b.reshape(-1, 1, 1)


def cross_entropy(logits, labels):  # mean over N of -log softmax(logits)[label]
    if IMPL == "native":
        return F.cross_entropy(logits, labels)
    n, c = logits.shape
    hit = labels.unsqueeze(1) == torch.arange(c, device=logits.device)
    return -torch.where(hit, log_softmax(logits), 0.0).sum() / n


def linear(x, w, b):
    return x @ w + b


def gelu(x):  # the tanh form
    if IMPL == "native":
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def attention(q, k, v, causal=False):  # [.., T, Dh] queries, scaled by 1/sqrt(Dh)
    if IMPL == "native":  # is_causal aligns the mask top-left: the same as tril(k: S - T) at T = S
        assert not causal or q.shape[-2] == k.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    t, s = q.shape[-2], k.shape[-2]
    sc = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        sc = torch.where(keep, sc, float("-inf"))
    return softmax(sc) @ v


# ---- the models ---------------------------------------------------------------------------


def block(fn, *args):
    """fn(*args), one block of a model. Under mode ckpt, PyTorch's per-block activation
    checkpointing: torch.utils.checkpoint (non-reentrant) keeps the block's inputs and
    recomputes its activations in the backward pass."""
    if CKPT:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class Params(dict):
    """name -> leaf tensor; normal/zeros/ones as the TDSL `param ... = INIT` clauses."""

    def __init__(self, dev):
        super().__init__()
        self.dev = dev

    def normal(self, name, shape, std):
        self[name] = (torch.randn(shape, device=self.dev) * std).requires_grad_()

    def const(self, name, shape, value):
        self[name] = torch.full(shape, float(value), device=self.dev, requires_grad=True)


# The TDSL constants (full, --small) of every case.
SIZES = {
    "mlp": (dict(B=256, D=1024, L=2), dict(B=8, D=32, L=2)),
    "cnn": (dict(B=128, C=64, S=32), dict(B=2, C=4, S=8)),
    "gpt": (dict(B=8, T=512, D=768, H=12, L=12, V=8192), dict(B=2, T=16, D=32, H=2, L=1, V=64)),
    "gelu": (dict(N=65536, M=1024), dict(N=1024, M=1024)),
}


def build_mlp(dev, B, D, L):  # examples/mlp.tdsl
    P = Params(dev)
    P.normal("w_in", [784, D], 0.05); P.const("b_in", [D], 0)
    for i in range(L):
        P.normal(f"w_h{i}", [D, D], 0.044); P.const(f"b_h{i}", [D], 0)
    P.normal("w_out", [D, 10], 0.044); P.const("b_out", [10], 0)
    x = torch.randn(B, 784, device=dev)
    labels = torch.randint(0, 10, (B,), device=dev)

    def loss_fn(x, labels):
        h = torch.relu(linear(x, P["w_in"], P["b_in"]))
        for i in range(L):
            h = block(lambda h, i=i: torch.relu(linear(h, P[f"w_h{i}"], P[f"b_h{i}"])), h)
        logits = linear(h, P["w_out"], P["b_out"])
        return cross_entropy(logits, labels)

    opt = torch.optim.SGD(list(P.values()), lr=0.05)
    return loss_fn, (x, labels), opt, P


def build_cnn(dev, B, C, S):  # examples/cnn.tdsl
    P = Params(dev)

    def bn(name, width):
        P.const(name + "_g", [width], 1); P.const(name + "_b", [width], 0)

    P.normal("stem_w", [C, 3, 3, 3], 0.27); bn("stem", C)
    for j in range(4):  # stage 1: two identity blocks, convs 0..3
        P.normal(f"s1_w{j}", [C, C, 3, 3], 0.059); bn(f"s1_{j}", C)
    # stages 2-4: (in width, out width, std of wd, ws, w) as in the file
    stages = {2: (C, 2 * C, 0.059, 0.18, 0.042), 3: (2 * C, 4 * C, 0.042, 0.125, 0.029),
              4: (4 * C, 8 * C, 0.029, 0.088, 0.021)}
    for s, (i, o, sd, ss, sw) in stages.items():
        P.normal(f"s{s}_wd", [o, i, 3, 3], sd)
        P.normal(f"s{s}_ws", [o, i, 1, 1], ss)
        for j in range(3):
            P.normal(f"s{s}_w{j}", [o, o, 3, 3], sw)
        for j in range(5):
            bn(f"s{s}_{j}", o)
    P.normal("fc_w", [8 * C, 10], 0.044); P.const("fc_b", [10], 0)
    images = torch.randn(B, 3, S, S, device=dev)
    labels = torch.randint(0, 10, (B,), device=dev)

    def conv_bn(x, w, bnname, stride=1):  # 3x3 conv, padding 1, no bias; then batch norm
        y = F.conv2d(x, P[w], stride=stride, padding=1)
        return batch_norm(y, P[bnname + "_g"], P[bnname + "_b"])

    def basic(x, w1, bn1, w2, bn2):
        h = torch.relu(conv_bn(x, w1, bn1))
        return torch.relu(conv_bn(h, w2, bn2) + x)

    def down(x, s):  # stride 2, 1x1 stride-2 projection (padding 0) + batch norm on shortcut
        h = torch.relu(conv_bn(x, f"s{s}_wd", f"s{s}_0", stride=2))
        sc = batch_norm(F.conv2d(x, P[f"s{s}_ws"], stride=2), P[f"s{s}_2_g"], P[f"s{s}_2_b"])
        return torch.relu(conv_bn(h, f"s{s}_w0", f"s{s}_1") + sc)

    def loss_fn(images, labels):
        x = torch.relu(conv_bn(images, "stem_w", "stem"))
        for i in range(2):
            x = block(basic, x, f"s1_w{2 * i}", f"s1_{2 * i}", f"s1_w{2 * i + 1}",
                      f"s1_{2 * i + 1}")
        for s in (2, 3, 4):
            x = block(down, x, s)
            x = block(basic, x, f"s{s}_w1", f"s{s}_3", f"s{s}_w2", f"s{s}_4")
        pooled = F.avg_pool2d(x, S // 8).reshape(B, 8 * C)
        return cross_entropy(linear(pooled, P["fc_w"], P["fc_b"]), labels)

    opt = torch.optim.SGD(list(P.values()), lr=0.1, momentum=0.9, weight_decay=5e-4)
    return loss_fn, (images, labels), opt, P


def build_gpt(dev, B, T, D, H, L, V):  # examples/gpt.tdsl
    P = Params(dev)
    P.normal("wte", [V, D], 0.02)
    for l in range(L):
        P.const(f"g1_{l}", [D], 1); P.normal(f"wqkv_{l}", [D, 3 * D], 0.02)
        P.normal(f"wo_{l}", [D, D], 0.02); P.const(f"g2_{l}", [D], 1)
        P.normal(f"w1_{l}", [D, 4 * D], 0.02); P.normal(f"w2_{l}", [4 * D, D], 0.02)
    P.const("gf", [D], 1)
    tokens = torch.randint(0, V, (B, T), device=dev)
    targets = torch.randint(0, V, (B, T), device=dev)

    def heads(t):  # the batch read from the tensor: a micro-batch is a slice of it
        return t.reshape(t.shape[0], T, H, D // H).permute(0, 2, 1, 3)

    def layer(x, l):
        q, k, v = (rms_norm(x, P[f"g1_{l}"]) @ P[f"wqkv_{l}"]).split(D, dim=-1)
        a = attention(heads(q), heads(k), heads(v), causal=True)
        x = x + a.permute(0, 2, 1, 3).reshape(x.shape[0], T, D) @ P[f"wo_{l}"]
        return x + gelu(rms_norm(x, P[f"g2_{l}"]) @ P[f"w1_{l}"]) @ P[f"w2_{l}"]

    def loss_fn(tokens, targets):
        x = F.embedding(tokens, P["wte"])
        for l in range(L):
            x = block(layer, x, l)
        logits = rms_norm(x, P["gf"]) @ P["wte"].t()
        return cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    opt = torch.optim.Adam(list(P.values()), lr=3e-4, betas=(0.9, 0.999), eps=1e-8)
    return loss_fn, (tokens, targets), opt, P


MODELS = {"mlp": build_mlp, "cnn": build_cnn, "gpt": build_gpt}

# ---- timing -------------------------------------------------------------------------------


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def fresh(dev):
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def time_steps(fn, dev, warmup, steps, reps=1):
    """Run fn warmup times, then steps timed samples of reps back-to-back calls each; returns
    (ms per call of every sample, memory dict)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    mem = {}
    if dev == "cuda":
        mem["resident_mib"] = torch.cuda.memory_allocated() / MIB
        torch.cuda.reset_peak_memory_stats()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    ms = []
    for i in range(steps):
        if dev == "cuda":
            torch.cuda.synchronize()
            ev[i][0].record()
            for _ in range(reps):
                fn()
            ev[i][1].record()
            ev[i][1].synchronize()
            ms.append(ev[i][0].elapsed_time(ev[i][1]) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ms.append((time.perf_counter() - t0) * 1e3 / reps)
    if dev == "cuda":
        mem["peak_alloc_mib"] = torch.cuda.max_memory_allocated() / MIB
        mem["reserved_mib"] = torch.cuda.memory_reserved() / MIB
    return ms, mem


def first_calls(fn, dev, calls=3):
    """The first calls of fn (for a compiled fn: compilation and any recompilation), made in
    both modes so that both take the same number of steps: (seconds, first result)."""
    sync(dev); t0 = time.perf_counter()
    first = fn()
    for _ in range(calls - 1):
        fn()
    sync(dev)
    return time.perf_counter() - t0, first


def graph_stats():
    """Dynamo's graph and graph-break counts since the last reset (e.g. loss.backward() and
    Optimizer.zero_grad are graph breaks; opt.step() is traced as graphs of its own)."""
    c = torch._dynamo.utils.counters
    breaks = sum(c["graph_break"].values())
    return f" ({c['stats']['unique_graphs']} graphs, {breaks} graph breaks)"


def run_model(name, mode, args):
    torch.manual_seed(args.seed)
    shape = SIZES[name][args.small]
    loss_fn, inputs, opt, params = MODELS[name](args.device, **shape)
    if mode == "eager_cl":
        if name != "cnn":
            raise ValueError("eager_cl is for the cnn only")
        for p in params.values():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
        inputs = (inputs[0].contiguous(memory_format=torch.channels_last), *inputs[1:])
    amp = {"bf16": torch.bfloat16, "f16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(args.device) if args.amp == "f16" else None
    if amp is not None and args.device == "cuda":
        kw = {k: v for k, v in opt.defaults.items()
              if k in ("lr", "momentum", "weight_decay", "betas", "eps")}
        opt = type(opt)(list(params.values()), fused=True, **kw)

    k = args.micro_batches
    if inputs[0].shape[0] % k:
        raise ValueError(f"--micro-batches {k} does not divide the batch {inputs[0].shape[0]}")
    slices = list(zip(*(t.chunk(k) for t in inputs)))  # gradient accumulation: k slices

    def make_step(lf):
        def step():
            total = 0.0
            for part in slices:  # each slice's mean loss / k: the whole batch's mean
                if amp is None:
                    loss = lf(*part) / k
                else:
                    with torch.autocast(args.device, dtype=amp):
                        loss = lf(*part) / k
                if scaler is None:
                    loss.backward()
                else:
                    scaler.scale(loss).backward()
                total = total + loss.detach()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
            return total
        return step

    step, note, compile_s = make_step(loss_fn), "", None
    if mode in ("eager", "eager_cl", "ckpt"):
        loss_first = first_calls(step, args.device)[1]
    else:
        torch._dynamo.utils.counters.clear()
        try:
            step = torch.compile(make_step(loss_fn))
            compile_s, loss_first = first_calls(step, args.device)
            note = "whole step compiled" + graph_stats()
        except Exception as e:  # fall back to compiling forward (+ its AOT backward) only
            print(f"[{name}/compile] whole-step compile failed ({type(e).__name__}: {e}); "
                  "compiling the loss function only", file=sys.stderr)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            step = make_step(torch.compile(loss_fn))
            compile_s, loss_first = first_calls(step, args.device)
            note = "fwd+bwd compiled, opt.step eager (whole-step compile failed)" + graph_stats()
    loss_first = float(loss_first)
    last = [None]  # the last step's loss (a 0-d tensor), read after the timed steps

    def timed():
        last[0] = step()

    ms, mem = time_steps(timed, args.device, args.warmup, args.steps)
    return dict(shape=shape, ms=ms, mem=mem, compile_s=compile_s, note=note,
                loss_first=loss_first, loss_last=float(last[0]))


def run_gelu(mode, args):
    torch.manual_seed(args.seed)
    n, m = SIZES["gelu"][args.small].values()
    x = torch.randn(n, m, device=args.device)
    b = torch.randn(m, device=args.device)

    def f(x, b):
        return gelu(x + b)

    fn, compile_s = f, None
    with torch.no_grad():
        if mode == "compile":
            fn = torch.compile(f)
            compile_s = first_calls(lambda: fn(x, b), args.device)[0]  # y not kept alive
        ms, mem = time_steps(lambda: fn(x, b), args.device, args.warmup, args.steps)
    gbps = 2 * n * m * 4 / (statistics.median(ms) * 1e-3) / 1e9  # x read + y written
    return dict(shape=dict(N=n, M=m), ms=ms, mem=mem, compile_s=compile_s, effective_gbps=gbps,
                note=f"forward only; {gbps:.0f} GB/s effective (x read + y written)")


def ref_gemm(args):
    """cuBLAS through torch.matmul at M=N=K: f32 with TF32 off, f32 with TF32 on (the row
    tcc's `--allow-tf32` build compares with) and bf16 (f32 accumulation)."""
    n = 256 if args.small else 4096
    out = {}
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for key, dt, tf32 in (("f32", torch.float32, False), ("f32_tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.manual_seed(args.seed)
            a = torch.randn(n, n, device=args.device, dtype=dt)
            b = torch.randn(n, n, device=args.device, dtype=dt)
            c = torch.empty(n, n, device=args.device, dtype=dt)
            ms, _ = time_steps(lambda: torch.matmul(a, b, out=c), args.device, 5, 20, reps=5)
            out[f"gemm_{key}_tflops"] = 2 * n ** 3 / (statistics.median(ms) * 1e-3) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    out["gemm_mnk"] = n
    return out


def ref_copy(args):
    nbytes = (4 if args.small else 256) * MIB
    src = torch.randn(nbytes // 4, device=args.device)
    dst = torch.empty_like(src)
    ms, _ = time_steps(lambda: dst.copy_(src), args.device, 5, 20, reps=5)
    return {"copy_mib": nbytes / MIB,
            "copy_gbps": 2 * nbytes / (statistics.median(ms) * 1e-3) / 1e9}


# ---- driver -------------------------------------------------------------------------------


def fmt(v, nd=1):
    return "n/a" if v is None else f"{v:.{nd}f}"


def main():
    global IMPL, CKPT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="mlp,cnn,gpt,gelu,gemm,copy")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tf32", action="store_true", help="allow TF32 in matmul and cuDNN")
    ap.add_argument("--no-cudnn-benchmark", action="store_true")
    ap.add_argument("--impl", default="native", choices=["native", "prelude"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--amp", default="off", choices=["off", "bf16", "f16"],
                    help="autocast dtype (fused optimizers; f16 with GradScaler)")
    ap.add_argument("--micro-batches", type=int, default=1, metavar="K",
                    help="gradient accumulation: each step as K slices of the batch "
                         "(tcc's --micro-batches K)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a size of every case that has it, as tcc's --set "
                         "(repeatable: --set V=50304)")
    args = ap.parse_args()
    for kv in args.set:
        name, _, value = kv.partition("=")
        if not value.isdigit() or not any(name in s[args.small] for s in SIZES.values()):
            ap.error(f"--set {kv}: expected NAME=INTEGER with NAME a size of some case")
        for s in SIZES.values():
            if name in s[args.small]:
                s[args.small][name] = int(value)
    if args.micro_batches < 1:
        ap.error("--micro-batches must be >= 1")
    cases = [c for c in args.cases.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    bad = [c for c in cases if c not in (*MODELS, "gelu", "gemm", "copy")]
    bad += [m for m in modes if m not in ("eager", "compile", "eager_cl", "ckpt")]
    if bad:
        ap.error(f"unknown case or mode: {', '.join(bad)}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda (the default) but torch.cuda.is_available() is False "
                 f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                 "use --device cpu to run on the CPU")
    IMPL = args.impl
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")

    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    config = dict(torch=torch.__version__, device=dev_name, impl=args.impl, amp=args.amp,
                  matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                  cudnn_tf32=torch.backends.cudnn.allow_tf32,
                  warmup=args.warmup, steps=args.steps, small=args.small, seed=args.seed,
                  cudnn_benchmark=torch.backends.cudnn.benchmark, sets=args.set)
    print(f"# torch_bench: {json.dumps(config)}", flush=True)
    runs, ref = [], {}
    for case in cases:
        if case in ("gemm", "copy"):
            fresh(args.device)
            try:
                ref.update(ref_gemm(args) if case == "gemm" else ref_copy(args))
            except Exception as e:
                traceback.print_exc()
                ref[f"{case}_error"] = f"{type(e).__name__}: {e}"
            continue
        for mode in modes:
            if mode == "eager_cl" and case != "cnn":
                continue
            if mode == "ckpt" and case == "gelu":
                continue
            fresh(args.device)
            CKPT = mode == "ckpt"
            print(f"[{case}/{mode}] running ...", flush=True)
            try:
                r = run_gelu(mode, args) if case == "gelu" else run_model(case, mode, args)
                ms = r.pop("ms")
                r.update(median_ms=statistics.median(ms), min_ms=min(ms),
                         mean_ms=statistics.mean(ms), **r.pop("mem"))
            except Exception as e:
                traceback.print_exc()
                r = dict(note=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            r = dict(case=case, mode=mode, **r)
            runs.append(r)
            if mode == "compile":
                torch._dynamo.reset()
            print(f"[{case}/{mode}] {json.dumps(r)}", flush=True)

    print("\n## details\n\n| case | mode | shape | compile s | min ms | mean ms | resident MiB "
          "| loss first -> last | note |\n|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        shape = " ".join(f"{k}={v}" for k, v in r.get("shape", {}).items())
        loss = (f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}" if "loss_first" in r else "")
        print(f"| {r['case']} | {r['mode']} | {shape} | {fmt(r.get('compile_s'))} "
              f"| {fmt(r.get('min_ms'), 3)} | {fmt(r.get('mean_ms'), 3)} "
              f"| {fmt(r.get('resident_mib'))} | {loss} | {r.get('note', '')} |")
    print("\n## results\n\n| case | mode | median ms | peak MiB (allocated) | reserved MiB |\n"
          "|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['case']} | {r['mode']} | {fmt(r.get('median_ms'), 3)} "
              f"| {fmt(r.get('peak_alloc_mib'))} | {fmt(r.get('reserved_mib'))} |")
    if ref:
        print()
        gemm, copy = ("cuBLAS GEMM", "D2D copy") if args.device == "cuda" else ("CPU GEMM", "copy")
        for k, v in ref.items():
            if k.startswith("gemm_") and k.endswith("_tflops"):
                print(f"- {gemm} {k[5:-7]} M=N=K={ref['gemm_mnk']} (torch.matmul): "
                      f"{v:.2f} TFLOP/s")
            elif k == "copy_gbps":
                print(f"- {copy} {ref['copy_mib']:.0f} MiB (dst.copy_(src)): {v:.1f} GB/s "
                      "(read + write)")
            elif k.endswith("_error"):
                print(f"- {k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, runs=runs, reference=ref), f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
