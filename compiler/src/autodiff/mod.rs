//! Reverse-mode automatic differentiation on the graph IR.
//!
//! [`expand`] rewrites a lowered graph so that it no longer contains `grad` nodes or a
//! pending `train`:
//! - every `grad(y, x)` becomes the gradient node of `x` in one backward pass per distinct
//!   `y` (several `grad`s of one `y` share it);
//! - `train OPT minimize LOSS` appends the backward pass of `LOSS` with respect to every
//!   float param, then the optimizer's update nodes (see [`optim`]), recorded as
//!   `Graph::updates`.
//!
//! A softmax or log-softmax written as the prelude writes it (`exp(x - max(x))` normalized)
//! is differentiated as PyTorch does: no gradient reaches the stabilizing row maximum (it is
//! exactly zero), and a softmax's gradient is `p * (g - sum(g * p))` from its result `p`.
//!
//! Backward nodes are appended after the forward nodes, so the node order of the result is
//! forward program order, then the backward pass, then the optimizer: the order eager
//! execution follows. Values made inside a `checkpoint { }` block are not read by the
//! backward pass: it reads clones recomputed from the block's inputs, made right before their
//! first backward use (a block's results read outside the block are kept, as PyTorch keeps a
//! checkpointed function's outputs).

mod builder;
pub mod optim;
mod rules;
pub mod scale;
pub mod stacks;

use crate::ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, TypeError, UnaryOp};
use builder::Builder;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tcc_grammar::diag::Diagnostic;

/// Differentiation state of one backward pass.
pub(crate) struct Ad<'g> {
    pub b: Builder<'g>,
    /// Recomputed clones of checkpointed forward values.
    clones: BTreeMap<NodeId, NodeId>,
    /// Checkpointed values that are nevertheless kept (read outside their region).
    kept: BTreeSet<NodeId>,
    /// Gradient pieces of sliced operands: `(axis, [start, end), piece)` per operand, summed
    /// into the operand's gradient when it is reached.
    pieces: BTreeMap<NodeId, Vec<Piece>>,
}

/// A gradient piece: `(axis, [start, end), gradient of that slice)`.
type Piece = (usize, (usize, usize), NodeId);

impl Ad<'_> {
    /// Records the gradient of a slice of `x` along one axis.
    pub fn add_piece(&mut self, x: NodeId, axis: usize, range: (usize, usize), g: NodeId) {
        self.pieces.entry(x).or_default().push((axis, range, g));
    }

    /// The pieces of `x`'s gradient as one dense tensor: one concat when the pieces lie
    /// along one axis without overlapping (zeros fill the gaps), else padded and summed.
    fn assemble(&mut self, x: NodeId) -> Result<Option<NodeId>, TypeError> {
        let Some(mut ps) = self.pieces.remove(&x) else {
            return Ok(None);
        };
        let full = self.b.ty(x);
        ps.sort_by_key(|p| (p.0, p.1));
        let axis = ps[0].0;
        let disjoint =
            ps.iter().all(|p| p.0 == axis) && ps.windows(2).all(|w| w[0].1 .1 <= w[1].1 .0);
        if disjoint {
            let mut parts = Vec::new();
            let mut cursor = 0;
            for &(_, (s, e), g) in &ps {
                if s > cursor {
                    let mut dims = full.dims().to_vec();
                    dims[axis] = s - cursor;
                    parts.push(
                        self.b
                            .full(0.0, crate::ir::TensorType::new(full.dtype, dims))?,
                    );
                }
                parts.push(g);
                cursor = e;
            }
            let d = full.dims()[axis];
            if cursor < d {
                let mut dims = full.dims().to_vec();
                dims[axis] = d - cursor;
                parts.push(
                    self.b
                        .full(0.0, crate::ir::TensorType::new(full.dtype, dims))?,
                );
            }
            return Ok(Some(if parts.len() == 1 {
                parts[0]
            } else {
                self.b.add(Op::Concat { axis }, parts)?
            }));
        }
        let mut acc: Option<NodeId> = None;
        for (axis, range, g) in ps {
            let mut ranges: Vec<(usize, usize)> = full.dims().iter().map(|&d| (0, d)).collect();
            ranges[axis] = range;
            let dense = rules::pad(self, g, &ranges, &full.shape)?;
            acc = Some(match acc {
                Some(a) => self.b.add2(a, dense)?,
                None => dense,
            });
        }
        Ok(acc)
    }

    /// Folds `x`'s pending pieces into its adjoint.
    fn finalize(&mut self, adj: &mut BTreeMap<NodeId, NodeId>, x: NodeId) -> Result<(), TypeError> {
        if let Some(d) = self.assemble(x)? {
            let v = match adj.get(&x) {
                Some(&prev) => self.b.add2(prev, d)?,
                None => d,
            };
            adj.insert(x, v);
        }
        Ok(())
    }

    /// The forward value to read in the backward pass: the value itself, or its recomputed
    /// clone when it was made inside a checkpoint region.
    pub fn fwd(&mut self, id: NodeId) -> Result<NodeId, TypeError> {
        let node = self.b.g.node(id);
        if node.checkpoint.is_none() || self.kept.contains(&id) {
            return Ok(id);
        }
        if let Some(&c) = self.clones.get(&id) {
            return Ok(c);
        }
        let (op, inputs, span) = (node.op.clone(), node.inputs.clone(), node.span);
        let mut new_inputs = Vec::with_capacity(inputs.len());
        for i in inputs {
            new_inputs.push(self.fwd(i)?);
        }
        let saved = self.b.span;
        self.b.span = span;
        let c = self.b.add(op, new_inputs);
        self.b.span = saved;
        let c = c?;
        self.clones.insert(id, c);
        Ok(c)
    }
}

