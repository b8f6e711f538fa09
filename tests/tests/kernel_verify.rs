//! The kernel-IR verifiers (`kernel::verify`): they accept what the compiler produces for
//! every example and bench model, and report each kind of corruption of a real program.

use std::time::Duration;
use tcc::artifact::{plan_step, CompileOptions, Planned, Target};
use tcc::ir::NodeId;
use tcc::kernel::fuse::FuseOptions;
use tcc::kernel::offsets::Offsets;
use tcc::kernel::verify::{check_kernels, verify_kernels, verify_planned, KernelError};
use tcc::kernel::E;
use tcc_tests::{compile_pipeline, options_from_args, root};

/// Small sizes of the examples (the verifiers are symbolic, but planning is not free).
fn small(file: &str) -> &'static str {
    match file {
        "gpt" => "--set L=2 --set D=64 --set H=2 --set T=64 --set B=2 --set V=128",
        "cnn" => "--set B=4 --set C=16 --set S=16",
        "mlp" => "--set B=8 --set D=32",
        "add" | "gelu" => "--set N=256 --set M=64",
        "gemm_f32" | "gemm_bf16" => "--set N=128",
        _ => "",
    }
}

fn planned(dir: &str, file: &str, target: Target, fuse: bool) -> Planned {
    let src = std::fs::read_to_string(root().join(format!("{dir}/{file}.tdsl")))
        .unwrap_or_else(|e| panic!("{dir}/{file}: {e}"));
    let g = compile_pipeline(&src, &options_from_args(small(file)))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let opts = CompileOptions {
        target,
        fuse: FuseOptions {
            fuse,
            ..Default::default()
        },
        plan_budget: Duration::from_millis(20),
        ..Default::default()
    };
    plan_step(&g, &opts).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn files(dir: &str) -> Vec<String> {
    tcc_tests::tdsl_files(dir)
        .iter()
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
        .collect()
}

#[test]
fn every_example_and_bench_model_verifies() {
    let mut checked = 0;
    for dir in ["examples", "bench"] {
        for file in files(dir) {
            for target in [Target::Cpu, Target::Cuda] {
                for fuse in [true, false] {
                    let p = planned(dir, &file, target, fuse);
                    let what = format!("{dir}/{file} {target:?} fuse={fuse}");
                    assert!(!p.fused.kernels.is_empty(), "{what}: no kernels");
                    if let Err(e) = verify_kernels(&p.graph, &p.fused) {
                        panic!("{what}: {}", lines(&e));
                    }
                    if let Err(e) = verify_planned(&p.graph, &p.fused, &p.plan) {
                        panic!("{what}: {}", lines(&e));
                    }
                    checked += 1;
                }
            }
        }
    }
    // 4 examples and 6 bench models, 4 ways each.
    assert!(checked >= 40, "{checked}");
}

fn lines(e: &[KernelError]) -> String {
    e.iter()
        .map(|x| format!("\n  {x}"))
        .collect::<Vec<_>>()
        .join("")
}

/// A real fused program to corrupt: gpt for CUDA (attention, an embedding scatter, Adam
/// updates stored in place).
fn gpt() -> Planned {
    planned("examples", "gpt", Target::Cuda, true)
}

fn is_leaf(p: &Planned, n: NodeId) -> bool {
    p.graph.inputs.contains(&n) || p.graph.params.contains(&n) || p.graph.states.contains(&n)
}

fn numel(p: &Planned, n: NodeId) -> u64 {
    p.graph.ty(n).shape.numel() as u64
}

fn kernel_errors(p: &Planned) -> Vec<KernelError> {
    match verify_kernels(&p.graph, &p.fused) {
        Ok(()) => panic!("the corruption went unnoticed"),
        Err(e) => e,
    }
}

fn plan_errors(p: &Planned) -> Vec<KernelError> {
    // The kernels themselves are intact.
    if let Err(e) = verify_kernels(&p.graph, &p.fused) {
        panic!("kernels: {}", lines(&e));
    }
    match verify_planned(&p.graph, &p.fused, &p.plan) {
        Ok(()) => panic!("the corruption went unnoticed"),
        Err(e) => e,
    }
}

/// The first kernel with a plain store (not accumulating, not attention) into a buffer of
/// more than one element whose index is affine in the domain: (kernel, its buffer).
fn plain_store(p: &Planned) -> (usize, NodeId) {
    p.fused
        .kernels
        .iter()
        .enumerate()
        .find_map(|(ki, k)| {
            let s = k.stores.first()?;
            let ok = k.attention.is_none()
                && !s.accumulate
                && numel(p, s.buf) > 1
                && k.pool.affine(s.index).is_some_and(|a| !a.terms.is_empty());
            ok.then_some((ki, s.buf))
        })
        .expect("a plain store")
}

#[test]
fn a_store_one_element_past_its_buffer_is_reported() {
    let mut p = gpt();
    let (ki, buf) = plain_store(&p);
    let len = numel(&p, buf);
    let k = &mut p.fused.kernels[ki];
    k.stores[0].index = k.pool.iadd_c(k.stores[0].index, 1);
    let name = k.name.clone();
    let errs = kernel_errors(&p);
    assert_eq!(
        errs,
        vec![KernelError::OutOfBounds {
            kernel: ki,
            name: name.clone(),
            buf: buf.index(),
            what: "store 0".into(),
            store: true,
            element: len as i64,
            len,
        }]
    );
    let msg = errs[0].to_string();
    assert_eq!(
        msg,
        format!(
            "kernel {ki} `{name}`: store 0 of %{} reaches element {len}, the buffer has {len}",
            buf.index()
        )
    );
}

#[test]
fn a_load_shifted_past_its_buffer_is_reported() {
    let mut p = gpt();
    // A kernel whose first store's value loads a non-leaf buffer at an affine index that
    // moves with the outermost loop variable.
    let (ki, buf) = p
        .fused
        .kernels
        .iter()
        .enumerate()
        .find_map(|(ki, k)| {
            let s = k.stores.first()?;
            if k.matmul.is_some() || k.attention.is_some() || k.domain.first()? < &2 {
                return None;
            }
            let mut stack = vec![s.value];
            while let Some(x) = stack.pop() {
                match k.pool.get(x) {
                    E::Load { buf, index, .. } => {
                        let moves = k.pool.affine(*index).is_some_and(|a| a.coef(0) > 0);
                        if moves && !is_leaf(&p, *buf) {
                            return Some((ki, *buf));
                        }
                    }
                    E::Un(_, a) | E::Cast(_, a) => stack.push(*a),
                    E::Bin(_, a, b) => stack.extend([*a, *b]),
                    E::Select(c, a, b) => stack.extend([*c, *a, *b]),
                    _ => {}
                }
            }
            None
        })
        .expect("a kernel loading a buffer along its outer loop");
    // v0 -> v0 + len in the value only: the load starts past the buffer's end.
    let len = numel(&p, buf) as i64;
    let k = &mut p.fused.kernels[ki];
    let v0 = k.pool.var(0);
    let shifted = k.pool.iadd_c(v0, len);
    k.stores[0].value = k.pool.substitute(k.stores[0].value, 0, shifted);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(|e| matches!(e, KernelError::OutOfBounds { kernel, buf: b, store: false, element, len: l, .. }
            if *kernel == ki && *b == buf.index() && *element >= *l as i64)),
        "{}",
        lines(&errs)
    );
    assert!(
        errs.iter().all(
            |e| matches!(e, KernelError::OutOfBounds { kernel, store: false, .. } if *kernel == ki)
        ),
        "{}",
        lines(&errs)
    );
}

