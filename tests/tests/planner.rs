//! The memory planner: liveness with views and in-place reuse, plans that verify on every
//! example and on random programs, offset assignment on random interval sets and on the
//! MiniMalloc example, memory-aware scheduling, and the `tcc mem` report.

use proptest::prelude::*;
use std::time::Duration;
use tcc::analysis::arena::{self, Interval};
use tcc::analysis::liveness::{liveness, BufferKind};
use tcc::eager::{self, Precision};
use tcc::front::Options;
use tcc::ir::Graph;
use tcc::plan;
use tcc_tests::*;

/// The graph after autodiff (program order) and after the whole pipeline (scheduled).
fn graphs(src: &str, opts: &Options) -> (Graph, Graph) {
    let g = tcc_tests::compile_to(src, opts, "autodiff").unwrap_or_else(|e| panic!("{e}"));
    let s = tcc_tests::run_stages(&g, "schedule", "schedule", Default::default())
        .unwrap_or_else(|e| panic!("{e}"));
    (g, s.graph().clone())
}

#[test]
fn elementwise_chains_run_in_place_and_views_share_bytes() {
    let (g, _) = graphs(
        "model m {\n input x: f32[64]\n let a = exp(x)\n let b = a * 2\n let c = relu(b)\n let d = reshape(c, [8, 8])\n let e = transpose(d)\n output e\n}\n",
        &Options::default(),
    );
    let order = g.topo_order().unwrap();
    let lv = liveness(&g, &order);
    // One input buffer, one transient buffer for exp, mul, relu (in place), reshape and
    // transpose (views); the literal 2 has none.
    let kinds: Vec<BufferKind> = lv.buffers.iter().map(|b| b.kind).collect();
    assert_eq!(kinds, vec![BufferKind::Input, BufferKind::Transient]);
    assert_eq!(lv.buffers[1].nodes.len(), 5);
    assert_eq!(lv.in_place.len(), 2);
    assert!(lv.buffers[1].output);
    let p = plan::plan(&g, Duration::from_millis(100));
    plan::verify(&g, &p).unwrap();
    assert_eq!(p.arena_bytes, 512, "two 256-byte buffers");
}

#[test]
fn no_in_place_when_the_operand_is_still_needed() {
    let (g, _) = graphs(
        "model m {\n input x: f32[64]\n let a = exp(x)\n let b = a * 2\n let c = a + b\n output c\n}\n",
        &Options::default(),
    );
    let lv = liveness(&g, &g.topo_order().unwrap());
    // b cannot overwrite a (read again by c); c may overwrite b, not a.
    assert_eq!(lv.in_place.len(), 1);
    let transient = lv
        .buffers
        .iter()
        .filter(|b| b.kind == BufferKind::Transient)
        .count();
    assert_eq!(transient, 2);
}

#[test]
fn updates_write_params_in_place() {
    let (_, s) = graphs(
        "model m {\n input x: f32[64]\n param w: f32[64] = ones\n let loss = sum(x * w)\n train sgd(lr: 0.1) minimize loss\n}\n",
        &Options::default(),
    );
    let p = plan::plan(&s, Duration::from_millis(100));
    plan::verify(&s, &p).unwrap();
    let (t, v) = s.updates[0];
    assert_eq!(
        p.offset_of(t),
        p.offset_of(v),
        "the new value is written over the param"
    );
    assert_eq!(p.persistent_bytes, 256);
}