fn internal(e: TypeError, g: &Graph, at: NodeId) -> Diagnostic {
    let span = g.get(at).map(|n| n.span).unwrap_or_default();
    if e.code == "E0504" {
        return Diagnostic::error(e.code, e.message).with_primary(span, e.detail);
    }
    Diagnostic::error(
        "E0002",
        format!("internal compiler error in autodiff: {}", e.message),
    )
    .with_primary(span, e.detail)
}

/// Nodes that `y` depends on (including `y`).
fn ancestors(g: &Graph, y: NodeId) -> BTreeSet<NodeId> {
    let mut seen = BTreeSet::new();
    let mut q = VecDeque::from([y]);
    while let Some(n) = q.pop_front() {
        if seen.insert(n) {
            q.extend(g.node(n).inputs.iter().copied());
        }
    }
    seen
}

/// Nodes that depend on any of `xs` (including them).
fn descendants(g: &Graph, xs: &[NodeId]) -> BTreeSet<NodeId> {
    let mut seen = BTreeSet::new();
    let mut q: VecDeque<NodeId> = xs.iter().copied().collect();
    while let Some(n) = q.pop_front() {
        if seen.insert(n) {
            q.extend(g.users(n));
        }
    }
    seen
}

/// Softmaxes and log-softmaxes as the prelude writes them, which the backward pass treats as
/// PyTorch does.
#[derive(Default)]
struct Softmaxes {
    /// Nodes no gradient is propagated to: the row maxima subtracted for stability, whose
    /// gradient is exactly zero (both results are unchanged when `s` shifts by a constant
    /// along the axes), and a softmax's `exp(s)` and row sum (its gradient goes to `s`
    /// directly, see `softmax`).
    skip: BTreeSet<NodeId>,
    /// Each softmax result `p = e / S` → `(s, axes)`: the gradient of `s` is
    /// `p * (g - sum(g * p, axes))`, which reads `p` and `g` only (the general rule read
    /// `e`, `S`, `p` and `g`, and kept `e` alive from the forward pass to the backward).
    softmax: BTreeMap<NodeId, (NodeId, Vec<usize>)>,
    /// Softmax results read only through a matmul `o = p @ v` → `o`
    /// ([`read_through_matmul`]).
    through: BTreeMap<NodeId, NodeId>,
}

