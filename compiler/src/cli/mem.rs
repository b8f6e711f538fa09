//! `tcc mem`: the memory figures of a build, with the evidence.

use super::run::bytes;
use crate::analysis::liveness::liveness;
use crate::eager::memory::{self, EagerMemory};
use crate::front::Sources;
use crate::ir::Graph;
use crate::plan::{self, Plan};
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
    /// `--amp`: `off`, `bf16` or `f16`.
    pub amp: String,
    pub nodes: usize,
    pub eager_peak_bytes: u64,
    pub eager_param_bytes: u64,
    pub eager_state_bytes: u64,
    pub eager_input_bytes: u64,
    pub eager_transient_bytes: u64,
    pub no_reuse_bytes: u64,
    pub lower_bound_program_order_bytes: u64,
    pub lower_bound_bytes: u64,
    pub arena_bytes: u64,
    pub persistent_bytes: u64,
    pub transient_bytes: u64,
    pub fragmentation: f64,
    pub arena_over_eager: f64,
    pub method: String,
    pub optimal: bool,
    pub coloring_bytes: u64,
    pub slots: usize,
    pub buffers: usize,
    pub in_place: usize,
    pub plan_ms: f64,
    /// The compiled program: kernels after fusion, and their plan (fused intermediates
    /// have no buffer).
    pub fused_kernels: usize,
    pub fused_arena_bytes: u64,
    pub fused_lower_bound_bytes: u64,
    pub fused_over_eager: f64,
    pub live_at_peak: Vec<LiveTensor>,
    /// The compiled plan's bytes by dtype.
    pub fused_bytes_by_dtype: Vec<DtypeBytes>,
}

