//! Gradients from autodiff agree with central finite differences computed in f64, for
//! every differentiable primitive and prelude function, on shapes with broadcasting and on
//! strided views (transposes, slices).

use std::collections::BTreeMap;
use tcc::eager::{self, Data, Precision, Tensor};
use tcc::front::Options;
use tcc::ir::Op;
use tcc_tests::compile_pipeline;

/// The declarations every case can use (random inputs, seeded).
use tcc_tests::BUILTIN_DECLS as DECLS;

fn output_type(expr: &str) -> String {
    let src = format!("model m {{ {DECLS}\n let out = {expr}\n output out\n}}\n");
    let g = compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{expr}:\n{e}"));
    let (_, id) = &g.outputs[0];
    g.ty(*id).to_string()
}

fn run(g: &tcc::ir::Graph, inputs: &BTreeMap<String, Tensor>) -> Vec<(String, Tensor)> {
    let mut p = eager::init_persistent(g, 0);
    eager::run_step(g, &mut p, inputs, Precision::F64).unwrap()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_f64()[0]
}

/// Checks d sum(expr * proj) / d x for every x in `wrt` against finite differences.
fn check(expr: &str, wrt: &[&str]) {
    let out_ty = output_type(expr);
    let dims = out_ty.trim_start_matches("f32");
    let grads: String = wrt
        .iter()
        .map(|x| format!("    let d_{x} = grad(y, {x})\n"))
        .collect();
    let outs: Vec<String> = wrt.iter().map(|x| format!("d_{x}")).collect();
    let src = format!(
        "model m {{ {DECLS}\n    input proj: f32{dims}\n    let y = sum(({expr}) * proj)\n{grads}    output y, {}\n}}\n",
        outs.join(", ")
    );
    let g = compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{expr}:\n{e}"));
    let inputs = eager::random_inputs(&g, 7);
    let outs = run(&g, &inputs);
    let eps = 1e-6;
    for (wi, x) in wrt.iter().enumerate() {
        let analytic = outs[1 + wi].1.to_f64();
        let base = &inputs[*x];
        let n = base.numel();
        // Check up to 48 elements spread over the tensor.
        let stride = (n / 48).max(1);
        for i in (0..n).step_by(stride) {
            let mut plus = inputs.clone();
            let mut minus = inputs.clone();
            for (inp, d) in [(&mut plus, eps), (&mut minus, -eps)] {
                if let Some(Tensor {
                    data: Data::F(v), ..
                }) = inp.get_mut(*x)
                {
                    v[i] += d;
                }
            }
            let yp = scalar(&run(&g, &plus)[0].1);
            let ym = scalar(&run(&g, &minus)[0].1);
            let fd = (yp - ym) / (2.0 * eps);
            let an = analytic[i];
            let tol = 1e-5 * fd.abs().max(an.abs()).max(1.0);
            assert!(
                (fd - an).abs() <= tol,
                "{expr}: d/d{x}[{i}] analytic {an} vs finite difference {fd}"
            );
        }
    }
}

/// Every unary op of the table and every one-argument activation of the prelude
/// (enumerated: see `unary_builtin_cases`).
#[test]
fn unary_primitives() {
    let cases = tcc_tests::unary_builtin_cases();
    // All unary ops but `not` and `gelu_grad`, which are no builtins.
    assert!(cases.len() >= tcc::ir::UnaryOp::ALL.len() - 2, "{cases:?}");
    for (expr, wrt) in &cases {
        check(expr, wrt);
    }
    check("-a", &["a"]);
}