#[test]
fn a_consumer_moved_before_its_producer_is_reported() {
    let mut p = gpt();
    // Adjacent kernels i, i + 1 where i + 1 reads a buffer only i writes before it.
    let stored_before = |p: &Planned, i: usize, n: NodeId| {
        p.fused.kernels[..i]
            .iter()
            .any(|k| k.stores.iter().any(|s| s.buf == n))
    };
    let (i, buf) = (0..p.fused.kernels.len() - 1)
        .find_map(|i| {
            let (a, b) = (&p.fused.kernels[i], &p.fused.kernels[i + 1]);
            b.loads().into_iter().find_map(|n| {
                (a.stores.iter().any(|s| s.buf == n) && !stored_before(&p, i, n)).then_some((i, n))
            })
        })
        .expect("a producer and its consumer");
    p.fused.kernels.swap(i, i + 1);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::ReadBeforeWrite { kernel, buf: b, .. }
            if *kernel == i && *b == buf.index())
        ),
        "{}",
        lines(&errs)
    );
}

#[test]
fn a_scatter_without_its_zero_fill_is_reported() {
    let mut p = gpt();
    let (ki, buf) = p
        .fused
        .kernels
        .iter()
        .enumerate()
        .find_map(|(ki, k)| {
            let s = k.stores.iter().find(|s| s.accumulate)?;
            Some((ki, s.buf))
        })
        .expect("gpt's embedding gradient accumulates");
    // The fill is the kernel before, storing the same buffer.
    assert!(p.fused.kernels[ki - 1].stores.iter().any(|s| s.buf == buf));
    p.fused.kernels.remove(ki - 1);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::AccumulateUnwritten { kernel, buf: b, .. }
            if *kernel == ki - 1 && *b == buf.index())
        ),
        "{}",
        lines(&errs)
    );
}

