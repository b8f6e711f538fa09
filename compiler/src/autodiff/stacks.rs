//! Stacked params held as one param a layer, so that each layer's update runs as soon as
//! that layer's gradient is ready.
//!
//! A param declared `w: f32[L, …]` and read only as its layers (`w[l]` in an unrolled
//! loop: gpt's block weights, the cnn's stage weights) has a gradient that is the concat of
//! its layers' gradients, which the backward pass makes one after another. Applied as one
//! update, the first layer's gradient (the last made) holds back the whole update, and every
//! other layer's gradient stays live until then. [`split`] gives the step one param per
//! layer, `w[l]`, in place of `w` and its `select`s, before the backward pass: each layer
//! then has its own gradient and update (`passes/schedule.rs` runs an update as soon as its
//! gradient is complete), and its optimizer state is per layer too ([`group_states`]).
//!
//! The pieces are laid out back to back in the persistent region, where `w` lies (the
//! region follows the order of `Graph::params` and `Graph::states`, and each piece's
//! bytes are a multiple of the alignment), so the artifact, saved params and the
//! interpreter still see `w` whole ([`crate::ir::Stack`]). The update rules are
//! elementwise, so the step computes what the whole update computed.
//!
//! `autodiff::expand_with` splits every stack where that lowers the scheduled peak
//! ([`lowers_peak`]); otherwise those of which several layers' gradients wait at the peak
//! ([`held_at_peak`]), where the fused plans say that lowers the arena ([`Weigh::arena`]):
//! the cnn's last stage, `s4_w`.
//!
//! Left whole: a param read otherwise than through its layers (an output, a whole read), a
//! layer that nothing reads or whose reads do not reach the loss (it would get no update,
//! where the whole param updates it with a zero gradient: weight decay and moments still
//! move it, as in PyTorch), a layer whose bytes are not a multiple of the alignment, and
//! every param of a data-parallel step (whose updates run after its collectives).

use crate::analysis::liveness::Liveness;
use crate::ir::{Graph, NodeId, Op, Stack, TensorType, TypeError};
use std::collections::{BTreeMap, BTreeSet};

/// The layers of `p` that its readers select, by reader, when every reader selects a layer
/// and every layer is selected; `None` otherwise.
fn layer_readers(g: &Graph, p: NodeId) -> Option<Vec<(NodeId, usize)>> {
    let ty = g.ty(p);
    let layers = *ty.dims().first()?;
    if layers < 2 || !ty.dtype.is_float() {
        return None;
    }
    let piece = TensorType::new(ty.dtype, ty.dims()[1..].to_vec());
    if piece.size_bytes() == 0 || !(piece.size_bytes() as u64).is_multiple_of(crate::plan::ALIGN) {
        return None;
    }
    if g.outputs.iter().any(|&(_, o)| o == p) {
        return None;
    }
    let mut readers = Vec::new();
    let mut seen = vec![false; layers];
    for u in g.users(p) {
        match g.node(u).op {
            Op::Select { axis: 0, index } if index < layers => {
                seen[index] = true;
                readers.push((u, index));
            }
            _ => return None,
        }
    }
    seen.iter().all(|&s| s).then_some(readers)
}

/// Which stacked params [`split`] splits.
#[derive(Clone, Copy, Debug)]
pub enum Which<'a> {
    /// None: every stack stays whole.
    None,
    /// Every one that can be.
    All,
    /// Those of these names that can be.
    Only(&'a BTreeSet<String>),
}

/// Splits the stacked params of a training step that `which` names into one param a layer
/// (see the module doc). The graph is renumbered in its own order, each param's pieces
/// where it was.
pub fn split(g: &mut Graph, which: Which) -> Result<(), TypeError> {
    if g.train.is_none() || matches!(which, Which::None) {
        return Ok(());
    }
    let Some(order) = g.topo_order() else {
        return Err(TypeError::new("E0002", "cyclic graph", ""));
    };
    let mut pieces_of: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut removed: BTreeSet<NodeId> = BTreeSet::new();
    for p in g.params.clone() {
        let Some(readers) = layer_readers(g, p) else {
            continue;
        };
        let node = g.node(p).clone();
        let Op::Param { name, ty, init } = node.op else {
            continue;
        };
        if let Which::Only(names) = which {
            if !names.contains(&name) {
                continue;
            }
        }
        let piece_ty = TensorType::new(ty.dtype, ty.dims()[1..].to_vec());
        let mut pieces = Vec::with_capacity(ty.dims()[0]);
        for l in 0..ty.dims()[0] {
            let op = Op::Param {
                name: format!("{name}[{l}]"),
                ty: piece_ty.clone(),
                init,
            };
            pieces.push(g.add(op, vec![], node.span, None)?);
        }
        for (s, l) in readers {
            g.replace_all_uses(s, pieces[l]);
            g.remove(s);
            removed.insert(s);
        }
        g.remove(p);
        removed.insert(p);
        g.stacks.push(Stack {
            name,
            ty,
            pieces: pieces.clone(),
        });
        pieces_of.insert(p, pieces);
    }
    if pieces_of.is_empty() {
        return Ok(());
    }
    let mut new_order = Vec::with_capacity(order.len());
    let mut params = Vec::with_capacity(g.params.len());
    for n in order {
        match pieces_of.get(&n) {
            Some(pieces) => {
                new_order.extend(pieces);
                params.extend(pieces);
            }
            None if removed.contains(&n) => {}
            None => {
                new_order.push(n);
                if matches!(g.node(n).op, Op::Param { .. }) {
                    params.push(n);
                }
            }
        }
    }
    g.params = params;
    *g = g.reordered(&new_order);
    Ok(())
}

