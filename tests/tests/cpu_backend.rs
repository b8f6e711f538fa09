//! The CPU back end agrees with the eager interpreter.

use std::collections::BTreeMap;
use tcc_tests::{
    compile_pipeline, cpu_steps, eager_steps, options_from_args, params_rel_err, rel_err,
};

fn check(src: &str, args: &str, steps: usize, tol: f64) {
    let g = compile_pipeline(src, &options_from_args(args)).unwrap();
    let inputs = tcc::eager::random_inputs(&g, 1);
    let want = eager_steps(&g, &inputs, steps, 0).unwrap();
    let got = cpu_steps(&g, &inputs, steps, 0, true).unwrap();
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= tol, "output `{name}`: relative error {e:e} > {tol:e}");
    }
    // Params and optimizer state as one vector (see `params_rel_err`).
    let e = params_rel_err(&got.persistent, &want.persistent).expect("same params");
    assert!(e <= tol, "params: relative error {e:e} > {tol:e}");
    let _ = BTreeMap::<String, ()>::new();
}

#[test]
fn smoke_pointwise() {
    check(
        "model m {\n input x: f32[4, 8]\n input b: f32[8]\n let y = gelu(x + b)\n output y\n}",
        "",
        1,
        1e-5,
    );
}

fn example(name: &str) -> String {
    std::fs::read_to_string(tcc_tests::root().join("examples").join(name)).unwrap()
}

#[test]
fn tiny_trains_like_eager() {
    check(&example("tiny.tdsl"), "", 5, 1e-5);
}

#[test]
fn mlp_trains_like_eager() {
    check(&example("mlp.tdsl"), "--set B=8 --set D=32", 5, 1e-5);
}

/// Five steps at C=8. (At B=4 C=4 S=16 a ReLU input of about 1e-8 lands on the other side
/// of zero at step 3, after rounding differences of 1e-7 between a fused f32 kernel and
/// op-by-op f64 rounded to f32; one gradient element is then routed differently and the
/// runs part by far more than rounding, as comparing every node of the step showed.)
#[test]
fn cnn_trains_like_eager() {
    check(
        &example("cnn.tdsl"),
        "--set B=4 --set C=8 --set S=16",
        5,
        1e-5,
    );
}

#[test]
fn gpt_trains_like_eager() {
    check(
        &example("gpt.tdsl"),
        "--set L=2 --set D=16 --set H=2 --set T=8 --set B=2 --set V=32",
        5,
        1e-5,
    );
}

#[test]
fn cnn_forward_like_eager() {
    check(
        &example("cnn.tdsl"),
        "--set B=4 --set C=4 --set S=16",
        1,
        1e-5,
    );
}

#[test]
fn conv_ops_like_eager() {
    let src = "model m {
  input x: f32[2, 3, 8, 8]
  param w: f32[4, 3, 3, 3] = normal(0.0, 0.3)
  param w2: f32[4, 3, 1, 1] = normal(0.0, 0.3)
  let y = conv2d(x, w, stride: 2, padding: 1)
  let z = conv2d(x, w2, stride: 2)
  let p = max_pool2d(y + z, k: 2, stride: 2)
  let q = avg_pool2d(y, k: 3, stride: 1, padding: 1)
  let loss = sum(p) + sum(q * q)
  output loss
  train sgd(lr: 0.01) minimize loss
}";
    check(src, "", 1, 1e-5);
}

/// Every compiled example passes the plan verifier (inside `compile`) and the runtime's one
/// arena is exactly the plan's size.
#[test]
fn runtime_arena_equals_the_verified_plan() {
    for (ex, set) in [
        ("tiny.tdsl", ""),
        ("mlp.tdsl", ""),
        ("cnn.tdsl", "--set B=4 --set C=4 --set S=16"),
        (
            "gpt.tdsl",
            "--set L=2 --set D=16 --set H=2 --set T=8 --set B=2 --set V=32",
        ),
    ] {
        let g = compile_pipeline(&example(ex), &options_from_args(set)).unwrap();
        let c = tcc::artifact::compile(&g, &Default::default()).unwrap();
        tcc::plan::verify(&c.graph, &c.plan).unwrap();
        let img = tcc::artifact::persistent_image(&c, 0, &Default::default()).unwrap();
        let bytes = tcc::artifact::write_artifact(&c, tcc::artifact::Target::Cpu, &img);
        let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
        let s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
        assert_eq!(s.arena_bytes() as u64, c.plan.arena_bytes, "{ex}");
        assert_eq!(model.arena_bytes() as u64, c.plan.arena_bytes, "{ex}");
    }
}

