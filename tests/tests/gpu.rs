//! The CPU differential tests, on the GPU: our PTX, run by the runtime's CUDA executor,
//! agrees with the eager interpreter. Needs the `cuda` feature and a GPU; without a GPU
//! the tests print a notice and pass unless `TCC_REQUIRE_GPU` is set (as
//! `scripts/gpu-check.sh` sets it on the GPU machine).
//!
//! Bounds: f32 1e-5 (GPU `ex2.approx`/`lg2.approx` are within a few ulp; sums run in a
//! different order than the CPU's), f16 2e-3, bf16 1.6e-2, integers exact.
#![cfg(feature = "cuda")]

use tcc::front::Options;
use tcc_runtime::Device;
use tcc_tests::{
    builtin_program, compile_pipeline, device_steps, device_steps_with, eager_steps,
    gpu_path_cases, half_cases, integer_program, options_from_args, params_rel_err, rel_err, root,
    tdsl_files, BUILTIN_CASES, IMPLICIT_GEMM_CONVS, INTEGER_CASES,
};

/// Whether a GPU is usable; panics if one is required and missing.
fn gpu() -> bool {
    let src = "model m {\n input x: f32[2]\n let y = x + 1\n output y\n}\n";
    let g = compile_pipeline(src, &Options::default()).unwrap();
    let inputs = tcc::eager::random_inputs(&g, 0);
    match device_steps(&g, &inputs, 1, 0, true, Device::Cuda(0)) {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var_os("TCC_REQUIRE_GPU").is_none(),
                "TCC_REQUIRE_GPU is set but the GPU is not usable: {e}"
            );
            tcc_tests::skipped("GPU tests", &format!("no usable GPU ({e})"));
            false
        }
    }
}

fn agree(src: &str, opts: &Options, what: &str, steps: usize, tol: f64) {
    let g = compile_pipeline(src, opts).unwrap_or_else(|e| panic!("{what}:\n{e}"));
    let inputs = tcc::eager::random_inputs(&g, 5);
    let want = eager_steps(&g, &inputs, steps, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = device_steps(&g, &inputs, steps, 0, true, Device::Cuda(0))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= tol, "{what}: output `{name}` differs by {e:e}");
    }
    let e = params_rel_err(&got.persistent, &want.persistent).unwrap_or(f64::INFINITY);
    assert!(e <= tol, "{what}: params differ by {e:e}");
}

#[test]
fn gpu_builtins_agree_with_eager() {
    if !gpu() {
        return;
    }
    for (_, cases) in BUILTIN_CASES {
        for (expr, wrt) in cases.iter() {
            let src = builtin_program(expr, wrt).unwrap();
            agree(&src, &Options::default(), expr, 1, 1e-5);
        }
    }
    for e in INTEGER_CASES {
        agree(&integer_program(e), &Options::default(), e, 1, 0.0);
    }
    for (what, src, tol) in half_cases() {
        agree(&src, &Options::default(), &what, 1, tol);
    }
}

#[test]
fn gpu_gelu_gradient_far_from_zero() {
    if !gpu() {
        return;
    }
    tcc_tests::check_gelu_gradient_far_from_zero(tcc_runtime::Device::Cuda(0));
}

#[test]
fn gpu_fusion_cases_agree_with_eager() {
    if !gpu() {
        return;
    }
    for dir in ["tests/cases/fusion", "tests/cases/layout"] {
        for f in tdsl_files(dir) {
            let src = std::fs::read_to_string(&f).unwrap();
            agree(&src, &Options::default(), &f.display().to_string(), 1, 1e-5);
        }
    }
}

#[test]
fn gpu_examples_train_like_eager() {
    if !gpu() {
        return;
    }
    for (ex, set, steps) in [
        ("tiny", "", 5),
        ("mlp", "--set B=8 --set D=32", 5),
        ("cnn", "--set B=4 --set C=4 --set S=16", 2),
        // Wide enough for the tiled implicit GEMMs of every convolution and gradient. One
        // step: the GEMMs sum in another order than the interpreter's loops, and after an
        // update a ReLU input within rounding of 0 may fall on the other side (one such
        // flip moved the params of a second step by 9e-4).
        ("cnn", "--set B=4 --set C=16 --set S=16", 1),
        (
            "gpt",
            "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
            3,
        ),
    ] {
        let src = std::fs::read_to_string(root().join(format!("examples/{ex}.tdsl"))).unwrap();
        agree(&src, &options_from_args(set), ex, steps, 1e-5);
    }
}

