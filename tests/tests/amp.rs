//! Mixed precision (`--amp bf16|f16`, `compiler/src/passes/amp.rs`) and dynamic loss
//! scaling (`compiler/src/autodiff/scale.rs`) on the CPU back end against the interpreter,
//! within the bounds of `tests/src/amp.rs`.

use std::collections::BTreeMap;
use tcc::artifact::CompileOptions;
use tcc::autodiff::scale::{LossScale, SCALE, SKIPPED, TRACKER};
use tcc::eager::Tensor;
use tcc::ir::{DType, Op};
use tcc::passes::amp::{self, Amp, Precision};
use tcc_runtime::Device;
use tcc_tests::amp::{agree, compiled, interpreted, policies, step};
use tcc_tests::{builtin_program, device_options, root, StepResult};

#[test]
fn the_policy_table() {
    use tcc::ir::{BinaryOp, ReduceOp, UnaryOp};
    assert_eq!(amp::precision(&Op::MatMul), Precision::Low);
    let conv = Op::Conv2d {
        stride: [1, 1],
        padding: [0, 0],
        groups: 1,
    };
    assert_eq!(amp::precision(&conv), Precision::Low);
    let grad_weight = Op::Conv2dGradWeight {
        stride: [1, 1],
        padding: [0, 0],
        groups: 1,
        weight: tcc::ir::Shape(vec![4, 4, 3, 3]),
    };
    assert_eq!(amp::precision(&grad_weight), Precision::Rounded);
    for u in [UnaryOp::Exp, UnaryOp::Log, UnaryOp::Rsqrt] {
        assert_eq!(amp::precision(&Op::Unary(u)), Precision::Full, "{u:?}");
    }
    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        axes: vec![0],
        keepdim: false,
    };
    assert_eq!(amp::precision(&sum), Precision::Full);
    assert_eq!(
        amp::precision(&Op::Binary(BinaryOp::Add)),
        Precision::Widest
    );
    assert_eq!(amp::precision(&Op::Unary(UnaryOp::Relu)), Precision::Widest);
    assert_eq!(
        amp::precision(&Op::Cast { to: DType::F32 }),
        Precision::AsIs
    );
}

/// The examples at small sizes: the mixed-precision step computes 16-bit matmuls and keeps
/// params, gradients and optimizer state f32, and compiled and interpreted steps agree.
#[test]
fn examples_agree_with_the_interpreter_under_both_policies() {
    // The cnn's 20 convolutions, each rounding its output to 16 bits and followed by a
    // batch norm, add up rounding differences: 2.5 times the bound (measured: 2.4e-2 for
    // bf16 at B=4).
    for (file, args, factor) in [
        ("examples/mlp.tdsl", "--set B=8 --set D=32", 1.0),
        ("examples/cnn.tdsl", "--set B=4 --set C=8 --set S=16", 2.5),
        (
            "examples/gpt.tdsl",
            "--set B=2 --set T=8 --set D=32 --set H=2 --set L=1 --set V=64",
            1.0,
        ),
        ("examples/tiny.tdsl", "", 1.0),
    ] {
        let src = std::fs::read_to_string(root().join(file)).unwrap();
        for a in policies() {
            let g = step(&src, args, a);
            let mixed = amp::apply(&g, a.dtype.unwrap()).unwrap();
            let low = a.dtype.unwrap();
            let contractions: Vec<_> = mixed
                .node_ids()
                .filter(|&n| amp::precision(&mixed.node(n).op) == Precision::Low)
                .collect();
            for &n in &contractions {
                assert_eq!(mixed.ty(n).dtype, low, "{file}: {:?}", mixed.node(n).op);
            }
            for &(p, d) in &mixed.grads {
                assert_eq!(mixed.ty(p).dtype, DType::F32, "{file}: param");
                assert_eq!(mixed.ty(d).dtype, DType::F32, "{file}: gradient");
            }
            for &s in &mixed.states {
                assert_eq!(mixed.ty(s).dtype, DType::F32, "{file}: state");
            }
            if !file.contains("tiny") {
                assert!(!contractions.is_empty(), "{file}: no tensor-core op");
            }
        }
        agree(&src, args, 1, factor, file, Device::Cpu);
    }
}

