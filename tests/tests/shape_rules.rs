//! Every builtin's shape/dtype rule, through the front end, including broadcasting edge
//! cases; and the IR-level rules directly.

use tcc::front::Options;
use tcc::ir::{infer, BinaryOp, DType, Op, Shape, TensorType};
use tcc_tests::compile_bytes;

/// Compiles `let r = EXPR` in a model with inputs `a: f32[4, 3]`, `b: f32[3]`,
/// `m: f32[3, 5]`, `v: f32[2, 4, 3]`, `ids: i32[2, 7]`, `img: f32[2, 3, 8, 8]`,
/// `k: f32[6, 3, 3, 3]`, `flag: bool[4, 3]`, `h: f16[4, 3]`, `t: f32[5, 1, 3]` and returns
/// r's type, or the error codes.
fn ty(expr: &str) -> Result<String, String> {
    let src = format!(
        "model m {{
    input a: f32[4, 3]
    input b: f32[3]
    input m: f32[3, 5]
    input v: f32[2, 4, 3]
    input ids: i32[2, 7]
    input img: f32[2, 3, 8, 8]
    input k: f32[6, 3, 3, 3]
    input flag: bool[4, 3]
    input h: f16[4, 3]
    input t: f32[5, 1, 3]
    param table: f32[10, 6] = zeros
    let r = {expr}
    output r
}}
"
    );
    match compile_bytes("case.tdsl", src.as_bytes(), &Options::default()) {
        Ok((_, l)) => {
            let g = &l.graphs[0];
            let (_, id) = g
                .outputs
                .iter()
                .find(|(n, _)| n == "r")
                .ok_or("no output")?;
            Ok(g.ty(*id).to_string())
        }
        Err(rendered) => {
            let codes: Vec<&str> = rendered
                .match_indices("error[")
                .map(|(i, _)| &rendered[i + 6..i + 11])
                .collect();
            Err(codes.join(" "))
        }
    }
}

fn ok(expr: &str, expected: &str) {
    assert_eq!(ty(expr), Ok(expected.to_string()), "{expr}");
}

fn err(expr: &str, code: &str) {
    match ty(expr) {
        Ok(t) => panic!("{expr} should fail with {code}, got {t}"),
        Err(codes) => assert!(codes.contains(code), "{expr}: expected {code}, got {codes}"),
    }
}

#[test]
fn elementwise_unary() {
    for f in [
        "neg", "abs", "exp", "log", "sqrt", "rsqrt", "recip", "tanh", "sigmoid", "relu", "gelu",
        "silu", "sin", "cos", "erf",
    ] {
        ok(&format!("{f}(a)"), "f32[4, 3]");
        ok(&format!("{f}(h)"), "f16[4, 3]");
        err(&format!("{f}(flag)"), "E0402");
    }
    err("exp(ids)", "E0402");
    ok("relu(ids)", "i32[2, 7]");
    ok("-a", "f32[4, 3]");
    ok("!flag", "bool[4, 3]");
    err("!a", "E0402");
}

#[test]
fn broadcasting() {
    ok("a + b", "f32[4, 3]");
    ok("b + a", "f32[4, 3]");
    ok("a * 2", "f32[4, 3]");
    ok("2.5 - a", "f32[4, 3]");
    ok("v + a", "f32[2, 4, 3]");
    ok("t + a", "f32[5, 4, 3]"); // [5,1,3] with [4,3]: the 1 stretches
    ok("t + v[0]", "f32[5, 4, 3]");
    ok("reshape(b, [3, 1]) + reshape(b, [1, 3])", "f32[3, 3]");
    ok("sum(a) + a", "f32[4, 3]"); // scalar tensor broadcasts
    err("a + m", "E0302");
    err("v + t", "E0302"); // [2,4,3] vs [5,1,3]: 2 vs 5
    err("a + h", "E0401");
    ok("a < b", "bool[4, 3]");
    ok("flag && a > 0", "bool[4, 3]");
    err("a && flag", "E0401");
    ok("maximum(a, b)", "f32[4, 3]");
    ok("minimum(a, 0)", "f32[4, 3]");
    ok("pow(a, 2)", "f32[4, 3]");
    err("pow(ids, 2)", "E0402");
    ok("ids % 3", "i32[2, 7]");
    err("ids * 0.5", "E0403");
    ok("where(flag, a, 0.0)", "f32[4, 3]");
    ok("where(flag, b, -inf)", "f32[4, 3]");
    err("where(a, a, a)", "E0402");
    err("where(flag, a, h)", "E0401");
    ok("cast(a, f16)", "f16[4, 3]");
    ok("cast(flag, i32)", "i32[4, 3]");
}

