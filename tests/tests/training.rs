//! Training with the eager interpreter: the examples learn a fixed synthetic, learnable data
//! set (deterministic, seeded).

use std::collections::BTreeMap;
use tcc::eager::{self, Precision, Tensor};
use tcc::ir::Graph;
use tcc_tests::{compile_pipeline, options_from_args, root};

/// Inputs of a classification problem a model can learn: each example is its class's
/// prototype plus noise.
fn prototypes(n: usize, dim: usize, classes: usize, seed: u64) -> (Tensor, Tensor) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let protos: Vec<f64> = (0..classes * dim).map(|_| next()).collect();
    let labels: Vec<i32> = (0..n).map(|i| (i % classes) as i32).collect();
    let mut x = Vec::with_capacity(n * dim);
    for &l in &labels {
        for d in 0..dim {
            x.push(protos[l as usize * dim + d] + 0.3 * next());
        }
    }
    (
        Tensor::from_f64(tcc::ir::DType::F32, vec![n, dim], x),
        Tensor::from_i32(vec![n], labels),
    )
}

fn losses(g: &Graph, inputs: &BTreeMap<String, Tensor>, steps: usize) -> Vec<f64> {
    let mut p = eager::init_persistent(g, 0);
    (0..steps)
        .map(|_| {
            let outs = eager::run_step(g, &mut p, inputs, Precision::Native).unwrap();
            outs.iter().find(|(n, _)| n == "loss").unwrap().1.to_f64()[0]
        })
        .collect()
}

fn mlp_source(optimizer: Option<&str>) -> String {
    let src = std::fs::read_to_string(root().join("examples/mlp.tdsl")).unwrap();
    match optimizer {
        Some(o) => src.replace("train sgd(lr: 0.05)", o),
        None => src,
    }
}

fn mlp_inputs() -> BTreeMap<String, Tensor> {
    let (x, labels) = prototypes(32, 784, 10, 3);
    BTreeMap::from([("x".to_string(), x), ("labels".to_string(), labels)])
}

#[test]
fn mlp_sgd_lowers_the_loss_tenfold_in_200_steps() {
    let g = compile_pipeline(
        &mlp_source(None),
        &options_from_args("--set B=32 --set D=64"),
    )
    .unwrap();
    let l = losses(&g, &mlp_inputs(), 200);
    assert!(l[199] * 10.0 <= l[0], "loss {} -> {}", l[0], l[199]);
    // Deterministic: the same run gives the same numbers.
    assert_eq!(l, losses(&g, &mlp_inputs(), 200));
}

#[test]
fn mlp_adam_lowers_the_loss_tenfold_in_200_steps() {
    let src = mlp_source(Some("train adam(lr: 0.001)"));
    assert!(src.contains("adam"));
    let g = compile_pipeline(&src, &options_from_args("--set B=32 --set D=64")).unwrap();
    let l = losses(&g, &mlp_inputs(), 200);
    assert!(l[199] * 10.0 <= l[0], "loss {} -> {}", l[0], l[199]);
}

#[test]
fn mlp_adamw_and_sgd_momentum_train() {
    for opt in [
        "train adamw(lr: 0.001, weight_decay: 0.1)",
        "train sgd(lr: 0.02, momentum: 0.9, weight_decay: 1e-4)",
    ] {
        let g = compile_pipeline(
            &mlp_source(Some(opt)),
            &options_from_args("--set B=32 --set D=64"),
        )
        .unwrap();
        let l = losses(&g, &mlp_inputs(), 100);
        assert!(l[99] * 5.0 <= l[0], "{opt}: loss {} -> {}", l[0], l[99]);
    }
}

#[test]
fn cnn_trains_at_a_small_size() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    let g = compile_pipeline(&src, &options_from_args("--set B=10 --set C=4 --set S=8")).unwrap();
    let (x, labels) = prototypes(10, 3 * 8 * 8, 10, 5);
    let x = Tensor {
        ty: tcc::ir::TensorType::new(tcc::ir::DType::F32, vec![10, 3, 8, 8]),
        data: x.data,
    };
    let inputs = BTreeMap::from([("images".to_string(), x), ("labels".to_string(), labels)]);
    let l = losses(&g, &inputs, 30);
    assert!(l[29] * 3.0 <= l[0], "loss {} -> {}", l[0], l[29]);
}

#[test]
fn checkpointed_training_equals_plain_training() {
    let plain = mlp_source(None);
    let ckpt = plain.replace(
        "h = relu(linear(h, w_h[i], b_h[i]))",
        "h = checkpoint { relu(linear(h, w_h[i], b_h[i])) }",
    );
    assert_ne!(plain, ckpt);
    let opts = options_from_args("--set B=16 --set D=32");
    let a = compile_pipeline(&plain, &opts).unwrap();
    let b = compile_pipeline(&ckpt, &opts).unwrap();
    assert!(b.node_count() > a.node_count(), "recomputation adds nodes");
    let inputs = mlp_inputs_sized(16);
    let run = |g: &Graph| {
        let mut p = eager::init_persistent(g, 0);
        let mut losses = Vec::new();
        for _ in 0..5 {
            let outs = eager::run_step(g, &mut p, &inputs, Precision::Native).unwrap();
            losses.push(outs[0].1.to_f64()[0]);
        }
        (losses, p)
    };
    let (la, pa) = run(&a);
    let (lb, pb) = run(&b);
    assert_eq!(la, lb);
    assert_eq!(pa, pb, "params after 5 steps are identical");
}

fn mlp_inputs_sized(n: usize) -> BTreeMap<String, Tensor> {
    let (x, labels) = prototypes(n, 784, 10, 3);
    BTreeMap::from([("x".to_string(), x), ("labels".to_string(), labels)])
}