/// Gives each optimizer state of a stacked param's layers (`w[l].SUFFIX`, made by
/// [`super::optim`]) its own stack `w.SUFFIX`, and puts its pieces back to back in
/// `Graph::states`, where the first of them was.
pub fn group_states(g: &mut Graph) {
    let name_of = |g: &Graph, n: NodeId| match &g.node(n).op {
        Op::Param { name, .. } | Op::State { name, .. } => Some(name.clone()),
        _ => None,
    };
    let states: BTreeMap<String, NodeId> = g
        .states
        .iter()
        .filter_map(|&n| Some((name_of(g, n)?, n)))
        .collect();
    let mut grouped: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut stacks = Vec::new();
    for s in &g.stacks {
        let Some(first) = s.pieces.first().and_then(|&p| name_of(g, p)) else {
            continue;
        };
        let prefix = format!("{first}.");
        for (state, &n0) in states.range(prefix.clone()..) {
            let Some(suffix) = state.strip_prefix(&prefix) else {
                break;
            };
            let pieces: Option<Vec<NodeId>> = s
                .pieces
                .iter()
                .map(|&p| states.get(&format!("{}.{suffix}", name_of(g, p)?)).copied())
                .collect();
            let Some(pieces) = pieces else { continue };
            if pieces.iter().any(|&p| g.ty(p) != g.ty(n0)) {
                continue;
            }
            let ty = TensorType::new(g.ty(n0).dtype, s.ty.dims().to_vec());
            grouped.insert(n0, pieces.clone());
            stacks.push(Stack {
                name: format!("{}.{suffix}", s.name),
                ty,
                pieces,
            });
        }
    }
    let inside: BTreeSet<NodeId> = grouped.values().flatten().copied().collect();
    let mut order = Vec::with_capacity(g.states.len());
    for &n in &g.states {
        match grouped.get(&n) {
            Some(pieces) => order.extend(pieces),
            None if inside.contains(&n) => {}
            None => order.push(n),
        }
    }
    g.states = order;
    g.stacks.extend(stacks);
}

/// How much lower the peak of a step with its stacks split must be for the split to be kept.
const MIN_PEAK_DROP: f64 = 0.01;

/// Whether the step with its stacks split (`split`) has a peak at least [`MIN_PEAK_DROP`]
/// lower than the step with them whole (`whole`), each as the schedule orders it, with an
/// update's temporaries in its kernel ([`crate::passes::schedule::max_live_fused`]). Split,
/// each layer's gradient is freed as soon as it is applied, which lowers the peak where it
/// lies in the backward pass (small batches: gpt at B = 1, T = 64 holds 207 MiB of
/// gradients there whole, 48 MiB split; the mlp). Where the activations at the turn to the
/// backward pass make the peak (gpt and the cnn at their own sizes), splitting every stack
/// costs update kernels for little (H200, an earlier build: the cnn's step took 24.0 ms
/// whole and 24.8 ms split, for a 2 % smaller arena; gpt under `--amp bf16` 12.6 and
/// 13.0 ms, for the same arena); [`held_at_peak`] then names the stacks worth splitting
/// alone.
pub fn lowers_peak(split: &Graph, whole: &Graph) -> Result<bool, Diagnostics> {
    Ok(drops(peak(split, false)?, peak(whole, false)?))
}

type Diagnostics = Vec<tcc_grammar::diag::Diagnostic>;

/// Whether `peak` is at least [`MIN_PEAK_DROP`] below `before`.
pub fn drops(peak: u64, before: u64) -> bool {
    (peak as f64) < before as f64 * (1.0 - MIN_PEAK_DROP)
}

/// The liveness of the step `g` as the stages after autodiff order it: scheduled, the
/// updates' temporaries in their kernels ([`crate::passes::schedule::liveness_fused`]),
/// and, where `free`, the values free recomputation may rebuild in the backward pass
/// ([`crate::remat::step::free_candidates`]) rebuilt there, as the `remat` stage does
/// unless `--remat none`.
fn scheduled(g: &Graph, free: bool) -> Result<(Graph, Liveness), Diagnostics> {
    let mut s = g.clone();
    crate::passes::schedule::schedule(&mut s)?;
    if free {
        s = crate::remat::step::apply(&s, &crate::remat::step::free_candidates(&s));
    }
    let order = s.topo_order().unwrap_or_else(|| s.node_ids().collect());
    let lv = crate::passes::schedule::liveness_fused(&s, &order);
    Ok((s, lv))
}