/// Weight gradients whose `k` (every output pixel of the batch) is long and whose output is
/// small split `k` across blocks that add into a zeroed buffer (`split_k` in the kernels).
#[test]
fn gpu_split_k_weight_gradients_agree_with_eager() {
    if !gpu() {
        return;
    }
    let src = "model m {
        input x: f32[32, 16, 16, 16]
        param w: f32[16, 16, 3, 3] = normal(0.0, 0.1)
        param w2: f32[24, 16, 3, 3] = normal(0.0, 0.1)
        let h = relu(conv2d(x, w, padding: 1))
        let y = conv2d(h, w2, stride: 2, padding: 1)
        let loss = mean(y * y)
        output loss
        train sgd(lr: 0.1, momentum: 0.9) minimize loss
    }";
    agree(
        src,
        &Options::default(),
        "split-K weight gradients",
        1,
        1e-5,
    );
}

/// Causal attention's gradients skip what the forward pass skips: the score gradient's
/// tiles above the diagonal, and `k` ranges of `dq`, `dk` and `dv` (48 heads of 260
/// positions: every attention matmul takes the large tiles).
#[test]
fn gpu_causal_attention_gradients_agree_with_eager() {
    if !gpu() {
        return;
    }
    let src = "model m {
        input w: f32[2, 24, 260, 32]
        param q: f32[2, 24, 260, 32] = normal(0.0, 1.0)
        param k: f32[2, 24, 260, 32] = normal(0.0, 1.0)
        param v: f32[2, 24, 260, 32] = normal(0.0, 1.0)
        let loss = mean(attention(q, k, v, causal: true) * w)
        output loss
        train sgd(lr: 100.0) minimize loss
    }";
    agree(src, &Options::default(), "causal attention", 2, 1e-5);
}

/// The fused attention kernel (`passes::attention`) on ragged tiles: 70 queries against 90
/// keys (causal: the diagonal shifted by 20), a value width other than the head's, and a
/// plain one; outputs and gradients (rebuilt from its row statistics).
#[test]
fn gpu_fused_attention_agrees_with_eager() {
    if !gpu() {
        return;
    }
    for causal in [true, false] {
        let src = format!(
            "model m {{
                input w: f32[3, 5, 70, 32]
                param q: f32[3, 5, 70, 16] = normal(0.0, 1.0)
                param k: f32[3, 5, 90, 16] = normal(0.0, 1.0)
                param v: f32[3, 5, 90, 32] = normal(0.0, 1.0)
                let a = attention(q, k, v, causal: {causal})
                let loss = mean(a * a * w)
                output loss
                train sgd(lr: 100.0) minimize loss
            }}"
        );
        agree(&src, &Options::default(), "fused attention", 2, 1e-5);
    }
}

#[test]
fn gpu_vector_and_matmul_paths_agree_with_eager() {
    if !gpu() {
        return;
    }
    for (what, src, tol) in gpu_path_cases() {
        agree(&src, &Options::default(), &what, 1, tol);
    }
}

/// Convolutions that the large-tile SGEMM runs as implicit GEMMs (gathered operands,
/// element by element or as runs of 4 channels, clamped and masked at the edges): padding,
/// a 1×1 window, the input gradient of a stride-2 convolution, split-K weight gradients
/// and a stream-K convolution, in channels-last, over two SGD steps (the splits' zeroed
/// sums are redone).
/// Against the CPU back end (itself tested against eager): eager takes minutes for these
/// sizes.
#[test]
fn gpu_implicit_gemm_convolutions_train_like_the_cpu() {
    if !gpu() {
        return;
    }
    let g = compile_pipeline(IMPLICIT_GEMM_CONVS, &Options::default()).unwrap();
    let inputs = tcc::eager::random_inputs(&g, 5);
    let cpu = tcc_tests::device_options(Device::Cpu, true);
    let want = tcc_tests::steps_compiled(&g, &inputs, 2, 0, Device::Cpu, &cpu).unwrap();
    let got = device_steps(&g, &inputs, 2, 0, true, Device::Cuda(0)).unwrap();
    for (name, t) in &want.outputs {
        let e = rel_err(&got.outputs[name], t);
        assert!(e <= 1e-5, "output `{name}` differs by {e:e}");
    }
    let e = params_rel_err(&got.persistent, &want.persistent).unwrap_or(f64::INFINITY);
    println!("implicit-GEMM convolutions: params rel err {e:e}");
    assert!(e <= 1e-5, "params differ by {e:e}");
}

