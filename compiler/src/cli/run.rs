//! `tcc run --eager`: steps of the reference interpreter with outputs, timing and the eager
//! memory accounting.

use crate::eager::{self, memory, Data, Persistent, Precision, Tensor};
use crate::front::Sources;
use crate::ir::{Graph, Op};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;
use tcc_runtime::artifact::is_check_output;

pub struct RunOptions {
    pub steps: u32,
    pub every: u32,
    pub seed: u64,
    pub inputs: Vec<(String, String)>,
    pub param_file: Option<PathBuf>,
    pub save_params: Option<PathBuf>,
    /// CPU threads of compiled runs (0: one per available core).
    pub threads: usize,
    /// f32 matmuls may use TF32 tensor cores (CUDA).
    pub allow_tf32: bool,
    /// `--gpus N`: data-parallel ranks (an artifact's own when not given).
    pub gpus: Option<u32>,
    /// ZeRO-1 for a `.tdsl` compiled here (`--zero 1`).
    pub zero: bool,
    /// Mixed precision of a `.tdsl` compiled or interpreted here.
    pub amp: crate::passes::amp::Amp,
    /// Go on after non-finite outputs, and save non-finite params (`--allow-nonfinite`).
    pub allow_nonfinite: bool,
    /// Values of params without an initialiser (an imported model's initializers).
    pub params: std::collections::BTreeMap<String, Tensor>,
    /// Write every output of the last step to `DIR/NAME.npy` (`--save-outputs DIR`).
    pub save_outputs: Option<PathBuf>,
}

/// Writes each output as `dir/NAME.npy` (the folder is made if missing).
pub fn save_outputs(dir: &std::path::Path, outs: &[(String, Tensor)]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for (name, t) in outs {
        let path = dir.join(format!("{name}.npy"));
        let bytes = eager::io::write_npy(t).map_err(|e| format!("output `{name}`: {e}"))?;
        tcc_runtime::fsutil::write_atomic(&path, &bytes)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    eprintln!("saved {} outputs to {}", outs.len(), dir.display());
    Ok(())
}

/// Where `t` first holds a NaN or an infinity: `(index, value)`.
fn first_nonfinite(t: &Tensor) -> Option<(usize, f64)> {
    if !t.ty.dtype.is_float() {
        return None;
    }
    t.to_f64()
        .into_iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
}

/// The error a non-finite output stops a run with (unless `--allow-nonfinite`): outputs of
/// one element are checked every step, the others on printed steps.
fn check_outputs<'a>(
    step: u32,
    printed: bool,
    outs: impl Iterator<Item = (&'a str, &'a Tensor)>,
) -> Result<(), String> {
    for (name, t) in outs {
        if !printed && t.ty.shape.numel() != 1 {
            continue;
        }
        if let Some((i, v)) = first_nonfinite(t) {
            let at = if t.ty.shape.numel() == 1 {
                String::new()
            } else {
                format!(" (element {i})")
            };
            return Err(format!(
                "step {step}: output `{name}` is {v}{at}; the run stops at the first non-finite step (`--allow-nonfinite` goes on)"
            ));
        }
    }
    Ok(())
}

/// The error a step whose updated params are not finite stops the run with (unless
/// `--allow-nonfinite`): `sum` is the sum of their magnitudes the step's finite check
/// computed (`None`: the step has no such check).
fn check_updates(step: u32, sum: Option<f32>) -> Result<(), String> {
    match sum {
        Some(sum) if !sum.is_finite() => {
            // The runtime's own error, so every path words it the same.
            let e = tcc_runtime::Error::NonFiniteUpdate {
                what: crate::autodiff::UPDATES_CHECKED.to_string(),
                sum,
            };
            Err(format!(
                "step {step}: {e}; the run stops at the first non-finite step \
                 (`--allow-nonfinite` goes on)"
            ))
        }
        _ => Ok(()),
    }
}

/// The error `--save-params` refuses non-finite params with (unless `--allow-nonfinite`).
fn check_params<'a>(params: impl Iterator<Item = (&'a str, &'a Tensor)>) -> Result<(), String> {
    for (name, t) in params {
        if let Some((i, v)) = first_nonfinite(t) {
            return Err(format!(
                "not saving params: `{name}` holds {v} at element {i} (`--allow-nonfinite` saves them anyway)"
            ));
        }
    }
    Ok(())
}

