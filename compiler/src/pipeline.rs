//! The pipeline from source to code: one table, [`PIPELINE`].
//!
//! Every stage is a row, in the order it runs, with what it takes and gives ([`Form`]), the
//! file that holds it, the invariant checked after it and why it sits where it does. Every
//! driver runs the table: `tcc build`, `run`, `mem`, `fit` and `remat`, the artifact writer
//! ([`crate::artifact::compile`] and [`crate::artifact::plan_step`] are the stages from
//! `outputs` on) and the tests. `--print-after STAGE|all` and `--stop-after STAGE` accept
//! every name of the table.
//!
//! | stage | takes → gives | file | checked after it |
//! |---|---|---|---|
//! | `lower` | source → graph | `front/` | graph verifier |
//! | `autodiff` | graph → graph | `autodiff/` | graph verifier |
//! | `schedule` | graph → graph | `passes/schedule.rs` | graph verifier |
//! | `remat` | graph → graph | `remat/step.rs` | graph verifier |
//! | `outputs` | graph → graph | `passes/outputs.rs` | graph verifier |
//! | `attention` | graph → graph | `passes/attention.rs` | graph verifier |
//! | `transpose_matmuls` | graph → graph | `passes/transpose_matmuls.rs` | graph verifier |
//! | `split_reductions` | graph → graph | `passes/split_reductions.rs` | graph verifier |
//! | `amp` | graph → graph | `passes/amp.rs` | graph verifier |
//! | `fuse` | graph → kernels | `kernel/fuse.rs`, `kernel/layout.rs`, `kernel/lower.rs`, `kernel/peak.rs` | kernel-IR verifier |
//! | `plan` | kernels → planned | `plan/`, `analysis/` | plan verifier, kernel-IR verifier with offsets |
//! | `codegen` | planned → code | `back/clif.rs`, `back/ptx/` | the code's own checks (ptxas in tests) |
//!
//! The graph verifier runs after every graph stage, and the kernel-IR verifiers after
//! `fuse` and `plan`, in debug builds and whenever [`Options::verify`] is set (the tests set
//! it); the plan verifier always runs. `remat` may run the stages after it (from `outputs`
//! to `plan`) as its cost oracle: every decision it weighs is a real, verified plan.

use crate::artifact::{BuildError, CompileOptions, Compiled, Planned, Target};
use crate::ir::{printer, verify::verify, Graph};
use crate::kernel::fuse::{self, Fused};
use crate::remat::step::{Decision, Mode};
use std::time::{Duration, Instant};
use tcc_grammar::diag::Diagnostic;
use tcc_grammar::span::SourceMap;

/// What a stage takes or gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// TDSL text.
    Source,
    /// The graph IR ([`Graph`]).
    Graph,
    /// The graph and its fused kernels ([`Kernels`]).
    Kernels,
    /// The kernels with the verified one-arena plan ([`Planned`]).
    Planned,
    /// The target's code ([`Compiled`]).
    Code,
}

impl std::fmt::Display for Form {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Form::Source => "source",
            Form::Graph => "graph",
            Form::Kernels => "kernels",
            Form::Planned => "planned kernels",
            Form::Code => "code",
        })
    }
}

/// The graph and the kernels that compute it (the output of `fuse`).
#[derive(Clone, Debug)]
pub struct Kernels {
    pub graph: Graph,
    pub fused: Fused,
}

/// A program between two stages.
#[derive(Clone, Debug)]
pub enum Product {
    Graph(Graph),
    Kernels(Kernels),
    Planned(Planned),
    Code(Compiled),
}

impl Product {
    /// Its form.
    pub fn form(&self) -> Form {
        match self {
            Product::Graph(_) => Form::Graph,
            Product::Kernels(_) => Form::Kernels,
            Product::Planned(_) => Form::Planned,
            Product::Code(_) => Form::Code,
        }
    }