#[test]
fn the_plan_verifier_names_every_overlap() {
    // Moving one buffer onto another live at the same time is caught, whichever two, and
    // the error names exactly the pairs that now share bytes (brute force).
    let src = std::fs::read_to_string(root().join("examples/mlp.tdsl")).unwrap();
    let (_, s) = graphs(&src, &Options::default());
    let good = plan::plan(&s, Duration::from_millis(100));
    plan::verify(&s, &good).unwrap();
    let bufs = &good.liveness.buffers;
    let live_together = |i: usize, j: usize| {
        let (a, b) = (&bufs[i], &bufs[j]);
        a.bytes > 0 && b.bytes > 0 && a.start < b.end && b.start < a.end
    };
    let mut tried = 0;
    for i in 0..bufs.len() {
        for j in 0..bufs.len() {
            if i == j || !live_together(i, j) || (i * 7 + j) % 5 != 0 {
                continue;
            }
            let mut bad = good.clone();
            bad.offsets[i] = bad.offsets[j];
            let mut want: Vec<(usize, usize)> = Vec::new();
            for a in 0..bufs.len() {
                for b in a + 1..bufs.len() {
                    let (oa, ob) = (bad.offsets[a], bad.offsets[b]);
                    if live_together(a, b) && oa < ob + bufs[b].bytes && ob < oa + bufs[a].bytes {
                        want.push((a, b));
                    }
                }
            }
            let errs = plan::verify(&s, &bad).expect_err("overlap not caught");
            let mut got: Vec<(usize, usize)> = errs
                .iter()
                .filter_map(|e| match e {
                    plan::PlanError::Overlap(a, b) => Some((*a, *b)),
                    _ => None,
                })
                .collect();
            got.sort_unstable();
            assert_eq!(got, want, "buffer {i} moved onto {j}");
            tried += 1;
        }
    }
    assert!(tried > 20, "{tried} cases");
}

#[test]
fn every_example_plans_and_verifies_between_the_bounds() {
    for (ex, set) in [
        ("tiny", ""),
        ("mlp", ""),
        ("cnn", "--set B=8"),
        ("gpt", "--set L=2 --set T=128"),
    ] {
        let src = std::fs::read_to_string(root().join(format!("examples/{ex}.tdsl"))).unwrap();
        let (program, scheduled) = graphs(&src, &options_from_args(set));
        let p = plan::plan(&scheduled, Duration::from_millis(300));
        plan::verify(&scheduled, &p).unwrap_or_else(|e| panic!("{ex}: {e:?}"));
        assert!(
            p.lower_bound <= p.arena_bytes && p.arena_bytes <= p.no_reuse_bytes,
            "{ex}"
        );
        // Scheduling never raises max-live.
        let before = liveness(&program, &program.topo_order().unwrap()).max_live();
        let after = liveness(&scheduled, &scheduled.topo_order().unwrap()).max_live();
        assert!(after <= before, "{ex}: {after} > {before}");
    }
}

#[test]
fn scheduling_preserves_results() {
    let src = std::fs::read_to_string(root().join("examples/mlp.tdsl")).unwrap();
    let (program, scheduled) = graphs(&src, &options_from_args("--set B=8 --set D=16"));
    assert_ne!(program.topo_order().unwrap().len(), 0);
    let inputs = eager::random_inputs(&program, 3);
    let run = |g: &Graph| {
        let mut p = eager::init_persistent(g, 0);
        let mut outs = Vec::new();
        for _ in 0..3 {
            outs = eager::run_step(g, &mut p, &inputs, Precision::Native).unwrap();
        }
        (outs, p)
    };
    let (a, pa) = run(&program);
    let (b, pb) = run(&scheduled);
    assert_eq!(a, b);
    assert_eq!(pa, pb);
}

#[test]
fn minimalloc_example_is_solved_optimally() {
    let text =
        std::fs::read_to_string(root().join("../shared/bench/minimalloc/input.12.csv")).unwrap();
    let (_, iv) = arena::parse_csv(&text).unwrap();
    let r = arena::plan(&iv, 1, Duration::from_millis(500));
    arena::verify(&iv, &r.placement, 1).unwrap();
    assert_eq!(r.placement.size, 12);
    assert!(r.optimal);
}

#[test]
fn minimalloc_instance_c_reaches_its_lower_bound() {
    let text =
        std::fs::read_to_string(root().join("../shared/bench/minimalloc/C.1048576.csv")).unwrap();
    let (_, iv) = arena::parse_csv(&text).unwrap();
    let r = arena::plan(&iv, 1, Duration::from_secs(4));
    arena::verify(&iv, &r.placement, 1).unwrap();
    assert_eq!(r.lower_bound, 1_039_360);
    assert!(r.placement.size <= 1_048_576, "{}", r.placement.size);
}

