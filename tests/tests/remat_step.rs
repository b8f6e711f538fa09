//! Rematerialization of TDSL training steps: decisions are compiled to verified plans that
//! meet the budget, and the recomputing step trains exactly like the plain one.

use std::collections::BTreeSet;
use std::time::Duration;
use tcc::artifact::{self, CompileOptions};
use tcc::remat::step::{self, AutoOptions, RematError};
use tcc_tests::{cpu_steps, params_rel_err, rel_err};

fn graph(file: &str, sets: &[(&str, &str)]) -> tcc::ir::Graph {
    tcc_tests::scheduled_step(file, sets)
}

const GPT: &[(&str, &str)] = &[
    ("L", "4"),
    ("D", "16"),
    ("H", "2"),
    ("T", "32"),
    ("B", "2"),
    ("V", "16"),
];

const CNN: &[(&str, &str)] = &[("B", "8"), ("C", "8"), ("S", "16")];

/// A 3-layer gpt whose recomputed values (at least 64 KiB each) are what the peak holds.
const GPT_3: &[(&str, &str)] = &[
    ("L", "3"),
    ("D", "64"),
    ("H", "2"),
    ("T", "64"),
    ("B", "4"),
    ("V", "64"),
];

/// Both steps train 3 steps from the same params and inputs; outputs and params agree to
/// f32 rounding (recomputation runs the same ops; fusion may group them differently).
fn same_training(a: &tcc::ir::Graph, b: &tcc::ir::Graph) {
    let inputs = tcc::eager::random_inputs(a, 3);
    let x = cpu_steps(a, &inputs, 3, 0, true).unwrap();
    let y = cpu_steps(b, &inputs, 3, 0, true).unwrap();
    for (name, t) in &x.outputs {
        let e = rel_err(&y.outputs[name], t);
        assert!(e <= 1e-6, "output `{name}`: relative error {e:e}");
    }
    let e = params_rel_err(&y.persistent, &x.persistent).unwrap();
    assert!(e <= 1e-6, "params: relative error {e:e}");
}

fn auto(g: &tcc::ir::Graph, budget: u64) -> Result<step::Decision, RematError> {
    step::auto(
        g,
        &AutoOptions {
            budget,
            compile: CompileOptions::default(),
            time_limit: Duration::from_millis(300),
            rounds: 6,
        },
    )
}

#[test]
fn auto_meets_the_budget_in_the_verified_plan_and_trains_like_no_remat() {
    for (file, sets, percent) in [
        ("examples/gpt.tdsl", GPT, 70),
        ("examples/gpt.tdsl", GPT, 50),
        ("examples/cnn.tdsl", CNN, 75),
    ] {
        let g = graph(file, sets);
        let base = step::measure(&g, &BTreeSet::new(), &CompileOptions::default()).unwrap();
        let transient = base.arena - base.persistent;
        let budget = base.persistent + transient * percent / 100;
        let d = auto(&g, budget).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(d.chosen.arena <= budget, "{file}");
        assert!(
            !d.chosen.evict.is_empty(),
            "{file}: something is recomputed"
        );
        assert!(d.chosen.added_flops > 0, "{file}");
        assert_eq!(d.base_arena, base.arena);
        // The compiled artifact's plan is the one measured, and the runtime allocates it.
        let c = artifact::compile(&d.chosen.graph, &CompileOptions::default()).unwrap();
        assert_eq!(c.plan.arena_bytes, d.chosen.arena, "{file}");
        let inputs = tcc::eager::random_inputs(&g, 1);
        let run = cpu_steps(&d.chosen.graph, &inputs, 1, 0, true).unwrap();
        assert_eq!(run.arena_bytes as u64, d.chosen.arena, "{file}");
        same_training(&g, &d.chosen.graph);
    }
}

