//! `tcc remat`: the rematerialization solvers on external graphs (Checkmate / Moccasin
//! node-link JSON) and on TDSL programs; and the `--mem-budget`/`--remat` flags that
//! `build`, `run`, `mem` and `fit` share.

use crate::artifact::CompileOptions;
use crate::front::{self, ModelSelection, Options, Sources};
use crate::ir::Graph;
use crate::passes::amp::Amp;
use crate::pipeline;
use crate::plan::human_bytes;
use crate::remat::step::{self, AutoOptions, Decision, Mode};
use crate::remat::{self, RematGraph};
use clap::ValueEnum;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `--remat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RematMode {
    /// Recompute what the compiler chooses so the arena fits `--mem-budget`.
    Auto,
    /// Recompute what `checkpoint { }` blocks say.
    Manual,
    /// Recompute nothing (`checkpoint { }` blocks are ignored).
    None,
}

/// Rematerialization flags of `build`, `run` and `mem`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RematArgs {
    /// Fit the step's arena in this much memory (`2GiB`, `512MiB`, `1.5GB`, bytes),
    /// recomputing forward values in the backward pass where needed (`--remat auto`).
    #[arg(long, value_name = "SIZE", value_parser = super::fit::parse_bytes)]
    pub mem_budget: Option<u64>,
    /// What to recompute [default: `auto` with `--mem-budget`, else `manual`].
    #[arg(long, value_enum)]
    pub remat: Option<RematMode>,
    /// Time for each round of the remat search, in milliseconds.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    pub remat_time_ms: u64,
    /// On CUDA, keep the products that only an activation's derivative reads
    /// (gpt's fc1 outputs) instead of recomputing them in the backward pass: more memory,
    /// fewer FLOPs. Free recomputation stays (`--remat none` turns off both).
    #[arg(long)]
    pub no_product_remat: bool,
    /// f32 steps on CUDA: run attention's backward pass as two flash-attention kernels
    /// (exact f32 FFMA) that rebuild the probabilities block by block instead of storing
    /// the `[B, H, T, S]` tensors of the composite: less memory where `T·S` is large (gpt
    /// at T = 2048, B = 2 on an H200: session 2.65 -> 2.31 GiB, step +10 %), slower where
    /// it is not (gpt at T = 512: +4 % step time for 0.01 GiB). Under `--amp` the
    /// tensor-core kernels always are.
    #[arg(long)]
    pub flash_backward: bool,
}

impl RematArgs {
    /// The mode the flags ask for.
    pub fn mode(&self) -> Result<Mode, String> {
        match (self.remat, self.mem_budget) {
            (Some(RematMode::Auto), None) => {
                Err("`--remat auto` needs a budget: add `--mem-budget SIZE`".into())
            }
            (Some(RematMode::Auto), Some(_)) | (None, Some(_)) => Ok(Mode::Auto),
            (Some(RematMode::Manual), _) | (None, None) => Ok(Mode::Manual),
            (Some(RematMode::None), _) => Ok(Mode::None),
        }
    }
}

impl RematArgs {
    /// The `remat` stage's options the flags ask for.
    pub fn options(&self) -> Result<crate::pipeline::RematOptions, String> {
        Ok(crate::pipeline::RematOptions {
            mode: self.mode()?,
            budget: self.mem_budget,
            time_limit: Duration::from_millis(self.remat_time_ms.max(1)),
            products: !self.no_product_remat,
            flash_backward: self.flash_backward,
        })
    }
}

/// One line: what the decision costs and saves.
pub fn summary(d: &Decision, budget: u64) -> String {
    if d.chosen.evict.is_empty() {
        return format!(
            "remat: the arena of {} fits the budget of {}; nothing is recomputed",
            human_bytes(d.chosen.arena),
            human_bytes(budget)
        );
    }
    format!(
        "remat: arena {} -> {} (budget {}): {} values recomputed, +{} FLOP ({:.2}% of the step), by {}; {} plans compiled in {:.2} s",
        human_bytes(d.base_arena),
        human_bytes(d.chosen.arena),
        human_bytes(budget),
        d.chosen.evict.len(),
        flop(d.chosen.added_flops),
        pct(d.chosen.added_flops, d.step_flops),
        d.method,
        d.tries,
        d.elapsed.as_secs_f64()
    )
}

/// What `tcc mem` prints about a decision: the summary and the largest recomputed values.
pub fn report(g: &Graph, d: &Decision, budget: u64, sources: &Sources) -> String {
    let mut s = format!("  {}\n", summary(d, budget));
    if d.chosen.evict.is_empty() {
        return s;
    }
    let mut vals: Vec<_> = d
        .chosen
        .evict
        .iter()
        .map(|&n| {
            let node = g.node(n);
            (
                node.ty.size_bytes() as u64,
                n,
                node.op.name(),
                node.ty.to_string(),
                sources.map.location(node.span).to_string(),
            )
        })
        .collect();
    vals.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    s.push_str("  largest recomputed values:\n");
    for (bytes, _, op, ty, at) in vals.iter().take(12) {
        s.push_str(&format!(
            "    {:>12}  {:<24} {:<18} {}\n",
            human_bytes(*bytes),
            ty,
            op,
            at
        ));
    }
    if vals.len() > 12 {
        s.push_str(&format!("    ... and {} more\n", vals.len() - 12));
    }
    s
}

fn flop(f: u64) -> String {
    let v = f as f64;
    if v >= 1e12 {
        format!("{:.2} T", v / 1e12)
    } else if v >= 1e9 {
        format!("{:.2} G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.2} K", v / 1e3)
    } else {
        format!("{f}")
    }
}

fn pct(a: u64, total: u64) -> f64 {
    a as f64 / total.max(1) as f64 * 100.0
}

/// Lowers `file` with `sets` and runs the pass pipeline (`clear`: forget `checkpoint { }`).
pub fn step_graph(
    file: &Path,
    bytes: &[u8],
    sets: &[(String, String)],
    model: &Option<String>,
    clear: bool,
    amp: Amp,
    parallel: super::Parallel,
) -> Result<Graph, String> {
    let name = file.display().to_string();
    let mut sources = Sources::new(&name, bytes);
    let opts = Options {
        sets: sets.to_vec(),
        models: ModelSelection::One(model.clone()),
    };
    let t = Instant::now();
    let mut lowered = front::micro_batch::compile_step(
        &mut sources,
        &opts,
        parallel.micro_batches,
        super::loss_chunks(parallel.loss_chunks, amp),
    )
    .map_err(|d| tcc_grammar::diag::render_all(&d, &sources.map))?;
    if lowered.graphs.is_empty() {
        return Err("no model to compile".into());
    }
    let g = lowered.graphs.remove(0);
    let popts = pipeline::Options {
        remat: pipeline::RematOptions {
            mode: if clear { Mode::None } else { Mode::Manual },
            ..Default::default()
        },
        compile: CompileOptions {
            amp,
            ranks: parallel.ranks,
            zero: parallel.zero,
            ..Default::default()
        },
        ..Default::default()
    };
    match pipeline::lowered(g, t.elapsed(), "schedule", &popts, &mut |_, _| {}) {
        Ok((pipeline::Product::Graph(g), _)) => Ok(g),
        Ok((p, _)) => Err(format!(
            "internal compiler error: the pipeline gave {}",
            p.form()
        )),
        Err(pipeline::StageError::Program(d)) => {
            Err(tcc_grammar::diag::render_all(&d, &sources.map))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `tcc remat FILE...`: external graphs (`.json`) or TDSL programs.
pub fn run(
    files: &[PathBuf],
    sets: &[(String, String)],
    model: &Option<String>,
    budgets: &[f64],
    time_ms: u64,
    amp: Amp,
) -> Result<(), String> {
    let (tdsl, json): (Vec<&PathBuf>, Vec<&PathBuf>) = files
        .iter()
        .partition(|f| f.extension().is_some_and(|e| e == "tdsl"));
    for f in tdsl {
        run_tdsl(f, sets, model, budgets, time_ms, amp)?;
    }
    if !json.is_empty() {
        run_graphs(&json, budgets, time_ms)?;
    }
    Ok(())
}

/// A TDSL program: no remat, per-block, √n and `auto` at each budget (a fraction of the
/// no-remat transient arena, on top of params and optimizer state), all as real plans.
fn run_tdsl(
    file: &Path,
    sets: &[(String, String)],
    model: &Option<String>,
    budgets: &[f64],
    time_ms: u64,
    amp: Amp,
) -> Result<(), String> {
    let bytes = super::read_file(file, super::MAX_SOURCE_BYTES)?;
    let t = Instant::now();
    let g = step_graph(file, &bytes, sets, model, true, amp, Default::default())?;
    let copts = CompileOptions {
        amp,
        ..Default::default()
    };
    let err = |e: crate::artifact::BuildError| e.to_string();
    let base = step::measure(&g, &BTreeSet::new(), &copts).map_err(err)?;
    let total = step::step_flops(&g);
    let transient = base.arena.saturating_sub(base.persistent);
    println!(
        "model `{}` ({}): arena without remat {} = persistent {} + transient {}; step {} FLOP (compiled in {:.0} ms)",
        g.name,
        file.display(),
        human_bytes(base.arena),
        human_bytes(base.persistent),
        human_bytes(transient),
        flop(total),
        t.elapsed().as_secs_f64() * 1e3
    );
    let prepared = step::prepare(&g);
    let fused = crate::kernel::fuse::fuse(&prepared, copts.fuse).map_err(|e| e.to_string())?;
    let m = step::Model::new(&prepared, &fused);
    println!(
        "{:<46} {:>12} {:>10} {:>9} {:>14} {:>8}",
        "strategy", "arena", "transient", "recomp.", "+FLOP", "+FLOP %"
    );
    let row = |name: &str, r: &step::Measured| {
        println!(
            "{:<46} {:>12} {:>9.1}% {:>9} {:>14} {:>7.2}%",
            name,
            human_bytes(r.arena),
            r.arena.saturating_sub(r.persistent) as f64 / transient.max(1) as f64 * 100.0,
            r.evict.len(),
            flop(r.added_flops),
            pct(r.added_flops, total)
        );
    };
    row("none", &base);
    let pb = step::per_block(&prepared, &m);
    let pb = step::measure(&prepared, &pb, &copts).map_err(err)?;
    row("per-block", &pb);
    let sq = step::sqrt_n(&m);
    let sq = step::measure(&prepared, &sq, &copts).map_err(err)?;
    row("sqrt(n)", &sq);
    for &frac in budgets {
        let budget = base.persistent + (transient as f64 * frac) as u64;
        let t = Instant::now();
        let o = AutoOptions {
            budget,
            compile: copts,
            time_limit: Duration::from_millis(time_ms.max(1)),
            rounds: 6,
        };
        let spinner = crate::progress::Spinner::start(
            &format!(
                "remat search at {:.0}% of the transient arena",
                frac * 100.0
            ),
            super::quiet(),
        );
        let found = step::auto(&g, &o);
        drop(spinner);
        match found {
            Ok(d) => row(
                &format!(
                    "auto {:>3.0}% ({:.1} s, {})",
                    frac * 100.0,
                    t.elapsed().as_secs_f64(),
                    short(&d.method)
                ),
                &d.chosen,
            ),
            Err(e) => println!("auto {:>3.0}%: {e}", frac * 100.0),
        }
    }
    println!("transient: arena above params and optimizer state, % of no remat; recomp.: values recomputed; auto N%: budget = persistent + N% of the transient arena");
    Ok(())
}

fn short(method: &str) -> &str {
    method.strip_prefix("search: ").unwrap_or(method)
}

fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / (1u64 << 30) as f64)
}

fn run_graphs(files: &[&PathBuf], budgets: &[f64], time_ms: u64) -> Result<(), String> {
    println!(
        "{:<40} {:>6} {:>10} {:>10} | {:>10} {:>9} | {:>10} {:>9} {:>8} {:>9}",
        "graph",
        "budget",
        "peak",
        "budget",
        "sqrt(n) pk",
        "+cost %",
        "ours peak",
        "+cost %",
        "time s",
        "status"
    );
    for f in files {
        let text = super::read_text(f, super::MAX_DATA_BYTES)?;
        let g: RematGraph =
            remat::parse_node_link(&text).map_err(|e| format!("{}: {e}", f.display()))?;
        let base = remat::none(&g);
        let sq = remat::sqrt_n(&g);
        let total = g.base_cost().max(1) as f64;
        let name = f.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
        for &frac in budgets {
            let budget = (base.eval.peak as f64 * frac) as u64;
            let start = Instant::now();
            let outcome = remat::solve(&g, budget, Duration::from_millis(time_ms));
            let secs = start.elapsed().as_secs_f64();
            let (peak, cost, status) = match (&outcome.best, outcome.finished) {
                (Some(s), fin) => (
                    gib(s.eval.peak),
                    format!("{:.1}", s.eval.added_cost as f64 / total * 100.0),
                    if fin { "optimal" } else { "work limit" },
                ),
                (None, true) => ("-".into(), "-".into(), "infeasible"),
                (None, false) => ("-".into(), "-".into(), "not found"),
            };
            // The mark sits inside the column, so the columns after it stay aligned.
            let sq_peak = if sq.eval.peak <= budget {
                gib(sq.eval.peak)
            } else {
                format!("{}!", gib(sq.eval.peak))
            };
            println!(
                "{:<40} {:>5.0}% {:>10} {:>10} | {:>10} {:>9.1} | {:>10} {:>9} {:>8.2} {:>9}",
                name,
                frac * 100.0,
                gib(base.eval.peak),
                gib(budget),
                sq_peak,
                sq.eval.added_cost as f64 / total * 100.0,
                peak,
                cost,
                secs,
                status
            );
        }
    }
    println!("peaks in GiB (units of the file); +cost: recomputation as % of one step's cost; `!`: sqrt(n) misses the budget");
    Ok(())
}
