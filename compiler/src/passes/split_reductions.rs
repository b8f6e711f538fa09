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

use crate::ir::{Graph, Op};

/// Below this many input elements a reduction stays whole.
const MIN_ELEMENTS: usize = 1 << 16;

/// Splits every large multi-axis reduction; returns the rewritten graph (node order kept,
/// each split reduction replaced in place by its two halves).
pub fn split_reductions(g: &Graph) -> Graph {
    super::replace_in_order(g, |h, n| {
        let node = h.node(n).clone();
        let Op::Reduce { op, axes, keepdim } = node.op else {
            return None;
        };
        if axes.len() < 2 || h.ty(node.inputs[0]).shape.numel() < MIN_ELEMENTS {
            return None;
        }
        let last = axes.iter().max().copied()?;
        let inner = h
            .add(
                Op::Reduce {
                    op,
                    axes: vec![last],
                    keepdim: true,
                },
                vec![node.inputs[0]],
                node.span,
                node.checkpoint,
            )
            .ok()?;
        let outer = h
            .add(
                Op::Reduce { op, axes, keepdim },
                vec![inner],
                node.span,
                node.checkpoint,
            )
            .ok()?;
        Some(vec![inner, outer])
    })
}