/// The peak of the step `g` as [`scheduled`] orders it.
pub fn peak(g: &Graph, free: bool) -> Result<u64, Diagnostics> {
    Ok(scheduled(g, free)?.1.max_live())
}

/// How the stages after autodiff build a step: what a split is weighed by.
#[derive(Clone, Copy, Debug)]
pub struct Weigh {
    /// The target's options, as the stages from `outputs` to `plan` take them.
    pub compile: crate::artifact::CompileOptions,
    /// Free recomputation runs (all but `--remat none`).
    pub free: bool,
}

impl Weigh {
    /// The arena of the step `g` as the stages after autodiff plan it: scheduled, with the
    /// values free recomputation may rebuild rebuilt in the backward pass
    /// ([`crate::remat::step::with_free_candidates`]; the `remat` stage then keeps back the
    /// costly ones, and on CUDA recomputes products), fused and planned for the target.
    pub fn arena(&self, g: &Graph) -> Result<u64, Diagnostics> {
        let internal = |e: crate::artifact::BuildError| {
            vec![tcc_grammar::diag::Diagnostic::error(
                "E0002",
                format!("internal compiler error: weighing a split of stacked params: {e}"),
            )]
        };
        let mut s = g.clone();
        crate::passes::schedule::schedule(&mut s)?;
        if self.free {
            s = crate::remat::step::with_free_candidates(&s);
        }
        let planned = crate::artifact::plan_step(&s, &self.compile).map_err(internal)?;
        Ok(planned.plan.arena_bytes)
    }
}

/// The stacked params of the step `whole` (built with every stack whole) of which two or
/// more layers' gradients are live at its peak, as [`scheduled`] orders it, all but the
/// largest of them at least [`MIN_PEAK_DROP`] of that peak: the candidates to split alone,
/// which [`Weigh::arena`] then weighs on the plans (the graph's peak does not model
/// fusion: the cnn at B = 16, C = 16, S = 16 names `s3_w`, whose split raises the fused
/// arena from 10.11 to 10.73 MiB).
///
/// Where the activations at the turn to the backward pass make the peak, no gradient is
/// live there and every stack stays whole. Free recomputation lowers that turn, and the
/// peak may then lie in the backward pass, where a whole stack's update waits for its
/// first layer's gradient while the others' are held: the cnn's last stage (three 9 MiB
/// layer gradients of `s4_w` at its fused peak). Split alone, such a stack frees each
/// layer's gradient as it is applied, for one update kernel a layer.
pub fn held_at_peak(whole: &Graph, free: bool) -> Result<BTreeSet<String>, Diagnostics> {
    use crate::analysis::liveness::BufferKind;
    let (s, lv) = scheduled(whole, free)?;
    let at = lv.peak_step();
    let live: Vec<_> = lv
        .buffers
        .iter()
        .filter(|b| b.kind != BufferKind::Persistent && b.start <= at && at < b.end)
        .collect();
    let peak = lv.max_live();
    let mut held = BTreeSet::new();
    for &(p, d) in &s.grads {
        let Op::Param { name, .. } = &s.node(p).op else {
            continue;
        };
        let nodes = s.gradient_nodes([d]);
        let bytes: Vec<u64> = live
            .iter()
            .filter(|b| b.nodes.iter().any(|n| nodes.contains(n)))
            .map(|b| b.bytes)
            .collect();
        // Split, at most the largest of them would be live there.
        let freed = bytes.iter().sum::<u64>() - bytes.iter().max().copied().unwrap_or(0);
        if bytes.len() >= 2 && drops(peak.saturating_sub(freed), peak) {
            held.insert(name.clone());
        }
    }
    Ok(held)
}

/// Whether every layer of every split param got a gradient and an update, and every
/// optimizer state of a layer is a layer of a stacked state ([`group_states`]). A layer
/// read only by values the loss does not depend on has none (see the module doc): the
/// step is then built whole.
pub fn complete(g: &Graph) -> bool {
    let graded: BTreeSet<NodeId> = g.grads.iter().map(|&(p, _)| p).collect();
    let in_stack: BTreeSet<NodeId> = g.stacks.iter().flat_map(|s| s.pieces.clone()).collect();
    let pieces_graded = g
        .stacks
        .iter()
        .flat_map(|s| &s.pieces)
        .filter(|&&p| matches!(g.node(p).op, Op::Param { .. }))
        .all(|p| graded.contains(p));
    let prefixes: Vec<String> = g
        .stacks
        .iter()
        .flat_map(|s| &s.pieces)
        .filter_map(|&p| match &g.node(p).op {
            Op::Param { name, .. } => Some(format!("{name}.")),
            _ => None,
        })
        .collect();
    let states_grouped = g.states.iter().all(|&n| match &g.node(n).op {
        Op::State { name, .. } => {
            in_stack.contains(&n) || !prefixes.iter().any(|p| name.starts_with(p.as_str()))
        }
        _ => true,
    });
    pieces_graded && states_grouped
}
