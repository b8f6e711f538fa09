//! Rematerialization of a compiled training step (a TDSL program): which forward values the
//! backward pass recomputes so that the step's arena fits a memory budget, with the fewest
//! added FLOPs.
//!
//! A decision is a set of *evicted* forward values of the scheduled graph (after autodiff
//! and scheduling). [`apply`] gives every backward reader of an evicted value a clone made
//! right before the first of them (recursively cloning evicted inputs it needs, and views of
//! evicted values), so the original is dead once the forward pass has used it. Fusion then
//! often folds a recomputed pointwise value into its reader: it costs FLOPs but no buffer.
//!
//! Memory is the real plan: every decision is compiled up to its verified arena
//! (`artifact::plan_step`, the plan that runs), and a budget counts as met only when that
//! arena is within it. The search runs on the parent module's simulator over a model of the
//! step (a node's bytes: its buffer in the fused plan; its cost: its FLOPs; views read
//! through to their root): [`auto`] calibrates the simulated peak against the real plan,
//! solves for the model target with a portfolio (chain DP over the candidates, greedy,
//! then branch and bound within the work limit), compiles the best decision, and tightens
//! the target by the real overshoot until the plan fits. The baselines — √n segments and
//! per-block checkpointing — are measured the same way, and `auto` takes the cheapest
//! decision that fits among everything it compiled.
//!
//! Without a budget, [`free`] (the default; `--remat none` turns it off) recomputes only
//! what costs next to nothing: pointwise values that backward kernels rebuild from what the
//! backward pass keeps anyway (in a kernel of their own only where that lowers the arena
//! further: the cnn's residual block outputs, read by the next stage's weight gradients
//! where no backward kernel of their shape runs). On CUDA it then recomputes
//! [`products`]: a product whose result is at least twice what it is made from and which
//! only an activation's derivative reads in the backward pass (gpt's fc1), kept when the
//! arena drops. Under `--amp` (tensor cores) they may add [`PRODUCT_FLOP_SHARE`] of the
//! step's FLOPs (gpt bf16: 1.95 -> 1.68 GiB, 0.59x PyTorch eager's peak, for about 1.2 ms
//! of a 12.6 ms step on an H200); in f32 [`PRODUCT_F32_FLOP_SHARE`], and free and product
//! recomputation together at most [`FREE_TOTAL_SHARE`] of the step's estimated time (gpt
//! f32: 4 of 12 fc1 outputs, 2.58 -> 2.39 GiB, 0.64x PyTorch eager's peak, +2.7 % step
//! time on an H200).

use super::{RematGraph, Solution};
use crate::artifact::{self, BuildError, CompileOptions};
use crate::ir::{Graph, NodeId, Op};
use crate::plan::human_bytes as human;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// `--remat`: what to recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Nothing, not even `checkpoint { }` blocks.
    None,
    /// What `checkpoint { }` blocks say (the default without a budget).
    #[default]
    Manual,
    /// Chosen by the compiler to fit `--mem-budget` (the default with one).
    Auto,
}

/// FLOPs of one node (multiply-adds count 2; pointwise ops 1 per element; views, leaves and
/// fills 0).
pub fn flops(g: &Graph, n: NodeId) -> u64 {
    let node = g.node(n);
    let out = node.ty.shape.numel() as u64;
    let numel = |i: usize| {
        node.inputs
            .get(i)
            .map(|&x| g.ty(x).shape.numel() as u64)
            .unwrap_or(0)
    };
    let dims = |i: usize| -> Vec<usize> {
        node.inputs
            .get(i)
            .map(|&x| g.ty(x).dims().to_vec())
            .unwrap_or_default()
    };
    // Taps per output element of a convolution with weight dims [O, I/groups, KH, KW].
    let taps = |w: &[usize]| -> u64 { w.iter().skip(1).product::<usize>() as u64 };
    match &node.op {
        op if op.is_source() || op.is_view_candidate() => 0,
        Op::MatMul => {
            let k = dims(0).last().copied().unwrap_or(1) as u64;
            2 * out * k
        }
        Op::Conv2d { .. } => 2 * out * taps(&dims(1)),
        Op::Conv2dGradInput { .. } => 2 * numel(0) * taps(&dims(1)),
        Op::Conv2dGradWeight { .. } => 2 * numel(1) * taps(node.ty.dims()),
        Op::Pool2d { kernel, .. } => out * (kernel[0] * kernel[1]) as u64,
        Op::Pool2dGrad { kernel, .. } => numel(1) * (kernel[0] * kernel[1]) as u64,
        Op::Reduce { .. } | Op::ArgMax { .. } => numel(0),
        Op::EmbeddingGrad { .. } => numel(1),
        // Scores `q kᵀ` (2·T·S·D a batch), then `p v` (2·T·S·E) for the output.
        Op::Attention { .. } | Op::AttentionLse { .. } => {
            let (q, k) = (dims(0), dims(1));
            let s = k.get(k.len().wrapping_sub(2)).copied().unwrap_or(1) as u64;
            let e = dims(2).last().copied().unwrap_or(0) as u64;
            2 * numel(0) * s + 2 * (numel(0) / q.last().copied().unwrap_or(1).max(1) as u64) * s * e
        }
        // The scores again, `dout vᵀ`, and `ds k` (`dq`) or `dsᵀ q` and `pᵀ dout` (`dk`, `dv`).
        Op::AttentionGrad { kv, .. } => {
            let (q, k) = (dims(0), dims(1));
            let s = k.get(k.len().wrapping_sub(2)).copied().unwrap_or(1) as u64;
            let e = dims(2).last().copied().unwrap_or(0) as u64;
            let rows = numel(0) / q.last().copied().unwrap_or(1).max(1) as u64;
            let products = 2 * numel(0) * s + 2 * rows * s * e;
            products + if *kv { products } else { 2 * numel(0) * s }
        }
        _ => out,
    }
}

/// FLOPs of a whole step.
pub fn step_flops(g: &Graph) -> u64 {
    g.node_ids().map(|n| flops(g, n)).sum()
}

/// May the backward pass recompute this forward value? Leaves, constants, outputs and the
/// loss stay (dropout recomputes its mask from its seed and the element index); views that alias their operand's bytes are recomputed with it
/// (a view that is a copy in the plan is a value of its own).
fn evictable(g: &Graph, n: NodeId, alias: bool) -> bool {
    let node = g.node(n);
    !node.backward
        && !alias
        && !node.op.is_source()
        && !g.outputs.iter().any(|(_, o)| *o == n)
        && g.train.as_ref().is_none_or(|t| t.loss != n)
        && !g.updates.iter().any(|(t, v)| *t == n || *v == n)
}

/// The storage root of a chain of views among `views`.
fn root_in(g: &Graph, views: &BTreeSet<NodeId>, mut n: NodeId) -> NodeId {
    while views.contains(&n) {
        match g.node(n).inputs.first() {
            Some(&i) => n = i,
            None => break,
        }
    }
    n
}

/// The simulator's model of a scheduled step.
pub struct Model {
    pub graph: RematGraph,
    /// Graph node of each model node.
    pub nodes: Vec<NodeId>,
    index: BTreeMap<NodeId, usize>,
    /// Views that alias their operand's buffer in the plan, by operand.
    aliases: BTreeMap<NodeId, Vec<NodeId>>,
}

