//! Memory-aware scheduling: reorders the graph within its dependencies to lower the peak of
//! live bytes.
//!
//! Expects: a graph after autodiff (forward, backward, optimizer in program order).
//! Guarantees: the same graph with nodes renumbered in an order whose max-live (as
//! [`crate::analysis::liveness`] counts it) is never above program order's: a list scheduler
//! picks, among ready nodes, the one that allocates least minus frees most (ties: program
//! order), so gradients are consumed and activations freed as early as their inputs allow;
//! the result is kept only when it lowers max-live. An optimizer update (written in place
//! into its param) runs only after every other reader of that param.
//! Cost: O(nodes × ready nodes × operands).

use crate::analysis::liveness::liveness;
use crate::ir::{Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};
use tcc_grammar::diag::Diagnostic;

/// The pass: keeps the better of program order and the list schedule.
pub fn schedule(g: &mut Graph) -> Result<(), Vec<Diagnostic>> {
    let program = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let listed = list_schedule(g);
    let before = liveness(g, &program).max_live();
    let after = liveness(g, &listed).max_live();
    if after < before {
        *g = g.reordered(&listed);
    }
    Ok(())
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
    let mut ready: BTreeSet<(usize, NodeId)> = program
        .iter()
        .filter(|n| waiting[n] == 0)
        .map(|&n| (pos[&n], n))
        .collect();
    let mut order = Vec::with_capacity(program.len());
    while !ready.is_empty() {
        let mut best: Option<(i64, usize, NodeId)> = None;
        for &(p, n) in &ready {
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
            if best.is_none_or(|(bd, bp, _)| (delta, p) < (bd, bp)) {
                best = Some((delta, p, n));
            }
        }
        let Some((_, p, n)) = best else { break };
        ready.remove(&(p, n));
        order.push(n);
        for i in &g.node(n).inputs {
            if let Some(c) = reads.get_mut(&root[i]) {
                *c -= 1;
            }
        }
        for &s in succs.get(&n).map(Vec::as_slice).unwrap_or(&[]) {
            if let Some(w) = waiting.get_mut(&s) {
                *w -= 1;
                if *w == 0 {
                    ready.insert((pos[&s], s));
                }
            }
        }
    }
    if order.len() != program.len() {
        return program;
    }
    order
}