    /// The graph it computes.
    pub fn graph(&self) -> &Graph {
        match self {
            Product::Graph(g) => g,
            Product::Kernels(k) => &k.graph,
            Product::Planned(p) => &p.graph,
            Product::Code(c) => &c.graph,
        }
    }

    /// The product as text, as `--print-after` and `--stop-after` show it: the graph IR,
    /// the kernel IR (with arena offsets once planned, after a line on the plan), or the
    /// code.
    pub fn render(&self, locations: Option<&SourceMap>) -> String {
        use crate::kernel::print::print_kernels;
        match self {
            Product::Graph(g) => printer::print(g, locations),
            Product::Kernels(k) => print_kernels(&k.fused.kernels, None),
            Product::Planned(p) => {
                format!(
                    "// plan: arena {} bytes (persistent {}, lower bound {}, scratch {} at {}), {} buffers, {}\n{}",
                    p.plan.arena_bytes,
                    p.plan.persistent_bytes,
                    p.plan.lower_bound,
                    p.plan.scratch_bytes,
                    p.plan.scratch_offset(),
                    p.plan.liveness.buffers.len(),
                    p.plan.method,
                    print_kernels(&p.fused.kernels, Some(&p.offsets))
                )
            }
            Product::Code(c) => c.code.clone(),
        }
    }
}

/// What `remat` does ([`crate::remat::step`]).
#[derive(Clone, Debug)]
pub struct RematOptions {
    pub mode: Mode,
    /// The arena must fit this many bytes (`--mem-budget`).
    pub budget: Option<u64>,
    /// Time for each round of the search.
    pub time_limit: Duration,
    /// On CUDA, recompute the products only an activation's derivative
    /// reads ([`crate::remat::step::products`]); off with `--no-product-remat`.
    pub products: bool,
    /// f32 attention's backward pass as the two FFMA flash kernels (`--flash-backward`;
    /// sets [`CompileOptions::flash_backward`] for the whole pipeline).
    pub flash_backward: bool,
}

impl Default for RematOptions {
    fn default() -> Self {
        RematOptions {
            mode: Mode::Manual,
            budget: None,
            time_limit: Duration::from_millis(2000),
            products: true,
            flash_backward: false,
        }
    }
}

/// How to run the pipeline.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Target, fusion, plan and code generation options.
    pub compile: CompileOptions,
    pub remat: RematOptions,
    /// Hand the product to the printer after these stages (`all` for every one).
    pub print_after: Vec<String>,
    /// Stop after this stage.
    pub stop_after: Option<String>,
    /// Verify after every stage (always on in debug builds).
    pub verify: bool,
}

/// What a run reports besides its product.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Wall time of each stage that ran, in order.
    pub timings: Vec<(&'static str, Duration)>,
    /// `remat`'s decision under `--mem-budget` with `auto`, and the step it started from.
    pub remat: Option<(Decision, Graph)>,
    /// What free recomputation did (absent when it found nothing to recompute or did not
    /// run).
    pub free: Option<crate::remat::step::Free>,
}

impl Report {
    /// Milliseconds spent in all the stages that ran.
    pub fn total_ms(&self) -> f64 {
        self.timings
            .iter()
            .map(|(_, d)| d.as_secs_f64() * 1e3)
            .sum()
    }