/// `gelu_grad`, which `gelu`'s backward pass makes (no builtin names it, and TDSL refuses a
/// `grad` of a `grad`), differentiates to gelu's second derivative: its rule is checked on
/// a graph built by hand, from -6 to 6, against finite differences of the table's formula.
#[test]
fn gelu_grad_differentiates_to_the_second_derivative() {
    use tcc::ir::{DType, Graph, ReduceOp, TensorType, UnaryOp};
    let s = tcc_grammar::span::Span::default();
    let xs: Vec<f64> = (0..41).map(|i| -6.0 + 0.3 * i as f64).collect();
    let mut g = Graph::new("m");
    let ty = TensorType::new(DType::F32, vec![xs.len()]);
    let name = "a".to_string();
    let a = g.add(Op::Input { name, ty }, vec![], s, None).unwrap();
    let d = g
        .add(Op::Unary(UnaryOp::GeluGrad), vec![a], s, None)
        .unwrap();
    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        axes: vec![0],
        keepdim: false,
    };
    let y = g.add(sum, vec![d], s, None).unwrap();
    let grads = tcc::autodiff::backward(&mut g, y, &[a]).unwrap();
    g.outputs.push(("dd".into(), grads[&a]));
    let x = Tensor::from_f64(DType::F32, vec![xs.len()], xs.clone());
    let outs = run(&g, &BTreeMap::from([("a".to_string(), x)]));
    let got = outs[0].1.to_f64();
    for (i, &x) in xs.iter().enumerate() {
        let h = 1e-5;
        let fd = (UnaryOp::GeluGrad.eval(x + h) - UnaryOp::GeluGrad.eval(x - h)) / (2.0 * h);
        assert!(
            (got[i] - fd).abs() <= 1e-7,
            "gelu''({x}): the rule gives {}, finite differences {fd}",
            got[i]
        );
    }
}

#[test]
fn binary_primitives_with_broadcasting() {
    check("a + b", &["a", "b"]);
    check("a - c", &["a", "c"]);
    check("a * b * c", &["a", "b", "c"]);
    check("a / (abs(b) + 0.5)", &["a", "b"]);
    check("pow(abs(a) + 0.5, c)", &["a", "c"]);
    check("maximum(a, b)", &["a", "b"]);
    check("minimum(c, a)", &["a", "c"]);
    check("a * 3 - 2 / (abs(c) + 1)", &["a", "c"]);
    check("where(a > 0, b, c)", &["b", "c"]);
    check("where(a > 0, a * a, 1.0)", &["a"]);
    check("exp(where(a < 0, a, -inf))", &["a"]);
    check("v * a", &["v", "a"]);
}

#[test]
fn reductions() {
    check("sum(a, axis: 0)", &["a"]);
    check("mean(v, axis: [0, 2], keepdim: true)", &["v"]);
    check("max(a, axis: 1)", &["a"]);
    check("min(v, axis: -1, keepdim: true)", &["v"]);
    check("mean(a)", &["a"]);
}

#[test]
fn shape_ops_and_views() {
    check("reshape(a, [2, 6])", &["a"]);
    check("transpose(a) @ a", &["a"]);
    check("permute(v, [2, 0, 1])", &["v"]);
    check("broadcast_to(b, [2, 3, 4])", &["b"]);
    check("concat([a, c, a], axis: 1)", &["a", "c"]);
    check("split(v, 2, axis: -1)[1] * 2", &["v"]);
    check("squeeze(c, axis: 1)", &["c"]);
    check("unsqueeze(b, axis: 0) + a", &["a", "b"]);
    check("v[1]", &["v"]);
    check("v[:, 1:3, ..]", &["v"]);
    check("v[.., -1]", &["v"]);
    check("a[1:3, 0:2] * a[0:2, 2:4]", &["a"]);
    check("tril(a)", &["a"]);
    check("triu(v, k: 1)", &["v"]);
    // Functions of strided views: transposed and sliced operands.
    check("softmax(transpose(a))", &["a"]);
    check("relu(v[:, 1:3, :]) @ m", &["v", "m"]);
}

#[test]
fn matmul_forms() {
    check("a @ m", &["a", "m"]);
    check("v @ m", &["v", "m"]);
    check("b @ m", &["b", "m"]);
    check("a @ b", &["a", "b"]);
    check("b @ g4", &["b", "g4"]);
    check("v @ transpose(v)", &["v"]);
    check(
        "reshape(v, [2, 1, 3, 4]) @ reshape(m, [1, 1, 4, 5])",
        &["v", "m"],
    );
}

#[test]
fn nn_primitives() {
    check("conv2d(img, k, padding: 1, groups: 2)", &["img", "k"]);
    check("conv2d(img[:, 0:2], k, stride: 2)", &["img", "k"]);
    check("max_pool2d(img, 2)", &["img"]);
    check("max_pool2d(img, 3, stride: 2, padding: 1)", &["img"]);
    check("avg_pool2d(img, 3, stride: 1, padding: 1)", &["img"]);
    check("embedding(table, ids)", &["table"]);
    check("dropout(a, 0.3)", &["a"]);
}

