//! Optimizers as graph nodes (PyTorch's update rules), recorded as `Graph::updates`.
//!
//! - `sgd(lr, momentum, weight_decay)`: `g += wd·p`; with momentum, `buf = m·buf + g` and
//!   `g = buf` (the buffer starts at zero, which equals PyTorch's first-step `buf = g`);
//!   `p -= lr·g`.
//! - `adam(lr, beta1, beta2, eps)`: `t += 1`; `m = β1·m + (1-β1)·g`; `v = β2·v + (1-β2)·g²`;
//!   `p -= lr/(1-β1ᵗ) · m / (√v/√(1-β2ᵗ) + eps)`.
//! - `adamw(…, weight_decay)`: as Adam, after the decoupled decay `p *= 1 - lr·wd`.
//!
//! State tensors (`NAME.momentum`, `NAME.exp_avg`, `NAME.exp_avg_sq`, `adam.step`) are
//! persistent, zero-initialised `state` nodes. Params the loss does not depend on get no
//! update (PyTorch skips params whose `.grad` is `None`).
//!
//! ZeRO-1 ([`lower_sharded`]): each of N ranks updates `S = ⌈n / N⌉` elements of an
//! `n`-element param, its `shard`, from its shard of the summed gradient
//! (`reduce_scatter`), and keeps only that shard's state (`[S]`); the updated shards are
//! gathered back into the param (`all_gather`), so every rank holds the whole param.
//! The update rules are the same element by element, so the step equals the unsharded one.

use super::builder::Builder;
use crate::ir::{
    BinaryOp, DType, Graph, NodeId, Op, Optimizer, TensorType, TrainSpec, TypeError, UnaryOp,
};
use std::collections::BTreeMap;

fn param_name(g: &Graph, p: NodeId) -> String {
    match &g.node(p).op {
        Op::Param { name, .. } => name.clone(),
        _ => format!("p{}", p.index()),
    }
}

/// Appends the optimizer's nodes and records `g.updates`.
pub fn lower(
    g: &mut Graph,
    train: &TrainSpec,
    params: &[NodeId],
    grads: &BTreeMap<NodeId, NodeId>,
) -> Result<(), TypeError> {
    lower_sharded(g, train, params, grads, None)
}