    /// `lower 1.2 ms, autodiff 3.4 ms, ...`.
    pub fn timing_line(&self) -> String {
        self.timings
            .iter()
            .map(|(s, d)| format!("{s} {:.1} ms", d.as_secs_f64() * 1e3))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Why a stage failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Errors in the user's program, with spans.
    #[error("{}", .0.iter().map(|d| d.message.clone()).collect::<Vec<_>>().join("; "))]
    Program(Vec<Diagnostic>),
    #[error(transparent)]
    Build(#[from] BuildError),
    /// `remat` could not meet the budget (or the flags ask for what cannot be done).
    #[error("{0}")]
    Remat(String),
    /// A verifier rejected a stage's output: a compiler bug.
    #[error("internal compiler error after stage `{stage}`: {message}")]
    Verify {
        stage: &'static str,
        message: String,
    },
    /// A stage was handed a product of the wrong form, or an unknown stage was named.
    #[error("internal compiler error: {0}")]
    Internal(String),
}

impl StageError {
    /// The diagnostics to report: the program's own, or one error carrying the message.
    pub fn diagnostics(&self) -> Vec<Diagnostic> {
        match self {
            StageError::Program(d) => d.clone(),
            other => vec![Diagnostic::error("E0002", other.to_string())],
        }
    }
}

type Run = fn(Product, &Options, &mut Report) -> Result<Product, StageError>;

/// One row of the table.
pub struct Stage {
    pub name: &'static str,
    pub takes: Form,
    pub gives: Form,
    /// Where it lives.
    pub file: &'static str,
    /// What is checked after it.
    pub invariant: &'static str,
    /// Why it sits where it does.
    pub why: &'static str,
    /// `None` for `lower`, which the front end runs ([`crate::front::compile`]).
    run: Option<Run>,
}

/// The name of the front end's stage.
pub const LOWER: &str = "lower";

/// Every stage, in order.
pub const PIPELINE: &[Stage] = &[
    Stage {
        name: LOWER,
        takes: Form::Source,
        gives: Form::Graph,
        file: "compiler/src/front/",
        invariant: "the graph verifier (`ir/verify.rs`): types, operand counts, acyclic",
        why: "first: parses, checks and lowers TDSL (inlining functions, unrolling loops) to one graph per model; with `--micro-batches K` it lowers the model at its batch and at 1/K of it and builds the step as K slices of the batch (`front/micro_batch.rs`)",
        run: None,
    },
    Stage {
        name: "autodiff",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/autodiff/",
        invariant: "the graph verifier; no `grad` node is left",
        why: "right after lowering: every later stage sees the whole step (forward, backward and optimizer) and no `grad` node; first it gives each embedding whose ids the step computes an output counting the out-of-range ids (`passes/index_checks.rs`); a training step without loss scaling gets an output summing the magnitudes of the params its updates write (unless `--no-finite-check`); the runtime checks both after every step; a stacked param read only by layer becomes a param a layer (`autodiff/stacks.rs`) where that lowers the scheduled peak, or, one stack alone, where the stages after it plan a smaller arena so (it weighs both steps with them), before the backward pass makes its gradients",
        run: Some(|p, o, _| {
            let (scale, ranks, zero) = (o.compile.amp.loss_scale, o.compile.ranks, o.compile.zero);
            let finite_check = !o.compile.amp.no_finite_check;
            let weigh = crate::autodiff::stacks::Weigh {
                compile: o.compile,
                free: o.remat.mode != Mode::None,
            };
            graph_stage(p, "autodiff", |g| {
                crate::passes::index_checks::index_checks(g).map_err(|e| {
                    vec![Diagnostic::error("E0002", format!("internal compiler error: {e}"))]
                })?;
                crate::autodiff::expand_data_parallel(
                    g,
                    scale,
                    ranks,
                    zero,
                    finite_check,
                    Some(&weigh),
                )
            })
        }),
    },
    Stage {
        name: "schedule",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/schedule.rs",
        invariant: "the graph verifier; max-live never above program order's (early updates' temporaries counted in their kernels)",
        why: "before remat, which evaluates and reorders a scheduled step; the order it fixes is kept by every later graph stage (they replace nodes in place)",
        run: Some(|p, _, _| graph_stage(p, "schedule", crate::passes::schedule::schedule)),
    },
    Stage {
        name: "remat",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/remat/step.rs",
        invariant: "the graph verifier; with a budget, the arena the stages after it plan fits it",
        why: "the last stage that chooses what to compute: it recomputes forward values (by default the pointwise ones that backward kernels can rebuild, in a kernel of their own only where that lowers the arena, and on CUDA the products an activation's derivative alone reads, such as gpt's fc1, within a share of the step's FLOPs and, in f32, of its estimated time; `--mem-budget`, `--remat`) and weighs each choice by running the stages from `outputs` to `plan` on it",
        run: Some(remat_stage),
    },
    Stage {
        name: "outputs",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/outputs.rs",
        invariant: "the graph verifier; no output names a param or state the step updates",
        why: "first of the lowering rewrites, which turn the final program (after remat) into the forms the kernels implement: an output that names an updated param or state gets a copy made before the update, as the interpreter returns it. Run before schedule instead (measured), remat would weigh fused attention ops it cannot recompute (gpt's --mem-budget 1.85GiB build no longer fits: 1.93 GiB at best) and cnn's kernels would change",
        run: Some(|p, _, _| {
            graph_rewrite(p, "outputs", crate::passes::outputs::with_output_copies)
        }),
    },
    Stage {
        name: "attention",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/attention.rs",
        invariant: "the graph verifier; types of replaced nodes unchanged",
        why: "CUDA with fusion only: turns the prelude's attention composite into the fused attention op the PTX back end implements; before the other rewrites, which would split its pieces",
        run: Some(attention_stage),
    },
    Stage {
        name: "transpose_matmuls",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/transpose_matmuls.rs",
        invariant: "the graph verifier; types of replaced nodes unchanged",
        why: "a matmul read only transposed is computed transposed; after attention (whose matmuls it would otherwise rewrite) and before fusion, which then reads the product in place",
        run: Some(|p, _, _| {
            graph_rewrite(p, "transpose_matmuls", crate::passes::transpose_matmuls::transpose_matmuls)
        }),
    },
    Stage {
        name: "split_reductions",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/split_reductions.rs",
        invariant: "the graph verifier; types of replaced nodes unchanged",
        why: "last graph stage: splits large reductions into two so that both stages have parallel work; fusion then sees the final ops",
        run: Some(|p, _, _| {
            graph_rewrite(p, "split_reductions", crate::passes::split_reductions::split_reductions)
        }),
    },
    Stage {
        name: "amp",
        takes: Form::Graph,
        gives: Form::Graph,
        file: "compiler/src/passes/amp.rs",
        invariant: "the graph verifier; outputs and updated values keep their dtypes",
        why: "`--amp` only: gives every value the dtype of the mixed-precision policy (16-bit tensor-core operands, f32 reductions and master weights) with casts made visible; after the other rewrites, which match the program as written, and before fusion, which stores each value in the dtype it is given",
        run: Some(amp_stage),
    },
    Stage {
        name: "fuse",
        takes: Form::Graph,
        gives: Form::Kernels,
        file: "compiler/src/kernel/fuse.rs (layout: kernel/layout.rs, lowering to kernel IR: kernel/lower.rs, the peak: kernel/peak.rs)",
        invariant: "the kernel-IR verifier (`kernel/verify.rs`): loads read buffers written before them, stores fit their buffers, values stored in place read their buffer only where they write; the transient peak is no higher than with one op per kernel (`kernel/peak.rs`, tested)",
        why: "groups the final graph's ops into kernels and picks their layouts (channels-last conv chains, permuted products), then weighs the grouping against the peak it gives; needs the final ops, and its kernels fix which buffers exist for the plan",
        run: Some(fuse_stage),
    },
    Stage {
        name: "plan",
        takes: Form::Kernels,
        gives: Form::Planned,
        file: "compiler/src/plan/mod.rs (liveness: analysis/liveness.rs, offsets: analysis/arena.rs)",
        invariant: "the plan verifier (`plan::verify`) and the kernel-IR verifier with offsets: every access planned and aligned, no two live buffers overlap",
        why: "gives every buffer the kernels use its offset in the one arena (persistent state first), plus the scratch region CUDA's stream-K matmuls share",
        run: Some(plan_stage),
    },
    Stage {
        name: "codegen",
        takes: Form::Planned,
        gives: Form::Code,
        file: "compiler/src/back/clif.rs (CPU), compiler/src/back/ptx/ (CUDA)",
        invariant: "the code's own checks (Cranelift's verifier when the runtime JITs; ptxas in the tests)",
        why: "last: translates the planned kernels for the target, and orders their launches by their data dependencies",
        run: Some(codegen_stage),
    },
];

/// The stage named `name`.
pub fn stage(name: &str) -> Option<&'static Stage> {
    PIPELINE.iter().find(|s| s.name == name)
}

/// Position of the stage named `name` in the table.
pub fn position(name: &str) -> Option<usize> {
    PIPELINE.iter().position(|s| s.name == name)
}

/// Every stage's name, in order.
pub fn stage_names() -> Vec<&'static str> {
    PIPELINE.iter().map(|s| s.name).collect()
}