impl Model {
    /// Builds the model from the step and its fused kernels. Every value but aliasing views,
    /// params, optimizer state and scalars counts its bytes, fused or not: fusion folds many
    /// values into their readers' kernels, but once a reader is recomputed in the backward
    /// pass, its inputs must be kept (or recomputed too).
    pub fn new(g: &Graph, fused: &crate::kernel::fuse::Fused) -> Model {
        let lv = crate::analysis::liveness::kernel_liveness(g, fused);
        let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
        let index: BTreeMap<NodeId, usize> =
            order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut alias_set = BTreeSet::new();
        let mut aliases: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
        for &id in &order {
            let node = g.node(id);
            if !node.op.is_view_candidate() {
                continue;
            }
            let Some(&x) = node.inputs.first() else {
                continue;
            };
            let same = matches!(
                (lv.buffer_of.get(&id), lv.buffer_of.get(&x)),
                (Some(a), Some(b)) if a == b
            );
            // A view no kernel stores is an alias too.
            let owns = lv
                .buffer_of
                .get(&id)
                .is_some_and(|&b| lv.buffers[b].owner == id);
            if same || !owns {
                alias_set.insert(id);
                aliases.entry(x).or_default().push(id);
            }
        }
        let n = order.len();
        let mut rg = RematGraph {
            names: Vec::with_capacity(n),
            mem: vec![0; n],
            cost: vec![0; n],
            preds: vec![Vec::new(); n],
            order: (0..n).collect(),
            backward: vec![false; n],
            fixed: vec![false; n],
        };
        for (i, &id) in order.iter().enumerate() {
            let node = g.node(id);
            rg.names.push(format!("{} {}", node.op.name(), node.ty));
            let persistent = node.op.is_persistent();
            let alias = alias_set.contains(&id);
            let scalar = matches!(node.op, Op::Literal { .. });
            if !persistent && !alias && !scalar {
                rg.mem[i] = node.ty.size_bytes() as u64;
            }
            rg.cost[i] = flops(g, id);
            let mut preds: Vec<usize> = node
                .inputs
                .iter()
                .filter_map(|&x| index.get(&root_in(g, &alias_set, x)).copied())
                .collect();
            preds.sort_unstable();
            preds.dedup();
            rg.preds[i] = preds;
            rg.backward[i] = node.backward;
            rg.fixed[i] = !evictable(g, id, alias);
        }
        Model {
            graph: rg,
            nodes: order,
            index,
            aliases,
        }
    }

    /// The graph nodes of a model eviction, with the views that alias them.
    pub fn evicted(&self, evict: &[bool]) -> BTreeSet<NodeId> {
        let mut out = BTreeSet::new();
        let mut stack: Vec<NodeId> = evict
            .iter()
            .enumerate()
            .filter(|(_, &e)| e)
            .map(|(i, _)| self.nodes[i])
            .collect();
        while let Some(n) = stack.pop() {
            if out.insert(n) {
                if let Some(vs) = self.aliases.get(&n) {
                    stack.extend(vs.iter().copied());
                }
            }
        }
        out
    }

    /// The model eviction of a set of graph nodes.
    pub fn mask(&self, set: &BTreeSet<NodeId>) -> Vec<bool> {
        let mut m = vec![false; self.nodes.len()];
        for n in set {
            if let Some(&i) = self.index.get(n) {
                m[i] = true;
            }
        }
        m
    }
}

/// The step with `evict` recomputed (see the module doc). A clone's input is the original
/// value when that is still alive (kept, or read later anyway); a forward value whose
/// readers have all run is recomputed too, back to values that are alive — as the
/// simulator counts it. Values in `evict` that no later backward node reads stay as they
/// are.
pub fn apply(g: &Graph, evict: &BTreeSet<NodeId>) -> Graph {
    if evict.is_empty() {
        return g.clone();
    }
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // Last reader of each value (any reader; a view's readers extend its operand), and last
    // forward reader (views in `evict` extend their operand: they go with it).
    let mut last_any: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut last_fwd: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in order.iter().rev() {
        let node = g.node(n);
        for &i in &node.inputs {
            let e = last_any.entry(i).or_insert(0);
            *e = (*e).max(pos[&n]);
            if !node.backward {
                let e = last_fwd.entry(i).or_insert(0);
                *e = (*e).max(pos[&n]);
            }
        }
        if let Some(&i) = node.inputs.first().filter(|_| node.op.is_view_candidate()) {
            if let Some(&l) = last_any.get(&n) {
                let e = last_any.entry(i).or_insert(0);
                *e = (*e).max(l);
            }
            if let Some(&l) = last_fwd.get(&n).filter(|_| evict.contains(&n)) {
                let e = last_fwd.entry(i).or_insert(0);
                *e = (*e).max(l);
            }
        }
    }
    struct Cloner<'a> {
        g: &'a Graph,
        h: Graph,
        evict: &'a BTreeSet<NodeId>,
        last_any: BTreeMap<NodeId, usize>,
        clones: BTreeMap<NodeId, NodeId>,
        order: Vec<NodeId>,
    }
    impl Cloner<'_> {
        /// Whether a reader at position `at` needs `n` recomputed.
        fn needs(&self, n: NodeId, at: usize) -> bool {
            let leaf = self.g.node(n).op.is_leaf();
            self.evict.contains(&n)
                || (!leaf
                    && !self.g.node(n).backward
                    && self.last_any.get(&n).is_none_or(|&l| l < at))
        }

        /// The clone of `n` (made, with the inputs it needs, and scheduled now if not yet).
        fn clone_of(&mut self, n: NodeId, at: usize) -> Option<NodeId> {
            if let Some(&c) = self.clones.get(&n) {
                return Some(c);
            }
            let node = self.g.node(n).clone();
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &i in &node.inputs {
                inputs.push(if self.needs(i, at) {
                    self.clone_of(i, at)?
                } else {
                    i
                });
            }
            let c = self.h.add(node.op.clone(), inputs, node.span, None).ok()?;
            self.h.mark_backward(c);
            self.h.mark_recomputed(c, n);
            self.clones.insert(n, c);
            self.order.push(c);
            Some(c)
        }
    }
    let mut cl = Cloner {
        g,
        h: g.clone(),
        evict,
        last_any,
        clones: BTreeMap::new(),
        order: Vec::with_capacity(order.len()),
    };
    for &n in &order {
        if g.node(n).backward {
            let at = pos[&n];
            for i in g.node(n).inputs.clone() {
                // Backward readers that run before the last forward reader (a schedule may
                // interleave them) still read the original.
                let after = last_fwd.get(&root_in(g, evict, i)).is_none_or(|&l| at > l);
                if after && evict.contains(&i) {
                    // A clone that does not type-check cannot happen (same op, same operand
                    // types); if it did, the original would simply be kept.
                    if let Some(c) = cl.clone_of(i, at) {
                        cl.h.replace_use_in(n, i, c);
                    }
                }
            }
        }
        cl.order.push(n);
    }
    let order = updates_last(&cl.h, cl.order);
    cl.h.reordered(&order)
}

