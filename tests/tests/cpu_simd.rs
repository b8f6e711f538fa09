//! The innermost loop of pointwise kernels runs on f32x4 vectors where shapes allow, and the
//! results agree with the eager interpreter for extents that are and are not multiples of
//! 4, on one thread and on several (a rank-1 kernel then runs its vector loop over `[lo,
//! hi)` chunks that start anywhere).

use std::collections::BTreeMap;
use tcc::front::Options;
use tcc_tests::{compile_pipeline, cpu_steps, eager_steps, rel_err};

/// The CLIF text of the CPU code of `src`.
fn clif(src: &str) -> String {
    let g = compile_pipeline(src, &Options::default()).unwrap();
    tcc::artifact::compile(&g, &Default::default())
        .unwrap_or_else(|e| panic!("{src}: {e}"))
        .code
}

/// Runs `g` once on the CPU with `threads` worker threads.
fn cpu_threads(
    g: &tcc::ir::Graph,
    inputs: &BTreeMap<String, tcc::eager::Tensor>,
    threads: usize,
) -> BTreeMap<String, tcc::eager::Tensor> {
    cpu_threads_steps(g, inputs, threads, 1)
}

/// Runs `steps` steps of `g` on the CPU with `threads` worker threads; the last step's
/// outputs.
fn cpu_threads_steps(
    g: &tcc::ir::Graph,
    inputs: &BTreeMap<String, tcc::eager::Tensor>,
    threads: usize,
    steps: usize,
) -> BTreeMap<String, tcc::eager::Tensor> {
    cpu_layout_steps(g, inputs, threads, steps, false).0
}

/// Outputs of a step and params after it, by name.
type StepValues = (
    BTreeMap<String, tcc::eager::Tensor>,
    BTreeMap<String, Vec<f64>>,
);

/// [`cpu_threads_steps`] with convolution chains' intermediates channels-last (the CLI's
/// default) or not; also the params after the last step.
fn cpu_layout_steps(
    g: &tcc::ir::Graph,
    inputs: &BTreeMap<String, tcc::eager::Tensor>,
    threads: usize,
    steps: usize,
    channels_last: bool,
) -> StepValues {
    use tcc::artifact::{self, CompileOptions, Target};
    let mut opts = CompileOptions::default();
    opts.fuse.channels_last = channels_last;
    let c = artifact::compile(g, &opts).unwrap();
    let img = artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    let bytes = artifact::write_artifact(&c, Target::Cpu, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    s.set_threads(threads).unwrap();
    for _ in 0..steps {
        // Inputs may share bytes with intermediates: set before every step.
        for (name, t) in inputs {
            s.set_input_bytes(name, &t.to_le_bytes()).unwrap();
        }
        s.run().unwrap();
    }
    let outputs = g
        .outputs
        .iter()
        .map(|(name, n)| {
            let b = s.output_bytes(name).unwrap();
            let t = tcc::eager::Tensor::from_le_bytes(g.ty(*n).clone(), b).unwrap();
            (name.clone(), t)
        })
        .collect();
    let mut params = BTreeMap::new();
    for (p, name, ty) in g.persistent_tensors() {
        if let tcc::ir::Op::Param { .. } = &g.node(p).op {
            let b = s.param_bytes(&name).unwrap();
            let t = tcc::eager::Tensor::from_le_bytes(ty, b).unwrap();
            params.insert(name, t.to_f64());
        }
    }
    (outputs, params)
}

/// `src` compiled for the CPU agrees with the eager interpreter (1 and 3 threads).
fn agree(src: &str) {
    let g = compile_pipeline(src, &Options::default()).unwrap_or_else(|e| panic!("{src}:\n{e}"));
    let inputs = tcc::eager::random_inputs(&g, 7);
    let want = eager_steps(&g, &inputs, 1, 0).unwrap();
    let got = cpu_steps(&g, &inputs, 1, 0, true).unwrap();
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= 1e-5, "{src}: output `{name}` differs by {e:e}");
    }
    let got3 = cpu_threads(&g, &inputs, 3);
    for (name, t) in &want.outputs {
        let e = rel_err(&got3[name], t);
        assert!(
            e <= 1e-5,
            "{src} (3 threads): output `{name}` differs by {e:e}"
        );
    }
}

