"""PyTorch DistributedDataParallel (and ZeroRedundancyOptimizer) on the examples' models, the
baseline of `tcc run --gpus N`: launch with `torchrun --nproc-per-node N bench/ddp.py`.

Each rank builds the model of bench/torch_bench.py (the same params and sizes as
examples/*.tdsl, B per GPU), wraps its params in one module under DDP (25 MiB buckets,
gradients reduced while the backward pass runs), and times steps with CUDA events
(median over --steps after --warmup). Adam is the fused one. Rank 0 prints one JSON line:
the step time, `max_memory_allocated` of every rank, the world size.
"""
import argparse, json, os, statistics, sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import torch_bench as tb  # noqa: E402


class Holder(torch.nn.Module):
    """A torch_bench model as one module, so DDP can wrap it: its params, and the loss
    function (which reads them from the same dict) as its forward."""

    def __init__(self, params, loss_fn):
        super().__init__()
        self.ps = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach()) for k, v in params.items()})
        self.loss_fn = loss_fn

    def forward(self, *xs):
        return self.loss_fn(*xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=["mlp", "cnn", "gpt"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer (ZeRO-1)")
    ap.add_argument("--amp", default="off", choices=["off", "bf16"])
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = "cuda"
    torch.manual_seed(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = tb.SIZES[args.model][0]
    loss_fn, inputs, opt, params = tb.MODELS[args.model](dev, **shape)
    holder = Holder(params, loss_fn).to(dev)
    # The model functions read their params from `params`: point them at the module's.
    for k in list(params.keys()):
        params[k] = holder.ps[k]
    model = torch.nn.parallel.DistributedDataParallel(holder, device_ids=[rank], bucket_cap_mb=25)
    kw = {k: v for k, v in opt.defaults.items() if k in ("lr", "momentum", "weight_decay", "betas", "eps")}
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=type(opt), fused=True, **kw)
    else:
        opt = type(opt)(list(model.parameters()), fused=True, **kw)
    amp = {"bf16": torch.bfloat16}.get(args.amp)

    def ddp_step():
        if amp is None:
            loss = model(*inputs)
        else:
            with torch.autocast(dev, dtype=amp):
                loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        ddp_step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = ddp_step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device=dev)
    mems = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(mems, mem)
    ms = torch.tensor([statistics.median(times)], device=dev)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps(dict(model=args.model, world=world, zero=args.zero, amp=args.amp,
                              shape=shape, ms=round(float(ms), 3), loss=float(loss),
                              mem_mib=[round(float(m), 1) for m in mems])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
