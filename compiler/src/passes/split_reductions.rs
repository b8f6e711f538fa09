//! Split large reductions over several axes into two reductions.
//!
//! Expects a verified graph after autodiff. `reduce(x, axes: [.., a])` over at least two
//! axes of a tensor of 64 Ki elements or more becomes `reduce(reduce(x, axes: [a],
//! keepdim: true), axes: [.., a])`: the inner reduction keeps one value per remaining
//! element (many rows: a kernel with parallelism), the outer one reduces those (few).
//! Sum, max and min are associative; a mean of equal-sized means is the mean. The result
//! type and every user are unchanged. Used by `artifact::compile`, so back ends never face
//! one long serial reduction (a whole-tensor loss on a GPU is otherwise one block of
//! threads). Cost: one pass over the nodes; at most one new node per split.

use crate::ir::{Graph, NodeId, Op};

/// Below this many input elements a reduction stays whole.
const MIN_ELEMENTS: usize = 1 << 16;

/// Splits every large multi-axis reduction; returns the rewritten graph (node order kept,
/// each split reduction replaced in place by its two halves).
pub fn split_reductions(g: &Graph) -> Graph {
    let Some(order) = g.topo_order() else {
        return g.clone();
    };
    let mut h = g.clone();
    let mut new_order: Vec<NodeId> = Vec::with_capacity(order.len());
    let mut changed = false;
    for n in order {
        let node = h.node(n).clone();
        let split = match &node.op {
            Op::Reduce { op, axes, keepdim }
                if axes.len() >= 2 && h.ty(node.inputs[0]).shape.numel() >= MIN_ELEMENTS =>
            {
                axes.iter()
                    .max()
                    .map(|&last| (*op, axes.clone(), *keepdim, last))
            }
            _ => None,
        };
        let Some((op, axes, keepdim, last)) = split else {
            new_order.push(n);
            continue;
        };
        let inner = h.add(
            Op::Reduce {
                op,
                axes: vec![last],
                keepdim: true,
            },
            vec![node.inputs[0]],
            node.span,
            node.checkpoint,
        );
        let outer = inner.and_then(|i| {
            h.add(
                Op::Reduce { op, axes, keepdim },
                vec![i],
                node.span,
                node.checkpoint,
            )
            .map(|o| (i, o))
        });
        match outer {
            Ok((i, o)) if h.ty(o) == &node.ty => {
                h.replace_all_uses(n, o);
                h.remove(n);
                new_order.push(i);
                new_order.push(o);
                changed = true;
            }
            _ => new_order.push(n),
        }
    }
    if !changed {
        return g.clone();
    }
    // Nodes added but abandoned (a failed split) are not in `new_order`: drop them.
    let keep: std::collections::BTreeSet<NodeId> = new_order.iter().copied().collect();
    let stray: Vec<NodeId> = h.node_ids().filter(|x| !keep.contains(x)).collect();
    for x in stray {
        h.remove(x);
    }
    h.reordered(&new_order)
}