/// Runs the stages from `first` to `last` (inclusive, stopping earlier at
/// [`Options::stop_after`]) on `input`, which must be of `first`'s form. `print` receives
/// `(stage, product)` after each stage `print_after` names. Returns the last product and the
/// report.
pub fn run(
    input: Product,
    first: &str,
    last: &str,
    opts: &Options,
    print: &mut dyn FnMut(&str, &Product),
) -> Result<(Product, Report), StageError> {
    let mut report = Report::default();
    let p = run_into(input, first, last, opts, print, &mut report)?;
    Ok((p, report))
}

/// [`run`], adding to an existing report.
pub fn run_into(
    input: Product,
    first: &str,
    last: &str,
    opts: &Options,
    print: &mut dyn FnMut(&str, &Product),
    report: &mut Report,
) -> Result<Product, StageError> {
    let unknown = |s: &str| StageError::Internal(format!("no stage `{s}` in the pipeline"));
    let from = position(first).ok_or_else(|| unknown(first))?;
    let to = position(last).ok_or_else(|| unknown(last))?;
    let stop = match &opts.stop_after {
        Some(s) => position(s).ok_or_else(|| unknown(s))?,
        None => usize::MAX,
    };
    // `--flash-backward` reaches the stages through the compile options, which the remat
    // stage's plans use too.
    let merged;
    let opts = if opts.remat.flash_backward && !opts.compile.flash_backward {
        merged = Options {
            compile: CompileOptions {
                flash_backward: true,
                ..opts.compile
            },
            ..opts.clone()
        };
        &merged
    } else {
        opts
    };
    let mut p = input;
    for stage in PIPELINE.iter().take(to.min(stop) + 1).skip(from) {
        if p.form() != stage.takes {
            return Err(StageError::Internal(format!(
                "stage `{}` takes {}, it was given {}",
                stage.name,
                stage.takes,
                p.form()
            )));
        }
        let Some(f) = stage.run else {
            return Err(StageError::Internal(format!(
                "stage `{}` runs from source: use `lowered`",
                stage.name
            )));
        };
        crate::progress::step(stage.name);
        let t = Instant::now();
        p = f(p, opts, report)?;
        report.timings.push((stage.name, t.elapsed()));
        if verifying(opts) {
            check(stage.name, &p)?;
        }
        if wants(opts, stage.name) {
            print(stage.name, &p);
        }
    }
    Ok(p)
}

