//! Gradients freed as they are applied (issue 27): each optimizer update runs as soon as its
//! gradient is complete and the param's last other reader has run, so its gradient's bytes
//! are free for the rest of the backward pass, and the step computes what it did with every
//! update at the end.

use std::collections::BTreeSet;
use tcc::artifact::{self, CompileOptions};
use tcc::ir::{Graph, NodeId, Op};
use tcc::kernel::Kernel;
use tcc::remat::step;
use tcc_runtime::Device;
use tcc_tests::device_options;

/// The scheduled step of `file` with `sets` (`"B=8 C=16"`).
fn graph(file: &str, sets: &str) -> Graph {
    let sets: Vec<(&str, &str)> = sets
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect();
    tcc_tests::scheduled_step(file, &sets)
}

/// The step as `tcc build` plans it for `device`: free recomputation, then the kernels,
/// verified.
fn kernels(g: &Graph, device: Device) -> (Graph, Vec<Kernel>) {
    let opts = CompileOptions {
        ..device_options(device, true)
    };
    let (h, _) = step::free(g, &opts).unwrap();
    let p = artifact::plan_step(&h, &opts).unwrap();
    // No kernel reads a param or state after the kernel writing its new value.
    tcc::kernel::verify::verify_kernels(&p.graph, &p.fused).unwrap();
    (p.graph, p.fused.kernels)
}

const GPT: &str = "L=3 D=64 H=2 T=32 B=2 V=64";

/// Each pointwise update kernel (an optimizer's moments and new param: no product or
/// reduction in it) of a param that is not stacked (whose gradient is no concat of
/// per-layer pieces) runs right after the last kernel it has to follow, one that stores
/// what it reads or that reads the param or state it writes, with only other updates
/// between. (A stacked param left whole, as at this size, waits for its pieces as program
/// order assembles them, near the end of the backward pass; `tests/stacks.rs` covers split
/// ones.)
fn check_updates_run_when_ready(what: &str, g: &Graph, ks: &[Kernel]) {
    let values: BTreeSet<NodeId> = g.updates.iter().map(|u| u.1).collect();
    let mut checked = 0;
    for (i, k) in ks.iter().enumerate() {
        let stored: Vec<NodeId> = k
            .stores
            .iter()
            .map(|s| s.buf)
            .filter(|b| values.contains(b))
            .collect();
        let pointwise = k.nodes.iter().all(|&n| {
            let op = &g.node(n).op;
            !op.is_contraction() && !op.is_reduction_like() && !matches!(op, Op::Concat { .. })
        });
        if stored.is_empty() || !pointwise {
            continue;
        }
        let targets: BTreeSet<NodeId> = g
            .updates
            .iter()
            .filter(|u| stored.contains(&u.1))
            .map(|u| u.0)
            .collect();
        let loads = k.loads();
        let Some(ready) = ks[..i]
            .iter()
            .rposition(|j| {
                j.stores.iter().any(|s| loads.contains(&s.buf))
                    || j.loads().iter().any(|b| targets.contains(b))
            })
            .map(|r| r + 1)
        else {
            // It needs nothing the step computes (Adam's step count): the schedule runs it
            // before its first reader.
            continue;
        };
        for (j, between) in ks.iter().enumerate().take(i).skip(ready) {
            assert!(
                between.stores.iter().any(|s| values.contains(&s.buf)),
                "{what}: the update kernel {i} ({}) could run after kernel {}, but kernel {j} \
                 ({}) runs first",
                k.name,
                ready - 1,
                between.name
            );
        }
        checked += 1;
    }
    assert!(checked > 0, "{what}: no pointwise update kernel");
}