fn gelu_bias(shape: &str, m: usize) -> String {
    format!(
        "model m {{\n input x: f32{shape}\n input b: f32[{m}]\n let y = gelu(x * 1.5 + b)\n output y\n}}\n"
    )
}

#[test]
fn gelu_bias_over_odd_and_even_extents() {
    for (shape, m) in [
        ("[3, 37]", 37),
        ("[5, 64]", 64),
        ("[1, 3]", 3),
        ("[2, 4]", 4),
        ("[4, 7]", 7),
        ("[37]", 37),
        ("[64]", 64),
    ] {
        let src = gelu_bias(shape, m);
        agree(&src);
        let code = clif(&src);
        assert_eq!(
            code.contains("f32x4"),
            m >= 4,
            "{shape}: vector code expected exactly when the innermost extent is >= 4:\n{code}"
        );
    }
}

/// Every op with a vector form, over ranges that reach the branches of the inline exp and
/// tanh (underflow, overflow, the small-argument polynomial, saturation).
#[test]
fn vector_ops_agree_with_eager() {
    let exprs = [
        "exp(x * 40)",
        "exp(-abs(x) * 60) + exp(abs(x) * 60)",
        "tanh(x * 12)",
        "tanh(x * 0.2)",
        "sigmoid(x * 50)",
        "silu(x * 20)",
        "gelu(x * 8)",
        // Past the inline exp's clamps, which GELU, sigmoid and SiLU leave unselected.
        "gelu(x * 40) + sigmoid(x * 200) + silu(x * 200)",
        "relu(x) - neg(b)",
        "abs(x) * b",
        "sqrt(abs(x))",
        "rsqrt(abs(x) + 0.5)",
        "recip(abs(x) + 0.5)",
        "x / (abs(b) + 0.5) - x % (abs(b) + 0.5)",
        "maximum(x, b) + minimum(x, b * 2)",
        "where(x > b, x, b * 2)",
        "where(x > 0 && b < 0.5 || x == b, x, 0.0)",
        "where(!(x <= 0.1) || x >= 1.0 || x != x, exp(x), x)",
        "cast(x < b, f32) + cast(cast(x * 0.0 + r, bool), f32) * 2",
        "x - r",
        // NaN (sqrt of negatives) and infinities through the inline math.
        "exp(sqrt(x)) + tanh(sqrt(x) * 20) + gelu(sqrt(x)) + sigmoid(sqrt(x))",
        "tanh(exp(x * 200)) + exp(exp(x * 100)) + sigmoid(-exp(x * 100)) + silu(exp(x * 90))",
        "exp(x - max(x, axis: 1, keepdim: true))",
    ];
    for e in exprs {
        let src = format!(
            "model m {{\n input x: f32[5, 37]\n input b: f32[37]\n input r: f32[5, 1]\n let y = {e}\n output y\n}}\n"
        );
        agree(&src);
        assert!(clif(&src).contains("f32x4"), "{e}: no vector code");
    }
}

