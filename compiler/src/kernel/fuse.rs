//! Fusion: which graph nodes get a buffer, and the kernels that compute them.
//!
//! Expects a verified, scheduled graph (after the pass pipeline). Guarantees: every node
//! either has a buffer (inputs, params, state, outputs, update values, and the kernels'
//! roots) or is computed inside the kernels that read it, with no buffer at all; kernels
//! run in schedule order and every kernel reads only buffers written before it.
//!
//! Rules (producer into consumer):
//! - views (reshape, permute, broadcast, slice, select) are index arithmetic: never a copy,
//!   unless a matmul needs strides that the view chain cannot give (then one contiguous copy);
//! - a pointwise node fuses into its consumers: always with one consumer, and with several
//!   only when it is cheap (≤ 8 operations: recomputing beats a round trip to memory), or
//!   when every use ends in one kernel and its own operations are few, a fused reduction
//!   below it counting once (softmax's `exp(x - max(x))`, read by its row sum and its
//!   division, and layer norm's `x - mean(x)` are computed in one kernel: on gpt, 650 → 625
//!   kernels, 77.5 → 76.4 ms a step on an H100); never into a consumer that reads each element many times (matmul, convolution,
//!   pooling, gathers);
//! - a reduction (sum/mean/max/min/argmax, pooling, convolution products) with one consumer
//!   fuses into it when the consumer evaluates it once per distinct value, i.e. the
//!   reduction's result varies only along outer loops of the consumer (row statistics of
//!   softmax and layer norm; a convolution under its bias/activation epilogue);
//! - an f32, f16 or bf16 matmul with one elementwise consumer of its own shape becomes that
//!   kernel's anchor: bias, activation, residual add and scaling run as its epilogue;
//! - for CUDA ([`FuseOptions::implicit_gemm`]), a convolution or convolution gradient (f32,
//!   or one 16-bit dtype) is an implicit GEMM anchor under the same rule; a weight gradient whose `k` is long
//!   and output small (`lower::conv_split_k`) gets a buffer, a zero fill and a split-K
//!   kernel, and one an optimizer's update reads keeps a buffer of its own (the update's
//!   kernel computes the momentum);
//! - scatter ops (embedding gradient, max-pool gradient) are a zero fill plus an
//!   accumulating kernel;
//! - an optimizer's pointwise state update read only by its parameter's pointwise update,
//!   with no other kernel between them, is computed and stored by that update's kernel
//!   ([`update_hosts`]): one kernel an Adam update instead of three;
//! - for CUDA, a concat whose pieces are all kernels' roots read only through reshapes and
//!   permutes has no kernel: each piece's kernel stores into the concat's buffer
//!   ([`concat_pieces`]);
//! - a pointwise node read by several kernels and costly only through small row statistics
//!   fused below it (`logits - max(logits)`) is recomputed by each reader from the
//!   statistics, which get buffers ([`row_statistics`]);
//! - a recomputed forward value (free recomputation, `remat::step::free`) that a product
//!   reads is stored by the last backward kernel of its shape before that product
//!   ([`recompute_hosts`]) rather than by a kernel of its own.
//!
//! Then the peak (`super::peak`): the decisions above are weighed against the transient peak
//! they give, which must not exceed the same graph's with one op per kernel (an unrolled
//! recurrent chain's gradient sums, fused into one kernel at the end, kept 64 products
//! alive: 33.6 MiB against 4.8 MiB). Nodes whose fusion lengthens lifetimes at the peak get
//! buffers of their own, a kernel's result may be stored over a buffer it reads for the
//! last time (`Fused::in_place`), and where neither brings the peak down the unfused kernels
//! are kept.
//!
//! Cost: a few passes over the graph; a kernel that cannot be built as decided (a matmul
//! operand that is no strided view, a reduction evaluated too often, an in-place update
//! hazard) materializes the offending node and fusion runs again (at most once per node).
//! An update whose param a later kernel still reads (a reader fused into that kernel, a
//! recomputed value it stores) moves after that kernel instead ([`updates_after`], once per
//! update; a second hazard for it materializes the reader).

use super::lower::{
    self, free_vars, matmul_anchor_ok, reachable, widening, Builder, Decisions, LowerError,
};
pub use super::Fused;
use super::{ExprId, Kernel, Store, E};
use crate::analysis::zeros::Zeros;
use crate::ir::{Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};

/// Options of the fusion pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuseOptions {
    /// When false, every op gets its own kernel and buffer (views stay free): the unfused
    /// baseline.
    pub fuse: bool,
    /// Lay out 4-D intermediates of convolution chains channels-last (NHWC).
    pub channels_last: bool,
    /// Lower f32 convolutions and their gradients as implicit GEMMs ([`super::Gather`]
    /// operands), which only the CUDA back end runs, and let large f16/bf16 matmuls (f32
    /// under TF32) read a B contiguous along `k` in place (Hopper's wgmma reads it
    /// K-major); set by
    /// the pipeline's `fuse` stage for CUDA.
    pub implicit_gemm: bool,
    /// Lower convolutions and their gradients as implicit GEMMs ([`super::Gather`]
    /// operands) where shapes allow ([`lower::Decisions::conv_gemm`]): set by the pipeline
    /// for both targets (the CPU's are bounded by [`lower::cpu_conv_gemm_ok`]).
    pub conv_gemm: bool,
    /// Let f32 matmuls read a B contiguous along `k` (a transposed view: a weight in a
    /// backward pass, attention's `k^T`) in place instead of copying it; set by
    /// the pipeline's `fuse` stage for CUDA without TF32, whose FFMA tiles load such a B
    /// along `k`, and for the CPU, whose GEMM helper packs B from any layout.
    pub k_major_f32: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            fuse: true,
            channels_last: false,
            implicit_gemm: false,
            conv_gemm: false,
            k_major_f32: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FuseError {
    #[error("the graph has a cycle")]
    Cycle,
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error(
        "the update of `{0}` reads it at another index than it writes (not supported in place)"
    )]
    UpdateHazard(String),
}