/// Every builtin case of the CPU suite, forward and gradients, under both policies.
#[test]
fn every_builtin_agrees_under_both_policies() {
    let cases = tcc_tests::all_builtin_cases();
    for (expr, wrt) in &cases {
        let src = builtin_program(expr, wrt).unwrap_or_else(|e| panic!("{expr}: {e}"));
        agree(&src, "", 1, 1.0, expr, Device::Cpu);
    }
}

const SCALED: &str = "
model m {
    input x: f32[16, 32]
    param w: f32[32, 16] = normal(0.0, 0.5)
    let y = x @ w
    let loss = mean(y * y) * 1e-6
    output loss
    train adam(lr: 0.01) minimize loss
}
";

fn f16_with(scale: Option<LossScale>) -> Amp {
    Amp {
        dtype: Some(DType::F16),
        loss_scale: scale,
        no_finite_check: false,
    }
}

fn scalar(r: &StepResult, name: &str) -> f64 {
    r.persistent[name].to_f64()[0]
}

/// A scale so large that the f16 gradients overflow: the step is skipped with params and
/// Adam's state bitwise unchanged, the scale is backed off and the step counted.
#[test]
fn an_overflowing_step_is_skipped_and_the_scale_backs_off() {
    let a = f16_with(Some(LossScale {
        init: 1e30,
        ..LossScale::default()
    }));
    let g = step(SCALED, "", a);
    let inputs = tcc::eager::random_inputs(&g, 1);
    let before = compiled(&g, &inputs, Device::Cpu, 0, a);
    for r in [
        compiled(&g, &inputs, Device::Cpu, 1, a),
        interpreted(&g, &inputs, 1, a),
    ] {
        for (name, t) in &before.persistent {
            if name.starts_with("amp.") {
                continue;
            }
            assert_eq!(
                r.persistent[name].to_le_bytes(),
                t.to_le_bytes(),
                "{name} changed"
            );
        }
        assert_eq!(scalar(&r, SCALE), 5e29_f32 as f64);
        assert_eq!(scalar(&r, SKIPPED), 1.0);
        assert_eq!(scalar(&r, TRACKER), 0.0);
    }
}

/// After `interval` clean steps in a row the scale grows; the count starts again.
#[test]
fn the_scale_grows_after_clean_steps() {
    let a = f16_with(Some(LossScale {
        init: 1024.0,
        interval: 2,
        ..LossScale::default()
    }));
    let g = step(SCALED, "", a);
    let inputs = tcc::eager::random_inputs(&g, 1);
    for (steps, scale, tracker) in [(1, 1024.0, 1.0), (2, 2048.0, 0.0), (3, 2048.0, 1.0)] {
        for r in [
            compiled(&g, &inputs, Device::Cpu, steps, a),
            interpreted(&g, &inputs, steps, a),
        ] {
            assert_eq!(scalar(&r, SCALE), scale, "after {steps} steps");
            assert_eq!(scalar(&r, TRACKER), tracker, "after {steps} steps");
            assert_eq!(scalar(&r, SKIPPED), 0.0);
        }
    }
}