/// Finds the softmaxes and log-softmaxes of [`Softmaxes`]: `m = max(x, axes, keepdim: true)`
/// read only by `s = x - m`, where `s` is read only as `e = exp(s)` with `e` read only by
/// `S = sum(e, axes)` and `e / S` (softmax), or as `exp(s)` summed into `S` and
/// `s - log(S)` (log-softmax). The shortcuts leave out the `x == m` mask and two row sums
/// per softmax. Values on the model's interface, differentiated (`targets`) or read by
/// anything else keep the general rule.
fn softmaxes(g: &Graph, y: NodeId, targets: &[NodeId]) -> Softmaxes {
    let visible =
        |n: NodeId| n == y || targets.contains(&n) || g.outputs.iter().any(|(_, o)| *o == n);
    let only = |n: NodeId, ok: &dyn Fn(NodeId) -> bool| {
        let us = g.users(n);
        !visible(n) && !us.is_empty() && us.into_iter().all(ok)
    };
    let op = |n: NodeId| &g.node(n).op;
    let ins = |n: NodeId| g.node(n).inputs.as_slice();
    let is_sum_over = |n: NodeId, x: NodeId, axes: &[usize]| {
        matches!(op(n), Op::Reduce { op: ReduceOp::Sum, axes: a, keepdim: true } if a == axes)
            && ins(n) == [x]
    };
    let mut out = Softmaxes::default();
    for m in g.node_ids() {
        let Op::Reduce {
            op: ReduceOp::Max,
            axes,
            keepdim: true,
        } = op(m)
        else {
            continue;
        };
        let x = ins(m)[0];
        let users = g.users(m);
        let [s] = users[..] else { continue };
        if visible(m) || !matches!(op(s), Op::Binary(BinaryOp::Sub)) || ins(s) != [x, m] {
            continue;
        }
        let exp_of_s = |e: NodeId| matches!(op(e), Op::Unary(UnaryOp::Exp)) && ins(e) == [s];
        // Softmax: e = exp(s) read by S = sum(e) and e / S only; S read by e / S only.
        if only(s, &exp_of_s) {
            let e = g.users(s)[0];
            let div_by = |d: NodeId, sum: NodeId| {
                matches!(op(d), Op::Binary(BinaryOp::Div)) && ins(d) == [e, sum]
            };
            let sums: Vec<NodeId> = g
                .users(e)
                .into_iter()
                .filter(|&n| is_sum_over(n, e, axes))
                .collect();
            let softmax = !sums.is_empty()
                && only(e, &|n| {
                    sums.contains(&n) || sums.iter().any(|&q| div_by(n, q))
                })
                && sums.iter().all(|&q| only(q, &|d| div_by(d, q)));
            if softmax {
                out.skip.extend([m, e]);
                for q in sums {
                    out.skip.insert(q);
                    for d in g.users(q) {
                        out.softmax.insert(d, (s, axes.clone()));
                        if let Some(o) = read_through_matmul(g, d, axes).filter(|_| !visible(d)) {
                            out.through.insert(d, o);
                        }
                    }
                }
                continue;
            }
        }
        // Log-softmax: s read by exp(s) and s - log(sum(exp(s))) only.
        let log_softmax = || {
            let us = g.users(s);
            let exps: Vec<NodeId> = us.iter().copied().filter(|&e| exp_of_s(e)).collect();
            let [e] = exps[..] else { return false };
            let sums = g.users(e);
            let [q] = sums[..] else { return false };
            let logs = g.users(q);
            let [l] = logs[..] else { return false };
            let minus_l =
                |o: NodeId| matches!(op(o), Op::Binary(BinaryOp::Sub)) && ins(o) == [s, l];
            is_sum_over(q, e, axes)
                && !visible(e)
                && !visible(q)
                && matches!(op(l), Op::Unary(UnaryOp::Log))
                && ins(l) == [q]
                && only(l, &minus_l)
                && !visible(s)
                && us.iter().all(|&o| o == e || minus_l(o))
        };
        if log_softmax() {
            out.skip.insert(m);
        }
    }
    out
}

/// The gradient of a softmax's `s` given the gradient `g` of its result `p`:
/// `p * (g - sum(g * p, axes, keepdim: true))`.
fn softmax_grad(ad: &mut Ad, p: NodeId, g: NodeId, axes: &[usize]) -> Result<NodeId, TypeError> {
    let p = ad.fwd(p)?;
    let gp = ad.b.mul(g, p)?;
    let r = ad.b.sum(gp, axes.to_vec(), true)?;
    let d = ad.b.sub(g, r)?;
    ad.b.mul(p, d)
}

/// Whether softmax result `p` (along `axes`) is read only as the left operand of `o = p @ v`
/// (attention), along the axis that product contracts, with `o` shaped like `p` but for the
/// last axis: then `o`. For such a softmax `sum(g * p, axes) = sum(go * o, last axis)`,
/// where `g = go @ transpose(v)` is the gradient of `p` and `go` that of `o`
/// (`Σ_j p_ij Σ_e go_ie v_je = Σ_e go_ie o_ie`, as flash attention's backward computes it).
/// Checked on the forward graph, before the backward pass adds readers of `p`.
fn read_through_matmul(g: &Graph, p: NodeId, axes: &[usize]) -> Option<NodeId> {
    let [o] = g.users(p)[..] else { return None };
    let node = g.node(o);
    let rank = g.ty(p).rank();
    let rows = |n: NodeId| {
        g.ty(n)
            .dims()
            .get(..rank.checked_sub(1)?)
            .map(<[usize]>::to_vec)
    };
    let matmul = matches!(node.op, Op::MatMul) && node.inputs[0] == p && node.inputs[1] != p;
    let along = rank >= 2 && axes == [rank - 1] && g.ty(o).rank() == rank;
    (matmul && along && rows(o).is_some() && rows(o) == rows(p)).then_some(o)
}