/// An update `(target, value)` of gpt, the kernel storing its value and an earlier kernel
/// reading the target's old value.
fn update_with_reader(p: &Planned) -> (NodeId, NodeId, usize, usize) {
    p.graph
        .updates
        .iter()
        .find_map(|&(t, v)| {
            let kv = p
                .fused
                .kernels
                .iter()
                .position(|k| k.stores.iter().any(|s| s.buf == v))?;
            let kr = (0..kv).find(|&i| p.fused.kernels[i].loads().contains(&t))?;
            Some((t, v, kv, kr))
        })
        .expect("a param read before its update")
}

#[test]
fn reading_a_param_after_its_update_is_reported() {
    let mut p = gpt();
    let (t, v, kv, kr) = update_with_reader(&p);
    let k = p.fused.kernels.remove(kv);
    p.fused.kernels.insert(kr, k);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::ReadAfterUpdate { kernel, buf, value, writer, .. }
            if *kernel == kr + 1 && *buf == t.index() && *value == v.index() && *writer == kr)
        ),
        "{}",
        lines(&errs)
    );
}

#[test]
fn an_update_reading_its_target_elsewhere_is_reported() {
    let mut p = gpt();
    let (t, v, kv, _) = update_with_reader(&p);
    // Read the old value backwards along the innermost loop: in bounds, not in place.
    let k = &mut p.fused.kernels[kv];
    assert!(k.loads().contains(&t), "the update reads its old value");
    let last = k.domain.len() - 1;
    let ext = k.domain[last] as i64;
    assert!(ext > 1);
    let x = k.pool.var(last as u32);
    let rev = k.pool.imul_c(x, -1);
    let rev = k.pool.iadd_c(rev, ext - 1);
    let si = k.stores.iter().position(|s| s.buf == v).unwrap();
    k.stores[si].value = k.pool.substitute(k.stores[si].value, last as u32, rev);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::InPlaceHazard { kernel, buf, value, .. }
            if *kernel == kv && *buf == t.index() && *value == v.index())
        ),
        "{}",
        lines(&errs)
    );
    assert!(errs
        .iter()
        .all(|e| !matches!(e, KernelError::OutOfBounds { .. })));
}

#[test]
fn stores_of_the_wrong_buffer_dtype_or_expression_are_reported() {
    let base = gpt();
    let (ki, buf) = plain_store(&base);
    // A dtype the buffer does not have.
    let mut p = base.clone();
    let s = &mut p.fused.kernels[ki].stores[0];
    let (found, expected) = (tcc::ir::DType::F16, p.graph.ty(buf).dtype);
    assert_ne!(found, expected);
    s.dtype = found;
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::DTypeMismatch { kernel, buf: b, found: f, expected: x, .. }
            if *kernel == ki && *b == buf.index() && *f == found && *x == expected)
        ),
        "{}",
        lines(&errs)
    );
    // Into a param directly.
    let mut p = base.clone();
    let param = p.graph.params[0];
    p.fused.kernels[ki].stores[0].buf = param;
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::StoreToLeaf { kernel, buf: b, leaf, .. }
            if *kernel == ki && *b == param.index() && *leaf == "param")
        ),
        "{}",
        lines(&errs)
    );
    // Into a node the graph does not have.
    let mut p = base.clone();
    let ghost = NodeId((p.graph.node_count() as u32 + 1000).into());
    p.fused.kernels[ki].stores[0].buf = ghost;
    let errs = kernel_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::UnknownBuffer { kernel, buf: b, .. }
            if *kernel == ki && *b == ghost.index())
        ),
        "{}",
        lines(&errs)
    );
    // An index that is no node of the pool: an error, not a panic.
    let mut p = base.clone();
    let k = &mut p.fused.kernels[ki];
    let len = k.pool.nodes.len();
    k.stores[0].index = tcc::kernel::ExprId(len as u32 + 7);
    let errs = kernel_errors(&p);
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::BadExpr { kernel, expr, .. }
            if *kernel == ki && *expr == len + 7)),
        "{}",
        lines(&errs)
    );
    // An output no kernel stores.
    let mut p = base;
    let (_, out) = p.graph.outputs[0].clone();
    p.fused
        .kernels
        .retain(|k| k.stores.iter().all(|s| s.buf != out));
    let errs = kernel_errors(&p);
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::NeverWritten { buf, .. } if *buf == out.index())),
        "{}",
        lines(&errs)
    );
}