/// f32 matmuls on TF32 tensor cores (`allow_tf32`): operands keep 10 mantissa bits (rounded
/// on `mma.sync`, truncated by wgmma, as cuBLAS's are), so the bound is 5e-3 instead of 1e-5.
#[test]
fn gpu_tf32_matmuls_agree_with_eager() {
    if !gpu() {
        return;
    }
    for (decls, e) in [
        (
            " input x: f32[128, 96]\n input w: f32[96, 80]\n input b: f32[80]",
            "relu(x @ w + b)",
        ),
        (" input x: f32[70, 36]\n input w: f32[36, 50]", "x @ w"),
        (
            " input x: f32[40, 128]\n input w: f32[40, 64]",
            "transpose(x) @ w",
        ),
        (
            " input x: f32[2, 64, 32]\n input w: f32[2, 32, 72]",
            "x @ w",
        ),
        // Hopper's wgmma (TF32 tiles are K-major only): A by `cp.async`, B contiguous along
        // `n` transposed in shared memory; ragged m, n and k.
        (" input x: f32[300, 136]\n input w: f32[136, 260]", "x @ w"),
        // Both transposed in shared memory.
        (
            " input x: f32[136, 300]\n input w: f32[136, 260]",
            "transpose(x) @ w + 1.0",
        ),
        // B contiguous along `k`, read in place.
        (
            " input x: f32[300, 136]\n input w: f32[260, 136]",
            "x @ transpose(w)",
        ),
        // 128×256 tiles (a wave of them), batched.
        (
            " input x: f32[2, 768, 96]\n input w: f32[2, 96, 2816]",
            "x @ w",
        ),
        // 128×256 tiles with both operands transposed: three stages, one ahead.
        (
            " input x: f32[200, 1260]\n input w: f32[200, 3580]",
            "transpose(x) @ w",
        ),
    ] {
        let src = format!("model m {{\n{decls}\n let out = {e}\n output out\n}}\n");
        let g = compile_pipeline(&src, &Options::default()).unwrap();
        let inputs = tcc::eager::random_inputs(&g, 5);
        let want = eager_steps(&g, &inputs, 1, 0).unwrap();
        let got = device_steps_with(&g, &inputs, 1, 0, true, Device::Cuda(0), true)
            .unwrap_or_else(|err| panic!("{e}: {err}"));
        for (name, t) in &want.outputs {
            let err = rel_err(&got.outputs[name], t);
            assert!(err <= 5e-3, "{e}: output `{name}` differs by {err:e}");
        }
    }
}

/// Stream-K matmuls (`back::ptx::stream_k`): tiles that fill their waves badly share
/// their `k` stages between blocks, whose ranges start and end inside tiles; the tile's
/// first block adds the others' partials. Ragged `m`, `n` and `k`, a batch, an epilogue,
/// and a weight gradient (`[2999, 600] @ [600, 260]`) of a training step, over two steps
/// (the flags are reset for the next launch).
#[test]
fn gpu_stream_k_matmuls_agree_with_eager() {
    if !gpu() {
        return;
    }
    let src = "model m {
        input x: f32[600, 2999]
        input u: f32[3, 260, 1560]
        input v: f32[1560, 300]
        input t: f32[600, 260]
        param w: f32[2999, 260] = normal(0.0, 0.05)
        param b: f32[260] = normal(0.0, 1.0)
        let y = relu(x @ w + b)
        let z = u @ v
        let loss = mean(y * t)
        output loss
        output z
        train sgd(lr: 0.5) minimize loss
    }";
    agree(src, &Options::default(), "stream-K matmuls", 2, 1e-5);
}

