//! Fused attention (`passes::attention`, CUDA): which composites become one `attention`
//! op, the graph it leaves, and the same numbers in the interpreter (outputs and the
//! parameters after training steps). The CUDA kernel itself is checked against the
//! interpreter by `gpu.rs` and assembled by `ptxas.rs`.

use tcc::ir::Graph;
use tcc::passes::attention::{fuse_attention, fuse_attention_backward};
use tcc_tests::{compile_pipeline, eager_steps, rel_err};

fn count(g: &Graph, name: &str) -> usize {
    g.node_ids()
        .filter(|&n| g.node(n).op.name() == name)
        .count()
}

/// A training step over attention of `t` queries and `s` keys of head dimension `d`. The
/// loss is quadratic in the output, so its gradient comes after it (a gradient step that
/// the schedule puts before the output keeps the composite).
fn model(t: usize, s: usize, d: usize, causal: bool) -> String {
    format!(
        "model m {{
            input w: f32[2, 3, {t}, {d}]
            param q: f32[2, 3, {t}, {d}] = normal(0.0, 1.0)
            param k: f32[2, 3, {s}, {d}] = normal(0.0, 1.0)
            param v: f32[2, 3, {s}, {d}] = normal(0.0, 1.0)
            let a = attention(q, k, v, causal: {causal})
            let loss = mean(a * a * w)
            output loss
            train sgd(lr: 10.0) minimize loss
        }}"
    )
}

/// The interpreter gives the rewritten graph's step the composite's numbers.
fn same_steps(g: &Graph, h: &Graph, what: &str) {
    same_steps_within(g, h, what, 1e-5)
}

fn same_steps_within(g: &Graph, h: &Graph, what: &str, tol: f64) {
    let inputs = tcc::eager::random_inputs(g, 5);
    let a = eager_steps(g, &inputs, 2, 1).unwrap();
    let b = eager_steps(h, &inputs, 2, 1).unwrap();
    for (name, t) in a.outputs.iter().chain(&a.persistent) {
        let other = b
            .outputs
            .get(name)
            .or_else(|| b.persistent.get(name))
            .unwrap_or_else(|| panic!("{what}: `{name}` missing"));
        let e = rel_err(other, t);
        assert!(e <= tol, "{what}: `{name}` differs by {e:e}");
    }
}

#[test]
fn causal_attention_becomes_one_op_and_rebuilds_its_probabilities() {
    for (t, s, causal) in [(70, 70, true), (40, 70, true), (70, 40, false)] {
        let what = format!("T={t} S={s} causal={causal}");
        let g = compile_pipeline(&model(t, s, 16, causal), &Default::default()).unwrap();
        let h = fuse_attention(&g);
        assert_eq!(count(&h, "attention"), 1, "{what}");
        assert_eq!(count(&h, "attention_lse"), 1, "{what}");
        // No softmax rows are left: the probabilities are `exp(s - lse)`.
        assert_eq!(count(&h, "reduce.max"), 0, "{what}");
        // The output's product is the attention's; the scores' is rebuilt.
        assert_eq!(count(&g, "matmul"), count(&h, "matmul") + 1, "{what}");
        // The rebuilt probabilities come after the attention, in the backward pass.
        let order = h.topo_order().unwrap();
        let at = |name: &str| {
            order
                .iter()
                .position(|&n| h.node(n).op.name() == name)
                .unwrap()
        };
        assert!(at("attention_lse") < at("exp"), "{what}");
        same_steps(&g, &h, &what);
    }
}