/// [`lower`] for one rank of a ZeRO-1 step over `ranks` ranks (`None`: unsharded):
/// `grads` are this rank's `[S]` gradient shards.
pub fn lower_sharded(
    g: &mut Graph,
    train: &TrainSpec,
    params: &[NodeId],
    grads: &BTreeMap<NodeId, NodeId>,
    ranks: Option<usize>,
) -> Result<(), TypeError> {
    let span = train.span;
    let mut updates = Vec::new();
    let mut b = Builder::new(g, span);
    // Adam's shared step counter and bias corrections, computed once.
    let adam = match train.optimizer {
        Optimizer::Adam { beta1, beta2, .. } | Optimizer::AdamW { beta1, beta2, .. } => {
            let t = b.add(
                Op::State {
                    name: "adam.step".into(),
                    ty: TensorType::scalar(DType::F32),
                },
                vec![],
            )?;
            let one = b.lit(1.0, DType::F32)?;
            let t1 = b.add2(t, one)?;
            updates.push((t, t1));
            let b1 = b.lit(beta1, DType::F32)?;
            let b2 = b.lit(beta2, DType::F32)?;
            let p1 = b.bin(BinaryOp::Pow, b1, t1)?;
            let p2 = b.bin(BinaryOp::Pow, b2, t1)?;
            let bc1 = b.rsub(1.0, p1)?;
            let bc2 = b.rsub(1.0, p2)?;
            let sqrt_bc2 = b.un(UnaryOp::Sqrt, bc2)?;
            Some((bc1, sqrt_bc2))
        }
        Optimizer::Sgd { .. } => None,
    };
    for &p in params {
        let Some(&grad) = grads.get(&p) else { continue };
        b.g.grads.push((p, grad));
        let name = param_name(b.g, p);
        let whole = b.ty(p);
        let dt = whole.dtype;
        b.span = b.g.node(p).span;
        let param = p;
        // The values updated here: the param, or this rank's shard of it.
        let (p, ty) = match ranks {
            None => (p, whole.clone()),
            Some(r) => {
                let s = b.add(Op::Shard { ranks: r }, vec![p])?;
                (s, b.ty(s))
            }
        };
        let state = |b: &mut Builder, suffix: &str| {
            let state = format!("{name}.{suffix}");
            if ranks.is_some() {
                b.g.shards.insert(state.clone(), name.clone());
            }
            b.add(
                Op::State {
                    name: state,
                    ty: ty.clone(),
                },
                vec![],
            )
        };
        let new_p = match train.optimizer {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                let mut d = grad;
                if weight_decay != 0.0 {
                    let wd = b.scale(p, weight_decay)?;
                    d = b.add2(d, wd)?;
                }
                if momentum != 0.0 {
                    let buf = state(&mut b, "momentum")?;
                    let m = b.scale(buf, momentum)?;
                    let nb = b.add2(m, d)?;
                    updates.push((buf, nb));
                    d = nb;
                }
                let step = b.scale(d, lr)?;
                b.sub(p, step)?
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            }
            | Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                ..
            } => {
                let (bc1, sqrt_bc2) =
                    adam.ok_or_else(|| TypeError::new("E0002", "adam state missing", ""))?;
                let m = state(&mut b, "exp_avg")?;
                let v = state(&mut b, "exp_avg_sq")?;
                let m1 = b.scale(m, beta1)?;
                let g1 = b.scale(grad, 1.0 - beta1)?;
                let nm = b.add2(m1, g1)?;
                let v1 = b.scale(v, beta2)?;
                let gg = b.mul(grad, grad)?;
                let g2 = b.scale(gg, 1.0 - beta2)?;
                let nv = b.add2(v1, g2)?;
                updates.push((m, nm));
                updates.push((v, nv));
                let bc1 = b.cast(bc1, dt)?;
                let sqrt_bc2 = b.cast(sqrt_bc2, dt)?;
                let sv = b.un(UnaryOp::Sqrt, nv)?;
                let denom = b.div(sv, sqrt_bc2)?;
                let e = b.lit(eps, dt)?;
                let denom = b.add2(denom, e)?;
                let ratio = b.div(nm, denom)?;
                let lr_l = b.lit(lr, dt)?;
                let step_size = b.div(lr_l, bc1)?;
                let step = b.mul(ratio, step_size)?;
                let base = match train.optimizer {
                    Optimizer::AdamW { weight_decay, .. } if weight_decay != 0.0 => {
                        b.scale(p, 1.0 - lr * weight_decay)?
                    }
                    _ => p,
                };
                b.sub(base, step)?
            }
        };
        let new_p = match ranks {
            None => new_p,
            Some(r) => gather(&mut b, new_p, &whole, r)?,
        };
        updates.push((param, new_p));
    }
    g.updates.extend(updates);
    Ok(())
}

/// The updated shards of every rank gathered into a param of type `whole`: straight into
/// its shape when the shards tile it, else through the padded `[N·S]` and a slice.
fn gather(
    b: &mut Builder,
    shard: NodeId,
    whole: &TensorType,
    ranks: usize,
) -> Result<NodeId, TypeError> {
    let n = whole.shape.numel();
    let padded = b.ty(shard).shape.numel() * ranks;
    if padded == n {
        return b.add(
            Op::AllGather {
                ranks,
                shape: whole.shape.clone(),
            },
            vec![shard],
        );
    }
    let all = b.add(
        Op::AllGather {
            ranks,
            shape: crate::ir::Shape(vec![padded]),
        },
        vec![shard],
    )?;
    let head = b.add(
        Op::Slice {
            ranges: vec![(0, n)],
        },
        vec![all],
    )?;
    b.reshape(head, whole.shape.clone())
}