/// [`softmax_grad`] for a softmax read through a matmul ([`read_through_matmul`]): `p * (g -
/// sum(go * o, last axis, keepdim: true))`. The row sum then reads two `[.., T, E]` tensors
/// instead of `g * p` over `[.., T, S]`, and `g` is read once, by an elementwise chain that
/// fuses into the epilogue of the matmul computing it (attention's `dS` without
/// materialising `dP`).
fn softmax_grad_through(
    ad: &mut Ad,
    p: NodeId,
    g: NodeId,
    (o, go): (NodeId, NodeId),
) -> Result<NodeId, TypeError> {
    let p = ad.fwd(p)?;
    let o = ad.fwd(o)?;
    let last = ad.b.g.ty(o).rank() - 1;
    let prod = ad.b.mul(go, o)?;
    let r = ad.b.sum(prod, vec![last], true)?;
    let d = ad.b.sub(g, r)?;
    ad.b.mul(p, d)
}

/// One backward pass: the gradient of scalar `y` with respect to each of `targets` that `y`
/// depends on.
pub fn backward(
    g: &mut Graph,
    y: NodeId,
    targets: &[NodeId],
) -> Result<BTreeMap<NodeId, NodeId>, Diagnostic> {
    backward_from(g, y, targets, None)
}

/// [`backward`] starting from `seed` (the gradient of `y` with respect to itself, `1` when
/// `None`; the loss scale under mixed precision).
fn backward_from(
    g: &mut Graph,
    y: NodeId,
    targets: &[NodeId],
    seed: Option<NodeId>,
) -> Result<BTreeMap<NodeId, NodeId>, Diagnostic> {
    let anc = ancestors(g, y);
    let desc = descendants(g, targets);
    let special = softmaxes(g, y, targets);
    let relevant: BTreeSet<NodeId> = anc
        .intersection(&desc)
        .copied()
        .filter(|n| !special.skip.contains(n))
        .collect();
    let order = g
        .topo_order()
        .ok_or_else(|| Diagnostic::error("E0002", "internal compiler error: cyclic graph"))?;
    // Checkpointed values read outside their own region are kept.
    let mut kept = BTreeSet::new();
    for id in g.node_ids() {
        let region = g.node(id).checkpoint;
        if region.is_some() {
            let outside = g.users(id).iter().any(|&u| g.node(u).checkpoint != region)
                || g.outputs.iter().any(|(_, o)| *o == id)
                || id == y;
            if outside {
                kept.insert(id);
            }
        }
    }
    let span = g.node(y).span;
    let ydt = g.ty(y).clone();
    let mut ad = Ad {
        b: Builder::new(g, span),
        clones: BTreeMap::new(),
        kept,
        pieces: BTreeMap::new(),
    };
    let mut adj: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let seed = match seed {
        Some(s) => s,
        None => ad.b.full(1.0, ydt).map_err(|e| internal(e, ad.b.g, y))?,
    };
    adj.insert(y, seed);
    for &n in order.iter().rev() {
        if !relevant.contains(&n) {
            continue;
        }
        ad.b.span = ad.b.g.node(n).span;
        ad.finalize(&mut adj, n)
            .map_err(|e| internal(e, ad.b.g, n))?;
        let Some(&gn) = adj.get(&n) else {
            continue;
        };
        if let Some((sn, axes)) = special.softmax.get(&n) {
            let through = special
                .through
                .get(&n)
                .and_then(|&o| Some((o, *adj.get(&o)?)));
            let ds = match through {
                Some(og) => softmax_grad_through(&mut ad, n, gn, og),
                None => softmax_grad(&mut ad, n, gn, axes),
            }
            .map_err(|e| internal(e, ad.b.g, n))?;
            let acc = match adj.get(sn) {
                Some(&prev) => ad.b.add2(prev, ds).map_err(|e| internal(e, ad.b.g, n))?,
                None => ds,
            };
            adj.insert(*sn, acc);
            continue;
        }
        let inputs = ad.b.g.node(n).inputs.clone();
        if inputs.is_empty() {
            continue;
        }
        let wants: Vec<bool> = inputs
            .iter()
            .map(|i| relevant.contains(i) && ad.b.g.ty(*i).dtype.is_float())
            .collect();
        if !wants.iter().any(|&w| w) {
            continue;
        }
        ad.b.span = ad.b.g.node(n).span;
        let grads = rules::vjp(&mut ad, n, gn, &wants).map_err(|e| internal(e, ad.b.g, n))?;
        for (inp, gi) in inputs.iter().zip(grads) {
            let Some(gi) = gi else { continue };
            let acc = match adj.get(inp) {
                Some(&prev) => ad.b.add2(prev, gi).map_err(|e| internal(e, ad.b.g, n))?,
                None => gi,
            };
            adj.insert(*inp, acc);
        }
    }
    for &t in targets {
        ad.finalize(&mut adj, t)
            .map_err(|e| internal(e, ad.b.g, t))?;
    }
    Ok(targets
        .iter()
        .filter_map(|t| adj.get(t).map(|&g| (*t, g)))
        .collect())
}