/// Formats a byte count with a binary unit.
pub fn bytes(n: u64) -> String {
    crate::plan::human_bytes(n)
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
    for (n, t) in &opts.params {
        persistent.values.insert(n.clone(), t.clone());
    }
    if let Some(path) = &opts.param_file {
        let wanted: Vec<(String, crate::ir::TensorType)> = g
            .persistent_tensors()
            .into_iter()
            .map(|(_, name, ty)| (name, ty))
            .collect();
        let loaded = eager::io::read_safetensors(path, &wanted).map_err(|e| e.to_string())?;
        super::info!("loaded {} tensors from {}", loaded.len(), path.display());
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
    eager::check_index_inputs(g, &inputs).map_err(|e| e.to_string())?;
    if opts.steps == 0 {
        super::info!("model `{}`: {} nodes, compiled in {compile_ms:.1} ms; --steps 0: memory accounting only", g.name, g.node_count());
    } else {
        super::info!(
            "model `{}`: {} nodes, compiled in {compile_ms:.1} ms; running {} step{} eagerly",
            g.name,
            g.node_count(),
            opts.steps,
            if opts.steps == 1 { "" } else { "s" }
        );
    }
    let mut times = Vec::with_capacity(opts.steps as usize);
    let mut last = Vec::new();
    for step in 1..=opts.steps {
        let start = Instant::now();
        let mut outs = eager::run_step(g, &mut persistent, &inputs, Precision::Native)
            .map_err(|e| e.to_string())?;
        let updated = g
            .checks
            .iter()
            .filter(|c| c.kind == tcc_runtime::artifact::CheckKind::FiniteUpdates)
            .find_map(|c| outs.iter().find(|(n, _)| *n == c.output))
            .and_then(|(_, t)| t.to_f64().first().map(|&v| v as f32));
        outs.retain(|(name, _)| !is_check_output(name));
        times.push(start.elapsed().as_secs_f64() * 1e3);
        let printed = step % opts.every == 0 || step == opts.steps;
        let check = check_outputs(step, printed, outs.iter().map(|(n, t)| (n.as_str(), t)));
        if printed || check.is_err() {
            let mut line = format!("step {step:>4}");
            for (name, t) in &outs {
                let _ = write!(line, "  {name}: {}", summary(t));
            }
            println!("{line}");
        }
        if !opts.allow_nonfinite {
            check?;
            check_updates(step, updated)?;
        }
        last = outs;
    }
    if let Some(dir) = &opts.save_outputs {
        let outs: Vec<(String, Tensor)> = last.into_iter().collect();
        save_outputs(dir, &outs)?;
    }
    let value = |name: &str| persistent.values.get(name).map(|t| t.to_f64()[0]);
    if let (Some(scale), Some(skipped)) = (
        value(crate::autodiff::scale::SCALE),
        value(crate::autodiff::scale::SKIPPED),
    ) {
        println!(
            "loss scale: {scale} for the next step; {skipped} steps skipped (non-finite gradients) in all"
        );
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
        if !opts.allow_nonfinite {
            check_params(persistent.values.iter().map(|(n, t)| (n.as_str(), t)))?;
        }
        let tensors: Vec<(String, Tensor)> = persistent.values.into_iter().collect();
        let bytes = eager::io::write_safetensors(&tensors)
            .map_err(|e| format!("cannot save params: {e}"))?;
        tcc_runtime::fsutil::write_atomic(path, &bytes)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        super::info!("saved {} tensors to {}", tensors.len(), path.display());
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

fn tensor_type(s: &tcc_runtime::artifact::TensorSlot) -> crate::ir::TensorType {
    use tcc_runtime::artifact::DType as D;
    let d = match s.dtype {
        D::F32 => crate::ir::DType::F32,
        D::F16 => crate::ir::DType::F16,
        D::Bf16 => crate::ir::DType::BF16,
        D::I32 => crate::ir::DType::I32,
        D::Bool => crate::ir::DType::Bool,
    };
    crate::ir::TensorType::new(d, s.shape.clone())
}

/// Prints a step's outputs (the scalar ones every step, all on printed steps, and all on a
/// step whose outputs are not finite), and fails on non-finite ones unless allowed.
fn report_step(
    step: u32,
    printed: bool,
    outs: &[(&str, Tensor)],
    allow_nonfinite: bool,
) -> Result<(), String> {
    let check = check_outputs(step, printed, outs.iter().map(|(n, t)| (*n, t)));
    if printed || check.is_err() {
        let mut line = format!("step {step:>4}");
        for (name, t) in outs {
            let _ = write!(line, "  {name}: {}", summary(t));
        }
        println!("{line}");
    }
    if allow_nonfinite {
        Ok(())
    } else {
        check
    }
}

/// The bytes `tcc run` feeds input `slot` when no `--input` file gives it: the program's
/// seeded random values (index inputs below their bound), drawn straight into the dtype's
/// bytes. From an artifact alone, the bound is the one its manifest records, so `tcc run
/// model.tcc` feeds what `tcc run model.tdsl` does.
fn random_input_bytes(
    slot: &tcc_runtime::artifact::TensorSlot,
    graph: Option<&crate::ir::Graph>,
    seed: u64,
) -> Vec<u8> {
    let ty = tensor_type(slot);
    match graph {
        Some(g) => eager::random_graph_input_bytes(g, &slot.name, seed)
            .unwrap_or_else(|| vec![0; ty.size_bytes()]),
        None => {
            eager::random_input_bytes(&slot.name, &ty, slot.index_bound.map(|b| b as usize), seed)
        }
    }
}

/// The outputs of the program, without the in-step checks' counts (the runtime reads
/// those; `tcc run` neither prints nor saves them).
fn user_outputs(
    model: &tcc_runtime::Model,
) -> impl Iterator<Item = &tcc_runtime::artifact::TensorSlot> {
    model.outputs().iter().filter(|s| !is_check_output(&s.name))
}

/// The line `--params` prints: what a params file held of the model's persistent tensors.
fn report_loaded(path: &std::path::Path, loaded: &tcc_runtime::ParamsLoaded) {
    super::info!(
        "loaded {} of {} persistent tensors from {}{}",
        loaded.loaded.len(),
        loaded.loaded.len() + loaded.missing.len(),
        path.display(),
        if loaded.missing.is_empty() {
            String::new()
        } else {
            format!(
                "; not in the file, kept as initialised: {}",
                loaded.missing.join(", ")
            )
        }
    );
}

/// Every `--input NAME=FILE` must name an input of the model.
fn check_input_names(model: &tcc_runtime::Model, opts: &RunOptions) -> Result<(), String> {
    for (name, _) in &opts.inputs {
        if !model.inputs().iter().any(|s| s.name == *name) {
            let names: Vec<&str> = model.inputs().iter().map(|s| s.name.as_str()).collect();
            return Err(format!(
                "--input {name}: the model has no input `{name}` (inputs: {})",
                names.join(", ")
            ));
        }
    }
    Ok(())
}

/// `tcc run` on compiled code (the artifact's target picks the device): one session on the
/// compiled artifact. Inputs not given with `--input` are seeded random values, the same
/// from the source (`graph`) as from an artifact (whose manifest records the index inputs'
/// bounds: embedding ids, labels).
pub fn run_compiled(
    model: &tcc_runtime::Model,
    graph: Option<&Graph>,
    opts: &RunOptions,
    compile_ms: f64,
) -> Result<(), String> {
    let built = model.manifest().ranks.unwrap_or(1);
    if let Some(n) = opts.gpus.filter(|&n| n != built) {
        return Err(tcc_runtime::Error::Ranks {
            built: built as usize,
            given: n as usize,
        }
        .to_string());
    }
    if built > 1 {
        return run_data_parallel(model, graph, opts, compile_ms, built as usize);
    }
    let device = match model.target() {
        tcc_runtime::artifact::Target::Cpu => tcc_runtime::Device::Cpu,
        tcc_runtime::artifact::Target::Cuda => tcc_runtime::Device::Cuda(0),
    };
    let t0 = Instant::now();
    let spinner = crate::progress::Spinner::start(
        &format!(
            "loading `{}` on {device}: compiling {} kernels",
            model.manifest().model,
            model.manifest().kernels.len()
        ),
        super::quiet(),
    );
    let mut s = tcc_runtime::Session::new(model, device).map_err(|e| e.to_string())?;
    // The finite check is reported after the step's outputs (below).
    s.set_allow_nonfinite(true);
    drop(spinner);
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    if device == tcc_runtime::Device::Cpu {
        s.set_threads(opts.threads).map_err(|e| e.to_string())?;
    }
    // `TCC_CUDA_GRAPH=0`: launch the kernels one by one instead of replaying the step's
    // CUDA graph (to measure what the graph saves).
    if std::env::var_os("TCC_CUDA_GRAPH").is_some_and(|v| v == "0") {
        s.set_cuda_graph(false);
    }
    super::info!(
        "model `{}`: {} kernels; {} in {compile_ms:.1} ms, loaded on {device}{} in {load_ms:.1} ms; arena {} in one allocation",
        model.manifest().model,
        model.manifest().kernels.len(),
        // An artifact was read (and its params drawn), a program compiled.
        if graph.is_some() { "compiled" } else { "read and checked" },
        if device == tcc_runtime::Device::Cpu {
            format!(" ({} threads)", s.threads())
        } else {
            format!(" ({})", s.code_origin())
        },
        bytes(s.arena_bytes() as u64),
    );
    if let Some(path) = &opts.param_file {
        let loaded = s.load_params(path).map_err(|e| e.to_string())?;
        report_loaded(path, &loaded);
    }
    let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
    for slot in model.inputs() {
        let bytes = match opts.inputs.iter().find(|(n, _)| *n == slot.name) {
            Some((_, file)) => {
                let path = std::path::Path::new(file);
                eager::io::read_npy_bytes(path, &slot.name, &tensor_type(slot))
                    .map_err(|e| e.to_string())?
                    .bytes
            }
            None => random_input_bytes(slot, graph, opts.seed),
        };
        inputs.push((slot.name.clone(), bytes));
    }
    check_input_names(model, opts)?;
    let mut times = Vec::with_capacity(opts.steps as usize);
    let mut device_times = Vec::with_capacity(opts.steps as usize);
    for step in 1..=opts.steps {
        for (name, b) in &inputs {
            s.set_input_bytes(name, b).map_err(|e| e.to_string())?;
        }
        let start = Instant::now();
        s.run().map_err(|e| e.to_string())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        if let Some(ms) = s.last_step_device_ms() {
            device_times.push(ms as f64);
        }
        let printed = step % opts.every == 0 || step == opts.steps;
        // Scalar outputs (the loss) every step, the others when printed.
        let mut outs: Vec<(&str, Tensor)> = Vec::new();
        for slot in user_outputs(model) {
            let one = slot.shape.iter().product::<usize>() == 1;
            if !(printed || one) {
                continue;
            }
            let b = s.output_bytes(&slot.name).map_err(|e| e.to_string())?;
            if let Some(t) = Tensor::from_le_bytes(tensor_type(slot), b) {
                outs.push((&slot.name, t));
            }
        }
        report_step(step, printed, &outs, opts.allow_nonfinite)?;
        if !opts.allow_nonfinite {
            check_updates(step, s.updated_params_l1().map_err(|e| e.to_string())?)?;
        }
    }
    if let Some(dir) = &opts.save_outputs {
        let mut outs = Vec::new();
        for slot in user_outputs(model) {
            let b = s.output_bytes(&slot.name).map_err(|e| e.to_string())?;
            let t = Tensor::from_le_bytes(tensor_type(slot), b)
                .ok_or_else(|| format!("output `{}` has the wrong size", slot.name))?;
            outs.push((slot.name.clone(), t));
        }
        save_outputs(dir, &outs)?;
    }
    if let Some(ls) = s.loss_scale().map_err(|e| e.to_string())? {
        println!(
            "loss scale: {} for the next step; {} steps skipped (non-finite gradients) in all",
            ls.scale, ls.skipped_steps
        );
    }
    println!(
        "arena: {} (params and optimizer state {}, the rest shared by inputs, outputs and intermediates)",
        bytes(s.arena_bytes() as u64),
        bytes(model.manifest().plan.persistent_bytes)
    );
    if !times.is_empty() {
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        println!(
            "step time: median {median:.2} ms, min {:.2} ms over {} step{} (first {:.2} ms)",
            sorted[0],
            times.len(),
            if times.len() == 1 { "" } else { "s" },
            times[0]
        );
    }
    if device_times.len() > 1 {
        // The first step is the warm-up.
        let mut sorted = device_times[1..].to_vec();
        sorted.sort_by(f64::total_cmp);
        println!(
            "device step time (CUDA events, kernels only, after 1 warm-up step): median {:.3} ms, min {:.3} ms",
            sorted[sorted.len() / 2],
            sorted[0]
        );
    }
    if let Ok((free, total)) = s.device_memory() {
        println!(
            "device memory in use: {} of {} (arena {} + CUDA context, module and other processes)",
            bytes((total - free) as u64),
            bytes(total as u64),
            bytes(s.arena_bytes() as u64)
        );
    }
    if let Ok(used) = s.session_device_bytes() {
        let arena = s.arena_bytes() as u64;
        println!(
            "device memory of this session: {} (arena {} + runtime {}: module, CUDA graph, events; measured by cuMemGetInfo after the context was made, which is not counted)",
            bytes(used as u64),
            bytes(arena),
            bytes((used as u64).saturating_sub(arena))
        );
    }
    if let Some(top) = std::env::var_os("TCC_PROFILE") {
        // `TCC_PROFILE=1` lists the 15 slowest kernels; a larger number lists that many.
        let top = top
            .to_str()
            .and_then(|t| t.parse::<usize>().ok())
            .filter(|&n| n > 1)
            .unwrap_or(15);
        let mut prof = s.profile_kernels().map_err(|e| e.to_string())?;
        let total: f32 = prof.iter().map(|p| p.1).sum();
        prof.sort_by(|a, b| b.1.total_cmp(&a.1));
        println!("kernel profile (one step, kernels launched one by one): {total:.3} ms");
        for (name, ms) in prof.iter().take(top) {
            let describe = model
                .manifest()
                .kernels
                .iter()
                .find(|k| &k.name == name)
                .map(|k| k.describe.clone())
                .unwrap_or_default();
            let short: String = describe.chars().take(90).collect();
            println!("  {ms:>10.3} ms  {name:<6} {short}");
        }
    }
    if let Some(path) = &opts.save_params {
        if !opts.allow_nonfinite {
            let mut params = Vec::new();
            for p in model.persistent() {
                let b = s.param_bytes(&p.slot.name).map_err(|e| e.to_string())?;
                if let Some(t) = Tensor::from_le_bytes(tensor_type(&p.slot), b) {
                    params.push((p.slot.name.as_str(), t));
                }
            }
            check_params(params.iter().map(|(n, t)| (*n, t)))?;
        }
        s.save_params(path).map_err(|e| e.to_string())?;
        super::info!("saved params to {}", path.display());
    }
    Ok(())
}

/// `tcc run --gpus N`: the step on N ranks (GPUs, or CPU ranks for a CPU artifact), each
/// on its own slice of the batch. Random inputs differ per rank (seed + rank); an
/// `--input` file holds the whole batch (split along its first axis) or one rank's (given
/// to every rank). Scalar outputs print as their mean over the ranks (the loss of the
/// whole batch), other outputs as rank 0 has them.
fn run_data_parallel(
    model: &tcc_runtime::Model,
    graph: Option<&Graph>,
    opts: &RunOptions,
    compile_ms: f64,
    ranks: usize,
) -> Result<(), String> {
    let devices: Vec<tcc_runtime::Device> = match model.target() {
        tcc_runtime::artifact::Target::Cpu => vec![tcc_runtime::Device::Cpu; ranks],
        tcc_runtime::artifact::Target::Cuda => (0..ranks).map(tcc_runtime::Device::Cuda).collect(),
    };
    let t0 = Instant::now();
    let spinner = crate::progress::Spinner::start(
        &format!(
            "loading `{}` on {ranks} ranks ({}): compiling {} kernels each",
            model.manifest().model,
            devices
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            model.manifest().kernels.len()
        ),
        super::quiet(),
    );
    let mut dp = tcc_runtime::DataParallel::new(model, &devices).map_err(|e| e.to_string())?;
    dp.set_allow_nonfinite(true);
    drop(spinner);
    if model.target() == tcc_runtime::artifact::Target::Cpu {
        // The ranks share the host's cores.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = if opts.threads > 0 {
            opts.threads
        } else {
            (cores / ranks).max(1)
        };
        for r in 0..ranks {
            if let Some(s) = dp.session_mut(r) {
                s.set_threads(per).map_err(|e| e.to_string())?;
            }
        }
    }
    // `TCC_CUDA_GRAPH=0`: every rank launches its kernels one by one (as a single session).
    if std::env::var_os("TCC_CUDA_GRAPH").is_some_and(|v| v == "0") {
        for r in 0..ranks {
            if let Some(s) = dp.session_mut(r) {
                s.set_cuda_graph(false);
            }
        }
    }
    super::info!(
        "model `{}`: {} kernels; {} in {compile_ms:.1} ms, loaded on {ranks} ranks ({}) in {:.1} ms; arena {} per rank",
        model.manifest().model,
        model.manifest().kernels.len(),
        if graph.is_some() { "compiled" } else { "read and checked" },
        {
            // Each rank's GPU may take other code (SASS for another architecture).
            let mut origins: Vec<String> = (0..ranks)
                .filter_map(|r| dp.session(r).map(|s| s.code_origin().to_string()))
                .collect();
            origins.dedup();
            origins.join("; ")
        },
        t0.elapsed().as_secs_f64() * 1e3,
        bytes(model.arena_bytes() as u64),
    );
    // A ZeRO-1 state is read whole from the file and sharded over the ranks.
    if let Some(path) = &opts.param_file {
        let loaded = dp.load_params(path).map_err(|e| e.to_string())?;
        report_loaded(path, &loaded);
    }
    check_input_names(model, opts)?;
    // Each input's bytes for every rank (the whole batch, rank after rank).
    let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
    for slot in model.inputs() {
        let ty = tensor_type(slot);
        let mut whole = Vec::new();
        if let Some((_, file)) = opts.inputs.iter().find(|(n, _)| *n == slot.name) {
            let mut dims = ty.dims().to_vec();
            let path = std::path::Path::new(file);
            let t = match dims.first_mut() {
                Some(d) => {
                    *d *= ranks;
                    let big = crate::ir::TensorType::new(ty.dtype, dims);
                    eager::io::read_npy_bytes(path, &slot.name, &big)
                        .or_else(|_| eager::io::read_npy_bytes(path, &slot.name, &ty))
                }
                None => eager::io::read_npy_bytes(path, &slot.name, &ty),
            }
            .map_err(|e| e.to_string())?;
            whole = t.bytes;
        } else {
            for r in 0..ranks {
                let seed = opts.seed.wrapping_add(r as u64);
                whole.extend(random_input_bytes(slot, graph, seed));
            }
        }
        inputs.push((slot.name.clone(), whole));
    }
    let mut times = Vec::with_capacity(opts.steps as usize);
    for step in 1..=opts.steps {
        for (name, b) in &inputs {
            dp.set_input_split(name, b).map_err(|e| e.to_string())?;
        }
        let start = Instant::now();
        dp.run().map_err(|e| e.to_string())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        let printed = step % opts.every == 0 || step == opts.steps;
        let mut outs: Vec<(&str, Tensor)> = Vec::new();
        for slot in user_outputs(model) {
            let one = slot.shape.iter().product::<usize>() == 1;
            if !(printed || one) {
                continue;
            }
            // Rank 0's tensor; a float scalar becomes the mean over the ranks.
            let mut first: Option<Tensor> = None;
            let mut sum = 0.0;
            for r in 0..ranks {
                let s = dp.session(r).ok_or("no such rank")?;
                let b = s.output_bytes(&slot.name).map_err(|e| e.to_string())?;
                let t = Tensor::from_le_bytes(tensor_type(slot), b)
                    .ok_or_else(|| format!("output `{}` has the wrong size", slot.name))?;
                if let (true, Data::F(v)) = (one, &t.data) {
                    sum += v.first().copied().unwrap_or(0.0);
                }
                if r == 0 {
                    first = Some(t);
                }
                if !one {
                    break;
                }
            }
            if let Some(mut t) = first {
                if let (true, Data::F(v)) = (one, &mut t.data) {
                    if let Some(x) = v.first_mut() {
                        *x = sum / ranks as f64;
                    }
                }
                outs.push((&slot.name, t));
            }
        }
        report_step(step, printed, &outs, opts.allow_nonfinite)?;
        if !opts.allow_nonfinite {
            // Every rank holds the same params after the step.
            let s = dp.session(0).ok_or("no such rank")?;
            check_updates(step, s.updated_params_l1().map_err(|e| e.to_string())?)?;
        }
    }
    println!(
        "arena: {} per rank on {ranks} ranks (params and optimizer state {})",
        bytes(model.arena_bytes() as u64),
        bytes(model.manifest().plan.persistent_bytes)
    );
    if !times.is_empty() {
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "step time ({ranks} ranks): median {:.2} ms, min {:.2} ms over {} steps (first {:.2} ms)",
            sorted[sorted.len() / 2],
            sorted[0],
            times.len(),
            times[0]
        );
    }
    for r in 0..ranks {
        if let Some(Ok(used)) = dp.session(r).map(|s| s.session_device_bytes()) {
            println!(
                "device memory of rank {r}: {} (arena {} + runtime {})",
                bytes(used as u64),
                bytes(model.arena_bytes() as u64),
                bytes((used as u64).saturating_sub(model.arena_bytes() as u64))
            );
        }
    }
    if let Some(path) = &opts.save_params {
        dp.save_params(path).map_err(|e| e.to_string())?;
        super::info!(
            "saved params (rank 0's, every rank holds the same; ZeRO-1 state put back \
             together from the ranks' shards) to {}",
            path.display()
        );
    }
    Ok(())
}
