//! `tcc mem`: the memory figures of a build, with the evidence.

use super::run::bytes;
use crate::analysis::liveness::liveness;
use crate::eager::memory::{self, EagerMemory};
use crate::front::Sources;
use crate::ir::Graph;
use crate::plan::Plan;
use serde::Serialize;
use std::time::{Duration, Instant};

/// A tensor live at the plan's peak.
#[derive(Serialize, Debug)]
pub struct LiveTensor {
    pub bytes: u64,
    pub op: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub source: String,
}

/// Bytes of one dtype in the compiled plan.
#[derive(Serialize, Debug)]
pub struct DtypeBytes {
    pub dtype: String,
    /// Params and optimizer state of this dtype.
    pub persistent_bytes: u64,
    /// Transient buffers of this dtype live at the plan's peak.
    pub peak_transient_bytes: u64,
}

/// Everything `tcc mem` reports (also its `--json` form).
#[derive(Serialize, Debug)]
pub struct MemReport {
    pub model: String,
    /// `cpu` or `cuda`: the target whose plan this is.
    pub target: String,
    /// `--amp`: `off`, `bf16` or `f16`.
    pub amp: String,
    /// `--gpus N`: the plan is each data-parallel rank's (absent: a step that runs alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    /// `--micro-batches K`: the step runs its batch as K slices (absent: 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<usize>,
    /// The loss head runs in K chunks (`--loss-chunks`, or chosen; absent: whole).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_chunks: Option<usize>,
    /// Nodes of the final graph (the one the kernels compute).
    pub nodes: usize,
    /// tcc's own op-by-op execution of the step (`tcc run --eager`): every value
    /// allocated when made and freed after its last use. Not PyTorch's figure.
    pub eager_peak_bytes: u64,
    pub eager_param_bytes: u64,
    pub eager_state_bytes: u64,
    pub eager_input_bytes: u64,
    pub eager_transient_bytes: u64,
    /// The step built with one op per kernel (`tcc build --no-fuse`): its kernels, and its
    /// bytes were every buffer its own.
    pub unfused_kernels: usize,
    pub no_reuse_bytes: u64,
    pub lower_bound_program_order_bytes: u64,
    pub lower_bound_bytes: u64,
    /// The arena of the step built with one op per kernel (`tcc build --no-fuse`): what
    /// the fused arena never exceeds.
    pub arena_bytes: u64,
    pub persistent_bytes: u64,
    pub transient_bytes: u64,
    pub fragmentation: f64,
    pub arena_over_eager: f64,
    /// The fused plan's offset method, whether it is optimal for its kernel order, its
    /// coloring alternative, buffers and values stored in place.
    pub method: String,
    pub optimal: bool,
    pub coloring_bytes: u64,
    pub slots: usize,
    pub buffers: usize,
    pub in_place: usize,
    pub plan_ms: f64,
    /// The compiled program: kernels after fusion, and their plan (fused intermediates
    /// have no buffer); `plan_ms` is the time of the stages from `outputs` to `plan`.
    pub fused_kernels: usize,
    pub fused_arena_bytes: u64,
    pub fused_lower_bound_bytes: u64,
    pub fused_persistent_bytes: u64,
    /// CUDA: the scratch region stream-K matmuls share (inside the fused arena).
    pub fused_scratch_bytes: u64,
    /// The largest bytes of transient buffers live at once over the fused kernels (each
    /// rounded up to the arena alignment, as planned).
    pub fused_peak_transient_bytes: u64,
    pub fused_over_eager: f64,
    /// Parameter gradients (and the contributions they are summed from) live at the fused
    /// plan's peak: bytes and buffers.
    pub gradient_peak_bytes: u64,
    pub gradient_peak_buffers: usize,
    /// Fusion weighed against the peak (`kernel::peak`): the transient peak as first fused,
    /// the rounds that gave values buffers of their own to lower it, how many values, and
    /// whether the unfused kernels were kept.
    pub fusion_first_peak_bytes: u64,
    pub fusion_peak_rounds: usize,
    pub fusion_given_buffers: usize,
    pub fusion_unfused_kept: bool,
    /// That as one line of text (absent when fusion kept its first decisions).
    pub fusion_peak_line: Option<String>,
    /// Free recomputation (`remat::step::free`, off with `--remat none`): whether it ran
    /// and was kept, and the arena without it.
    pub free_recompute_kept: bool,
    pub free_recompute_values: usize,
    pub free_recompute_arena_without_bytes: Option<u64>,
    /// That as one line of text (absent when there was nothing to recompute).
    pub free_recompute_line: Option<String>,
    /// Product recomputation (`remat::step::products`, on CUDA): whether it
    /// was kept, and its line (absent when it had no candidate).
    pub product_recompute_kept: bool,
    pub product_recompute_line: Option<String>,
    /// Every transient buffer live at the peak, largest first (the table shows ten).
    pub live_at_peak: Vec<LiveTensor>,
    /// The compiled plan's bytes by dtype.
    pub fused_bytes_by_dtype: Vec<DtypeBytes>,
    /// A data-parallel step's model states on each GPU, against the ZeRO formula.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_states: Option<ModelStates>,
}