fn intervals() -> impl Strategy<Value = Vec<Interval>> {
    prop::collection::vec((0u64..40, 1u64..20, 1u64..64), 1..60).prop_map(|v| {
        v.into_iter()
            .map(|(lo, len, size)| Interval {
                lower: lo,
                upper: lo + len,
                size,
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(tcc_tests::proptest_config(200))]

    #[test]
    fn random_interval_sets_plan_between_the_bounds(iv in intervals(), align in prop::sample::select(vec![1u64, 8, 256])) {
        let r = arena::plan(&iv, align, Duration::from_millis(20));
        prop_assert!(arena::verify(&iv, &r.placement, align).is_ok());
        let sum: u64 = iv.iter().map(|v| v.size.div_ceil(align) * align).sum();
        prop_assert!(arena::max_live(&iv) <= r.placement.size);
        prop_assert!(r.lower_bound <= r.placement.size && r.placement.size <= sum);
    }

    #[test]
    fn random_programs_plan_and_verify(ops in prop::collection::vec((0usize..6, 0usize..8, 0usize..8), 1..14), train in any::<bool>()) {
        // Values of shape [4, 8] built from random ops over earlier values.
        let mut src = String::from("model m {\n input x: f32[4, 8]\n param w: f32[8, 8] = normal(0.0, 0.1)\n let v0 = x @ w\n");
        for (k, (op, a, b)) in ops.iter().enumerate() {
            let (a, b) = (a % (k + 1), b % (k + 1));
            let e = match op {
                0 => format!("v{a} + v{b}"),
                1 => format!("tanh(v{a}) * v{b}"),
                2 => format!("v{a} @ w"),
                3 => format!("softmax(v{a})"),
                4 => format!("v{a} - mean(v{b}, axis: 0, keepdim: true)"),
                _ => format!("transpose(transpose(v{a})) * 0.5"),
            };
            src.push_str(&format!(" let v{} = {e}\n", k + 1));
        }
        let last = ops.len();
        src.push_str(&format!(" let loss = sum(v{last} * v{last})\n output loss, v{}\n", last / 2));
        if train {
            src.push_str(" train adam(lr: 0.01) minimize loss\n");
        }
        src.push_str("}\n");
        let (_, s) = graphs(&src, &Options::default());
        let p = plan::plan(&s, Duration::from_millis(50));
        prop_assert!(plan::verify(&s, &p).is_ok(), "{src}");
        prop_assert!(p.lower_bound <= p.arena_bytes && p.arena_bytes <= p.no_reuse_bytes);
    }
}

fn mem_text(ex: &str, set: &str) -> (String, String) {
    let src = std::fs::read_to_string(root().join(format!("examples/{ex}.tdsl"))).unwrap();
    let opts = options_from_args(set);
    let (sources, _) =
        compile_bytes(&format!("examples/{ex}.tdsl"), src.as_bytes(), &opts).unwrap();
    let (program, scheduled) = graphs(&src, &opts);
    let f = tcc::cli::mem::report(
        &program,
        &scheduled,
        &sources,
        Duration::from_millis(500),
        &Default::default(),
        None,
    )
    .unwrap();
    let svg = tcc::cli::plan_svg::render(&f.graph, &f.plan, &f.eager, &sources.map);
    (tcc::cli::mem::text(&f.report, false), svg)
}

#[test]
fn mem_report_snapshots_and_svg_is_well_formed_xml() {
    for (ex, set) in [
        ("tiny", ""),
        ("mlp", ""),
        ("cnn", "--set B=8"),
        ("gpt", "--set L=2"),
    ] {
        let (text, svg) = mem_text(ex, set);
        insta::assert_snapshot!(format!("mem_{ex}"), text);
        let doc = roxmltree::Document::parse(&svg)
            .unwrap_or_else(|e| panic!("{ex}: SVG is not XML: {e}"));
        let rects = doc.descendants().filter(|n| n.has_tag_name("rect")).count();
        assert!(rects > 2, "{ex}: buffers drawn");
        let titled = doc
            .descendants()
            .filter(|n| n.has_tag_name("title"))
            .count();
        assert!(titled > 1, "{ex}: hover titles");
    }
}
