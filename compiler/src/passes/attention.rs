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
    // Outputs an earlier match replaced: one attention may read another's output.
    let mut replaced: std::collections::BTreeMap<NodeId, NodeId> = Default::default();
    for f in &found {
        let m = |x: NodeId| replaced.get(&x).copied().unwrap_or(x);
        let f = &Found {
            q: m(f.q),
            kt: m(f.kt),
            v: m(f.v),
            dead: f.dead.clone(),
            ..*f
        };
        let Some(plan) = rewrite(&mut h, f, &order) else {
            continue;
        };
        if let Some(&att) = plan
            .at_output
            .iter()
            .find(|&&x| matches!(h.node(x).op, Op::Attention { .. }))
        {
            replaced.insert(f.o, att);
        }
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

/// `x` with pairs of permutes that undo each other looked through.
fn canon(g: &Graph, mut x: NodeId) -> NodeId {
    loop {
        let Op::Permute { perm: outer } = &g.node(x).op else {
            return x;
        };
        let inner_node = g.node(x).inputs[0];
        let Op::Permute { perm: inner } = &g.node(inner_node).op else {
            return x;
        };
        // Axis `i` of `x` is axis `inner[outer[i]]` of the inner permute's operand.
        if outer.iter().enumerate().any(|(i, &o)| inner[o] != i) {
            return x;
        }
        x = g.node(inner_node).inputs[0];
    }
}

/// `x`'s operand when `x` swaps the last two axes of it.
fn swapped_from(g: &Graph, x: NodeId) -> Option<NodeId> {
    let r = g.ty(x).rank();
    if r < 2 {
        return None;
    }
    let swap: Vec<usize> = (0..r.saturating_sub(2)).chain([r - 1, r - 2]).collect();
    match &g.node(x).op {
        Op::Permute { perm } if *perm == swap => g.node(x).inputs.first().copied(),
        _ => None,
    }
}

/// The binary `op` node `n` as its operands, the one for which `first` holds first.
fn operands_with(
    g: &Graph,
    n: NodeId,
    op: BinaryOp,
    first: impl Fn(NodeId) -> bool,
) -> Option<(NodeId, NodeId)> {
    if g.node(n).op != Op::Binary(op) {
        return None;
    }
    let (a, b) = (g.node(n).inputs[0], g.node(n).inputs[1]);
    if first(a) {
        Some((a, b))
    } else if first(b) {
        Some((b, a))
    } else {
        None
    }
}

/// One attention backward pass as the rewrite above leaves it, from the rebuilt
/// probabilities `p`:
///
/// ```text
/// dv = pᵀ G;  ds = p (G vᵀ - delta);  [where(mask, ds, 0)];  dsc = ds · scale
/// dq = dsc k;  dkᵀ = qᵀ dsc  (or dk = dscᵀ q)
/// ```
struct Backward {
    q: NodeId,
    k: NodeId,
    v: NodeId,
    g: NodeId,
    lse: NodeId,
    delta: NodeId,
    causal: bool,
    scale: f32,
    dq: NodeId,
    /// `dk`, and whether the graph computes it transposed (`[.., D, S]`).
    dk: (NodeId, bool),
    dv: NodeId,
    /// The matched nodes, which the rewrite removes.
    chain: Vec<NodeId>,
}

fn find_backward(g: &Graph, p: NodeId) -> Option<Backward> {
    if g.node(p).op != Op::Unary(UnaryOp::Exp) {
        return None;
    }
    let sub = g.node(p).inputs[0];
    let (m, lr) = (*g.node(sub).inputs.first()?, *g.node(sub).inputs.get(1)?);
    if g.node(sub).op != Op::Binary(BinaryOp::Sub) || !single_use(g, sub, p) {
        return None;
    }
    let lse = match g.node(lr).op {
        Op::Reshape { .. } => g.node(lr).inputs[0],
        _ => return None,
    };
    let Op::AttentionLse { causal, scale } = g.node(lse).op else {
        return None;
    };
    let (q, k) = (g.node(lse).inputs[0], g.node(lse).inputs[1]);
    // The forward attention over the same `q` and `k` gives `v`.
    let v = g.node_ids().find_map(|a| {
        (g.node(a).op == Op::Attention { causal, scale } && g.node(a).inputs[..2] == [q, k])
            .then(|| g.node(a).inputs[2])
    })?;
    let (mut scaled, mut mask) = (m, None);
    if g.node(m).op == Op::Where {
        mask = Some(g.node(m).inputs[0]);
        scaled = g.node(m).inputs[1];
        if !single_use(g, scaled, m) {
            return None;
        }
    }
    if mask.is_some() != causal || !single_use(g, m, sub) {
        return None;
    }
    let (s, c) = operands_with(g, scaled, BinaryOp::Mul, |x| {
        matches!(g.node(x).op, Op::MatMul)
    })?;
    // The scale as the forward op holds it (f32; the program's literal may be f64).
    let is_scale = |c: NodeId| literal(g, c).is_some_and(|x| x as f32 == scale);
    if !is_scale(c) || !single_use(g, s, scaled) || g.node(s).inputs[0] != q {
        return None;
    }
    // The readers of `p`: `pᵀ` for `dv`, and `p (dp - delta)`.
    let [r0, r1] = g.users(p)[..] else {
        return None;
    };
    let (pt, pm) = if swapped_from(g, r0) == Some(p) {
        (r0, r1)
    } else {
        (r1, r0)
    };
    let reads_once = |by: NodeId| g.node(by).inputs.iter().filter(|&&x| x == p).count() == 1;
    if swapped_from(g, pt) != Some(p) || !reads_once(pm) {
        return None;
    }
    let [dv] = g.users(pt)[..] else {
        return None;
    };
    if !matches!(g.node(dv).op, Op::MatMul) || g.node(dv).inputs[0] != pt {
        return None;
    }
    let gout = g.node(dv).inputs[1];
    let (_, x) = operands_with(g, pm, BinaryOp::Mul, |x| x == p)?;
    if g.node(x).op != Op::Binary(BinaryOp::Sub) || !single_use(g, x, pm) {
        return None;
    }
    let (dp, delta) = (g.node(x).inputs[0], g.node(x).inputs[1]);
    let dp_ok = matches!(g.node(dp).op, Op::MatMul)
        && g.node(dp).inputs[0] == gout
        && swapped_from(g, g.node(dp).inputs[1]).map(|y| canon(g, y)) == Some(canon(g, v));
    let mut stat = g.ty(lr).clone();
    stat.dtype = DType::F32;
    if !dp_ok || !single_use(g, dp, x) || *g.ty(delta) != stat || *g.ty(lr) != stat {
        return None;
    }
    let mut chain = vec![s, scaled, sub, p, pt, dv, dp, x, pm];
    if mask.is_some() {
        chain.push(m);
    }
    // `where(mask, ds, 0)` when causal (the probabilities are 0 there already), then the
    // scale.
    let mut ds = pm;
    if let Some(mk) = mask {
        let [w] = g.users(pm)[..] else {
            return None;
        };
        let ins = &g.node(w).inputs;
        if g.node(w).op != Op::Where || ins[0] != mk || ins[1] != pm || literal(g, ins[2])? != 0.0 {
            return None;
        }
        chain.push(w);
        ds = w;
    }
    let [sc] = g.users(ds)[..] else {
        return None;
    };
    let (_, c2) = operands_with(g, sc, BinaryOp::Mul, |y| y == ds)?;
    if !is_scale(c2) || !single_use(g, ds, sc) {
        return None;
    }
    chain.push(sc);
    // `dq = dsc k`, and `dkᵀ = qᵀ dsc` or `dk = dscᵀ q`.
    let (mut dq, mut dk) = (None, None);
    for u in g.users(sc) {
        let ins = &g.node(u).inputs;
        if swapped_from(g, u) == Some(sc) {
            let [m2] = g.users(u)[..] else {
                return None;
            };
            let ok = matches!(g.node(m2).op, Op::MatMul)
                && g.node(m2).inputs[0] == u
                && canon(g, g.node(m2).inputs[1]) == canon(g, q);
            if !ok || dk.is_some() {
                return None;
            }
            chain.extend([u, m2]);
            dk = Some((m2, false));
        } else if matches!(g.node(u).op, Op::MatMul) && ins[0] == sc {
            if canon(g, ins[1]) != canon(g, k) || dq.is_some() {
                return None;
            }
            chain.push(u);
            dq = Some(u);
        } else if matches!(g.node(u).op, Op::MatMul) && ins[1] == sc {
            let qt = swapped_from(g, ins[0]).map(|y| canon(g, y));
            if qt != Some(canon(g, q)) || dk.is_some() {
                return None;
            }
            chain.push(u);
            dk = Some((u, true));
        } else {
            return None;
        }
    }
    if g.users(sc).len() != 2 {
        return None;
    }
    let (dq, dk) = (dq?, dk?);
    // Shapes the gradient kernels take, with `q`, `k`, `v` and `G` of one dtype.
    let r = g.ty(q).rank();
    let (d, e) = (g.ty(q).dims()[r - 1], g.ty(v).dims()[r - 1]);
    let dim_ok = |x: usize| (16..=MAX_HEAD_DIM).contains(&x) && x.is_power_of_two();
    let dt = g.ty(q).dtype;
    let same = [k, v, gout].iter().all(|&y| g.ty(y).dtype == dt);
    (dim_ok(d) && dim_ok(e) && same).then_some(Backward {
        q,
        k,
        v,
        g: gout,
        lse: lr,
        delta,
        causal,
        scale,
        dq,
        dk,
        dv,
        chain,
    })
}

/// Replaces each attention backward pass the rewrite above leaves ([`find_backward`]) by
/// two flash-attention gradient kernels, `dq` and `dk`/`dv` ([`Op::AttentionGrad`]), which
/// rebuild the probabilities block by block (on tensor cores under mixed precision, in f32
/// FFMA otherwise) and store no `[.., T, S]` tensor. Returns `g` itself when there is none.
pub fn fuse_attention_backward(g: &Graph) -> Graph {
    let Some(order) = g.topo_order() else {
        return g.clone();
    };
    let found: Vec<Backward> = order.iter().filter_map(|&p| find_backward(g, p)).collect();
    if found.is_empty() {
        return g.clone();
    }
    let at: std::collections::BTreeMap<NodeId, usize> =
        order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut h = g.clone();
    let mut after: std::collections::BTreeMap<NodeId, Vec<NodeId>> = Default::default();
    let mut dead: std::collections::BTreeSet<NodeId> = Default::default();
    // Gradients an earlier match replaced: one attention's operand may be another's
    // gradient (`attention(q, k, attention(..))`).
    let mut replaced: std::collections::BTreeMap<NodeId, NodeId> = Default::default();
    for b in &found {
        let m = |x: NodeId| replaced.get(&x).copied().unwrap_or(x);
        let b = Backward {
            q: m(b.q),
            k: m(b.k),
            v: m(b.v),
            g: m(b.g),
            lse: m(b.lse),
            delta: m(b.delta),
            chain: b.chain.clone(),
            ..*b
        };
        if b.chain.iter().any(|x| replaced.contains_key(x)) {
            continue;
        }
        let Some((nodes, news)) = rewrite_backward(&mut h, &b) else {
            continue;
        };
        replaced.extend(news);
        // Placed after the last of their operands in the old order (each old gradient
        // came after all of them); they wait there for any operand not placed yet.
        let anchor = [b.q, b.k, b.v, b.g, b.lse, b.delta]
            .iter()
            .filter_map(|x| at.get(x).map(|&i| (i, *x)))
            .max();
        let Some((_, last)) = anchor else {
            continue;
        };
        after.entry(last).or_default().extend(nodes);
        dead.extend(b.chain.iter().copied());
    }
    // The chains, then what only they read (the mask, literals).
    let mut stack: Vec<NodeId> = Vec::new();
    for &n in &dead {
        stack.extend(h.node(n).inputs.iter().filter(|x| !dead.contains(x)));
        h.remove(n);
    }
    while let Some(x) = stack.pop() {
        if dead.contains(&x) || !h.users(x).is_empty() {
            continue;
        }
        let ins = h.node(x).inputs.clone();
        if h.remove_if_unused(x) {
            dead.insert(x);
            stack.extend(ins);
        }
    }
    // The old order with the new nodes after their anchors; a node is placed once all
    // its operands are (readers of an old `dv`, a view, may come before `delta`), the
    // others keeping their order.
    let mut seq: Vec<NodeId> = Vec::with_capacity(order.len());
    for &n in &order {
        if !dead.contains(&n) {
            seq.push(n);
        }
        if let Some(a) = after.get(&n) {
            seq.extend(a);
        }
    }
    let mut placed: std::collections::BTreeSet<NodeId> = Default::default();
    let mut pending: Vec<NodeId> = Vec::new();
    let mut new_order = Vec::with_capacity(seq.len());
    for x in seq {
        pending.push(x);
        let mut progress = true;
        while progress {
            progress = false;
            let mut i = 0;
            while i < pending.len() {
                if h.node(pending[i]).inputs.iter().all(|x| placed.contains(x)) {
                    let n = pending.remove(i);
                    placed.insert(n);
                    new_order.push(n);
                    progress = true;
                } else {
                    i += 1;
                }
            }
        }
    }
    if !pending.is_empty() || new_order.len() != h.node_count() {
        return g.clone();
    }
    h.reordered(&new_order)
}

/// Old gradients with the nodes that replace them.
type Replaced = Vec<(NodeId, NodeId)>;

/// Adds the two gradient kernels (and the views that split `dk` from `dv`) and makes the
/// old gradients' readers read them; returns the added nodes in order, and each old
/// gradient with its replacement.
fn rewrite_backward(h: &mut Graph, b: &Backward) -> Option<(Vec<NodeId>, Replaced)> {
    let span = h.node(b.dq).span;
    let block = h.node(b.dq).block;
    let mut added = Vec::new();
    let mut add = |h: &mut Graph, op: Op, ins: Vec<NodeId>| -> Option<NodeId> {
        let x = h.add(op, ins, span, None).ok()?;
        h.mark_backward(x);
        if let Some(bl) = block {
            h.set_block(x, bl);
        }
        added.push(x);
        Some(x)
    };
    let ins = vec![b.q, b.k, b.v, b.g, b.lse, b.delta];
    let (causal, scale) = (b.causal, b.scale);
    let dq = add(
        h,
        Op::AttentionGrad {
            causal,
            scale,
            kv: false,
        },
        ins.clone(),
    )?;
    let kv = add(
        h,
        Op::AttentionGrad {
            causal,
            scale,
            kv: true,
        },
        ins,
    )?;
    let dims = h.ty(kv).dims().to_vec();
    let r = dims.len();
    let d = h.ty(b.q).dims()[r - 1];
    let slice = |lo: usize, hi: usize| {
        let mut ranges: Vec<(usize, usize)> = dims.iter().map(|&x| (0, x)).collect();
        ranges[r - 1] = (lo, hi);
        Op::Slice { ranges }
    };
    let dk = add(h, slice(0, d), vec![kv])?;
    let dv = add(h, slice(d, dims[r - 1]), vec![kv])?;
    let (old_dk, transposed) = b.dk;
    let dk = if transposed {
        let swap: Vec<usize> = (0..r - 2).chain([r - 1, r - 2]).collect();
        add(h, Op::Permute { perm: swap }, vec![dk])?
    } else {
        dk
    };
    if [(b.dq, dq), (old_dk, dk), (b.dv, dv)]
        .iter()
        .any(|&(old, new)| h.ty(old) != h.ty(new))
    {
        for &x in added.iter().rev() {
            h.remove(x);
        }
        return None;
    }
    let news = vec![(b.dq, dq), (old_dk, dk), (b.dv, dv)];
    for &(old, new) in &news {
        h.replace_all_uses(old, new);
    }
    Some((added, news))
}