/// Expands `grad` nodes and `train` (see the module doc). The graph is compacted afterwards
/// so node ids follow execution order.
pub fn expand(g: &mut Graph) -> Result<(), Vec<Diagnostic>> {
    expand_scaled(g, None)
}

/// [`expand_scaled`] for a step of `ranks` data-parallel ranks (`--gpus N`), each running
/// it on its own slice of the batch: the loss's gradient is seeded with `1/ranks` (each
/// rank's loss is the mean over its slice, so the ranks' gradients then sum to the
/// gradient of the mean over the whole batch: the mean folds into the seed and costs no
/// kernel) and every gradient `train` applies is summed over the ranks by an `all_reduce`
/// before anything reads it (loss-scale checks included, so every rank takes the same
/// decision). `ranks` of 1 or less is [`expand_scaled`].
///
/// With `finite_check` and no loss scaling, the step also gets an output summing the
/// magnitudes of the params its updates write, which the runtime checks is finite after
/// every step ([`tcc_runtime::artifact::CheckKind::FiniteUpdates`]): one more read of each
/// param. Loss scaling has its own finite-check, which skips the step's updates instead.
///
/// `weigh`: how the stages after this one build the step, when known (the pipeline's
/// options), so that a stacked param can be split alone where the plans they make say it
/// lowers the arena ([`stacks::held_at_peak`]).
pub fn expand_data_parallel(
    g: &mut Graph,
    loss_scale: Option<scale::LossScale>,
    ranks: usize,
    zero: bool,
    finite_check: bool,
    weigh: Option<&stacks::Weigh>,
) -> Result<(), Vec<Diagnostic>> {
    if ranks <= 1 {
        return expand_with(g, loss_scale, 1, false, finite_check, weigh);
    }
    if g.train.is_none() {
        return Err(vec![Diagnostic::error(
            "E0530",
            "`--gpus` needs a training step: data parallelism splits a `train` step's batch \
             over the GPUs and sums the gradients, and this program has no `train` statement",
        )]);
    }
    g.ranks = Some(ranks);
    expand_with(g, loss_scale, ranks, zero, finite_check, weigh)
}

/// [`expand`], with dynamic loss scaling of `train` when `loss_scale` is given
/// ([`scale`]).
pub fn expand_scaled(
    g: &mut Graph,
    loss_scale: Option<scale::LossScale>,
) -> Result<(), Vec<Diagnostic>> {
    expand_with(g, loss_scale, 1, false, false, None)
}

/// The step as the pipeline expands it by default (no loss scaling, the finite check of
/// the updated params), with the stacked params `which` names split a layer a param and
/// the others whole in place of the choice it makes: each choice it weighs, for comparing
/// them.
pub fn expand_with_stacks(g: &mut Graph, which: stacks::Which) -> Result<(), Vec<Diagnostic>> {
    expand_split(g, None, 1, false, true, which)
}

