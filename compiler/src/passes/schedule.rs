//! Memory-aware scheduling: reorders the graph within its dependencies to lower the peak of
//! live bytes.
//!
//! Expects: a graph after autodiff (forward, backward, optimizer in program order).
//! Guarantees: the same graph with nodes renumbered in an order whose max-live (as
//! [`crate::analysis::liveness`] counts it, with the optimizer updates' temporaries in
//! their kernels where updates run early: [`max_live_fused`]) is never above program
//! order's: a list scheduler
//! picks, among ready nodes, the one that allocates least minus frees most (ties: program
//! order), so gradients are consumed and activations freed as early as their inputs allow;
//! the result is kept only when it lowers max-live. An optimizer update (written in place
//! into its param) runs only after every other reader of that param, and then as soon as
//! its gradient is ready ([`updates_when_ready`]) where that does not raise max-live (an
//! update's temporaries counted in its kernel, [`max_live_fused`]). A
//! micro-batched step (`--micro-batches K`) runs its micro-batches one after another, and
//! adds each micro-batch's gradient contributions as they are made; a step whose loss head
//! is computed in chunks (`--loss-chunks`) runs each chunk's forward and backward together
//! ([`chunk_segments`]).
//! Cost: O(nodes × operands × log nodes), plus the re-ranking of a ready node each time a root
//! it reads comes down to its last reads.

use crate::analysis::liveness::liveness;
use crate::ir::{Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};
use tcc_grammar::diag::Diagnostic;

/// The pass: keeps the better of program order and the list schedule.
pub fn schedule(g: &mut Graph) -> Result<(), Vec<Diagnostic>> {
    let mut program = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let mut listed = list_schedule(g);
    let micro = g.micro_batches.is_some() || g.loss_chunks.is_some();
    if micro {
        shared_once(g);
        let sums = sums_in_turn(g);
        program = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
        listed = list_schedule(g);
        // Each node's micro-batch follows from the graph alone (both orders run an
        // update after its param's readers): computed once, both orders sorted by it.
        let segment = segments(g, &program);
        program.sort_by_key(|n| segment.get(n).copied().unwrap_or(0));
        listed.sort_by_key(|n| segment.get(n).copied().unwrap_or(0));
        if g.micro_batches.is_none() {
            // A chunked loss head's last segment is the whole backward pass: its last
            // gradient sum runs as soon as its terms are ready, not at the segment's end.
            for o in [&mut program, &mut listed] {
                right_after_operands(g, o, &sums);
            }
        }
    }
    let before = liveness(g, &program).max_live();
    let after = liveness(g, &listed).max_live();
    let order = if after < before { listed } else { program };
    if g.ranks.is_some() {
        *g = g.reordered(&collectives_last(g, &order));
        return Ok(());
    }
    // Updates applied as their gradients are ready, where that does not raise max-live.
    let mut applied = updates_when_ready(g, &order);
    // Compared with an update's temporaries in its kernel, as fusion computes them: where
    // a split stack's last layer is updated at the peak, its momentum and decay terms
    // counted as buffers would keep every update at the end (the cnn split: 5 MB more
    // max-live counted so, a 12 MiB smaller fused arena).
    if applied != order && max_live_fused(g, &applied) > max_live_fused(g, &order) {
        applied.clone_from(&order);
    }
    // (Data-parallel steps returned above: their collectives keep the order they need.)
    let late = leaf_views_late(g, &applied);
    if late != order || after < before || micro {
        *g = g.reordered(&late);
    }
    Ok(())
}

/// The elementwise values that only updates read, back to the gradients they apply
/// (momentum and weight-decay terms, Adam's moments and steps): fusion computes them in
/// the update's kernel, so they never have a buffer of their own.
fn update_temporaries(g: &Graph, order: &[NodeId]) -> BTreeSet<NodeId> {
    let values: BTreeSet<NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
    let kept: BTreeSet<NodeId> = g
        .grads
        .iter()
        .map(|&(_, d)| d)
        .chain(g.outputs.iter().map(|&(_, o)| o))
        .collect();
    let mut temporaries = BTreeSet::new();
    for &n in order.iter().rev() {
        if values.contains(&n) || kept.contains(&n) || !g.node(n).op.is_elementwise() {
            continue;
        }
        let users = g.users(n);
        if !users.is_empty()
            && users
                .iter()
                .all(|u| temporaries.contains(u) || values.contains(u))
        {
            temporaries.insert(n);
        }
    }
    temporaries
}