/// Starts the pipeline on a model the front end lowered (`lower` took `front_time`):
/// checks and prints it as the `lower` stage, then runs from `autodiff` to `last`.
/// `checkpoint { }` blocks are dropped first unless remat is `manual`.
pub fn lowered(
    mut graph: Graph,
    front_time: Duration,
    last: &str,
    opts: &Options,
    print: &mut dyn FnMut(&str, &Product),
) -> Result<(Product, Report), StageError> {
    if opts.remat.mode != Mode::Manual {
        graph.clear_checkpoints();
    }
    let mut report = Report {
        timings: vec![(LOWER, front_time)],
        ..Report::default()
    };
    let p = Product::Graph(graph);
    if verifying(opts) {
        check(LOWER, &p)?;
    }
    if wants(opts, LOWER) {
        print(LOWER, &p);
    }
    if last == LOWER || opts.stop_after.as_deref() == Some(LOWER) {
        return Ok((p, report));
    }
    let p = run_into(p, "autodiff", last, opts, print, &mut report)?;
    Ok((p, report))
}

fn verifying(opts: &Options) -> bool {
    opts.verify || cfg!(debug_assertions)
}

fn wants(opts: &Options, stage: &str) -> bool {
    opts.print_after.iter().any(|p| p == stage || p == "all")
}

