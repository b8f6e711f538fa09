//! The loss head computed in chunks (`tcc::front::micro_batch::compile_step`): chosen by
//! default for a large vocabulary's logits, each chunk's backward run right after its
//! forward, the same results as the whole head and a smaller arena.

use tcc::artifact::CompileOptions;
use tcc_tests::{chunks_vs_whole, device_options, run_stages, split_step, split_step_through};

const GPT: &str = include_str!("../../examples/gpt.tdsl");

/// A small gpt whose logits (`[4·256, 2048]`, 8 MiB) are 32 times its hidden states.
const SMALL: &[(&str, &str)] = &[
    ("B", "4"),
    ("T", "256"),
    ("D", "64"),
    ("H", "2"),
    ("L", "2"),
    ("V", "2048"),
];

/// A letter for each matmul of `g`, in its order, that `mark` names by its result's dims
/// and whether it is of the backward pass.
fn products_in_order(g: &tcc::ir::Graph, mark: impl Fn(&[usize], bool) -> Option<char>) -> String {
    g.topo_order()
        .unwrap_or_default()
        .into_iter()
        .filter(|&n| g.node(n).op == tcc::ir::Op::MatMul)
        .filter_map(|n| mark(g.node(n).ty.dims(), g.node(n).backward))
        .collect()
}

fn cpu() -> CompileOptions {
    device_options(tcc_runtime::Device::Cpu, true)
}

#[test]
fn a_large_loss_head_runs_in_chunks_with_the_whole_heads_results() {
    let (r, chunks) =
        chunks_vs_whole(GPT, SMALL, 3, tcc_runtime::Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "chunks {chunks:?}: params rel err {:e}, outputs {:e}, arena {} -> {} bytes",
        r.params, r.outputs, r.arenas.0, r.arenas.1
    );
    // 1024 rows: four chunks of 256.
    assert_eq!(chunks, Some(4));
    assert!(r.params < 1e-5, "params differ by {:e}", r.params);
    assert!(r.outputs < 1e-5, "the loss differs by {:e}", r.outputs);
    // Only a chunk's logits (and their gradient) are live at a time: 17.09 against
    // 21.42 MiB when measured.
    assert!(
        r.arenas.1 * 10 < r.arenas.0 * 9,
        "the arena did not drop by a tenth: {} -> {}",
        r.arenas.0,
        r.arenas.1
    );
}

#[test]
fn each_chunks_backward_runs_before_the_next_chunks_logits() {
    let g = split_step(GPT, SMALL, 1, None, &cpu()).unwrap_or_else(|e| panic!("{e}"));
    // In the scheduled order, the chunks' logits (`[1, 256, 2048]`) alternate with the
    // products that take their gradient back to the hidden states.
    // A chunk's logits, and the gradient of a chunk's hidden states.
    let seen = products_in_order(&g, |dims, backward| match (dims, backward) {
        ([1, 256, 2048], false) => Some('f'),
        ([1, 256, 64], true) => Some('b'),
        _ => None,
    });
    assert_eq!(
        seen, "fbfbfbfb",
        "forward (f) and backward (b) head products in order"
    );
}

#[test]
fn small_heads_and_dropout_stay_whole_and_bad_counts_are_errors() {
    // 4 × 64 rows: a chunk would keep fewer than 256.
    let small = [
        ("B", "4"),
        ("T", "64"),
        ("D", "64"),
        ("H", "2"),
        ("L", "1"),
        ("V", "2048"),
    ];
    let g = split_step(GPT, &small, 1, None, &cpu()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.loss_chunks, None);
    // Asked for, it is split.
    let g = split_step(GPT, &small, 1, Some(2), &cpu()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.loss_chunks, Some(2));
    // A count that does not divide the batch, and one with micro-batches, are errors.
    let e = split_step(GPT, SMALL, 1, Some(3), &cpu()).expect_err("3 does not divide 4");
    assert!(e.contains("E0541") && e.contains("--loss-chunks 3"), "{e}");
    let e = split_step(GPT, SMALL, 2, Some(2), &cpu()).expect_err("with micro-batches");
    assert!(e.contains("E0547"), "{e}");
    // Dropout in the head would draw its masks per chunk: kept whole by default, an error
    // when asked for.
    let drop = GPT.replace(
        "let logits = rms_norm(x, gf) @ transpose(wte)",
        "let logits = dropout(rms_norm(x, gf) @ transpose(wte), 0.1)",
    );
    assert_ne!(drop, GPT);
    let g = split_step(&drop, SMALL, 1, None, &cpu()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.loss_chunks, None);
    let e = split_step(&drop, SMALL, 1, Some(2), &cpu()).expect_err("dropout in the head");
    assert!(e.contains("E0548") && e.contains("dropout"), "{e}");
}

