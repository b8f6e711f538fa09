//! Fused attention (CUDA): the prelude's `attention` composite becomes one
//! [`Op::Attention`] kernel that never stores its scores or probabilities.
//!
//! After autodiff, causal or plain attention reads
//!
//! ```text
//! s = (q @ kt) * c;  m = where(tril(..), s, -inf)   (or m = s)
//! e = exp(m - max(m));  p = e / sum(e);  o = p @ v
//! ```
//!
//! and its gradient reads `p` (for `dv = pᵀ do` and `ds = p (dp - rowsum(do o))`) and `o`.
//! The rewrite replaces `o` by `attention(q, k, v)`, adds `lse = attention_lse(q, k)` (the
//! row log-sum-exp, stored by the same kernel), and rebuilds `p` where the gradient first
//! needs it as `exp(where(tril(..), (q @ kt) * c, -inf) - lse)`: one matmul with an
//! epilogue, the same causal skip, no softmax rows. The `[.., T, S]` scores and
//! probabilities no longer live from the forward pass to the backward pass (gpt: 100 MB a
//! layer), and the forward pass reads and writes none of them.
//!
//! The pipeline runs it as the `attention` stage, for CUDA with fusion only, on the shapes the back end's
//! kernel takes ([`supported`]); elsewhere the composite stays as it is.

use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceOp, Scalar, UnaryOp};

pub use crate::ir::ops::{
    attention_supported as supported, MAX_ATTENTION_HEAD_DIM as MAX_HEAD_DIM,
};

/// One match of the composite.
struct Found {
    q: NodeId,
    /// `kᵀ` as the scores' matmul reads it (`[.., D, S]`).
    kt: NodeId,
    v: NodeId,
    /// The mask (a `tril` of `true`s) when causal.
    mask: Option<NodeId>,
    neg_inf: Option<NodeId>,
    scale: f32,
    /// Nodes the rewrite removes: the scores' matmul, its scaling, the mask's `where`, the
    /// softmax, the probabilities and the output matmul.
    dead: Vec<NodeId>,
    p: NodeId,
    o: NodeId,
}

fn literal(g: &Graph, n: NodeId) -> Option<f64> {
    match g.node(n).op {
        Op::Literal {
            value: Scalar::Float(v),
            ..
        } => Some(v),
        _ => None,
    }
}

fn single_use(g: &Graph, n: NodeId, by: NodeId) -> bool {
    g.users(n) == [by] && g.node(by).inputs.iter().filter(|&&x| x == n).count() == 1
}

/// Whether `n` is read by `a` and `b` and nothing else.
fn used_only_by(g: &Graph, n: NodeId, mut by: [NodeId; 2]) -> bool {
    let mut users = g.users(n);
    users.sort();
    by.sort();
    users == by
}

/// The last-axis row reduction `op` of `x`, kept.
fn row_reduce(g: &Graph, n: NodeId, op: ReduceOp) -> Option<NodeId> {
    let node = g.node(n);
    match &node.op {
        Op::Reduce {
            op: o,
            axes,
            keepdim: true,
        } if *o == op && axes.len() == 1 => {
            let x = *node.inputs.first()?;
            (axes[0] + 1 == g.ty(x).rank()).then_some(x)
        }
        _ => None,
    }
}

/// `tril(full(true, [T, S]), k: S - T)`: the prelude's causal mask.
fn causal_mask(g: &Graph, n: NodeId, t: usize, s: usize) -> bool {
    let node = g.node(n);
    let Op::Tri { upper: false, k } = node.op else {
        return false;
    };
    let Some(&full) = node.inputs.first() else {
        return false;
    };
    let is_true = matches!(
        &g.node(full).op,
        Op::Full {
            value: Scalar::Bool(true),
            ..
        }
    );
    is_true && g.ty(n).dims() == [t, s] && k == s as i64 - t as i64
}