#[test]
fn updates_run_as_soon_as_their_gradients_are_ready() {
    let g = graph("examples/gpt.tdsl", GPT);
    for device in [Device::Cpu, Device::Cuda(0)] {
        let (h, ks) = kernels(&g, device);
        check_updates_run_when_ready(&format!("gpt on {device:?}"), &h, &ks);
    }
    // The cnn (at its own size, where the order does not raise max-live): its last stage's
    // stacked convolution weights are updated before any weight gradient of the stage
    // before it (they were applied after the whole backward pass). The update still waits
    // for the pieces of its gradient as program order assembles them, after that stage's
    // down block.
    let g = graph("examples/cnn.tdsl", "");
    for device in [Device::Cpu, Device::Cuda(0)] {
        let (h, ks) = kernels(&g, device);
        check_stage_4_before_stage_3(&format!("cnn on {device:?}"), &h, &ks);
    }
}

fn check_stage_4_before_stage_3(what: &str, h: &Graph, ks: &[Kernel]) {
    let s4 = h
        .updates
        .iter()
        .find(|&&(t, _)| matches!(&h.node(t).op, Op::Param { name, .. } if name == "s4_w"))
        .map(|u| u.1)
        .unwrap();
    let at = |pred: &dyn Fn(&Kernel) -> bool| ks.iter().position(pred).unwrap();
    let update = at(&|k: &Kernel| k.stores.iter().any(|s| s.buf == s4));
    let s3_grad = at(&|k: &Kernel| {
        k.nodes.iter().any(|&n| {
            matches!(h.node(n).op, Op::Conv2dGradWeight { .. })
                && h.ty(n).dims() == [4 * 64, 4 * 64, 3, 3]
        })
    });
    assert!(
        update < s3_grad,
        "{what}: s4_w's update (kernel {update}) runs after a stage-3 weight gradient \
         (kernel {s3_grad})"
    );
}

/// A step whose updates run early trains as the interpreter does (it applies every update
/// at the end): SGD with momentum and weight decay (each of a param's two updates reads the
/// other's target) and Adam. The cnn's batch statistics at batch 8 make its params drift
/// apart over steps, so it is compared after one.
#[test]
fn updates_applied_early_compute_what_the_interpreter_does() {
    for (file, sets, steps) in [
        ("examples/cnn.tdsl", "B=8 C=8 S=16", 1),
        ("examples/gpt.tdsl", GPT, 3),
    ] {
        tcc_tests::assert_cpu_steps_like_eager(&graph(file, sets), 5, steps, 1e-5, file);
    }
}

/// A small-batch gpt, whose final norm's gain is updated before the recomputed normalised
/// output the logits' weight gradient reads is stored: it used to fail to build ("the update
/// of `gf` reads it at another index than it writes") on both targets.
#[test]
fn an_update_follows_the_recomputed_values_that_read_its_param() {
    let g = graph("examples/gpt.tdsl", "B=1 T=64 L=1 D=256 H=4 V=2048");
    for device in [Device::Cpu, Device::Cuda(0)] {
        let opts = device_options(device, true);
        let (h, _) = step::free(&g, &opts).unwrap_or_else(|e| panic!("{device:?}: {e}"));
        let p = artifact::plan_step(&h, &opts).unwrap_or_else(|e| panic!("{device:?}: {e}"));
        tcc::kernel::verify::verify_kernels(&p.graph, &p.fused).unwrap();
    }
}

/// Where fusion moves a reader of a param into a kernel after the param's update (the mlp's
/// transposed head weight, read by its input gradient's matmul), the update follows that
/// kernel: no kernel copies the param's old value for the reader (the mlp had a `permute`
/// kernel of its own for it on CUDA; the CPU back end transposes its weights in kernels of
/// their own anyway).
#[test]
fn an_update_follows_a_reader_fused_into_a_later_kernel() {
    let g = graph("examples/mlp.tdsl", "");
    let (h, ks) = kernels(&g, Device::Cuda(0));
    let copies = tcc_tests::view_copy_kernels(&h, &ks, &["permute", "select", "reshape"]);
    assert!(copies.is_empty(), "{copies:?}");
}