/// Whether `u` reads a matmul or convolution result directly or through casts (so may be
/// its epilogue), or is a cast read only by such a node (mixed precision puts casts
/// between a product and its epilogue, and between a row sum and the epilogue reading it).
fn reads_a_product(g: &Graph, u: NodeId) -> bool {
    let is_cast = |n: NodeId| matches!(g.node(n).op, Op::Cast { .. });
    let mut u = u;
    while is_cast(u) {
        match g.users(u).as_slice() {
            [next] => u = *next,
            _ => break,
        }
    }
    g.node(u).inputs.iter().any(|&i| {
        let mut i = i;
        while is_cast(i) {
            i = g.node(i).inputs[0];
        }
        g.node(i).op.is_contraction()
    })
}

/// Runs fusion on a scheduled graph.
pub fn fuse(g: &Graph, opts: FuseOptions) -> Result<Fused, FuseError> {
    if !opts.fuse {
        return fuse_forcing(g, opts, &BTreeSet::new());
    }
    let one_per_op = FuseOptions {
        fuse: false,
        ..opts
    };
    // The fused kernels and the one-kernel-per-op ones (the peak's limit) are independent:
    // on two threads where a second one starts (the same result either way).
    let (first, unfused) = std::thread::scope(|s| {
        let unfused = std::thread::Builder::new()
            .stack_size(WORKER_STACK)
            .spawn_scoped(s, || fuse_forcing(g, one_per_op, &BTreeSet::new()));
        let first = fuse_forcing(g, opts, &BTreeSet::new());
        let unfused = match unfused {
            Ok(h) => h.join().unwrap_or_else(|_| {
                Err(FuseError::Lower(LowerError::Internal(
                    "the one-kernel-per-op fusion stopped".into(),
                )))
            }),
            Err(_) => fuse_forcing(g, one_per_op, &BTreeSet::new()),
        };
        (first, unfused)
    });
    // The fused kernels' error first, as when they were built first.
    let (first, unfused) = (first?, unfused?);
    super::peak::limit_peak(g, unfused, first, |forced| fuse_forcing(g, opts, forced))
}

/// Stack of the thread that builds the one-kernel-per-op kernels: lowering walks
/// expressions recursively, so it gets the compiler thread's stack (`main.rs`; pages are
/// reserved, committed only when used).
const WORKER_STACK: usize = 1 << 30;

/// Fusion with the nodes of `forced` given buffers.
fn fuse_forcing(
    g: &Graph,
    opts: FuseOptions,
    forced: &BTreeSet<NodeId>,
) -> Result<Fused, FuseError> {
    let mut order = g.topo_order().ok_or(FuseError::Cycle)?;
    let mut forced: BTreeSet<NodeId> = forced.clone();
    // Update values moved later once: a second hazard gives the reader a buffer instead.
    let mut delayed: BTreeSet<NodeId> = BTreeSet::new();
    let zeros = Zeros::of(g);
    for round in 0..=order.len() {
        let (materialized, hosts) = decide(g, &order, opts, &forced);
        let mut layouts = if opts.channels_last {
            super::layout::channels_last(g, &materialized)
        } else {
            BTreeMap::new()
        };
        for (n, p) in super::layout::permuted_products(g, &materialized) {
            layouts.entry(n).or_insert(p);
        }
        let stores = StoreSites {
            into: concat_pieces(g, &order, &materialized, opts),
            hosts,
            delayed: delayed.clone(),
        };
        match build(g, &order, &materialized, &stores, &layouts, &zeros, opts) {
            Ok(kernels) => {
                let in_place = super::peak::in_place(g, &kernels);
                return Ok(Fused {
                    kernels,
                    materialized,
                    order,
                    layouts,
                    in_place,
                    peak: Default::default(),
                    rounds: round + 1,
                });
            }
            Err(Retry::Materialize(ns)) => {
                let before = forced.len();
                forced.extend(beneath_first(g, &ns));
                if forced.len() == before {
                    return Err(FuseError::Lower(LowerError::Internal(
                        "fusion did not converge".into(),
                    )));
                }
            }
            Err(Retry::Later(later)) => {
                // Moved or not (every node between may depend on the update), each of
                // these updates is delayed now: a hazard for it again materializes the
                // reader next round.
                delayed.extend(later.iter().map(|l| l.0));
                order = updates_after(g, &order, &later, &stores.hosts);
            }
            Err(Retry::Fail(e)) => return Err(e),
        }
    }
    Err(FuseError::Lower(LowerError::Internal(
        "fusion did not converge".into(),
    )))
}

/// The nodes of one retry to materialize: all but those that read another one of them
/// through views only. A matmul operand viewed through a copy (`reshape(permute(x))`
/// merging axes that are not adjacent in memory) and viewed again (say transposed for a
/// weight gradient) fails twice in the same round: as the copy's own reader, which asks
/// for the copy, and as the view's reader, which asks for the whole view. With the copy
/// materialized the view reads it in place (gpt: one `[8, 768, 512]` transposing copy of
/// every attention output fewer); if it still cannot, the next round asks again.
fn beneath_first(g: &Graph, ns: &[NodeId]) -> Vec<NodeId> {
    let wanted: BTreeSet<NodeId> = ns.iter().copied().collect();
    ns.iter()
        .copied()
        .filter(|&n| {
            let mut x = n;
            while g.node(x).op.is_view_candidate() {
                match g.node(x).inputs.first() {
                    Some(&i) => x = i,
                    None => break,
                }
                if wanted.contains(&x) {
                    return false;
                }
            }
            true
        })
        .collect()
}

