//! Fusion that never raises the peak.
//!
//! Fusing a node into a later kernel keeps the buffers it reads alive until that kernel
//! runs. That is free for a chain of pointwise ops, but not for a sum of many gradient
//! contributions: fused into one kernel at the end of the backward pass, the sum keeps
//! every contribution alive until it runs (an unrolled recurrent chain's weight gradient:
//! 64 `[H, H]` products a weight, 6× the memory of running one op at a time), and a skip
//! connection added into a later kernel keeps its operands alive across it.
//!
//! After fusion, [`limit_peak`] weighs the plan's peak (the largest bytes of transient
//! buffers live at once over the kernels) against itself without the fusions that lengthen
//! lifetimes at the peak: the nodes fused into a kernel at or after the peak step that read
//! a buffer live there get buffers of their own, so they run where the program has them
//! (a sum then accumulates as its contributions arrive), and fusion runs again. A round is
//! kept only if the peak drops, and rounds go on while it does.
//!
//! Invariant (tested on both targets, on every example, bench program and random programs):
//! the fused peak is no higher than the peak of the same graph run one op per kernel (the
//! fusion pass with `fuse: false`: every op its own kernel, the same operand copies, values
//! stored in place the same way), so the fused arena is no larger than `tcc build --no-fuse`'s.

use super::fuse::FuseError;
use super::Fused;
use crate::analysis::liveness::{kernel_liveness, BufferKind, Liveness};
use crate::ir::{Graph, NodeId};
use std::collections::{BTreeMap, BTreeSet};

/// Rounds of re-fusion at most (each is one fusion pass and one liveness analysis).
const ROUNDS: usize = 24;

/// The peak transient bytes of kernels, each buffer rounded up to the arena's alignment as
/// the planner places it (the planner's lower bound).
pub fn fused_peak(g: &Graph, f: &Fused) -> u64 {
    aligned_max_live(&kernel_liveness(g, f))
}

/// Sum of aligned transient buffer sizes live at each step of `lv` (index `steps` is past
/// the last one): the planner's lower bound is its largest entry.
fn aligned_live(lv: &Liveness) -> Vec<u64> {
    let steps = lv.order.len() + 1;
    let mut delta = vec![0i128; steps + 1];
    for b in lv
        .buffers
        .iter()
        .filter(|b| b.kind != BufferKind::Persistent)
    {
        let size = crate::plan::align_up(b.bytes) as i128;
        delta[b.start.min(steps)] += size;
        delta[b.end.min(steps)] -= size;
    }
    let mut cur = 0i128;
    delta
        .into_iter()
        .map(|d| {
            cur += d;
            cur.max(0) as u64
        })
        .collect()
}

/// Largest sum of aligned transient buffer sizes live at one step: the planner's lower
/// bound.
fn aligned_max_live(lv: &Liveness) -> u64 {
    aligned_live(lv).into_iter().max().unwrap_or(0)
}

/// The step at which the aligned transient bytes of `lv` peak (the first, on ties).
fn peak_step(lv: &Liveness) -> usize {
    let live = aligned_live(lv);
    let peak = live.iter().copied().max().unwrap_or(0);
    live.iter().position(|&l| l == peak).unwrap_or(0)
}

/// The fused nodes whose fusion keeps a buffer live at the peak step: nodes of a kernel at
/// or after the peak that read (directly or through views) a transient buffer live there,
/// and whose own place in the order is before the peak kernel's (given a buffer, they would
/// run, and free what they read, before it).
fn lengthening(g: &Graph, f: &Fused, lv: &Liveness) -> Vec<NodeId> {
    // Step `s` of the liveness is kernel `s - 1` (step 0: the inputs arrive).
    let s = peak_step(lv);
    let Some(t) = s.checked_sub(1) else {
        return Vec::new();
    };
    let pos: BTreeMap<NodeId, usize> = f.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let live: BTreeSet<NodeId> = lv
        .buffers
        .iter()
        .filter(|b| b.kind != BufferKind::Persistent && !b.output && b.start <= s && s < b.end)
        .map(|b| b.owner)
        .collect();
    let root_pos = |k: &super::Kernel| {
        k.nodes
            .iter()
            .filter_map(|n| pos.get(n).copied())
            .max()
            .unwrap_or(0)
    };
    let Some(peak_kernel) = f.kernels.get(t) else {
        return Vec::new();
    };
    let at = root_pos(peak_kernel);
    // The buffer a node's value is read from: through unmaterialized views to their base.
    let base = |mut x: NodeId| {
        for _ in 0..g.node_count() {
            if f.materialized.contains(&x) || !g.node(x).op.is_view_candidate() {
                break;
            }
            match g.node(x).inputs.first() {
                Some(&i) => x = i,
                None => break,
            }
        }
        x
    };
    let mut out = BTreeSet::new();
    for k in &f.kernels[t..] {
        for &u in &k.nodes {
            let op = &g.node(u).op;
            if f.materialized.contains(&u) || op.is_leaf() || op.is_view_candidate() {
                continue;
            }
            if pos.get(&u).is_none_or(|&p| p >= at) {
                continue;
            }
            if g.node(u).inputs.iter().any(|&i| live.contains(&base(i))) {
                out.insert(u);
            }
        }
    }
    out.into_iter().collect()
}

