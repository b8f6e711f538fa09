//! Layout selection: which buffers are stored channels-last.
//!
//! The language's logical layout is NCHW, and inputs, outputs, params and optimizer state
//! keep it (the caller sees them). A buffer's physical layout is only a permutation of its
//! axes in the index arithmetic of every load and store (`lower::Builder::buffer_index`),
//! so choosing NHWC for the intermediates of a convolution chain costs no copy: the kernels
//! at the chain's boundaries read one layout and write the other. The matmul anchor reads
//! strides from the same arithmetic. Views never copy; a contiguous copy is made only where
//! a matmul's B operand is not contiguous along its columns (`lower::Builder::matmul_spec`).
//!
//! On the CPU, channels-last makes a window's channels one contiguous run, which the
//! implicit GEMM's packing copies on vectors (`back::clif`). On CUDA, channels-last is what lets a convolution and its input gradient run as implicit
//! GEMMs (their rows `[N, H, W]` lead the output's domain, and the gathered activation is
//! contiguous along `k`): the cnn example's step takes 43 ms in NHWC and 133 ms in NCHW on
//! an H100 (`--layout`).
//!
//! A 4-D intermediate belongs to a convolution chain when a convolution, pooling or their
//! gradients produces it or reads it, directly or through pointwise ops and views.
//!
//! A matmul read only through one permutation of its axes that keeps the columns last is
//! stored in that permuted order ([`permuted_products`]): attention's `p @ v`, `[B, H, T,
//! Dh]`, read as `[B, T, H * Dh]` by the output projection, is written as `[B, T, H, Dh]`,
//! and the projection and its weight gradient read it in place instead of a copy (on gpt,
//! 24 copy kernels a step fewer).

use super::lower::matmul_anchor_ok;
use crate::ir::{Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet};

/// Ops a channels-last layout passes through unchanged. An `all_reduce` sums each element
/// across the ranks where it lies, so it takes its operand's layout and reduces it in place
/// (a convolution's weight gradient, summed on its own: not a permuting copy).
fn passes_layout(op: &Op) -> bool {
    op.is_elementwise() || matches!(op, Op::BroadcastTo { .. } | Op::AllReduce)
}

/// NHWC for every materialized 4-D intermediate of a convolution chain.
pub fn channels_last(g: &Graph, materialized: &BTreeSet<NodeId>) -> BTreeMap<NodeId, Vec<usize>> {
    let outputs: BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    let updates: BTreeSet<NodeId> = g.updates.iter().map(|&(_, v)| v).collect();
    // A reduce-scatter's shards are runs of its operand's bytes, which must be in logical
    // order to line up with the param's shards.
    let sharded: BTreeSet<NodeId> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::ReduceScatter { .. }))
        .flat_map(|n| g.node(n).inputs.clone())
        .collect();
    // An attention gradient's tensor-core kernel stages rows contiguous along the head
    // dimension (it has no strided fallback).
    let attention_rows: BTreeSet<NodeId> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::AttentionGrad { .. }))
        .flat_map(|n| g.node(n).inputs.clone())
        .collect();
    // Nodes connected to a conv-family op through layout-preserving ops.
    let mut in_chain: BTreeSet<NodeId> = BTreeSet::new();
    let mut stack: Vec<NodeId> = Vec::new();
    for n in g.node_ids() {
        if g.node(n).op.is_spatial() {
            stack.push(n);
            stack.extend(g.node(n).inputs.iter().copied());
        }
    }
    while let Some(n) = stack.pop() {
        if g.ty(n).rank() != 4 || !in_chain.insert(n) {
            continue;
        }
        let node = g.node(n);
        if passes_layout(&node.op) || node.op.is_spatial() {
            stack.extend(node.inputs.iter().copied());
        }
        for u in g.users(n) {
            if passes_layout(&g.node(u).op) || g.node(u).op.is_spatial() {
                stack.push(u);
            }
        }
    }
    in_chain
        .into_iter()
        .filter(|n| {
            let op = &g.node(*n).op;
            materialized.contains(n)
                && (passes_layout(op) || op.is_spatial())
                && !outputs.contains(n)
                && !updates.contains(n)
                && !sharded.contains(n)
                && !attention_rows.contains(n)
        })
        .map(|n| (n, vec![0, 2, 3, 1]))
        .collect()
}

/// The matmuls and attention outputs stored in the order of the one permutation that
/// reads them (every use is a permute, or a chain of them, by the same `perm` in all, which
/// keeps the last axis last, or an elementwise op of the same shape, which reads any layout
/// alike): `perm` as their layout. Attention's `[B, H, T, Dh]` output, read as
/// `reshape(permute(o, [0, 2, 1, 3]), [B, T, H·Dh])`, is then stored as the merged heads
/// the projection reads in place (gpt: one copy a layer fewer).
pub fn permuted_products(
    g: &Graph,
    materialized: &BTreeSet<NodeId>,
) -> BTreeMap<NodeId, Vec<usize>> {
    let read_by_caller = g.read_by_caller();
    let mut out = BTreeMap::new();
    for &n in materialized {
        let rank = g.ty(n).rank();
        let product = matmul_anchor_ok(g, n)
            || matches!(
                g.node(n).op,
                Op::Attention { .. } | Op::AttentionGrad { kv: false, .. }
            );
        if !product || rank < 3 || read_by_caller.contains(&n) {
            continue;
        }
        let same_shape_elementwise =
            |u: NodeId| g.node(u).op.is_elementwise() && g.ty(u).shape == g.ty(n).shape;
        let mut perms = g
            .users(n)
            .into_iter()
            .filter(|&u| !same_shape_elementwise(u))
            .map(|u| read_through_permutes(g, u, materialized));
        let Some(Some(perm)) = perms.next() else {
            continue;
        };
        let same = perms.all(|p| p.as_ref() == Some(&perm));
        let identity = perm.iter().enumerate().all(|(i, &a)| i == a);
        if same && !identity && perm.last() == Some(&(rank - 1)) {
            out.insert(n, perm);
        }
    }
    out
}

/// The permutation that user `u` of a tensor applies to it: `u` is a permute, followed
/// through the permutes that are its only use (and have no buffer); `None` otherwise.
fn read_through_permutes(
    g: &Graph,
    u: NodeId,
    materialized: &BTreeSet<NodeId>,
) -> Option<Vec<usize>> {
    let Op::Permute { perm } = &g.node(u).op else {
        return None;
    };
    let mut perm = perm.clone();
    let mut at = u;
    while !materialized.contains(&at) {
        let users = g.users(at);
        let [next] = users.as_slice() else { break };
        let Op::Permute { perm: q } = &g.node(*next).op else {
            break;
        };
        // `next` axis i is `at` axis q[i], which is the tensor's axis perm[q[i]].
        perm = q.iter().map(|&a| perm[a]).collect();
        at = *next;
    }
    Some(perm)
}