/// The model states of one rank of a data-parallel step: the formula `params + gradients
/// + optimizer state / N` (ZeRO-1; `/ 1` without `--zero 1`) against the plan.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
pub struct ModelStates {
    pub ranks: usize,
    pub zero: bool,
    /// Every param, every trained param's gradient, and the optimizer state of all ranks
    /// together (each param's shards counted whole).
    pub param_bytes: u64,
    pub gradient_bytes: u64,
    pub state_bytes: u64,
    /// `param_bytes + gradient_bytes + state_bytes / N` (with ZeRO-1; else `/ 1`).
    pub formula_bytes: u64,
    /// The plan's persistent bytes: params and this rank's optimizer state, each aligned;
    /// the formula's share without gradients is `param_bytes + state_bytes / N`.
    pub planned_persistent_bytes: u64,
}

/// [`ModelStates`] of a data-parallel graph (`None` for a step that runs alone). A state
/// named after a param (`NAME.suffix`) with `⌈n / N⌉` of the param's `n` elements is a
/// ZeRO-1 shard.
pub fn model_states(g: &Graph, planned_persistent_bytes: u64) -> Option<ModelStates> {
    use crate::ir::Op;
    let ranks = g.ranks?;
    let zero = g
        .node_ids()
        .any(|n| matches!(g.node(n).op, Op::ReduceScatter { .. }));
    let mut params: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
    let mut param_bytes = 0;
    for &p in &g.params {
        if let Op::Param { name, .. } = &g.node(p).op {
            let ty = g.ty(p);
            params.insert(name, (ty.shape.numel(), ty.size_bytes() as u64));
            param_bytes += ty.size_bytes() as u64;
        }
    }
    let gradient_bytes = g
        .grads
        .iter()
        .map(|&(p, _)| g.ty(p).size_bytes() as u64)
        .sum();
    let mut state_bytes = 0u64;
    for n in g.node_ids() {
        let Op::State { name, ty } = &g.node(n).op else {
            continue;
        };
        let owner = name.rsplit_once('.').and_then(|(o, _)| params.get(o));
        state_bytes += match owner {
            // A shard: the whole state has the param's elements.
            Some(&(numel, _)) if zero && ty.shape.numel() == numel.div_ceil(ranks) => {
                (numel * ty.dtype.size_bytes()) as u64
            }
            _ => ty.size_bytes() as u64,
        };
    }
    let divisor = if zero { ranks as u64 } else { 1 };
    Some(ModelStates {
        ranks,
        zero,
        param_bytes,
        gradient_bytes,
        state_bytes,
        formula_bytes: param_bytes + gradient_bytes + state_bytes / divisor,
        planned_persistent_bytes,
    })
}

/// Bytes of the buffers live at the plan's peak that hold parameter gradients
/// ([`Graph::gradient_nodes`]), and how many buffers.
fn gradient_bytes_at_peak(g: &Graph, lv: &crate::analysis::liveness::Liveness) -> (u64, usize) {
    let grads = g.gradient_nodes(g.grads.iter().map(|&(_, d)| d));
    let peak = lv.peak_step();
    lv.buffers
        .iter()
        .filter(|b| {
            b.kind != crate::analysis::liveness::BufferKind::Persistent
                && b.start <= peak
                && peak < b.end
                && b.nodes.iter().any(|n| grads.contains(n))
        })
        .fold((0, 0), |(s, c), b| (s + b.bytes, c + 1))
}