/// An f32 reduction whose innermost axis is contiguous runs that loop on f32x4 partial
/// results (combined across lanes, then a scalar tail), and agrees with the interpreter:
/// extents with and without a tail, several axes, NaNs (max propagates them), reductions
/// nested in another's body (layer norm's variance reads its mean) and a reduction over a
/// strided axis (scalar).
#[test]
fn reductions_run_on_vectors() {
    let cases = [
        ("sum(x, axis: 1)", "[5, 37]", true),
        ("max(x, axis: -1) + min(x * 3.0, axis: -1)", "[4, 9]", true),
        ("mean(x, axis: [1, 2])", "[3, 5, 11]", true),
        (
            "max(sqrt(x), axis: 1) + sum(sqrt(x) * 0.0, axis: 1)",
            "[6, 40]",
            true,
        ),
        (
            "sum(exp(x - max(x, axis: 1, keepdim: true)), axis: 1)",
            "[3, 64]",
            true,
        ),
        (
            "layer_norm(x, x[0] * 0.0 + 1.0, x[0] * 0.0)",
            "[4, 13]",
            true,
        ),
        ("sum(x, axis: 0)", "[40, 3]", false),
        ("sum(x, axis: 1)", "[5, 7]", false),
    ];
    for (e, shape, vector) in cases {
        let src = format!("model m {{\n input x: f32{shape}\n let y = {e}\n output y\n}}\n");
        agree(&src);
        let code = clif(&src);
        // The reduction's vector accumulator is combined across lanes.
        assert_eq!(
            code.contains("extractlane"),
            vector,
            "{e} over {shape}: vector reduction expected: {vector}\n{code}"
        );
    }
}

/// Kernels the vector loop does not cover keep the scalar loop and still agree.
#[test]
fn scalar_fallbacks_agree_with_eager() {
    for e in [
        "sin(x)",
        "transpose(x) * 2",
        "concat([x, x], axis: 1)",
        "cast(arange(37), f32) + x",
    ] {
        let src = format!(
            "model m {{\n input x: f32[37, 37]\n input b: f32[37]\n let y = {e}\n output y\n}}\n"
        );
        agree(&src);
    }
    let src = "model m {\n input x: f32[37, 37]\n let y = sin(x)\n output y\n}\n";
    assert!(!clif(src).contains("f32x4"), "sin has no vector form");
}

/// f32 products run in the runtime's GEMM helper (`sgemm`), in blocks of at most
/// `SGEMM_BLOCK_M` rows and `SGEMM_BLOCK_N` columns: shapes on and around the block edges,
/// ragged row tiles, batched and broadcast operands, transposed views of either operand
/// (read in place, not copied) and fused epilogues agree with the eager interpreter on 1
/// and 3 threads (whose row ranges start inside a block).
#[test]
fn products_through_the_gemm_helper_agree_with_eager() {
    use tcc_runtime::cpu::{SGEMM_BLOCK_M as BM, SGEMM_BLOCK_N as BN};
    let (m1, n1) = (BM + 5, BN + 3);
    let cases = [
        format!("input a: f32[{m1}, 37]\n input b: f32[37, {n1}]\n let y = a @ b"),
        format!("input a: f32[1, 300]\n input b: f32[300, {BN}]\n let y = a @ b"),
        format!("input a: f32[{BM}, 3]\n input b: f32[3, 1]\n let y = relu(a @ b + 1.0)"),
        "input a: f32[3, 6, 9]\n input b: f32[3, 9, 5]\n let y = a @ b".to_string(),
        "input a: f32[2, 7, 9]\n input b: f32[9, 11]\n let y = tanh(a @ b) * 2.0".to_string(),
        "input a: f32[9, 7]\n input b: f32[13, 9]\n let y = transpose(a) @ transpose(b)"
            .to_string(),
        format!("input a: f32[40, 66]\n input b: f32[{n1}, 66]\n input c: f32[{n1}]\n let y = gelu(a @ transpose(b) + c)"),
        "input a: f32[5, 1]\n input b: f32[1, 4]\n let y = a @ b + 1.0".to_string(),
    ];
    for body in &cases {
        let src = format!("model m {{\n {body}\n output y\n}}\n");
        agree(&src);
        // The same sums on any number of threads, bit for bit.
        let g = compile_pipeline(&src, &Options::default()).unwrap();
        let inputs = tcc::eager::random_inputs(&g, 7);
        let (one, three) = (cpu_threads(&g, &inputs, 1), cpu_threads(&g, &inputs, 3));
        assert_eq!(
            one["y"].to_le_bytes(),
            three["y"].to_le_bytes(),
            "{src}: 1 and 3 threads differ"
        );
        let code = clif(&src);
        assert!(
            code.contains("call_indirect") && code.contains("v3+88"),
            "{src}: the product should call the GEMM helper (slot 11):\n{code}"
        );
        if body.contains("transpose") {
            assert_eq!(
                code.matches("function %").count(),
                1,
                "{src}: one kernel (transposed operands read in place):\n{code}"
            );
        }
    }
}

