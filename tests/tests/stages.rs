//! Snapshot tests of every stage of the pipeline (`tcc::pipeline::PIPELINE`).
//!
//! `tests/cases/<stage>/*.tdsl` holds the cases of each stage: the program runs through the
//! stages before it, and its product just before and just after the stage is snapshotted
//! (`stage_<stage>__<case>`). Every case states what the stage must do in checked headers:
//! - `// expect-changed: true|false` (required): whether the stage changes the product's
//!   text (`lower` always turns source into a graph);
//! - `// expect-contains: TEXT` / `// expect-lacks: TEXT` (repeatable): in the product after
//!   the stage, as `--print-after` shows it;
//! - `// expect-count: N TEXT` (repeatable): TEXT occurs exactly N times after the stage;
//! - `// expect-kernels: N` (from `fuse` on): the number of kernels;
//! - `// expect-arena-bytes: <= N` or `== N` (from `plan` on): the planned arena.
//!
//! Options: `// target: cuda` (default: cpu), `// remat-budget: BYTES` (`--mem-budget` with
//! `--remat auto`), `// amp: bf16|f16` (`--amp`, with its default loss scaling). A stage added to the table without two cases fails
//! `every_stage_has_cases`.

use tcc::artifact::{CompileOptions, Target};
use tcc::pipeline::{self, Product, RematOptions, PIPELINE};
use tcc_tests::{compile_bytes, root, tdsl_files};

/// Every `// key: value` header line of a case, in order.
fn headers<'a>(src: &'a str, key: &str) -> Vec<&'a str> {
    let prefix = format!("// {key}:");
    src.lines()
        .take_while(|l| l.starts_with("//") || l.trim().is_empty())
        .filter_map(|l| l.strip_prefix(prefix.as_str()).map(str::trim))
        .collect()
}

fn options(src: &str) -> pipeline::Options {
    let target = match headers(src, "target").first().copied() {
        Some("cuda") => Target::Cuda,
        Some("cpu") | None => Target::Cpu,
        Some(t) => panic!("unknown target `{t}`"),
    };
    let mut compile = CompileOptions {
        target,
        ..CompileOptions::default()
    };
    compile.fuse.channels_last = target == Target::Cuda;
    if let Some(a) = headers(src, "amp").first() {
        compile.amp = tcc::passes::amp::Amp::named(a).expect("amp: off, bf16 or f16");
    }
    let remat = match headers(src, "remat-budget").first() {
        Some(b) => RematOptions {
            mode: tcc::remat::step::Mode::Auto,
            budget: Some(b.parse().expect("remat-budget: bytes")),
            ..RematOptions::default()
        },
        None => RematOptions::default(),
    };
    pipeline::Options {
        compile,
        remat,
        verify: true,
        ..Default::default()
    }
}

/// The product just before `stage` and just after it (as text, and the product after).
fn around(stage: usize, src: &str, name: &str) -> (String, String, Product) {
    let opts = options(src);
    let (sources, mut lowered) =
        compile_bytes(&format!("{name}.tdsl"), src.as_bytes(), &Default::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    let g = lowered.graphs.remove(0);
    let fail = |e: pipeline::StageError| -> ! {
        panic!(
            "{name}: {}",
            tcc_grammar::diag::render_all(&e.diagnostics(), &sources.map)
        )
    };
    let this = PIPELINE[stage].name;
    if stage == 0 {
        let (after, _) = pipeline::lowered(g, Default::default(), this, &opts, &mut |_, _| {})
            .unwrap_or_else(|e| fail(e));
        return (src.to_string(), after.render(None), after);
    }
    let before_stage = PIPELINE[stage - 1].name;
    let (before, _) = pipeline::lowered(g, Default::default(), before_stage, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| fail(e));
    let before_text = before.render(None);
    let (after, _) =
        pipeline::run(before, this, this, &opts, &mut |_, _| {}).unwrap_or_else(|e| fail(e));
    (before_text, after.render(None), after)
}

fn kernels_and_arena(p: &Product) -> (Option<usize>, Option<u64>) {
    match p {
        Product::Kernels(k) => (Some(k.fused.kernels.len()), None),
        Product::Planned(p) => (Some(p.fused.kernels.len()), Some(p.plan.arena_bytes)),
        Product::Code(c) => (Some(c.fused.kernels.len()), Some(c.plan.arena_bytes)),
        Product::Graph(_) => (None, None),
    }
}

fn check_case(stage: usize, path: &std::path::Path) {
    let src = std::fs::read_to_string(path).unwrap();
    let case = path.file_stem().unwrap().to_string_lossy().to_string();
    let name = format!("{}/{case}", PIPELINE[stage].name);
    let (before, after, product) = around(stage, &src, &case);
    let changed = match headers(&src, "expect-changed").first().copied() {
        Some("true") => true,
        Some("false") => false,
        other => panic!("{name}: `// expect-changed: true|false` is required, found {other:?}"),
    };
    assert_eq!(before != after, changed, "{name}: changed?\n{after}");
    for t in headers(&src, "expect-contains") {
        assert!(
            after.contains(t),
            "{name}: no `{t}` after the stage:\n{after}"
        );
    }
    for t in headers(&src, "expect-lacks") {
        assert!(
            !after.contains(t),
            "{name}: `{t}` after the stage:\n{after}"
        );
    }
    for c in headers(&src, "expect-count") {
        let (n, t) = c.split_once(' ').expect("expect-count: N TEXT");
        let n: usize = n.parse().expect("expect-count: N TEXT");
        assert_eq!(after.matches(t).count(), n, "{name}: `{t}` count:\n{after}");
    }
    let (kernels, arena) = kernels_and_arena(&product);
    if let Some(k) = headers(&src, "expect-kernels").first() {
        let want: usize = k.parse().expect("expect-kernels: N");
        assert_eq!(kernels, Some(want), "{name}: kernels\n{after}");
    }
    if let Some(a) = headers(&src, "expect-arena-bytes").first() {
        let arena = arena.unwrap_or_else(|| panic!("{name}: no plan after this stage"));
        match a.split_once(' ') {
            Some(("<=", n)) => assert!(arena <= n.parse::<u64>().unwrap(), "{name}: {arena}"),
            Some(("==", n)) => assert_eq!(arena, n.parse::<u64>().unwrap(), "{name}"),
            _ => panic!("{name}: `// expect-arena-bytes: <= N` or `== N`"),
        }
    }
    insta::assert_snapshot!(
        format!("stage_{}__{case}", PIPELINE[stage].name),
        format!(
            "// ----- before {0} -----\n{before}\n// ----- after {0} -----\n{after}",
            PIPELINE[stage].name
        )
    );
}

#[test]
fn every_stage_has_cases() {
    for s in PIPELINE {
        let dir = root().join("tests/cases").join(s.name);
        let n = if dir.is_dir() {
            tdsl_files(&format!("tests/cases/{}", s.name)).len()
        } else {
            0
        };
        assert!(
            n >= 2,
            "stage `{}` has {n} cases in {}: add at least two",
            s.name,
            dir.display()
        );
    }
}

#[test]
fn stage_cases() {
    for (i, s) in PIPELINE.iter().enumerate() {
        for f in tdsl_files(&format!("tests/cases/{}", s.name)) {
            check_case(i, &f);
        }
    }
}