/// Whether `n` widens a 16-bit value to f32 for implicit GEMMs or fused attention alone
/// (mixed precision's weight gradients read their 16-bit operands widened, as an f32
/// attention of 16-bit queries, keys and values would; under `--amp` attention reads them
/// as they are): their loads read the 16-bit
/// buffer and widen each element, so the cast needs no f32 copy, and its operand gets the
/// buffer instead.
fn read_widened(g: &Graph, n: NodeId, opts: FuseOptions) -> bool {
    if !widening(g, n) {
        return false;
    }
    let users = g.users(n);
    !users.is_empty()
        && users.iter().all(|&u| match g.node(u).op {
            Op::Conv2d { .. } | Op::Conv2dGradInput { .. } | Op::Conv2dGradWeight { .. } => {
                opts.conv_gemm
            }
            Op::Attention { .. } | Op::AttentionLse { .. } => true,
            _ => false,
        })
}

/// Which nodes get a buffer, and which update values another one's kernel computes
/// ([`update_hosts`]).
fn decide(
    g: &Graph,
    order: &[NodeId],
    opts: FuseOptions,
    forced: &BTreeSet<NodeId>,
) -> (BTreeSet<NodeId>, BTreeMap<NodeId, NodeId>) {
    let mut m: BTreeSet<NodeId> = forced.clone();
    let outputs: BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    let updates: BTreeSet<NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
    let mut users: BTreeMap<NodeId, Vec<(NodeId, usize)>> = BTreeMap::new();
    for &n in order {
        for (k, &i) in g.node(n).inputs.iter().enumerate() {
            users.entry(i).or_default().push((n, k));
        }
    }
    let no_users = Vec::new();
    for &n in order {
        let op = &g.node(n).op;
        if op.is_leaf() || outputs.contains(&n) || updates.contains(&n) || op.is_scatter() {
            m.insert(n);
        }
        // The collective's kernel copies its operand into the result's buffer, which the
        // ranks then reduce in place: both are buffers, and that kernel computes nothing
        // else.
        if op.is_collective() {
            m.insert(n);
            m.extend(g.node(n).inputs.iter().copied());
        }
        // A weight gradient split along k accumulates into a buffer of its own.
        if opts.conv_gemm && lower::conv_split_k(g, n, opts.implicit_gemm) > 1 {
            m.insert(n);
        }
    }
    // Reverse pass: heavy uses (through views) and reductions.
    let mut heavy: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().rev() {
        let op = &g.node(n).op;
        let us = users.get(&n).unwrap_or(&no_users);
        let is_heavy = us.iter().any(|&(u, k)| {
            let see_through = g.node(u).op.is_view_candidate() || read_widened(g, u, opts);
            g.node(u).op.reads_operand_repeatedly(k)
                || (see_through && heavy.contains(&u) && !m.contains(&u))
        });
        if is_heavy {
            heavy.insert(n);
        }
        if m.contains(&n) || op.is_leaf() || matches!(op, Op::Literal { .. }) {
            continue;
        }
        if op.is_view_candidate() {
            continue;
        }
        if !opts.fuse {
            m.insert(n);
            continue;
        }
        if op.is_pointwise() {
            let constant = matches!(op, Op::Full { .. } | Op::Arange { .. });
            if is_heavy && !constant && !read_widened(g, n, opts) {
                m.insert(n);
            }
            continue;
        }
        if op.is_reduction_like() {
            let single = us.len() == 1;
            let ok = single
                && !is_heavy
                && match op {
                    Op::MatMul if matmul_anchor_ok(g, n) => {
                        let (u, _) = us[0];
                        g.node(u).op.is_elementwise() && g.ty(u).shape == g.ty(n).shape
                    }
                    // An implicit GEMM is an anchor too: only an elementwise epilogue. A
                    // 16-bit convolution read only widened to f32 (a batch norm's input
                    // under mixed precision) stores its 16-bit result instead, and its
                    // readers widen it as they load it: half the bytes of an f32 copy.
                    Op::Conv2d { .. }
                    | Op::Conv2dGradInput { .. }
                    | Op::Conv2dGradWeight { .. }
                        if opts.conv_gemm =>
                    {
                        let (u, _) = us[0];
                        // A weight gradient of 16-bit operands keeps a buffer of its own,
                        // so its kernel keeps the columns' channels-last order (a tap's
                        // channels contiguous, as tensor cores read them); an optimizer
                        // update as its epilogue would impose the param's order.
                        let low_weight_grad = matches!(op, Op::Conv2dGradWeight { .. })
                            && g.node(n).inputs.iter().any(|&x| widening(g, x));
                        // Nor, on CUDA, does one whose reader is an optimizer's (it reads a
                        // param or state of the gradient's shape: momentum, weight decay):
                        // the update computes it (`update_hosts`). As the epilogue, the
                        // param's order slowed the cnn's split `s4_w` layers' gradient
                        // kernels from 0.28 to 0.35 ms (H200).
                        let update_weight_grad = matches!(op, Op::Conv2dGradWeight { .. })
                            && opts.implicit_gemm
                            && reads_persistent_of_shape(g, u, &g.ty(n).shape);
                        g.node(u).op.is_elementwise()
                            && g.ty(u).shape == g.ty(n).shape
                            && !widening(g, u)
                            && !low_weight_grad
                            && !update_weight_grad
                    }
                    // A reduction read by a matmul's epilogue would be recomputed for every
                    // element there (an epilogue has no loop over rows to hoist it to):
                    // attention's row sums `sum(dO * O)` read by `dS = P * (dP - D)`.
                    Op::Reduce { .. } if reads_a_product(g, us[0].0) => false,
                    _ => !g.node(us[0].0).op.is_scatter(),
                };
            if !ok {
                m.insert(n);
            }
            continue;
        }
        m.insert(n);
    }
    if !opts.fuse {
        return (m, BTreeMap::new());
    }
    let hosts = update_hosts(g, order, &m, &users, &updates);
    // Forward pass: pointwise nodes read by several consumers fuse only when cheap.
    let mut cost: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut kept = Vec::new();
    for &n in order {
        let node = g.node(n);
        if m.contains(&n) || node.op.is_leaf() {
            cost.insert(n, 1);
            continue;
        }
        let c = match &node.op {
            Op::Literal { .. } => 0,
            op if op.is_reduction_like() => 1000,
            _ => {
                1 + node
                    .inputs
                    .iter()
                    .map(|i| cost.get(i).copied().unwrap_or(1))
                    .sum::<usize>()
            }
        };
        let nusers = users.get(&n).map_or(0, |u| u.len());
        if node.op.is_pointwise() && nusers > 1 && c > 8 {
            if shared_root(g, n, &m, &users, &hosts).is_some() && local_cost(g, n, &m) <= 8 {
                // Every use ends in one kernel: computed there once per use, and a row
                // statistic below it once per row (softmax's `exp(x - max(x))`, read by
                // its sum and its division; layer norm's `x - mean(x)`).
                cost.insert(n, c.min(1000));
                kept.push(n);
                continue;
            }
            // Costly only through row statistics fused below it, small next to it: those
            // get buffers instead and each reader recomputes it from them (cross-entropy's
            // `logits - max(logits)`, read by the loss and by the gradient: otherwise a
            // second logits-sized buffer, 128 MiB on gpt, live beside the logits).
            let stats = row_statistics(g, n, &m);
            if !stats.is_empty() {
                let mut m2 = m.clone();
                m2.extend(stats.iter().copied());
                if local_cost(g, n, &m2) <= 8 {
                    for &r in &stats {
                        m.insert(r);
                        cost.insert(r, 1);
                    }
                    cost.insert(n, local_cost(g, n, &m));
                    continue;
                }
            }
            m.insert(n);
            cost.insert(n, 1);
        } else {
            cost.insert(n, c.min(1000));
        }
    }
    // A later decision may have split the uses of a node kept above among kernels.
    loop {
        let hosts = update_hosts(g, order, &m, &users, &updates);
        let split: Vec<NodeId> = kept
            .iter()
            .copied()
            .filter(|&n| !m.contains(&n) && shared_root(g, n, &m, &users, &hosts).is_none())
            .collect();
        if split.is_empty() {
            let mut hosts = hosts;
            recompute_hosts(g, order, &m, &users, &mut hosts);
            return (m, hosts);
        }
        m.extend(split);
    }
}