/// Smallest value free recomputation considers: below this the bytes saved are noise.
const FREE_MIN_BYTES: u64 = 64 << 10;
/// Most nodes one free recomputation may clone (the value and the dead pointwise values
/// between it and what is kept).
const FREE_MAX_NODES: usize = 16;

/// The forward values free recomputation evicts ([`free`]): pointwise values (an
/// activation's output, a norm's normalised output, a residual sum) whose backward readers
/// can rebuild them from what the backward pass keeps anyway (values it reads at or after
/// their first backward reader, params, constants), through at most a few other pointwise
/// values that are dead by then. A value is not rebuilt from another evicted one (cnn's
/// residual stream would otherwise recompute every block's output from the block before),
/// and views of an evicted value go with it.
pub fn free_candidates(g: &Graph) -> BTreeSet<NodeId> {
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // Last reader of each value (a view's readers extend its operand), and first backward
    // reader of each forward value (through forward views).
    let mut last_any: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut first_bwd: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in order.iter().rev() {
        let node = g.node(n);
        for &i in &node.inputs {
            let e = last_any.entry(i).or_insert(0);
            *e = (*e).max(pos[&n]);
        }
        if let Some(&i) = node.inputs.first().filter(|_| node.op.is_view_candidate()) {
            if let Some(&l) = last_any.get(&n) {
                let e = last_any.entry(i).or_insert(0);
                *e = (*e).max(l);
            }
        }
    }
    for &n in &order {
        let node = g.node(n);
        if !node.backward {
            continue;
        }
        for &i in &node.inputs {
            let mut x = i;
            loop {
                if g.node(x).backward {
                    break;
                }
                first_bwd.entry(x).or_insert(pos[&n]);
                if !g.node(x).op.is_view_candidate() {
                    break;
                }
                match g.node(x).inputs.first() {
                    Some(&y) => x = y,
                    None => break,
                }
            }
        }
    }
    // Latest first: an activation's output before the norm output it is computed from,
    // which it then reads (inlined where it is cheap) rather than recomputing.
    let mut evict: BTreeSet<NodeId> = BTreeSet::new();
    // What the evicted values are rebuilt from: never evicted themselves.
    let mut read: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().rev() {
        let node = g.node(n);
        if node.backward
            || !node.op.is_elementwise()
            || !evictable(g, n, false)
            || (node.ty.size_bytes() as u64) < FREE_MIN_BYTES
            || read.contains(&n)
        {
            continue;
        }
        let Some(&at) = first_bwd.get(&n) else {
            continue;
        };
        // What the clone needs: kept values (`kept`), or dead pointwise ones cloned with it.
        let mut stack = node.inputs.clone();
        let mut seen = BTreeSet::new();
        let mut kept = BTreeSet::new();
        let mut ok = true;
        while let Some(x) = stack.pop() {
            if !seen.insert(x) {
                continue;
            }
            let xn = g.node(x);
            if seen.len() > FREE_MAX_NODES || evict.contains(&x) || xn.backward {
                ok = false;
                break;
            }
            if xn.op.is_source() {
                continue;
            }
            if xn.op.is_view_candidate() || last_any.get(&x).is_none_or(|&l| l < at) {
                if !(xn.op.is_view_candidate() || xn.op.is_elementwise()) {
                    ok = false;
                    break;
                }
                stack.extend(xn.inputs.iter().copied());
            } else {
                kept.insert(x);
            }
        }
        if ok {
            evict.insert(n);
            read.extend(seen);
            read.extend(kept);
        }
    }
    // Forward views of evicted values go with them.
    for &n in &order {
        let node = g.node(n);
        if !node.backward && node.op.is_view_candidate() && evict.contains(&g.view_root(n)) {
            evict.insert(n);
        }
    }
    evict
}

/// What free recomputation did to a step (`tcc mem` and `tcc build` show it).
#[derive(Clone, Debug, PartialEq)]
pub struct Free {
    /// Forward values recomputed in the backward pass (views not counted), and their bytes.
    pub values: usize,
    pub bytes: u64,
    /// The arena, kernel count and the roofline estimate of the step's time
    /// (`kernel::peak::step_seconds`), without and with it.
    pub arena: (u64, u64),
    pub kernels: (usize, usize),
    pub seconds: (f64, f64),
    /// Kernels of their own that store clones (no backward kernel of the clone's shape
    /// runs where a product reads it): kept, all together, only where the arena is lower
    /// with them than without; no other kernel is added.
    pub own_kernels: usize,
    /// Whether it was kept (it lowers the arena within [`FREE_TOTAL_SHARE`] of the step's
    /// estimated time, each value within [`crate::kernel::peak::TIME_SHARE`]).
    pub kept: bool,
    /// Product recomputation on CUDA ([`products`]), weighed after it.
    pub products: Option<Products>,
}

/// What product recomputation did to a step ([`products`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Products {
    /// Forward products recomputed in the backward pass, and their bytes.
    pub values: usize,
    pub bytes: u64,
    /// The FLOPs they add, and the step's FLOPs before.
    pub flops: (u64, u64),
    /// The arena and kernel count without and with it.
    pub arena: (u64, u64),
    pub kernels: (usize, usize),
    /// Whether it was kept (it lowers the arena within its FLOP share and, in f32, its
    /// share of the estimated time).
    pub kept: bool,
}

impl Products {
    /// One line for reports.
    pub fn line(&self) -> String {
        let pct = if self.flops.1 > 0 {
            self.flops.0 as f64 / self.flops.1 as f64 * 100.0
        } else {
            0.0
        };
        recompute_line(
            self.kept,
            format!("{} forward products", self.values),
            self.bytes,
            "in the backward pass",
            self.arena,
            self.kernels,
            format!("+{pct:.1}% FLOPs"),
        )
    }
}

/// A recomputation's line: what it recomputes (or would), where, the arena and kernels
/// before and after, and its cost.
fn recompute_line(
    kept: bool,
    what: String,
    bytes: u64,
    place: &str,
    arena: (u64, u64),
    kernels: (usize, usize),
    cost: String,
) -> String {
    format!(
        "{} {what} ({}) {place}: arena {} -> {}, kernels {} -> {}, {cost}{}",
        if kept {
            "recomputes"
        } else {
            "would recompute"
        },
        human(bytes),
        human(arena.0),
        human(arena.1),
        kernels.0,
        kernels.1,
        if kept { "" } else { " (not kept)" }
    )
}

impl Free {
    /// One line for reports.
    pub fn line(&self) -> String {
        let pct = if self.seconds.0 > 0.0 {
            (self.seconds.1 / self.seconds.0 - 1.0) * 100.0
        } else {
            0.0
        };
        let place = match self.own_kernels {
            0 => "in backward kernels".to_string(),
            n => format!("in backward kernels ({n} in kernels of their own)"),
        };
        recompute_line(
            self.kept,
            format!("{} forward values", self.values),
            self.bytes,
            &place,
            self.arena,
            self.kernels,
            format!("estimated time {pct:+.2}%"),
        )
    }
}