/// The backward pass becomes the two flash-attention gradient ops (on tensor cores under
/// `--amp`, in FFMA with `--flash-backward`): no `[.., T, S]` product or probabilities are
/// left, and the interpreter gives the same step (the ops' definition against the
/// composite's autodiff).
#[test]
fn attention_gradients_become_two_flash_kernels() {
    for (t, s, d, causal) in [
        (70, 70, 16, true),
        (40, 70, 32, true),
        (70, 40, 16, false),
        (33, 33, 64, true),
    ] {
        let what = format!("T={t} S={s} D={d} causal={causal}");
        let g = compile_pipeline(&model(t, s, d, causal), &Default::default()).unwrap();
        let f = fuse_attention(&g);
        let h = fuse_attention_backward(&f);
        assert_eq!(count(&h, "attention_grad_q"), 1, "{what}");
        assert_eq!(count(&h, "attention_grad_kv"), 1, "{what}");
        assert_eq!(count(&h, "matmul"), 0, "{what}");
        assert_eq!(count(&h, "exp"), 0, "{what}");
        // The ops round once where the composite rounds each `[T, S]` step to f32: the
        // params agree to about 1e-9; the loss, a mean of signed terms, to about 1e-5.
        same_steps_within(&g, &h, &what, 1e-4);
    }
    // Head dimensions the gradient kernels do not take keep the rebuilt composite.
    let g = compile_pipeline(&model(20, 20, 48, true), &Default::default()).unwrap();
    let f = fuse_attention(&g);
    let h = fuse_attention_backward(&f);
    assert_eq!(count(&h, "attention_grad_q"), 0);
    assert_eq!(f.node_count(), h.node_count());
}

#[test]
fn forward_only_attention_stores_no_statistics() {
    let src = "model m {
        input q: f32[4, 50, 32]
        input k: f32[4, 60, 32]
        input v: f32[4, 60, 16]
        let y = attention(q, k, v, causal: true)
        output y
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let h = fuse_attention(&g);
    assert_eq!(count(&h, "attention"), 1);
    assert_eq!(count(&h, "attention_lse"), 0);
    assert_eq!(count(&h, "matmul"), 0);
    same_steps(&g, &h, "forward only");
}

#[test]
fn other_shapes_and_masks_keep_the_composite() {
    // Head dimension not a multiple of 16, and larger than the kernel's registers hold.
    for d in [8, 24, 144] {
        let g = compile_pipeline(&model(20, 20, d, true), &Default::default()).unwrap();
        let h = fuse_attention(&g);
        assert_eq!(count(&h, "attention"), 0, "D={d}");
        assert_eq!(g.node_count(), h.node_count(), "D={d}");
    }
    // A mask of another shape than the prelude's causal one.
    let src = "model m {
        input q: f32[2, 20, 16]
        input k: f32[2, 20, 16]
        input v: f32[2, 20, 16]
        let s = (q @ transpose(k)) * 0.25
        let p = softmax(where(triu(ones([20, 20], bool)), s, -inf), axis: -1)
        let y = p @ v
        output y
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    assert_eq!(count(&fuse_attention(&g), "attention"), 0);
    // The same written out as the prelude writes it is fused.
    let src = src.replace("triu(", "tril(");
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    let h = fuse_attention(&g);
    assert_eq!(count(&h, "attention"), 1);
    same_steps(&g, &h, "written-out causal attention");
}