/// Gradients of about 1e-8 flush to zero or to a few subnormals in f16 (smallest subnormal
/// 6e-8): without loss scaling most of the step is lost; with it the f16 step follows the
/// f32 one.
#[test]
fn f16_gradients_that_underflow_train_with_loss_scaling() {
    let src = SCALED.replace("adam(lr: 0.01)", "sgd(lr: 1e4)");
    let f32_graph = step(&src, "", Amp::default());
    let inputs = tcc::eager::random_inputs(&f32_graph, 1);
    let start =
        compiled(&f32_graph, &inputs, Device::Cpu, 0, Amp::default()).persistent["w"].to_f64();
    let moved = |r: &StepResult| -> Vec<f64> {
        r.persistent["w"]
            .to_f64()
            .iter()
            .zip(&start)
            .map(|(a, b)| a - b)
            .collect()
    };
    let reference = moved(&compiled(
        &f32_graph,
        &inputs,
        Device::Cpu,
        1,
        Amp::default(),
    ));
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(
        norm(&reference) > 1e-3,
        "the f32 step barely moves: {}",
        norm(&reference)
    );

    let plain = f16_with(None);
    let g = step(&src, "", plain);
    let unscaled = moved(&compiled(&g, &inputs, Device::Cpu, 1, plain));
    let lost: Vec<f64> = unscaled
        .iter()
        .zip(&reference)
        .map(|(a, b)| a - b)
        .collect();
    let e = norm(&lost) / norm(&reference);
    assert!(e > 0.5, "f16 without scaling lost only {e:e} of the step");

    let scaled = f16_with(Some(LossScale::default()));
    let g = step(&src, "", scaled);
    for r in [
        compiled(&g, &inputs, Device::Cpu, 1, scaled),
        interpreted(&g, &inputs, 1, scaled),
    ] {
        let d = moved(&r);
        let diff: Vec<f64> = d.iter().zip(&reference).map(|(a, b)| a - b).collect();
        let e = norm(&diff) / norm(&reference);
        assert!(e < 1e-2, "the scaled f16 step differs from f32's by {e:e}");
    }
}

/// A small GPT trained 300 steps on a learnable synthetic task (each target is a fixed
/// function of the token) under `--amp bf16` ends within 2 % of the f32 loss.
#[test]
fn a_small_gpt_trains_under_bf16_like_f32() {
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl"))
        .unwrap()
        .replace("adam(lr: 3e-4)", "adam(lr: 3e-3)");
    let args = "--set B=4 --set T=16 --set D=32 --set H=2 --set L=2 --set V=32";
    let (b, t, v) = (4usize, 16usize, 32i32);
    let tokens: Vec<i32> = (0..b * t).map(|i| ((i * 7 + i / 5) as i32) % v).collect();
    let targets: Vec<i32> = tokens.iter().map(|&x| (x * 5 + 3) % v).collect();
    let inputs = BTreeMap::from([
        ("tokens".to_string(), Tensor::from_i32(vec![b, t], tokens)),
        ("targets".to_string(), Tensor::from_i32(vec![b, t], targets)),
    ]);
    let final_loss = |a: Amp| {
        let g = step(&src, args, a);
        compiled(&g, &inputs, Device::Cpu, 300, a).outputs["loss"].to_f64()[0]
    };
    let f32_loss = final_loss(Amp::default());
    let bf16_loss = final_loss(Amp::named("bf16").unwrap());
    let first = {
        let g = step(&src, args, Amp::default());
        compiled(&g, &inputs, Device::Cpu, 1, Amp::default()).outputs["loss"].to_f64()[0]
    };
    assert!(
        f32_loss < 0.5 * first,
        "f32 did not learn: {first} -> {f32_loss}"
    );
    let e = (bf16_loss - f32_loss).abs() / f32_loss;
    assert!(
        e <= 0.02,
        "bf16 loss {bf16_loss} vs f32 {f32_loss} ({:.1}%)",
        e * 100.0
    );
}