/// The unmaterialized reductions that pointwise node `n` computes through unmaterialized
/// pointwise nodes, when each has at most 1/16 of `n`'s elements (row statistics); empty
/// when any other reduction, product or scatter is among them.
fn row_statistics(g: &Graph, n: NodeId, m: &BTreeSet<NodeId>) -> Vec<NodeId> {
    let numel = g.ty(n).shape.numel();
    let mut out = Vec::new();
    let mut stack = g.node(n).inputs.clone();
    let mut seen = BTreeSet::new();
    while let Some(y) = stack.pop() {
        if !seen.insert(y) || m.contains(&y) || g.node(y).op.is_source() {
            continue;
        }
        let op = &g.node(y).op;
        if matches!(op, Op::Reduce { .. }) && g.ty(y).shape.numel().saturating_mul(16) <= numel {
            out.push(y);
        } else if op.is_pointwise() || op.is_view_candidate() {
            stack.extend(g.node(y).inputs.iter().copied());
        } else {
            return Vec::new();
        }
    }
    out
}

/// Whether the kernel of root `x` would be pointwise (`anchor`: or a product's epilogue, or
/// a pointwise kernel with fused row statistics): no other reduction, scatter or product
/// among the unmaterialized nodes it computes.
fn plain_pointwise(g: &Graph, x: NodeId, m: &BTreeSet<NodeId>, anchor: bool) -> bool {
    let mut stack = vec![x];
    let mut seen = BTreeSet::new();
    let mut products = 0;
    while let Some(y) = stack.pop() {
        if !seen.insert(y) || (y != x && m.contains(&y)) || g.node(y).op.is_source() {
            continue;
        }
        let op = &g.node(y).op;
        let product = matches!(
            op,
            Op::MatMul
                | Op::Conv2d { .. }
                | Op::Conv2dGradInput { .. }
                | Op::Conv2dGradWeight { .. }
        );
        if product && anchor {
            products += 1;
            if products > 1 {
                return false;
            }
        } else if anchor && matches!(op, Op::Reduce { .. }) {
            // A row statistic fused below the host (evaluated once per row; the guest's
            // stores run per element like the host's own).
        } else if op.is_reduction_like()
            || op.is_scatter()
            || !(op.is_pointwise() || op.is_view_candidate())
        {
            return false;
        }
        stack.extend(g.node(y).inputs.iter().copied());
    }
    true
}

/// Most recomputed values one kernel stores besides its own ([`recompute_hosts`]).
const MAX_RECOMPUTE_GUESTS: usize = 4;