/// The share of the step's estimated time ([`step_seconds`]) that kernels added to lower
/// the peak below the unfused one may cost: the bound for free memory savings.
/// Rounds that bring the peak down to the unfused one are always taken.
pub const TIME_SHARE: f64 = 0.01;

/// Nominal machine of the cost model: a launch, bytes a second, FLOPs a second (an H100's
/// order of magnitude; only ratios between plans of one program matter).
const LAUNCH_S: f64 = 4e-6;
pub const BYTES_PER_S: f64 = 2.5e12;
const FLOPS_PER_S: f64 = 5e13;

/// Estimated seconds of one kernel: a launch plus the slower of its memory traffic (every
/// buffer it loads or stores, once) and its arithmetic (`remat::step::flops` of its nodes).
pub fn kernel_seconds(g: &Graph, k: &super::Kernel) -> f64 {
    let mut bufs: BTreeSet<NodeId> = k.loads().into_iter().collect();
    bufs.extend(k.stores.iter().map(|s| s.buf));
    let bytes: u64 = bufs.iter().map(|&b| g.ty(b).size_bytes() as u64).sum();
    let flops: u64 = k
        .nodes
        .iter()
        .map(|&n| crate::remat::step::flops(g, n))
        .sum();
    LAUNCH_S + (bytes as f64 / BYTES_PER_S).max(flops as f64 / FLOPS_PER_S)
}

/// Estimated seconds of a step's kernels ([`kernel_seconds`]).
pub fn step_seconds(g: &Graph, f: &Fused) -> f64 {
    f.kernels.iter().map(|k| kernel_seconds(g, k)).sum()
}

/// The unmaterialized nodes (not views or leaves) computed by the kernel at the peak step:
/// given buffers, the kernel splits into one kernel an op there.
fn peak_kernel_nodes(g: &Graph, f: &Fused, lv: &Liveness) -> Vec<NodeId> {
    let Some(t) = peak_step(lv).checked_sub(1) else {
        return Vec::new();
    };
    f.kernels.get(t).map_or_else(Vec::new, |k| {
        k.nodes
            .iter()
            .copied()
            .filter(|&u| {
                let op = &g.node(u).op;
                !f.materialized.contains(&u) && !op.is_leaf() && !op.is_view_candidate()
            })
            .collect()
    })
}