/// Free recomputation, the default (`--remat none` turns it off): the values of
/// [`free_candidates`] are recomputed by the backward kernels that read them, inside a
/// pointwise reader or stored by a pointwise kernel of their shape just before a product
/// reads them (`kernel::fuse`), or, where no such kernel runs, by a kernel of their own
/// when the arena is lower with all such clones than without them; kept when both plans
/// say it adds no other kernel and lowers
/// the arena within [`FREE_TOTAL_SHARE`] of the step's estimated time, each value within
/// [`crate::kernel::peak::TIME_SHARE`] (its own kernel's launch included).
///
/// Then, on CUDA, product recomputation ([`products`]) on the step it gives.
pub fn free(g: &Graph, opts: &CompileOptions) -> Result<(Graph, Option<Free>), BuildError> {
    free_with(g, opts, true)
}

/// [`free`], with product recomputation only where `with_products` (`--no-product-remat`
/// turns it off, keeping the free recomputation).
pub fn free_with(
    g: &Graph,
    opts: &CompileOptions,
    with_products: bool,
) -> Result<(Graph, Option<Free>), BuildError> {
    let (h, free, plan) = free_pointwise(g, opts)?;
    if !with_products || opts.target != crate::artifact::Target::Cuda {
        return Ok((h, free));
    }
    let share = match opts.amp.dtype {
        Some(_) => PRODUCT_FLOP_SHARE,
        None => PRODUCT_F32_FLOP_SHARE,
    };
    let evict = product_candidates(&h, share);
    if evict.is_empty() {
        return Ok((h, free));
    }
    let plan = match plan {
        Some(p) => p,
        None => artifact::plan_step(&h, opts)?,
    };
    // In f32, all default recomputation together stays within [`FREE_TOTAL_SHARE`] of the
    // step's estimated time before it.
    let limit = match opts.amp.dtype {
        Some(_) => None,
        None => {
            let base = match &free {
                Some(f) => f.seconds.0,
                None => crate::kernel::peak::step_seconds(&plan.graph, &plan.fused),
            };
            Some(base * (1.0 + FREE_TOTAL_SHARE))
        }
    };
    let (h, products) = products(&h, &evict, plan, opts, share, limit)?;
    let free = match free {
        Some(f) => Some(Free { products, ..f }),
        None => products.map(|p| Free {
            values: 0,
            bytes: 0,
            arena: (p.arena.0, p.arena.0),
            kernels: (p.kernels.0, p.kernels.0),
            seconds: (0.0, 0.0),
            own_kernels: 0,
            kept: false,
            products: Some(p),
        }),
    };
    Ok((h, free))
}

/// The bytes `values` of `g` take where the step stores them: under `--amp`, each in the
/// dtype the mixed-precision policy stores it in ([`crate::passes::amp::stored_dtypes`]:
/// a product's 16-bit copy, an f32 statistic), which runs after this stage; as `g` types
/// them otherwise.
fn stored_bytes(g: &Graph, values: &[NodeId], opts: &CompileOptions) -> u64 {
    // A step the policy cannot be applied to fails in the `amp` stage, with its error; the
    // report then counts f32 bytes.
    let stored = opts
        .amp
        .dtype
        .and_then(|low| crate::passes::amp::stored_dtypes(g, low).ok());
    values
        .iter()
        .map(|&n| {
            let ty = g.ty(n);
            let size = stored
                .as_ref()
                .and_then(|d| d.get(&n))
                .map_or(ty.dtype.size_bytes(), |d| d.size_bytes());
            ty.shape.numel().saturating_mul(size) as u64
        })
        .sum()
}

/// `g` with every value of [`free_candidates`] recomputed in the backward pass, as
/// [`free`] first tries it (before it keeps back the costly ones and weighs the plans): a
/// step as the `remat` stage will make it, one plan cheaper to weigh
/// ([`crate::autodiff::stacks::Weigh`]).
pub fn with_free_candidates(g: &Graph) -> Graph {
    products_after_hosts(&apply(g, &free_candidates(g)))
}

/// [`free`]'s pointwise part: the step, the report, and the step's plan when one was made.
fn free_pointwise(
    g: &Graph,
    opts: &CompileOptions,
) -> Result<(Graph, Option<Free>, Option<artifact::Planned>), BuildError> {
    let mut evict = free_candidates(g);
    if evict.is_empty() {
        return Ok((g.clone(), None, None));
    }
    let before = artifact::plan_step(g, opts)?;
    let secs = |p: &artifact::Planned| crate::kernel::peak::step_seconds(&p.graph, &p.fused);
    let base = secs(&before);
    let mut tried = None;
    // The step recomputing `evict`, each product that reads a clone after the chain that
    // stores it.
    let recompute = |g: &Graph, evict: &BTreeSet<NodeId>| products_after_hosts(&apply(g, evict));
    // A value whose recomputation costs more than its share is kept, and the rest planned
    // again (hosts are never clones, so that settles it; a third round is a safeguard).
    for _ in 0..3 {
        let h = recompute(g, &evict);
        let after = artifact::plan_step(&h, opts)?;
        let costly = costly_clones(&after, &evict, base);
        tried = Some((h, after, evict.clone()));
        if costly.is_empty() {
            break;
        }
        evict.retain(|&n| !costly.contains(&g.view_root(n)));
        if evict.iter().all(|&n| g.node(n).op.is_view_candidate()) {
            break;
        }
    }
    let Some((mut h, mut after, mut evict)) = tried else {
        return Ok((g.clone(), None, Some(before)));
    };
    // Clones stored by a kernel of their own (no backward kernel of their shape runs where
    // a product reads them) stay, all together, only where the arena is lower with them
    // than without.
    let (own, _) = own_kernel_clones(&after, &evict);
    if !own.is_empty() {
        let mut fewer = evict.clone();
        fewer.retain(|&n| !own.contains(&g.view_root(n)));
        let h2 = recompute(g, &fewer);
        let after2 = artifact::plan_step(&h2, opts)?;
        if after2.plan.arena_bytes <= after.plan.arena_bytes {
            (h, after, evict) = (h2, after2, fewer);
        }
    }
    let values: Vec<NodeId> = evict
        .iter()
        .copied()
        .filter(|&n| !g.node(n).op.is_view_candidate())
        .collect();
    let f = Free {
        values: values.len(),
        bytes: stored_bytes(g, &values, opts),
        arena: (before.plan.arena_bytes, after.plan.arena_bytes),
        kernels: (before.fused.kernels.len(), after.fused.kernels.len()),
        seconds: (base, secs(&after)),
        own_kernels: own_kernel_clones(&after, &evict).1,
        kept: false,
        products: None,
    };
    let kept = !values.is_empty()
        && f.arena.1 < f.arena.0
        && f.kernels.1 <= f.kernels.0 + f.own_kernels
        && f.seconds.1 <= f.seconds.0 * (1.0 + FREE_TOTAL_SHARE);
    let f = Free { kept, ..f };
    if kept {
        Ok((h, Some(f), Some(after)))
    } else {
        Ok((g.clone(), Some(f), Some(before)))
    }
}

/// The share of the step's FLOPs that product recomputation may add under `--amp`.
pub const PRODUCT_FLOP_SHARE: f64 = 0.10;

/// The share of the step's FLOPs that product recomputation may add in f32, where the
/// step's estimated time bounds it too (within [`FREE_TOTAL_SHARE`], with free
/// recomputation).
pub const PRODUCT_F32_FLOP_SHARE: f64 = 0.06;

