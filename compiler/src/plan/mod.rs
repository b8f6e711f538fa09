//! The memory plan: every buffer of a scheduled graph gets an offset in ONE arena.
//!
//! Layout: persistent buffers (params, optimizer state) first, back to back; then the
//! transient region, where inputs, outputs and intermediates share bytes according to their
//! lifetimes ([`crate::analysis::liveness`]). Offsets are 256-byte aligned. The transient
//! region is the better of two solutions: slots from coloring the interference graph
//! ([`crate::analysis::interference`]), and direct offset assignment
//! ([`crate::analysis::arena::plan`]: greedy by size and by lifetime, then a search towards
//! the max-live lower bound).

use crate::analysis::arena::{self, Interval};
use crate::analysis::interference;
use crate::analysis::liveness::{liveness, BufferKind, Liveness};
use crate::ir::{Graph, NodeId};
use std::collections::BTreeMap;
use std::time::Duration;

/// Offset alignment of every buffer, in bytes ([`TargetInfo::align`](crate::target::TargetInfo::align)).
pub const ALIGN: u64 = crate::target::TARGET.align;

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// A complete memory plan.
#[derive(Clone, Debug)]
pub struct Plan {
    pub liveness: Liveness,
    /// Offset of each buffer (index as in `liveness.buffers`).
    pub offsets: Vec<u64>,
    pub arena_bytes: u64,
    /// Bytes at the arena's end, after every buffer, that stream-K matmuls share
    /// (`back::ptx::PtxOptions::scratch_offset`); part of `arena_bytes`.
    pub scratch_bytes: u64,
    /// Bytes of the persistent region (aligned).
    pub persistent_bytes: u64,
    /// Persistent region + the max-live of the transient buffers (aligned sizes): no plan
    /// of this schedule can be smaller.
    pub lower_bound: u64,
    /// Persistent region + every transient buffer back to back.
    pub no_reuse_bytes: u64,
    /// Transient region size from interference-graph coloring (slots).
    pub coloring_bytes: u64,
    pub slots: usize,
    /// Which method gave the transient region.
    pub method: &'static str,
    pub optimal: bool,
}

impl Plan {
    /// Arena offset of a node's result (`None` for scalar literals).
    pub fn offset_of(&self, n: NodeId) -> Option<u64> {
        self.liveness.buffer_of.get(&n).map(|&b| self.offsets[b])
    }

    /// Where the scratch region starts: after every buffer.
    pub fn scratch_offset(&self) -> u64 {
        self.arena_bytes - self.scratch_bytes
    }

    /// Makes room for `bytes` of scratch at the arena's end (aligned), replacing any; the
    /// bounds count it too (no plan of the step does without).
    pub fn add_scratch(&mut self, bytes: u64) {
        let old = self.scratch_bytes;
        let start = if bytes == 0 {
            self.scratch_offset()
        } else {
            align_up(self.scratch_offset())
        };
        self.scratch_bytes = align_up(bytes);
        self.arena_bytes = start + self.scratch_bytes;
        self.lower_bound = self.lower_bound - old + self.scratch_bytes;
        self.no_reuse_bytes = self.no_reuse_bytes - old + self.scratch_bytes;
    }

    /// `arena / lower bound - 1`.
    pub fn fragmentation(&self) -> f64 {
        if self.lower_bound == 0 {
            0.0
        } else {
            self.arena_bytes as f64 / self.lower_bound as f64 - 1.0
        }
    }
}

/// Plans `g` in its current node order (the schedule). `budget` bounds the offset search.
pub fn plan(g: &Graph, budget: Duration) -> Plan {
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    plan_order(g, &order, budget)
}

/// Plans `g` executed in `order`, one op per step (no fusion).
pub fn plan_order(g: &Graph, order: &[NodeId], budget: Duration) -> Plan {
    plan_liveness(liveness(g, order), budget)
}

