//! Reference semantics of the eager interpreter on hand-checked values.

use std::collections::BTreeMap;
use tcc::eager::{self, EagerError, Precision, Tensor};
use tcc::front::Options;
use tcc::ir::DType;
use tcc_tests::compile_pipeline;

fn eval(decls: &str, expr: &str, inputs: Vec<(&str, Tensor)>) -> Result<Tensor, EagerError> {
    let src = format!("model m {{\n{decls}\n let out = {expr}\n output out\n}}\n");
    let g = compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{e}"));
    let inputs: BTreeMap<String, Tensor> = inputs
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
    let mut p = eager::init_persistent(&g, 0);
    eager::run_step(&g, &mut p, &inputs, Precision::Native).map(|mut o| o.remove(0).1)
}

fn f32s(shape: Vec<usize>, v: &[f64]) -> Tensor {
    Tensor::from_f64(DType::F32, shape, v.to_vec())
}

#[test]
fn integer_division_floors_and_remainder_takes_the_divisor_sign() {
    let a = Tensor::from_i32(vec![4], vec![7, -7, 7, -7]);
    let b = Tensor::from_i32(vec![4], vec![2, 2, -2, -2]);
    let q = eval(
        "input a: i32[4]\n input b: i32[4]",
        "a / b",
        vec![("a", a.clone()), ("b", b.clone())],
    )
    .unwrap();
    assert_eq!(q.to_f64(), vec![3.0, -4.0, -4.0, 3.0]);
    let r = eval(
        "input a: i32[4]\n input b: i32[4]",
        "a % b",
        vec![("a", a.clone()), ("b", b)],
    )
    .unwrap();
    assert_eq!(r.to_f64(), vec![1.0, 1.0, -1.0, -1.0]);
    let z = Tensor::from_i32(vec![4], vec![1, 0, 1, 1]);
    assert_eq!(
        eval(
            "input a: i32[4]\n input b: i32[4]",
            "a / b",
            vec![("a", a), ("b", z)]
        ),
        Err(EagerError::DivisionByZero)
    );
}

#[test]
fn half_precision_rounds_on_store() {
    // 1 + 2^-11 is not representable in f16 (10 mantissa bits): it rounds to 1.
    let x = Tensor::from_f64(DType::F16, vec![2], vec![1.0, 2.0]);
    let y = eval("input x: f16[2]", "x + 0.00048828125", vec![("x", x)]).unwrap();
    assert_eq!(y.to_f64(), vec![1.0, 2.0]);
    let x = Tensor::from_f64(DType::BF16, vec![1], vec![1.0]);
    let y = eval("input x: bf16[1]", "x / 3", vec![("x", x)]).unwrap();
    assert_eq!(y.to_f64(), vec![half::bf16::from_f64(1.0 / 3.0).to_f64()]);
    let x = f32s(vec![1], &[1.0]);
    let y = eval("input x: f32[1]", "x / 3", vec![("x", x)]).unwrap();
    assert_eq!(y.to_f64(), vec![(1.0f32 / 3.0) as f64]);
}

#[test]
fn reductions_argmax_and_casts() {
    let x = f32s(vec![2, 3], &[1.0, 5.0, 5.0, -1.0, -2.0, -0.5]);
    let d = "input x: f32[2, 3]";
    assert_eq!(
        eval(d, "argmax(x, axis: 1)", vec![("x", x.clone())])
            .unwrap()
            .to_f64(),
        vec![1.0, 2.0]
    );
    assert_eq!(
        eval(d, "argmax(x)", vec![("x", x.clone())])
            .unwrap()
            .to_f64(),
        vec![1.0]
    );
    assert_eq!(
        eval(d, "max(x, axis: 0)", vec![("x", x.clone())])
            .unwrap()
            .to_f64(),
        vec![1.0, 5.0, 5.0]
    );
    assert_eq!(
        eval(d, "mean(x, axis: 1)", vec![("x", x.clone())])
            .unwrap()
            .to_f64(),
        vec![(11.0f32 / 3.0) as f64, (-3.5f32 / 3.0) as f64]
    );
    assert_eq!(
        eval(d, "cast(x, i32)", vec![("x", x.clone())])
            .unwrap()
            .to_f64(),
        vec![1.0, 5.0, 5.0, -1.0, -2.0, 0.0]
    );
    assert_eq!(
        eval(d, "cast(cast(x, bool), f32)", vec![("x", x)])
            .unwrap()
            .to_f64(),
        vec![1.0; 6]
    );
}

