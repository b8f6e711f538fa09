//! Micro-batching (`--micro-batches K`): a step over its batch as K slices, one after
//! another, equals the step on the whole batch to f32 rounding, in less memory; programs
//! whose samples meet before the loss are refused with the op named.

use tcc_runtime::Device;
use tcc_tests::{micro_batched_step, micro_vs_whole, root};

fn example(name: &str) -> String {
    std::fs::read_to_string(root().join("examples").join(name)).expect("example")
}

/// gpt at a size the CPU runs in a second: Adam, layer norms, attention, a stacked param.
const SMALL_GPT: &[(&str, &str)] = &[
    ("B", "4"),
    ("T", "32"),
    ("D", "32"),
    ("L", "2"),
    ("V", "64"),
    ("H", "2"),
];

#[test]
fn micro_batches_equal_the_whole_batch() {
    let mlp = example("mlp.tdsl");
    let gpt = example("gpt.tdsl");
    let mlp_sets: &[(&str, &str)] = &[("B", "32"), ("D", "64")];
    for (what, src, sets, k) in [
        ("mlp, sgd", &mlp, mlp_sets, 2),
        ("mlp, sgd", &mlp, mlp_sets, 4),
        ("gpt, adam", &gpt, SMALL_GPT, 2),
        ("gpt, adam", &gpt, SMALL_GPT, 4),
    ] {
        tcc_tests::assert_micro_equals_whole(what, src, sets, k, Device::Cpu);
    }
}

#[test]
fn momentum_shared_params_checkpoints_and_early_gradients_split_exactly() {
    let prog = |params: &str, body: &str, opt: &str| {
        format!(
            "const B = 8\nmodel m {{\n    input x: f32[B, 4]\n{params}\n{body}\n    output \
             loss\n    train {opt} minimize loss\n}}\n"
        )
    };
    let w = "    param w: f32[4, 4] = normal(0.0, 0.5)";
    let wu = "    param w: f32[4, 4] = normal(0.0, 0.5)\n    param u: f32[4, 4] = normal(0.0, 0.5)";
    let wt = "    param w: f32[4, 4] = normal(0.0, 0.5)\n    param t: f32[4] = normal(0.0, 0.5)";
    for (what, src) in [
        // SGD with momentum: the gradient the optimizer applies is a sum of the slices'.
        (
            "momentum",
            prog(w, "    let h = tanh(x @ w)\n    let loss = mean(h * h)", "sgd(lr: 0.1, momentum: 0.9, weight_decay: 0.01)"),
        ),
        // A param read through another value and directly: sums of sums.
        (
            "shared",
            prog(
                wu,
                "    let v = w + u\n    let h = x @ v + tanh(x @ w) + sin(x @ u)\n    let loss = sum(h * h)",
                "sgd(lr: 0.01)",
            ),
        ),
        // A checkpoint block: its values are recomputed per micro-batch, never merged.
        (
            "checkpoint",
            prog(
                w,
                "    let h = checkpoint { tanh(tanh(x @ w) @ w) }\n    let loss = mean(h * h)",
                "adam(lr: 0.1)",
            ),
        ),
        // `t`'s gradient comes from its own term only, complete before any slice runs, but
        // every slice reads `t`: its update must wait for the last one.
        (
            "early gradient",
            prog(
                wt,
                "    let z = x @ w\n    let h = where(z > t, z, 0.0)\n    let loss = sum(h * h) + sum(t * t)",
                "adam(lr: 0.1)",
            ),
        ),
    ] {
        for k in [2, 4] {
            let r = micro_vs_whole(&src, &[], k, 3, Device::Cpu, "off")
                .unwrap_or_else(|e| panic!("{what}, K={k}: {e}"));
            assert!(r.params < 1e-5, "{what}, K={k}: params differ by {:e}", r.params);
        }
    }
}