/// Plans the buffers of fused kernels (`crate::kernel::fuse`): one step per kernel; fused
/// intermediates have no buffer.
pub fn plan_kernels(g: &Graph, fused: &crate::kernel::Fused, budget: Duration) -> Plan {
    plan_liveness(crate::analysis::liveness::kernel_liveness(g, fused), budget)
}

fn transient_count(lv: &Liveness) -> usize {
    lv.buffers
        .iter()
        .filter(|b| b.kind != BufferKind::Persistent)
        .count()
}

/// Gives offsets to the buffers of `lv`.
pub fn plan_liveness(lv: Liveness, budget: Duration) -> Plan {
    let mut offsets = vec![0u64; lv.buffers.len()];
    // Persistent region: declaration order.
    let mut cursor = 0u64;
    for (i, b) in lv.buffers.iter().enumerate() {
        if b.kind == BufferKind::Persistent {
            offsets[i] = cursor;
            cursor += align_up(b.bytes);
        }
    }
    let persistent = cursor;
    let transient: Vec<usize> = (0..lv.buffers.len())
        .filter(|&i| lv.buffers[i].kind != BufferKind::Persistent)
        .collect();
    let intervals: Vec<Interval> = transient
        .iter()
        .map(|&i| {
            let b = &lv.buffers[i];
            Interval {
                lower: b.start as u64,
                upper: b.end as u64,
                size: align_up(b.bytes),
            }
        })
        .collect();
    let no_reuse: u64 = intervals.iter().map(|iv| iv.size).sum();
    // Slots from coloring.
    // Coloring is the alternative the offsets are compared with; skipped (no slots) when
    // the interference graph would be too large to build.
    let (slot_of, slot_sizes) = match interference::interference(&lv) {
        Some(ig) => interference::color(&lv, &ig),
        None => (vec![None; lv.buffers.len()], Vec::new()),
    };
    let colored = !slot_sizes.is_empty() || transient_count(&lv) == 0;
    let mut slot_base = Vec::with_capacity(slot_sizes.len());
    let mut c = 0u64;
    for s in &slot_sizes {
        slot_base.push(c);
        c += align_up(*s);
    }
    let coloring_bytes = c;
    // Direct offset assignment.
    let report = arena::plan(&intervals, ALIGN, budget);
    let (method, transient_bytes) = if !colored || report.placement.size <= coloring_bytes {
        for (k, &i) in transient.iter().enumerate() {
            offsets[i] = persistent + report.placement.offsets[k];
        }
        (report.placement.method, report.placement.size)
    } else {
        for &i in &transient {
            if let Some(s) = slot_of[i] {
                offsets[i] = persistent + slot_base[s];
            }
        }
        ("interference-graph coloring", coloring_bytes)
    };
    Plan {
        offsets,
        arena_bytes: persistent + transient_bytes,
        scratch_bytes: 0,
        persistent_bytes: persistent,
        lower_bound: persistent + report.lower_bound,
        no_reuse_bytes: persistent + no_reuse,
        coloring_bytes,
        slots: slot_sizes.len(),
        method,
        optimal: report.optimal && (!colored || report.placement.size <= coloring_bytes),
        liveness: lv,
    }
}

/// A broken plan invariant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("buffer {0} (node {1}) ends past the arena")]
    OutOfArena(usize, usize),
    #[error("buffer {0} is not {ALIGN}-byte aligned")]
    Misaligned(usize),
    #[error("buffers {0} and {1} are live at the same time and overlap in the arena")]
    Overlap(usize, usize),
    #[error("node {0} has no buffer")]
    Missing(usize),
    #[error("the layers of `{0}` do not lie back to back")]
    Stack(String),
}