/// The max-live of `order` ([`liveness`]) with the updates' temporaries
/// ([`update_temporaries`]) left out: what the schedule weighs the order of updates by.
pub fn max_live_fused(g: &Graph, order: &[NodeId]) -> u64 {
    liveness_fused(g, order).max_live()
}

/// The liveness of `order` ([`liveness`]) with the updates' temporaries
/// ([`update_temporaries`]) left out, as [`max_live_fused`] weighs it.
pub fn liveness_fused(g: &Graph, order: &[NodeId]) -> crate::analysis::liveness::Liveness {
    let temporaries = update_temporaries(g, order);
    let mut lv = liveness(g, order);
    lv.buffers.retain(|b| !temporaries.contains(&b.owner));
    lv
}

/// Whether `n` is a view whose chain of inputs (through views) ends at a leaf.
fn leaf_view(g: &Graph, n: NodeId) -> bool {
    g.node(n).op.is_view_candidate() && g.node(g.view_root(n)).op.is_leaf()
}

/// `order` with every view of a leaf (a param's transpose, an input's reshape, through any
/// chain of views) moved to just before its first reader. A view runs no code and has no
/// bytes of its own in the schedule's model, so the order's liveness is the same; but
/// fusion may give it a buffer (a matmul operand copied into the order the GEMM reads), and
/// that copy then lives from where the view stands to its last reader. Views of leaves
/// are ready at the start, so the list schedule put them there: a loop that multiplies by
/// one weight at each of N steps kept N copies of its transpose from the first kernel to
/// the backward pass (half the arena of a 64-step `tanh(h @ w) + h`). Views nothing reads
/// (outputs) stay where they are.
fn leaf_views_late(g: &Graph, order: &[NodeId]) -> Vec<NodeId> {
    // Deferred: views of leaves read by something.
    let deferred: BTreeSet<NodeId> = order
        .iter()
        .copied()
        .filter(|&n| leaf_view(g, n) && !g.users(n).is_empty())
        .collect();
    if deferred.is_empty() {
        return order.to_vec();
    }
    // Every other node in order, each after the deferred views it reads (its other
    // operands are placed already).
    let mut out = Vec::with_capacity(order.len());
    let mut placed: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().filter(|n| !deferred.contains(n)) {
        place(g, n, &mut out, &mut placed);
    }
    out
}

/// Appends `n` to `out` after its operands not yet placed, each once, operands first
/// (without recursion: a chain of operands may be long).
fn place(g: &Graph, n: NodeId, out: &mut Vec<NodeId>, placed: &mut BTreeSet<NodeId>) {
    let mut stack = vec![(n, false)];
    while let Some((x, ready)) = stack.pop() {
        if placed.contains(&x) {
            continue;
        }
        if ready {
            placed.insert(x);
            out.push(x);
            continue;
        }
        stack.push((x, true));
        for &i in g.node(x).inputs.iter().rev() {
            if !placed.contains(&i) {
                stack.push((i, false));
            }
        }
    }
}