/// Matches the composite whose output matmul is `o`.
fn find(g: &Graph, o: NodeId) -> Option<Found> {
    let on = g.node(o);
    if !matches!(on.op, Op::MatMul) {
        return None;
    }
    let (p, v) = (*on.inputs.first()?, *on.inputs.get(1)?);
    let pn = g.node(p);
    if !matches!(pn.op, Op::Binary(BinaryOp::Div)) {
        return None;
    }
    let (e, ssum) = (pn.inputs[0], pn.inputs[1]);
    if row_reduce(g, ssum, ReduceOp::Sum)? != e || !single_use(g, ssum, p) {
        return None;
    }
    if !used_only_by(g, e, [ssum, p]) || !matches!(g.node(e).op, Op::Unary(UnaryOp::Exp)) {
        return None;
    }
    let sub = g.node(e).inputs[0];
    if !matches!(g.node(sub).op, Op::Binary(BinaryOp::Sub)) || !single_use(g, sub, e) {
        return None;
    }
    let (m, mx) = (g.node(sub).inputs[0], g.node(sub).inputs[1]);
    if row_reduce(g, mx, ReduceOp::Max)? != m || !single_use(g, mx, sub) {
        return None;
    }
    if !used_only_by(g, m, [mx, sub]) {
        return None;
    }
    // The scores, masked or not.
    let (scaled, mask, neg_inf) = match g.node(m).op {
        Op::Where => {
            let ins = &g.node(m).inputs;
            let (c, x, y) = (ins[0], ins[1], ins[2]);
            (literal(g, y)? == f64::NEG_INFINITY).then_some(())?;
            (x, Some(c), Some(y))
        }
        Op::Binary(BinaryOp::Mul) => (m, None, None),
        _ => return None,
    };
    if mask.is_some() && !single_use(g, scaled, m) {
        return None;
    }
    let sn = g.node(scaled);
    if !matches!(sn.op, Op::Binary(BinaryOp::Mul)) {
        return None;
    }
    let (s, c) = (sn.inputs[0], sn.inputs[1]);
    let scale = literal(g, c)?;
    if !(scale > 0.0 && scale.is_finite() && single_use(g, s, scaled)) {
        return None;
    }
    if !matches!(g.node(s).op, Op::MatMul) {
        return None;
    }
    let (q, kt) = (g.node(s).inputs[0], g.node(s).inputs[1]);
    // Shapes: q [.., T, D], kt [.., D, S], v [.., S, E], every leading dim equal.
    let (qd, kd, vd) = (g.ty(q).dims(), g.ty(kt).dims(), g.ty(v).dims());
    let r = qd.len();
    if r < 3 || kd.len() != r || vd.len() != r {
        return None;
    }
    let (t, d, sl, e_dim) = (qd[r - 2], qd[r - 1], kd[r - 1], vd[r - 1]);
    let same_batch = qd[..r - 2] == kd[..r - 2] && qd[..r - 2] == vd[..r - 2];
    let f32s = [q, kt, v].iter().all(|&x| g.ty(x).dtype == DType::F32);
    if !same_batch || !f32s || kd[r - 2] != d || vd[r - 2] != sl || !supported(d, e_dim) {
        return None;
    }
    if let Some(c) = mask {
        if !causal_mask(g, c, t, sl) {
            return None;
        }
    }
    let mut dead = vec![s, scaled, mx, sub, e, ssum, p, o];
    if mask.is_some() {
        dead.push(m);
    }
    Some(Found {
        q,
        kt,
        v,
        mask,
        neg_inf,
        scale: scale as f32,
        dead,
        p,
        o,
    })
}

/// `k` as `[.., S, D]`: the input of `kt` when `kt` is the transpose of its last two axes,
/// else a new transpose (a view).
fn untransposed(g: &mut Graph, kt: NodeId, added: &mut Vec<NodeId>) -> Option<NodeId> {
    let r = g.ty(kt).rank();
    let swap: Vec<usize> = (0..r - 2).chain([r - 1, r - 2]).collect();
    if let Op::Permute { perm } = &g.node(kt).op {
        if *perm == swap {
            return g.node(kt).inputs.first().copied();
        }
    }
    let span = g.node(kt).span;
    let k = g
        .add(Op::Permute { perm: swap }, vec![kt], span, None)
        .ok()?;
    added.push(k);
    Some(k)
}

/// Rewrites every attention composite of `g` that [`supported`] takes; returns `g` itself
/// when there is none.
pub fn fuse_attention(g: &Graph) -> Graph {
    let Some(order) = g.topo_order() else {
        return g.clone();
    };
    let found: Vec<Found> = order.iter().filter_map(|&o| find(g, o)).collect();
    if found.is_empty() {
        return g.clone();
    }
    let mut h = g.clone();
    // Nodes to place before a node of the old order, and nodes that replace one.
    let mut before: std::collections::BTreeMap<NodeId, Vec<NodeId>> = Default::default();
    let mut replace: std::collections::BTreeMap<NodeId, Vec<NodeId>> = Default::default();
    let mut dead: std::collections::BTreeSet<NodeId> = Default::default();
    let mut skip: std::collections::BTreeSet<NodeId> = Default::default();
    for f in &found {
        let Some(plan) = rewrite(&mut h, f, &order) else {
            continue;
        };
        replace.insert(f.o, plan.at_output.clone());
        if let Some((first, nodes)) = plan.rebuilt {
            before.entry(first).or_default().extend(nodes);
        }
        dead.extend(f.dead.iter().copied());
        skip.extend(plan.moved);
    }
    if replace.is_empty() {
        return g.clone();
    }
    let mut new_order = Vec::with_capacity(order.len());
    for &n in &order {
        if let Some(b) = before.get(&n) {
            new_order.extend(b);
        }
        if let Some(r) = replace.get(&n) {
            new_order.extend(r);
        } else if !dead.contains(&n) && !skip.contains(&n) {
            new_order.push(n);
        }
    }
    for &n in &dead {
        h.remove(n);
    }
    h.reordered(&new_order)
}