/// Horizontal hosts of recomputed values (`remat::step::apply`'s clones, which free
/// recomputation makes by default): a clone that a product reads (a weight gradient's
/// operand: gpt's `gelu` output, cnn's `relu` outputs) needs a buffer, and rather than a
/// kernel of its own it is stored by the last pointwise kernel before its first reader
/// whose loops cover the same shape (in the backward pass there nearly always is one: the
/// gradient of the same layer's output). Recomputation then adds no kernel, only the bytes
/// the host reads and stores for it. The host must be a backward kernel (a forward one
/// would store the value as early as the original did) that is no recomputation itself
/// (so each clone's host is there whatever else is recomputed), run after the clone's
/// operands are written, and be no guest itself nor an update's host.
fn recompute_hosts(
    g: &Graph,
    order: &[NodeId],
    m: &BTreeSet<NodeId>,
    users: &BTreeMap<NodeId, Vec<(NodeId, usize)>>,
    hosts: &mut BTreeMap<NodeId, NodeId>,
) {
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let updates: BTreeSet<NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
    let outputs: BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    // Update hosts keep to their updates; a kernel hosts a few recomputed values at most.
    let update_hosts: BTreeSet<NodeId> = hosts.values().copied().collect();
    let busy = |hosts: &BTreeMap<NodeId, NodeId>, r: NodeId| {
        hosts.contains_key(&r)
            || update_hosts.contains(&r)
            || g.node(r).op.is_collective()
            || hosts.values().filter(|&&h| h == r).count() >= MAX_RECOMPUTE_GUESTS
    };
    for &c in order {
        let node = g.node(c);
        if node.recomputed.is_none()
            || !m.contains(&c)
            || !node.op.is_elementwise()
            || hosts.contains_key(&c)
            || outputs.contains(&c)
            || updates.contains(&c)
            || !plain_pointwise(g, c, m, false)
        {
            continue;
        }
        // The first node reading its buffer (through views that are no copies).
        let mut first = usize::MAX;
        let mut stack = vec![c];
        while let Some(x) = stack.pop() {
            for &(u, _) in users.get(&x).map_or(&[][..], Vec::as_slice) {
                // A view that is no copy reads nothing where it stands: its readers do.
                if g.node(u).op.is_view_candidate() && !m.contains(&u) {
                    stack.push(u);
                } else {
                    first = first.min(pos.get(&u).copied().unwrap_or(0));
                }
            }
        }
        // The last buffer its kernel would read is written before the host runs.
        let mut after = 0;
        let mut stack = g.node(c).inputs.clone();
        let mut seen = BTreeSet::new();
        while let Some(y) = stack.pop() {
            if !seen.insert(y) {
                continue;
            }
            if m.contains(&y) || g.node(y).op.is_leaf() {
                after = after.max(pos.get(&y).copied().unwrap_or(0));
            } else {
                stack.extend(g.node(y).inputs.iter().copied());
            }
        }
        let shape = &node.ty.shape;
        let host = (after + 1..first.min(order.len()))
            .rev()
            .map(|p| order[p])
            .find(|&r| {
                let rn = g.node(r);
                m.contains(&r)
                    && r != c
                    && rn.backward
                    && rn.recomputed.is_none()
                    && rn.op.is_elementwise()
                    && rn.ty.shape == *shape
                    && !updates.contains(&r)
                    && !busy(hosts, r)
                    && plain_pointwise(g, r, m, true)
            });
        if let Some(r) = host {
            hosts.insert(c, r);
        }
    }
}

/// Kernels that store other nodes than their root: update hosts ([`update_hosts`]) and
/// concat pieces ([`concat_pieces`]).
struct StoreSites {
    hosts: BTreeMap<NodeId, NodeId>,
    into: BTreeMap<NodeId, Piece>,
    /// Update values already moved after a later reader of their target
    /// ([`updates_after`]): another such reader gets a buffer instead.
    delayed: BTreeSet<NodeId>,
}

/// Where a concat's piece is stored: a node whose one use is a chain of reshapes and
/// permutes (`views`, in use order) ending in the concat, at `start` along `axis`.
#[derive(Clone, Debug)]
struct Piece {
    concat: NodeId,
    views: Vec<NodeId>,
    axis: usize,
    start: usize,
}

/// The pieces that are stored straight into their concat's buffer, by node: those of every
/// materialized concat (not an output or update) whose pieces are all kernels' roots read
/// only through reshapes and permutes on their way to it. The concat then needs no kernel
/// (gpt's `q`, `k` and `v` gradients into the `[B, T, 3·D]` one of the fused projection:
/// a 38 MB copy a layer, and the pieces' buffers, gone). CUDA only (the CPU runs every
/// concat as it is): the pieces' matmul epilogues store there as into their own buffer.
fn concat_pieces(
    g: &Graph,
    order: &[NodeId],
    m: &BTreeSet<NodeId>,
    opts: FuseOptions,
) -> BTreeMap<NodeId, Piece> {
    let mut out = BTreeMap::new();
    if !opts.fuse || !opts.implicit_gemm {
        return out;
    }
    let mut users: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in order {
        for &i in &g.node(n).inputs {
            *users.entry(i).or_default() += 1;
        }
    }
    let special = outputs_and_updates(g);
    let single = |x: NodeId| users.get(&x) == Some(&1) && !special.contains(&x);
    for &c in order {
        let node = g.node(c);
        let Op::Concat { axis } = node.op else {
            continue;
        };
        if !m.contains(&c) || special.contains(&c) {
            continue;
        }
        let mut pieces = Vec::new();
        let mut start = 0;
        for &i in &node.inputs {
            let mut views = Vec::new();
            let mut x = i;
            while matches!(g.node(x).op, Op::Reshape { .. } | Op::Permute { .. })
                && !m.contains(&x)
                && single(x)
            {
                views.push(x);
                x = g.node(x).inputs[0];
            }
            let op = &g.node(x).op;
            let ok = m.contains(&x)
                && single(x)
                && !op.is_leaf()
                && !op.is_scatter()
                && !matches!(op, Op::Concat { .. } | Op::AllReduce)
                && lower::conv_split_k(g, x, true) <= 1
                && g.ty(x).dtype == node.ty.dtype
                && !pieces.iter().any(|(y, _): &(NodeId, Piece)| *y == x);
            if !ok {
                pieces.clear();
                break;
            }
            views.reverse();
            pieces.push((
                x,
                Piece {
                    concat: c,
                    views,
                    axis,
                    start,
                },
            ));
            start += g.ty(i).dims()[axis];
        }
        if !pieces.is_empty() && pieces.len() == node.inputs.len() {
            out.extend(pieces);
        }
    }
    out
}

/// The outputs, the updated params and state and their new values: nodes whose buffers
/// have a fixed role, never a concat piece's or a value stored in place's.
pub(super) fn outputs_and_updates(g: &Graph) -> BTreeSet<NodeId> {
    g.outputs
        .iter()
        .map(|(_, o)| *o)
        .chain(g.updates.iter().flat_map(|&(t, v)| [t, v]))
        .collect()
}