/// `order` with each optimizer update moved up to where its gradient is complete: the
/// nodes that only an update reads (its moments, its weight decay, the new value), up to
/// the gradient the optimizer applies, run just after the last value they need and the
/// last other reader of the param (or state) the update writes in place. The gradient's
/// bytes are then free for the rest of the backward pass, so at most the gradients of the
/// params whose backward pass is under way are live at once, where program order applied
/// every update after the whole backward pass (the cnn's stage-4 weights, 27 MiB of
/// gradient, stayed live through stages 3 to 1, its peak). What depends on no moved-up
/// value (Adam's step count and bias corrections, the states themselves) runs just before
/// its first reader. The result is checked (same nodes, topological, every update after
/// every other reader of its target through views); `order` is returned if any check
/// fails, and unchanged for a step without updates.
pub(crate) fn updates_when_ready(g: &Graph, order: &[NodeId]) -> Vec<NodeId> {
    if g.updates.is_empty() {
        return order.to_vec();
    }
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let gradients: BTreeSet<NodeId> = g.grads.iter().map(|&(_, d)| d).collect();
    let interface: BTreeSet<NodeId> = g.outputs.iter().map(|&(_, o)| o).collect();
    let values: BTreeMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    // The cone of the updates: what they read, back to the gradients, stopping at inputs
    // and at anything another value reads.
    let mut cone: BTreeSet<NodeId> = BTreeSet::new();
    let mut stack: Vec<NodeId> = values.keys().copied().collect();
    while let Some(n) = stack.pop() {
        if interface.contains(&n) || !cone.insert(n) {
            continue;
        }
        if matches!(g.node(n).op, Op::Input { .. }) || gradients.contains(&n) {
            continue;
        }
        stack.extend(g.node(n).inputs.iter().copied());
    }
    // In-step checks that read the new values (the finite check's sums) stay where they
    // are, after the values: they hold an update back no more than its store does.
    let checks: BTreeSet<NodeId> = g
        .outputs
        .iter()
        .filter(|(name, _)| tcc_runtime::artifact::is_check_output(name))
        .map(|&(_, o)| o)
        .collect();
    let mut trailing: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().rev() {
        let users = g.users(n);
        if checks.contains(&n)
            || (!interface.contains(&n)
                && !values.contains_key(&n)
                && !users.is_empty()
                && users.iter().all(|u| trailing.contains(u)))
        {
            trailing.insert(n);
        }
    }
    // Moved: cone nodes all of whose readers move too, or are such checks (latest first,
    // so readers are known).
    let mut moved: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().rev() {
        if cone.contains(&n)
            && !trailing.contains(&n)
            && !matches!(g.node(n).op, Op::Input { .. })
            && g.users(n)
                .iter()
                .all(|u| moved.contains(u) || trailing.contains(u))
        {
            moved.insert(n);
        }
    }
    if moved.is_empty() {
        return order.to_vec();
    }
    // The readers of each update's target, through views.
    let targets: BTreeSet<NodeId> = g.updates.iter().map(|&(t, _)| t).collect();
    let mut readers: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for &n in order {
        for &i in &g.node(n).inputs {
            let r = g.view_root(i);
            if targets.contains(&r) {
                readers.entry(r).or_default().push(n);
            }
        }
    }
    // Each moved node's anchor: the position after which it runs (`None`: it floats, and
    // runs just before its first reader).
    let mut anchor: BTreeMap<NodeId, Option<usize>> = BTreeMap::new();
    for &n in order.iter().filter(|n| moved.contains(n)) {
        let at = |x: &NodeId| {
            if moved.contains(x) {
                anchor.get(x).copied().flatten()
            } else {
                pos.get(x).copied()
            }
        };
        let mut a = g.node(n).inputs.iter().filter_map(at).max();
        if let Some(t) = values.get(&n) {
            let r = readers
                .get(t)
                .into_iter()
                .flatten()
                .filter(|&&r| r != n)
                .filter_map(at)
                .max();
            a = a.max(r);
        }
        anchor.insert(n, a);
    }
    // Then as late as their earliest reader, but never later than `order` ran them: an
    // update's nodes run together, where its last constraint allows (a momentum read by
    // its param's new value waits for the param's last reader, so fusion still computes
    // both in one kernel), and a gradient the schedule ran early stays there.
    for &n in order.iter().rev().filter(|n| moved.contains(n)) {
        let latest = g
            .users(n)
            .iter()
            .filter_map(|u| anchor.get(u).copied().flatten())
            .min();
        let (Some(Some(a)), Some(l), Some(&p)) = (anchor.get(&n).copied(), latest, pos.get(&n))
        else {
            continue;
        };
        let l = l.min(p.saturating_sub(1));
        if l > a {
            anchor.insert(n, Some(l));
        }
    }
    let mut after: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
    for &n in order.iter().filter(|n| moved.contains(n)) {
        if let Some(Some(a)) = anchor.get(&n) {
            after.entry(*a).or_default().push(n);
        }
    }
    let mut out: Vec<NodeId> = Vec::with_capacity(order.len());
    let mut placed: BTreeSet<NodeId> = BTreeSet::new();
    let floating = |n: &NodeId| moved.contains(n) && anchor.get(n) == Some(&None);
    for (i, &n) in order.iter().enumerate() {
        if !moved.contains(&n) {
            // Its operands are unmoved (placed before it) or floating.
            place(g, n, &mut out, &mut placed);
        }
        for &m in after.get(&i).into_iter().flatten() {
            place(g, m, &mut out, &mut placed);
        }
    }
    // Floating nodes nothing placed reads (none when every update is placed).
    for &n in order.iter().filter(|n| floating(n)) {
        place(g, n, &mut out, &mut placed);
    }
    if valid_update_order(g, order, &out, &readers) {
        out
    } else {
        order.to_vec()
    }
}

