//! `tcc fit`: the largest value of a constant (the batch, usually) whose planned arena fits
//! a memory budget, found before anything runs.

use super::remat_cmd::{step_graph, RematMode};
use crate::artifact::CompileOptions;
use crate::passes::amp::Amp;
use crate::remat::step;
use std::time::Duration;

/// Parses `16GiB`, `512 MiB`, `1.5GB`, `4096` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| format!("`{s}` is not a size (try 16GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown size unit `{other}` (B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    if !v.is_finite() || v < 0.0 {
        return Err(format!("`{s}` is not a size"));
    }
    Ok((v * mult) as u64)
}

/// What one value gives: the arena without recomputation and, when remat is allowed and
/// needed, the arena and added FLOPs of the decision that fits.
struct Try {
    arena: u64,
    remat: Option<(u64, u64, u64)>,
}

impl Try {
    fn fits(&self, budget: u64) -> bool {
        self.arena <= budget || self.remat.is_some_and(|r| r.0 <= budget)
    }
}

/// Compiles with `name = value` up to the verified plan (and, with `auto`, decides what to
/// recompute when the plain arena is over the budget).
#[allow(clippy::too_many_arguments)]
fn try_value(
    name: &str,
    bytes: &[u8],
    file: &std::path::Path,
    sets: &[(String, String)],
    model: &Option<String>,
    value: u64,
    budget: u64,
    remat: RematMode,
    time_ms: u64,
    amp: Amp,
    parallel: super::Parallel,
) -> Result<Try, String> {
    let mut sets = sets.to_vec();
    sets.retain(|(n, _)| n != name);
    sets.push((name.to_string(), value.to_string()));
    // Asked-for loss chunks apply to the batches they divide (the others keep the head
    // whole), as micro-batch counts do.
    let parallel = match parallel.loss_chunks {
        Some(k)
            if k > 1 && batch_grows(bytes, model, name) && !value.is_multiple_of(u64::from(k)) =>
        {
            super::Parallel {
                loss_chunks: Some(1),
                ..parallel
            }
        }
        _ => parallel,
    };
    let g = step_graph(
        file,
        bytes,
        &sets,
        model,
        remat != RematMode::Manual,
        amp,
        parallel,
    )?;
    let copts = CompileOptions {
        amp,
        ranks: parallel.ranks,
        zero: parallel.zero,
        ..Default::default()
    };
    let base = step::measure(&g, &Default::default(), &copts).map_err(|e| e.to_string())?;
    if base.arena <= budget || remat != RematMode::Auto {
        return Ok(Try {
            arena: base.arena,
            remat: None,
        });
    }
    let o = step::AutoOptions {
        budget,
        compile: copts,
        time_limit: Duration::from_millis(time_ms.max(1)),
        rounds: 6,
    };
    match step::auto(&g, &o) {
        Ok(d) => Ok(Try {
            arena: base.arena,
            remat: Some((d.chosen.arena, d.chosen.added_flops, d.step_flops)),
        }),
        Err(step::RematError::Infeasible { .. }) => Ok(Try {
            arena: base.arena,
            remat: None,
        }),
        Err(e) => Err(e.to_string()),
    }
}

/// Whether `name` is the constant that sizes the program's batch.
fn batch_grows(bytes: &[u8], model: &Option<String>, name: &str) -> bool {
    crate::front::micro_batch::batch_name(&String::from_utf8_lossy(bytes), model.as_deref())
        .is_some_and(|b| b == name)
}