/// The step expanded with its stacked params split a layer a param ([`stacks`]) where
/// that lowers the scheduled step's peak, and whole otherwise (one update a stack runs
/// fewer, larger kernels): all of them where that lowers it, else, with `weigh`, those of
/// which several layers' gradients are live at the peak ([`stacks::held_at_peak`]) where
/// the plans of the stages after this one say that lowers the arena.
fn expand_with(
    g: &mut Graph,
    loss_scale: Option<scale::LossScale>,
    ranks: usize,
    zero: bool,
    finite_check: bool,
    weigh: Option<&stacks::Weigh>,
) -> Result<(), Vec<Diagnostic>> {
    use stacks::Which;
    let whole = g.clone();
    expand_split(g, loss_scale, ranks, zero, finite_check, Which::All)?;
    if g.stacks.is_empty() {
        return Ok(());
    }
    let mut unsplit = whole.clone();
    expand_split(
        &mut unsplit,
        loss_scale,
        ranks,
        zero,
        finite_check,
        Which::None,
    )?;
    if stacks::complete(g) && stacks::lowers_peak(g, &unsplit)? {
        return Ok(());
    }
    // Split all, the peak stays where it was: then the stacks of which several layers'
    // gradients wait at the whole step's peak (as the `remat` stage's free recomputation
    // leaves it), split alone where the plans say so.
    let Some(weigh) = weigh else {
        *g = unsplit;
        return Ok(());
    };
    let splittable: BTreeSet<String> = g
        .stacks
        .iter()
        .filter(|s| {
            s.pieces
                .first()
                .is_some_and(|&p| matches!(g.node(p).op, Op::Param { .. }))
        })
        .map(|s| s.name.clone())
        .collect();
    // Under loss scaling every update waits for the check of all the gradients: a split
    // frees nothing early.
    if loss_scale.is_some() {
        *g = unsplit;
        return Ok(());
    }
    let held = stacks::held_at_peak(&unsplit, weigh.free)?;
    let held: BTreeSet<String> = held.intersection(&splittable).cloned().collect();
    if !held.is_empty() {
        let mut some = whole;
        expand_split(
            &mut some,
            loss_scale,
            ranks,
            zero,
            finite_check,
            Which::Only(&held),
        )?;
        if !some.stacks.is_empty()
            && stacks::complete(&some)
            // A step that cannot be planned so is not taken (the whole one is built and
            // reports its own errors).
            && matches!(
                (weigh.arena(&some), weigh.arena(&unsplit)),
                (Ok(a), Ok(b)) if stacks::drops(a, b)
            )
        {
            *g = some;
            return Ok(());
        }
    }
    *g = unsplit;
    Ok(())
}

fn expand_split(
    g: &mut Graph,
    loss_scale: Option<scale::LossScale>,
    ranks: usize,
    zero: bool,
    finite_check: bool,
    split: stacks::Which,
) -> Result<(), Vec<Diagnostic>> {
    let grad_nodes: Vec<NodeId> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::Grad))
        .collect();
    let mut diags = Vec::new();
    // Nested grads (a grad whose y depends on another grad) are second order.
    for &gn in &grad_nodes {
        let y = g.node(gn).inputs[0];
        let nested = ancestors(g, y)
            .iter()
            .any(|&a| a != gn && matches!(g.node(a).op, Op::Grad));
        if nested {
            diags.push(
                Diagnostic::error("E0504", "second-order gradients are not supported")
                    .with_primary(
                        g.node(gn).span,
                        "this `grad` differentiates a value computed from another `grad`",
                    ),
            );
        }
    }
    if !diags.is_empty() {
        return Err(diags);
    }
    let mut by_y: BTreeMap<NodeId, Vec<(NodeId, NodeId)>> = BTreeMap::new();
    for &gn in &grad_nodes {
        let n = g.node(gn);
        by_y.entry(n.inputs[0]).or_default().push((gn, n.inputs[1]));
    }
    for (y, pairs) in by_y {
        let xs: Vec<NodeId> = pairs.iter().map(|p| p.1).collect();
        let grads = backward(g, y, &xs).map_err(|d| vec![d])?;
        for (gn, x) in pairs {
            let replacement = match grads.get(&x) {
                Some(&r) => r,
                None => {
                    let (span, ty) = (g.node(gn).span, g.ty(x).clone());
                    let mut b = Builder::new(g, span);
                    b.full(0.0, ty).map_err(|e| vec![internal(e, g, gn)])?
                }
            };
            g.replace_all_uses(gn, replacement);
        }
    }
    for gn in grad_nodes {
        g.remove(gn);
    }
    if let Some(train) = g.train.clone() {
        if ranks <= 1 {
            stacks::split(g, split).map_err(|e| vec![internal(e, g, train.loss)])?;
        }
        let train = g.train.clone().unwrap_or(train);
        let params: Vec<NodeId> = g
            .params
            .iter()
            .copied()
            .filter(|&p| g.ty(p).dtype.is_float())
            .collect();
        let at = |e, g: &Graph| vec![internal(e, g, train.loss)];
        match loss_scale {
            None if ranks <= 1 => {
                let grads = backward(g, train.loss, &params).map_err(|d| vec![d])?;
                optim::lower(g, &train, &params, &grads).map_err(|e| at(e, g))?;
            }
            None => {
                let ty = g.ty(train.loss).clone();
                let seed = Builder::new(g, train.span)
                    .full(1.0 / ranks as f64, ty)
                    .map_err(|e| at(e, g))?;
                let grads =
                    backward_from(g, train.loss, &params, Some(seed)).map_err(|d| vec![d])?;
                if zero {
                    let shards =
                        reduce_scatter(g, grads, ranks, train.span).map_err(|e| at(e, g))?;
                    optim::lower_sharded(g, &train, &params, &shards, Some(ranks))
                        .map_err(|e| at(e, g))?;
                } else {
                    let grads = all_reduce(g, grads, train.span).map_err(|e| at(e, g))?;
                    optim::lower(g, &train, &params, &grads).map_err(|e| at(e, g))?;
                }
            }
            Some(settings) => {
                let scaler = scale::begin(g, settings, train.span).map_err(|e| at(e, g))?;
                let ty = g.ty(train.loss).clone();
                let mut seed = scaler.seed(g, &ty, train.span).map_err(|e| at(e, g))?;
                if ranks > 1 {
                    seed = Builder::new(g, train.span)
                        .scale(seed, 1.0 / ranks as f64)
                        .map_err(|e| at(e, g))?;
                }
                let grads =
                    backward_from(g, train.loss, &params, Some(seed)).map_err(|d| vec![d])?;
                let sharded = zero && ranks > 1;
                let grads = if sharded {
                    reduce_scatter(g, grads, ranks, train.span).map_err(|e| at(e, g))?
                } else if ranks > 1 {
                    all_reduce(g, grads, train.span).map_err(|e| at(e, g))?
                } else {
                    grads
                };
                let (grads, finite) = scaler
                    .unscale(g, &grads, train.span, sharded)
                    .map_err(|e| at(e, g))?;
                optim::lower_sharded(g, &train, &params, &grads, sharded.then_some(ranks))
                    .map_err(|e| at(e, g))?;
                scaler.finish(g, finite, train.span).map_err(|e| at(e, g))?;
            }
        }
        if finite_check && loss_scale.is_none() {
            check_updates(g, train.span).map_err(|e| at(e, g))?;
        }
        stacks::group_states(g);
    }
    *g = g.compacted();
    Ok(())
}