/// A kernel that loads a transient buffer `a` and stores another one `b`: both live there.
fn transient_pair(p: &Planned) -> (usize, NodeId, NodeId) {
    let persistent = |n: NodeId| {
        p.graph.params.contains(&n)
            || p.graph.states.contains(&n)
            || p.graph.updates.iter().any(|&(_, v)| v == n)
    };
    p.fused
        .kernels
        .iter()
        .enumerate()
        .find_map(|(ki, k)| {
            let b = k.stores.first()?.buf;
            let a = k
                .loads()
                .into_iter()
                .find(|&a| !is_leaf(p, a) && !persistent(a) && a != b)?;
            (!persistent(b)).then_some((ki, a, b))
        })
        .expect("a kernel reading one intermediate and writing another")
}

fn buffer(p: &Planned, n: NodeId) -> usize {
    p.plan.liveness.buffer_of[&n]
}

#[test]
fn live_buffers_sharing_bytes_are_reported() {
    let mut p = gpt();
    let (ki, a, b) = transient_pair(&p);
    let (ba, bb) = (buffer(&p, a), buffer(&p, b));
    p.plan.offsets[bb] = p.plan.offsets[ba];
    let errs = plan_errors(&p);
    let pair = [a.index(), b.index()];
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::Overlap { kernel, a, b, .. }
            if *kernel <= ki && pair.contains(a) && pair.contains(b) && a != b)),
        "{}",
        lines(&errs)
    );
}

#[test]
fn a_planner_that_forgets_reads_is_caught() {
    // The planner's own check trusts its liveness: with every transient buffer dying right
    // after its first kernel, it packs buffers that are still read later over each other,
    // and `plan::verify` sees nothing wrong.
    let mut p = gpt();
    let mut lv = p.plan.liveness.clone();
    for b in &mut lv.buffers {
        if b.kind == tcc::analysis::liveness::BufferKind::Transient && !b.output {
            b.end = b.start + 1;
        }
    }
    p.plan = tcc::plan::plan_liveness(lv, Duration::from_millis(20));
    assert!(tcc::plan::verify(&p.graph, &p.plan).is_ok());
    let errs = plan_errors(&p);
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::Overlap { .. })),
        "{}",
        lines(&errs)
    );
    assert!(errs
        .iter()
        .all(|e| matches!(e, KernelError::Overlap { .. })));
}

#[test]
fn misplaced_buffers_are_reported() {
    let base = gpt();
    let (ki, _, b) = transient_pair(&base);
    let first = base
        .fused
        .kernels
        .iter()
        .position(|k| k.stores.iter().any(|s| s.buf == b) || k.loads().contains(&b))
        .unwrap();
    assert!(first <= ki);
    let bb = buffer(&base, b);
    // Misaligned.
    let mut p = base.clone();
    p.plan.offsets[bb] += 64;
    let off = p.plan.offsets[bb];
    let errs = plan_errors(&p);
    assert!(
        errs.contains(&KernelError::Misaligned {
            kernel: first,
            name: p.fused.kernels[first].name.clone(),
            buf: b.index(),
            offset: off,
        }),
        "{}",
        lines(&errs)
    );
    // Past the arena.
    let mut p = base.clone();
    p.plan.offsets[bb] = p.plan.arena_bytes;
    let errs = plan_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::PastArena { kernel, buf, offset, arena, .. }
            if *kernel == first && *buf == b.index() && offset == arena)
        ),
        "{}",
        lines(&errs)
    );
    // In the scratch region of stream-K matmuls.
    let mut p = base.clone();
    p.plan.add_scratch(1 << 20);
    p.plan.offsets[bb] = p.plan.scratch_offset();
    let errs = plan_errors(&p);
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::InScratch { kernel, buf, .. }
            if *kernel == first && *buf == b.index())),
        "{}",
        lines(&errs)
    );
    // Not planned at all.
    let mut p = base.clone();
    p.plan.liveness.buffer_of.remove(&b);
    let errs = plan_errors(&p);
    assert!(
        errs.iter()
            .any(|e| matches!(e, KernelError::Unplanned { kernel, buf, .. }
            if *kernel == first && *buf == b.index())),
        "{}",
        lines(&errs)
    );
    // The `plan` stage's offset table refuses it too, naming the same first access.
    match Offsets::new(&p.fused.kernels, &p.plan) {
        Err(e) => assert_eq!((e.kernel, e.buf), (first, b.index()), "{e}"),
        Ok(_) => panic!("an access without an offset went unnoticed"),
    }
    assert_eq!(base.offsets.get(b), base.plan.offset_of(b));
    // An update's new value somewhere else than over its param.
    let mut p = base;
    let (t, v) = p.graph.updates[0];
    p.plan.liveness.buffer_of.insert(v, bb);
    let errs = plan_errors(&p);
    assert!(
        errs.iter().any(
            |e| matches!(e, KernelError::UpdateNotInPlace { buf, target, .. }
            if *buf == v.index() && *target == t.index())
        ),
        "{}",
        lines(&errs)
    );
}

