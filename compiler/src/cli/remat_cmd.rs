//! `tcc remat`: the rematerialization solvers on external graphs.

use crate::remat::{self, RematGraph};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / (1u64 << 30) as f64)
}

pub fn run(files: &[PathBuf], budgets: &[f64], time_ms: u64) -> Result<(), String> {
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
        let text =
            std::fs::read_to_string(f).map_err(|e| format!("cannot read {}: {e}", f.display()))?;
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
                    if fin { "optimal" } else { "time limit" },
                ),
                (None, true) => ("-".into(), "-".into(), "infeasible"),
                (None, false) => ("-".into(), "-".into(), "not found"),
            };
            let sq_fits = if sq.eval.peak <= budget { "" } else { "!" };
            println!(
                "{:<40} {:>5.0}% {:>10} {:>10} | {:>9}{sq_fits} {:>9.1} | {:>10} {:>9} {:>8.2} {:>9}",
                name,
                frac * 100.0,
                gib(base.eval.peak),
                gib(budget),
                gib(sq.eval.peak),
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