/// The CUDA code of every example under both policies assembles for sm_90 (ptxas of CUDA
/// 13.0, as CI installs it; the GPU tests run the same programs on the device).
#[test]
fn mixed_precision_ptx_assembles() {
    let Some(ptxas) = tcc_tests::ptxas() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "ptxas is missing under CI"
        );
        tcc_tests::skipped(
            "mixed_precision_ptx_assembles",
            "ptxas not found; PTX not assembled",
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("tcc-amp-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for (file, args) in [
        ("examples/mlp.tdsl", "--set B=8 --set D=32"),
        ("examples/cnn.tdsl", "--set B=4 --set C=16 --set S=16"),
        (
            "examples/gpt.tdsl",
            "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
        ),
        ("examples/tiny.tdsl", ""),
    ] {
        let src = std::fs::read_to_string(root().join(file)).unwrap();
        for a in policies() {
            let g = step(&src, args, a);
            let opts = CompileOptions {
                amp: a,
                ..device_options(Device::Cuda(0), true)
            };
            let c = tcc::artifact::compile(&g, &opts).unwrap_or_else(|e| panic!("{file}: {e}"));
            if let Err(e) = tcc_tests::assemble_ptx(&ptxas, &dir, &c.code) {
                failures.push(format!("{file} --amp {}: {e}", a.name()));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A weight gradient is split along `k` by 128×128 tiles, those of the tensor cores for
/// widened 16-bit operands and of the FFMA SGEMM for f32 ones: the cnn's stage-3 gradients
/// (256 × 2304 from 8192 pixels) are 36 tiles, 8 splits (144 of the old 64×64 FFMA tiles
/// split nothing).
#[test]
fn weight_gradients_split_by_128_tiles() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    for a in [Amp::default()].into_iter().chain(policies()) {
        let g = step(&src, "", a);
        let g = match a.dtype {
            Some(low) => amp::apply(&g, low).unwrap(),
            None => g,
        };
        let splits: Vec<usize> = g
            .node_ids()
            .filter(|&n| {
                matches!(g.node(n).op, Op::Conv2dGradWeight { .. })
                    && g.ty(n).dims() == [256, 256, 3, 3]
            })
            .map(|n| tcc::kernel::lower::conv_split_k(&g, n, true))
            .collect();
        assert_eq!(splits, [8; 3], "--amp {}", a.name());
    }
}

/// Under `--amp`, a convolution's weight gradient reads the 16-bit operands the forward
/// convolution and the input gradient read (widened: f32 accumulation, f32 result), and
/// relu's mask in the backward pass tests the 16-bit copy the next convolution read: no
/// f32 activation lives from the forward pass into the backward pass for these.
#[test]
fn weight_gradients_and_relu_masks_read_the_16_bit_copies() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    for a in policies() {
        let low = a.dtype.unwrap();
        let g = step(&src, "--set B=2 --set C=8 --set S=8", a);
        let mixed = amp::apply(&g, low).unwrap();
        let (mut weight_grads, mut masks) = (0, 0);
        for n in mixed.node_ids() {
            let node = mixed.node(n);
            match &node.op {
                Op::Conv2dGradWeight { .. } => {
                    assert_eq!(mixed.ty(n).dtype, DType::F32);
                    for &x in &node.inputs {
                        let widened = matches!(mixed.node(x).op, Op::Cast { to: DType::F32 });
                        assert!(widened, "--amp {}: {:?}", a.name(), node.op);
                        let from = mixed.ty(mixed.node(x).inputs[0]).dtype;
                        assert_eq!(from, low, "--amp {}: {:?}", a.name(), node.op);
                    }
                    weight_grads += 1;
                }
                Op::Binary(tcc::ir::BinaryOp::Gt) if node.backward => {
                    // Where the value has a 16-bit copy, the mask reads it (the last
                    // block's relu feeds the pooling in f32 and has none).
                    let x = node.inputs[0];
                    let copied = mixed
                        .users(x)
                        .iter()
                        .any(|&u| matches!(mixed.node(u).op, Op::Cast { to } if to == low));
                    assert!(
                        !copied,
                        "--amp {}: a mask reads f32 beside its copy",
                        a.name()
                    );
                    masks += usize::from(mixed.ty(x).dtype == low);
                }
                _ => {}
            }
        }
        // 20 convolutions; 17 relus (the stem's, two in each of 8 blocks), all but the
        // last read by a convolution.
        assert_eq!((weight_grads, masks), (20, 16), "--amp {}", a.name());
    }
}

/// Where the 16-bit copies of the cnn's step are made (`passes::amp::reusable`,
/// `forward_16_bit`): each conv weight is cast again for the backward pass (its input
/// gradient reads a backward copy, so no forward copy lives across the turn), while the
/// images' copy, made once, serves the stem's weight gradient too (recasting would keep
/// the f32 images alive instead); a weight gradient widens its 16-bit operands itself
/// (a widening it shared would be stored in f32); and a forward `relu` whose copy a convolution reads is
/// stored only as that copy, so the residual sums read the rounded activation.
#[test]
fn weight_copies_are_made_per_pass_and_activations_stored_once() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    for a in policies() {
        let low = a.dtype.unwrap();
        let g = step(&src, "--set B=2 --set C=8 --set S=8", a);
        let mixed = amp::apply(&g, low).unwrap();
        let leaf = |mut n: tcc::ir::NodeId| loop {
            match mixed.node(n).op {
                Op::Select { .. } | Op::Reshape { .. } | Op::Cast { .. } => {
                    n = mixed.node(n).inputs[0]
                }
                ref op => return op.clone(),
            }
        };
        let (mut grad_inputs, mut image_copies, mut residuals, mut widenings) = (0, 0, 0, 0);
        for n in mixed.node_ids() {
            let node = mixed.node(n);
            match &node.op {
                Op::Conv2dGradInput { .. } => {
                    let w = node.inputs[1];
                    assert!(matches!(mixed.node(w).op, Op::Cast { .. }));
                    assert!(matches!(leaf(w), Op::Param { .. }), "{}", a.name());
                    assert!(
                        mixed.node(w).backward,
                        "--amp {}: a forward weight copy is read backward",
                        a.name()
                    );
                    grad_inputs += 1;
                }
                Op::Cast { to } if *to == low && matches!(leaf(n), Op::Input { .. }) => {
                    image_copies += 1;
                }
                Op::Cast { to: DType::F32 } if mixed.ty(node.inputs[0]).dtype == low => {
                    // A weight gradient's widening is its own.
                    let users = mixed.users(n);
                    let by_weight_gradient = users
                        .iter()
                        .any(|&u| matches!(mixed.node(u).op, Op::Conv2dGradWeight { .. }));
                    if by_weight_gradient {
                        assert_eq!(users.len(), 1, "--amp {}: a shared widening", a.name());
                        widenings += 1;
                    }
                }
                Op::Unary(tcc::ir::UnaryOp::Relu) if !node.backward => {
                    let users = mixed.users(n);
                    let copied = users
                        .iter()
                        .any(|&u| matches!(mixed.node(u).op, Op::Cast { to } if to == low));
                    if copied {
                        assert_eq!(
                            users.len(),
                            1,
                            "--amp {}: an f32 relu beside its copy",
                            a.name()
                        );
                    }
                }
                Op::Binary(tcc::ir::BinaryOp::Add)
                    if !node.backward && mixed.ty(n).dtype == DType::F32 =>
                {
                    // A residual sum reading a widened 16-bit relu output.
                    let rounded = node.inputs.iter().any(|&i| {
                        matches!(mixed.node(i).op, Op::Cast { to: DType::F32 })
                            && matches!(leaf(i), Op::Unary(tcc::ir::UnaryOp::Relu))
                    });
                    residuals += usize::from(rounded);
                }
                _ => {}
            }
        }
        // 19 input gradients (the stem's images take none); one copy of the images; the
        // identity blocks' sums (two in stage 1, one in each later stage) read their
        // rounded input.
        // Two operands of each of the 20 weight gradients.
        assert_eq!(widenings, 40, "--amp {}", a.name());
        assert_eq!(
            (grad_inputs, image_copies, residuals),
            (19, 1, 5),
            "--amp {}",
            a.name()
        );
    }
}

/// The stream-K scratch region (after the plan's buffers) is exactly what the kernels that
/// run stream-K use, which the kernels' offsets decide (`back::ptx::scratch_bytes`): the
/// cnn's f32 step has stream-K convolutions on the SGEMM; under bf16 the same products run
/// on tensor cores and no scratch is reserved (before, the widened weight gradients counted
/// as SGEMMs: 9 MiB of unused scratch at this size, 16.5 MiB at the cnn's own).
#[test]
fn stream_k_scratch_is_what_the_kernels_use() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    for a in [Amp::default(), Amp::named("bf16").unwrap()] {
        let g = step(&src, "--set B=32 --set C=64 --set S=16", a);
        let opts = CompileOptions {
            amp: a,
            ..device_options(Device::Cuda(0), true)
        };
        let c = tcc::artifact::compile(&g, &opts).unwrap();
        let used = c
            .launches
            .iter()
            .map(|l| l.scratch_bytes)
            .max()
            .unwrap_or(0);
        let stream_k = c.code.contains("ld.acquire.gpu");
        assert_eq!(stream_k, a.dtype.is_none(), "--amp {}", a.name());
        assert_eq!(used > 0, stream_k, "--amp {}", a.name());
        // The region is aligned: at least what the kernels use, less than one alignment more.
        let s = c.plan.scratch_bytes;
        assert!(
            s >= used && s < used + 256,
            "--amp {}: {s} for {used}",
            a.name()
        );
    }
}