/// Mixed precision on the GPU: the examples under `--amp bf16` and `f16` (tensor-core
/// 16-bit matmuls, f16 loss scaling) agree with the interpreter's mixed-precision step within
/// the bounds of `tests/src/amp.rs` (the cnn's 20 convolutions with batch norms: 2.5 times).
#[test]
fn gpu_mixed_precision_examples_agree_with_eager() {
    if !gpu() {
        return;
    }
    for (file, args, factor) in [
        ("examples/mlp.tdsl", "--set B=8 --set D=32", 1.0),
        // C=16: the convolutions of stages 1 to 3 run on tensor cores, stage 4 on FFMA.
        ("examples/cnn.tdsl", "--set B=4 --set C=16 --set S=16", 2.5),
        // Ragged tiles (24 and 40 channels), padding on an odd side, stride 2, a 1×1 conv.
        ("bench/conv_edges.tdsl", "", 1.0),
        (
            "examples/gpt.tdsl",
            "--set B=2 --set T=64 --set D=64 --set H=2 --set L=2 --set V=128",
            1.0,
        ),
        ("examples/tiny.tdsl", "", 1.0),
        // Weight gradients `hᵀ @ dy` read a transposed 16-bit A (`[k][row]` tiles).
        ("bench/rnn_chain.tdsl", "--set T=8", 1.0),
    ] {
        let src = std::fs::read_to_string(root().join(file)).unwrap();
        tcc_tests::amp::agree(&src, args, 1, factor, file, Device::Cuda(0));
    }
}

/// Attention's gradients under `--amp bf16` and `f16`, causal and not: the probabilities
/// and the score gradient are cast before they are transposed, and the value and key
/// gradients read them transposed on the tensor cores (`[k][row]` A tiles; 4 heads of 192
/// positions, head dim 64).
#[test]
fn gpu_attention_gradients_agree_under_mixed_precision() {
    if !gpu() {
        return;
    }
    for causal in [true, false] {
        let src = format!(
            "model m {{
                input q: f32[2, 4, 192, 64]
                input k: f32[2, 4, 192, 64]
                input v: f32[2, 4, 192, 64]
                input w: f32[2, 4, 192, 64]
                let loss = sum(attention(q, k, v, causal: {causal}) * w)
                let dq = grad(loss, q)
                let dk = grad(loss, k)
                let dv = grad(loss, v)
                output dq
                output dk
                output dv
            }}"
        );
        tcc_tests::amp::agree(&src, "", 1, 1.0, "attention", Device::Cuda(0));
    }
}

/// The flash-attention gradient kernels (`back::ptx::attention_grad`) on ragged tiles: 70
/// queries against 90 keys (causal: the diagonal shifted by 20) and 90 against 70 (not
/// causal), head dimensions 16, 32, 64 and 128 with value widths other than the head's;
/// `dq`, `dk` and `dv` against the interpreted mixed-precision step.
#[test]
fn gpu_flash_attention_gradients_agree_on_ragged_tiles() {
    if !gpu() {
        return;
    }
    for ((t, s), causal) in [((70, 90), true), ((70, 90), false), ((90, 70), false)] {
        for (d, e) in [(64, 32), (128, 128), (16, 16), (32, 64)] {
            let src = format!(
                "model m {{
                    input q: f32[2, 3, {t}, {d}]
                    input k: f32[2, 3, {s}, {d}]
                    input v: f32[2, 3, {s}, {e}]
                    input w: f32[2, 3, {t}, {e}]
                    let loss = sum(attention(q, k, v, causal: {causal}) * w)
                    let dq = grad(loss, q)
                    let dk = grad(loss, k)
                    let dv = grad(loss, v)
                    output dq
                    output dk
                    output dv
                }}"
            );
            let what = format!("attention gradients T={t} S={s} d={d} e={e} causal={causal}");
            tcc_tests::amp::agree(&src, "", 1, 1.0, &what, Device::Cuda(0));
        }
    }
}