/// gpt's attention (a fused `qkv` projection split into heads: strided views) on CUDA:
/// one attention kernel a layer, which stores the row statistics; the scores and
/// probabilities of the forward pass are gone.
#[test]
fn gpt_runs_one_attention_kernel_a_layer_on_cuda() {
    let src = std::fs::read_to_string(tcc_tests::root().join("examples/gpt.tdsl")).unwrap();
    let src = src
        .replace("const B = 8", "const B = 2")
        .replace("const T = 512", "const T = 64")
        .replace("const L = 12", "const L = 2")
        .replace("const V = 8192", "const V = 256");
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    let opts = tcc::artifact::CompileOptions {
        target: tcc::artifact::Target::Cuda,
        ..Default::default()
    };
    let planned = tcc::artifact::plan_step(&g, &opts).unwrap();
    let att: Vec<_> = planned
        .fused
        .kernels
        .iter()
        .filter_map(|k| k.attention.as_ref())
        .collect();
    assert_eq!(att.len(), 2);
    for a in att {
        assert!(a.causal && a.lse.is_some() && a.o.is_some());
        // q, k and v are read in place from the projection: 3·D apart a row.
        assert_eq!(
            (a.q.rs, a.k.rs, a.v.as_ref().map(|v| v.rs)),
            (2304, 2304, Some(2304))
        );
        // The output is stored as the merged heads `[B, T, H·Dh]` the projection reads
        // (`layout::permuted_products`): a row 768 floats, a head 64 floats over.
        let o = a.o.as_ref().unwrap();
        assert_eq!(
            (o.rs, o.cs, o.batch_strides.clone()),
            (768, 1, vec![64 * 768, 64])
        );
    }
    // No kernel only copies a view: neither the merged heads for the projection nor
    // their transpose for its weight gradient (`fuse::beneath_first`).
    let copies = tcc_tests::view_copy_kernels(
        &planned.graph,
        &planned.fused.kernels,
        &["permute", "reshape"],
    );
    assert!(copies.is_empty(), "copy kernels: {copies:?}");
    // The CPU keeps the composite.
    let cpu = tcc::artifact::plan_step(&g, &Default::default()).unwrap();
    assert!(cpu.fused.kernels.iter().all(|k| k.attention.is_none()));
}

/// Attentions that read each other: one's output is another's values, a third's queries
/// are the second's output. Each pass rewrites all of them (an operand that an earlier
/// match replaced is read through its replacement), and the rewritten steps train as the
/// composite does.
#[test]
fn chained_attentions_rewrite_one_after_another() {
    let src = "model m {
        param q: f32[2, 2, 40, 16] = normal(0.0, 1.0)
        param k: f32[2, 2, 40, 16] = normal(0.0, 1.0)
        param v: f32[2, 2, 40, 16] = normal(0.0, 1.0)
        param k2: f32[2, 2, 40, 16] = normal(0.0, 1.0)
        param q2: f32[2, 2, 40, 16] = normal(0.0, 1.0)
        let a = attention(q, k, v, causal: true)
        let b = attention(q2, k2, a * 0.5, causal: true)
        let c = attention(b, k2, v, causal: false)
        let loss = mean(c * c)
        output loss
        train sgd(lr: 1.0) minimize loss
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let f = fuse_attention(&g);
    assert_eq!(count(&f, "attention"), 3);
    same_steps(&g, &f, "chained attentions");
    let h = fuse_attention_backward(&f);
    assert_eq!(count(&h, "attention_grad_q"), 3);
    assert_eq!(count(&h, "attention_grad_kv"), 3);
    same_steps_within(&g, &h, "chained attention gradients", 1e-4);
}

/// An attention gradient's operands keep rows contiguous along the head dimension where a
/// convolution chain would store them channels-last: attention read by a convolution
/// builds for CUDA under `--amp` (its output gradient comes from the convolution's input
/// gradient).
#[test]
fn attention_gradients_read_a_convolutions_gradient() {
    let src = "model m {
        param q: f32[2, 4, 64, 64] = normal(0.0, 1.0)
        param k: f32[2, 4, 64, 64] = normal(0.0, 1.0)
        param v: f32[2, 4, 64, 64] = normal(0.0, 1.0)
        param w: f32[4, 4, 3, 3] = normal(0.0, 0.1)
        let y = conv2d(attention(q, k, v, causal: true), w, padding: 1)
        let loss = mean(y * y)
        output loss
        train sgd(lr: 0.1) minimize loss
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let mut opts = tcc::artifact::CompileOptions {
        target: tcc::artifact::Target::Cuda,
        amp: tcc::passes::amp::Amp::named("bf16").unwrap(),
        ..Default::default()
    };
    opts.fuse.channels_last = true;
    let c = tcc::artifact::compile(&g, &opts).unwrap();
    assert_eq!(c.code.matches("attention_grad_kv %").count(), 1);
    assert_eq!(c.code.matches("attention_grad_q %").count(), 1);
}
