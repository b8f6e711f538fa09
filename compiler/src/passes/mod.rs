//! The graph-to-graph stages of the pipeline (their order and why: [`crate::pipeline`]):
//! `schedule`, and the lowering rewrites after `remat` (`outputs`, `attention`,
//! `transpose_matmuls`, `split_reductions`), with the helper they share.

pub mod amp;
pub mod attention;
pub mod index_checks;
pub mod outputs;
pub mod schedule;
pub mod split_reductions;
pub mod transpose_matmuls;

use crate::ir::{Graph, NodeId};

/// Rewrites `g` node by node in its order, for the compile-time splits: `expand(h, n)`
/// adds to `h` the nodes that replace `n` and returns them in order (the last one of
/// `n`'s type takes its uses), or `None` to keep `n`. Nodes added but not used (a
/// replacement of another type) are dropped. Returns `g` itself when nothing changed.
pub fn replace_in_order(
    g: &Graph,
    mut expand: impl FnMut(&mut Graph, NodeId) -> Option<Vec<NodeId>>,
) -> Graph {
    let Some(order) = g.topo_order() else {
        return g.clone();
    };
    let mut h = g.clone();
    let mut new_order: Vec<NodeId> = Vec::with_capacity(order.len());
    let mut changed = false;
    for n in order {
        match expand(&mut h, n) {
            Some(added) if added.last().is_some_and(|&l| h.ty(l) == h.ty(n)) => {
                if let Some(&last) = added.last() {
                    h.replace_all_uses(n, last);
                }
                h.remove(n);
                new_order.extend(added);
                changed = true;
            }
            _ => new_order.push(n),
        }
    }
    if !changed {
        return g.clone();
    }
    let keep: std::collections::BTreeSet<NodeId> = new_order.iter().copied().collect();
    let stray: Vec<NodeId> = h.node_ids().filter(|x| !keep.contains(x)).collect();
    for x in stray {
        h.remove(x);
    }
    h.reordered(&new_order)
}