/// The head is the last product of a weight the loss depends on (the logits), not an
/// earlier larger one: with a small vocabulary, fc1 (`[.., 4D]`) is the largest product,
/// and the logits (`[.., V]`, twice their operand) are too small to split by default.
/// Asked for, the chunks hold the logits' products alone (forward, and the two gradients).
#[test]
fn the_head_is_the_last_product_not_the_largest() {
    let small_v = [
        ("B", "4"),
        ("T", "256"),
        ("D", "128"),
        ("H", "2"),
        ("L", "2"),
        ("V", "256"),
    ];
    let g = split_step(GPT, &small_v, 1, None, &cpu()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.loss_chunks, None);
    let g = split_step(GPT, &small_v, 1, Some(2), &cpu()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.loss_chunks, Some(2));
    let chunked = g
        .node_ids()
        .filter(|&n| g.node(n).micro_batch.is_some() && g.node(n).op == tcc::ir::Op::MatMul)
        .count();
    assert!(chunked <= 3 * 2, "{chunked} products in the chunks");
}

#[test]
fn a_chunks_weight_gradient_runs_in_its_chunk_under_mixed_precision() {
    // Free recomputation moves a product that reads a recomputed value after the chain
    // that stores it: under bf16 the chain of the next chunk's (its cast of the hidden
    // states) was taken, so each chunk's logit gradient lived through the next chunk.
    let compile = CompileOptions {
        amp: tcc::passes::amp::Amp::named("bf16").expect("bf16"),
        ..device_options(tcc_runtime::Device::Cpu, true)
    };
    let g = split_step_through(GPT, SMALL, 1, Some(4), &compile, "remat")
        .unwrap_or_else(|e| panic!("{e}"));
    // A chunk's logits, and the tied embedding's gradient from a chunk.
    let seen = products_in_order(&g, |dims, backward| match (dims, backward) {
        ([1, 256, 2048], false) => Some('f'),
        ([64, 2048], true) => Some('w'),
        _ => None,
    });
    assert_eq!(
        seen, "fwfwfwfw",
        "logits (f) and weight gradients (w) of the chunks in order"
    );
}

#[test]
fn each_chunks_weight_gradient_kernel_runs_in_its_chunk() {
    // The tied embedding's gradient sums its chunks' contributions in the epilogues of the
    // products that make them, each in its own chunk: one chunk's logit gradient is dead
    // before the next chunk's logits are made. gpt at its own size (fused, not run): with
    // the sum reading its earlier terms first, the first chunk's product joined the second
    // chunk's sum.
    for target in [tcc::artifact::Target::Cpu, tcc::artifact::Target::Cuda] {
        let compile = CompileOptions { target, ..cpu() };
        let g = split_step_through(GPT, &[], 1, None, &compile, "amp")
            .unwrap_or_else(|e| panic!("{target:?}: {e}"));
        let Ok(tcc::pipeline::Product::Kernels(k)) = run_stages(&g, "fuse", "fuse", compile) else {
            panic!("{target:?}: gpt fuses");
        };
        let mut seen = String::new();
        for kernel in &k.fused.kernels {
            let Some(&root) = kernel.nodes.last() else {
                continue;
            };
            let has_matmul = kernel
                .nodes
                .iter()
                .any(|&n| k.graph.node(n).op == tcc::ir::Op::MatMul);
            if !has_matmul {
                continue;
            }
            match k.graph.ty(root).dims() {
                [2, 512, 8192] => seen.push('f'),
                [768, 8192] => seen.push('w'),
                _ => {}
            }
        }
        assert_eq!(
            seen, "fwfwfwfw",
            "{target:?}: logits (f) and weight gradients (w)"
        );
    }
}

#[test]
fn fit_grows_the_batch_with_asked_for_chunks() {
    // `tcc fit --grow B --loss-chunks 4` tries batches 4 does not divide (the search
    // starts at 1): those keep the head whole instead of failing the search.
    let file = tcc_tests::root().join("examples/gpt.tdsl");
    let sets: Vec<(String, String)> = SMALL
        .iter()
        .filter(|(n, _)| *n != "B")
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let b = tcc::cli::fit::run(
        &file,
        &sets,
        &None,
        24 << 20,
        "B",
        64,
        tcc::cli::remat_cmd::RematMode::None,
        200,
        Default::default(),
        tcc::cli::Parallel {
            loss_chunks: Some(4),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(b >= 4, "the largest batch that fits 24 MiB: {b}");
}