/// Re-fuses `first` so that its peak is no higher than `unfused`'s (the same graph with one
/// op per kernel), and lower where that is cheap:
/// - each round gives buffers to the nodes whose fusion lengthens lifetimes at the peak
///   ([`lengthening`]), or where that is refused to the gradient sums among them alone;
///   kept when the peak drops, and, once the peak is at or below the unfused one, only
///   while the added kernels cost at most [`TIME_SHARE`] of the step's estimated time;
/// - while the peak is above the unfused one and that does not lower it, the kernel at the
///   peak is split into one kernel an op;
/// - if the peak is still above after [`ROUNDS`] rounds, the unfused kernels are the plan.
///
/// `refuse` runs fusion with a set of nodes forced to have buffers.
pub(super) fn limit_peak(
    g: &Graph,
    unfused: Fused,
    first: Fused,
    refuse: impl Fn(&BTreeSet<NodeId>) -> Result<Fused, FuseError>,
) -> Result<Fused, FuseError> {
    let limit = fused_peak(g, &unfused);
    let base = step_seconds(g, &first);
    // The best fusion so far, its liveness (which the next round reads) and its peak.
    let mut best_lv = kernel_liveness(g, &first);
    let mut best = first;
    let mut peak = aligned_max_live(&best_lv);
    let mut report = PeakReport {
        unfused: limit,
        first: peak,
        ..PeakReport::default()
    };
    let mut forced: BTreeSet<NodeId> = BTreeSet::new();
    for _ in 0..ROUNDS {
        let mut taken = false;
        for way in [Way::Lengthening, Way::Sums, Way::Split] {
            let split = way == Way::Split;
            if split && peak <= limit {
                break;
            }
            let more = match way {
                Way::Split => peak_kernel_nodes(g, &best, &best_lv),
                Way::Lengthening => lengthening(g, &best, &best_lv),
                Way::Sums => {
                    let all = lengthening(g, &best, &best_lv);
                    let mut l = all.clone();
                    l.retain(|&n| crate::passes::schedule::gradient_sum(g, n));
                    // The same set as the round before: refused already.
                    if l.len() == all.len() {
                        continue;
                    }
                    l
                }
            };
            let mut next = forced.clone();
            next.extend(more);
            if next.len() == forced.len() {
                continue;
            }
            let f = refuse(&next)?;
            let lv = kernel_liveness(g, &f);
            let p = aligned_max_live(&lv);
            let cost = step_seconds(g, &f) - base;
            let keep = if peak > limit {
                p < peak || (split && p == peak)
            } else {
                p < peak && cost <= TIME_SHARE * base
            };
            if keep {
                (best, best_lv, peak, forced) = (f, lv, p, next);
                report.rounds += 1;
                report.estimated_cost = cost / base;
                taken = true;
                break;
            }
        }
        if !taken {
            break;
        }
    }
    report.given_buffers = forced.len();
    let mut out = if peak > limit {
        report.unfused_kept = true;
        report.last = limit;
        unfused
    } else {
        report.last = peak;
        best
    };
    out.peak = report;
    Ok(prune_in_place(g, out))
}

/// How a round of [`limit_peak`] picks the nodes it gives buffers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Every node whose fusion lengthens a lifetime at the peak ([`lengthening`]).
    Lengthening,
    /// The sums of gradient contributions among them (fused into a kernel at the end),
    /// where giving buffers to all of them (forward values recomputed in backward
    /// kernels, a product) would raise the peak elsewhere (gpt with a chunked loss head: the contributions
    /// of the tied embedding's gradient, summed in its update kernel, kept 72 MiB alive
    /// through the backward pass, and the round with the recomputed values was refused).
    Sums,
    /// The kernel at the peak split into one kernel an op ([`peak_kernel_nodes`]).
    Split,
}

/// What [`limit_peak`] did (`Fused::peak`), for `tcc mem` and the build line. Bytes are
/// peak transient bytes ([`fused_peak`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PeakReport {
    /// The same graph with one op per kernel.
    pub unfused: u64,
    /// Fusion as decided before weighing the peak.
    pub first: u64,
    /// After the rounds.
    pub last: u64,
    /// Rounds kept.
    pub rounds: usize,
    /// Nodes given buffers of their own by them.
    pub given_buffers: usize,
    /// Their estimated cost, as a share of the step's estimated time ([`step_seconds`]).
    pub estimated_cost: f64,
    /// The peak stayed above the unfused one: the unfused kernels are the plan.
    pub unfused_kept: bool,
}

impl PeakReport {
    /// One line, or `None` when fusion kept its first decisions.
    pub fn line(&self) -> Option<String> {
        use crate::plan::human_bytes as b;
        if self.unfused_kept {
            return Some(format!(
                "fusion raised the transient peak to {} against {} with one op per kernel: the step runs one op per kernel",
                b(self.first),
                b(self.unfused)
            ));
        }
        (self.rounds > 0).then(|| {
            format!(
                "fusion lowered its transient peak {} -> {} (one op per kernel: {}) by giving {} values buffers of their own ({} round{}, estimated {:+.1}% time)",
                b(self.first),
                b(self.last),
                b(self.unfused),
                self.given_buffers,
                self.rounds,
                if self.rounds == 1 { "" } else { "s" },
                self.estimated_cost * 100.0
            )
        })
    }
}