/// Under `--amp`, the convolutions and both their gradients (channels-last 16-bit
/// activations, weight copies made by a cast) run on tensor cores: `mma.sync` over 16-byte
/// runs of the gathered windows, not FFMA over element gathers. The stem (3 input
/// channels: a tap's run is not 8 channels) keeps the FFMA tiles.
#[test]
fn convolutions_run_on_tensor_cores_under_amp() {
    let src = std::fs::read_to_string(root().join("examples/cnn.tdsl")).unwrap();
    for a in policies() {
        let g = step(&src, "--set B=8", a);
        let opts = CompileOptions {
            amp: a,
            ..device_options(Device::Cuda(0), true)
        };
        let c = tcc::artifact::compile(&g, &opts).unwrap();
        let instr = format!(
            "mma.sync.aligned.m16n8k16.row.col.f32.{0}.{0}.f32",
            a.name()
        );
        let (mut fwd, mut stem, mut grad_input) = (0, 0, 0);
        let (mut grad_weight, mut stem_grad_weight) = (0, 0);
        // Each entry's text starts with its description's comment line.
        for entry in c.code.split("\n// ").skip(1) {
            let on_mma = entry.contains(&instr) && entry.contains("cp.async.cg.shared.global");
            let head = entry.lines().next().unwrap_or("");
            if head.contains("zero fill") {
                continue;
            }
            if head.contains("conv2d_grad_weight ") && on_mma {
                // dy runs along the output channels (A's rows): A's tile is [k][row].
                let a_trans = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16";
                assert!(entry.contains(a_trans), "--amp {}: {head}", a.name());
                grad_weight += 1;
            } else if head.contains("conv2d_grad_weight ") {
                stem_grad_weight += 1;
            } else if head.contains("conv2d_grad_input ") {
                assert!(on_mma, "--amp {}: {head}", a.name());
                grad_input += 1;
            } else if head.contains("conv2d ") && on_mma {
                // A forward conv's weight runs along k: B's tile is [column][k].
                let b_kmajor = "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
                assert!(entry.contains(b_kmajor), "--amp {}: {head}", a.name());
                fwd += 1;
            } else if head.contains("conv2d ") {
                stem += 1;
            }
        }
        // 20 convolutions; the stem's input gradient is not needed (images take none).
        let counts = (fwd, stem, grad_input, grad_weight, stem_grad_weight);
        assert_eq!(counts, (19, 1, 19, 19, 1), "--amp {}", a.name());
    }
}