/// Whether the elementwise value `u` reads, through elementwise ops and views, a param or
/// optimizer state of `shape` (an optimizer's update of a param of that shape).
fn reads_persistent_of_shape(g: &Graph, u: NodeId, shape: &crate::ir::Shape) -> bool {
    let mut stack = vec![u];
    let mut seen = BTreeSet::new();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        for &i in &g.node(x).inputs {
            let node = g.node(i);
            if matches!(node.op, Op::Param { .. } | Op::State { .. }) && node.ty.shape == *shape {
                return true;
            }
            if node.op.is_elementwise() || node.op.is_view_candidate() {
                stack.push(i);
            }
        }
    }
    false
}

/// Update values computed by the kernel of another one, its host: an elementwise update
/// value whose every use ends in the kernel of an elementwise update value of its shape
/// (an optimizer's new moments, read only by its new parameter). The host's kernel stores
/// them beside its own value: Adam's three kernels an update become one, reading the
/// gradient once and the moments' new values from registers (on gpt, 12 → 7 memory
/// passes over each parameter's elements).
fn update_hosts(
    g: &Graph,
    order: &[NodeId],
    m: &BTreeSet<NodeId>,
    users: &BTreeMap<NodeId, Vec<(NodeId, usize)>>,
    updates: &BTreeSet<NodeId>,
) -> BTreeMap<NodeId, NodeId> {
    let none = BTreeMap::new();
    // Its kernel would be pointwise: no product or reduction fused below it (a momentum
    // computed in a weight gradient's epilogue stays there: moved into the update's kernel,
    // the product ran last and cnn's step took 39.6 → 41.5 ms).
    let pointwise = |x: NodeId| {
        let mut stack = g.node(x).inputs.clone();
        let mut seen = BTreeSet::new();
        while let Some(y) = stack.pop() {
            if !seen.insert(y) || m.contains(&y) || g.node(y).op.is_leaf() {
                continue;
            }
            if g.node(y).op.is_reduction_like() || g.node(y).op.is_scatter() {
                return false;
            }
            stack.extend(g.node(y).inputs.iter().copied());
        }
        true
    };
    // No kernel but other updates' runs between the two: the guest's inputs then live no
    // longer (cnn's stacked convolution weights had their momentum computed 170 kernels
    // before the update, as soon as the last layer's gradient was ready; hosted there, the
    // step took 39.6 → 41.5 ms).
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let adjacent = |u: NodeId, r: NodeId| {
        let (Some(&a), Some(&b)) = (pos.get(&u), pos.get(&r)) else {
            return false;
        };
        order[a.min(b) + 1..a.max(b)]
            .iter()
            .all(|&x| !m.contains(&x) || g.node(x).op.is_leaf() || updates.contains(&x))
    };
    let hostable = |x: NodeId| {
        updates.contains(&x) && m.contains(&x) && g.node(x).op.is_elementwise() && pointwise(x)
    };
    let mut hosts: BTreeMap<NodeId, NodeId> = updates
        .iter()
        .copied()
        .filter(|&u| hostable(u))
        .filter_map(|u| {
            let r = shared_root(g, u, m, users, &none)?;
            (r != u && hostable(r) && g.ty(r).shape == g.ty(u).shape && adjacent(u, r))
                .then_some((u, r))
        })
        .collect();
    // No chains: a host that is itself a guest keeps its own guests' kernels apart (a
    // guest stored by the last host of a chain would be read stale by the middle one's
    // kernel, were that one left out in `build`).
    let guests: BTreeSet<NodeId> = hosts.keys().copied().collect();
    hosts.retain(|_, r| !guests.contains(r));
    hosts
}

/// The kernel root (materialized node) that every use of `n` ends in, when there is a
/// single one: each use is followed through unmaterialized nodes of one user each.
fn shared_root(
    g: &Graph,
    n: NodeId,
    m: &BTreeSet<NodeId>,
    users: &BTreeMap<NodeId, Vec<(NodeId, usize)>>,
    hosts: &BTreeMap<NodeId, NodeId>,
) -> Option<NodeId> {
    let mut root = None;
    for &(u, _) in users.get(&n)? {
        let mut at = u;
        // Each step goes to a later node: at most one step per node of the graph.
        for _ in 0..g.node_count() {
            if m.contains(&at) {
                break;
            }
            match users.get(&at).map(Vec::as_slice) {
                Some([(next, _)]) => at = *next,
                _ => return None,
            }
        }
        if !m.contains(&at)
            || g.node(at).op.reads_operand_repeatedly(0)
            || g.node(at).op.is_scatter()
        {
            return None;
        }
        let at = hosts.get(&at).copied().unwrap_or(at);
        match root {
            None => root = Some(at),
            Some(r) if r == at => {}
            Some(_) => return None,
        }
    }
    root
}

/// Operations per element of `n` and its unmaterialized pointwise inputs, with a fused
/// reduction counted once (it is evaluated once per row of the kernel, not per element).
fn local_cost(g: &Graph, n: NodeId, m: &BTreeSet<NodeId>) -> usize {
    let mut total = 0;
    let mut stack = vec![n];
    let mut seen = BTreeSet::new();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        let node = g.node(x);
        if (x != n && m.contains(&x)) || node.op.is_leaf() {
            continue;
        }
        match &node.op {
            Op::Literal { .. } => {}
            op if op.is_reduction_like() => total += 1,
            op if op.is_view_candidate() => stack.extend(node.inputs.iter().copied()),
            _ => {
                total += 1;
                stack.extend(node.inputs.iter().copied());
            }
        }
    }
    total
}

enum Retry {
    Materialize(Vec<NodeId>),
    /// Update values whose kernels must run after the paired nodes' ([`updates_after`]).
    Later(Vec<(NodeId, NodeId)>),
    Fail(FuseError),
}

impl From<LowerError> for Retry {
    fn from(e: LowerError) -> Retry {
        match e {
            LowerError::Materialize(n) => Retry::Materialize(vec![n]),
            e => Retry::Fail(FuseError::Lower(e)),
        }
    }
}