/// Drops the values stored in place that the peak does not need. Writing over a buffer makes
/// the kernel wait for every earlier reader of it (on CUDA, kernels that share no bytes run
/// concurrently): the mlp's longest dependency chain went from 16 to 18 kernels and its step
/// from 0.449 to 0.476 ms on an H100 with every candidate in place. A value stored apart
/// adds its bytes at its kernel's step only, so it stays in place only where that step
/// would then exceed the peak. A collective's result always stays in place.
pub fn prune_in_place(g: &Graph, mut f: Fused) -> Fused {
    if f.in_place.is_empty() {
        return f;
    }
    let mut live = aligned_live(&kernel_liveness(g, &f));
    let peak = live.iter().copied().max().unwrap_or(0);
    let mut at: BTreeMap<NodeId, usize> = BTreeMap::new();
    for (t, k) in f.kernels.iter().enumerate() {
        for s in &k.stores {
            at.entry(s.buf).or_insert(t);
        }
    }
    let entries: Vec<(NodeId, NodeId)> = f.in_place.iter().map(|(&n, &d)| (n, d)).collect();
    for (n, _) in entries {
        // A collective's result stays in its operand's bytes: the kernel would only copy
        // them onto themselves, so the ranks skip it and reduce the buffer in place.
        if g.node(n).op.is_collective() {
            continue;
        }
        let Some(&t) = at.get(&n) else { continue };
        let size = crate::plan::align_up(g.ty(n).size_bytes() as u64);
        // Kernel `t` is liveness step `t + 1`.
        if live[t + 1] + size <= peak {
            live[t + 1] += size;
            f.in_place.remove(&n);
        }
    }
    f
}

/// The stored nodes that take the bytes of a buffer their kernel reads for the last time,
/// as one op per kernel does for elementwise chains (`analysis::liveness`): a sum's
/// accumulator, a residual stream, an activation. A kernel's store takes a read buffer's
/// bytes when
/// - the kernel stores one value, without accumulating, and no other kernel stores it;
///   it computes no attention;
/// - the buffer was stored by one earlier kernel and is read by no later kernel; it is no
///   leaf, output, update value or matmul/gather operand of the kernel;
/// - every load of it in the kernel is at the store's own index (each element is read
///   only for the element written over it, by the same iteration, before the write) and
///   both have the same bytes and element size.
///
/// Each buffer gives its bytes once; a value that took them may give them on (a chain of
/// adds accumulates in one buffer).
pub fn in_place(g: &Graph, kernels: &[super::Kernel]) -> BTreeMap<NodeId, NodeId> {
    use super::E;
    let mut stored_by: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
    let mut last_load: BTreeMap<NodeId, usize> = BTreeMap::new();
    for (ki, k) in kernels.iter().enumerate() {
        for s in &k.stores {
            stored_by.entry(s.buf).or_default().push(ki);
        }
        for b in k.loads() {
            last_load.insert(b, ki);
        }
    }
    let special = super::fuse::outputs_and_updates(g);
    let once = |b: NodeId, ki: usize| stored_by.get(&b).is_some_and(|v| v.as_slice() == [ki]);
    let mut out = BTreeMap::new();
    let mut given: BTreeSet<NodeId> = BTreeSet::new();
    for (ki, k) in kernels.iter().enumerate() {
        let [s] = k.stores.as_slice() else {
            continue;
        };
        if s.accumulate
            || k.attention.is_some()
            || !once(s.buf, ki)
            || g.node(s.buf).op.is_leaf()
            || g.updates.iter().any(|&(_, v)| v == s.buf)
        {
            continue;
        }
        let operands = k.operand_loads();
        let bytes = g.ty(s.buf).size_bytes();
        let elem = s.dtype.size_bytes();
        let mut loads: BTreeMap<NodeId, bool> = BTreeMap::new();
        for e in k.live_nodes() {
            if let E::Load { buf, index, .. } = k.pool.get(e) {
                let ok = loads.entry(*buf).or_insert(true);
                *ok &= *index == s.index;
            }
        }
        let donor = loads.into_iter().find_map(|(d, at_index)| {
            let fits = at_index
                && !given.contains(&d)
                && !special.contains(&d)
                && !g.node(d).op.is_leaf()
                && !operands.contains(&d)
                && last_load.get(&d) == Some(&ki)
                && stored_by.get(&d).is_some_and(|v| v.len() == 1 && v[0] < ki)
                && g.ty(d).size_bytes() == bytes
                && g.ty(d).dtype.size_bytes() == elem;
            fits.then_some(d)
        });
        if let Some(d) = donor {
            given.insert(d);
            out.insert(s.buf, d);
        }
    }
    out
}