/// gpt's step for CUDA under `a` at the sizes of `args`, through fusion.
fn fused_gpt(args: &str, a: Amp) -> tcc::pipeline::Kernels {
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl")).unwrap();
    let g = step(&src, args, a);
    let opts = CompileOptions {
        amp: a,
        ..device_options(Device::Cuda(0), true)
    };
    match tcc_tests::run_stages(&g, "outputs", "fuse", opts).unwrap() {
        tcc::pipeline::Product::Kernels(k) => k,
        p => panic!("fuse gave {}", p.form()),
    }
}

/// Mixed precision's casts do not let a row sum into a matmul's epilogue, where it would be
/// recomputed for every element (gpt's attention backward `dS = P * (dP - sum(dO * O))`
/// took 1.75 ms a layer on an H100 that way, against 0.39 ms).
#[test]
fn no_reduction_is_fused_into_a_matmul_epilogue_under_amp() {
    for a in policies() {
        let k = fused_gpt(
            "--set L=1 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
            a,
        );
        for kernel in &k.fused.kernels {
            let has =
                |f: &dyn Fn(&Op) -> bool| kernel.nodes.iter().any(|&n| f(&k.graph.node(n).op));
            let both =
                has(&|op| matches!(op, Op::MatMul)) && has(&|op| matches!(op, Op::Reduce { .. }));
            assert!(!both, "--amp {}: {}", a.name(), kernel.describe);
        }
    }
}