/// Full-size gpt (about 410 kernels for CUDA): both verifiers accept it, each in well
/// under a second (they are linear in the kernels' pools, `n log n` in the buffers).
#[test]
fn full_size_gpt_verifies_fast() {
    let src = std::fs::read_to_string(root().join("examples/gpt.tdsl")).unwrap();
    let g = compile_pipeline(&src, &Default::default()).unwrap();
    for target in [Target::Cuda, Target::Cpu] {
        let opts = CompileOptions {
            target,
            plan_budget: Duration::from_millis(20),
            ..Default::default()
        };
        let p = plan_step(&g, &opts).unwrap();
        assert!(p.fused.kernels.len() > 300, "{}", p.fused.kernels.len());
        let t = std::time::Instant::now();
        let report = check_kernels(&p.graph, &p.fused);
        let kernels = t.elapsed();
        let t = std::time::Instant::now();
        let planned = verify_planned(&p.graph, &p.fused, &p.plan);
        let plan = t.elapsed();
        eprintln!(
            "gpt {target:?}: {} kernels, verify_kernels {kernels:?}, verify_planned {plan:?}, \
             {} accesses unproven",
            p.fused.kernels.len(),
            report.unproven.len()
        );
        assert!(report.errors.is_empty(), "{}", lines(&report.errors));
        if let Err(e) = planned {
            panic!("{}", lines(&e));
        }
        assert!(
            kernels + plan < Duration::from_millis(500),
            "{kernels:?} + {plan:?}"
        );
    }
}

/// The fusion and layout cases and LANGUAGE.md's programs (those that compile to one
/// model), every way: CPU and CUDA, fused, unfused and channels-last.
#[test]
fn every_case_and_language_program_verifies() {
    let mut sources: Vec<(String, String)> = Vec::new();
    for dir in ["tests/cases/fusion", "tests/cases/layout"] {
        for f in tcc_tests::tdsl_files(dir) {
            let src = std::fs::read_to_string(&f).unwrap();
            sources.push((f.display().to_string(), src));
        }
    }
    let cases = sources.len();
    assert!(cases >= 9, "{cases}");
    if tcc_tests::language_md().exists() {
        for (i, src) in tcc_tests::language_examples().into_iter().enumerate() {
            sources.push((format!("LANGUAGE.md block {i}"), src));
        }
    }
    let mut checked = 0;
    for (i, (what, src)) in sources.iter().enumerate() {
        let g = match compile_pipeline(src, &Default::default()) {
            Ok(g) => g,
            // A LANGUAGE.md block may be a fragment or a program meant to fail.
            Err(_) if i >= cases => continue,
            Err(e) => panic!("{what}: {e}"),
        };
        for target in [Target::Cpu, Target::Cuda] {
            for (fuse, channels_last) in [(true, false), (false, false), (true, true)] {
                let opts = CompileOptions {
                    target,
                    fuse: FuseOptions {
                        fuse,
                        channels_last,
                        ..Default::default()
                    },
                    plan_budget: Duration::from_millis(20),
                    ..Default::default()
                };
                let p = plan_step(&g, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                let how = format!("{what} {target:?} fuse={fuse} channels_last={channels_last}");
                if let Err(e) = verify_kernels(&p.graph, &p.fused) {
                    panic!("{how}: {}", lines(&e));
                }
                if let Err(e) = verify_planned(&p.graph, &p.fused, &p.plan) {
                    panic!("{how}: {}", lines(&e));
                }
            }
        }
        checked += 1;
    }
    assert!(checked >= cases, "{checked}");
}