/// `new` holds `old`'s nodes once each, in a topological order, and runs every update's
/// value after every other reader of its target.
fn valid_update_order(
    g: &Graph,
    old: &[NodeId],
    new: &[NodeId],
    readers: &BTreeMap<NodeId, Vec<NodeId>>,
) -> bool {
    let at: BTreeMap<NodeId, usize> = new.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    if new.len() != old.len() || at.len() != old.len() || old.iter().any(|n| !at.contains_key(n)) {
        return false;
    }
    let topological = new.iter().enumerate().all(|(i, &n)| {
        g.node(n)
            .inputs
            .iter()
            .all(|x| at.get(x).is_some_and(|&j| j < i))
    });
    topological
        && g.updates.iter().all(|&(t, v)| {
            readers
                .get(&t)
                .into_iter()
                .flatten()
                .all(|r| *r == v || at.get(r) < at.get(&v))
        })
}

/// The segment each node of `order` runs in: [`micro_segments`] for a micro-batched step,
/// [`chunk_segments`] for one whose loss head is computed in chunks, none otherwise.
pub(crate) fn segments(g: &Graph, order: &[NodeId]) -> BTreeMap<NodeId, u32> {
    if g.micro_batches.is_some() {
        micro_segments(g, order)
    } else if g.loss_chunks.is_some() {
        chunk_segments(g, order)
    } else {
        BTreeMap::new()
    }
}

/// The segment each node of `order` runs in where only the loss head is computed in
/// chunks (marked as micro-batches are, `front::micro_batch::compile_step`): a node
/// computed from a chunk runs in the latest chunk it depends on, as in
/// [`micro_segments`], so each chunk's backward runs right after its forward; every other
/// node runs in the latest segment its readers allow (the whole forward pass before the
/// first chunk, a backward value computed from forward values alone, such as the
/// attention probabilities a backward kernel rebuilds, after the last one). Sorted by it,
/// the order stays topological: a node's readers run in its segment or a later one, and an
/// update after every other reader of its target.
pub(crate) fn chunk_segments(g: &Graph, order: &[NodeId]) -> BTreeMap<NodeId, u32> {
    let level = micro_segments(g, order);
    let last = level.values().copied().max().unwrap_or(0);
    let mut chunked: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order {
        let node = g.node(n);
        if node.micro_batch.is_some() || node.inputs.iter().any(|i| chunked.contains(i)) {
            chunked.insert(n);
        }
    }
    // A reader of a param or state runs before its update.
    let mut updates_of: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for &(t, v) in &g.updates {
        updates_of.entry(t).or_default().push(v);
    }
    let mut users: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for &n in order {
        let node = g.node(n);
        for &i in &node.inputs {
            users.entry(i).or_default().push(n);
            if let Some(vs) = updates_of.get(&i) {
                users
                    .entry(n)
                    .or_default()
                    .extend(vs.iter().filter(|&&v| v != n));
            }
        }
    }
    let values: BTreeSet<NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
    let mut seg: BTreeMap<NodeId, u32> = BTreeMap::new();
    for &n in order.iter().rev() {
        let s = if chunked.contains(&n) {
            level.get(&n).copied().unwrap_or(0)
        } else if values.contains(&n) {
            // An update computed from no chunk still runs after every reader of its
            // target, the chunks' included.
            last
        } else {
            users
                .get(&n)
                .into_iter()
                .flatten()
                .filter_map(|u| seg.get(u).copied())
                .min()
                .unwrap_or(last)
        };
        seg.insert(n, s);
    }
    seg
}