/// The step at which the transient buffers of `lv` peak.
fn peak_step(lv: &crate::analysis::liveness::Liveness) -> usize {
    let steps = lv.order.len() + 1;
    let mut live = vec![0u64; steps + 1];
    for b in lv
        .buffers
        .iter()
        .filter(|b| b.kind != crate::analysis::liveness::BufferKind::Persistent)
    {
        for l in &mut live[b.start..b.end.min(steps)] {
            *l += b.bytes;
        }
    }
    live.iter()
        .enumerate()
        .max_by_key(|&(i, &v)| (v, std::cmp::Reverse(i)))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

/// Persistent bytes and bytes live at the peak, by the dtype of each buffer's owner.
fn by_dtype(g: &Graph, lv: &crate::analysis::liveness::Liveness) -> Vec<DtypeBytes> {
    use crate::analysis::liveness::BufferKind;
    let peak = peak_step(lv);
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

/// Plans `scheduled`; `program` is the same step in program order (after autodiff, before
/// scheduling) for the eager baseline and the before-scheduling bound.
pub fn report(
    program: &Graph,
    scheduled: &Graph,
    sources: &Sources,
    budget: Duration,
    amp: crate::passes::amp::Amp,
) -> Result<(MemReport, Plan, EagerMemory), String> {
    // Under `--amp` both the eager baseline and the plans are of the mixed-precision step
    // (eager: autocast's op-by-op execution of it).
    let mixed = |g: &Graph| {
        amp.apply_to(g)
            .map_err(|e| format!("internal error: mixed precision: {}", e.message))
    };
    let (program, scheduled) = (&mixed(program)?, &mixed(scheduled)?);
    let eager = memory::account(program);
    let porder = program
        .topo_order()
        .unwrap_or_else(|| program.node_ids().collect());
    let plv = liveness(program, &porder);
    let start = Instant::now();
    let p = plan::plan(scheduled, budget);
    let plan_ms = start.elapsed().as_secs_f64() * 1e3;
    plan::verify(scheduled, &p)
        .map_err(|e| format!("internal error: the plan does not verify: {e:?}"))?;
    // Buffers live at the step where the plan's transient bytes peak.
    let lv = &p.liveness;
    let peak_step = peak_step(lv);
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
        .take(10)
        .map(|b| {
            let node = scheduled.node(b.owner);
            LiveTensor {
                bytes: b.bytes,
                op: node.op.name(),
                ty: node.ty.to_string(),
                source: sources.map.location(node.span).to_string(),
            }
        })
        .collect();
    // What runs: the compiled program's own plan (fusion, output copies, split reductions).
    let planned = crate::artifact::plan_step(
        scheduled,
        &crate::artifact::CompileOptions {
            plan_budget: budget,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let fused_bytes_by_dtype = by_dtype(&planned.graph, &planned.plan.liveness);
    let (fused, fp) = (planned.fused, planned.plan);
    let r = MemReport {
        model: scheduled.name.clone(),
        amp: amp.name().to_string(),
        nodes: scheduled.node_count(),
        eager_peak_bytes: eager.peak_bytes(),
        eager_param_bytes: eager.param_bytes,
        eager_state_bytes: eager.state_bytes,
        eager_input_bytes: eager.input_bytes,
        eager_transient_bytes: eager.peak_transient_bytes,
        no_reuse_bytes: p.no_reuse_bytes,
        lower_bound_program_order_bytes: p.persistent_bytes + plv.max_live(),
        lower_bound_bytes: p.lower_bound,
        arena_bytes: p.arena_bytes,
        persistent_bytes: p.persistent_bytes,
        transient_bytes: p.arena_bytes - p.persistent_bytes,
        fragmentation: p.fragmentation(),
        arena_over_eager: p.arena_bytes as f64 / eager.peak_bytes().max(1) as f64,
        method: p.method.to_string(),
        optimal: p.optimal,
        coloring_bytes: p.persistent_bytes + p.coloring_bytes,
        slots: p.slots,
        buffers: lv.buffers.len(),
        in_place: lv.in_place.len(),
        plan_ms,
        fused_kernels: fused.kernels.len(),
        fused_arena_bytes: fp.arena_bytes,
        fused_lower_bound_bytes: fp.lower_bound,
        fused_over_eager: fp.arena_bytes as f64 / eager.peak_bytes().max(1) as f64,
        live_at_peak,
        fused_bytes_by_dtype,
    };
    Ok((r, p, eager))
}

/// The text table. `timing` adds the planning time (left out of snapshots).
pub fn text(r: &MemReport, timing: bool) -> String {
    let mut s = String::new();
    let line = |s: &mut String, k: &str, v: u64, note: String| {
        s.push_str(&format!("  {k:<30} {:>12}  {note}\n", bytes(v)));
    };
    s.push_str(&format!(
        "memory plan of model `{}` ({} nodes)\n",
        r.model, r.nodes
    ));
    line(
        &mut s,
        "eager peak (PyTorch-style)",
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
        "every buffer its own bytes".into(),
    );
    line(
        &mut s,
        "max-live lower bound",
        r.lower_bound_bytes,
        format!(
            "of the chosen schedule (program order: {})",
            bytes(r.lower_bound_program_order_bytes)
        ),
    );
    line(
        &mut s,
        "arena, one kernel per op",
        r.arena_bytes,
        format!(
            "persistent {} + transient {}",
            bytes(r.persistent_bytes),
            bytes(r.transient_bytes)
        ),
    );
    s.push_str(&format!(
        "  {:<30} {:>11.2}%  arena / lower bound - 1\n",
        "fragmentation",
        r.fragmentation * 100.0
    ));
    s.push_str(&format!(
        "  {:<30} {:>12}  arena / eager peak\n",
        "vs eager",
        format!("{:.3}x", r.arena_over_eager)
    ));
    line(
        &mut s,
        "arena, fused (what runs)",
        r.fused_arena_bytes,
        format!(
            "{} kernels; lower bound {}; {:.3}x eager",
            r.fused_kernels,
            bytes(r.fused_lower_bound_bytes),
            r.fused_over_eager
        ),
    );
    s.push_str(&format!(
        "  plan: {} buffers ({} in place), offsets by {}{}; coloring into {} slots would need {}{}\n",
        r.buffers,
        r.in_place,
        r.method,
        if r.optimal { " (optimal for this schedule)" } else { "" },
        r.slots,
        bytes(r.coloring_bytes),
        if timing {
            format!("; planned and verified in {:.1} ms", r.plan_ms)
        } else {
            String::new()
        }
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
    s.push_str("  largest tensors live at the peak:\n");
    for t in &r.live_at_peak {
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
