//! `tcc run --eager`: steps of the reference interpreter with outputs, timing and the eager
//! memory accounting.

use crate::eager::{self, memory, Persistent, Precision, Tensor};
use crate::front::Sources;
use crate::ir::{Graph, Op};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

pub struct RunOptions {
    pub steps: u32,
    pub every: u32,
    pub seed: u64,
    pub inputs: Vec<(String, String)>,
    pub param_file: Option<PathBuf>,
    pub save_params: Option<PathBuf>,
}

/// Formats a byte count with a binary unit.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// One line describing a tensor: type, mean and the first values.
pub fn summary(t: &Tensor) -> String {
    let v = t.to_f64();
    let shown: Vec<String> = v.iter().take(4).map(|x| format!("{x:.6}")).collect();
    let more = if v.len() > 4 { ", …" } else { "" };
    if v.len() == 1 {
        return format!("{} = {:.6}", t.ty, v[0]);
    }
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    format!("{} mean {mean:.6} [{}{more}]", t.ty, shown.join(", "))
}

pub fn run_eager(
    g: &Graph,
    sources: &Sources,
    opts: &RunOptions,
    compile_ms: f64,
) -> Result<(), String> {
    let mut persistent: Persistent = eager::init_persistent(g, opts.seed);
    if let Some(path) = &opts.param_file {
        let wanted: Vec<(String, crate::ir::TensorType)> = g
            .params
            .iter()
            .chain(&g.states)
            .filter_map(|&p| match &g.node(p).op {
                Op::Param { name, ty, .. } | Op::State { name, ty } => {
                    Some((name.clone(), ty.clone()))
                }
                _ => None,
            })
            .collect();
        let loaded = eager::io::read_safetensors(path, &wanted).map_err(|e| e.to_string())?;
        eprintln!("loaded {} tensors from {}", loaded.len(), path.display());
        for (n, t) in loaded {
            persistent.values.insert(n, t);
        }
    }
    let mut inputs = eager::random_inputs(g, opts.seed);
    for (name, file) in &opts.inputs {
        let ty = g
            .inputs
            .iter()
            .find_map(|&i| match &g.node(i).op {
                Op::Input { name: n, ty } if n == name => Some(ty.clone()),
                _ => None,
            })
            .ok_or_else(|| {
                let names: Vec<String> = inputs.keys().cloned().collect();
                format!(
                    "--input {name}: the model has no input `{name}` (inputs: {})",
                    names.join(", ")
                )
            })?;
        let t = eager::io::read_npy(std::path::Path::new(file), name, &ty)
            .map_err(|e| e.to_string())?;
        inputs.insert(name.clone(), t);
    }
    if opts.steps == 0 {
        eprintln!("model `{}`: {} nodes, compiled in {compile_ms:.1} ms; --steps 0: memory accounting only", g.name, g.node_count());
    } else {
        eprintln!(
            "model `{}`: {} nodes, compiled in {compile_ms:.1} ms; running {} step{} eagerly",
            g.name,
            g.node_count(),
            opts.steps,
            if opts.steps == 1 { "" } else { "s" }
        );
    }
    let mut times = Vec::with_capacity(opts.steps as usize);
    for step in 1..=opts.steps {
        let start = Instant::now();
        let outs = eager::run_step(g, &mut persistent, &inputs, Precision::Native)
            .map_err(|e| e.to_string())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        if step % opts.every == 0 || step == opts.steps {
            let mut line = format!("step {step:>4}");
            for (name, t) in &outs {
                let _ = write!(line, "  {name}: {}", summary(t));
            }
            println!("{line}");
        }
    }
    let mem = memory::account(g);
    print_memory(g, sources, &mem);
    if !times.is_empty() {
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        println!(
            "step time: median {median:.2} ms over {} step{} (first {:.2} ms)",
            times.len(),
            if times.len() == 1 { "" } else { "s" },
            times[0]
        );
    }
    if let Some(path) = &opts.save_params {
        let tensors: Vec<(String, Tensor)> = persistent.values.into_iter().collect();
        let bytes = eager::io::write_safetensors(&tensors)
            .map_err(|e| format!("cannot save params: {e}"))?;
        std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("saved {} tensors to {}", tensors.len(), path.display());
    }
    Ok(())
}

/// Prints the eager memory accounting.
pub fn print_memory(g: &Graph, sources: &Sources, mem: &memory::EagerMemory) {
    println!(
        "eager memory peak: {} = params {} + optimizer state {} + inputs {} + transient {}",
        bytes(mem.peak_bytes()),
        bytes(mem.param_bytes),
        bytes(mem.state_bytes),
        bytes(mem.input_bytes),
        bytes(mem.peak_transient_bytes)
    );
    let at = mem.order.get(mem.peak_position).map(|&n| {
        let node = g.node(n);
        format!("{} {}", node.op.name(), sources.map.location(node.span))
    });
    println!(
        "  peak reached at op {}/{} ({}); largest tensors live then:",
        mem.peak_position + 1,
        mem.order.len(),
        at.unwrap_or_default()
    );
    for (n, b) in mem.live_at_peak.iter().take(8) {
        let node = g.node(*n);
        println!(
            "    {:>12}  {:<22} {:<18} {}",
            bytes(*b),
            node.ty.to_string(),
            node.op.name(),
            sources.map.location(node.span)
        );
    }
}