/// The micro-batch during which each node of `order` (a topological order of a
/// micro-batched step) runs: the latest micro-batch it depends on, or the first for a node
/// that depends on none (a param's transpose, a constant). [`schedule`] sorts the step by
/// it, stably, so one micro-batch's forward and backward nodes all run before the next
/// one's first node and its activations are dead before the next one's are made; the
/// order stays topological, as a node's operands run in its micro-batch or an earlier one.
/// (Running every node that depends on none with its first reader instead was measured:
/// gpt at B=32 in 4 micro-batches then fused to a higher peak than one op per kernel, and
/// ran unfused, 320 ms a step against 250 ms on an H100. Views of leaves alone are moved
/// so afterwards ([`leaf_views_late`]): they run no code, and gpt's micro-batched PTX and
/// plan are the same with or without that.)
pub(crate) fn micro_segments(g: &Graph, order: &[NodeId]) -> BTreeMap<NodeId, u32> {
    // An update (written in place into its param or state) runs after every other reader
    // of its target, as in the list schedule: a param whose gradient is complete in the
    // first micro-batch is still read by the later ones.
    let mut after: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for &(t, v) in &g.updates {
        after
            .entry(v)
            .or_default()
            .extend(g.users(t).into_iter().filter(|&u| u != v));
    }
    let mut level: BTreeMap<NodeId, u32> = BTreeMap::new();
    for &n in order {
        let node = g.node(n);
        let l = node
            .inputs
            .iter()
            .chain(after.get(&n).into_iter().flatten())
            .filter_map(|i| level.get(i).copied())
            .chain(node.micro_batch)
            .max()
            .unwrap_or(0);
        level.insert(n, l);
    }
    level
}

/// Merges nodes that compute the same value (the same op of the same operands): each
/// micro-batch's backward pass made its own copies of what it reads of the params alone,
/// which would all be computed in the first micro-batch and live until their own one ran
/// (the mlp in 4 micro-batches: 45.04 MiB against 32.31 MiB merged, when a weight's
/// transpose was merged too). Views of leaves (a weight's transpose) are no longer merged:
/// each runs in its own micro-batch, just before its reader ([`leaf_views_late`]; the mlp
/// in 4 micro-batches: 28.34 MiB).
/// Params, inputs and state are never merged (each is its own value), nor values of
/// `checkpoint { }` blocks.
fn shared_once(g: &mut Graph) {
    let Some(order) = g.topo_order() else { return };
    let mut seen: BTreeMap<(String, Vec<NodeId>), NodeId> = BTreeMap::new();
    for n in order {
        let node = g.node(n);
        if matches!(
            node.op,
            Op::Input { .. } | Op::Param { .. } | Op::State { .. }
        ) {
            continue;
        }
        // A value made in a `checkpoint { }` block is never merged: its recomputed clone
        // for the backward pass is the same op of the same operands.
        if node.checkpoint.is_some() {
            continue;
        }
        // Nor a view of a leaf (a weight's transpose): each micro-batch's runs just before
        // its reader ([`leaf_views_late`]), so a copy fusion makes of it lives within that
        // micro-batch, where one merged view would be copied once and live from the first
        // micro-batch's reader to the last one's.
        if leaf_view(g, n) {
            continue;
        }
        let key = (format!("{:?}", node.op), node.inputs.clone());
        match seen.get(&key) {
            Some(&first) => {
                g.replace_all_uses(n, first);
                g.remove(n);
            }
            None => {
                seen.insert(key, n);
            }
        }
    }
}

