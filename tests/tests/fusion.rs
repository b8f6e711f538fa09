//! Fusion cases: `tests/cases/fusion/*.tdsl`, each with an `// expect-kernels: N` header
//! checked beside a snapshot of its kernels, and each run on the CPU against the eager
//! interpreter.

use tcc::kernel::fuse::{fuse, FuseOptions};
use tcc::kernel::print::print_kernels;
use tcc_tests::{compile_pipeline, cpu_steps, eager_steps, header, rel_err, tdsl_files};

#[test]
fn fusion_cases() {
    let files = tdsl_files("tests/cases/fusion");
    assert!(files.len() >= 7, "fusion cases are missing");
    for f in files {
        let src = std::fs::read_to_string(&f).unwrap();
        let name = f.file_stem().unwrap().to_string_lossy().to_string();
        let want: usize = header(&src, "expect-kernels")
            .unwrap_or_else(|| panic!("{name}: no `// expect-kernels:` header"))
            .parse()
            .unwrap();
        let g = compile_pipeline(&src, &Default::default()).unwrap();
        let fused = fuse(&g, FuseOptions::default()).unwrap();
        let text = print_kernels(&fused.kernels, None);
        assert_eq!(
            fused.kernels.len(),
            want,
            "{name}: expected {want} kernels, got:\n{text}"
        );
        insta::assert_snapshot!(format!("fusion_{name}"), text);
        // Unfused, every op is a kernel of its own.
        let unfused = fuse(
            &g,
            FuseOptions {
                fuse: false,
                channels_last: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(unfused.kernels.len() >= fused.kernels.len(), "{name}");
        // Same numbers as the interpreter.
        tcc_tests::assert_cpu_like_eager(&g, 3, 1e-5, &name);
    }
}

/// The layout pass: channels-last intermediates for a convolution chain, converting only at
/// the chain's ends (snapshots of both layouts), with the same numbers as the interpreter.
#[test]
fn channels_last_conv_chain() {
    let src = std::fs::read_to_string(tcc_tests::root().join("tests/cases/layout/conv_chain.tdsl"))
        .unwrap();
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    let nchw = fuse(&g, FuseOptions::default()).unwrap();
    let nhwc = fuse(
        &g,
        FuseOptions {
            fuse: true,
            channels_last: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(nchw.layouts.is_empty());
    assert!(
        !nhwc.layouts.is_empty(),
        "conv-chain intermediates go channels-last"
    );
    // Same kernels, no copies added: conversion happens inside the boundary kernels.
    assert_eq!(nchw.kernels.len(), nhwc.kernels.len());
    for (n, p) in &nhwc.layouts {
        assert_eq!(p, &vec![0, 2, 3, 1]);
        assert_eq!(g.ty(*n).rank(), 4);
        assert!(!g.outputs.iter().any(|(_, o)| o == n), "outputs keep NCHW");
    }
    insta::assert_snapshot!("layout_nchw", print_kernels(&nchw.kernels, None));
    insta::assert_snapshot!("layout_nhwc", print_kernels(&nhwc.kernels, None));
    // Numbers: compile with channels-last and compare with the interpreter.
    let inputs = tcc::eager::random_inputs(&g, 2);
    let want = eager_steps(&g, &inputs, 1, 0).unwrap();
    let c = tcc::artifact::compile(
        &g,
        &tcc::artifact::CompileOptions {
            fuse: FuseOptions {
                fuse: true,
                channels_last: true,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .unwrap();
    let img = tcc::artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    let bytes = tcc::artifact::write_artifact(&c, tcc::artifact::Target::Cpu, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    for (name, t) in &inputs {
        s.set_input_bytes(name, &t.to_le_bytes()).unwrap();
    }
    s.run().unwrap();
    for (name, n) in &g.outputs {
        let got =
            tcc::eager::Tensor::from_le_bytes(g.ty(*n).clone(), s.output_bytes(name).unwrap())
                .unwrap();
        let e = rel_err(&got, &want.outputs[name]);
        assert!(e <= 1e-5, "output `{name}` differs by {e:e}");
    }
}

/// Attention's score gradient is a matmul epilogue: the softmax's row sums come from the
/// output and its gradient (`[.., T, E]`), so no kernel other than the forward softmax
/// reduces over the `[.., T, T]` scores, and the matmul computing `dp` also subtracts,
/// multiplies and masks.
#[test]
fn attention_score_gradient_is_a_matmul_epilogue() {
    let src =
        std::fs::read_to_string(tcc_tests::root().join("tests/cases/fusion/attention_grad.tdsl"))
            .unwrap();
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    let fused = fuse(&g, FuseOptions::default()).unwrap();
    let scores = [2usize, 16, 16];
    let ops = |k: &tcc::kernel::Kernel| -> Vec<String> {
        k.nodes
            .iter()
            .map(|&n| format!("{:?}", g.node(n).op))
            .collect()
    };
    let reducing: Vec<&tcc::kernel::Kernel> = fused
        .kernels
        .iter()
        .filter(|k| k.domain == scores && k.matmul.is_none())
        .filter(|k| ops(k).iter().any(|o| o.starts_with("Reduce")))
        .collect();
    assert_eq!(reducing.len(), 1, "only the forward softmax reduces scores");
    assert!(ops(reducing[0]).iter().any(|o| o.contains("Max")));
    let epilogue = fused.kernels.iter().any(|k| {
        let o = ops(k);
        k.matmul.is_some()
            && k.domain == scores
            && o.iter().any(|o| o.contains("Sub"))
            && o.iter().any(|o| o == "Where")
    });
    assert!(epilogue, "no matmul computes dp with the ds epilogue");
}

/// An optimizer's new moments are computed and stored by the kernel of the new parameter
/// that reads them where they are pointwise (one kernel an update: Adam's `m`, `v` and
/// `w`, momentum's `v` and `w`). A stacked parameter is held as one param a layer (`w[l]`),
/// each updated so, and its gradient is never a concat copied first. The CPU's parameters
/// and moments after three steps are the interpreter's.
#[test]
fn optimizer_moments_are_stored_by_the_parameter_update() {
    for (opt, stores) in [("adam(lr: 0.01)", 3), ("sgd(lr: 0.1, momentum: 0.9)", 2)] {
        let src = format!(
            "model m {{
                input x: f32[4, 8]
                param w: f32[3, 8, 8] = normal(0.0, 0.3)
                param b: f32[8] = zeros
                let h = x
                for l in 0..3 {{
                    h = tanh(h @ w[l] + b)
                }}
                let loss = mean(h * h)
                output loss
                train {opt} minimize loss
            }}"
        );
        let g = compile_pipeline(&src, &Default::default()).unwrap();
        let fused = fuse(&g, FuseOptions::default()).unwrap();
        let text = print_kernels(&fused.kernels, None);
        // One kernel writes each of `w`'s layers' new value and its state's (`b`'s
        // moments stay in the kernels summing its gradient).
        let w = g
            .params
            .iter()
            .copied()
            .filter(|&p| {
                matches!(&g.node(p).op, tcc::ir::Op::Param { name, .. } if name.starts_with("w["))
            })
            .collect::<Vec<_>>();
        assert_eq!(w.len(), 3);
        assert!(g.stacks.iter().any(|s| s.name == "w" && s.pieces == w));
        for p in w {
            let value = g
                .updates
                .iter()
                .find(|&&(t, _)| t == p)
                .map(|&(_, v)| v)
                .unwrap();
            let k = fused
                .kernels
                .iter()
                .find(|k| k.stores.iter().any(|s| s.buf == value))
                .unwrap();
            let updated: Vec<tcc::ir::NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
            assert!(k.stores.iter().all(|s| updated.contains(&s.buf)), "{text}");
            // Each of its states' new values is stored there, or (momentum, whose gradient
            // is a layer's own) by the epilogue of the product computing the gradient.
            let name = match &g.node(p).op {
                tcc::ir::Op::Param { name, .. } => name.clone(),
                _ => unreachable!(),
            };
            let states: Vec<tcc::ir::NodeId> = g
                .updates
                .iter()
                .filter(|&&(t, _)| {
                    matches!(&g.node(t).op, tcc::ir::Op::State { name: n, .. } if n.starts_with(&format!("{name}.")))
                })
                .map(|&(_, v)| v)
                .collect();
            assert_eq!(states.len(), stores - 1, "{opt}");
            for v in states {
                let j = fused
                    .kernels
                    .iter()
                    .find(|j| j.stores.iter().any(|s| s.buf == v))
                    .unwrap();
                assert!(
                    j.name == k.name || j.matmul.is_some(),
                    "{opt}: {name}'s state has a kernel of its own ({})\n{text}",
                    j.name
                );
            }
        }
        let concats = fused
            .kernels
            .iter()
            .filter(|k| {
                k.nodes
                    .last()
                    .is_some_and(|&n| g.node(n).op.name() == "concat")
            })
            .count();
        assert_eq!(concats, 0, "{opt}: the stacked gradient is copied\n{text}");
        let inputs = tcc::eager::random_inputs(&g, 3);
        let want = eager_steps(&g, &inputs, 3, 0).unwrap();
        let got = cpu_steps(&g, &inputs, 3, 0, true).unwrap();
        for (name, t) in &want.outputs {
            let e = rel_err(&got.outputs[name], t);
            assert!(e <= 1e-5, "{opt}: output `{name}` differs by {e:e}");
        }
        assert_eq!(got.persistent.len(), want.persistent.len());
        for (name, t) in &want.persistent {
            let e = rel_err(&got.persistent[name], t);
            assert!(e <= 1e-5, "{opt}: `{name}` differs by {e:e}");
        }
    }
}

/// For CUDA, the pieces of a concat that are kernels' roots, read only through reshapes and
/// permutes (attention's `q`, `k` and `v` gradients, heads merged, into the gradient of the
/// fused projection), are stored straight into the concat's buffer: no kernel copies them.
#[test]
fn concat_pieces_are_stored_in_place_for_cuda() {
    let src = "fn heads(t: f32[2, 16, 32]) -> f32[2, 4, 16, 8] {
    permute(reshape(t, [2, 16, 4, 8]), [0, 2, 1, 3])
}
model m {
 input x: f32[2, 16, 32]
 param wqkv: f32[32, 96] = normal(0.0, 0.2)
 let (q, k, v) = split(x @ wqkv, 3, axis: -1)
 let a = attention(heads(q), heads(k), heads(v), causal: true)
 let loss = mean(a * a)
 output loss
 train sgd(lr: 0.1) minimize loss
}
";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    for (target, pieces, writers) in [
        (tcc::artifact::Target::Cuda, true, 3),
        (tcc::artifact::Target::Cpu, false, 1),
    ] {
        let opts = tcc::artifact::CompileOptions {
            target,
            ..Default::default()
        };
        let compiled = tcc::artifact::compile(&g, &opts).unwrap();
        let cg = &compiled.graph;
        let concat: Vec<tcc::ir::NodeId> = cg
            .node_ids()
            .filter(|&n| cg.node(n).op.name() == "concat")
            .collect();
        assert_eq!(concat.len(), 1, "the q, k and v gradients' concat");
        let c = concat[0];
        let kernels = &compiled.fused.kernels;
        let text = print_kernels(kernels, None);
        let writing: Vec<&tcc::kernel::Kernel> = kernels
            .iter()
            .filter(|k| k.stores.iter().any(|s| s.buf == c))
            .collect();
        assert_eq!(writing.len(), writers, "{target:?}\n{text}");
        let copies = kernels.iter().any(|k| k.nodes.contains(&c));
        assert_eq!(
            copies, !pieces,
            "{target:?}: a kernel computes the concat\n{text}"
        );
        if pieces {
            // Each is a matmul with its epilogue, storing only there.
            for k in writing {
                assert!(
                    k.matmul.is_some() && k.stores.len() == 1,
                    "{}\n{text}",
                    k.name
                );
            }
        }
    }
}

/// A matmul operand that is a copy (`reshape(permute(a))` merges axes that are not
/// adjacent in memory) read again through more views (its transpose, by a second matmul)
/// is copied once: the second matmul reads the first copy in place instead of asking for
/// a copy of its own view (`fuse::beneath_first`). Both give the interpreter's values.
#[test]
fn a_view_of_a_copied_operand_reads_the_copy() {
    let src = "model m {
        input x: f32[2, 4, 8, 16]
        input w: f32[64, 32]
        input dy: f32[2, 8, 32]
        let a = tanh(x)
        let merged = reshape(permute(a, [0, 2, 1, 3]), [2, 8, 64])
        let y = merged @ w
        let gw = transpose(reshape(merged, [16, 64])) @ reshape(dy, [16, 32])
        output y, gw
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    for target in [tcc::artifact::Target::Cuda, tcc::artifact::Target::Cpu] {
        let opts = tcc::artifact::CompileOptions {
            target,
            ..Default::default()
        };
        let planned = tcc::artifact::plan_step(&g, &opts).unwrap();
        // One kernel computes and copies `merged`; the two matmuls read it.
        let kinds: Vec<&str> = planned
            .fused
            .kernels
            .iter()
            .map(|k| k.describe.as_str())
            .collect();
        let copies = planned
            .fused
            .kernels
            .iter()
            .filter(|k| k.matmul.is_none())
            .count();
        assert_eq!((kinds.len(), copies), (3, 1), "{target:?}: {kinds:?}");
    }
    tcc_tests::assert_cpu_like_eager(&g, 5, 1e-5, "a view of a copy");
}

/// Cross-entropy's `logits - max(logits)` is read by the loss and by the gradient: the row
/// maxima get a buffer and each reader recomputes the difference, so no second buffer the
/// size of the logits is stored beside them (only the logits and their gradient, which may
/// be stored over them), and the numbers are the interpreter's.
#[test]
fn shifted_logits_are_recomputed_from_stored_row_maxima() {
    // As gpt's head: `[B, T, V]` logits read through a reshape to `[B * T, V]`.
    let src = "model m {
        input x: f32[8, 64, 32]
        input labels: i32[8, 64]
        param w: f32[32, 1024] = normal(0.0, 0.1)
        let logits = x @ w
        let loss = cross_entropy(reshape(logits, [512, 1024]), reshape(labels, [512]))
        output loss
        train sgd(lr: 0.1) minimize loss
    }";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let fused = fuse(&g, FuseOptions::default()).unwrap();
    let logits_sized: Vec<_> = fused
        .materialized
        .iter()
        .filter(|&&n| !g.node(n).op.is_leaf() && g.ty(n).shape.numel() == 512 * 1024)
        .map(|&n| g.node(n).op.name())
        .collect();
    assert!(
        logits_sized.len() <= 2,
        "logits-sized buffers: {logits_sized:?}\n{}",
        print_kernels(&fused.kernels, None)
    );
    tcc_tests::assert_cpu_like_eager(&g, 3, 1e-5, "cross-entropy");
}

/// On the CPU, convolutions and both their gradients are implicit GEMMs (blocks gathered
/// for the runtime's `sgemm_gathered`, `back::clif`'s `gather_matmul`), in either layout, a
/// channels-first output included, and a weight gradient whose pixels overflow the panel
/// budget is split along them; every step agrees with the interpreter.
#[test]
fn cpu_convolutions_are_implicit_gemms() {
    let src = "const N = 2\nconst C = 8\nconst S = 24\n\
        model m {\n\
            input x: f32[N, 3, S, S]\n\
            param w1: f32[C, 3, 3, 3] = normal(0.0, 0.3)\n\
            param w2: f32[C, C, 3, 3] = normal(0.0, 0.2)\n\
            param w3: f32[C, C, 1, 1] = normal(0.0, 0.3)\n\
            let h = relu(conv2d(x, w1, padding: 1))\n\
            let y = conv2d(relu(conv2d(h, w2, stride: 2, padding: 1)), w3)\n\
            let loss = mean(y * y)\n\
            output loss, y\n\
            train sgd(lr: 0.1) minimize loss\n\
        }\n";
    let g = compile_pipeline(src, &Default::default()).unwrap();
    let inputs = tcc::eager::random_inputs(&g, 3);
    let want = eager_steps(&g, &inputs, 3, 0).unwrap();
    for channels_last in [false, true] {
        let opts = tcc::artifact::CompileOptions {
            fuse: FuseOptions {
                fuse: true,
                channels_last,
                ..Default::default()
            },
            ..Default::default()
        };
        let c = tcc::artifact::compile(&g, &opts).unwrap();
        let kernels = &c.fused.kernels;
        let convs: Vec<_> = kernels
            .iter()
            .filter(|k| k.describe.contains("conv2d") && !k.describe.starts_with("zero fill"))
            .collect();
        assert!(convs.len() >= 8, "{}", print_kernels(kernels, None));
        for k in &convs {
            let gemm = k.matmul.as_ref().is_some_and(|m| m.a.gather.is_some());
            assert!(gemm, "not an implicit GEMM on the CPU: {}", k.describe);
            // Threads split a weight gradient's (wide) columns into panels and the other
            // convolutions' (tall) rows into row tiles, so that no thread packs the larger
            // operand whole.
            let mm = k.matmul.as_ref().unwrap();
            let p = mm.cpu_panels().unwrap();
            let grad_w = k.describe.contains("conv2d_grad_weight");
            assert_eq!(p.by_panels, grad_w && mm.m < mm.n, "{}: {p:?}", k.describe);
            assert_eq!(mm.cpu_extent() as i64, p.extent());
        }
        let got = steps_of(&c, &inputs, 3, 1);
        for (name, t) in &want.outputs {
            let e = rel_err(&got[name], t);
            assert!(
                e <= 1e-4,
                "channels_last {channels_last}: `{name}` differs by {e:e}"
            );
        }
        // Each output element is computed by one thread the same way, whatever the count.
        assert_eq!(steps_of(&c, &inputs, 3, 3), got, "1 and 3 threads differ");
    }
    // A weight gradient over more pixels than a panel of its columns holds is split.
    let big = "const N = 4\nconst S = 64\n\
        model m {\n\
            input x: f32[N, 16, S, S]\n\
            param w: f32[16, 16, 3, 3] = normal(0.0, 0.1)\n\
            let y = conv2d(x, w, padding: 1)\n\
            let loss = mean(y * y)\n\
            output loss\n\
            train sgd(lr: 0.1) minimize loss\n\
        }\n";
    let g = compile_pipeline(big, &Default::default()).unwrap();
    let c = tcc::artifact::compile(&g, &Default::default()).unwrap();
    let split = c
        .fused
        .kernels
        .iter()
        .filter_map(|k| k.matmul.as_ref())
        .any(|m| m.split_k > 1 && m.a.gather.is_some());
    assert!(split, "{}", print_kernels(&c.fused.kernels, None));
    tcc_tests::assert_cpu_like_eager(&g, 5, 1e-4, "split weight gradient");
    // Windows past CPU_MAX_K (3x3 over 512 channels: ResNet's last stage) up to
    // CPU_MAX_WINDOW_K: the forward convolution and the input gradient are implicit GEMMs.
    let deep = "model m {\n\
            input x: f32[2, 8, 5, 5]\n\
            param w0: f32[8, 8, 1, 1] = normal(0.0, 0.3)\n\
            param w1: f32[512, 8, 3, 3] = normal(0.0, 0.1)\n\
            param w2: f32[8, 512, 3, 3] = normal(0.0, 0.02)\n\
            let h = conv2d(conv2d(x, w0), w1, padding: 1)\n\
            let y = conv2d(h, w2, padding: 1)\n\
            let loss = mean(y * y)\n\
            output loss\n\
            train sgd(lr: 0.1) minimize loss\n\
        }\n";
    let g = compile_pipeline(deep, &Default::default()).unwrap();
    let c = tcc::artifact::compile(&g, &Default::default()).unwrap();
    for op in ["conv2d %", "conv2d_grad_input"] {
        let deep = c.fused.kernels.iter().any(|k| {
            k.describe.contains(op)
                && k.matmul
                    .as_ref()
                    .is_some_and(|m| m.a.gather.is_some() && m.k > tcc::kernel::lower::CPU_MAX_K)
        });
        assert!(deep, "{op}: {}", print_kernels(&c.fused.kernels, None));
    }
    tcc_tests::assert_cpu_like_eager(&g, 3, 1e-4, "a 4608-deep window");
}

/// Outputs of `steps` compiled CPU steps of `c` fed `inputs`, on `threads` threads.
fn steps_of(
    c: &tcc::artifact::Compiled,
    inputs: &std::collections::BTreeMap<String, tcc::eager::Tensor>,
    steps: usize,
    threads: usize,
) -> std::collections::BTreeMap<String, tcc::eager::Tensor> {
    let img = tcc::artifact::persistent_image(c, 0, &Default::default()).unwrap();
    let bytes = tcc::artifact::write_artifact(c, tcc::artifact::Target::Cpu, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
    let mut s = tcc_runtime::Session::new(&model, tcc_runtime::Device::Cpu).unwrap();
    s.set_threads(threads).unwrap();
    for (name, t) in inputs {
        s.set_input_bytes(name, &t.to_le_bytes()).unwrap();
    }
    for _ in 0..steps {
        s.run().unwrap();
    }
    c.graph
        .outputs
        .iter()
        .map(|(name, n)| {
            let ty = c.graph.ty(*n).clone();
            let t = tcc::eager::Tensor::from_le_bytes(ty, s.output_bytes(name).unwrap()).unwrap();
            (name.clone(), t)
        })
        .collect()
}

/// On CUDA, a convolution's weight gradient whose reader is an optimizer's update (an
/// elementwise reader of a state or param of its shape: momentum, weight decay) keeps a
/// kernel of its own, with no epilogue; the update's kernel computes the momentum. As the
/// epilogue, the param's order slowed the cnn's weight-gradient kernels by a quarter.
#[test]
fn a_weight_gradient_read_by_an_update_has_no_epilogue() {
    for opt in [
        "sgd(lr: 0.1, momentum: 0.9)",
        "sgd(lr: 0.1, momentum: 0.9, weight_decay: 0.01)",
    ] {
        let src = format!(
            "model m {{
                input x: f32[2, 4, 8, 8]
                param w: f32[8, 4, 3, 3] = normal(0.0, 0.3)
                let y = conv2d(x, w, padding: 1)
                let loss = mean(y * y)
                output loss
                train {opt} minimize loss
            }}"
        );
        let g = compile_pipeline(&src, &Default::default()).unwrap();
        let cuda = FuseOptions {
            implicit_gemm: true,
            conv_gemm: true,
            ..Default::default()
        };
        let fused = fuse(&g, cuda).unwrap();
        let gw = g
            .node_ids()
            .find(|&n| matches!(g.node(n).op, tcc::ir::Op::Conv2dGradWeight { .. }))
            .unwrap();
        let k = fused
            .kernels
            .iter()
            .find(|k| k.nodes.contains(&gw))
            .unwrap();
        assert_eq!(k.nodes.last(), Some(&gw), "{opt}: {}", k.describe);
    }
}