/// Runs the search and prints each try and the answer (also returned).
#[allow(clippy::too_many_arguments)]
pub fn run(
    file: &std::path::Path,
    sets: &[(String, String)],
    model: &Option<String>,
    budget: u64,
    name: &str,
    max: u64,
    remat: RematMode,
    time_ms: u64,
    amp: Amp,
    parallel: super::Parallel,
) -> Result<u64, String> {
    let ranks = parallel.ranks;
    let bytes = super::read_file(file, super::MAX_SOURCE_BYTES)?;
    let mut tried: std::collections::BTreeMap<u64, bool> = std::collections::BTreeMap::new();
    let mut last_fit: Option<(u64, String)> = None;
    let mut smallest: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    let most = parallel.micro_batches.max(1);
    let grows_batch = batch_grows(&bytes, model, name);
    if most > 1 {
        // Whether the program splits at all (batch norm does not), once, before the search.
        let v = if grows_batch { most as u64 } else { 0 };
        let mut sets = sets.to_vec();
        if v > 0 {
            sets.retain(|(n, _)| n != name);
            sets.push((name.to_string(), v.to_string()));
        }
        let p = super::Parallel {
            micro_batches: most,
            ..parallel
        };
        super::remat_cmd::step_graph(file, &bytes, &sets, model, true, amp, p)
            .map_err(|e| format!("`--micro-batches {most}` cannot split this step:\n{e}"))?;
    }
    let mut eval = |v: u64| -> Result<bool, String> {
        if let Some(&a) = tried.get(&v) {
            return Ok(a);
        }
        // The micro-batch counts to try, fewest first: while the batch grows, those that
        // divide it; while another constant grows, none but `most` (the batch is fixed).
        // The arena shrinks as the count grows, so the fewest that fits is bisected.
        let ks: Vec<usize> = if grows_batch {
            (1..=most).filter(|&k| v.is_multiple_of(k as u64)).collect()
        } else if most > 1 {
            vec![1, most]
        } else {
            vec![1]
        };
        let attempt = |k: usize| -> Result<(bool, Try), String> {
            let spinner = crate::progress::Spinner::start(
                &format!(
                    "{name} = {v}{}",
                    if k > 1 {
                        format!(", {k} micro-batches")
                    } else {
                        String::new()
                    }
                ),
                super::quiet(),
            );
            let p = super::Parallel {
                micro_batches: k,
                ..parallel
            };
            let t = try_value(
                name, &bytes, file, sets, model, v, budget, remat, time_ms, amp, p,
            );
            drop(spinner);
            t.map(|t| (t.fits(budget), t))
        };
        let (mut fits, mut t) = attempt(ks[0])?;
        let mut k = ks[0];
        if !fits && ks.len() > 1 {
            let (f, tl) = attempt(ks[ks.len() - 1])?;
            k = ks[ks.len() - 1];
            if !f {
                t = tl;
            } else {
                let (mut lo, mut hi) = (0, ks.len() - 1); // ks[lo] does not fit, ks[hi] does
                let mut best = tl;
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    let (fm, tm) = attempt(ks[mid])?;
                    if fm {
                        hi = mid;
                        best = tm;
                    } else {
                        lo = mid;
                    }
                }
                fits = true;
                t = best;
                k = ks[hi];
            }
        }
        let mut what = match t.remat {
            Some((a, f, total)) => format!(
                "arena {} -> {} with remat (+{:.2}% FLOPs)",
                super::run::bytes(t.arena),
                super::run::bytes(a),
                f as f64 / total.max(1) as f64 * 100.0
            ),
            None => format!("arena {}", super::run::bytes(t.arena)),
        };
        if k > 1 {
            what.push_str(&format!(" with --micro-batches {k}"));
        }
        smallest.insert(v, t.remat.map_or(t.arena, |r| r.0.min(t.arena)));
        println!(
            "  {name} = {v:>8}: {what}{}",
            if fits { "" } else { "  (over)" }
        );
        if fits && last_fit.as_ref().is_none_or(|l| l.0 < v) {
            last_fit = Some((v, what));
        }
        tried.insert(v, fits);
        Ok(fits)
    };
    if !eval(1)? {
        let a = smallest.get(&1).copied().unwrap_or(0);
        return Err(format!(
            "even {name} = 1 needs an arena of {} ({a} bytes), over the budget of {}{}",
            super::run::bytes(a),
            super::run::bytes(budget),
            if remat == RematMode::Auto {
                ", with recomputation"
            } else {
                " (try --remat auto)"
            }
        ));
    }
    // Double until the arena no longer fits, then bisect.
    let (mut lo, mut hi) = (1u64, 2u64);
    while hi <= max && eval(hi)? {
        lo = hi;
        hi = hi.saturating_mul(2);
    }
    let hi = hi.min(max + 1);
    let (mut lo, mut hi) = (lo, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if eval(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    eval(lo)?;
    let what = last_fit.map(|l| l.1).unwrap_or_default();
    println!(
        "largest {name} that fits {}: {lo} ({what}; {}){}",
        super::run::bytes(budget),
        match remat {
            RematMode::Auto => "recomputation allowed",
            RematMode::None => "no recomputation",
            RematMode::Manual => "checkpoint blocks only",
        },
        if lo == max {
            " — the --max limit"
        } else {
            ""
        }
    );
    if ranks > 1 {
        println!(
            "on {ranks} GPUs (data parallel{}, {name} per GPU, each GPU's arena within the \
             budget): a global {name} of {}",
            if parallel.zero { ", ZeRO-1" } else { "" },
            lo.saturating_mul(ranks as u64)
        );
    }
    Ok(lo)
}