#[test]
fn prelude_functions() {
    check("softmax(a)", &["a"]);
    check("softmax(v, axis: 1)", &["v"]);
    check("log_softmax(a)", &["a"]);
    check("layer_norm(a, b, g4)", &["a", "b", "g4"]);
    check("rms_norm(v, b)", &["v", "b"]);
    check("batch_norm(img, b, g4)", &["img", "b", "g4"]);
    check("cross_entropy(a, labels)", &["a"]);
    check("mse(a, c)", &["a", "c"]);
    check("linear(v, m, m[0])", &["v", "m"]);
    check("attention(q, kv, kv)", &["q", "kv"]);
    check("attention(q, kv, kv, causal: true)", &["q", "kv"]);
}

/// The uses of `x - max(x)` that are not shift-invariant keep the gradient through the max:
/// finite differences would catch it left out.
#[test]
fn row_maxima_outside_a_softmax_keep_their_gradient() {
    check("exp(a - max(a, axis: 1, keepdim: true))", &["a"]);
    check(
        "exp(a - max(a, axis: 1, keepdim: true)) / sum(exp(a), axis: 1, keepdim: true)",
        &["a"],
    );
    check(
        "a - max(a, axis: 1, keepdim: true) - log(sum(exp(a), axis: 1, keepdim: true))",
        &["a"],
    );
    check("softmax(a) + max(a, axis: 1, keepdim: true)", &["a"]);
    check(
        "checkpoint { let e = exp(a - max(a, axis: 1, keepdim: true))\n e / sum(e, axis: 1, keepdim: true) + e }",
        &["a"],
    );
}

/// The softmax and log-softmax backward passes leave the stabilizing row maximum out: no
/// `x == max` mask (and its two row sums) is built, unlike for a bare `max`.
#[test]
fn softmax_backward_skips_the_row_maximum() {
    let masks = |expr: &str| {
        let src = format!(
            "model m {{ {DECLS}\n let y = sum({expr})\n let d = grad(y, a)\n output d\n}}\n"
        );
        let g =
            compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{expr}:\n{e}"));
        let is_max = |n: &tcc::ir::NodeId| {
            matches!(
                g.node(*n).op,
                Op::Reduce {
                    op: tcc::ir::ReduceOp::Max,
                    ..
                }
            )
        };
        g.node_ids()
            .filter(|&n| {
                matches!(g.node(n).op, Op::Binary(tcc::ir::BinaryOp::Eq))
                    && g.node(n).inputs.iter().any(is_max)
            })
            .count()
    };
    assert_eq!(masks("softmax(a) * softmax(a)"), 0);
    // Its gradient is p * (g - sum(g * p)): the backward pass reads the result p, not
    // exp(x - max): that is read by the forward's row sum and division only.
    let src = format!(
        "model m {{ {DECLS}\n let y = sum(softmax(a) * b)\n let d = grad(y, a)\n output d\n}}\n"
    );
    let g = compile_pipeline(&src, &Options::default()).unwrap();
    let exps: Vec<_> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::Unary(tcc::ir::UnaryOp::Exp)))
        .collect();
    assert_eq!(exps.len(), 1);
    assert_eq!(
        g.users(exps[0]).len(),
        2,
        "{}",
        tcc::ir::printer::print(&g, None)
    );
    assert_eq!(masks("log_softmax(a) * a"), 0);
    assert_eq!(masks("cross_entropy(a, labels) * 1.0"), 0);
    assert_eq!(masks("exp(a - max(a, axis: 1, keepdim: true))"), 1);
}

#[test]
fn checkpoint_blocks_give_the_same_gradients() {
    check("checkpoint { let h = tanh(a @ m)\n h * h }", &["a", "m"]);
}