/// Re-associates each backward sum of several terms (a chain of same-typed `add`s, as
/// autodiff sums a param's gradient contributions) whose terms come from different
/// micro-batches so it adds them in micro-batch order: `((g0 + g1) + g2) + g3` rather than
/// autodiff's reverse `((g3 + g2) + g1) + g0`, which could only start once the last
/// micro-batch is done and so kept every micro-batch's contribution alive until then.
/// Now each contribution is added (in place) as its micro-batch finishes.
fn sums_in_turn(g: &mut Graph) -> Vec<NodeId> {
    let mut made = Vec::new();
    let Some(order) = g.topo_order() else {
        return made;
    };
    let mut level = segments(g, &order);
    let mut pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // Values the step hands on (outputs, updates, the gradients the optimizer applies)
    // stay nodes of their own.
    let mut kept = g.read_by_caller();
    kept.extend(g.grads.iter().map(|&(_, d)| d));
    kept.extend(g.updates.iter().map(|&(_, v)| v));
    let is_sum = gradient_sum;
    let interior = |g: &Graph, n: NodeId| {
        let users = g.users(n);
        is_sum(g, n) && users.len() == 1 && is_sum(g, users[0]) && !kept.contains(&n)
    };
    let roots: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|&n| is_sum(g, n) && !interior(g, n))
        .collect();
    for r in roots {
        let (mut terms, mut inner, mut stack) = (Vec::new(), Vec::new(), vec![r]);
        while let Some(n) = stack.pop() {
            for &i in &g.node(n).inputs {
                if interior(g, i) {
                    inner.push(i);
                    stack.push(i);
                } else {
                    terms.push(i);
                }
            }
        }
        let key = |level: &BTreeMap<NodeId, u32>, pos: &BTreeMap<NodeId, usize>, t: NodeId| {
            (
                level.get(&t).copied().unwrap_or(0),
                pos.get(&t).copied().unwrap_or(0),
            )
        };
        let Some(&t0) = terms.first() else { continue };
        let first = key(&level, &pos, t0).0;
        if terms.len() < 3 || terms.iter().all(|&t| key(&level, &pos, t).0 == first) {
            continue;
        }
        terms.sort_by_key(|&t| key(&level, &pos, t));
        let (span, at) = (g.node(r).span, key(&level, &pos, r).1);
        let mut rest = terms.into_iter();
        let Some(mut acc) = rest.next() else { continue };
        // A chunked loss head's sum reads the new term first: fusion then adds the sum so
        // far in the epilogue of the product that makes the term, in the term's chunk
        // (read second, the term's product joined the earlier sum's kernel, and an earlier
        // chunk's logit gradient lived through the next chunk).
        let chunked = g.loss_chunks.is_some() && g.micro_batches.is_none();
        for t in rest {
            let Ok(id) = g.add(
                Op::Binary(crate::ir::BinaryOp::Add),
                if chunked { vec![t, acc] } else { vec![acc, t] },
                span,
                None,
            ) else {
                return made;
            };
            g.mark_backward(id);
            made.push(id);
            // A later root may sum this one: it stands where the root stood.
            let l = key(&level, &pos, acc).0.max(key(&level, &pos, t).0);
            level.insert(id, l);
            pos.insert(id, at);
            acc = id;
        }
        g.replace_all_uses(r, acc);
        g.remove(r);
        for n in inner {
            g.remove_if_unused(n);
        }
    }
    made.retain(|&n| g.get(n).is_some());
    made
}

/// Whether `n` adds two gradient contributions: a backward `add` of operands of its own
/// type (what [`sums_in_turn`] reorders and `kernel::peak` gives buffers).
pub(crate) fn gradient_sum(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    node.backward
        && node.op == Op::Binary(crate::ir::BinaryOp::Add)
        && node.inputs.iter().all(|&i| g.ty(i) == &node.ty)
}

/// Moves each of `nodes` (in turn) in `order` to just after the last of its operands: it
/// still runs after them, and earlier than before, so before its readers.
fn right_after_operands(g: &Graph, order: &mut Vec<NodeId>, nodes: &[NodeId]) {
    for &n in nodes {
        // An update's new value stays after its target's other readers.
        if g.updates.iter().any(|&(_, v)| v == n) {
            continue;
        }
        let Some(at) = order.iter().position(|&m| m == n) else {
            continue;
        };
        let ins = &g.node(n).inputs;
        let Some(last) = order[..at].iter().rposition(|m| ins.contains(m)) else {
            continue;
        };
        if ins.iter().all(|i| order[..=last].contains(i)) {
            let v = order.remove(at);
            order.insert(last + 1, v);
        }
    }
}