/// Persistent bytes and bytes live at the peak, by the dtype of each buffer's owner.
fn by_dtype(g: &Graph, lv: &crate::analysis::liveness::Liveness) -> Vec<DtypeBytes> {
    use crate::analysis::liveness::BufferKind;
    let peak = lv.peak_step();
    let mut rows: std::collections::BTreeMap<&'static str, (u64, u64)> = Default::default();
    for b in &lv.buffers {
        let Some(node) = g.get(b.owner) else { continue };
        let row = rows.entry(node.ty.dtype.name()).or_default();
        if b.kind == BufferKind::Persistent {
            row.0 += b.bytes;
        } else if b.start <= peak && peak < b.end {
            row.1 += b.bytes;
        }
    }
    rows.into_iter()
        .map(|(d, (p, t))| DtypeBytes {
            dtype: d.to_string(),
            persistent_bytes: p,
            peak_transient_bytes: t,
        })
        .collect()
}

/// What `tcc mem` found: the report, the plan that runs (fused kernels, one step a kernel)
/// and the graph it computes, and the eager accounting.
pub struct MemFindings {
    pub report: MemReport,
    pub graph: Graph,
    pub plan: Plan,
    pub eager: EagerMemory,
}

/// Plans `scheduled` for `compile`'s target as the build does (the stages from `outputs`
/// to `plan`), fused and with one op per kernel (`--no-fuse`); `program` is the same step
/// in program order (after autodiff, before scheduling) for the eager baseline and the
/// before-scheduling bound.
pub fn report(
    program: &Graph,
    scheduled: &Graph,
    sources: &Sources,
    budget: Duration,
    compile: &crate::artifact::CompileOptions,
    free: Option<&crate::remat::step::Free>,
) -> Result<MemFindings, String> {
    let amp = compile.amp;
    // Under `--amp` the eager baseline is of the mixed-precision step (autocast's op-by-op
    // execution of it); the plans apply the policy in their `amp` stage.
    let mixed = |g: &Graph| {
        amp.apply_to(g)
            .map_err(|e| format!("internal error: mixed precision: {}", e.message))
    };
    let program = &mixed(program)?;
    let eager = memory::account(program);
    let porder = program
        .topo_order()
        .unwrap_or_else(|| program.node_ids().collect());
    let plv = liveness(program, &porder);
    // What runs: the compiled program's own plan (fusion, output copies, fused attention on
    // CUDA, split reductions, mixed precision).
    let start = Instant::now();
    let planned = crate::artifact::plan_step(
        scheduled,
        &crate::artifact::CompileOptions {
            plan_budget: budget,
            ..*compile
        },
    )
    .map_err(|e| e.to_string())?;
    let plan_ms = start.elapsed().as_secs_f64() * 1e3;
    let final_graph = planned.graph;
    // The baseline: the same step built with one op per kernel (`tcc build --no-fuse`).
    let unfused = crate::artifact::plan_step(
        scheduled,
        &crate::artifact::CompileOptions {
            plan_budget: budget,
            fuse: crate::kernel::fuse::FuseOptions {
                fuse: false,
                ..compile.fuse
            },
            ..*compile
        },
    )
    .map_err(|e| e.to_string())?;
    let p = unfused.plan;
    let (fused, fp) = (planned.fused, planned.plan);
    // Buffers live at the step where the fused plan's transient bytes peak.
    let lv = &fp.liveness;
    let peak_step = lv.peak_step();
    let mut at_peak: Vec<&crate::analysis::liveness::Buffer> = lv
        .buffers
        .iter()
        .filter(|b| {
            b.kind != crate::analysis::liveness::BufferKind::Persistent
                && b.start <= peak_step
                && peak_step < b.end
        })
        .collect();
    at_peak.sort_by_key(|b| (std::cmp::Reverse(b.bytes), b.owner));
    let live_at_peak = at_peak
        .iter()
        .filter_map(|b| {
            let node = final_graph.get(b.owner)?;
            Some(LiveTensor {
                bytes: b.bytes,
                op: node.op.name(),
                ty: node.ty.to_string(),
                source: sources.map.location(node.span).to_string(),
            })
        })
        .collect();
    let fused_bytes_by_dtype = by_dtype(&final_graph, lv);
    let (gradient_peak_bytes, gradient_peak_buffers) = gradient_bytes_at_peak(&final_graph, lv);
    let fused_peak = crate::kernel::peak::fused_peak(&final_graph, &fused);
    let r = MemReport {
        model: scheduled.name.clone(),
        target: compile.target.name().to_string(),
        amp: amp.name().to_string(),
        ranks: final_graph.ranks,
        micro_batches: final_graph.micro_batches,
        loss_chunks: final_graph.loss_chunks,
        nodes: final_graph.node_count(),
        eager_peak_bytes: eager.peak_bytes(),
        eager_param_bytes: eager.param_bytes,
        eager_state_bytes: eager.state_bytes,
        eager_input_bytes: eager.input_bytes,
        eager_transient_bytes: eager.peak_transient_bytes,
        unfused_kernels: unfused.fused.kernels.len(),
        no_reuse_bytes: p.no_reuse_bytes,
        lower_bound_program_order_bytes: p.persistent_bytes + plv.max_live(),
        lower_bound_bytes: p.lower_bound,
        arena_bytes: p.arena_bytes,
        persistent_bytes: p.persistent_bytes,
        transient_bytes: p.arena_bytes - p.persistent_bytes,
        fragmentation: p.fragmentation(),
        arena_over_eager: p.arena_bytes as f64 / eager.peak_bytes().max(1) as f64,
        method: fp.method.to_string(),
        optimal: fp.optimal,
        coloring_bytes: fp.persistent_bytes + fp.coloring_bytes,
        slots: fp.slots,
        buffers: lv.buffers.len(),
        in_place: lv.in_place.len(),
        plan_ms,
        fused_kernels: fused.kernels.len(),
        fused_arena_bytes: fp.arena_bytes,
        fused_lower_bound_bytes: fp.lower_bound,
        fused_persistent_bytes: fp.persistent_bytes,
        fused_scratch_bytes: fp.scratch_bytes,
        fused_peak_transient_bytes: fused_peak,
        fused_over_eager: fp.arena_bytes as f64 / eager.peak_bytes().max(1) as f64,
        gradient_peak_bytes,
        gradient_peak_buffers,
        fusion_first_peak_bytes: fused.peak.first,
        fusion_peak_rounds: fused.peak.rounds,
        fusion_given_buffers: fused.peak.given_buffers,
        fusion_unfused_kept: fused.peak.unfused_kept,
        fusion_peak_line: fused.peak.line(),
        free_recompute_kept: free.is_some_and(|f| f.kept),
        free_recompute_values: free.map_or(0, |f| f.values),
        free_recompute_arena_without_bytes: free.map(|f| f.arena.0),
        free_recompute_line: free.filter(|f| f.values > 0).map(|f| f.line()),
        product_recompute_kept: free
            .and_then(|f| f.products.as_ref())
            .is_some_and(|p| p.kept),
        product_recompute_line: free.and_then(|f| f.products.as_ref()).map(|p| p.line()),
        live_at_peak,
        fused_bytes_by_dtype,
        model_states: model_states(&final_graph, fp.persistent_bytes),
    };
    Ok(MemFindings {
        report: r,
        graph: final_graph,
        plan: fp,
        eager,
    })
}