/// The forward products [`products`] recomputes, in program order: a matmul whose result is
/// at least twice the bytes of the activations it is computed from (its other operands are
/// params, read anyway), and which the backward pass reads only elementwise (through views):
/// an activation function's derivative, such as gpt's `gelu(x @ w1)`. Storing such a result
/// costs more than what rebuilds it, and its one product is the whole cost of the
/// rebuild. Taken first-fit in program order while their products add at most `share`
/// of the step's FLOPs (what rebuilding their operands adds is checked by [`products`]);
/// their forward views go with them, and a product with a view that is an output or an
/// update is not taken, nor one of a loss head computed in chunks (each chunk's backward
/// pass runs right after it: storing it costs nothing across the step).
pub fn product_candidates(g: &Graph, share: f64) -> BTreeSet<NodeId> {
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let budget = (step_flops(g) as f64 * share) as u64;
    let chunked_head = g.loss_chunks.is_some() && g.micro_batches.is_none();
    let mut spent = 0u64;
    let mut out = BTreeSet::new();
    for &n in &order {
        let node = g.node(n);
        if (chunked_head && node.micro_batch.is_some())
            || node.backward
            || node.recomputed.is_some()
            || node.op != Op::MatMul
            || !evictable(g, n, false)
            || (node.ty.size_bytes() as u64) < FREE_MIN_BYTES
        {
            continue;
        }
        let activations: u64 = node
            .inputs
            .iter()
            .filter(|&&i| !g.node(g.view_root(i)).op.is_source())
            .map(|&i| g.ty(i).size_bytes() as u64)
            .sum();
        if (node.ty.size_bytes() as u64) < 2 * activations {
            continue;
        }
        // Its readers, through views: some backward, every backward one elementwise; its
        // forward views, evicted with it.
        let mut stack = vec![n];
        let mut views = Vec::new();
        let mut backward = 0usize;
        let mut ok = true;
        while let Some(x) = stack.pop() {
            for u in g.users(x) {
                let un = g.node(u);
                if un.op.is_view_candidate() {
                    stack.push(u);
                    if !un.backward {
                        ok &= evictable(g, u, false);
                        views.push(u);
                    }
                } else if un.backward {
                    backward += 1;
                    ok &= un.op.is_elementwise();
                }
            }
        }
        let cost = flops(g, n);
        if !ok || backward == 0 || spent + cost > budget {
            continue;
        }
        spent += cost;
        out.insert(n);
        out.extend(views);
    }
    out
}

/// Product recomputation, the default on CUDA (`--no-product-remat` or `--remat none` turn
/// it off): `evict` ([`product_candidates`] of `g`) is recomputed in the backward pass, kept
/// when the planned arena drops and everything recomputed (the products and the operands
/// rebuilt for them) adds at most `share` of the step's FLOPs and, when `limit` is given (in
/// f32), the step's estimated seconds stay within it: the last products in program order
/// are left out until they do. `base` is `g`'s plan.
pub fn products(
    g: &Graph,
    evict: &BTreeSet<NodeId>,
    base: artifact::Planned,
    opts: &CompileOptions,
    share: f64,
    limit: Option<f64>,
) -> Result<(Graph, Option<Products>), BuildError> {
    let pos: BTreeMap<NodeId, usize> = g
        .topo_order()
        .unwrap_or_else(|| g.node_ids().collect())
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n, i))
        .collect();
    let mut evict = evict.clone();
    loop {
        let values: Vec<NodeId> = evict
            .iter()
            .copied()
            .filter(|&n| !g.node(n).op.is_view_candidate())
            .collect();
        let Some(&last) = values.iter().max_by_key(|&n| pos.get(n)) else {
            return Ok((g.clone(), None));
        };
        let h = apply(g, &evict);
        let after = artifact::plan_step(&h, opts)?;
        let seconds = crate::kernel::peak::step_seconds(&after.graph, &after.fused);
        let in_time = limit.is_none_or(|l| seconds <= l);
        if !in_time && values.len() > 1 {
            // Without the last product (and its views).
            evict.retain(|&n| g.view_root(n) != last);
            continue;
        }
        let before = step_flops(g);
        let added = step_flops(&h).saturating_sub(before);
        let p = Products {
            values: values.len(),
            bytes: stored_bytes(g, &values, opts),
            flops: (added, before),
            arena: (base.plan.arena_bytes, after.plan.arena_bytes),
            kernels: (base.fused.kernels.len(), after.fused.kernels.len()),
            kept: after.plan.arena_bytes < base.plan.arena_bytes
                && added as f64 <= share * before as f64
                && in_time,
        };
        return Ok((if p.kept { h } else { g.clone() }, Some(p)));
    }
}

/// The step with each product that first reads a recomputed value moved after the chain
/// of backward elementwise nodes of that value's shape which the schedule runs next in the
/// product's call and micro-batch (and which do not need the product), with everything
/// between that depends on it. That chain is
/// what fusion stores the clone by (`kernel::fuse`'s recompute hosts: the last backward
/// kernel of its shape before its first reader). In a transformer's MLP the schedule runs
/// the weight gradient `gelu(h)ᵀ dy` before the input gradient `(dy w2ᵀ) gelu'(h)`; moved
/// after it, the clone of `gelu(h)` is stored by the same layer's input-gradient kernel,
/// which reads `h` anyway, instead of by the next layer's (which read the other `h` again
/// for it and kept the clone alive for a whole layer: gpt's bf16 step took 0.55 ms more).
fn products_after_hosts(h: &Graph) -> Graph {
    let mut order = h.topo_order().unwrap_or_else(|| h.node_ids().collect());
    let clones: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|&c| h.node(c).recomputed.is_some() && h.node(c).op.is_elementwise())
        .collect();
    // Each product moves once (two clones may reach the same one).
    let mut moved_products: BTreeSet<NodeId> = BTreeSet::new();
    // A chunked loss head's segments (each chunk's forward and backward): a product of
    // one chunk must not wait for the next chunk's chain (its operands would live across
    // that chunk's logits).
    let segment = match h.loss_chunks {
        Some(_) => crate::passes::schedule::segments(h, &order),
        None => BTreeMap::new(),
    };
    for c in clones {
        let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let shape = &h.ty(c).shape;
        // Its first reader, through views and casts: a product.
        let mut readers = Vec::new();
        let mut stack = vec![c];
        while let Some(x) = stack.pop() {
            for u in h.users(x) {
                let op = &h.node(u).op;
                if op.is_view_candidate() || matches!(op, Op::Cast { .. }) {
                    stack.push(u);
                } else {
                    readers.push(u);
                }
            }
        }
        let Some(&p) = readers
            .iter()
            .min_by_key(|&&u| pos.get(&u).copied().unwrap_or(0))
        else {
            continue;
        };
        if !matches!(h.node(p).op, Op::MatMul) || moved_products.contains(&p) {
            continue;
        }
        let Some(&at) = pos.get(&p) else { continue };
        let pn = h.node(p);
        // What the product feeds, directly or not, in schedule order up to `i` (extended as
        // the search goes on).
        let mut fed: BTreeSet<NodeId> = BTreeSet::from([p]);
        let mut fed_to = at;
        let mut feeds = |i: usize, fed: &mut BTreeSet<NodeId>| {
            while fed_to < i {
                fed_to += 1;
                let n = order[fed_to];
                if h.node(n).inputs.iter().any(|x| fed.contains(x)) {
                    fed.insert(n);
                }
            }
        };
        // The chain: backward elementwise nodes of the clone's shape that the product does
        // not feed, in the product's own call (`block`: the same layer) and micro-batch,
        // at most `MAX_HOST_WINDOW` nodes after it.
        let last = (at + MAX_HOST_WINDOW).min(order.len() - 1);
        let mut chain_node = |i: usize, fed: &mut BTreeSet<NodeId>| {
            let node = h.node(order[i]);
            feeds(i, fed);
            node.backward
                && node.op.is_elementwise()
                && node.ty.shape == *shape
                && node.recomputed.is_none()
                && node.block == pn.block
                && node.micro_batch == pn.micro_batch
                && segment.get(&order[i]) == segment.get(&p)
                && !fed.contains(&order[i])
        };
        let Some(mut end) = (at + 1..=last).find(|&i| chain_node(i, &mut fed)) else {
            continue;
        };
        // Up the chain: its latest reader of that shape, while there is one.
        loop {
            let mut users: Vec<usize> = h
                .users(order[end])
                .into_iter()
                .filter_map(|u| pos.get(&u).copied())
                .filter(|&i| i > end && i <= last)
                .collect();
            users.sort_unstable();
            let next = users.into_iter().rev().find(|&i| chain_node(i, &mut fed));
            match next {
                Some(i) => end = i,
                None => break,
            }
        }
        feeds(end, &mut fed);
        // Everything between that the product feeds moves after the chain, in order.
        crate::ir::sink(&mut order, at..=end, &fed);
        moved_products.insert(p);
    }
    if moved_products.is_empty() {
        return h.clone();
    }
    // An update moved above a reader of its param runs after it again.
    let order = updates_last(h, order);
    h.reordered(&order)
}