/// A computed value a tensor-core matmul reads transposed on its left is cast to 16 bits as
/// it lies and read through the swap: every weight gradient's activations, and the logits' gradient
/// (by the output weight's gradient, sharing the cast the input gradient reads). Only
/// params (weights, made once a step) keep transposed copies there: a transposing cast
/// reads across rows (0.21 ms a layer for gpt's `pᵀ` on an H100).
#[test]
fn transposed_16_bit_operands_are_cast_before_their_swap() {
    for a in policies() {
        let k = fused_gpt(
            "--set L=1 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
            a,
        );
        let g = &k.graph;
        // The node below a chain of views.
        let below_views = |mut n: tcc::ir::NodeId| loop {
            match g.node(n).op {
                Op::Reshape { .. } | Op::Permute { .. } | Op::Select { .. } | Op::Slice { .. } => {
                    n = g.node(n).inputs[0]
                }
                _ => return n,
            }
        };
        let mut read_swapped = 0;
        for n in g.node_ids() {
            if !matches!(g.node(n).op, Op::MatMul) {
                continue;
            }
            let lhs = g.node(n).inputs[0];
            match g.node(lhs).op {
                Op::Permute { .. } if matches!(g.node(below_views(lhs)).op, Op::Cast { .. }) => {
                    read_swapped += 1
                }
                Op::Cast { to } if to != DType::F32 => {
                    let x = g.node(lhs).inputs[0];
                    if matches!(g.node(x).op, Op::Permute { .. }) {
                        let leaf = &g.node(below_views(x)).op;
                        assert!(
                            matches!(leaf, Op::Param { .. }),
                            "--amp {}: a transposing cast of {leaf:?}",
                            a.name()
                        );
                    }
                }
                _ => {}
            }
        }
        // The output weight's gradient (from the logits' gradient) and the weight
        // gradients whose activations are f32: the two layer norms' outputs (the gelu's
        // and the attention's are 16-bit already, read swapped with no cast). The value
        // and key gradients are the flash-attention gradient kernel's, which reads `q`
        // and `dout` as they lie.
        assert_eq!(read_swapped, 3, "--amp {}", a.name());
    }
}