/// The f32 flash-attention gradient kernels (`back::ptx::attention_ffma_grad`,
/// `--flash-backward`) on the same ragged tiles: 70 queries against 90 keys (causal: the
/// diagonal shifted by 20) and 90 against 70 (not causal), and several blocks a side
/// (causal), head dimensions 16 to 128 with value widths other than the head's; `dq`, `dk`
/// and `dv` against the interpreted composite. The compiled step must hold both kernels
/// (else it would test the composite).
#[test]
fn gpu_f32_flash_attention_gradients_agree_on_ragged_tiles() {
    if !gpu() {
        return;
    }
    let shapes = [
        ((70, 90), true),
        ((70, 90), false),
        ((90, 70), false),
        // Several blocks a side: causal skipping of whole key blocks (`dq`) and query
        // blocks (`dk`, `dv`).
        ((260, 260), true),
        ((150, 200), true),
    ];
    for ((t, s), causal) in shapes {
        for (d, e) in [(64, 32), (128, 128), (16, 16), (32, 64)] {
            let src = format!(
                "model m {{
                    input q: f32[2, 3, {t}, {d}]
                    input k: f32[2, 3, {s}, {d}]
                    input v: f32[2, 3, {s}, {e}]
                    input w: f32[2, 3, {t}, {e}]
                    let loss = sum(attention(q, k, v, causal: {causal}) * w)
                    let dq = grad(loss, q)
                    let dk = grad(loss, k)
                    let dv = grad(loss, v)
                    output dq
                    output dk
                    output dv
                }}"
            );
            let what = format!("f32 attention gradients T={t} S={s} d={d} e={e} causal={causal}");
            let g = compile_pipeline(&src, &Options::default()).unwrap();
            let opts = tcc::artifact::CompileOptions {
                flash_backward: true,
                ..tcc_tests::device_options(Device::Cuda(0), true)
            };
            let c = tcc::artifact::compile(&g, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
            // The rewrite leaves 90 queries on 70 keys with 16-wide heads composite.
            let kernels = usize::from((t, d) != (90, 16));
            assert_eq!(
                c.code.matches("attention_grad_kv %").count(),
                kernels,
                "{what}"
            );
            assert_eq!(
                c.code.matches("attention_grad_q %").count(),
                kernels,
                "{what}"
            );
            let inputs = tcc::eager::random_inputs(&g, 5);
            let want = eager_steps(&g, &inputs, 1, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = tcc_tests::steps_compiled(&g, &inputs, 1, 0, Device::Cuda(0), &opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (name, x) in &want.outputs {
                let err = rel_err(&got.outputs[name], x);
                assert!(err <= 1e-5, "{what}: output `{name}` differs by {err:e}");
            }
        }
    }
}

/// The tensor-core attention kernel (`back::ptx::attention_mma`, 16-bit queries, keys and
/// values): ragged tiles (70 queries against 90 keys; causal, the diagonal shifted by 20),
/// head dimensions 16, 32, 64 and 128, value widths other than the head's; more queries
/// than keys. Its output against the interpreter on the same 16-bit inputs (the
/// probabilities are rounded to 16 bits before `p v`), then a trained step under `--amp` whose attention reads 16-bit
/// projections (scores spread over several units, as a trained model's are) and whose
/// gradients use the kernel's row statistics. The loss is a sum of squares: a sum of
/// signed terms can cancel, and a bound relative to it then measures nothing.
#[test]
fn gpu_tensor_core_attention_agrees() {
    if !gpu() {
        return;
    }
    for (dtype, tol) in [("bf16", 1e-2), ("f16", 2e-3)] {
        for (d, e) in [(64, 32), (128, 128), (16, 16), (32, 64)] {
            for causal in [true, false] {
                let src = tcc_tests::tensor_core_attention(dtype, (70, 90), (d, e), causal);
                let what = format!("{dtype} attention d={d} e={e} causal={causal}");
                agree(&src, &Options::default(), &what, 1, tol);
            }
        }
        // More queries than keys, causal: the first 20 rows see no key (NaN, as the
        // composite gives) and the first row tile reads no key block.
        let src = tcc_tests::tensor_core_attention(dtype, (90, 70), (64, 64), true);
        agree(
            &src,
            &Options::default(),
            "attention, 90 queries on 70 keys",
            1,
            tol,
        );
    }
    for causal in [true, false] {
        let src = format!(
            "model m {{
                input x: f32[2, 70, 64]
                input y: f32[2, 90, 64]
                param wq: f32[64, 128] = normal(0.0, 0.3)
                param wk: f32[64, 128] = normal(0.0, 0.3)
                param wv: f32[64, 64] = normal(0.0, 0.3)
                let q = permute(reshape(x @ wq, [2, 70, 2, 64]), [0, 2, 1, 3])
                let k = permute(reshape(y @ wk, [2, 90, 2, 64]), [0, 2, 1, 3])
                let v = permute(reshape(y @ wv, [2, 90, 2, 32]), [0, 2, 1, 3])
                let a = attention(q, k, v, causal: {causal})
                let loss = mean(a * a)
                output a
                output loss
                train sgd(lr: 0.1) minimize loss
            }}"
        );
        tcc_tests::amp::agree(&src, "", 1, 1.0, "tensor-core attention", Device::Cuda(0));
    }
}

