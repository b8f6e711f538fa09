//! `tcc arena`: the planner's offset assignment on a stand-alone interval set.

use super::ArenaArgs;
use crate::analysis::arena;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

pub fn run(args: &ArenaArgs) -> Result<(), String> {
    let text = super::read_text(&args.file, super::MAX_DATA_BYTES)?;
    let (ids, intervals) =
        arena::parse_csv(&text).map_err(|e| format!("{}: {e}", args.file.display()))?;
    let start = Instant::now();
    if let Some(cap) = args.capacity {
        let outcome = arena::search(
            &intervals,
            cap,
            args.align.max(1),
            Duration::from_millis(args.budget_ms),
        );
        let secs = start.elapsed().as_secs_f64();
        return match outcome {
            arena::SearchOutcome::Found(p) => {
                arena::verify(&intervals, &p, args.align.max(1))
                    .map_err(|e| format!("internal error: invalid placement: {e}"))?;
                println!(
                    "{}: fits in {cap} (uses {}) in {secs:.3} s",
                    args.file.display(),
                    p.size
                );
                write_solution(args, &ids, &intervals, &p)
            }
            arena::SearchOutcome::Infeasible => Err(format!(
                "{}: no placement fits in {cap} (proved in {secs:.3} s)",
                args.file.display()
            )),
            arena::SearchOutcome::Unknown => Err(format!(
                "{}: no placement within {cap} found in {secs:.3} s",
                args.file.display()
            )),
        };
    }
    let report = arena::plan(
        &intervals,
        args.align.max(1),
        Duration::from_millis(args.budget_ms),
    );
    let secs = start.elapsed().as_secs_f64();
    arena::verify(&intervals, &report.placement, args.align.max(1))
        .map_err(|e| format!("internal error: invalid placement: {e}"))?;
    // MiniMalloc file names carry the capacity: NAME.CAPACITY.csv.
    let capacity: Option<u64> = args
        .file
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.rsplit('.').next())
        .and_then(|c| c.parse().ok());
    let a = report.placement.size;
    let mut line = format!(
        "{}: {} buffers  arena {a}  lower bound {}  ({:+.2}% over)  {}  by {}  {:.3} s{}",
        args.file.display(),
        intervals.len(),
        report.lower_bound,
        pct(a, report.lower_bound),
        report
            .heuristics
            .iter()
            .map(|(m, size)| format!("{m} {size}"))
            .collect::<Vec<_>>()
            .join(" / "),
        report.placement.method,
        secs,
        if report.optimal { "  optimal" } else { "" }
    );
    if let Some(c) = capacity {
        let _ = write!(line, "  capacity {c} ({:+.2}%)", pct(a, c));
    }
    println!("{line}");
    write_solution(args, &ids, &intervals, &report.placement)
}

fn write_solution(
    args: &ArenaArgs,
    ids: &[String],
    intervals: &[arena::Interval],
    p: &arena::Placement,
) -> Result<(), String> {
    if let Some(out) = &args.output {
        let mut csv = String::from("id,lower,upper,size,offset\n");
        for (i, iv) in intervals.iter().enumerate() {
            let _ = writeln!(
                csv,
                "{},{},{},{},{}",
                ids[i], iv.lower, iv.upper, iv.size, p.offsets[i]
            );
        }
        tcc_runtime::fsutil::write_atomic(out, csv.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    }
    Ok(())
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        (a as f64 / b as f64 - 1.0) * 100.0
    }
}
