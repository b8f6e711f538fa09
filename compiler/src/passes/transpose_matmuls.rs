//! Compute a transposed matmul result directly: `transpose(a @ b)` becomes `bᵀ @ aᵀ`.
//!
//! Expects a verified graph after autodiff. A matmul whose only use swaps its last two
//! axes is replaced by the matmul of its operands transposed and swapped, itself viewed
//! through the same swap (so every user keeps its operand and type; the two swaps compose
//! to the identity in the views of whatever reads it). Autodiff makes one in every
//! attention layer: the key gradient is `transpose(qᵀ @ ds)`, whose result was stored as
//! `[.., d, t]` and read across its rows by the concatenation of the q, k and v gradients
//! (1.3 ms of uncoalesced loads a gpt step on an H100). Operands that are themselves
//! swaps are read through (`transpose(transpose(x))` is `x`). Used by
//! the pipeline as the `transpose_matmuls` stage, after `attention`. Cost: one pass over the nodes; three
//! new nodes per rewrite.

use crate::ir::{Graph, NodeId, Op};

/// Rewrites every matmul read only through a swap of its last two axes; returns the
/// rewritten graph (order kept).
pub fn transpose_matmuls(g: &Graph) -> Graph {
    let read = g.read_by_caller();
    let mut h = super::replace_in_order(g, |h, n| {
        let node = h.node(n).clone();
        if !matches!(node.op, Op::MatMul) || read.contains(&n) {
            return None;
        }
        let r = node.ty.rank();
        let users = h.users(n);
        let only = match users.as_slice() {
            [u] => *u,
            _ => return None,
        };
        let (a, b) = (node.inputs[0], node.inputs[1]);
        if !is_swap(h, only) || h.ty(a).rank() < 2 || h.ty(b).rank() < 2 || r < 2 {
            return None;
        }
        let mut added = Vec::new();
        let mut swapped = |h: &mut Graph, x: NodeId| -> Option<NodeId> {
            if is_swap(h, x) {
                return Some(h.node(x).inputs[0]);
            }
            let y = h.add(swap(h.ty(x).rank()), vec![x], node.span, node.checkpoint);
            let y = y.ok()?;
            added.push(y);
            Some(y)
        };
        let (bt, at) = (swapped(h, b)?, swapped(h, a)?);
        let mm = h
            .add(Op::MatMul, vec![bt, at], node.span, node.checkpoint)
            .ok()?;
        let back = h.add(swap(r), vec![mm], node.span, node.checkpoint).ok()?;
        for &x in added.iter().chain([&mm, &back]) {
            if node.backward {
                h.mark_backward(x);
            }
            if let Some(blk) = node.block {
                h.set_block(x, blk);
            }
        }
        added.extend([mm, back]);
        Some(added)
    });
    // Swaps of operands read through and now unused.
    let Some(order) = h.topo_order() else {
        return h;
    };
    let mut dead = Vec::new();
    for &x in &order {
        if is_swap(&h, x) && h.remove_if_unused(x) {
            dead.push(x);
        }
    }
    if dead.is_empty() {
        return h;
    }
    let order: Vec<NodeId> = order.into_iter().filter(|x| !dead.contains(x)).collect();
    h.reordered(&order)
}

/// A permutation of rank `r` that swaps the last two axes.
fn swap(r: usize) -> Op {
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    Op::Permute { perm }
}

/// True when `x` is a permute that swaps its last two axes and keeps the others.
pub(crate) fn is_swap(g: &Graph, x: NodeId) -> bool {
    let r = g.ty(x).rank();
    match &g.node(x).op {
        Op::Permute { perm } => r >= 2 && swap(r) == (Op::Permute { perm: perm.clone() }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::test_graph as graph;

    fn ops(g: &Graph) -> Vec<String> {
        g.topo_order()
            .unwrap_or_default()
            .into_iter()
            .map(|n| match &g.node(n).op {
                Op::Permute { perm } => format!("permute{perm:?}"),
                op => op.name().to_string(),
            })
            .collect()
    }

    #[test]
    fn a_transposed_product_is_computed_transposed() {
        let g = graph(
            "model t {
                input a: f32[2, 64, 32]
                input b: f32[2, 64, 48]
                let y = transpose(transpose(a) @ b) * 2.0
                output y
            }",
        );
        let h = transpose_matmuls(&g);
        crate::ir::verify::verify(&h).unwrap_or_else(|e| panic!("{e:?}"));
        // transpose(aᵀ @ b) = bᵀ @ a: a is read as it lies (its swap is gone), b through
        // one swap; the product's user keeps its swap, of the new product's swap.
        assert_eq!(
            ops(&h),
            [
                "input",
                "input",
                "permute[0, 2, 1]",
                "matmul",
                "permute[0, 2, 1]",
                "permute[0, 2, 1]",
                "literal",
                "mul"
            ]
        );
        let mm = h
            .node_ids()
            .find(|&n| matches!(h.node(n).op, Op::MatMul))
            .unwrap_or_else(|| panic!("no matmul"));
        assert_eq!(h.ty(mm).dims(), [2, 48, 32]);
    }

    #[test]
    fn a_product_with_other_uses_or_an_output_is_kept() {
        for body in [
            "let p = a @ b\n let y = transpose(p) + 1.0\n let z = p * 2.0\n output y, z",
            "let p = a @ b\n let y = transpose(p)\n output y, p",
        ] {
            let src =
                format!("model t {{\n input a: f32[16, 16]\n input b: f32[16, 16]\n {body}\n}}");
            let g = graph(&src);
            assert_eq!(ops(&transpose_matmuls(&g)), ops(&g), "{body}");
        }
    }
}