#[test]
fn reductions() {
    ok("sum(a)", "f32[]");
    ok("sum(a, axis: 0)", "f32[3]");
    ok("sum(a, axis: -1, keepdim: true)", "f32[4, 1]");
    ok("mean(v, axis: [0, 2])", "f32[4]");
    ok("max(v, axis: 1, keepdim: true)", "f32[2, 1, 3]");
    ok("min(a, axis: [-1, -2])", "f32[]");
    ok("argmax(a, axis: 1)", "i32[4]");
    ok("argmax(a)", "i32[]");
    ok("sum(ids)", "i32[]");
    err("mean(ids)", "E0402");
    err("sum(a, axis: 2)", "E0306");
    err("sum(a, axis: -3)", "E0306");
    err("sum(a, axis: [0, 0])", "E0306");
    err("sum(flag)", "E0402");
}

#[test]
fn matmul() {
    ok("a @ m", "f32[4, 5]");
    ok("v @ m", "f32[2, 4, 5]");
    ok("b @ m", "f32[5]"); // 1-D on the left: prepended 1 removed
    ok("a @ b", "f32[4]"); // 1-D on the right
    ok("b @ b", "f32[]");
    ok("v @ transpose(v)", "f32[2, 4, 4]");
    ok("t @ transpose(a)", "f32[5, 1, 4]");
    ok(
        "reshape(v, [2, 1, 4, 3]) @ reshape(m, [1, 1, 3, 5])",
        "f32[2, 1, 4, 5]",
    );
    err("a @ a", "E0301");
    err("a @ 2", "E0212");
    err("reshape(v, [2, 4, 3]) @ reshape(t, [5, 3, 1])", "E0302");
    err("a @ cast(m, f16)", "E0401");
}

#[test]
fn shape_ops() {
    ok("reshape(a, [12])", "f32[12]");
    ok("reshape(a, [2, -1])", "f32[2, 6]");
    err("reshape(a, [5, -1])", "E0303");
    err("reshape(a, [-1, -1])", "E0303");
    err("reshape(a, [13])", "E0303");
    ok("transpose(a)", "f32[3, 4]");
    ok("transpose(v)", "f32[2, 3, 4]");
    err("transpose(b)", "E0313");
    ok("permute(v, [2, 0, 1])", "f32[3, 2, 4]");
    ok("permute(v, [-1, 0, 1])", "f32[3, 2, 4]");
    err("permute(v, [0, 0, 1])", "E0307");
    err("permute(v, [0, 1])", "E0307");
    ok("broadcast_to(b, [2, 4, 3])", "f32[2, 4, 3]");
    ok("broadcast_to(t, [5, 4, 3])", "f32[5, 4, 3]");
    err("broadcast_to(a, [4, 4])", "E0314");
    ok("concat([a, a], axis: 0)", "f32[8, 3]");
    ok("concat([a, a, a], axis: -1)", "f32[4, 9]");
    ok("concat([a])", "f32[4, 3]");
    err("concat([a, m], axis: 0)", "E0304");
    err("concat([a, b], axis: 0)", "E0304");
    err("concat([a, h], axis: 0)", "E0401");
    ok("split(v, 2, axis: 0)[1]", "f32[1, 4, 3]");
    ok("split(a, 3, axis: -1)[0]", "f32[4, 1]");
    err("split(a, 2, axis: 1)", "E0309");
    ok("squeeze(t, axis: 1)", "f32[5, 3]");
    err("squeeze(t, axis: 0)", "E0315");
    ok("unsqueeze(b, axis: 0)", "f32[1, 3]");
    ok("unsqueeze(b, axis: -1)", "f32[3, 1]");
    ok("unsqueeze(b, axis: 1)", "f32[3, 1]");
    err("unsqueeze(b, axis: 2)", "E0306");
}

#[test]
fn indexing() {
    ok("v[0]", "f32[4, 3]");
    ok("v[-1]", "f32[4, 3]");
    ok("v[1, 2]", "f32[3]");
    ok("v[:, 0:2]", "f32[2, 2, 3]");
    ok("v[.., -1]", "f32[2, 4]");
    ok("v[.., 1:]", "f32[2, 4, 2]");
    ok("v[0, .., :2]", "f32[4, 2]");
    ok("a[:, :]", "f32[4, 3]");
    err("v[2]", "E0308");
    err("v[0, 0, 0, 0]", "E0308");
    err("v[.., ..]", "E0308");
    err("v[:, 3:1]", "E0308");
    err("v[ids]", "E0216");
}

#[test]
fn creation() {
    ok("zeros([2, 3])", "f32[2, 3]");
    ok("ones([4], i32)", "i32[4]");
    ok("ones([2, 2], bool)", "bool[2, 2]");
    ok("full([3], 7, f16)", "f16[3]");
    ok("full([3], true, bool)", "bool[3]");
    err("full([3], 0.5, i32)", "E0403");
    err("zeros([0, 3])", "E0316");
    ok("arange(5)", "i32[5]");
    err("arange(0)", "E0316");
    ok("tril(a)", "f32[4, 3]");
    ok("triu(v, k: 1)", "f32[2, 4, 3]");
    err("tril(b)", "E0313");
}

