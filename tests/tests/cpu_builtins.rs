//! Every builtin and primitive, forward and backward, compiled for the CPU agrees with the
//! eager interpreter: ‖cpu − eager‖ / ‖eager‖ ≤ 1e-5 for f32 (each case computes
//! `y = sum(expr * proj)` and the gradients of `y`, so fused backward kernels run too).
//! The cases are shared with the GPU tests (`tests/src/lib.rs`).

use tcc::front::Options;
use tcc_tests::{
    builtin_program, compile_pipeline, half_cases, integer_program, unary_builtin_cases,
    BUILTIN_CASES, INTEGER_CASES,
};

fn agree(src: &str, what: &str, tol: f64) {
    let g = compile_pipeline(src, &Options::default()).unwrap_or_else(|e| panic!("{what}:\n{e}"));
    tcc_tests::assert_cpu_like_eager(&g, 5, tol, what);
}

fn group(name: &str) {
    let (_, cases) = BUILTIN_CASES.iter().find(|(g, _)| *g == name).unwrap();
    for (expr, wrt) in cases.iter() {
        let src = builtin_program(expr, wrt).unwrap_or_else(|e| panic!("{expr}: {e}"));
        agree(&src, expr, 1e-5);
    }
}

/// Every unary op of the table and every one-argument activation of the prelude
/// (enumerated: see `unary_builtin_cases`).
#[test]
fn unary() {
    let cases = unary_builtin_cases();
    // All unary ops but `not` and `gelu_grad`, which are no builtins.
    assert!(cases.len() >= tcc::ir::UnaryOp::ALL.len() - 2, "{cases:?}");
    for (expr, wrt) in &cases {
        let src = builtin_program(expr, wrt).unwrap_or_else(|e| panic!("{expr}: {e}"));
        agree(&src, expr, 1e-5);
    }
}

#[test]
fn binary_with_broadcasting() {
    group("binary");
}

#[test]
fn reductions() {
    group("reductions");
}

#[test]
fn shapes_and_views() {
    group("shapes");
}

#[test]
fn matmul_forms() {
    group("matmul");
}

#[test]
fn convolution_pooling_embedding() {
    group("conv");
}

#[test]
fn composites() {
    group("composites");
}

/// Integer, boolean and index-producing ops (exact).
#[test]
fn integers_and_bools() {
    for e in INTEGER_CASES {
        agree(&integer_program(e), e, 0.0);
    }
}

/// Half precision: loads and stores convert (f16/bf16 rounding on store); bounds in
/// `half_cases`.
#[test]
fn half_precision() {
    for (what, src, tol) in half_cases() {
        agree(&src, &what, tol);
    }
}

#[test]
fn outputs_of_trained_params_hold_the_value_the_step_used() {
    let src = "model m {\n input x: f32[4, 3]\n param w: f32[3, 2] = normal(0.0, 0.5)\n let loss = sum((x @ w) * (x @ w))\n output loss, w\n train sgd(lr: 0.1) minimize loss\n}\n";
    agree(src, "output w", 1e-6);
}

#[test]
fn gelu_gradient_far_from_zero() {
    tcc_tests::check_gelu_gradient_far_from_zero(tcc_runtime::Device::Cpu);
}