#[test]
fn pooling_and_conv_reference_values() {
    let x = f32s(vec![1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let d = "input x: f32[1, 1, 2, 2]";
    // Average pooling counts padding (PyTorch's default): the corner window sees 1 of 4.
    let y = eval(
        d,
        "avg_pool2d(x, 2, stride: 1, padding: 1)",
        vec![("x", x.clone())],
    )
    .unwrap();
    assert_eq!(
        y.to_f64(),
        vec![0.25, 0.75, 0.5, 1.0, 2.5, 1.5, 0.75, 1.75, 1.0]
    );
    let y = eval(
        d,
        "max_pool2d(x, 2, stride: 1, padding: 1)",
        vec![("x", x.clone())],
    )
    .unwrap();
    assert_eq!(
        y.to_f64(),
        vec![1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 3.0, 4.0, 4.0]
    );
    // A 2x2 all-ones kernel with padding 0 sums the image.
    let y = eval(d, "conv2d(x, ones([1, 1, 2, 2]))", vec![("x", x)]).unwrap();
    assert_eq!(y.to_f64(), vec![10.0]);
}

#[test]
fn dropout_is_deterministic_and_scales_kept_values() {
    let x = f32s(vec![1000], &[1.0; 1000]);
    let a = eval(
        "input x: f32[1000]",
        "dropout(x, 0.25)",
        vec![("x", x.clone())],
    )
    .unwrap()
    .to_f64();
    let b = eval("input x: f32[1000]", "dropout(x, 0.25)", vec![("x", x)])
        .unwrap()
        .to_f64();
    assert_eq!(a, b);
    let kept = a.iter().filter(|&&v| v != 0.0).count();
    assert!(
        (700..800).contains(&kept),
        "kept {kept} of 1000 at p = 0.25"
    );
    assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
}

#[test]
fn runtime_errors_are_typed() {
    let ids = Tensor::from_i32(vec![2], vec![1, 9]);
    let r = eval(
        "param t: f32[4, 2] = ones\n input ids: i32[2]",
        "embedding(t, ids)",
        vec![("ids", ids)],
    );
    assert_eq!(
        r,
        Err(EagerError::IndexOutOfRange {
            what: "embedding id",
            index: 9,
            bound: 4
        })
    );
    let r = eval("input x: f32[2]", "x", vec![]);
    assert_eq!(r, Err(EagerError::MissingInput("x".into())));
    let r = eval(
        "input x: f32[2]",
        "x",
        vec![("x", f32s(vec![3], &[1.0, 2.0, 3.0]))],
    );
    assert!(matches!(r, Err(EagerError::InputType { .. })));
    let r = eval("param w: f32[2]", "w * 2", vec![]);
    assert_eq!(r, Err(EagerError::MissingParam("w".into())));
}

#[test]
fn param_initialisers_are_seeded_and_distributed() {
    let g = compile_pipeline("model m {\n param w: f32[100, 100] = normal(1.0, 0.5)\n param u: f32[10000] = uniform(-2.0, 2.0)\n output w, u\n}\n", &Options::default()).unwrap();
    let a = eager::init_persistent(&g, 0);
    let b = eager::init_persistent(&g, 0);
    let c = eager::init_persistent(&g, 1);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let w = a.values["w"].to_f64();
    let mean = w.iter().sum::<f64>() / w.len() as f64;
    let var = w.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / w.len() as f64;
    assert!(
        (mean - 1.0).abs() < 0.02 && (var.sqrt() - 0.5).abs() < 0.02,
        "mean {mean} std {}",
        var.sqrt()
    );
    let u = a.values["u"].to_f64();
    assert!(u.iter().all(|&x| (-2.0..2.0).contains(&x)));
}

/// `softplus` (a prelude composite) against `ln(1 + e^x)` computed by hand, including
/// arguments where the naive formula overflows (e^100 is inf in f32) or loses everything to
/// rounding (1 + e^-100 == 1).
#[test]
fn softplus_matches_its_definition_without_overflow() {
    let xs = [-100.0, -3.0, -0.5, 0.0, 0.5, 3.0, 100.0];
    let x = f32s(vec![xs.len()], &xs);
    let y = eval("input x: f32[7]", "softplus(x)", vec![("x", x)]).unwrap();
    let want = [
        3.720_075_976_020_836e-44,
        0.048_587_351_573_741_98,
        0.474_076_984_180_746_4,
        std::f64::consts::LN_2,
        0.974_076_984_180_746_4,
        3.048_587_351_573_742,
        100.0,
    ];
    for ((got, want), x) in y.to_f64().iter().zip(want).zip(xs) {
        let tol = 1e-6 * want.abs().max(1e-30);
        assert!(
            (got - want).abs() <= tol.max(1e-12),
            "softplus({x}) = {got}, expected {want}"
        );
    }
}