#[test]
fn nn() {
    ok("conv2d(img, k)", "f32[2, 6, 6, 6]");
    ok("conv2d(img, k, padding: 1)", "f32[2, 6, 8, 8]");
    ok("conv2d(img, k, stride: 2, padding: 1)", "f32[2, 6, 4, 4]");
    ok(
        "conv2d(img, k, stride: [1, 2], padding: [1, 0])",
        "f32[2, 6, 8, 3]",
    );
    ok(
        "conv2d(img, ones([6, 1, 3, 3]), groups: 3, padding: 1)",
        "f32[2, 6, 8, 8]",
    );
    err("conv2d(img, ones([6, 2, 3, 3]))", "E0305");
    err("conv2d(img, k, groups: 2)", "E0305");
    err("conv2d(img, ones([6, 3, 9, 9]))", "E0305");
    err("conv2d(a, k)", "E0305");
    ok("max_pool2d(img, 2)", "f32[2, 3, 4, 4]");
    ok(
        "avg_pool2d(img, 3, stride: 1, padding: 1)",
        "f32[2, 3, 8, 8]",
    );
    ok("max_pool2d(img, [2, 4])", "f32[2, 3, 4, 2]");
    err("max_pool2d(a, 2)", "E0310");
    err("avg_pool2d(img, 9)", "E0310");
    ok("embedding(table, ids)", "f32[2, 7, 6]");
    ok("embedding(table, ids[0])", "f32[7, 6]");
    err("embedding(table, a)", "E0402");
    ok("dropout(a, 0.1)", "f32[4, 3]");
    ok("dropout(a, 0)", "f32[4, 3]");
    err("dropout(a, 1.5)", "E0316");
    ok("grad(sum(a * b), b)", "f32[3]");
    err("grad(a, b)", "E0501");
}

#[test]
fn prelude() {
    ok("softmax(a)", "f32[4, 3]");
    ok("softmax(v, axis: 1)", "f32[2, 4, 3]");
    ok("log_softmax(h)", "f16[4, 3]");
    ok("layer_norm(v, b, b)", "f32[2, 4, 3]");
    ok("layer_norm(a, b, b, eps: 1e-3)", "f32[4, 3]");
    err("layer_norm(a, reshape(m, [15]), b)", "E0311");
    ok("rms_norm(a, b)", "f32[4, 3]");
    ok("batch_norm(img, ones([3]), zeros([3]))", "f32[2, 3, 8, 8]");
    ok("cross_entropy(a, ids[0, 0:4])", "f32[]");
    err("cross_entropy(a, ids)", "E0311");
    ok("mse(a, a)", "f32[]");
    ok("linear(v, m, zeros([5]))", "f32[2, 4, 5]");
    ok("attention(v, v, v)", "f32[2, 4, 3]");
    ok("attention(v, v, v, causal: true)", "f32[2, 4, 3]");
    ok("attention(v, t[0:2], t[0:2], causal: true)", "f32[2, 4, 3]");
    err("attention(v, v, v, causal: 1)", "E0311");
}

#[test]
fn compile_time_values() {
    ok("a * sqrt(4)", "f32[4, 3]");
    ok("a[3 / 3]", "f32[3]");
    ok("if 2 > 1 { a } else { b }", "f32[4, 3]");
    ok("if 1 > 2 { a } else { b }", "f32[3]");
    err("if a { a } else { b }", "E0216");
    err("a[7 / 2]", "E0216");
}

#[test]
fn ir_rules_directly() {
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let add = Op::Binary(BinaryOp::Add);
    // Edge cases of broadcasting: scalars, ones on either side, rank extension.
    assert_eq!(infer(&add, &[&t(&[]), &t(&[])]).unwrap(), t(&[]));
    assert_eq!(infer(&add, &[&t(&[]), &t(&[2, 3])]).unwrap(), t(&[2, 3]));
    assert_eq!(infer(&add, &[&t(&[1]), &t(&[2, 3])]).unwrap(), t(&[2, 3]));
    assert_eq!(
        infer(&add, &[&t(&[2, 1, 4]), &t(&[3, 1])]).unwrap(),
        t(&[2, 3, 4])
    );
    assert_eq!(infer(&add, &[&t(&[1, 1]), &t(&[1])]).unwrap(), t(&[1, 1]));
    assert!(infer(&add, &[&t(&[2]), &t(&[3])]).is_err());
    assert!(infer(&add, &[&t(&[2, 3])]).is_err(), "arity is checked");
    let e = infer(&Op::MatMul, &[&t(&[256, 1024]), &t(&[784, 1024])]).unwrap_err();
    assert_eq!(e.code, "E0301");
    assert_eq!(e.detail, "f32[256, 1024] @ f32[784, 1024]: 1024 ≠ 784");
    let r = infer(
        &Op::Reshape {
            shape: Shape(vec![6]),
        },
        &[&t(&[2, 3])],
    )
    .unwrap();
    assert_eq!(r, t(&[6]));
}
