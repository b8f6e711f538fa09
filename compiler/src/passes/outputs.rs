//! The `outputs` stage: an output that names a param or state the step updates gets a copy.
//!
//! Expects: a step after `remat` (its order final).
//! Guarantees: no output names an updated param or state; each such output reads a cast
//! (a copy) placed after the leaves and before everything else, so it holds the value the
//! step used, as the eager interpreter returns it. Other nodes keep their order.
//! Cost: one pass over the nodes; a graph without such outputs is returned as it is.

use crate::ir::{Graph, NodeId, Op};

/// Outputs that name a param or state the step updates would read the new value at the end
/// of the step; they get a copy made before any update, so they return the value the step
/// used (as the eager interpreter does).
pub fn with_output_copies(g: &Graph) -> Graph {
    let targets: std::collections::BTreeSet<NodeId> = g.updates.iter().map(|u| u.0).collect();
    if !g.outputs.iter().any(|(_, n)| targets.contains(n)) {
        return g.clone();
    }
    let mut h = g.clone();
    let mut copies = Vec::new();
    for k in 0..h.outputs.len() {
        let n = h.outputs[k].1;
        if !targets.contains(&n) {
            continue;
        }
        let node = h.node(n).clone();
        let to = node.ty.dtype;
        if let Ok(c) = h.add(Op::Cast { to }, vec![n], node.span, None) {
            h.outputs[k].1 = c;
            copies.push(c);
        }
    }
    let Some(rest) = h.topo_order() else {
        return h;
    };
    // Leaves, then the copies, then everything else in its scheduled order.
    let leaves: Vec<NodeId> = rest
        .iter()
        .copied()
        .filter(|&n| {
            matches!(
                h.node(n).op,
                Op::Param { .. } | Op::State { .. } | Op::Input { .. }
            )
        })
        .collect();
    let mut order = leaves.clone();
    order.extend(copies.iter().copied());
    order.extend(
        rest.into_iter()
            .filter(|n| !leaves.contains(n) && !copies.contains(n)),
    );
    h.reordered(&order)
}