#[test]
fn baselines_recompute_and_train_like_no_remat() {
    let g = graph("examples/gpt.tdsl", GPT);
    let fused = tcc::kernel::fuse::fuse(&g, Default::default()).unwrap();
    let m = step::Model::new(&g, &fused);
    let opts = CompileOptions::default();
    let base = step::measure(&g, &BTreeSet::new(), &opts).unwrap();
    for (name, set) in [
        ("per-block", step::per_block(&g, &m)),
        ("sqrt(n)", step::sqrt_n(&m)),
    ] {
        assert!(!set.is_empty(), "{name}");
        let r = step::measure(&g, &set, &opts).unwrap();
        assert!(
            r.arena < base.arena,
            "{name}: {} vs {}",
            r.arena,
            base.arena
        );
        assert!(r.added_flops > 0, "{name}");
        same_training(&g, &r.graph);
    }
}

#[test]
fn an_unreachable_budget_is_an_error_naming_the_smallest_arena() {
    let g = graph("examples/gpt.tdsl", GPT);
    let base = step::measure(&g, &BTreeSet::new(), &CompileOptions::default()).unwrap();
    let budget = base.persistent / 2;
    match auto(&g, budget) {
        Err(RematError::Infeasible {
            budget: b,
            smallest,
            persistent,
            ..
        }) => {
            assert_eq!(b, budget);
            assert!(smallest > budget && smallest < base.arena);
            assert_eq!(persistent, base.persistent);
        }
        other => panic!("expected an infeasible budget, got {other:?}"),
    }
    let msg = auto(&g, budget).unwrap_err().to_string();
    assert!(
        msg.contains("cannot be met") && msg.contains("smallest arena"),
        "{msg}"
    );
}

#[test]
fn a_budget_already_met_recomputes_nothing() {
    let g = graph("examples/mlp.tdsl", &[("B", "8"), ("D", "32")]);
    let d = auto(&g, u64::MAX / 2).unwrap();
    assert!(d.chosen.evict.is_empty());
    assert_eq!(d.chosen.arena, d.base_arena);
    assert_eq!(d.method, "none needed");
}

#[test]
fn flops_count_matmuls_and_convolutions() {
    let g = graph("examples/mlp.tdsl", &[("B", "8"), ("D", "32")]);
    let mm: Vec<u64> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, tcc::ir::Op::MatMul) && !g.node(n).backward)
        .map(|n| step::flops(&g, n))
        .collect();
    // 784 -> 32: 2 * 8 * 32 * 784 multiply-adds.
    assert_eq!(mm[0], 2 * 8 * 32 * 784);
    assert!(step::step_flops(&g) > mm.iter().sum::<u64>());
}

fn cli(args: &[&str]) -> std::process::ExitCode {
    use clap::Parser;
    let mut all = vec!["tcc"];
    all.extend_from_slice(args);
    tcc::cli::run(tcc::cli::Cli::parse_from(all))
}