#[test]
fn several_grads_of_one_value_share_one_backward_pass() {
    let src = format!(
        "model m {{ {DECLS}\n let y = sum(tanh(a @ m))\n let da = grad(y, a)\n let dm = grad(y, m)\n let db = grad(y, b)\n output da, dm, db\n}}\n"
    );
    let g = compile_pipeline(&src, &Options::default()).unwrap();
    // One seed (the `full 1.0` of dy/dy) for one backward pass.
    let seeds = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::Full { .. }) && g.ty(n).rank() == 0)
        .count();
    assert_eq!(seeds, 1);
    // `b` does not influence y: its gradient is zero.
    let outs = run(&g, &eager::random_inputs(&g, 1));
    assert!(outs[2].1.to_f64().iter().all(|&x| x == 0.0));
}

mod random_shapes {
    use super::*;
    use proptest::prelude::*;

    /// Gradient check of `expr` over inputs `a` and `b` of the given shapes.
    fn check_shapes(expr: &str, sa: &[usize], sb: &[usize]) {
        let dims = |s: &[usize]| {
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let decls = format!("input a: f32[{}]\n input b: f32[{}]", dims(sa), dims(sb));
        let src = format!("model m {{\n {decls}\n let out = {expr}\n output out\n}}\n");
        let g =
            compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{src}\n{e}"));
        let out_dims = g.ty(g.outputs[0].1).dims().to_vec();
        let src = format!(
            "model m {{\n {decls}\n input proj: f32[{}]\n let y = sum(({expr}) * proj)\n let da = grad(y, a)\n let db = grad(y, b)\n output y, da, db\n}}\n",
            dims(&out_dims)
        );
        let g = compile_pipeline(&src, &Options::default()).unwrap();
        let inputs = eager::random_inputs(&g, 11);
        let outs = run(&g, &inputs);
        let eps = 1e-6;
        for (k, x) in ["a", "b"].iter().enumerate() {
            let an = outs[1 + k].1.to_f64();
            let n = inputs[*x].numel();
            for i in (0..n).step_by((n / 12).max(1)) {
                let mut p = inputs.clone();
                let mut m = inputs.clone();
                if let (
                    Some(Tensor {
                        data: Data::F(vp), ..
                    }),
                    Some(Tensor {
                        data: Data::F(vm), ..
                    }),
                ) = (p.get_mut(*x), m.get_mut(*x))
                {
                    vp[i] += eps;
                    vm[i] -= eps;
                }
                let fd = (scalar(&run(&g, &p)[0].1) - scalar(&run(&g, &m)[0].1)) / (2.0 * eps);
                assert!(
                    (fd - an[i]).abs() <= 1e-5 * fd.abs().max(an[i].abs()).max(1.0),
                    "{src}: d{x}[{i}] {} vs {fd}",
                    an[i]
                );
            }
        }
    }

    /// A shape and a second shape broadcast-compatible with it (some dims 1 or dropped).
    fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
        prop::collection::vec((1usize..4, 0u8..3), 1..4).prop_map(|dims| {
            let a: Vec<usize> = dims.iter().map(|d| d.0).collect();
            let b: Vec<usize> = dims
                .iter()
                .map(|&(d, k)| if k == 0 { 1 } else { d })
                .collect();
            // Drop a random number of leading dims of b (rank extension).
            let drop = dims
                .iter()
                .take_while(|d| d.1 == 2)
                .count()
                .min(b.len() - 1);
            (a, b[drop..].to_vec())
        })
    }

    proptest! {
        #![proptest_config(tcc_tests::proptest_config(24))]

        #[test]
        fn broadcasting_binary_ops((sa, sb) in broadcast_pair(), op in prop::sample::select(vec!["a * b", "a - b", "maximum(a, b)", "a / (abs(b) + 1)", "where(a > b, a, b * 2)"])) {
            check_shapes(op, &sa, &sb);
            check_shapes(op, &sb, &sa);
        }

        #[test]
        fn batched_matmul(bt in 1usize..3, m in 1usize..4, k in 1usize..4, n in 1usize..4, bcast in any::<bool>()) {
            let sb = if bcast { vec![k, n] } else { vec![bt, k, n] };
            check_shapes("a @ b", &[bt, m, k], &sb);
        }

        #[test]
        fn reductions_and_softmax(dims in prop::collection::vec(1usize..4, 1..4), axis in 0usize..3) {
            let axis = axis % dims.len();
            check_shapes(&format!("softmax(a, axis: {axis}) + sum(b, axis: {axis}, keepdim: true)"), &dims, &dims);
        }
    }
}