/// Most nodes after a product that [`products_after_hosts`] looks through for the chain
/// that stores its clone (gpt's: 27).
const MAX_HOST_WINDOW: usize = 256;

/// The step time free recomputation may add in all, as a share of the estimated step: the
/// issue's bound on step time for memory saved by default (each value also within
/// [`crate::kernel::peak::TIME_SHARE`]). In f32, product recomputation shares it.
pub const FREE_TOTAL_SHARE: f64 = 0.03;

/// The recomputed values (by original, among `evict`) whose recomputation costs more than
/// [`crate::kernel::peak::TIME_SHARE`] of the estimated step `base`: as a guest of another
/// kernel, the bytes it reads and stores there at the cost model's bandwidth; in a kernel
/// of its own (no backward kernel of its shape runs where a product reads it: a residual
/// block's output, read by the next stage's weight gradients), that kernel's whole
/// estimate, launch included.
fn costly_clones(p: &artifact::Planned, evict: &BTreeSet<NodeId>, base: f64) -> BTreeSet<NodeId> {
    let mut out = BTreeSet::new();
    for k in &p.fused.kernels {
        for (i, s) in k.stores.iter().enumerate() {
            let Some(orig) = p.graph.get(s.buf).and_then(|n| n.recomputed) else {
                continue;
            };
            if !evict.contains(&orig) {
                continue;
            }
            let cost = if i == 0 {
                crate::kernel::peak::kernel_seconds(&p.graph, k)
            } else {
                let bytes = p.graph.ty(s.buf).size_bytes() as u64
                    + p.graph
                        .node(s.buf)
                        .inputs
                        .iter()
                        .filter(|&&x| p.fused.materialized.contains(&x))
                        .map(|&x| p.graph.ty(x).size_bytes() as u64)
                        .sum::<u64>();
                bytes as f64 / crate::kernel::peak::BYTES_PER_S
            };
            if cost > crate::kernel::peak::TIME_SHARE * base {
                out.insert(orig);
            }
        }
    }
    out
}

/// The recomputed values (by original, among `evict`) whose clone is stored by a kernel of
/// its own in `p` (its kernel's first store), and how many such kernels there are.
fn own_kernel_clones(p: &artifact::Planned, evict: &BTreeSet<NodeId>) -> (BTreeSet<NodeId>, usize) {
    let origs: Vec<NodeId> = p
        .fused
        .kernels
        .iter()
        .filter_map(|k| k.stores.first())
        .filter_map(|s| p.graph.get(s.buf).and_then(|n| n.recomputed))
        .filter(|orig| evict.contains(orig))
        .collect();
    let kernels = origs.len();
    (origs.into_iter().collect(), kernels)
}

/// Moves each optimizer update (with everything computed from it) after the last other
/// reader of its param, so a recomputation that reads a param reads the value the step
/// started with (the schedule had put updates as early as their gradients allowed).
fn updates_last(h: &Graph, mut order: Vec<NodeId>) -> Vec<NodeId> {
    for &(target, value) in &h.updates {
        let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        // The update and what reads it, transitively.
        let mut moved: BTreeSet<NodeId> = BTreeSet::from([value]);
        for &n in &order[pos.get(&value).copied().unwrap_or(0)..] {
            if h.node(n).inputs.iter().any(|i| moved.contains(i)) {
                moved.insert(n);
            }
        }
        // Recomputed values read from the param: fusion stores such a clone by a later
        // kernel, or computes it inside its readers, so the param is read where they are.
        let mut clones: BTreeSet<NodeId> = BTreeSet::new();
        for &n in &order {
            let node = h.node(n);
            if node.recomputed.is_some()
                && node
                    .inputs
                    .iter()
                    .any(|&i| h.view_root(i) == target || clones.contains(&h.view_root(i)))
            {
                clones.insert(n);
            }
        }
        // Readers of the param (through views and clones) that are not part of it.
        let reads = |n: NodeId| {
            h.node(n).inputs.iter().any(|&i| {
                let r = h.view_root(i);
                r == target || clones.contains(&r)
            })
        };
        let last = order
            .iter()
            .enumerate()
            .filter(|(_, &n)| !moved.contains(&n) && reads(n))
            .map(|(i, _)| i)
            .max();
        let (Some(last), Some(&first)) = (last, pos.get(&value)) else {
            continue;
        };
        if first > last {
            continue;
        }
        crate::ir::sink(&mut order, 0..=last, &moved);
    }
    order
}

/// The step reordered for recomputation: backward nodes that the schedule placed inside the
/// forward pass and that read only forward values (masks and statistics a gradient will
/// need) move to just before their first reader. Placed early, they would make every
/// evicted value they read be recomputed during the forward pass.
pub fn prepare(g: &Graph) -> Graph {
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let Some(fwd_end) = order.iter().rposition(|&n| !g.node(n).backward) else {
        return g.clone();
    };
    let update_values: BTreeSet<NodeId> = g.updates.iter().map(|u| u.1).collect();
    let mut early: BTreeSet<NodeId> = BTreeSet::new();
    for &n in &order[..fwd_end] {
        let node = g.node(n);
        if node.backward
            && !update_values.contains(&n)
            && node
                .inputs
                .iter()
                .all(|i| !g.node(*i).backward || early.contains(i))
        {
            early.insert(n);
        }
    }
    if early.is_empty() {
        return g.clone();
    }
    let mut rest: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|n| !early.contains(n))
        .collect();
    for &n in order.iter().rev().filter(|n| early.contains(n)) {
        let users = g.users(n);
        let at = rest
            .iter()
            .position(|x| users.contains(x))
            .unwrap_or(rest.len());
        rest.insert(at, n);
    }
    let rest = updates_last(g, rest);
    g.reordered(&rest)
}