/// The invariant checked after a stage, by the form it gave.
fn check(stage: &'static str, p: &Product) -> Result<(), StageError> {
    let fail = |message: String| StageError::Verify { stage, message };
    match p {
        Product::Graph(g) => verify(g).map_err(|e| fail(join(&e))),
        Product::Kernels(k) => {
            crate::kernel::verify::verify_kernels(&k.graph, &k.fused).map_err(|e| fail(join(&e)))
        }
        Product::Planned(p) => crate::kernel::verify::verify_planned(&p.graph, &p.fused, &p.plan)
            .map_err(|e| fail(join(&e))),
        Product::Code(_) => Ok(()),
    }
}

fn join<E: std::fmt::Display>(errs: &[E]) -> String {
    errs.iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

fn graph_of(p: Product, stage: &str) -> Result<Graph, StageError> {
    match p {
        Product::Graph(g) => Ok(g),
        other => Err(StageError::Internal(format!(
            "stage `{stage}` takes a graph, it was given {}",
            other.form()
        ))),
    }
}

/// A pass that rewrites the graph in place.
fn graph_stage(
    p: Product,
    stage: &str,
    pass: impl FnOnce(&mut Graph) -> Result<(), Vec<Diagnostic>>,
) -> Result<Product, StageError> {
    let mut g = graph_of(p, stage)?;
    pass(&mut g).map_err(StageError::Program)?;
    Ok(Product::Graph(g))
}

/// A rewrite that returns a new graph (the lowering rewrites, which cannot fail).
fn graph_rewrite(
    p: Product,
    stage: &str,
    pass: fn(&Graph) -> Graph,
) -> Result<Product, StageError> {
    let g = graph_of(p, stage)?;
    Ok(Product::Graph(pass(&g)))
}

fn remat_stage(p: Product, o: &Options, report: &mut Report) -> Result<Product, StageError> {
    let g = graph_of(p, "remat")?;
    // Free recomputation first (all but `--remat none`): a budget is then sought from the
    // step it gives.
    let g = if o.remat.mode == Mode::None {
        g
    } else {
        let (h, free) = crate::remat::step::free_with(&g, &o.compile, o.remat.products)?;
        report.free = free;
        h
    };
    let (h, decision) =
        crate::remat::step::decide(&g, &o.remat, o.compile).map_err(StageError::Remat)?;
    match decision {
        Some(d) => {
            report.remat = Some((d, g));
            Ok(Product::Graph(h))
        }
        None => Ok(Product::Graph(h)),
    }
}

fn attention_stage(p: Product, o: &Options, _: &mut Report) -> Result<Product, StageError> {
    let g = graph_of(p, "attention")?;
    if o.compile.target == Target::Cuda && o.compile.fuse.fuse {
        let h = crate::passes::attention::fuse_attention(&g);
        // The fused backward: on tensor cores under `--amp`; in f32, the FFMA kernels when
        // asked (`--flash-backward`).
        if o.compile.amp.dtype.is_some() || o.compile.flash_backward {
            Ok(Product::Graph(
                crate::passes::attention::fuse_attention_backward(&h),
            ))
        } else {
            Ok(Product::Graph(h))
        }
    } else {
        Ok(Product::Graph(g))
    }
}

fn amp_stage(p: Product, o: &Options, _: &mut Report) -> Result<Product, StageError> {
    let g = graph_of(p, "amp")?;
    if o.compile.amp.dtype.is_none() {
        return Ok(Product::Graph(g));
    }
    o.compile
        .amp
        .apply_to(&g)
        .map(Product::Graph)
        .map_err(|e| StageError::Internal(format!("mixed precision: {}: {}", e.message, e.detail)))
}

fn fuse_stage(p: Product, o: &Options, _: &mut Report) -> Result<Product, StageError> {
    let g = graph_of(p, "fuse")?;
    let c = &o.compile;
    let fuse_opts = fuse::FuseOptions {
        implicit_gemm: c.target == Target::Cuda,
        conv_gemm: true,
        // The CPU's f32 products run in the runtime's GEMM helper, which packs B from any
        // layout.
        k_major_f32: c.target == Target::Cpu || !c.allow_tf32,
        ..c.fuse
    };
    let fused = fuse::fuse(&g, fuse_opts).map_err(BuildError::from)?;
    Ok(Product::Kernels(Kernels { graph: g, fused }))
}

fn plan_stage(p: Product, o: &Options, _: &mut Report) -> Result<Product, StageError> {
    let Product::Kernels(Kernels { graph, fused }) = p else {
        return Err(StageError::Internal(format!(
            "stage `plan` takes kernels, it was given {}",
            p.form()
        )));
    };
    Ok(Product::Planned(crate::artifact::plan_kernels(
        graph, fused, &o.compile,
    )?))
}

fn codegen_stage(p: Product, o: &Options, _: &mut Report) -> Result<Product, StageError> {
    let Product::Planned(planned) = p else {
        return Err(StageError::Internal(format!(
            "stage `codegen` takes planned kernels, it was given {}",
            p.form()
        )));
    };
    Ok(Product::Code(crate::artifact::codegen(
        planned, &o.compile,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_takes_what_the_one_before_gives() {
        assert_eq!(PIPELINE[0].takes, Form::Source);
        assert_eq!(PIPELINE[PIPELINE.len() - 1].gives, Form::Code);
        for w in PIPELINE.windows(2) {
            assert_eq!(w[0].gives, w[1].takes, "{} -> {}", w[0].name, w[1].name);
        }
        let mut names = stage_names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PIPELINE.len(), "stage names are unique");
        assert!(!names.contains(&"all"), "`all` means every stage");
    }

    #[test]
    fn each_row_names_a_file_that_exists_and_says_why() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for s in PIPELINE {
            let path = s.file.split_whitespace().next().unwrap_or("");
            assert!(root.join(path).exists(), "{}: {path}", s.name);
            assert!(s.why.len() > 20 && s.invariant.len() > 10, "{}", s.name);
        }
    }

    #[test]
    fn the_readme_and_this_module_list_the_stages_in_order() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap_or_default();
        let here = include_str!("pipeline.rs");
        for (what, text) in [("README.md", readme.as_str()), ("pipeline.rs", here)] {
            let rows: Vec<&str> = text
                .lines()
                .filter_map(|l| {
                    let l = l.trim_start_matches("//!").trim();
                    l.strip_prefix("| `")?.split('`').next()
                })
                .filter(|n| stage(n).is_some())
                .collect();
            assert_eq!(rows, stage_names(), "the stage table of {what}");
        }
    }

    #[test]
    fn a_product_of_the_wrong_form_is_an_error() {
        let g = Graph::new("m");
        let opts = Options::default();
        let e = run(
            Product::Graph(g.clone()),
            "plan",
            "plan",
            &opts,
            &mut |_, _| {},
        );
        assert!(matches!(e, Err(StageError::Internal(m)) if m.contains("takes kernels")));
        let e = run(
            Product::Graph(g.clone()),
            "lower",
            "lower",
            &opts,
            &mut |_, _| {},
        );
        assert!(matches!(e, Err(StageError::Internal(_))));
        let e = run(Product::Graph(g), "nope", "plan", &opts, &mut |_, _| {});
        assert!(matches!(e, Err(StageError::Internal(m)) if m.contains("no stage `nope`")));
    }
}