/// Large reductions over several axes are split into a chain (here, 256 rows being few, the
/// last axis is first cut into 32 chunks of 16: one value per chunk, then per row, then the
/// rows), with the same numbers as the interpreter.
#[test]
fn large_multi_axis_reductions_are_split() {
    let src = "model m {\n input x: f32[256, 512]\n let s = sum(x * x)\n let a = mean(exp(x), axis: [0, 1], keepdim: true)\n let b = max(x)\n output s, a, b\n}\n";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let c = tcc::artifact::compile(&g, &Default::default()).unwrap();
    let reductions = |g: &tcc::ir::Graph| {
        g.node_ids()
            .filter(|&n| matches!(g.node(n).op, tcc::ir::Op::Reduce { .. }))
            .count()
    };
    assert_eq!(reductions(&g), 3);
    assert_eq!(
        reductions(&c.graph),
        9,
        "each large reduction becomes three"
    );
    let chunked = c.graph.node_ids().filter(|&n| {
        let node = c.graph.node(n);
        matches!(node.op, tcc::ir::Op::Reduce { .. })
            && c.graph.ty(node.inputs[0]).dims() == [256, 32, 16]
    });
    assert_eq!(chunked.count(), 3, "each sums chunks of 16 first");
    tcc_tests::assert_cpu_like_eager(&g, 4, 1e-5, "split reductions");
}

/// Views are read in place rather than copied: attention's `p @ v` is stored with its heads
/// merged (`[B, T, H, Dh]`, the permutation that reads it) for the output projection and
/// its weight gradient, and a `[B * T, V]` gradient reshaped to `[B, T, V]` and back is read
/// transposed by its weight gradient. No CUDA kernel is a copy of views alone (Adam updates
/// the weights after every kernel that reads them: an SGD update fused into the weight
/// gradient would need a copy of the old weight), and the CPU's numbers (same fusion, but
/// transposed weights copied) are the interpreter's.
#[test]
fn permuted_products_and_reshapes_read_back_are_not_copied() {
    let src = "fn heads(t: f32[2, 16, 32]) -> f32[2, 4, 16, 8] {
    permute(reshape(t, [2, 16, 4, 8]), [0, 2, 1, 3])
}
model m {
 input x: f32[2, 16, 32]
 input ids: i32[32]
 param wqkv: f32[32, 96] = normal(0.0, 0.2)
 param wo: f32[32, 32] = normal(0.0, 0.2)
 param head: f32[40, 32] = normal(0.0, 0.2)
 let (q, k, v) = split(x @ wqkv, 3, axis: -1)
 let a = attention(heads(q), heads(k), heads(v), causal: true)
 let y = reshape(permute(a, [0, 2, 1, 3]), [2, 16, 32]) @ wo
 let logits = y @ transpose(head)
 let loss = cross_entropy(reshape(logits, [32, 40]), ids)
 output loss
 train adam(lr: 0.01) minimize loss
}
";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    // The CUDA kernels (compiled, not run): f32 matmuls there read a transposed B in place
    // too, where the CPU copies it.
    let cuda = tcc::artifact::CompileOptions {
        target: tcc::artifact::Target::Cuda,
        ..Default::default()
    };
    let c = tcc::artifact::compile(&g, &cuda).unwrap();
    let views = ["permute", "reshape", "transpose", "broadcast_to", "select"];
    let copies = tcc_tests::view_copy_kernels(&c.graph, &c.fused.kernels, &views);
    assert!(copies.is_empty(), "copy kernels: {copies:?}");
    // The q/k/v gradients are stored into their concat with their heads merged (the key
    // gradient through two permutes), at indices without a division.
    let concat = c
        .graph
        .node_ids()
        .find(|&n| c.graph.node(n).op.name() == "concat")
        .expect("a concat");
    let pieces: Vec<&tcc::kernel::Kernel> = c
        .fused
        .kernels
        .iter()
        .filter(|k| k.stores.iter().any(|s| s.buf == concat))
        .collect();
    assert_eq!(
        pieces.len(),
        3,
        "the q, k and v gradients store into the concat"
    );
    for k in pieces {
        let divisions = k
            .live_nodes()
            .into_iter()
            .filter(|&e| {
                matches!(
                    k.pool.get(e),
                    tcc::kernel::E::Bin(tcc::ir::BinaryOp::Div | tcc::ir::BinaryOp::Rem, ..)
                )
            })
            .count();
        assert_eq!(divisions, 0, "{}", k.name);
    }
    let inputs = tcc::eager::random_inputs(&g, 3);
    let want = eager_steps(&g, &inputs, 2, 0).unwrap();
    let got = cpu_steps(&g, &inputs, 2, 0, true).unwrap();
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= 1e-5, "output `{name}` differs by {e:e}");
    }
    let e = params_rel_err(&got.persistent, &want.persistent).expect("same params");
    assert!(e <= 1e-5, "params differ by {e:e}");
}