/// A decision compiled to its real plan.
#[derive(Clone, Debug)]
pub struct Measured {
    pub evict: BTreeSet<NodeId>,
    /// The step with the recomputations.
    pub graph: Graph,
    pub arena: u64,
    pub persistent: u64,
    pub added_flops: u64,
}

/// Compiles `g` with `evict` recomputed up to its verified plan.
pub fn measure(
    g: &Graph,
    evict: &BTreeSet<NodeId>,
    opts: &CompileOptions,
) -> Result<Measured, BuildError> {
    let h = apply(g, evict);
    let p = artifact::plan_step(&h, opts)?;
    let added = step_flops(&h).saturating_sub(step_flops(g));
    Ok(Measured {
        evict: evict.clone(),
        arena: p.plan.arena_bytes,
        persistent: p.plan.persistent_bytes,
        added_flops: added,
        graph: h,
    })
}

/// √n checkpointing (Chen et al.): keep every ⌈√k⌉-th of the k candidates, recompute the
/// rest.
pub fn sqrt_n(m: &Model) -> BTreeSet<NodeId> {
    m.evicted(&super::sqrt_n(&m.graph).evict)
}

/// Per-block checkpointing (as `torch.utils.checkpoint` around each block): every
/// candidate made inside a top-level call of a user function is recomputed, unless a
/// forward node outside that call (or an output) reads it — the block's result stays.
pub fn per_block(g: &Graph, m: &Model) -> BTreeSet<NodeId> {
    let mut mask = vec![false; m.nodes.len()];
    for i in m.graph.candidates() {
        let n = m.nodes[i];
        let b = g.node(n).block;
        mask[i] = b.is_some()
            && g.users(n)
                .iter()
                .all(|&u| g.node(u).backward || g.node(u).block == b);
    }
    m.evicted(&mask)
}

/// Options of [`auto`].
#[derive(Clone, Copy, Debug)]
pub struct AutoOptions {
    /// The arena must be at most this many bytes.
    pub budget: u64,
    pub compile: CompileOptions,
    /// Limit of the model search (per round), counted in search work ([`super::Work`]).
    pub time_limit: Duration,
    /// Compile-and-tighten rounds.
    pub rounds: usize,
}

/// What [`auto`] chose.
#[derive(Clone, Debug)]
pub struct Decision {
    pub chosen: Measured,
    /// Which search found it.
    pub method: String,
    /// The plan without recomputation.
    pub base_arena: u64,
    pub step_flops: u64,
    /// Decisions compiled on the way.
    pub tries: usize,
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RematError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(
        "the memory budget of {} cannot be met: the smallest arena found is {} ({how}); \
         the params and optimizer state alone take {}",
        human(*budget),
        human(*smallest),
        human(*persistent)
    )]
    Infeasible {
        budget: u64,
        smallest: u64,
        how: String,
        persistent: u64,
    },
}

/// Chooses what to recompute so the arena fits `o.budget` (see the module doc).
pub fn auto(g: &Graph, o: &AutoOptions) -> Result<Decision, RematError> {
    let start = Instant::now();
    let total = step_flops(g);
    let base = measure(g, &BTreeSet::new(), &o.compile)?;
    let base_arena = base.arena;
    let done = |chosen: Measured, method: &str, tries: usize| Decision {
        chosen,
        method: method.to_string(),
        base_arena,
        step_flops: total,
        tries,
        elapsed: start.elapsed(),
    };
    if base.arena <= o.budget {
        return Ok(done(base, "none needed", 1));
    }
    let persistent = base.persistent;
    let prepared = prepare(g);
    let g = &prepared;
    let fused = crate::kernel::fuse::fuse(g, o.compile.fuse).map_err(BuildError::from)?;
    let m = Model::new(g, &fused);
    let model_peak = super::none(&m.graph).eval.peak.max(1);
    let real_transient = base.arena.saturating_sub(persistent).max(1);
    let want = o.budget.saturating_sub(persistent);
    let mut tries = 1usize;
    let mut fits: Vec<(Measured, String)> = Vec::new();
    let mut smallest = (base.arena, "no recomputation".to_string());
    let mut consider = |r: Measured, how: String, fits: &mut Vec<(Measured, String)>| {
        if r.arena < smallest.0 {
            smallest = (r.arena, how.clone());
        }
        if r.arena <= o.budget {
            fits.push((r, how));
        }
    };
    // The reordered step alone (nothing recomputed) sometimes fits already.
    let r = measure(g, &BTreeSet::new(), &o.compile)?;
    tries += 1;
    consider(r, "reordered, nothing recomputed".into(), &mut fits);
    // Baselines first: they bound what the search must beat, and start it.
    let mut seeds: Vec<Vec<bool>> = Vec::new();
    for (name, set) in [("per-block", per_block(g, &m)), ("sqrt(n)", sqrt_n(&m))] {
        if !set.is_empty() {
            seeds.push(m.mask(&set));
            let r = measure(g, &set, &o.compile)?;
            tries += 1;
            consider(r, name.to_string(), &mut fits);
        }
    }
    // The model target: the real transient budget in model units to start with; then,
    // after an overshoot, the target shrunk by the real ratio, and once one target fits and
    // one does not, bisection between them for the largest target that fits (the cheapest
    // decision; the real arena grows with the target, if not strictly, so the best fitting
    // decision seen is kept).
    let mut target = (want as f64 * model_peak as f64 / real_transient as f64) as u64;
    let (mut good, mut bad): (Option<u64>, Option<u64>) = (None, None);
    // The search decision whose real arena came closest above the budget.
    let mut closest: Option<(u64, Vec<bool>)> = None;
    for _ in 0..o.rounds.max(1) {
        let real = match solve_model(&m.graph, target, o.time_limit, &seeds) {
            Some(sol) => {
                let set = m.evicted(&sol.evict);
                let r = measure(g, &set, &o.compile)?;
                tries += 1;
                let arena = r.arena;
                if arena > o.budget && closest.as_ref().is_none_or(|c| arena < c.0) {
                    closest = Some((arena, sol.evict.clone()));
                }
                consider(r, format!("search: {}", sol.method), &mut fits);
                Some(arena)
            }
            None => None,
        };
        let fit = real.is_some_and(|a| a <= o.budget);
        if std::env::var_os("TCC_REMAT_DEBUG").is_some() {
            eprintln!("remat probe: model target {target} (no remat {model_peak}): real {real:?}");
        }
        if fit {
            good = Some(good.map_or(target, |x| x.max(target)));
        } else {
            bad = Some(bad.map_or(target, |x| x.min(target)));
        }
        target = match (good, bad, real) {
            (Some(a), Some(b), _) if b > a + b / 100 => a + (b - a) / 2,
            (Some(_), Some(_), _) => break,
            (Some(a), None, _) => (a + a / 8).min(model_peak),
            // An overshoot: shrink by the real ratio, a little more so the target moves.
            (None, _, Some(arena)) => {
                let got = arena.saturating_sub(persistent).max(1) as f64;
                (target as f64 * (want as f64 / got).min(0.98)) as u64
            }
            // No model solution at this target: nothing found fits yet.
            (None, _, None) => break,
        };
        if good == Some(model_peak) {
            break;
        }
    }
    if !fits.iter().any(|f| f.1.starts_with("search")) {
        // The model could not reach what the plan needs: add evictions to the closest
        // search decision, most bytes per FLOP first, as few as make the plan fit.
        if let Some((_, mask)) = closest {
            let mut rest: Vec<usize> = m
                .graph
                .candidates()
                .into_iter()
                .filter(|&c| !mask[c])
                .collect();
            rest.sort_by(|&a, &b| {
                let r = |c: usize| m.graph.mem[c] as f64 / (m.graph.cost[c] as f64 + 1.0);
                r(b).total_cmp(&r(a)).then(a.cmp(&b))
            });
            let with = |k: usize| {
                let mut mk = mask.clone();
                for &c in &rest[..k] {
                    mk[c] = true;
                }
                m.evicted(&mk)
            };
            // Bisection for the fewest: `lo` does not fit, `hi` does.
            let mut found: Option<Measured> = None;
            let all = measure(g, &with(rest.len()), &o.compile)?;
            tries += 1;
            if all.arena <= o.budget {
                found = Some(all);
                let (mut lo, mut hi) = (0usize, rest.len());
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    let r = measure(g, &with(mid), &o.compile)?;
                    tries += 1;
                    if r.arena <= o.budget {
                        hi = mid;
                        found = Some(r);
                    } else {
                        lo = mid;
                    }
                }
            }
            if let Some(r) = found {
                let k = r.evict.len();
                consider(r, format!("search, extended to {k} values"), &mut fits);
            }
        }
    }
    if fits.is_empty() {
        // The floor: recompute every candidate.
        let all: BTreeSet<NodeId> = m
            .graph
            .candidates()
            .into_iter()
            .map(|i| m.nodes[i])
            .collect();
        let r = measure(g, &all, &o.compile)?;
        tries += 1;
        consider(r, "every candidate recomputed".into(), &mut fits);
    }
    let best = fits
        .into_iter()
        .min_by_key(|(r, how)| (r.added_flops, r.arena, how.clone()));
    match best {
        Some((r, how)) => {
            let (r, how, n) = refine(g, &m, r, how, o)?;
            Ok(done(r, &how, tries + n))
        }
        None => Err(RematError::Infeasible {
            budget: o.budget,
            smallest: smallest.0,
            how: smallest.1,
            persistent,
        }),
    }
}

