//! Every PTX module the test suite generates assembles with `ptxas -arch=sm_90` (the GPU
//! machine's CUDA 13.0), or `-arch=sm_90a` for the modules whose `.target` is sm_90a
//! (Hopper's `wgmma`). Without ptxas the test prints a notice and passes, except under
//! CI (`CI` set), where `.ci/run` installs it and its absence is a failure.

use tcc::artifact::{compile, CompileOptions, Target};
use tcc::front::Options;
use tcc::kernel::fuse::FuseOptions;
use tcc_tests::{
    assemble_ptx, builtin_program, compile_pipeline, gpu_path_cases, integer_program,
    options_from_args, ptxas, root, tdsl_files, tensor_core_attention, BUILTIN_CASES,
    IMPLICIT_GEMM_CONVS, INTEGER_CASES,
};

fn programs() -> Vec<(String, String, Options)> {
    let mut v = Vec::new();
    for (ex, set) in [
        ("tiny", ""),
        ("mlp", "--set B=8 --set D=32"),
        ("cnn", "--set B=2 --set C=4 --set S=8"),
        (
            "gpt",
            "--set L=2 --set D=16 --set H=2 --set T=8 --set B=2 --set V=32",
        ),
        ("mlp", ""),
    ] {
        let src = std::fs::read_to_string(root().join(format!("examples/{ex}.tdsl"))).unwrap();
        v.push((format!("{ex} {set}"), src, options_from_args(set)));
    }
    // TF32 on wgmma (assembled when `assemble_both` builds with TF32): a B transposed in
    // shared memory on 128×256 tiles, both operands on 128×256 (three stages) and 128×128.
    v.push((
        "tf32 wgmma".to_string(),
        "model m {\n input x: f32[1260, 200]\n input w: f32[200, 3580]\n input u: f32[200, 1260]\n input v: f32[200, 300]\n let a = x @ w\n let b = transpose(u) @ w\n let c = transpose(u) @ v\n output a, b, c\n}\n".to_string(),
        Options::default(),
    ));
    for dir in ["tests/cases/fusion", "tests/cases/layout"] {
        for f in tdsl_files(dir) {
            let src = std::fs::read_to_string(&f).unwrap();
            v.push((f.display().to_string(), src, Options::default()));
        }
    }
    for (_, cases) in BUILTIN_CASES {
        for (expr, wrt) in cases.iter() {
            v.push((
                expr.to_string(),
                builtin_program(expr, wrt).unwrap(),
                Options::default(),
            ));
        }
    }
    for e in INTEGER_CASES {
        v.push((e.to_string(), integer_program(e), Options::default()));
    }
    for (what, src, _) in gpu_path_cases() {
        v.push((what, src, Options::default()));
    }
    v.push((
        "implicit-GEMM convolutions".to_string(),
        IMPLICIT_GEMM_CONVS.to_string(),
        Options::default(),
    ));
    // The f32 flash-attention gradient kernels (assembled when `assemble_both` builds with
    // them): ragged tiles, head widths 64 and 32, and 128 (the most shared memory).
    for (d, e, causal) in [(64, 32, true), (128, 128, false)] {
        v.push((
            format!("f32 attention gradients d={d} e={e}"),
            format!(
                "model m {{\n input w: f32[2, 3, 70, {e}]\n param q: f32[2, 3, 70, {d}] = normal(0.0, 1.0)\n param k: f32[2, 3, 90, {d}] = normal(0.0, 1.0)\n param v: f32[2, 3, 90, {e}] = normal(0.0, 1.0)\n let loss = mean(attention(q, k, v, causal: {causal}) * w)\n output loss\n train sgd(lr: 0.1) minimize loss\n}}\n"
            ),
            Options::default(),
        ));
    }
    for d in ["f16", "bf16"] {
        v.push((
            format!("{d} tensor-core attention"),
            tensor_core_attention(d, (70, 90), (64, 32), true),
            Options::default(),
        ));
        v.push((
            d.to_string(),
            format!("model m {{\n input x: {d}[8, 16]\n let out = softmax(x * 2) @ transpose(x)\n output out\n}}\n"),
            Options::default(),
        ));
    }
    v
}

