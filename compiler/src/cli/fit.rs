//! `tcc fit`: the largest value of a constant (the batch, usually) whose planned arena fits
//! a memory budget, found before anything runs.

use crate::front::{self, ModelSelection, Options, Sources};
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

/// Compiles with `name = value` and returns the planned arena size.
fn arena_for(
    name: &str,
    bytes: &[u8],
    file: &str,
    sets: &[(String, String)],
    model: &Option<String>,
    value: u64,
) -> Result<u64, String> {
    let mut sets = sets.to_vec();
    sets.retain(|(n, _)| n != name);
    sets.push((name.to_string(), value.to_string()));
    let mut sources = Sources::new(file, bytes);
    let opts = Options {
        sets,
        models: ModelSelection::One(model.clone()),
    };
    let mut lowered = front::compile(&mut sources, &opts)
        .map_err(|d| tcc_grammar::diag::render_all(&d, &sources.map))?;
    if lowered.graphs.is_empty() {
        return Err("no model to compile".into());
    }
    let mut g = lowered.graphs.remove(0);
    crate::passes::run(
        &mut g,
        &crate::passes::PipelineOptions::default(),
        |_, _| {},
    )
    .map_err(|d| tcc_grammar::diag::render_all(&d, &sources.map))?;
    let p = crate::plan::plan(&g, Duration::from_millis(200));
    Ok(p.arena_bytes)
}

/// Runs the search and prints each try and the answer.
pub fn run(
    file: &std::path::Path,
    sets: &[(String, String)],
    model: &Option<String>,
    budget: u64,
    name: &str,
    max: u64,
) -> Result<(), String> {
    let bytes = std::fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let fname = file.display().to_string();
    let mut tried = std::collections::BTreeMap::new();
    let mut eval = |v: u64| -> Result<u64, String> {
        if let Some(&a) = tried.get(&v) {
            return Ok(a);
        }
        let a = arena_for(name, &bytes, &fname, sets, model, v)?;
        println!("  {name} = {v:>8}: arena {}", super::run::bytes(a));
        tried.insert(v, a);
        Ok(a)
    };
    let first = eval(1)?;
    if first > budget {
        return Err(format!(
            "even {name} = 1 needs an arena of {} ({} bytes), over the budget of {}",
            super::run::bytes(first),
            first,
            super::run::bytes(budget)
        ));
    }
    // Double until the arena no longer fits, then bisect.
    let (mut lo, mut hi) = (1u64, 2u64);
    while hi <= max && eval(hi)? <= budget {
        lo = hi;
        hi = hi.saturating_mul(2);
    }
    let hi = hi.min(max + 1);
    let (mut lo, mut hi) = (lo, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if eval(mid)? <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let a = eval(lo)?;
    println!(
        "largest {name} that fits {}: {lo} (arena {}){}",
        super::run::bytes(budget),
        super::run::bytes(a),
        if lo == max {
            " — the --max limit"
        } else {
            ""
        }
    );
    Ok(())
}