#[test]
fn micro_batches_under_mixed_precision() {
    // bf16 rounds each micro-batch's activations on their own, so the steps agree to
    // bf16's precision, not f32's; the loss scaler of f16 sees the summed gradients.
    let gpt = example("gpt.tdsl");
    for amp in ["bf16", "f16"] {
        let r = micro_vs_whole(&gpt, SMALL_GPT, 2, 3, Device::Cpu, amp)
            .unwrap_or_else(|e| panic!("{amp}: {e}"));
        eprintln!(
            "gpt {amp}, K=2: params rel err {:e}, outputs {:e}",
            r.params, r.outputs
        );
        assert!(r.params < 1e-3, "{amp}: params differ by {:e}", r.params);
        assert!(r.outputs < 1e-2, "{amp}: outputs differ by {:e}", r.outputs);
    }
}

#[test]
fn micro_batches_lower_the_arena_where_activations_dominate() {
    // gpt at T=128: activations are most of the arena, so it shrinks with K (the f32
    // gradient sums and the params stay).
    let sets: &[(&str, &str)] = &[
        ("B", "8"),
        ("T", "128"),
        ("D", "64"),
        ("L", "2"),
        ("V", "128"),
        ("H", "2"),
    ];
    let src = example("gpt.tdsl");
    let compile = tcc_tests::device_options(Device::Cpu, true);
    let mut arenas = Vec::new();
    for k in [1, 2, 4] {
        let g = micro_batched_step(&src, sets, k, &compile).expect("compiles");
        let c = tcc::artifact::compile(&g, &compile).expect("plans");
        arenas.push(c.plan.arena_bytes);
        // The micro-batches run in turn: every node of micro-batch `m` comes before the
        // first node of `m + 1`, and each node's operands come from micro-batches no later
        // than its own.
        let mut last = 0;
        for n in g.node_ids() {
            if let Some(m) = g.node(n).micro_batch {
                assert!(m >= last, "micro-batch {m} runs after {last} began");
                last = m;
            }
        }
        assert_eq!(last as usize, k - 1);
        // Each update runs after every other reader of its param (the last micro-batch's).
        for &(t, v) in &g.updates {
            for u in g.users(t) {
                assert!(u <= v, "an update runs before a reader of its target");
            }
        }
    }
    eprintln!("gpt arenas at K = 1, 2, 4: {arenas:?}");
    assert!(arenas[1] * 10 < arenas[0] * 9, "{arenas:?}");
    assert!(arenas[2] < arenas[1], "{arenas:?}");
}

#[test]
fn micro_batches_cost_at_most_one_gradient_sum_per_param() {
    // The mlp's activations are small next to its weights, so splitting its batch saves
    // little, but it must not cost more than the f32 sums of the gradients (one buffer per
    // param, the size of the params): each micro-batch's contribution is added as soon as
    // it is made, not all of them at the end.
    let src = example("mlp.tdsl");
    let compile = tcc_tests::device_options(Device::Cpu, true);
    let arena = |k: usize| {
        let g = micro_batched_step(&src, &[], k, &compile).expect("compiles");
        let c = tcc::artifact::compile(&g, &compile).expect("plans");
        (c.plan.arena_bytes, c.plan.persistent_bytes)
    };
    let (whole, params) = arena(1);
    for k in [2, 4, 8] {
        let (micro, _) = arena(k);
        eprintln!("mlp K={k}: arena {micro} bytes, whole batch {whole}, params {params}");
        assert!(
            micro <= whole + params,
            "K={k}: {micro} > {whole} + {params}"
        );
    }
}

fn refused(src: &str, sets: &[(&str, &str)], k: usize) -> String {
    let compile = tcc_tests::device_options(Device::Cpu, true);
    match micro_batched_step(src, sets, k, &compile) {
        Ok(_) => panic!("K={k} compiled:\n{src}"),
        Err(e) => e,
    }
}