/// Convolutions and both their gradients run through `sgemm_gathered`: a window that is
/// one chunk of `k` (B gathered once per column block) and weight gradients whose `k` (the
/// batch's pixels) spans several chunks, over ragged channel counts, strides and padding.
/// The loss of a second training step (which reads the first step's updates) agrees with
/// the eager interpreter on 1 and 3 threads, whose ranges start inside blocks, in both
/// layouts.
#[test]
fn convolutions_through_the_gathered_helper_train_like_eager() {
    for (c, s, stride, pad) in [
        (3usize, 23usize, 1usize, 1usize),
        (5, 30, 2, 0),
        (17, 12, 1, 2),
    ] {
        let src = format!(
            "model m {{
 input x: f32[3, {c}, {s}, {s}]
 input labels: i32[3]
 param w1: f32[7, {c}, 3, 3] = normal(0.0, 0.2)
 param w2: f32[4, 7, 3, 3] = normal(0.0, 0.2)
 param wo: f32[4, 5] = normal(0.0, 0.2)
 let h = relu(conv2d(x, w1, stride: {stride}, padding: {pad}))
 let h2 = tanh(conv2d(h, w2, padding: 1))
 let pooled = mean(h2, axis: [2, 3])
 let loss = cross_entropy(pooled @ wo, labels)
 output loss
 train sgd(lr: 0.5) minimize loss
}}
"
        );
        let g =
            compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{src}:\n{e}"));
        let code = clif(&src);
        assert!(
            code.contains("v3+96"),
            "{src}: no call of sgemm_gathered (slot 12)"
        );
        let inputs = tcc::eager::random_inputs(&g, 7);
        let want = eager_steps(&g, &inputs, 2, 0).unwrap();
        for (threads, channels_last) in [(1, false), (3, false), (1, true), (3, true)] {
            let got = cpu_layout_steps(&g, &inputs, threads, 2, channels_last).0;
            let e = rel_err(&got["loss"], &want.outputs["loss"]);
            assert!(
                e <= 1e-4,
                "{src} ({threads} threads, channels-last {channels_last}): loss differs by {e:e}"
            );
        }
    }
}

/// A convolution whose channel runs are longer than a chunk of 512 steps (blocks of fewer
/// rows, one run a chunk) and whose output channels pass one block of 512 columns.
#[test]
fn wide_convolutions_through_the_gathered_helper_agree_with_eager() {
    let src = "model m {
 input x: f32[1, 520, 5, 5]
 param w: f32[516, 520, 3, 3] = normal(0.0, 0.02)
 let y = conv2d(x, w, padding: 1)
 output y
}
";
    agree(src);
    assert!(
        clif(src).contains("v3+96"),
        "no call of sgemm_gathered (slot 12)"
    );
}

