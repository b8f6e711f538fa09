//! Vector-Jacobian products: for each op, the gradients of its operands given the gradient
//! `g` of its result. Forward values are read through [`Ad::fwd`], which substitutes a
//! recomputed clone for values made inside a `checkpoint { }` region.

use super::builder::R;
use super::Ad;
use crate::ir::{BinaryOp, NodeId, Op, ReduceOp, Shape, TypeError, UnaryOp};

/// Operand gradients of node `id` (one entry per operand; `None` where not needed or not
/// defined). `wants[i]` says whether operand `i` needs a gradient.
pub fn vjp(
    ad: &mut Ad,
    id: NodeId,
    g: NodeId,
    wants: &[bool],
) -> Result<Vec<Option<NodeId>>, TypeError> {
    let node = ad.b.g.node(id).clone();
    let ins = node.inputs.clone();
    let mut out: Vec<Option<NodeId>> = vec![None; ins.len()];
    let want = |i: usize| wants.get(i).copied().unwrap_or(false);
    match &node.op {
        Op::Unary(u) => {
            if want(0) {
                out[0] = unary(ad, *u, ins[0], id, g)?;
            }
        }
        Op::Binary(b) => {
            let (ga, gb) = binary(ad, *b, ins[0], ins[1], id, g, want(0), want(1))?;
            out[0] = ga;
            out[1] = gb;
        }
        Op::Where => {
            let c = ad.fwd(ins[0])?;
            if want(1) {
                let m = ad.b.mask(c, g)?;
                let s = ad.b.ty(ins[1]).shape;
                out[1] = Some(ad.b.sum_to(m, &s)?);
            }
            if want(2) {
                let z = ad.b.lit(0.0, ad.b.ty(g).dtype)?;
                let m = ad.b.where_(c, z, g)?;
                let s = ad.b.ty(ins[2]).shape;
                out[2] = Some(ad.b.sum_to(m, &s)?);
            }
        }
        Op::Cast { .. } => {
            let from = ad.b.ty(ins[0]).dtype;
            if want(0) && from.is_float() {
                out[0] = Some(ad.b.cast(g, from)?);
            }
        }
        Op::Reduce { op, axes, keepdim } => {
            if want(0) {
                out[0] = Some(reduce(ad, *op, axes, *keepdim, ins[0], id, g)?);
            }
        }
        Op::Reshape { .. } => {
            if want(0) {
                let s = ad.b.ty(ins[0]).shape;
                out[0] = Some(ad.b.reshape(g, s)?);
            }
        }
        Op::Permute { perm } => {
            if want(0) {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                out[0] = Some(ad.b.permute(g, inv)?);
            }
        }
        Op::BroadcastTo { .. } => {
            if want(0) {
                let s = ad.b.ty(ins[0]).shape;
                out[0] = Some(ad.b.sum_to(g, &s)?);
            }
        }
        Op::Concat { axis } => {
            let mut off = 0;
            for (i, &x) in ins.iter().enumerate() {
                let t = ad.b.ty(x);
                let len = t.dims()[*axis];
                if want(i) {
                    let mut ranges: Vec<(usize, usize)> =
                        ad.b.ty(g).dims().iter().map(|&d| (0, d)).collect();
                    ranges[*axis] = (off, off + len);
                    out[i] = Some(ad.b.add(Op::Slice { ranges }, vec![g])?);
                }
                off += len;
            }
        }
        Op::Slice { ranges } => {
            if want(0) {
                let full = ad.b.ty(ins[0]).shape;
                let cut: Vec<usize> = (0..ranges.len())
                    .filter(|&a| ranges[a] != (0, full.dims()[a]))
                    .collect();
                if let [axis] = cut[..] {
                    // A slice along one axis: kept as a piece, assembled with the other
                    // pieces of the same operand in one concat (no zero padding per piece).
                    ad.add_piece(ins[0], axis, ranges[axis], g);
                } else {
                    out[0] = Some(pad(ad, g, ranges, &full)?);
                }
            }
        }
        Op::Select { axis, index } => {
            if want(0) {
                let mut dims = ad.b.ty(g).dims().to_vec();
                dims.insert(*axis, 1);
                let g1 = ad.b.reshape(g, Shape(dims))?;
                ad.add_piece(ins[0], *axis, (*index, index + 1), g1);
            }
        }
        Op::MatMul => {
            let (ga, gb) = matmul(ad, ins[0], ins[1], g, want(0), want(1))?;
            out[0] = ga;
            out[1] = gb;
        }
        Op::Conv2d {
            stride,
            padding,
            groups,
        } => {
            if want(0) {
                let w = ad.fwd(ins[1])?;
                let input = ad.b.ty(ins[0]).shape;
                out[0] = Some(ad.b.add(
                    Op::Conv2dGradInput {
                        stride: *stride,
                        padding: *padding,
                        groups: *groups,
                        input,
                    },
                    vec![g, w],
                )?);
            }
            if want(1) {
                let x = ad.fwd(ins[0])?;
                let weight = ad.b.ty(ins[1]).shape;
                out[1] = Some(ad.b.add(
                    Op::Conv2dGradWeight {
                        stride: *stride,
                        padding: *padding,
                        groups: *groups,
                        weight,
                    },
                    vec![x, g],
                )?);
            }
        }
        Op::Pool2d {
            kind,
            kernel,
            stride,
            padding,
        } => {
            if want(0) {
                let x = ad.fwd(ins[0])?;
                out[0] = Some(ad.b.add(
                    Op::Pool2dGrad {
                        kind: *kind,
                        kernel: *kernel,
                        stride: *stride,
                        padding: *padding,
                    },
                    vec![x, g],
                )?);
            }
        }
        Op::Embedding => {
            if want(0) {
                let ids = ad.fwd(ins[1])?;
                let vocab = ad.b.ty(ins[0]).dims()[0];
                out[0] = Some(ad.b.add(Op::EmbeddingGrad { vocab }, vec![ids, g])?);
            }
        }
        Op::Dropout { p, seed } => {
            if want(0) {
                // The same seed gives the same mask: dropout of g is g * mask / (1 - p).
                out[0] = Some(ad.b.add(Op::Dropout { p: *p, seed: *seed }, vec![g])?);
            }
        }
        Op::Tri { upper, k } => {
            if want(0) {
                out[0] = Some(ad.b.add(
                    Op::Tri {
                        upper: *upper,
                        k: *k,
                    },
                    vec![g],
                )?);
            }
        }
        Op::Pool2dGrad { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Conv2dGradWeight { .. }
        | Op::EmbeddingGrad { .. }
        | Op::Attention { .. }
        | Op::AttentionLse { .. }
        | Op::AttentionGrad { .. }
        | Op::AllReduce
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::Shard { .. }
        | Op::Grad => {
            if wants.iter().any(|&w| w) {
                return Err(TypeError::new(
                    "E0504",
                    "second-order gradients are not supported",
                    format!("cannot differentiate `{}`", node.op.name()),
                ));
            }
        }
        Op::Input { .. }
        | Op::Param { .. }
        | Op::State { .. }
        | Op::Literal { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::ArgMax { .. } => {}
    }
    Ok(out)
}

fn unary(
    ad: &mut Ad,
    u: UnaryOp,
    x: NodeId,
    y: NodeId,
    g: NodeId,
) -> Result<Option<NodeId>, TypeError> {
    let b_dtype = ad.b.ty(g).dtype;
    let r: R = match u {
        UnaryOp::Not => return Ok(None),
        UnaryOp::Neg => ad.b.neg(g),
        UnaryOp::Abs => {
            let x = ad.fwd(x)?;
            let z = ad.b.lit(0.0, b_dtype)?;
            let pos = ad.b.bin(BinaryOp::Ge, x, z)?;
            let ng = ad.b.neg(g)?;
            ad.b.where_(pos, g, ng)
        }
        UnaryOp::Exp => {
            let y = ad.fwd(y)?;
            ad.b.mul(g, y)
        }
        UnaryOp::Log => {
            let x = ad.fwd(x)?;
            ad.b.div(g, x)
        }
        UnaryOp::Sqrt => {
            let y = ad.fwd(y)?;
            let h = ad.b.scale(g, 0.5)?;
            ad.b.div(h, y)
        }
        UnaryOp::Rsqrt => {
            let y = ad.fwd(y)?;
            let y2 = ad.b.mul(y, y)?;
            let y3 = ad.b.mul(y2, y)?;
            let h = ad.b.scale(g, -0.5)?;
            ad.b.mul(h, y3)
        }
        UnaryOp::Recip => {
            let y = ad.fwd(y)?;
            let y2 = ad.b.mul(y, y)?;
            let t = ad.b.mul(g, y2)?;
            ad.b.neg(t)
        }
        UnaryOp::Tanh => {
            let y = ad.fwd(y)?;
            let y2 = ad.b.mul(y, y)?;
            let d = ad.b.rsub(1.0, y2)?;
            ad.b.mul(g, d)
        }
        UnaryOp::Sigmoid => {
            let y = ad.fwd(y)?;
            let one_minus = ad.b.rsub(1.0, y)?;
            let d = ad.b.mul(y, one_minus)?;
            ad.b.mul(g, d)
        }
        UnaryOp::Relu => {
            // From the result, as PyTorch's threshold_backward: `relu(x) > 0` exactly where
            // `x > 0`, and the result is what the next layer keeps anyway (a convolution's
            // input), so the pre-activation (a norm's output, a residual sum) need not be
            // stored for the backward pass (cnn: one 32 MiB tensor less per block at B=128).
            let y = ad.fwd(y)?;
            let z = ad.b.lit(0.0, b_dtype)?;
            let pos = ad.b.bin(BinaryOp::Gt, y, z)?;
            ad.b.mask(pos, g)
        }
        UnaryOp::Gelu => {
            // One op for gelu's derivative (`gelu_grad`): the composite took a dozen
            // pointwise ops, each rounded to 16 bits under `--amp`, in the epilogue of
            // the product that makes `g`.
            let x = ad.fwd(x)?;
            let d = ad.b.un(UnaryOp::GeluGrad, x)?;
            ad.b.mul(g, d)
        }
        UnaryOp::GeluGrad => {
            // gelu''(x) = (1 - t^2) (u' + 3 a c x^2 - x t u'^2), with u = c (x + a x^3),
            // u' = c (1 + 3 a x^2), t = tanh(u).
            let x = ad.fwd(x)?;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let a = 0.044715;
            let x2 = ad.b.mul(x, x)?;
            let x3 = ad.b.mul(x2, x)?;
            let ax3 = ad.b.scale(x3, a)?;
            let inner = ad.b.add2(x, ax3)?;
            let u = ad.b.scale(inner, c)?;
            let t = ad.b.un(UnaryOp::Tanh, u)?;
            let t2 = ad.b.mul(t, t)?;
            let sech2 = ad.b.rsub(1.0, t2)?;
            let x2k = ad.b.scale(x2, 3.0 * a * c)?;
            let du = ad.b.lit(c, b_dtype)?;
            let du = ad.b.add2(du, x2k)?;
            let du2 = ad.b.mul(du, du)?;
            let xt = ad.b.mul(x, t)?;
            let xtdu2 = ad.b.mul(xt, du2)?;
            let p = ad.b.add2(du, x2k)?;
            let p = ad.b.sub(p, xtdu2)?;
            let d = ad.b.mul(sech2, p)?;
            ad.b.mul(g, d)
        }
        UnaryOp::Silu => {
            let x = ad.fwd(x)?;
            let s = ad.b.un(UnaryOp::Sigmoid, x)?;
            let one_m = ad.b.rsub(1.0, s)?;
            let xm = ad.b.mul(x, one_m)?;
            let one = ad.b.lit(1.0, b_dtype)?;
            let inner = ad.b.add2(one, xm)?;
            let d = ad.b.mul(s, inner)?;
            ad.b.mul(g, d)
        }
        UnaryOp::Sin => {
            let x = ad.fwd(x)?;
            let c = ad.b.un(UnaryOp::Cos, x)?;
            ad.b.mul(g, c)
        }
        UnaryOp::Cos => {
            let x = ad.fwd(x)?;
            let s = ad.b.un(UnaryOp::Sin, x)?;
            let t = ad.b.mul(g, s)?;
            ad.b.neg(t)
        }
        UnaryOp::Erf => {
            let x = ad.fwd(x)?;
            let x2 = ad.b.mul(x, x)?;
            let nx2 = ad.b.neg(x2)?;
            let e = ad.b.un(UnaryOp::Exp, nx2)?;
            let d = ad.b.scale(e, 2.0 / std::f64::consts::PI.sqrt())?;
            ad.b.mul(g, d)
        }
    };
    r.map(Some)
}

#[allow(clippy::too_many_arguments)]
fn binary(
    ad: &mut Ad,
    op: BinaryOp,
    a: NodeId,
    b: NodeId,
    y: NodeId,
    g: NodeId,
    wa: bool,
    wb: bool,
) -> Result<(Option<NodeId>, Option<NodeId>), TypeError> {
    if op.is_comparison() || op.is_logical() {
        return Ok((None, None));
    }
    let sa = ad.b.ty(a).shape;
    let sb = ad.b.ty(b).shape;
    let mut ga = None;
    let mut gb = None;
    match op {
        BinaryOp::Add | BinaryOp::Sub | BinaryOp::Rem => {
            if wa {
                ga = Some(ad.b.sum_to(g, &sa)?);
            }
            if wb && op != BinaryOp::Rem {
                let t = if op == BinaryOp::Sub { ad.b.neg(g)? } else { g };
                gb = Some(ad.b.sum_to(t, &sb)?);
            }
        }
        BinaryOp::Mul => {
            if wa {
                let bv = ad.fwd(b)?;
                let t = ad.b.mul(g, bv)?;
                ga = Some(ad.b.sum_to(t, &sa)?);
            }
            if wb {
                let av = ad.fwd(a)?;
                let t = ad.b.mul(g, av)?;
                gb = Some(ad.b.sum_to(t, &sb)?);
            }
        }
        BinaryOp::Div => {
            let bv = ad.fwd(b)?;
            if wa {
                let t = ad.b.div(g, bv)?;
                ga = Some(ad.b.sum_to(t, &sa)?);
            }
            if wb {
                let yv = ad.fwd(y)?;
                let t = ad.b.mul(g, yv)?;
                let t = ad.b.div(t, bv)?;
                let t = ad.b.neg(t)?;
                gb = Some(ad.b.sum_to(t, &sb)?);
            }
        }
        BinaryOp::Pow => {
            let av = ad.fwd(a)?;
            let bv = ad.fwd(b)?;
            if wa {
                let one = ad.b.lit(1.0, ad.b.ty(b).dtype)?;
                let bm1 = ad.b.sub(bv, one)?;
                let p = ad.b.bin(BinaryOp::Pow, av, bm1)?;
                let t = ad.b.mul(p, bv)?;
                let t = ad.b.mul(g, t)?;
                ga = Some(ad.b.sum_to(t, &sa)?);
            }
            if wb {
                let yv = ad.fwd(y)?;
                let la = ad.b.un(UnaryOp::Log, av)?;
                let t = ad.b.mul(yv, la)?;
                let t = ad.b.mul(g, t)?;
                gb = Some(ad.b.sum_to(t, &sb)?);
            }
        }
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let av = ad.fwd(a)?;
            let bv = ad.fwd(b)?;
            let cmp = if op == BinaryOp::Maximum {
                BinaryOp::Ge
            } else {
                BinaryOp::Le
            };
            let m = ad.b.bin(cmp, av, bv)?;
            if wa {
                let t = ad.b.mask(m, g)?;
                ga = Some(ad.b.sum_to(t, &sa)?);
            }
            if wb {
                let z = ad.b.lit(0.0, ad.b.ty(g).dtype)?;
                let t = ad.b.where_(m, z, g)?;
                gb = Some(ad.b.sum_to(t, &sb)?);
            }
        }
        _ => {}
    }
    Ok((ga, gb))
}

fn reduce(
    ad: &mut Ad,
    op: ReduceOp,
    axes: &[usize],
    keepdim: bool,
    x: NodeId,
    y: NodeId,
    g: NodeId,
) -> R {
    let xt = ad.b.ty(x);
    let kept: Vec<usize> = xt
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let gk = if keepdim {
        g
    } else {
        ad.b.reshape(g, Shape(kept.clone()))?
    };
    match op {
        ReduceOp::Sum => ad.b.broadcast_to(gk, xt.shape.clone()),
        ReduceOp::Mean => {
            let count: usize = axes.iter().map(|&a| xt.dims()[a]).product();
            let s = ad.b.scale(gk, 1.0 / count.max(1) as f64)?;
            ad.b.broadcast_to(s, xt.shape.clone())
        }
        ReduceOp::Max | ReduceOp::Min => {
            // Ties share the gradient equally.
            let xv = ad.fwd(x)?;
            let yv = ad.fwd(y)?;
            let yk = ad.b.reshape(yv, Shape(kept))?;
            let hit = ad.b.bin(BinaryOp::Eq, xv, yk)?;
            let hf = ad.b.cast(hit, xt.dtype)?;
            let cnt = ad.b.sum(hf, axes.to_vec(), true)?;
            let share = ad.b.div(gk, cnt)?;
            ad.b.mul(hf, share)
        }
    }
}

/// Places `g` (the gradient of a slice) into zeros of the full shape.
pub(super) fn pad(ad: &mut Ad, g: NodeId, ranges: &[(usize, usize)], full: &Shape) -> R {
    let mut cur = g;
    let dtype = ad.b.ty(g).dtype;
    for (axis, (&(s, e), &d)) in ranges.iter().zip(full.dims()).enumerate() {
        if s == 0 && e == d {
            continue;
        }
        let mut parts = Vec::new();
        let cur_dims = ad.b.ty(cur).dims().to_vec();
        if s > 0 {
            let mut z = cur_dims.clone();
            z[axis] = s;
            parts.push(ad.b.full(0.0, crate::ir::TensorType::new(dtype, z))?);
        }
        parts.push(cur);
        if e < d {
            let mut z = cur_dims;
            z[axis] = d - e;
            parts.push(ad.b.full(0.0, crate::ir::TensorType::new(dtype, z))?);
        }
        cur = ad.b.add(Op::Concat { axis }, parts)?;
    }
    Ok(cur)
}

fn matmul(
    ad: &mut Ad,
    a: NodeId,
    b: NodeId,
    g: NodeId,
    wa: bool,
    wb: bool,
) -> Result<(Option<NodeId>, Option<NodeId>), TypeError> {
    let at = ad.b.ty(a);
    let bt = ad.b.ty(b);
    // Work with 2-D-or-more operands: a 1-D left operand is [1, k], a 1-D right one [k, 1].
    let a2_shape = if at.rank() == 1 {
        Shape(vec![1, at.dims()[0]])
    } else {
        at.shape.clone()
    };
    let b2_shape = if bt.rank() == 1 {
        Shape(vec![bt.dims()[0], 1])
    } else {
        bt.shape.clone()
    };
    let gt = ad.b.ty(g);
    let mut g2_dims = gt.dims().to_vec();
    if at.rank() == 1 {
        g2_dims.insert(
            g2_dims
                .len()
                .saturating_sub(if bt.rank() == 1 { 0 } else { 1 }),
            1,
        );
    }
    if bt.rank() == 1 {
        g2_dims.push(1);
    }
    let g2 = ad.b.reshape(g, Shape(g2_dims))?;
    let mut ga = None;
    let mut gb = None;
    if wa {
        let bv = ad.fwd(b)?;
        let b2 = ad.b.reshape(bv, b2_shape.clone())?;
        let bt2 = ad.b.transpose(b2)?;
        let t = ad.b.add(Op::MatMul, vec![g2, bt2])?;
        let t = ad.b.sum_to(t, &a2_shape)?;
        ga = Some(ad.b.reshape(t, at.shape.clone())?);
    }
    if wb && bt.rank() == 2 && a2_shape.rank() > 2 {
        // A 2-D right operand shared by a batch (`x @ w` with x [B, T, D]): one GEMM over
        // the flattened batch, x^T [D, B*T] @ g [B*T, N], rather than a batched product
        // [B, D, N] summed over B afterwards.
        let k = a2_shape.dims()[a2_shape.rank() - 1];
        let rows = a2_shape.numel() / k.max(1);
        let n = bt.dims()[1];
        let av = ad.fwd(a)?;
        let a_flat = ad.b.reshape(av, Shape(vec![rows, k]))?;
        let g_flat = ad.b.reshape(g2, Shape(vec![rows, n]))?;
        let at2 = ad.b.transpose(a_flat)?;
        gb = Some(ad.b.add(Op::MatMul, vec![at2, g_flat])?);
    } else if wb {
        let av = ad.fwd(a)?;
        let a2 = ad.b.reshape(av, a2_shape)?;
        let at2 = ad.b.transpose(a2)?;
        let t = ad.b.add(Op::MatMul, vec![at2, g2])?;
        let t = ad.b.sum_to(t, &b2_shape)?;
        gb = Some(ad.b.reshape(t, bt.shape.clone())?);
    }
    Ok((ga, gb))
}