/// The text table. `timing` adds the planning time (left out of snapshots).
pub fn text(r: &MemReport, timing: bool) -> String {
    let mut s = String::new();
    let line = |s: &mut String, k: &str, v: u64, note: String| {
        s.push_str(&format!("  {k:<30} {:>12}  {note}\n", bytes(v)));
    };
    s.push_str(&format!(
        "memory plan of model `{}` for {} ({} nodes){}\n",
        r.model,
        r.target,
        r.nodes,
        match r.ranks {
            Some(n) => format!(
                "; each of {n} data-parallel ranks (GPUs): one rank's batch, its gradients \
                 stored for the reduction"
            ),
            None => String::new(),
        }
    ));
    if let Some(k) = r.micro_batches {
        s.push_str(&format!(
            "  micro-batches {k}: the batch runs as {k} slices, one after another; the \
             gradients add up in f32 buffers that live through the step\n"
        ));
    }
    if let Some(k) = r.loss_chunks {
        s.push_str(&format!(
            "  loss head in {k} chunks: its last matmul and the loss over it run on {k} \
             slices of the batch, each one's backward right after it (`--loss-chunks 1`: \
             whole)\n"
        ));
    }
    line(
        &mut s,
        "eager, op by op (tcc --eager)",
        r.eager_peak_bytes,
        format!(
            "params {} + optimizer state {} + inputs {} + transient {}",
            bytes(r.eager_param_bytes),
            bytes(r.eager_state_bytes),
            bytes(r.eager_input_bytes),
            bytes(r.eager_transient_bytes)
        ),
    );
    line(
        &mut s,
        "no reuse",
        r.no_reuse_bytes,
        "one kernel per op, every buffer its own bytes".into(),
    );
    line(
        &mut s,
        "max-live lower bound",
        r.lower_bound_bytes,
        format!(
            "one kernel per op (ops in program order, before scheduling: {})",
            bytes(r.lower_bound_program_order_bytes)
        ),
    );
    line(
        &mut s,
        "arena, one kernel per op",
        r.arena_bytes,
        format!(
            "{} kernels (--no-fuse); persistent {} + transient {}; {:.3}x eager",
            r.unfused_kernels,
            bytes(r.persistent_bytes),
            bytes(r.transient_bytes),
            r.arena_over_eager
        ),
    );
    line(
        &mut s,
        "arena, fused (what runs)",
        r.fused_arena_bytes,
        format!(
            "{} kernels; persistent {} + transient peak {}{}; {:.3}x eager",
            r.fused_kernels,
            bytes(r.fused_persistent_bytes),
            bytes(r.fused_peak_transient_bytes),
            if r.fused_scratch_bytes > 0 {
                format!(" + matmul scratch {}", bytes(r.fused_scratch_bytes))
            } else {
                String::new()
            },
            r.fused_over_eager
        ),
    );
    if let Some(l) = &r.fusion_peak_line {
        s.push_str(&format!("  {:<30} {l}\n", ""));
    }
    if let Some(l) = &r.free_recompute_line {
        s.push_str(&format!("  {:<30} {l}\n", "free recomputation"));
    }
    if let Some(l) = &r.product_recompute_line {
        s.push_str(&format!("  {:<30} {l}\n", "product recomputation"));
    }
    s.push_str(&format!(
        "  {:<30} {:>11.2}%  fused arena / its lower bound {} - 1\n",
        "fragmentation",
        (r.fused_arena_bytes as f64 / r.fused_lower_bound_bytes.max(1) as f64 - 1.0) * 100.0,
        bytes(r.fused_lower_bound_bytes)
    ));
    s.push_str(&format!(
        "  plan: {} buffers ({} stored in place), offsets by {}{}; {}{}\n",
        r.buffers,
        r.in_place,
        r.method,
        if r.optimal {
            " (optimal for this kernel order)"
        } else {
            ""
        },
        if r.slots > 0 {
            format!(
                "coloring into {} slots would need {}",
                r.slots,
                bytes(r.coloring_bytes)
            )
        } else {
            "coloring not tried (too many buffers live at once)".to_string()
        },
        if timing {
            format!("; compiled and planned in {:.1} ms", r.plan_ms)
        } else {
            String::new()
        }
    ));
    if let Some(m) = &r.model_states {
        let n = if m.zero { m.ranks } else { 1 };
        s.push_str(&format!(
            "  {:<30} {:>12}  params {} + gradients {} + optimizer state {} / {n}{}; planned \
             persistent {} (params + {}optimizer state: {:+.2}% of the formula's {})\n",
            "model states per GPU",
            bytes(m.formula_bytes),
            bytes(m.param_bytes),
            bytes(m.gradient_bytes),
            bytes(m.state_bytes),
            if m.zero { " (ZeRO-1)" } else { "" },
            bytes(m.planned_persistent_bytes),
            if m.zero {
                "this GPU's shard of the "
            } else {
                ""
            },
            (m.planned_persistent_bytes as f64
                / (m.param_bytes + m.state_bytes / n as u64).max(1) as f64
                - 1.0)
                * 100.0,
            bytes(m.param_bytes + m.state_bytes / n as u64),
        ));
    }
    s.push_str(&format!(
        "  {:<30} {:>12}  in {} buffers (parameter gradients and their contributions)\n",
        "gradients live at the peak",
        bytes(r.gradient_peak_bytes),
        r.gradient_peak_buffers
    ));
    if r.amp != "off" {
        s.push_str(&format!("  by dtype (fused plan, --amp {}):\n", r.amp));
        for d in &r.fused_bytes_by_dtype {
            s.push_str(&format!(
                "    {:<6} persistent {:>12}  live at the peak {:>12}\n",
                d.dtype,
                bytes(d.persistent_bytes),
                bytes(d.peak_transient_bytes)
            ));
        }
    }
    s.push_str(&format!(
        "  largest tensors live at the peak ({} in all):\n",
        r.live_at_peak.len()
    ));
    for t in r.live_at_peak.iter().take(10) {
        s.push_str(&format!(
            "    {:>12}  {:<24} {:<18} {}\n",
            bytes(t.bytes),
            t.ty,
            t.op,
            t.source
        ));
    }
    s
}