/// What a finite check reports ([`tcc_runtime::artifact::Check::what`]).
pub const UPDATES_CHECKED: &str = "the params `train` updates";

/// Adds the finite check: an output `tcc.check.N` holding the sum of the magnitudes of
/// the values the updates write into the params, and its [`crate::ir::StepCheck`]. Every
/// optimizer carries a NaN or infinite gradient into its param, so the sum is not finite
/// when a gradient was not (or an update left f32's range, or the param was not finite
/// before). It reads each new param value once, after the update kernel has stored it,
/// which keeps a gradient's update in the kernel that computes the gradient (reading the
/// gradients themselves would store each one for a second reader). Under ZeRO-1 every
/// rank reads the gathered params, so every rank's sum is the same. (Each rank summing
/// the shard it updated, before the gather, took gpt's step on 2 H100s from 64.3 to
/// 72.1 ms; reading the gathered params costs 0.1 ms.)
fn check_updates(g: &mut Graph, span: tcc_grammar::span::Span) -> Result<(), TypeError> {
    let values: Vec<NodeId> = g
        .updates
        .iter()
        .filter(|(t, _)| g.params.contains(t))
        .map(|&(_, v)| v)
        .collect();
    let mut b = Builder::new(g, span);
    let mut total = None;
    for v in values {
        scale::add_magnitude(&mut b, &mut total, v)?;
    }
    let Some(total) = total else {
        return Ok(());
    };
    let output = format!("{}{}", tcc_runtime::artifact::CHECK_PREFIX, g.checks.len());
    g.outputs.push((output.clone(), total));
    g.checks.push(crate::ir::StepCheck {
        output,
        what: UPDATES_CHECKED.to_string(),
        bound: 0,
        kind: tcc_runtime::artifact::CheckKind::FiniteUpdates,
    });
    Ok(())
}