/// A data-parallel step's order with every node that reads an `all_reduce` (directly or
/// not: the optimizer's updates) after every node that does not, each part in `order`'s
/// order (a topological order still: a node of the first part reads none of the second).
/// The backward pass then never reuses the bytes an update frees, so no backward kernel
/// waits for an update, and the ranks' reductions overlap the rest of the backward pass
/// (as DDP's gradients live until the optimizer's step). A backward kernel may wait for a
/// gradient's sum, though: one that is not reduced in place (a copy, as of a split-K weight
/// gradient) frees its operand's bytes when [`sums_when_ready`] moves it up, and a kernel
/// that reuses them waits for the sum's bucket (4 kernels of the cnn on 2 ranks; its step
/// was still 0.5 ms faster on 4 H100s than with the sums at the end). On gpt on two H100s
/// the step took 67.7 ms before this and 67.6 after (the arena is 2.85 GiB either way): the
/// gap to one GPU's 61.5 ms was elsewhere (the runtime's launch), but the order no longer
/// depends on where the planner happens to reuse bytes.
///
/// Generally, nodes are ordered stably by how many collectives lie on their longest path
/// from the step's leaves (a collective counted after itself), and a collective that reads
/// such waiting values comes after every other node of its level: a ZeRO-1 step's
/// `all_gather`s come after all of the shards' updates, so a rank launching kernel by
/// kernel joins its streams once for them instead of once per param; what reads a gather
/// alone (a padded param's slice) follows it at once, so the gathered copies are not all
/// live together.
fn collectives_last(g: &Graph, order: &[NodeId]) -> Vec<NodeId> {
    // level[n]: collectives on the longest path to n's operands, each counted for the
    // nodes after it.
    let mut level: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut key: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in order {
        let node = g.node(n);
        let l = node
            .inputs
            .iter()
            .map(|i| level.get(i).copied().unwrap_or(0))
            .max()
            .unwrap_or(0);
        let collective = node.op.is_collective();
        // Sort key: 2·level, +1 for a collective that waits (after its level's others). A
        // node that reads only such a collective (directly or through such readers) at its
        // own level keeps the collective's key, so it follows it at once: a padded
        // `all_gather`'s slice into the param, not after every other param's gather.
        let follows = l > 0
            && !collective
            && node
                .inputs
                .iter()
                .filter(|i| level.get(i).copied().unwrap_or(0) == l)
                .all(|i| key.get(i) == Some(&(2 * l - 1)));
        let k = if follows {
            2 * l - 1
        } else {
            2 * l + usize::from(collective && l > 0)
        };
        key.insert(n, k);
        level.insert(n, l + usize::from(collective));
    }
    let mut out = order.to_vec();
    out.sort_by_key(|n| key.get(n).copied().unwrap_or(0));
    sums_when_ready(g, &out, &level)
}

/// `order` with each gradient sum (an `all_reduce` or `reduce_scatter` of a value no
/// collective feeds) moved up to just after the last of its operands. The runtime buckets
/// the collectives in launch order and reduces the buckets one after another, so a
/// reduction is placed where its gradient is ready: a layer's gradients are summed while
/// the backward pass goes on below it, and one gradient ready late (an embedding's, at the
/// end of the backward pass) holds back no other. Each moved node still follows its
/// operands, so the order stays topological.
fn sums_when_ready(g: &Graph, order: &[NodeId], level: &BTreeMap<NodeId, usize>) -> Vec<NodeId> {
    let is_sum = |n: NodeId| {
        let node = g.node(n);
        matches!(node.op, Op::AllReduce | Op::ReduceScatter { .. })
            && node
                .inputs
                .iter()
                .all(|i| level.get(i).is_none_or(|&l| l == 0))
    };
    let moved: BTreeSet<NodeId> = order.iter().copied().filter(|&n| is_sum(n)).collect();
    // For each node, the moved sums it is the last operand of (in `order`'s order).
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut after: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut first: Vec<NodeId> = Vec::new();
    for &n in order.iter().filter(|n| moved.contains(n)) {
        match g.node(n).inputs.iter().max_by_key(|i| pos.get(i)) {
            Some(&last) => after.entry(last).or_default().push(n),
            None => first.push(n),
        }
    }
    let mut out = first;
    out.reserve(order.len());
    for &n in order.iter().filter(|n| !moved.contains(n)) {
        out.push(n);
        if let Some(sums) = after.get(&n) {
            out.extend(sums);
        }
    }
    // Every moved sum follows an operand in `order` (so none is dropped).
    debug_assert_eq!(out.len(), order.len());
    out
}

/// The storage root of a node: views resolve to their operand's root, update values to their
/// target.
fn roots(g: &Graph, order: &[NodeId]) -> BTreeMap<NodeId, NodeId> {
    let target: BTreeMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    let mut root = BTreeMap::new();
    for &n in order {
        let node = g.node(n);
        let r = if let Some(&t) = target.get(&n) {
            t
        } else if node.op.is_view_candidate() {
            root.get(&node.inputs[0]).copied().unwrap_or(node.inputs[0])
        } else {
            n
        };
        root.insert(n, r);
    }
    root
}