#[test]
fn programs_that_cannot_be_split_are_refused_with_the_reason() {
    // Batch norm: its statistics couple every sample.
    let e = refused(&example("cnn.tdsl"), &[("B", "8")], 2);
    assert!(e.contains("E0544") && e.contains("batch_norm"), "{e}");
    // A batch the count does not divide.
    let e = refused(&example("mlp.tdsl"), &[("B", "30"), ("D", "16")], 4);
    assert!(e.contains("E0541") && e.contains("does not divide"), "{e}");
    let base = |body: &str| {
        format!(
            "const B = 8\nmodel m {{\n    input x: f32[B, 4]\n    param w: f32[4, 4] = \
             normal(0.0, 0.5)\n{body}\n}}\n"
        )
    };
    // No training step.
    let e = refused(&base("    output y = x @ w"), &[], 2);
    assert!(e.contains("E0540") && e.contains("train"), "{e}");
    // Samples picked by their place in the batch.
    let e = refused(
        &base(
            "    let loss = sum((x[0:2] @ w) * (x[0:2] @ w))\n    train sgd(lr: 0.1) minimize loss",
        ),
        &[],
        2,
    );
    assert!(
        e.contains("E0545") && e.contains("particular samples"),
        "{e}"
    );
    // A program whose ops change with the batch (`x[0:4]` is all of a micro-batch of 4).
    let e = refused(
        &base(
            "    let loss = sum((x[0:4] @ w) * (x[0:4] @ w))\n    train sgd(lr: 0.1) minimize loss",
        ),
        &[],
        2,
    );
    assert!(e.contains("E0542") && e.contains("structure"), "{e}");
    // Samples paired with samples.
    let e = refused(
        &base("    let loss = sum(x @ transpose(x))\n    train sgd(lr: 0.1) minimize loss"),
        &[],
        2,
    );
    assert!(e.contains("E0543") || e.contains("E0545"), "{e}");
    // Ops whose attributes depend on the batch size.
    for body in [
        "    let z = x @ w\n    let h = if B > 4 { tanh(z) } else { sin(z) }",
        "    let h = x[:, B / 4] * sum(w)",
        "    let h = tril(x @ w, k: B - 8)",
    ] {
        let e = refused(
            &base(&format!(
                "{body}\n    let loss = sum(h * h)\n    train sgd(lr: 0.1) minimize loss"
            )),
            &[],
            2,
        );
        assert!(
            e.contains("E0542") && e.contains("more than its shape"),
            "{body}: {e}"
        );
    }
    // A slice of the batch axis, from its start or not in step with the batch.
    for (slice, code) in [("x[0:B/2]", "E0543"), ("x[1:B]", "E0543")] {
        let body = format!("    let loss = sum(({slice} @ w) * ({slice} @ w))\n    train sgd(lr: 0.1) minimize loss");
        let e = refused(&base(&body), &[], 2);
        assert!(e.contains(code), "{slice}: {e}");
    }
    // A max over the batch: its gradient at a tie between slices would differ.
    let e = refused(
        &base("    let loss = max(x @ w)\n    train sgd(lr: 0.1) minimize loss"),
        &[],
        2,
    );
    assert!(e.contains("E0545") && e.contains("reduce.max"), "{e}");
    // A batch not sized by a constant.
    let e = refused(
        "model m {\n    input x: f32[8, 4]\n    param w: f32[4] = zeros\n    let loss = \
         sum(x @ w)\n    train sgd(lr: 0.1) minimize loss\n}\n",
        &[],
        2,
    );
    assert!(e.contains("E0540") && e.contains("constant"), "{e}");
}

#[test]
fn a_loss_summed_over_the_batch_and_a_regularizer_split_exactly() {
    // A sum over the batch (not a mean), a mean, and a term of the params alone: the
    // slices' sums add up, their means are averaged, and the params' term is computed once.
    let src = "
const B = 12
model m {
    input  x: f32[B, 6]
    param  w: f32[6, 3] = normal(0.0, 0.5)
    let h = tanh(x @ w)
    let loss = sum(h * h) * 0.1 + mean(h) + sum(w * w) * 0.01
    output loss, h
    train adam(lr: 0.05) minimize loss
}
";
    for k in [2, 3, 4, 6] {
        let r =
            micro_vs_whole(src, &[], k, 4, Device::Cpu, "off").unwrap_or_else(|e| panic!("{e}"));
        assert!(r.params < 1e-5, "K={k}: params differ by {:e}", r.params);
        assert!(r.outputs < 1e-5, "K={k}: outputs differ by {:e}", r.outputs);
    }
}