/// The fused attention kernel reads its 16-bit queries, keys and values as they lie and
/// widens them as it loads them: no kernel makes their f32 copies (36 kernels of gpt's
/// step under `--amp bf16`, 0.2 ms on an H100). Its output is 16-bit (read so by the
/// output projection and its weight gradient, with no cast kernel), its row statistics
/// f32. Its gradient is two flash-attention kernels a layer.
#[test]
fn fused_attention_reads_its_16_bit_operands() {
    for a in policies() {
        let k = fused_gpt(
            "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
            a,
        );
        let mut fused = 0;
        let mut grads = 0;
        for kernel in &k.fused.kernels {
            // The backward pass: flash-attention gradient kernels (`dq`, then `dk` and
            // `dv`) reading the 16-bit operands and output gradient, and the f32 row
            // statistics; no kernel stores the `[B, H, T, T]` probabilities or score
            // gradients.
            for s in &kernel.stores {
                let probabilities = k.graph.ty(s.buf).dims() == [2, 2, 64, 64]
                    && !matches!(k.graph.node(s.buf).op, Op::AttentionGrad { .. });
                assert!(!probabilities, "{}", kernel.describe);
            }
            if let Some(gr) = kernel.attention.as_ref().and_then(|at| at.grad.as_ref()) {
                let at = kernel.attention.as_ref().unwrap();
                let ops = [Some(&at.q), Some(&at.k), at.v.as_ref(), Some(&gr.dout)];
                for o in ops.into_iter().flatten().chain(at.o.as_ref()) {
                    assert_eq!(o.dtype, a.dtype.unwrap(), "{}", kernel.describe);
                }
                assert_eq!([gr.lse.dtype, gr.delta.dtype], [DType::F32; 2]);
                assert_eq!(at.lse, None);
                grads += 1;
                continue;
            }
            if let Some(at) = &kernel.attention {
                let ops = [Some(&at.q), Some(&at.k), at.v.as_ref()];
                for o in ops.into_iter().flatten().chain(at.o.as_ref()) {
                    assert_eq!(o.dtype, a.dtype.unwrap(), "{}", kernel.describe);
                }
                assert_eq!(at.lse.as_ref().map(|l| l.dtype), Some(DType::F32));
                fused += 1;
                continue;
            }
            // No kernel only widens a value for the attention (a transposed copy of `k`
            // for the backward pass's `q kᵀ`, views only, is no widening).
            let widening =
                |n: &tcc::ir::NodeId| matches!(k.graph.node(*n).op, Op::Cast { to: DType::F32 });
            let only_casts = kernel.nodes.iter().any(widening)
                && kernel.nodes.iter().all(|&n| {
                    let op = &k.graph.node(n).op;
                    op.is_view_candidate() || widening(&n)
                });
            let for_attention = kernel.nodes.iter().any(|&n| {
                k.graph
                    .users(n)
                    .iter()
                    .any(|&u| matches!(k.graph.node(u).op, Op::Attention { .. }))
            });
            assert!(!(only_casts && for_attention), "{}", kernel.describe);
        }
        assert_eq!(fused, 2, "--amp {}: one attention kernel a layer", a.name());
        assert_eq!(grads, 4, "--amp {}: two gradient kernels a layer", a.name());
    }
}

/// The CPU back end rounds f32 to bf16 inline (stores and rounding inside a kernel): bit for
/// bit what `half::bf16::from_f32` gives (the runtime's helper), ties to even, infinities,
/// overflow to infinity, subnormals, signed zeros, and a NaN stays a NaN.
#[test]
fn cpu_bf16_rounding_is_exact() {
    let one = 1.0f32.to_bits();
    let mut values: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        f32::from_bits(one + 0x8000),  // a tie: to even (1.0)
        f32::from_bits(one + 0x18000), // a tie: to even (up)
        f32::from_bits(one + 0x8001),  // just above a tie: up
        f32::from_bits(one + 0x7FFF),  // just below a tie: down
        f32::MAX,                      // rounds to infinity
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
        1e-40, // subnormal
        -3.3e38,
        65504.0,
        f32::NAN,
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..4000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        values.push(f32::from_bits((state >> 32) as u32));
    }
    let n = values.len();
    // `x * 1` keeps the value and makes the cast part of a computed kernel; `r` also rounds
    // inside the kernel (a 16-bit value read again as f32).
    let src = format!(
        "model m {{\n input x: f32[{n}]\n let y = cast(x * 1.0, bf16)\n let r = cast(y, f32) * 1.0\n output y, r\n}}\n"
    );
    let g = step(&src, "", Amp::default());
    let x = Tensor::from_f64(
        DType::F32,
        vec![n],
        values.iter().map(|&v| f64::from(v)).collect(),
    );
    let inputs = BTreeMap::from([("x".to_string(), x)]);
    let got = compiled(&g, &inputs, Device::Cpu, 1, Amp::default());
    let y = got.outputs["y"].to_le_bytes();
    let r = got.outputs["r"].to_le_bytes();
    for (i, &v) in values.iter().enumerate() {
        let want = half::bf16::from_f32(v);
        let bits = u16::from_le_bytes([y[2 * i], y[2 * i + 1]]);
        let back = f32::from_le_bytes([r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]]);
        if v.is_nan() {
            assert!(
                half::bf16::from_bits(bits).is_nan() && back.is_nan(),
                "NaN at {i}"
            );
        } else {
            assert_eq!(bits, want.to_bits(), "{v:e} ({:#010x})", v.to_bits());
            assert_eq!(back.to_bits(), want.to_f32().to_bits(), "{v:e} read back");
        }
    }
}