/// Every builtin case (forward and gradients) under `--amp bf16` and `f16` on the GPU
/// against the interpreter's mixed-precision step, as `tests/amp.rs` does on the CPU.
#[test]
fn gpu_builtins_agree_under_mixed_precision() {
    if !gpu() {
        return;
    }
    let cases = tcc_tests::all_builtin_cases();
    for (expr, wrt) in &cases {
        let src = builtin_program(expr, wrt).unwrap_or_else(|e| panic!("{expr}: {e}"));
        tcc_tests::amp::agree(&src, "", 1, 1.0, expr, Device::Cuda(0));
    }
}

/// A `cuda` artifact with SASS (`tcc build` with `ptxas` there) loads its cubins, with no
/// compile by the driver, and trains as the same artifact's PTX does; SASS for another
/// GPU, or bytes that are no cubin, fall back to the PTX and say why.
#[test]
fn gpu_sass_loads_without_the_driver_and_trains_as_the_ptx_does() {
    if !gpu() {
        return;
    }
    let Some(ptxas) = tcc_tests::ptxas() else {
        panic!("no ptxas on the GPU machine (it has CUDA's /usr/local/cuda/bin/ptxas)");
    };
    use tcc_runtime::{CodeOrigin, Model};
    for (ex, set) in [
        ("mlp", "--set B=8 --set D=32"),
        (
            "gpt",
            "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
        ),
    ] {
        let src = std::fs::read_to_string(root().join(format!("examples/{ex}.tdsl"))).unwrap();
        let g = compile_pipeline(&src, &options_from_args(set)).unwrap();
        let c =
            tcc::artifact::compile(&g, &tcc_tests::device_options(Device::Cuda(0), true)).unwrap();
        let bytes = tcc_tests::artifact_with_sass(&c, &ptxas, 4).unwrap();
        let inputs = tcc::eager::random_inputs(&g, 3);
        let run = |bytes: Vec<u8>| {
            let m = Model::from_bytes(bytes).unwrap();
            tcc_tests::model_steps(&m, &g, &inputs, 3, Device::Cuda(0)).unwrap()
        };
        let (sass, from_sass) = run(bytes.clone());
        // SASS for this GPU's architecture loads; for another, the PTX does, saying why.
        let arch = match &from_sass {
            CodeOrigin::Sass { arch } => arch.clone(),
            CodeOrigin::Ptx { why: Some(w) } if w.contains("this GPU is") => {
                eprintln!("{ex}: {w}; SASS not tested on this GPU");
                continue;
            }
            other => panic!("{ex}: loaded from {other}, not the SASS"),
        };
        // The same artifact without its SASS: the driver compiles the PTX.
        let img = tcc::artifact::persistent_image(&c, 7, &Default::default()).unwrap();
        let plain = tcc::artifact::write_artifact(&c, tcc::artifact::Target::Cuda, &img);
        let (ptx, from_ptx) = run(plain);
        assert_eq!(from_ptx, CodeOrigin::Ptx { why: None });
        for (name, t) in &ptx.outputs {
            let e = rel_err(&sass.outputs[name], t);
            assert!(e <= 1e-6, "{ex}: output `{name}` differs by {e:e}");
        }
        let e = params_rel_err(&sass.persistent, &ptx.persistent).unwrap_or(f64::INFINITY);
        assert!(e <= 1e-6, "{ex}: params differ by {e:e}");
        eprintln!("{ex}: SASS for {arch}; params within {e:e} of the PTX's");
        // SASS for another GPU, and bytes that are no cubin: the PTX, with the reason.
        let m = Model::from_bytes(bytes).unwrap();
        let (s, cubins) = m.sass().unwrap();
        // The same cubins without the padding between them.
        let section: Vec<u8> = cubins.concat();
        let mut fake = s.clone();
        let mut at = 0;
        for p in &mut fake.pieces {
            p.offset = at;
            at += p.len;
        }
        let mut other = fake.clone();
        other.arch = "sm_80".into();
        let garbage = vec![7u8; section.len()];
        for (sass, bytes, why) in [
            (&other, &section, "its SASS is for sm_80"),
            (&fake, &garbage, "not an ELF image"),
        ] {
            let art = tcc::artifact::write_artifact_with_sass(
                &c,
                tcc::artifact::Target::Cuda,
                &img,
                Some((sass, bytes)),
            );
            let (r, origin) = run(art);
            match &origin {
                CodeOrigin::Ptx { why: Some(w) } => assert!(w.contains(why), "{ex}: {w}"),
                other => panic!("{ex}: loaded from {other}, not the PTX"),
            }
            // Two runs of the same PTX: gpt's split-k reductions add in whatever order the
            // blocks finish (3.8e-9 apart on an H100).
            let e = params_rel_err(&r.persistent, &ptx.persistent).unwrap_or(f64::INFINITY);
            assert!(e <= 1e-6, "{ex}: the fallback's params differ by {e:e}");
        }
    }
}