/// A greedy list schedule (see the module doc).
pub fn list_schedule(g: &Graph) -> Vec<NodeId> {
    let program = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let pos: BTreeMap<NodeId, usize> = program.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let root = roots(g, &program);
    // Extra dependencies: every other reader of an update's target runs before the update.
    let mut preds: BTreeMap<NodeId, BTreeSet<NodeId>> = BTreeMap::new();
    for &n in &program {
        preds.insert(n, g.node(n).inputs.iter().copied().collect());
    }
    for &(t, v) in &g.updates {
        for u in g.users(t) {
            if u != v {
                if let Some(p) = preds.get_mut(&v) {
                    p.insert(u);
                }
            }
        }
    }
    let mut succs: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for (&n, ps) in &preds {
        for &p in ps {
            succs.entry(p).or_default().push(n);
        }
    }
    let mut waiting: BTreeMap<NodeId, usize> = preds.iter().map(|(&n, p)| (n, p.len())).collect();
    // Remaining reads of each storage root.
    let outputs: BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| root[o]).collect();
    let mut reads: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in &program {
        for i in &g.node(n).inputs {
            *reads.entry(root[i]).or_default() += 1;
        }
    }
    let persistent = |r: NodeId| matches!(g.node(r).op, Op::Param { .. } | Op::State { .. });
    let bytes = |r: NodeId| g.ty(r).size_bytes() as i64;
    // What running `n` now changes of the live bytes: what it allocates, minus the roots it
    // reads for the last time.
    let delta_of = |n: NodeId, reads: &BTreeMap<NodeId, usize>| -> i64 {
        let node = g.node(n);
        let allocates = root[&n] == n
            && !matches!(
                node.op,
                Op::Literal { .. } | Op::Param { .. } | Op::State { .. }
            );
        let mut delta = if allocates { bytes(n) } else { 0 };
        let mut counted: BTreeMap<NodeId, usize> = BTreeMap::new();
        for i in &node.inputs {
            *counted.entry(root[i]).or_default() += 1;
        }
        for (r, k) in counted {
            if reads.get(&r) == Some(&k) && !outputs.contains(&r) && !persistent(r) {
                delta -= bytes(r);
            }
        }
        delta
    };
    // The readers of each root, and the most reads one of them makes: a reader's delta can
    // change only once the root's remaining reads are down to that many, so a ready node's
    // delta is recomputed then, not at every step (a long unrolled loop keeps thousands of
    // nodes ready).
    let mut readers: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut most: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in &program {
        let mut counted: BTreeMap<NodeId, usize> = BTreeMap::new();
        for i in &g.node(n).inputs {
            *counted.entry(root[i]).or_default() += 1;
        }
        for (r, k) in counted {
            readers.entry(r).or_default().push(n);
            let m = most.entry(r).or_default();
            *m = (*m).max(k);
        }
    }
    // Ready nodes by (delta, program position): the scheduler takes the first.
    let mut key: BTreeMap<NodeId, (i64, usize)> = BTreeMap::new();
    let mut ready: BTreeSet<(i64, usize, NodeId)> = BTreeSet::new();
    for &n in program.iter().filter(|n| waiting[n] == 0) {
        let k = (delta_of(n, &reads), pos[&n]);
        key.insert(n, k);
        ready.insert((k.0, k.1, n));
    }
    let mut order = Vec::with_capacity(program.len());
    while let Some((_, _, n)) = ready.pop_first() {
        key.remove(&n);
        order.push(n);
        let mut touched: Vec<NodeId> = Vec::new();
        for i in &g.node(n).inputs {
            let r = root[i];
            if let Some(c) = reads.get_mut(&r) {
                *c -= 1;
                if !touched.contains(&r) {
                    touched.push(r);
                }
            }
        }
        for r in touched {
            if reads[&r] > most[&r] || outputs.contains(&r) || persistent(r) {
                continue;
            }
            for &m in &readers[&r] {
                let Some(&(d, p)) = key.get(&m) else { continue };
                let nd = delta_of(m, &reads);
                if nd != d {
                    ready.remove(&(d, p, m));
                    ready.insert((nd, p, m));
                    key.insert(m, (nd, p));
                }
            }
        }
        for &s in succs.get(&n).map(Vec::as_slice).unwrap_or(&[]) {
            if let Some(w) = waiting.get_mut(&s) {
                *w -= 1;
                if *w == 0 {
                    let k = (delta_of(s, &reads), pos[&s]);
                    key.insert(s, k);
                    ready.insert((k.0, k.1, s));
                }
            }
        }
    }
    if order.len() != program.len() {
        return program;
    }
    order
}