/// Weight gradients whose operands are gathered k-major (each pixel's channels contiguous,
/// copied on vectors: the output gradient's channels and a window's channels) make the
/// eager interpreter's SGD update: channel counts that are and are not multiples of 4, and
/// thread ranges that start inside a run of channels (1 and 3 threads), in both layouts
/// (channels-last, the CLI's default, is the one whose columns are runs of channels).
#[test]
fn weight_gradients_gathered_across_channels_update_like_eager() {
    for (c, o, s) in [(4usize, 8usize, 9usize), (6, 5, 11), (3, 13, 7)] {
        // The stacked weight's gradient has its channels innermost (`[3, 3, o]` columns):
        // runs of `o` values per window tap.
        let src = format!(
            "model m {{
 input x: f32[2, {c}, {s}, {s}]
 input labels: i32[2]
 param w1: f32[{o}, {c}, 3, 3] = normal(0.0, 0.3)
 param w2: f32[2, {o}, {o}, 3, 3] = normal(0.0, 0.2)
 param wo: f32[{o}, 3] = normal(0.0, 0.3)
 let h = tanh(conv2d(x, w1, padding: 1))
 let h2 = tanh(conv2d(h, w2[0], padding: 1))
 let h3 = conv2d(h2, w2[1], padding: 1)
 let loss = cross_entropy(mean(h3, axis: [2, 3]) @ wo, labels)
 output loss
 train sgd(lr: 1.0) minimize loss
}}
"
        );
        let g =
            compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{src}:\n{e}"));
        let inputs = tcc::eager::random_inputs(&g, 3);
        let p0 = eager_steps(&g, &inputs, 0, 0).unwrap().persistent;
        let p1 = eager_steps(&g, &inputs, 1, 0).unwrap().persistent;
        for (threads, channels_last) in [(1, true), (3, true), (1, false)] {
            let got = cpu_layout_steps(&g, &inputs, threads, 1, channels_last).1;
            for name in ["w1", "w2"] {
                let (a, b) = (p0[name].to_f64(), p1[name].to_f64());
                let want: Vec<f64> = b.iter().zip(&a).map(|(x, y)| x - y).collect();
                let upd: Vec<f64> = got[name].iter().zip(&a).map(|(x, y)| x - y).collect();
                let num: f64 = upd.iter().zip(&want).map(|(x, y)| (x - y).abs()).sum();
                let den: f64 = want.iter().map(|y| y.abs()).sum();
                assert!(
                    den > 0.0 && num <= 1e-4 * den,
                    "{src} ({threads} threads, channels-last {channels_last}): the update of \
                     `{name}` differs by {:e}",
                    num / den
                );
            }
        }
    }
}

/// Integer `/` and `%` by constants (floor rounding) run as multiplies on the CPU and agree
/// with the eager interpreter on negative values, zero and both ends of the i32 range, for
/// divisors that take each form (1, powers of two, odd and even non-powers, large).
#[test]
fn integer_division_by_constants_agrees_with_eager() {
    let divisors = [1, 2, 3, 7, 8, 10, 28, 1000, 65536, 2147483647];
    let mut lets = String::new();
    let mut outs = Vec::new();
    for (i, d) in divisors.iter().enumerate() {
        lets.push_str(&format!(" let q{i} = ids / {d}\n let r{i} = ids % {d}\n"));
        outs.push(format!("q{i}"));
        outs.push(format!("r{i}"));
    }
    let mut values: Vec<i32> = vec![i32::MIN, i32::MIN + 1, i32::MAX, i32::MAX - 1, 0, 1, -1];
    values.extend((-60..60).map(|v| v * 7 + v % 3));
    values.extend([-65537, -65536, -65535, 65535, 65536, -1001, -999]);
    let n = values.len();
    let src = format!(
        "model m {{\n input ids: i32[{n}]\n{lets} output {}\n}}\n",
        outs.join(", ")
    );
    let g = compile_pipeline(&src, &Options::default()).unwrap_or_else(|e| panic!("{src}:\n{e}"));
    let inputs: BTreeMap<String, tcc::eager::Tensor> = [(
        "ids".to_string(),
        tcc::eager::Tensor::from_i32(vec![n], values),
    )]
    .into();
    let want = eager_steps(&g, &inputs, 1, 0).unwrap();
    let got = cpu_steps(&g, &inputs, 1, 0, true).unwrap();
    for (name, t) in &want.outputs {
        assert_eq!(got.outputs[name].to_f64(), t.to_f64(), "{src}: `{name}`");
    }
    // The CPU code divides by none of the constants.
    let code = clif(&src);
    assert!(!code.contains("sdiv") && !code.contains("srem"), "{code}");
}