/// This rank's shard of each gradient summed over the ranks of a ZeRO-1 step
/// (`reduce_scatter`), for [`optim::lower_sharded`]. A gradient whose elements do not split
/// evenly is flattened and padded with zeros to `ranks · S` first. Params that share a
/// gradient node share its shard.
fn reduce_scatter(
    g: &mut Graph,
    grads: BTreeMap<NodeId, NodeId>,
    ranks: usize,
    span: tcc_grammar::span::Span,
) -> Result<BTreeMap<NodeId, NodeId>, crate::ir::TypeError> {
    let mut b = Builder::new(g, span);
    let mut done: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (p, d) in grads {
        let r = match done.get(&d) {
            Some(&r) => r,
            None => {
                let ty = b.ty(d);
                let n = ty.shape.numel();
                let padded = n.div_ceil(ranks) * ranks;
                let operand = if padded == n {
                    d
                } else {
                    let flat = b.reshape(d, crate::ir::Shape(vec![n]))?;
                    let zeros =
                        b.full(0.0, crate::ir::TensorType::new(ty.dtype, vec![padded - n]))?;
                    b.add(Op::Concat { axis: 0 }, vec![flat, zeros])?
                };
                let r = b.add(Op::ReduceScatter { ranks }, vec![operand])?;
                done.insert(d, r);
                r
            }
        };
        out.insert(p, r);
    }
    Ok(out)
}

/// Each gradient summed over the ranks of a data-parallel step. Params that share a
/// gradient node (`a + b` passes one gradient to both) share its sum: two reductions of one
/// buffer would add the ranks' values twice.
fn all_reduce(
    g: &mut Graph,
    grads: BTreeMap<NodeId, NodeId>,
    span: tcc_grammar::span::Span,
) -> Result<BTreeMap<NodeId, NodeId>, crate::ir::TypeError> {
    let mut b = Builder::new(g, span);
    let mut summed: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (p, d) in grads {
        let r = match summed.get(&d) {
            Some(&r) => r,
            None => {
                let r = match split_for_reduction(b.g, d) {
                    Some(pieces) => {
                        let mut summed_pieces = Vec::with_capacity(pieces.len());
                        for (piece, stored) in pieces {
                            // The value under a piece's reshapes: a collective's operand
                            // is a buffer of its own.
                            let mut sum = b.add(Op::AllReduce, vec![stored])?;
                            if stored != piece {
                                sum = b.reshape(sum, b.g.ty(piece).shape.clone())?;
                            }
                            summed_pieces.push(sum);
                        }
                        b.add(Op::Concat { axis: 0 }, summed_pieces)?
                    }
                    None => b.add(Op::AllReduce, vec![d])?,
                };
                summed.insert(d, r);
                r
            }
        };
        out.insert(p, r);
    }
    Ok(out)
}

/// The smallest piece of a stacked gradient reduced on its own ([`split_for_reduction`]).
const REDUCED_PIECE_BYTES: usize = 1 << 20;

/// The pieces of a gradient that is a concat along its first axis of pieces of at least
/// [`REDUCED_PIECE_BYTES`] each: a stacked param's (`w: f32[L, ..]` read as `w[l]` in a
/// loop), whose layers' gradients are ready one after another through the backward pass.
/// Summing each piece on its own lets the ranks reduce a layer's gradient while the
/// backward pass goes on below it; the sum of the whole concat could start only after the
/// first layer's gradient, at the end of the backward pass (on gpt, 93 % of the gradient
/// bytes; its step on 4 H100s went from 64.8 to 64.1 ms). A sum is elementwise, so the
/// concat of the pieces' sums is the sum of the concat. Each piece is given with the value
/// stored under its reshapes (views), which its sum reads.
///
/// Not a stack of convolution weights: their gradient kernels store straight into the
/// concat in the param's layout, and summed apart the pieces stay channels-last for the
/// update to read across (the cnn's step on 4 H100s took 43.5 ms split, 42.6 ms not). The
/// size is the f32 gradient's, before `--amp` (a 16-bit piece of 512 KiB is split too).
fn split_for_reduction(g: &Graph, d: NodeId) -> Option<Vec<(NodeId, NodeId)>> {
    let node = g.node(d);
    if !matches!(node.op, Op::Concat { axis: 0 }) || node.inputs.len() < 2 {
        return None;
    }
    let mut pieces = Vec::with_capacity(node.inputs.len());
    for &piece in &node.inputs {
        let mut stored = piece;
        while matches!(g.node(stored).op, Op::Reshape { .. }) {
            stored = g.node(stored).inputs[0];
        }
        if g.ty(piece).size_bytes() < REDUCED_PIECE_BYTES || g.node(stored).op.is_spatial() {
            return None;
        }
        pieces.push((piece, stored));
    }
    Some(pieces)
}