/// `src` compiled for CUDA twice, the second time channels-last with TF32 matmuls and f32
/// attention gradients as flash kernels (`--flash-backward`), each module assembled in
/// `dir`: the modules, and what failed.
fn assemble_both(
    what: &str,
    src: &str,
    opts: &Options,
    ptxas: &std::path::Path,
    dir: &std::path::Path,
) -> (Vec<String>, Vec<String>) {
    let g = compile_pipeline(src, opts).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut codes = Vec::new();
    let mut failures = Vec::new();
    for channels_last in [false, true] {
        let c = compile(
            &g,
            &CompileOptions {
                target: Target::Cuda,
                allow_tf32: channels_last,
                flash_backward: channels_last,
                fuse: FuseOptions {
                    fuse: true,
                    channels_last,
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        if let Err(e) = assemble_ptx(ptxas, dir, &c.code) {
            failures.push(format!("{what}: {e}"));
        }
        codes.push(c.code);
    }
    (codes, failures)
}

#[test]
fn every_generated_ptx_module_assembles_for_sm_90() {
    let Some(ptxas) = ptxas() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "ptxas is missing under CI: `pip install nvidia-cuda-nvcc==13.0.88`"
        );
        tcc_tests::skipped(
            "every_generated_ptx_module_assembles_for_sm_90",
            "ptxas not found; PTX not assembled (set TCC_PTXAS or pip install nvidia-cuda-nvcc==13.0.88)",
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("tcc-ptxas-{}", std::process::id()));
    let progs = programs();
    // Every program compiled twice and assembled, on one thread per core (each thread in its
    // own directory); then the pieces of one module.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<(usize, Vec<String>, Vec<String>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (next, progs, ptxas) = (&next, &progs, &ptxas);
                let dir = dir.join(format!("t{t}"));
                s.spawn(move || {
                    std::fs::create_dir_all(&dir).unwrap();
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((what, src, opts)) = progs.get(i) else {
                            break;
                        };
                        let (codes, failures) = assemble_both(what, src, opts, ptxas, &dir);
                        out.push((i, codes, failures));
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    results.sort_by_key(|r| r.0);
    // The f32 flash-attention gradient programs hold the kernels in their second build.
    for (i, codes, _) in &results {
        if progs[*i].0.starts_with("f32 attention gradients") {
            assert!(
                codes[1].contains("attention_grad_q %") && codes[1].contains("attention_grad_kv %"),
                "{}: no flash gradient kernel",
                progs[*i].0
            );
        }
    }
    let mut failures: Vec<String> = results.iter().flat_map(|r| r.2.clone()).collect();
    // The CUDA executor compiles a module in pieces of whole entries on several threads
    // (tcc_runtime::ptx::split): every module splits, and the pieces of the first small one
    // with 3 pieces assemble on their own (assembling pieces again costs ptxas time).
    let mut split_checked = false;
    for (i, codes, _) in &results {
        for code in codes {
            let what = &progs[*i].0;
            let Some(pieces) = tcc_runtime::ptx::split(code, 3) else {
                failures.push(format!("{what}: the module does not split into pieces"));
                continue;
            };
            if !split_checked && pieces.len() == 3 && code.len() < 200_000 {
                split_checked = true;
                for (i, p) in pieces.iter().enumerate() {
                    if let Err(e) = assemble_ptx(&ptxas, &dir, p) {
                        failures.push(format!("{what}, piece {i} of 3: {e}"));
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(split_checked, "no module had 3 pieces to assemble");
    assert!(
        failures.is_empty(),
        "{} of {} modules fail ptxas:\n{}",
        failures.len(),
        2 * progs.len(),
        failures.join("\n")
    );
    eprintln!("ptxas -arch=sm_90 accepted {} modules", 2 * progs.len());
}

/// The CUDA back end picks its fast paths where they apply, and only there.
#[test]
fn ptx_paths_are_chosen_where_they_apply() {
    let build = |src: &str, target: Target, allow_tf32: bool| {
        let g = compile_pipeline(src, &Options::default()).unwrap();
        compile(
            &g,
            &CompileOptions {
                target,
                allow_tf32,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let ptx = |src: &str, allow_tf32: bool| build(src, Target::Cuda, allow_tf32).code;
    let model =
        |decls: &str, e: &str| format!("model m {{\n{decls}\n let out = {e}\n output out\n}}\n");
    // Vector loads of x and b (contiguous along the innermost axis), a vector store.
    let gelu = ptx(
        &model(
            " input x: f32[64, 1024]\n input b: f32[1024]",
            "gelu(x + b)",
        ),
        false,
    );
    let (lds, sts) = (
        gelu.matches("ld.global.v4.f32").count(),
        gelu.matches("st.global.v4.f32").count(),
    );
    assert!(sts >= 1 && lds == 2 * sts, "{gelu}");
    assert!(!gelu.contains("ld.global.f32"), "{gelu}");
    // A row broadcast stays a scalar load; halves move 4 at a time.
    let half = ptx(
        &model(" input x: bf16[32, 64]\n input c: bf16[32, 1]", "x * c"),
        false,
    );
    assert!(half.contains("ld.global.v4.b16") && half.contains("st.global.v4.b16"));
    assert!(half.contains("ld.global.b16"), "{half}");
    // An odd innermost extent or a transposed load keeps the scalar path.
    for (decls, e) in [
        (" input x: f32[33, 7]", "exp(x)"),
        (
            " input x: f32[64, 96]\n input y: f32[96, 64]",
            "x + transpose(y)",
        ),
    ] {
        let p = ptx(&model(decls, e), false);
        assert!(!p.contains(".v4."), "{e}: {p}");
    }
    // A concat loads each element once, from the address its piece selects: one vector load
    // when the pieces lie along an outer axis, one scalar load along the innermost one when
    // a piece is not contiguous there.
    let outer = ptx(
        &model(
            " input a: f32[1, 8, 64]\n input b: f32[1, 8, 64]\n input c: f32[1, 8, 64]",
            "concat([a, b, c, a], axis: 0) * 2.0",
        ),
        false,
    );
    assert_eq!(outer.matches("ld.global").count(), 1, "{outer}");
    assert!(outer.contains("ld.global.v4.f32") && outer.contains("selp.b64"));
    let inner = ptx(
        &model(
            " input a: f32[4, 8, 64]\n input b: f32[4, 8, 64]\n input c: f32[4, 64, 8]",
            "concat([a, b, transpose(c)], axis: 2)",
        ),
        false,
    );
    assert_eq!(inner.matches("ld.global.f32").count(), 1, "{inner}");
    // Along the innermost axis in whole vectors (gpt's q/k/v gradient concat), each vector
    // comes from one piece: one vector load; pieces that end inside a vector stay scalar.
    let whole = ptx(
        &model(
            " input a: f32[4, 8, 64]\n input b: f32[4, 8, 64]\n input c: f32[4, 8, 8]",
            "concat([a, b, c], axis: 2) * 2.0",
        ),
        false,
    );
    assert_eq!(whole.matches("ld.global.v4.f32").count(), 1, "{whole}");
    assert!(!whole.contains("ld.global.f32"), "{whole}");
    let ragged = ptx(
        &model(
            " input a: f32[4, 8, 6]\n input b: f32[4, 8, 10]",
            "concat([a, b], axis: 2) * 2.0",
        ),
        false,
    );
    assert!(!ragged.contains(".v4."), "{ragged}");
    // A piece also read on its own is still loaded for that use.
    let shared = ptx(
        &model(
            " input a: f32[1, 8, 64]\n input b: f32[1, 8, 64]",
            "concat([a, b], axis: 0) + a",
        ),
        false,
    );
    assert_eq!(shared.matches("ld.global.v4.f32").count(), 2, "{shared}");
    // An f32 B contiguous along k (a transposed view) is read in place by the FFMA tiles,
    // with vector loads along k, by the CPU's GEMM helper, which packs it, and with TF32 by
    // Hopper's wgmma (K-major) where its tiles fit; a smaller one under TF32 (`mma.sync`)
    // is copied once, contiguously.
    let bt = model(
        " input a: f32[2048, 256]\n input b: f32[2048, 256]",
        "a @ transpose(b)",
    );
    let exact = build(&bt, Target::Cuda, false);
    assert_eq!(exact.fused.kernels.len(), 1, "no copy of b");
    let mm = exact.fused.kernels[0].matmul.as_ref().unwrap();
    assert_eq!((mm.b.rs, mm.b.cs), (1, 256));
    assert_eq!(
        exact.code.matches("ld.global.v4.f32").count(),
        4,
        "{}",
        exact.code
    );
    let tf32 = build(&bt, Target::Cuda, true);
    assert_eq!(
        tf32.fused.kernels.len(),
        1,
        "no copy of b under TF32 either"
    );
    assert!(tf32
        .code
        .contains("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32"));
    // A B contiguous along n under TF32: wgmma too, transposed in shared memory.
    let nn = build(
        &model(
            " input a: f32[2048, 256]\n input b: f32[256, 2048]",
            "a @ b",
        ),
        Target::Cuda,
        true,
    );
    assert!(nn.code.contains("k8.f32.tf32.tf32") && nn.code.contains("st.shared.v4.f32"));
    // The shapes of gpu.rs's TF32 cases take wgmma, 128×256 tiles where a wave fills: B
    // transposed (four stages), both (three: one `cp.async` group ahead).
    for (decls, e, tile, stages_ahead) in [
        (
            " input x: f32[300, 136]\n input w: f32[136, 260]",
            "x @ w",
            "m64n128k8",
            3,
        ),
        (
            " input x: f32[136, 300]\n input w: f32[136, 260]",
            "transpose(x) @ w",
            "m64n128k8",
            3,
        ),
        (
            " input x: f32[300, 136]\n input w: f32[260, 136]",
            "x @ transpose(w)",
            "m64n128k8",
            3,
        ),
        (
            " input x: f32[2, 768, 96]\n input w: f32[2, 96, 2816]",
            "x @ w",
            "m64n256k8",
            2,
        ),
        (
            " input x: f32[200, 1260]\n input w: f32[200, 3580]",
            "transpose(x) @ w",
            "m64n256k8",
            1,
        ),
    ] {
        let code = build(&model(decls, e), Target::Cuda, true).code;
        assert!(
            code.contains(&format!("{tile}.f32.tf32.tf32")),
            "{e}: {code}"
        );
        // The loop waits for all but `stages_ahead - 1` groups (the epilogue for all).
        for n in 1..4 {
            let waits = code.contains(&format!("cp.async.wait_group {n};"));
            assert_eq!(waits, n + 1 == stages_ahead, "{e}: wait_group {n}");
        }
    }
    let small_bt = model(
        " input a: f32[2048, 256]\n input b: f32[96, 256]",
        "a @ transpose(b)",
    );
    assert_eq!(build(&small_bt, Target::Cuda, true).fused.kernels.len(), 2);
    assert_eq!(build(&bt, Target::Cpu, false).fused.kernels.len(), 1);
    assert!(
        !exact.code.contains("sg_done"),
        "no skips in a dense matmul"
    );
    // Causal attention as the prelude's composite (a head dimension of 40, which the fused
    // attention kernel does not take; `analysis::zeros`): the score tiles above the diagonal sum no `k`
    // and `p @ v` sums `k` up to the diagonal; 44 = 300 keys - 256 queries.
    let att = model(
        " input q: f32[72, 256, 40]\n input k: f32[72, 300, 40]\n input v: f32[72, 300, 40]",
        "attention(q, k, v, causal: true)",
    );
    let causal = build(&att, Target::Cuda, false);
    let skips: Vec<String> = causal
        .fused
        .kernels
        .iter()
        .filter_map(|k| k.matmul.as_ref())
        .map(|mm| {
            mm.skip
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    assert_eq!(skips, ["j-i>44", "k-i>44"]);
    assert_eq!(
        causal.code.matches("bra.uni $L_sg_done").count(),
        2,
        "{}",
        causal.code
    );
    // `p @ v`'s k ranges grow with its row tiles: its blocks take the last rows first.
    assert_eq!(
        causal
            .code
            .matches("// tiles heaviest first: row tiles, stages growing along them")
            .count(),
        1,
        "{}",
        causal.code
    );
    // 16-bit queries, keys and values: one fused kernel on tensor cores (64 queries a
    // block against 64 keys a step: `q kᵀ` takes d/16 × 8 products a warp, `p v` 4 × e/8),
    // f32 and ragged or unaligned operands the exact one.
    for (dtype, d, e) in [("bf16", 64, 32), ("f16", 128, 128), ("bf16", 16, 16)] {
        let src = tensor_core_attention(dtype, (70, 90), (d, e), false);
        let tc = build(&src, Target::Cuda, false);
        assert_eq!(tc.fused.kernels.len(), 1);
        let mma = format!("mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32");
        assert_eq!(tc.code.matches(&mma).count(), d / 16 * 8 + 4 * e / 8);
        assert!(!tc.code.contains("ld.global.b16"), "{}", tc.code);
    }
    let exact = build(
        &tensor_core_attention("f32", (70, 90), (64, 32), true).replace("cast(q, f32)", "q"),
        Target::Cuda,
        false,
    );
    assert!(!exact.code.contains("mma.sync"), "{}", exact.code);
    // A head dimension of 96 (12 chunks a row, which 128 threads do not copy in whole
    // rows a pass) keeps the exact kernel.
    let wide = tensor_core_attention("bf16", (70, 90), (96, 96), true);
    let wide = build(&wide, Target::Cuda, false);
    assert_eq!(wide.fused.kernels.len(), 1);
    assert!(!wide.code.contains("mma.sync"), "{}", wide.code);
    // Queries read transposed (not contiguous along the head dimension).
    let strided = tensor_core_attention("bf16", (70, 90), (64, 32), true)
        .replace("q: bf16[2, 3, 70, 64]", "q: bf16[2, 3, 64, 70]")
        .replace("cast(q, f32)", "cast(transpose(q), f32)");
    let strided = build(&strided, Target::Cuda, false);
    assert_eq!(strided.fused.kernels.len(), 1);
    assert!(!strided.code.contains("mma.sync"), "{}", strided.code);
    // The gradients: `ds @ k` sums as `p @ v` does, `pᵀ @ do` and `dsᵀ @ q` sum the rows
    // from the diagonal on (their first row tiles are the longest).
    let grad = build(
        "model m {
            input w: f32[72, 256, 40]
            param q: f32[72, 256, 40] = normal(0.0, 1.0)
            param k: f32[72, 256, 40] = normal(0.0, 1.0)
            param v: f32[72, 256, 40] = normal(0.0, 1.0)
            let loss = mean(attention(q, k, v, causal: true) * w)
            output loss
            train sgd(lr: 0.1) minimize loss
        }",
        Target::Cuda,
        false,
    );
    for (order, count) in [("growing", 2), ("shrinking", 2)] {
        let line = format!("// tiles heaviest first: row tiles, stages {order} along them");
        assert_eq!(grad.code.matches(&line).count(), count, "{}", grad.code);
    }
    // `ds = p * (do @ vᵀ - d)` (k = 40): its epilogue issues a batch of rows' loads before
    // its first store: 4 rows of its 8×8 register tile, each 2 vectors of `p` and one `d`
    // (read once a row). The other tiled kernels' epilogues load at most 1 before.
    let ahead: Vec<(usize, usize)> = grad
        .code
        .split(".entry ")
        .filter_map(|entry| {
            let done = entry.match_indices("$L_sg_done").nth(1)?.0;
            let epilogue = &entry[done..];
            let before = &epilogue[..epilogue.find("st.global").unwrap_or(epilogue.len())];
            Some((
                before.matches("ld.global").count(),
                before.matches("ld.global.v4.f32").count(),
            ))
        })
        .filter(|&(loads, _)| loads > 1)
        .collect();
    assert_eq!(ahead, [(12, 8)], "{}", grad.code);
    // Long rows: a block per row shares the row's reductions, then its threads stride
    // over the row's elements.
    let softmax = ptx(
        &model(" input x: f32[64, 512]", "softmax(x, axis: -1)"),
        false,
    );
    assert!(
        softmax.contains("shfl.sync.down") && softmax.contains("$L_ihead"),
        "{softmax}"
    );
    // 512 = 2 × 256: each trip of the row's loops (its max, its sum, the stores) runs
    // two copies of the body, the loads of both first; 520 runs one.
    let loads_per_trip = |ptx: &str| -> Vec<usize> {
        let mut out = Vec::new();
        for line in ptx.lines() {
            let Some(label) = line.strip_suffix(':') else {
                continue;
            };
            if !(label.starts_with("$L_bhead") || label.starts_with("$L_ihead")) {
                continue;
            }
            let from = ptx.find(line).unwrap_or(0);
            let body = &ptx[from..];
            let end = body
                .find(&format!("bra.uni {label};"))
                .unwrap_or(body.len());
            out.push(body[..end].matches("ld.global").count());
        }
        out
    };
    assert_eq!(loads_per_trip(&softmax), [2, 2, 2], "{softmax}");
    let ragged = ptx(
        &model(" input x: f32[64, 520]", "softmax(x, axis: -1)"),
        false,
    );
    assert_eq!(loads_per_trip(&ragged), [1, 1, 1], "{ragged}");
    // Short rows keep a thread per row.
    let short = ptx(
        &model(" input x: f32[64, 8]", "softmax(x, axis: -1)"),
        false,
    );
    assert!(!short.contains("shfl.sync.down"), "{short}");
    // Convolutions run as implicit GEMMs; a weight gradient with a long k and a small
    // output splits k across blocks.
    let g = compile_pipeline(
        "model m {
            input x: f32[32, 16, 16, 16]
            param w: f32[16, 16, 3, 3] = normal(0.0, 0.1)
            let y = conv2d(x, w, padding: 1)
            let loss = mean(y * y)
            output loss
            train sgd(lr: 0.1) minimize loss
        }",
        &Options::default(),
    )
    .unwrap();
    let channels_last = |g: &tcc::ir::Graph| {
        let fuse = FuseOptions {
            fuse: true,
            channels_last: true,
            ..Default::default()
        };
        let opts = CompileOptions {
            target: Target::Cuda,
            fuse,
            ..Default::default()
        };
        compile(g, &opts).unwrap()
    };
    let c = channels_last(&g);
    let gathers = c
        .fused
        .kernels
        .iter()
        .filter_map(|k| k.matmul.as_ref())
        .filter(|m| m.a.gather.is_some() && m.b.gather.is_some())
        .count();
    assert_eq!(gathers, 2, "conv2d and its weight gradient");
    assert!(c
        .fused
        .kernels
        .iter()
        .any(|k| k.matmul.as_ref().is_some_and(|m| m.split_k > 1)));
    assert!(c.code.contains("red.global.add.f32"));
    // Larger ones (their input gradients, and a weight gradient split along `k`) take the
    // large-tile SGEMM, which gathers their operands; smaller ones keep the 64×64 tile.
    let c = channels_last(&compile_pipeline(IMPLICIT_GEMM_CONVS, &Options::default()).unwrap());
    // (what, on the SGEMM, stream-K, float4 runs)
    let mut paths = Vec::new();
    for kernel in c.code.split("\n// ").skip(1) {
        let what = kernel.lines().next().unwrap_or_default();
        if what.contains("conv2d") && !what.starts_with("zero fill") {
            let runs = kernel
                .lines()
                .any(|l| l.trim_start().starts_with('@') && l.contains("ld.global.v4.f32"));
            paths.push((
                what,
                kernel.contains(".b8 mm_s["),
                kernel.contains("sk_seg"),
                runs,
            ));
        }
    }
    let sgemm: Vec<&str> = paths.iter().filter(|p| p.1).map(|p| p.0).collect();
    let count = |what: &str| sgemm.iter().filter(|w| w.contains(what)).count();
    assert_eq!(paths.len(), 14, "{paths:?}");
    assert_eq!(sgemm.len(), 10, "{paths:?}");
    assert_eq!(count("conv2d_grad_input"), 4, "{paths:?}");
    assert_eq!(count("conv2d_grad_weight"), 2, "{paths:?}");
    assert_eq!(paths.iter().filter(|p| p.1 && p.2).count(), 1, "{paths:?}");
    assert_eq!(paths.iter().filter(|p| p.1 && p.3).count(), 9, "{paths:?}");
    let split = c.fused.kernels.iter().filter_map(|k| k.matmul.as_ref());
    assert_eq!(
        split.filter(|m| m.split_k > 1 && m.n == 576).count(),
        3,
        "{paths:?}"
    );
    // bf16 and f16 matmuls run on tensor cores; f32 only with allow_tf32.
    for d in ["bf16", "f16"] {
        let p = ptx(
            &model(
                &format!(" input a: {d}[128, 64]\n input b: {d}[64, 96]"),
                "a @ b",
            ),
            false,
        );
        assert!(
            p.contains(&format!("m16n8k16.row.col.f32.{d}.{d}.f32")),
            "{p}"
        );
        assert!(p.contains("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"));
        assert!(p.contains("cp.async.cg.shared.global"));
    }
    // Large ones take Hopper's wgmma (sm_90a): 128×128 tiles, or 128×256 where those
    // still give a block per SM, in dynamic shared memory; transposed operands set the
    // transpose flags.
    let wg = |decls: &str, e: &str| {
        let c = build(&model(decls, e), Target::Cuda, false);
        let launch = c.launches[0].clone();
        (c.code, launch)
    };
    let (p, l) = wg(
        " input a: bf16[512, 256]\n input b: bf16[256, 512]",
        "a @ b",
    );
    assert!(
        p.contains(".target sm_90a") && !p.contains("mma.sync"),
        "{p}"
    );
    assert!(p.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"));
    assert!(p.contains(", 1, 1, 0, 1;"), "A K-major, B N-major");
    assert!(l.shared_bytes > 48 * 1024, "{l:?}");
    let (p, _) = wg(
        " input a: f16[256, 512]\n input b: f16[256, 512]",
        "transpose(a) @ b",
    );
    assert!(
        p.contains(".f32.f16.f16") && p.contains(", 1, 1, 1, 1;"),
        "{p}"
    );
    let (p, _) = wg(
        " input a: bf16[512, 256]\n input b: bf16[512, 256]",
        "a @ transpose(b)",
    );
    assert!(p.contains(", 1, 1, 0, 0;"), "{p}");
    let (p, l) = wg(
        " input a: bf16[132, 128, 64]\n input b: bf16[132, 64, 256]",
        "a @ b",
    );
    assert!(p.contains("m64n256k16"), "{p}");
    assert_eq!(l.grid, [1, 1, 132]);
    // The epilogue walks the f32 tile 4 columns a thread: one `ld.shared.v4` and one
    // vector store a group; a load along the columns is one vector load a group, a load
    // along the rows one a group.
    let (p, _) = wg(
        " input a: bf16[512, 256]
 input b: bf16[256, 512]
 input h: f32[512, 512]
 input r: f32[512, 1]",
        "cast(tanh(cast(a @ b, f32) * h + r), bf16)",
    );
    assert!(p.contains("wgmma.mma_async"), "{p}");
    let count = |p: &str, i: &str| p.matches(i).count();
    assert!(count(&p, "ld.shared.v4.f32") > 0, "{p}");
    assert_eq!(
        count(&p, "ld.shared.v4.f32"),
        count(&p, "ld.global.v4.f32"),
        "{p}"
    );
    assert_eq!(
        count(&p, "ld.shared.v4.f32"),
        count(&p, "ld.global.f32"),
        "{p}"
    );
    assert_eq!(
        count(&p, "ld.shared.v4.f32"),
        count(&p, "st.global.v4.b16"),
        "{p}"
    );
    assert!(!p.contains("ld.shared.f32"), "{p}");
    // Small or unaligned ones keep mma.sync on sm_90.
    let (p, l) = wg(
        " input a: bf16[512, 255]\n input b: bf16[255, 512]",
        "a @ b",
    );
    assert!(
        p.contains(".target sm_90\n") && p.contains("mma.sync"),
        "{p}"
    );
    assert_eq!(l.shared_bytes, 0);
    // Large f32 matmuls take the 128×128 FFMA tiles (8×8 per thread); ones with too few
    // such tiles to fill the GPU keep the 64×64 tiles.
    let big = ptx(
        &model(" input a: f32[2048, 64]\n input b: f32[64, 2048]", "a @ b"),
        false,
    );
    let few = ptx(
        &model(" input a: f32[256, 64]\n input b: f32[64, 1024]", "a @ b"),
        false,
    );
    assert!(!few.contains("mm_s[16896]"), "{few}");
    // A side of at most 64 (attention's [T, T] @ [T, 64]) takes 128×64 or 64×128 tiles,
    // staged 16 deep (two slices of 8: twice the shared memory of a 128×128 tile's stage).
    for (decls, e) in [
        (
            " input a: f32[96, 512, 512]\n input b: f32[96, 512, 64]",
            "a @ b",
        ),
        (
            " input a: f32[96, 64, 512]\n input b: f32[96, 512, 512]",
            "a @ b",
        ),
    ] {
        let p = ptx(&model(decls, e), false);
        assert!(p.contains("mm_s[33792]"), "{e}: {p}");
    }
    assert!(
        big.contains("mm_s[16896]") && !big.contains("mma.sync"),
        "{big}"
    );
    // A short k (64) stores vectors, within launch bounds of two blocks an SM; a long k
    // (512) keeps scalar stores, and loads its whole stages by number (one address and one
    // vector load per operand, no zeros), also within those bounds.
    assert!(
        big.contains("st.global.v4.f32")
            && big.contains(".minnctapersm 2")
            && !big.contains("st.global.f32"),
        "{big}"
    );
    let deep = ptx(
        &model(
            " input a: f32[1024, 512]\n input b: f32[512, 2048]",
            "a @ b",
        ),
        false,
    );
    assert!(deep.contains("mm_s[16896]"), "{deep}");
    // The matmul's entry (128 output tiles of 64 stages: stream-K).
    let deep = match deep.match_indices(".visible .entry").nth(1) {
        Some((at, _)) => deep[..at].to_string(),
        None => deep,
    };
    assert!(deep.contains("matmul"), "{deep}");
    assert!(
        !deep.contains("st.global.v4") && deep.contains(".minnctapersm 2"),
        "{deep}"
    );
    // Two stage loads before the loop and two in it, unconditional (rows clamped).
    let stage_loads = deep
        .lines()
        .filter(|l| l.trim_start().starts_with("ld.global.v4.f32"))
        .count();
    assert_eq!(stage_loads, 4, "{deep}");
    assert!(
        deep.lines()
            .filter(|l| l.contains("ld.global.v4"))
            .all(|l| !l.contains('@')),
        "{deep}"
    );
    // A column group past n = 32 in a 64-wide tile reads the last whole group (columns
    // 28..32), so its vector loads stay aligned; rows clamp to the last row.
    let narrow = ptx(
        &model(
            " input a: f32[24, 1024, 512]\n input b: f32[512, 32]",
            "a @ b",
        ),
        false,
    );
    let clamps: Vec<&str> = narrow
        .lines()
        .filter_map(|l| l.trim().strip_prefix("min.s64 "))
        .filter_map(|l| l.rsplit(", ").next())
        .collect();
    assert!(narrow.contains("mm_s[33792]"), "{narrow}");
    assert_eq!(clamps, ["1023;", "28;"], "{narrow}");
    // A weight gradient's shape (25 tiles of 512 stages) runs stream-K on CUDA: one
    // kernel (with the epilogue's `+ b`) on a wave of 264 blocks, whose flags and partial
    // tiles lie in the scratch region after the plan's buffers; the CPU has none.
    let wgrad = model(
        " input x: f32[4096, 640]\n input dy: f32[4096, 640]\n input b: f32[640]",
        "transpose(x) @ dy + b",
    );
    let (cuda, cpu) = (
        build(&wgrad, Target::Cuda, false),
        build(&wgrad, Target::Cpu, false),
    );
    let mms = |c: &tcc::artifact::Compiled| -> Vec<(Vec<usize>, usize)> {
        c.fused
            .kernels
            .iter()
            .filter_map(|k| k.matmul.as_ref())
            .map(|m| (m.batch.clone(), m.k))
            .collect()
    };
    assert_eq!(mms(&cuda), vec![(vec![], 4096)]);
    assert_eq!(mms(&cpu), vec![(vec![], 4096)]);
    assert_eq!(cuda.fused.kernels.len(), 1, "the matmul and + b");
    assert_eq!(cuda.launches[0].grid, [264, 1, 1]);
    let (plan, used) = (&cuda.plan, cuda.launches[0].scratch_bytes);
    assert!(used >= 264 * 128 * 128 * 4 && plan.scratch_bytes >= used);
    assert_eq!(plan.scratch_offset() % 256, 0);
    assert_eq!(plan.scratch_offset() + plan.scratch_bytes, plan.arena_bytes);
    assert_eq!(cpu.plan.scratch_bytes, 0);
    assert!(cuda.code.contains(&format!(", {};", plan.scratch_offset())));
    // After the k loop: a later part's partial (64 floats a thread) and its flag, raised
    // after a barrier and a fence; a tile's first part waits on each later block's flag,
    // resets it and adds its partial; then the epilogue's stores.
    let after_loop = cuda.code.rsplit("$L_sg_done").next().unwrap_or_default();
    let mut ops: Vec<(&str, usize)> = Vec::new();
    for l in after_loop.lines() {
        // The instruction, past its predicate if any.
        let l = l.trim();
        let l = match l.strip_prefix('@') {
            Some(p) => p.split_once(' ').map_or(p, |(_, rest)| rest),
            None => l,
        };
        let op = match l.split(' ').next().unwrap_or_default() {
            o @ ("st.global.cg.f32"
            | "bar.sync"
            | "fence.acq_rel.gpu;"
            | "st.relaxed.gpu.global.u32"
            | "ld.acquire.gpu.global.u32"
            | "ld.global.cg.f32"
            | "st.global.f32"
            | "ret;") => o,
            _ => continue,
        };
        match ops.last_mut() {
            Some((o, n)) if *o == op => *n += 1,
            _ => ops.push((op, 1)),
        }
    }
    assert_eq!(
        ops,
        [
            ("st.global.cg.f32", 64),
            ("bar.sync", 1),
            ("fence.acq_rel.gpu;", 1),
            ("st.relaxed.gpu.global.u32", 1),
            ("ld.acquire.gpu.global.u32", 1),
            ("st.relaxed.gpu.global.u32", 1),
            ("bar.sync", 1),
            ("ld.global.cg.f32", 64),
            ("st.global.f32", 64),
            ("bar.sync", 1),
            ("ret;", 1),
        ],
        "{}",
        cuda.code
    );
    // gpt's output projection's shape (192 tiles of 96 stages) too; a product with many
    // tiles, or with too little work for a block an SM, runs whole tiles.
    let proj = model(" input x: f32[4096, 768]\n input w: f32[768, 768]", "x @ w");
    let c = build(&proj, Target::Cuda, false);
    assert_eq!(c.launches[0].grid, [264, 1, 1]);
    assert!(c
        .code
        .contains("stream-K: 192 tiles of 96 stages over 264 blocks"));
    assert!(!big.contains("stream-K") && !few.contains("stream-K"));
    let whole = build(
        &model(
            " input x: f32[4096, 768]\n input w: f32[768, 3072]",
            "x @ w",
        ),
        Target::Cuda,
        false,
    );
    assert_eq!(whole.launches[0].grid, [24, 32, 1]);
    assert_eq!(whole.plan.scratch_bytes, 0);
    // The GPU tests' stream-K cases take this path.
    for (what, src, _) in tcc_tests::gpu_path_cases() {
        if what.starts_with("stream-K") {
            let code = build(&src, Target::Cuda, false).code;
            assert!(code.contains("// stream-K"), "{what}");
        }
    }
    // Many rows of one output each: a warp per row; a softmax over fewer, longer rows
    // keeps a block per row.
    let warp = ptx(
        &model(" input x: f32[20000, 96]", "max(x, axis: -1)"),
        false,
    );
    assert!(
        warp.contains("shfl.sync.bfly") && !warp.contains("red_smem"),
        "{warp}"
    );
    assert!(!softmax.contains("shfl.sync.bfly"), "{softmax}");
    let many = ptx(
        &model(" input x: f32[40, 450, 96]", "softmax(x, axis: -1)"),
        false,
    );
    assert!(
        many.contains("shfl.sync.bfly") && many.contains("$L_ihead") && !many.contains("red_smem"),
        "{many}"
    );
    // An embedding gradient (a `+=` scatter) fused with rms_norm's row reduction: a block
    // per row, atomic adds.
    let c = build(
        "model m {
            input t: i32[64, 32]
            param e: f32[100, 96] = normal(0.0, 0.1)
            param g: f32[96] = ones
            let loss = mean(rms_norm(embedding(e, t), g))
            output loss
            train sgd(lr: 0.1) minimize loss
        }",
        Target::Cuda,
        false,
    );
    let scatter = c
        .code
        .split(".entry")
        .find(|e| e.contains("red.global.add.f32"))
        .unwrap_or_default();
    assert!(
        scatter.contains("red_smem") && scatter.contains("$L_ihead"),
        "{}",
        c.code
    );
    let f32mm = model(" input a: f32[128, 64]\n input b: f32[64, 96]", "a @ b");
    assert!(!ptx(&f32mm, false).contains("mma.sync"));
    assert!(ptx(&f32mm, true).contains("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"));
}

/// `tcc build --target cuda` with `ptxas` there: the artifact carries one cubin per piece of
/// the PTX, every kernel in exactly one (the reader checks it), for the module's `.target`;
/// the bytes are the same whatever the number of threads assembling them (the piece count is
/// fixed), so a build is as deterministic as `ptxas` is.
#[test]
fn sass_artifacts_hold_every_kernel_whatever_the_threads() {
    let Some(ptxas) = ptxas() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "ptxas is missing under CI: `pip install nvidia-cuda-nvcc==13.0.88`"
        );
        tcc_tests::skipped(
            "sass_artifacts_hold_every_kernel_whatever_the_threads",
            "ptxas not found; no SASS assembled",
        );
        return;
    };
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl")).unwrap();
    let opts = options_from_args("--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128");
    let g = compile_pipeline(&src, &opts).unwrap();
    let c = compile(
        &g,
        &CompileOptions {
            target: Target::Cuda,
            ..Default::default()
        },
    )
    .unwrap();
    let one = tcc_tests::artifact_with_sass(&c, &ptxas, 1).unwrap();
    let three = tcc_tests::artifact_with_sass(&c, &ptxas, 3).unwrap();
    assert!(one == three, "the SASS depends on the thread count");
    let m = tcc_runtime::Model::from_bytes(one).unwrap();
    let (sass, cubins) = m.sass().expect("the artifact carries SASS");
    let target = c
        .code
        .lines()
        .find_map(|l| l.strip_prefix(".target "))
        .unwrap();
    assert_eq!(sass.arch, target.trim());
    let kernels = m.manifest().kernels.len();
    assert!(
        sass.pieces.len() > 1 && sass.pieces.len() <= tcc::back::sass::PIECES.min(kernels),
        "{} pieces for {kernels} kernels",
        sass.pieces.len()
    );
    // What the CUDA executor checks before the driver reads a cubin holds for ptxas's.
    for c in &cubins {
        tcc_runtime::ptx::check_elf(c).unwrap();
    }
    // The PTX is the same as without SASS: it stays the fallback.
    assert_eq!(m.code(), c.code);
    eprintln!(
        "{} kernels in {} cubins for {} ({} bytes)",
        kernels,
        sass.pieces.len(),
        sass.arch,
        cubins.iter().map(|c| c.len()).sum::<usize>()
    );
}

/// Under `--amp`, gpt's attention reads its 16-bit projections on tensor cores: each
/// layer's attention kernel is the `mma.sync` one, rounding `p` to 16 bits in pairs, and
/// so are its two gradient kernels.
#[test]
fn mixed_precision_attention_runs_on_tensor_cores() {
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl")).unwrap();
    let args = "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128";
    for a in tcc_tests::amp::policies() {
        let g = tcc_tests::amp::step(&src, args, a);
        let opts = CompileOptions {
            amp: a,
            ..tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true)
        };
        let c = compile(&g, &opts).unwrap();
        let dtype = a.name();
        let attention: Vec<&str> = c
            .code
            .split("\n// ")
            .filter(|k| k.lines().next().is_some_and(|l| l.contains("attention %")))
            .collect();
        assert_eq!(
            attention.len(),
            2,
            "--amp {dtype}: one attention kernel a layer"
        );
        // The backward pass: `dq`, and `dk` with `dv`, on tensor cores too.
        let grads: Vec<&str> = c
            .code
            .split("\n// ")
            .filter(|k| {
                k.lines().next().is_some_and(|l| {
                    l.contains("attention_grad_q %") || l.contains("attention_grad_kv %")
                })
            })
            .collect();
        assert_eq!(
            grads.len(),
            4,
            "--amp {dtype}: two gradient kernels a layer"
        );
        for k in grads {
            assert!(k.contains(&format!("cvt.rn.{dtype}x2.f32")), "{k}");
            assert!(k.contains("ldmatrix.sync.aligned.m8n8.x4.trans"), "{k}");
            assert!(
                k.contains(&format!("m16n8k16.row.col.f32.{dtype}.{dtype}.f32")),
                "{k}"
            );
        }
        for k in attention {
            assert!(k.contains(&format!("cvt.rn.{dtype}x2.f32")), "{k}");
            assert!(
                k.contains(&format!("m16n8k16.row.col.f32.{dtype}.{dtype}.f32")),
                "{k}"
            );
        }
    }
}

/// With `--flash-backward`, gpt's f32 attention backward is the two flash-attention
/// gradient kernels (`back::ptx::attention_ffma_grad`): FFMA on rebuilt probabilities, no
/// tensor cores. Without it, the composite: no gradient kernel.
#[test]
fn f32_attention_gradients_run_as_two_ffma_kernels() {
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl")).unwrap();
    let args = "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128";
    let g = compile_pipeline(&src, &options_from_args(args)).unwrap();
    let plain = tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true);
    let c = compile(&g, &plain).unwrap();
    assert!(!c.code.contains("attention_grad_q %"));
    let c = compile(
        &g,
        &CompileOptions {
            flash_backward: true,
            ..plain
        },
    )
    .unwrap();
    let grads: Vec<&str> = c
        .code
        .split("\n// ")
        .filter(|k| {
            k.lines().next().is_some_and(|l| {
                l.contains("attention_grad_q %") || l.contains("attention_grad_kv %")
            })
        })
        .collect();
    assert_eq!(grads.len(), 4, "two gradient kernels a layer");
    for k in grads {
        assert!(k.contains("ex2.approx.ftz.f32"), "{k}");
        assert!(k.contains("fma.rn.f32"), "{k}");
        assert!(!k.contains("mma"), "{k}");
    }
}