/// Checks a plan: every buffer inside the arena and aligned; no two buffers whose lifetimes
/// overlap share a byte (persistent buffers live throughout); every non-literal node has a
/// buffer; a stack's layers lie back to back, in order (where the artifact says the whole
/// tensor lies).
pub fn verify(g: &Graph, p: &Plan) -> Result<(), Vec<PlanError>> {
    let mut errs = Vec::new();
    let lv = &p.liveness;
    for s in &g.stacks {
        let at = |n: &crate::ir::NodeId| lv.buffer_of.get(n).map(|&b| p.offsets[b]);
        let Some(start) = s.pieces.first().and_then(at) else {
            errs.push(PlanError::Stack(s.name.clone()));
            continue;
        };
        let mut end = start;
        for n in &s.pieces {
            if at(n) != Some(end) {
                errs.push(PlanError::Stack(s.name.clone()));
                break;
            }
            end += g.ty(*n).size_bytes() as u64;
        }
        if end - start != s.ty.size_bytes() as u64 {
            errs.push(PlanError::Stack(s.name.clone()));
        }
    }
    for (i, b) in lv.buffers.iter().enumerate() {
        if p.offsets[i] + b.bytes > p.arena_bytes {
            errs.push(PlanError::OutOfArena(i, b.owner.index()));
        }
        if !p.offsets[i].is_multiple_of(ALIGN) {
            errs.push(PlanError::Misaligned(i));
        }
    }
    for &n in &lv.order {
        if !matches!(g.node(n).op, crate::ir::Op::Literal { .. }) && !lv.buffer_of.contains_key(&n)
        {
            errs.push(PlanError::Missing(n.index()));
        }
    }
    let mut idx: Vec<usize> = (0..lv.buffers.len())
        .filter(|&i| lv.buffers[i].bytes > 0)
        .collect();
    idx.sort_by_key(|&i| (lv.buffers[i].start, i));
    if !any_overlap(p, &idx) {
        return if errs.is_empty() { Ok(()) } else { Err(errs) };
    }
    // Some buffers overlap: name every pair (quadratic, only for a broken plan).
    let mut live: Vec<usize> = Vec::new();
    for &i in &idx {
        let b = &lv.buffers[i];
        live.retain(|&j| lv.buffers[j].end > b.start);
        for &j in &live {
            let (a0, a1) = (p.offsets[i], p.offsets[i] + b.bytes);
            let (b0, b1) = (p.offsets[j], p.offsets[j] + lv.buffers[j].bytes);
            if a0 < b1 && b0 < a1 {
                errs.push(PlanError::Overlap(j.min(i), j.max(i)));
            }
        }
        live.push(i);
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

/// Whether two buffers live at the same time share a byte: a sweep over `idx` (the
/// buffers in order of start) keeping the live ones by offset. While none overlap, a new
/// one overlaps a live one exactly when it overlaps the last starting at or below its
/// offset or the first starting above. O(n log n).
fn any_overlap(p: &Plan, idx: &[usize]) -> bool {
    use std::cmp::Reverse;
    let bufs = &p.liveness.buffers;
    let mut ends: std::collections::BinaryHeap<Reverse<(usize, usize)>> = Default::default();
    let mut by_offset: BTreeMap<(u64, usize), u64> = BTreeMap::new();
    for &i in idx {
        let b = &bufs[i];
        while let Some(&Reverse((end, j))) = ends.peek() {
            if end > b.start {
                break;
            }
            ends.pop();
            by_offset.remove(&(p.offsets[j], j));
        }
        let (a0, a1) = (p.offsets[i], p.offsets[i].saturating_add(b.bytes));
        let below = by_offset.range(..=(a0, usize::MAX)).next_back();
        let above = by_offset.range((a0, usize::MAX)..).next();
        if below.is_some_and(|(_, &e)| e > a0) || above.is_some_and(|(&(s, _), _)| s < a1) {
            return true;
        }
        by_offset.insert((a0, i), a1);
        ends.push(Reverse((b.end, i)));
    }
    false
}

/// Sizes as people read them: `512 B`, `1.50 KiB`, `6.08 GiB`.
pub fn human_bytes(n: u64) -> String {
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