fn build(
    g: &Graph,
    order: &[NodeId],
    m: &BTreeSet<NodeId>,
    sites: &StoreSites,
    layouts: &BTreeMap<NodeId, Vec<usize>>,
    zeros: &Zeros,
    opts: FuseOptions,
) -> Result<Vec<Kernel>, Retry> {
    let (hosts, into) = (&sites.hosts, &sites.into);
    let implicit_gemm = opts.implicit_gemm;
    let d = Decisions {
        g,
        materialized: m,
        layouts,
        implicit_gemm,
        conv_gemm: opts.conv_gemm,
        k_major_f32: opts.k_major_f32,
        zeros,
    };
    // Guests whose host's buffer is laid out as theirs (the host's loops index both), by
    // host, in order.
    // A concat's piece stores one value at its place in the concat: no guests there.
    let written_by_pieces: BTreeSet<NodeId> = into.values().map(|p| p.concat).collect();
    let mut guests: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for &n in order {
        if let Some(&r) = hosts.get(&n) {
            if d.layout(n) == d.layout(r)
                && !matmul_anchor_ok(g, r)
                && !into.contains_key(&r)
                && !written_by_pieces.contains(&r)
            {
                guests.entry(r).or_default().push(n);
            }
        }
    }
    let mut hosted: BTreeSet<NodeId> = guests.values().flatten().copied().collect();
    // An attention kernel stores the row statistics of the same scores.
    let mut lse_of: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    for &n in order {
        if let Op::AttentionLse { causal, scale } = g.node(n).op {
            let host = order.iter().copied().find(|&a| {
                g.node(a).op == Op::Attention { causal, scale }
                    && g.node(a).inputs[..2] == g.node(n).inputs[..]
                    && !lse_of.contains_key(&a)
                    && m.contains(&a)
            });
            if let Some(a) = host {
                lse_of.insert(a, n);
                hosted.insert(n);
            }
        }
    }
    let mut kernels = Vec::new();
    let mut retry: Vec<NodeId> = Vec::new();
    let mut pos_of_kernel: Vec<usize> = Vec::new();
    for (pos, &n) in order.iter().enumerate() {
        let node = g.node(n);
        if !m.contains(&n)
            || node.op.is_leaf()
            || hosted.contains(&n)
            || written_by_pieces.contains(&n)
        {
            continue;
        }
        let name = format!("k{}", kernels.len());
        let splits = if opts.conv_gemm {
            lower::conv_split_k(g, n, implicit_gemm)
        } else {
            1
        };
        if splits > 1 {
            let fill = fill_kernel(&d, n, name.clone())?;
            let gemm = format!("k{}", kernels.len() + 1);
            match lower::split_k_kernel(&d, n, splits, gemm) {
                Ok(Some(k)) => {
                    kernels.push(fill);
                    pos_of_kernel.push(pos);
                    kernels.push(k);
                    pos_of_kernel.push(pos);
                    continue;
                }
                Ok(None) => {}
                Err(LowerError::Materialize(x)) => {
                    retry.push(x);
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if matches!(
            node.op,
            Op::Attention { .. } | Op::AttentionLse { .. } | Op::AttentionGrad { .. }
        ) {
            match lower::attention_kernel(&d, n, lse_of.get(&n).copied(), name) {
                Ok(k) => {
                    kernels.push(k);
                    pos_of_kernel.push(pos);
                }
                Err(LowerError::Materialize(x)) => retry.push(x),
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        if node.op.is_scatter() {
            kernels.push(fill_kernel(&d, n, name)?);
            pos_of_kernel.push(pos);
            let name = format!("k{}", kernels.len());
            kernels.push(lower::scatter_kernel(&d, n, name)?);
            pos_of_kernel.push(pos);
            continue;
        }
        // The loop nest follows the buffer's physical layout (contiguous stores), except
        // for a matmul anchor, whose back end owns the loops: its domain stays logical
        // (batch, rows, columns) and its stores follow the layout.
        let dims = node.ty.dims().to_vec();
        let (mut b, idx) = if matmul_anchor_ok(g, n) {
            let b = Builder::new(&d, n, dims);
            let idx = b.domain_vars();
            (b, idx)
        } else if let Some(order) = lower::cpu_conv_domain(&d, n) {
            let mine = guests.get(&n).cloned().unwrap_or_default();
            let b = Builder::new(&d, n, order.iter().map(|&a| dims[a]).collect()).with_guests(mine);
            let idx = b.index_in(&order);
            (b, idx)
        } else {
            let layout = d.layout(n);
            let mine = guests.get(&n).cloned().unwrap_or_default();
            let b =
                Builder::new(&d, n, layout.iter().map(|&a| dims[a]).collect()).with_guests(mine);
            let idx = b.logical_index(n);
            (b, idx)
        };
        b.defer_extra_anchors = true;
        // The root's store first (liveness names a kernel by it), then the guests' (the
        // root's value reads theirs as computed here: one expression each).
        let mut stores = Vec::new();
        let mut failed = false;
        for &x in [&n]
            .into_iter()
            .chain(guests.get(&n).map_or(&[][..], Vec::as_slice))
        {
            let value = match b.value(x, &idx) {
                Ok(v) => v,
                Err(LowerError::Materialize(y)) => {
                    retry.push(y);
                    failed = true;
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            let index = b.buffer_index(x, &idx);
            stores.push(Store {
                buf: x,
                dtype: g.ty(x).dtype,
                index,
                value,
                accumulate: false,
            });
        }
        if !b.extra_anchors.is_empty() {
            retry.append(&mut b.extra_anchors);
            failed = true;
        }
        if failed {
            continue;
        }
        // A concat's piece: stored into the concat's buffer at its place there.
        if let (Some(p), [st]) = (into.get(&n), stores.as_mut_slice()) {
            let mut at = b.view_up(n, &idx, &p.views);
            at[p.axis] = b.pool.iadd_c(at[p.axis], p.start as i64);
            st.buf = p.concat;
            st.index = b.buffer_index(p.concat, &at);
        }
        // Fused reductions must be evaluated once per distinct value: their free domain
        // variables must be the outermost loops.
        let fv = free_vars(&b.pool);
        let roots: Vec<ExprId> = stores.iter().flat_map(|s| [s.value, s.index]).collect();
        let live = reachable(&b.pool, &roots);
        for &(r, origin) in &b.fused_reductions {
            if !live.contains(&r) {
                continue;
            }
            let f = &fv[r.0 as usize];
            let rank = node.ty.rank() as u32;
            let dom: Vec<u32> = f.iter().copied().filter(|&v| v < rank).collect();
            let prefix = dom.iter().enumerate().all(|(i, &v)| v == i as u32);
            // A reduction that depends on no axis of a kernel with several points is a
            // kernel of its own (computed once, in parallel, rather than before the loops
            // of every thread of a GPU kernel).
            let whole = dom.is_empty() && node.ty.shape.numel() > 1;
            if !prefix || dom.len() != f.len() || whole {
                retry.push(origin);
            }
        }
        kernels.push(b.finish(name, stores, true));
        pos_of_kernel.push(pos);
    }
    if !retry.is_empty() {
        return Err(Retry::Materialize(retry));
    }
    // In-place updates: the kernel writing a param's new value must follow every other
    // kernel reading its old value, and read it only where it writes.
    // Update values to move, with the position of the last kernel reading their target.
    let mut later: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &(target, value) in &g.updates {
        let Some(kv) = kernels
            .iter()
            .position(|k| k.stores.iter().any(|s| s.buf == value))
        else {
            continue;
        };
        for (ki, k) in kernels.iter().enumerate() {
            if ki == kv || !k.loads().contains(&target) {
                continue;
            }
            if pos_of_kernel[ki] > pos_of_kernel[kv] {
                // A kernel that runs later reads the old value (a reader fused into a later
                // kernel than where the schedule put it, or a recomputed value stored by
                // a later kernel): the update runs after it, unless that kernel reads what
                // the update's kernel stores; then the reader gets a buffer (one that has
                // one already, a guest, cannot be helped so).
                let loads = k.loads();
                if kernels[kv].stores.iter().any(|s| loads.contains(&s.buf))
                    || sites.delayed.contains(&value)
                {
                    for &x in &k.nodes {
                        if g.node(x).inputs.contains(&target)
                            && x != *k.nodes.last().unwrap_or(&x)
                            && !m.contains(&x)
                        {
                            retry.push(x);
                        }
                    }
                    if retry.is_empty() {
                        return Err(Retry::Fail(FuseError::UpdateHazard(name_of(g, target))));
                    }
                    continue;
                }
                let e = later.entry(value).or_insert(pos_of_kernel[ki]);
                *e = (*e).max(pos_of_kernel[ki]);
            }
        }
        let k = &kernels[kv];
        let Some(store_index) = k.stores.iter().find(|s| s.buf == value).map(|s| s.index) else {
            continue;
        };
        let bad = k.live_nodes().into_iter().any(|e| {
            matches!(k.pool.get(e), E::Load { buf, index, .. } if *buf == target && *index != store_index)
        });
        if bad || k.operand_loads().contains(&target) {
            return Err(Retry::Fail(FuseError::UpdateHazard(name_of(g, target))));
        }
    }
    if !retry.is_empty() {
        return Err(Retry::Materialize(retry));
    }
    if !later.is_empty() {
        let after = |p: usize| order.get(p).copied();
        let pairs = later.into_iter().filter_map(|(v, p)| Some((v, after(p)?)));
        return Err(Retry::Later(pairs.collect()));
    }
    Ok(kernels)
}

/// `order` with each update value of `later` (with the update values its kernel stores
/// as guests, and what reads them up to there) moved after the node paired with it.
/// Nothing moved is read by a node left before it, so the order stays topological.
fn updates_after(
    g: &Graph,
    order: &[NodeId],
    later: &[(NodeId, NodeId)],
    hosts: &BTreeMap<NodeId, NodeId>,
) -> Vec<NodeId> {
    let mut order = order.to_vec();
    for &(value, after) in later {
        let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let (Some(&a), Some(&b)) = (pos.get(&value), pos.get(&after)) else {
            continue;
        };
        if b <= a {
            continue;
        }
        let mut moved: BTreeSet<NodeId> = BTreeSet::from([value]);
        moved.extend(hosts.iter().filter(|&(_, &h)| h == value).map(|(&u, _)| u));
        let start = moved
            .iter()
            .filter_map(|n| pos.get(n).copied())
            .min()
            .unwrap_or(a);
        for &n in &order[start..=b] {
            if g.node(n).inputs.iter().any(|i| moved.contains(i)) {
                moved.insert(n);
            }
        }
        crate::ir::sink(&mut order, start..=b, &moved);
    }
    order
}

fn name_of(g: &Graph, n: NodeId) -> String {
    match &g.node(n).op {
        Op::Param { name, .. } | Op::State { name, .. } | Op::Input { name, .. } => name.clone(),
        _ => format!("%{}", n.index()),
    }
}

/// `buf[i] = 0` over the node's shape.
fn fill_kernel(d: &Decisions<'_>, n: NodeId, name: String) -> Result<Kernel, LowerError> {
    let ty = d.g.ty(n).clone();
    let layout = d.layout(n);
    let mut b = Builder::new(d, n, layout.iter().map(|&a| ty.dims()[a]).collect());
    let idx = b.logical_index(n);
    let index = b.buffer_index(n, &idx);
    let z = b.pool.constant(0.0, super::VTy::of(ty.dtype));
    let st = Store {
        buf: n,
        dtype: ty.dtype,
        index,
        value: z,
        accumulate: false,
    };
    let mut k = b.finish(name, vec![st], true);
    k.describe = format!("zero fill for {} %{}", d.g.node(n).op.name(), n.index());
    Ok(k)
}