struct Plan {
    /// The nodes that take the output matmul's place (the attention and its row
    /// statistics, with any transpose of `k` they need).
    at_output: Vec<NodeId>,
    /// The first later reader of the probabilities and the nodes that rebuild them there
    /// (then the moved views).
    rebuilt: Option<(NodeId, Vec<NodeId>)>,
    /// Views of the probabilities that move from before the output to the rebuilt ones.
    moved: Vec<NodeId>,
}

fn rewrite(h: &mut Graph, f: &Found, order: &[NodeId]) -> Option<Plan> {
    // The probabilities' readers besides the output matmul (the gradient's) read the
    // statistics the attention kernel stores: readers the schedule put before the output
    // (views, such as the transpose `dv = pᵀ do` reads) move after it, with the views
    // that read them.
    let readers: Vec<NodeId> = h.users(f.p).into_iter().filter(|&u| u != f.o).collect();
    let at = |n: NodeId| order.iter().position(|&x| x == n);
    let o_at = at(f.o)?;
    let mut moved: Vec<NodeId> = Vec::new();
    let mut stack: Vec<NodeId> = readers.clone();
    while let Some(x) = stack.pop() {
        if at(x)? > o_at || moved.contains(&x) {
            continue;
        }
        if !h.node(x).op.is_view_candidate() {
            return None;
        }
        moved.push(x);
        stack.extend(h.users(x));
    }
    moved.sort_by_key(|&x| at(x));
    let first = order[o_at + 1..].iter().copied().find(|&n| {
        h.node(n)
            .inputs
            .iter()
            .any(|i| *i == f.p || moved.contains(i))
    });
    if first.is_none() && !readers.is_empty() {
        return None;
    }
    let on = h.node(f.o).clone();
    let span = on.span;
    let causal = f.mask.is_some();
    let scale = f.scale;
    let mut at_output = Vec::new();
    let k = untransposed(h, f.kt, &mut at_output)?;
    let att = h
        .add(
            Op::Attention { causal, scale },
            vec![f.q, k, f.v],
            span,
            None,
        )
        .ok()?;
    let tag = |h: &mut Graph, x: NodeId| {
        if on.backward {
            h.mark_backward(x);
        }
        if let Some(b) = on.block {
            h.set_block(x, b);
        }
    };
    tag(h, att);
    at_output.push(att);
    h.replace_all_uses(f.o, att);
    let mut rebuilt = None;
    if let Some(first) = first {
        // The statistics, only for a gradient that reads the probabilities.
        let lse = h
            .add(Op::AttentionLse { causal, scale }, vec![f.q, k], span, None)
            .ok()?;
        tag(h, lse);
        at_output.push(lse);
        let fspan = h.node(first).span;
        let mut nodes = Vec::new();
        let mut add = |h: &mut Graph, op: Op, ins: Vec<NodeId>| -> Option<NodeId> {
            let x = h.add(op, ins, fspan, None).ok()?;
            h.mark_backward(x);
            if let Some(b) = h.node(first).block {
                h.set_block(x, b);
            }
            nodes.push(x);
            Some(x)
        };
        let s = add(h, Op::MatMul, vec![f.q, f.kt])?;
        let c = add(
            h,
            Op::Literal {
                value: Scalar::Float(f64::from(scale)),
                dtype: DType::F32,
            },
            vec![],
        )?;
        let mut m = add(h, Op::Binary(BinaryOp::Mul), vec![s, c])?;
        if let (Some(mask), Some(ninf)) = (f.mask, f.neg_inf) {
            m = add(h, Op::Where, vec![mask, m, ninf])?;
        }
        let mut shape = h.ty(lse).dims().to_vec();
        shape.push(1);
        let lr = add(
            h,
            Op::Reshape {
                shape: crate::ir::Shape(shape),
            },
            vec![lse],
        )?;
        let d = add(h, Op::Binary(BinaryOp::Sub), vec![m, lr])?;
        let p = add(h, Op::Unary(UnaryOp::Exp), vec![d])?;
        for u in readers {
            h.replace_use_in(u, f.p, p);
        }
        nodes.extend(&moved);
        rebuilt = Some((first, nodes));
    }
    Some(Plan {
        at_output,
        rebuilt,
        moved,
    })
}