#[test]
fn build_with_a_budget_writes_an_artifact_whose_arena_fits() {
    let dir = std::env::temp_dir().join(format!("tcc-remat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("gpt.tcc");
    let file = tcc_tests::root().join("examples/gpt.tdsl");
    let mut args: Vec<String> = vec!["build".into(), file.display().to_string()];
    for (k, v) in GPT {
        args.push("--set".into());
        args.push(format!("{k}={v}"));
    }
    let g = graph("examples/gpt.tdsl", GPT);
    let base = step::measure(&g, &BTreeSet::new(), &CompileOptions::default()).unwrap();
    let budget = base.persistent + (base.arena - base.persistent) * 6 / 10;
    args.extend(
        [
            "--emit",
            "artifact",
            "--remat-time-ms",
            "300",
            "--mem-budget",
            &budget.to_string(),
            "-o",
            &out.display().to_string(),
        ]
        .map(String::from),
    );
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_eq!(cli(&refs), std::process::ExitCode::SUCCESS);
    let m = tcc_runtime::Model::load(&out).unwrap();
    assert!(m.arena_bytes() as u64 <= budget);
    assert!((m.arena_bytes() as u64) < base.arena);
    // The same budget without recomputation is refused, and `auto` needs a budget (the
    // stage's errors, which the CLI prints).
    let refused = |mode, budget| {
        let o = tcc::pipeline::RematOptions {
            mode,
            budget,
            ..Default::default()
        };
        step::decide(&g, &o, CompileOptions::default())
            .err()
            .unwrap_or_default()
    };
    let e = refused(step::Mode::None, Some(budget));
    assert!(e.contains("over --mem-budget"), "{e}");
    let e = refused(step::Mode::Auto, None);
    assert!(e.contains("needs a budget"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fit_finds_a_larger_batch_with_remat() {
    use tcc::cli::RematMode;
    let file = tcc_tests::root().join("examples/gpt.tdsl");
    let sets: Vec<(String, String)> = GPT
        .iter()
        .filter(|(k, _)| *k != "B")
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let g = graph("examples/gpt.tdsl", GPT);
    let base = step::measure(&g, &BTreeSet::new(), &CompileOptions::default()).unwrap();
    // The B=2 arena: without remat B=2 is the answer; recomputation fits more.
    let budget = base.arena;
    let fit = |remat| {
        tcc::cli::fit::run(
            &file,
            &sets,
            &None,
            budget,
            "B",
            64,
            remat,
            200,
            Default::default(),
            Default::default(),
        )
        .unwrap()
    };
    let plain = fit(RematMode::None);
    let with = fit(RematMode::Auto);
    assert_eq!(plain, 2);
    assert!(with > plain, "{with} vs {plain}");
}

/// Free recomputation, the default (issue 27): on a small cnn (each block's `relu` outputs
/// rebuilt from the convolution's output and the norm's statistics) and a small gpt (the
/// `gelu` outputs), on both targets, the arena drops, a kernel is added only for a clone
/// no backward kernel of its shape can store (the cnn's residual block outputs: the gpt
/// has none), and the step trains as the one that stores them.
#[test]
fn free_recomputation_lowers_the_arena_and_trains_alike() {
    // Sizes where the recomputed values (at least 64 KiB each) are what the peak holds.
    const CNN_FREE: &[(&str, &str)] = &[("B", "32"), ("C", "8"), ("S", "16")];
    const GPT_FREE: &[(&str, &str)] = &[
        ("L", "2"),
        ("D", "64"),
        ("H", "2"),
        ("T", "64"),
        ("B", "4"),
        ("V", "64"),
    ];
    for (file, sets) in [
        ("examples/cnn.tdsl", CNN_FREE),
        ("examples/gpt.tdsl", GPT_FREE),
    ] {
        let g = graph(file, sets);
        for device in [tcc_runtime::Device::Cpu, tcc_runtime::Device::Cuda(0)] {
            let opts = tcc_tests::device_options(device, true);
            // Free recomputation alone (on CUDA, product recomputation follows it).
            let (h, f) = step::free_with(&g, &opts, false).unwrap();
            let f = f.unwrap_or_else(|| panic!("{file} on {device:?}: no candidates"));
            assert!(f.kept, "{file} on {device:?}: {}", f.line());
            assert!(f.values > 0 && f.bytes > 0, "{file}: {}", f.line());
            // Kernels are added only for clones with no backward kernel of their shape
            // to host them: the cnn's residual block outputs, read by the next stage's
            // weight gradients (kept because the arena is lower with them).
            assert!(
                f.kernels.1 <= f.kernels.0 + f.own_kernels,
                "{file}: {}",
                f.line()
            );
            assert_eq!(
                f.own_kernels > 0,
                file.contains("cnn"),
                "{file}: {}",
                f.line()
            );
            assert!(f.arena.1 < f.arena.0, "{file}: {}", f.line());
            assert!(
                f.seconds.1 <= f.seconds.0 * (1.0 + step::FREE_TOTAL_SHARE),
                "{file}: {}",
                f.line()
            );
            let p = artifact::plan_step(&h, &opts).unwrap();
            assert_eq!(p.plan.arena_bytes, f.arena.1, "{file} on {device:?}");
            // Some clones are stored by another kernel (the horizontal hosts).
            let hosted = p
                .fused
                .kernels
                .iter()
                .flat_map(|k| k.stores.iter().skip(1))
                .filter(|s| p.graph.node(s.buf).recomputed.is_some())
                .count();
            assert!(hosted > 0, "{file} on {device:?}: no clone is hosted");
            if device == tcc_runtime::Device::Cpu {
                same_training(&g, &h);
            }
        }
    }
}

/// The loads of a kernel's stored value `s`.
fn loads_of(k: &tcc::kernel::Kernel, s: &tcc::kernel::Store) -> BTreeSet<tcc::ir::NodeId> {
    tcc::kernel::lower::reachable(&k.pool, &[s.value])
        .into_iter()
        .filter_map(|e| match *k.pool.get(e) {
            tcc::kernel::E::Load { buf, .. } => Some(buf),
            _ => None,
        })
        .collect()
}

/// Free recomputation under `--amp`, and where a clone a product reads is stored. Under
/// bf16 (the 16-bit casts keep their clones' marks) the small gpt's and cnn's arenas drop,
/// with kernels added only for clones stored by kernels of their own, as in f32. Each `gelu` clone of the gpt is stored by the kernel of
/// its own layer's input gradient (`(dy w2ᵀ) gelu'(h)`), which reads `h` anyway: the clone
/// reads no buffer its host's own value does not (the schedule ran the weight gradient
/// first, and the clone went to the next layer's kernel, which read the other layer's `h`
/// for it).
#[test]
fn free_recomputation_under_mixed_precision_stores_clones_beside_their_own_layer() {
    let cases = [
        ("examples/gpt.tdsl", GPT_3, tcc::passes::amp::Amp::default()),
        ("examples/gpt.tdsl", GPT_3, amp("bf16")),
        (
            "examples/cnn.tdsl",
            &[("B", "32"), ("C", "8"), ("S", "16")],
            amp("bf16"),
        ),
    ];
    for (file, sets, amp) in cases {
        let g = graph(file, sets);
        let opts = CompileOptions {
            amp,
            ..tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true)
        };
        let (h, f) = step::free(&g, &opts).unwrap();
        let f = f.unwrap_or_else(|| panic!("{file} {}: no candidates", amp.name()));
        assert!(f.kept, "{file} {}: {}", amp.name(), f.line());
        assert!(
            f.kernels.1 <= f.kernels.0 + f.own_kernels,
            "{file}: {}",
            f.line()
        );
        assert!(f.arena.1 < f.arena.0, "{file}: {}", f.line());
        if !file.contains("gpt") {
            continue;
        }
        let p = artifact::plan_step(&h, &opts).unwrap();
        let mut gelus = 0;
        for k in &p.fused.kernels {
            let Some(root) = k.stores.first() else {
                continue;
            };
            for s in k.stores.iter().skip(1) {
                let node = p.graph.node(s.buf);
                if node.recomputed.is_none()
                    || !matches!(node.op, tcc::ir::Op::Unary(tcc::ir::UnaryOp::Gelu))
                {
                    continue;
                }
                gelus += 1;
                let (mine, host) = (loads_of(k, s), loads_of(k, root));
                assert!(
                    mine.is_subset(&host),
                    "{}: a gelu clone reads {mine:?}, its host {host:?}",
                    amp.name()
                );
            }
        }
        // Layers 0 and 1 (the last layer's backward pass reads its gelu output at once).
        assert!(gelus >= 2, "{}: {gelus} hosted gelu clones", amp.name());
    }
}

/// Product recomputation under `--amp` on CUDA: each layer's fc1 product of the gpt (its
/// result 4 times the normalised input it is made from, read backward only by `gelu`'s
/// derivative and the recomputed `gelu`) is recomputed in the backward pass. The arena
/// drops, the FLOPs it adds stay within their share, the report counts the products' 16-bit
/// bytes, the step trains exactly as the one that stores them (f32, on the CPU), and a CPU
/// step recomputes no product.
#[test]
fn fc1_products_are_recomputed_under_mixed_precision_and_train_alike() {
    let g = graph("examples/gpt.tdsl", GPT_3);
    let cuda = tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true);
    let opts = CompileOptions {
        amp: amp("bf16"),
        ..cuda
    };
    let (h, f) = step::free(&g, &opts).unwrap();
    let p = f
        .and_then(|f| f.products)
        .unwrap_or_else(|| panic!("no product was a candidate"));
    assert!(p.kept, "{}", p.line());
    assert_eq!(p.values, 3, "{}", p.line());
    assert!(p.arena.1 < p.arena.0, "{}", p.line());
    assert!(
        p.flops.0 > 0 && p.flops.0 as f64 <= step::PRODUCT_FLOP_SHARE * p.flops.1 as f64,
        "{}",
        p.line()
    );
    let clones: Vec<_> = h
        .node_ids()
        .filter(|&n| h.node(n).recomputed.is_some() && h.node(n).op == tcc::ir::Op::MatMul)
        .collect();
    assert_eq!(clones.len(), 3, "recomputed products {clones:?}");
    // Their bytes are the 16-bit copies the step stores, not their f32 size.
    let stored: u64 = clones
        .iter()
        .map(|&n| h.ty(n).shape.numel() as u64 * 2)
        .sum();
    assert_eq!(p.bytes, stored, "{}", p.line());
    let planned = artifact::plan_step(&h, &opts).unwrap();
    assert_eq!(planned.plan.arena_bytes, p.arena.1);
    // Each recomputed product casts its weight to bf16 again, in the backward pass, rather
    // than keep the forward's copy alive in between.
    let pg = &planned.graph;
    let mut casts = 0;
    for n in pg.node_ids() {
        if pg.node(n).recomputed.is_none() || pg.node(n).op != tcc::ir::Op::MatMul {
            continue;
        }
        for &i in &pg.node(n).inputs {
            let c = pg.view_root(i);
            if matches!(pg.node(c).op, tcc::ir::Op::Cast { .. })
                && pg.node(pg.view_root(pg.node(c).inputs[0])).op.is_source()
            {
                assert!(
                    pg.node(c).backward,
                    "{n:?} reads the forward's weight copy {c:?}"
                );
                casts += 1;
            }
        }
    }
    assert_eq!(casts, 3);
    same_training(&g, &h);
    let cpu = tcc_tests::device_options(tcc_runtime::Device::Cpu, true);
    for o in [
        CompileOptions {
            amp: amp("bf16"),
            ..cpu
        },
        cpu,
    ] {
        let (_, f) = step::free(&g, &o).unwrap();
        assert!(
            f.as_ref().is_some_and(|f| f.products.is_none()),
            "the CPU: {:?}",
            f.and_then(|f| f.products).map(|p| p.line())
        );
    }
}

/// Product recomputation in f32 on CUDA: gpt's fc1 products are taken first in program
/// order within their FLOP share, and the last ones left out until free and product
/// recomputation together stay within `FREE_TOTAL_SHARE` of the step's estimated time.
/// Kept, the arena drops. (That recomputed products train as stored ones do is the
/// `--amp` test's: the same `apply`.)
#[test]
fn f32_products_are_recomputed_within_the_time_share() {
    let g = graph("examples/gpt.tdsl", &[("L", "3"), ("T", "256"), ("B", "8")]);
    let cuda = tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true);
    let (h, f) = step::free(&g, &cuda).unwrap();
    let f = f.unwrap_or_else(|| panic!("no free recomputation"));
    let p = f
        .products
        .clone()
        .unwrap_or_else(|| panic!("no product was a candidate"));
    assert!(p.kept, "{}", p.line());
    assert!(p.arena.1 < p.arena.0, "{}", p.line());
    assert!(
        p.flops.0 > 0 && p.flops.0 as f64 <= step::PRODUCT_F32_FLOP_SHARE * p.flops.1 as f64,
        "{}",
        p.line()
    );
    let planned = artifact::plan_step(&h, &cuda).unwrap();
    assert_eq!(planned.plan.arena_bytes, p.arena.1);
    let secs = tcc::kernel::peak::step_seconds(&planned.graph, &planned.fused);
    assert!(
        secs <= f.seconds.0 * (1.0 + step::FREE_TOTAL_SHARE),
        "{secs} s against {} s before",
        f.seconds.0
    );
    // The time bound, not the FLOP share, is what stops it: fewer products are kept than
    // the FLOP share takes.
    let free_only = step::free_with(&g, &cuda, false).unwrap().0;
    let candidates = step::product_candidates(&free_only, step::PRODUCT_F32_FLOP_SHARE)
        .into_iter()
        .filter(|&n| free_only.node(n).op == tcc::ir::Op::MatMul)
        .count();
    assert!(
        p.values >= 1 && p.values < candidates,
        "{} of {candidates} candidates: {}",
        p.values,
        p.line()
    );
}

fn amp(name: &str) -> tcc::passes::amp::Amp {
    tcc::passes::amp::Amp::named(name).unwrap()
}

/// The pipeline's `remat` stage alone on `g`.
fn remat_stage(
    g: &tcc::ir::Graph,
    opts: &tcc::pipeline::Options,
) -> (tcc::pipeline::Product, tcc::pipeline::Report) {
    tcc::pipeline::run(
        tcc::pipeline::Product::Graph(g.clone()),
        "remat",
        "remat",
        opts,
        &mut |_, _| {},
    )
    .unwrap()
}

/// `--no-product-remat` (`RematOptions::products` off) keeps gpt's fc1 products under
/// `--amp` and still recomputes the free values; the default recomputes both.
#[test]
fn no_product_remat_keeps_the_products_and_free_recomputation() {
    let g = graph("examples/gpt.tdsl", GPT_3);
    let cuda = tcc_tests::device_options(tcc_runtime::Device::Cuda(0), true);
    let run = |products: bool| {
        let opts = tcc::pipeline::Options {
            remat: tcc::pipeline::RematOptions {
                products,
                ..Default::default()
            },
            compile: CompileOptions {
                amp: amp("bf16"),
                ..cuda
            },
            ..Default::default()
        };
        let (p, report) = remat_stage(&g, &opts);
        let h = p.graph();
        let matmuls = h
            .node_ids()
            .filter(|&n| h.node(n).recomputed.is_some() && h.node(n).op == tcc::ir::Op::MatMul)
            .count();
        let free = report
            .free
            .unwrap_or_else(|| panic!("no free recomputation"));
        (matmuls, free)
    };
    let (matmuls, free) = run(false);
    assert_eq!(matmuls, 0);
    assert!(free.kept && free.values > 0 && free.products.is_none());
    let (matmuls, free) = run(true);
    assert_eq!(matmuls, 3);
    assert!(free.kept && free.products.is_some_and(|p| p.kept));
}

/// `--remat none` turns free recomputation off; the default keeps it.
#[test]
fn remat_none_stores_what_the_forward_pass_made() {
    let g = graph("examples/cnn.tdsl", &[("B", "32"), ("C", "8"), ("S", "16")]);
    let run = |mode: step::Mode| {
        let opts = tcc::pipeline::Options {
            remat: tcc::pipeline::RematOptions {
                mode,
                ..Default::default()
            },
            ..Default::default()
        };
        let (p, report) = remat_stage(&g, &opts);
        let recomputed = p
            .graph()
            .node_ids()
            .filter(|&n| p.graph().node(n).recomputed.is_some())
            .count();
        (recomputed, report.free)
    };
    let (none, free) = run(step::Mode::None);
    assert_eq!((none, free), (0, None));
    let (some, free) = run(step::Mode::Manual);
    assert!(some > 0 && free.is_some_and(|f| f.kept));
}