/// How many GPUs this machine has (0 when none is usable).
fn gpu_count() -> usize {
    tcc_runtime::cuda_device_count().unwrap_or(0)
}

/// One rank through NCCL (a world of one GPU): the communicator is made and the rank's
/// three-stream launch runs the step as one session does.
#[test]
fn gpu_one_nccl_rank_equals_one_session() {
    if !gpu() {
        return;
    }
    let (err, loss, mean) = tcc_tests::data_parallel_vs_whole(
        tcc_tests::DATA_PARALLEL_MLP,
        8,
        10,
        &[Device::Cuda(0)],
        Default::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("1 NCCL rank: params rel err {err:e}, loss {loss} vs {mean}");
    assert!(err < 1e-6, "params differ by {err:e}");
}

/// ZeRO-1 over NCCL on every GPU of the machine (2 or more): reduce-scatter, shard and
/// all-gather on the communication stream give the params, the state (shards put back
/// together) and the losses of plain data parallelism: 10 Adam steps of the small MLP, and
/// 10 SGD-momentum steps of a wide one (several buckets, a padded param). NCCL sums a
/// reduce-scatter in another order than an all-reduce on more than 2 GPUs; Adam's
/// `m / √v` turns those last bits of the wide model's near-cancelling gradients into
/// whole steps of `lr` (4 H100s: params 4e-6, moments 7e-4 apart, the same with and
/// without the CUDA graph), so the wide case uses momentum, which is linear in them.
#[test]
fn gpu_zero_one_over_nccl_equals_plain_data_parallelism() {
    if !gpu() {
        return;
    }
    let n = gpu_count();
    if n < 2 {
        tcc_tests::skipped(
            "gpu_zero_one_over_nccl_equals_plain_data_parallelism",
            &format!("{n} GPU(s); needs 2"),
        );
        return;
    }
    let devices: Vec<Device> = (0..n).map(Device::Cuda).collect();
    let wide = "
model dp {
    input  x: f32[{B}, 2048]
    input  labels: i32[{B}]
    param  w1: f32[2048, 2048] = normal(0.0, 0.02)
    param  w2: f32[2048, 2048] = normal(0.0, 0.02)
    param  w3: f32[2048, 2048] = normal(0.0, 0.02)
    param  w5: f32[2048, 10] = normal(0.0, 0.02)
    param  c: f32[2047] = normal(0.0, 0.1)
    let h = relu(relu(relu(x @ w1) @ w2) @ w3)
    let loss = cross_entropy(h @ w5, labels) + sum(c * c)
    output loss
    train sgd(lr: 0.01, momentum: 0.9) minimize loss
}
";
    for (name, src, b) in [("mlp", tcc_tests::DATA_PARALLEL_MLP, 8), ("wide", wide, 4)] {
        let (params, state, loss) =
            tcc_tests::zero_vs_plain(src, b, 10, &devices, Default::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!("{name} on {n} GPUs, ZeRO-1 vs plain: params {params:e}, state {state:e}, loss {loss:e}");
        assert!(params < 1e-5, "{name}: params differ by {params:e}");
        assert!(state < 1e-5, "{name}: optimizer state differs by {state:e}");
        assert!(loss < 1e-4, "{name}: losses differ by {loss:e}");
    }
}

/// Data parallelism over NCCL on every GPU of the machine (2 or more): N ranks equal one
/// session on the whole batch, with one bucket (the small MLP) and with several (64 MiB of
/// gradients in 25 MiB buckets), under f32 and bf16 autocast, and with a stacked param
/// summed a layer at a time.
#[test]
fn gpu_data_parallel_over_nccl_equals_the_whole_batch() {
    if !gpu() {
        return;
    }
    let n = gpu_count();
    if n < 2 {
        tcc_tests::skipped(
            "gpu_data_parallel_over_nccl_equals_the_whole_batch",
            &format!("{n} GPU(s); needs 2"),
        );
        return;
    }
    let devices: Vec<Device> = (0..n).map(Device::Cuda).collect();
    let wide = "
model dp {
    input  x: f32[{B}, 2048]
    input  labels: i32[{B}]
    param  w1: f32[2048, 2048] = normal(0.0, 0.02)
    param  w2: f32[2048, 2048] = normal(0.0, 0.02)
    param  w3: f32[2048, 2048] = normal(0.0, 0.02)
    param  w4: f32[2048, 2048] = normal(0.0, 0.02)
    param  w5: f32[2048, 10] = normal(0.0, 0.02)
    let h = relu(relu(relu(relu(x @ w1) @ w2) @ w3) @ w4)
    let loss = cross_entropy(h @ w5, labels)
    output loss
    train adam(lr: 0.00002) minimize loss
}
";
    // The same widths as one stacked param: its layers' gradients are summed one by one,
    // in place, as the backward pass reaches them.
    let stacked = "
model dp {
    input  x: f32[{B}, 2048]
    input  labels: i32[{B}]
    param  w: f32[4, 2048, 2048] = normal(0.0, 0.02)
    param  head: f32[2048, 10] = normal(0.0, 0.02)
    let h = x
    for l in 0..4 {
        h = relu(h @ w[l])
    }
    let loss = cross_entropy(h @ head, labels)
    output loss
    train adam(lr: 0.00002) minimize loss
}
";
    for (name, src, b, amp, tol) in [
        ("mlp f32", tcc_tests::DATA_PARALLEL_MLP, 8, "off", 1e-5),
        ("wide f32", wide, 4, "off", 1e-5),
        ("wide bf16", wide, 4, "bf16", 2e-2),
        ("stacked f32", stacked, 4, "off", 1e-5),
    ] {
        let amp = tcc::passes::amp::Amp::named(amp).expect("a policy");
        let (err, loss, mean) = tcc_tests::data_parallel_vs_whole(src, b, 10, &devices, amp)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!(
            "{name} on {n} GPUs: params rel err {err:e}, loss {loss} (whole) vs {mean} (ranks)"
        );
        assert!(err < tol, "{name}: params differ by {err:e}");
    }
    // A world of the wrong size is an error, not a hang.
    let src = tcc_tests::DATA_PARALLEL_MLP.replace("{B}", "4");
    let built_for = |ranks: usize| {
        let compile = tcc::artifact::CompileOptions {
            ranks,
            ..tcc_tests::device_options(Device::Cuda(0), true)
        };
        tcc_tests::compile_step(&src, &Default::default(), &compile)
            .expect("compiles")
            .2
    };
    let e = tcc_runtime::DataParallel::new(&built_for(n + 1), &devices).unwrap_err();
    assert!(matches!(e, tcc_runtime::Error::Ranks { .. }), "{e}");
    // A rank whose NCCL init fails: the others, waiting for it in `ncclCommInitRank`, are
    // not waited for; the error comes at once.
    let model = built_for(n);
    std::env::set_var("TCC_NCCL_FAIL_RANK", (n - 1).to_string());
    let t = std::time::Instant::now();
    let e = tcc_runtime::DataParallel::with_timeout(
        &model,
        &devices,
        std::time::Duration::from_secs(60),
    )
    .unwrap_err();
    std::env::remove_var("TCC_NCCL_FAIL_RANK");
    eprintln!(
        "failed NCCL init: {e} (after {:.2} s)",
        t.elapsed().as_secs_f64()
    );
    assert!(e.to_string().contains("failed on purpose"), "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn gpu_micro_batches_equal_the_whole_batch() {
    if !gpu() {
        return;
    }
    // gpt (Adam, fused attention, layer norms) and the mlp, K micro-batches against the
    // whole batch after 3 steps, on the GPU.
    let read = |f: &str| std::fs::read_to_string(root().join("examples").join(f)).unwrap();
    let gpt_sets: &[(&str, &str)] = &[
        ("B", "8"),
        ("T", "64"),
        ("D", "64"),
        ("L", "2"),
        ("V", "128"),
        ("H", "2"),
    ];
    for (what, src, sets, k) in [
        ("gpt", read("gpt.tdsl"), gpt_sets, 2),
        ("gpt", read("gpt.tdsl"), gpt_sets, 4),
        ("mlp", read("mlp.tdsl"), &[("B", "64")][..], 4),
    ] {
        tcc_tests::assert_micro_equals_whole(what, &src, sets, k, Device::Cuda(0));
    }
}