/// Keeps again the costliest recomputations of a fitting decision while the real plan
/// still fits: bisection on how many of them, most FLOPs first, to keep. Returns the
/// decision and the plans compiled.
fn refine(
    g: &Graph,
    m: &Model,
    fit: Measured,
    how: String,
    o: &AutoOptions,
) -> Result<(Measured, String, usize), BuildError> {
    let mut order: Vec<NodeId> = fit
        .evict
        .iter()
        .copied()
        .filter(|&n| flops(g, n) > 0)
        .collect();
    order.sort_by_key(|&n| (std::cmp::Reverse(flops(g, n)), n));
    let all = fit.evict.clone();
    let without = |k: usize| -> BTreeSet<NodeId> {
        let mut keep: BTreeSet<NodeId> = BTreeSet::new();
        for &n in &order[..k] {
            keep.extend(m.evicted(&m.mask(&BTreeSet::from([n]))));
        }
        all.difference(&keep).copied().collect()
    };
    let (mut lo, mut hi) = (0usize, order.len() + 1);
    let mut best = fit;
    let mut kept = 0;
    let mut tries = 0;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let r = measure(g, &without(mid), &o.compile)?;
        tries += 1;
        if r.arena <= o.budget {
            lo = mid;
            if r.added_flops < best.added_flops {
                best = r;
                kept = mid;
            }
        } else {
            hi = mid;
        }
    }
    let how = if kept > 0 {
        format!("{how}, {kept} kept again")
    } else {
        how
    };
    Ok((best, how, tries))
}

/// The cheapest model eviction under `target`: chain DP, greedy and the `seeds` that meet it
/// as starts, then branch and bound within `limit`.
fn solve_model(
    g: &RematGraph,
    target: u64,
    limit: Duration,
    seeds: &[Vec<bool>],
) -> Option<Solution> {
    let work = super::Work::of(limit);
    let k = g.candidates().len();
    // The DP simulates every pair of candidates: only for modest counts.
    let mut dp_phase = work.until(1.0 / 3.0);
    let dp = if k <= 160 {
        super::chain_dp_until(g, target, &mut dp_phase)
    } else {
        None
    };
    let mut greedy_phase = work.after(dp_phase).until(0.5);
    let greedy = super::greedy_batched(g, target, &mut greedy_phase, (k / 48).max(1));
    let warm = match (dp, greedy) {
        (Some(a), Some(b)) => Some(if b.eval.added_cost < a.eval.added_cost {
            b
        } else {
            a
        }),
        (a, b) => a.or(b),
    };
    let mut warm = warm;
    for seed in seeds {
        let e = super::simulate(g, seed);
        if e.peak <= target
            && warm
                .as_ref()
                .is_none_or(|w| e.added_cost < w.eval.added_cost)
        {
            warm = Some(Solution {
                evict: seed.clone(),
                eval: e,
                method: "baseline",
                optimal: false,
            });
        }
    }
    let bb = super::solve_from(g, target, work.after(greedy_phase), warm.clone());
    bb.best.or(warm)
}

/// The `remat` stage ([`crate::pipeline`]): applies the options to a scheduled step and
/// returns the step to compile and, with `auto`, the decision. Without `auto`, a budget is
/// only checked.
pub fn decide(
    g: &Graph,
    o: &crate::pipeline::RematOptions,
    compile: CompileOptions,
) -> Result<(Graph, Option<Decision>), String> {
    if o.mode == Mode::Auto && o.budget.is_none() {
        return Err("`--remat auto` needs a budget: add `--mem-budget SIZE`".into());
    }
    let Some(budget) = o.budget else {
        return Ok((g.clone(), None));
    };
    if o.mode != Mode::Auto {
        let m = measure(g, &BTreeSet::new(), &compile).map_err(|e| e.to_string())?;
        if m.arena > budget {
            return Err(format!(
                "the arena is {}, over --mem-budget {}; `--remat auto` recomputes activations to fit",
                human(m.arena),
                human(budget)
            ));
        }
        return Ok((g.clone(), None));
    }
    let opts = AutoOptions {
        budget,
        compile,
        time_limit: o.time_limit.max(Duration::from_millis(1)),
        rounds: 6,
    };
    let d = auto(g, &opts).map_err(|e| e.to_string())?;
    Ok((d.chosen.graph.clone(), Some(d)))
}
