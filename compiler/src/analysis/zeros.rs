//! Structural zeros: the triangles of a tensor that hold a known constant (`tril`'s zeros,
//! a causal mask's `-inf` and what follows from them) and the triangles whose values no
//! output reads. Matmuls use both to skip work: causal attention's `softmax(mask(q kᵀ)) v`
//! and its gradients sum over half of `k` and compute half of the scores, as a
//! flash-attention kernel does.
//!
//! A region is a half-plane over two axes of a tensor: the elements with
//! `idx[hi] - idx[lo] > c` (`tril(x, k)` zeroes `hi = last, lo = last - 1, c = k`).
//!
//! Semantics. A known zero is taken to annihilate a product (`0 · x = 0`) and `-inf` minus
//! a row statistic to stay `-inf`, as in sparse linear algebra and flash attention: where
//! the other factor is infinite or NaN the skipped terms would have given NaN in a dense
//! evaluation. Values outside the regions are computed as written.

use std::collections::BTreeMap;

use crate::ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, Scalar};

/// The elements of a tensor with `idx[hi] - idx[lo] > c`, over two distinct axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub lo: usize,
    pub hi: usize,
    pub c: i64,
}

/// What every element of a region holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// `0` (or `false`).
    Zero,
    NegInf,
}

/// Side tables of the analysis, by node.
#[derive(Clone, Debug, Default)]
pub struct Zeros {
    /// A region of the node's value and the constant it holds there.
    pub known: BTreeMap<NodeId, (Region, Fill)>,
    /// A region of the node's value that no output depends on.
    pub unread: BTreeMap<NodeId, Region>,
}

impl Zeros {
    /// Runs both analyses over `g` (forward for `known`, then backward for `unread`).
    pub fn of(g: &Graph) -> Zeros {
        let mut z = Zeros::default();
        let Some(order) = g.topo_order() else {
            return z;
        };
        for &n in &order {
            if let Some(f) = forward(g, &z, n) {
                z.known.insert(n, f);
            }
        }
        let read = g.read_by_caller();
        for &n in order.iter().rev() {
            if read.contains(&n) {
                continue;
            }
            if let Some(r) = backward(g, &z, n) {
                z.unread.insert(n, r);
            }
        }
        z
    }

    /// The region of `n` known to hold zeros.
    pub fn zero(&self, n: NodeId) -> Option<Region> {
        match self.known.get(&n) {
            Some(&(r, Fill::Zero)) => Some(r),
            _ => None,
        }
    }
}

fn rank(g: &Graph, n: NodeId) -> usize {
    g.ty(n).rank()
}

/// Moves a region of operand `x` to the axes of the elementwise result `out` (operands
/// align on their last axes); `None` where `x` is broadcast along one of its axes.
fn to_out(g: &Graph, x: NodeId, out: NodeId, r: Region) -> Option<Region> {
    let (xd, od) = (g.ty(x).dims(), g.ty(out).dims());
    let off = od.len().checked_sub(xd.len())?;
    let same = |a: usize| xd.get(a).is_some_and(|&d| od.get(a + off) == Some(&d));
    (same(r.lo) && same(r.hi)).then_some(Region {
        lo: r.lo + off,
        hi: r.hi + off,
        c: r.c,
    })
}

/// The inverse of [`to_out`]: a region of the result `out` on the axes of operand `x`.
fn to_in(g: &Graph, x: NodeId, out: NodeId, r: Region) -> Option<Region> {
    let (xd, od) = (g.ty(x).dims(), g.ty(out).dims());
    let off = od.len().checked_sub(xd.len())?;
    let (lo, hi) = (r.lo.checked_sub(off)?, r.hi.checked_sub(off)?);
    let back = Region { lo, hi, c: r.c };
    (to_out(g, x, out, back) == Some(r)).then_some(back)
}

/// The value of a scalar literal or a filled tensor.
fn constant(g: &Graph, n: NodeId) -> Option<f64> {
    match &g.node(n).op {
        Op::Literal { value, .. } | Op::Full { value, .. } => Some(match *value {
            Scalar::Float(v) => v,
            Scalar::Int(v) => v as f64,
            Scalar::Bool(b) => f64::from(u8::from(b)),
        }),
        _ => None,
    }
}

/// The fill of operand `x` over the result's region `r`, if known.
fn fill_of(g: &Graph, z: &Zeros, x: NodeId, out: NodeId, r: Region) -> Option<Fill> {
    if let Some(v) = constant(g, x) {
        return if v == 0.0 {
            Some(Fill::Zero)
        } else if v == f64::NEG_INFINITY {
            Some(Fill::NegInf)
        } else {
            None
        };
    }
    let &(rx, f) = z.known.get(&x)?;
    (to_out(g, x, out, rx) == Some(r)).then_some(f)
}

/// The region of operand `x` in the result's axes, with its fill.
fn operand(g: &Graph, z: &Zeros, x: NodeId, out: NodeId) -> Option<(Region, Fill)> {
    let &(r, f) = z.known.get(&x)?;
    Some((to_out(g, x, out, r)?, f))
}

/// True when `x` has extent 1 (or no axis) where the result's axis `a` lies: a statistic
/// broadcast along it.
fn broadcast_along(g: &Graph, x: NodeId, out: NodeId, a: usize) -> bool {
    let (xd, od) = (g.ty(x).dims(), g.ty(out).dims());
    let off = od.len().saturating_sub(xd.len());
    a < off || xd.get(a - off) == Some(&1) && od.get(a) != Some(&1)
}

fn forward(g: &Graph, z: &Zeros, n: NodeId) -> Option<(Region, Fill)> {
    let node = g.node(n);
    let ins = &node.inputs;
    let r = rank(g, n);
    match &node.op {
        Op::Tri { upper, k } if r >= 2 => {
            // tril keeps `j - i <= k`; triu keeps `j - i >= k`, so zeroes `i - j > -k`.
            let region = if *upper {
                Region {
                    lo: r - 1,
                    hi: r - 2,
                    c: k.checked_neg()?,
                }
            } else {
                Region {
                    lo: r - 2,
                    hi: r - 1,
                    c: *k,
                }
            };
            Some((region, Fill::Zero))
        }
        Op::Where => {
            let (c, x, y) = (*ins.first()?, *ins.get(1)?, *ins.get(2)?);
            if let Some((rc, Fill::Zero)) = operand(g, z, c, n) {
                return fill_of(g, z, y, n, rc).map(|f| (rc, f));
            }
            let (rx, fx) = operand(g, z, x, n)?;
            (fill_of(g, z, y, n, rx) == Some(fx)).then_some((rx, fx))
        }
        Op::Unary(op) => {
            let (rx, fx) = operand(g, z, *ins.first()?, n)?;
            match fx {
                Fill::NegInf if op.zero_at_neg_inf() => Some((rx, Fill::Zero)),
                Fill::Zero if op.preserves_zero() => Some((rx, Fill::Zero)),
                _ => None,
            }
        }
        Op::Cast { .. } => match operand(g, z, *ins.first()?, n)? {
            (rx, Fill::Zero) => Some((rx, Fill::Zero)),
            _ => None,
        },
        Op::Binary(op) => {
            let (x, y) = (*ins.first()?, *ins.get(1)?);
            let (ox, oy) = (operand(g, z, x, n), operand(g, z, y, n));
            let positive = |v: NodeId| constant(g, v).is_some_and(|c| c > 0.0);
            match op {
                BinaryOp::Mul => match (ox, oy) {
                    (Some((rx, Fill::Zero)), _) => Some((rx, Fill::Zero)),
                    (_, Some((ry, Fill::Zero))) => Some((ry, Fill::Zero)),
                    (Some((rx, Fill::NegInf)), None) if positive(y) => Some((rx, Fill::NegInf)),
                    (None, Some((ry, Fill::NegInf))) if positive(x) => Some((ry, Fill::NegInf)),
                    _ => None,
                },
                BinaryOp::Div => match ox? {
                    (rx, Fill::Zero) => Some((rx, Fill::Zero)),
                    (rx, Fill::NegInf) if positive(y) => Some((rx, Fill::NegInf)),
                    _ => None,
                },
                BinaryOp::Add | BinaryOp::Sub => match (ox, oy) {
                    (Some(a), Some(b)) if a == b && a.1 == Fill::Zero => Some(a),
                    // `-inf ± s` where `s` is a statistic of each row or column (softmax's
                    // max).
                    (Some((rx, Fill::NegInf)), None)
                        if broadcast_along(g, y, n, rx.hi) || broadcast_along(g, y, n, rx.lo) =>
                    {
                        Some((rx, Fill::NegInf))
                    }
                    _ => None,
                },
                BinaryOp::Maximum => match (ox, oy) {
                    (Some(a), Some(b)) if a == b => Some(a),
                    _ => None,
                },
                _ => None,
            }
        }
        Op::Permute { perm } => {
            let &(rx, f) = z.known.get(ins.first()?)?;
            let at = |a: usize| perm.iter().position(|&p| p == a);
            Some((
                Region {
                    lo: at(rx.lo)?,
                    hi: at(rx.hi)?,
                    c: rx.c,
                },
                f,
            ))
        }
        Op::Reshape { .. } | Op::BroadcastTo { .. } => {
            let x = *ins.first()?;
            let &(rx, f) = z.known.get(&x)?;
            let (xd, od) = (g.ty(x).dims(), g.ty(n).dims());
            // The trailing axes from the region's first one on are kept as they are.
            let t = xd.len() - rx.lo.min(rx.hi);
            let off = od.len().checked_sub(t)?;
            (xd[xd.len() - t..] == od[off..]).then_some((
                Region {
                    lo: rx.lo + off + t - xd.len(),
                    hi: rx.hi + off + t - xd.len(),
                    c: rx.c,
                },
                f,
            ))
        }
        Op::Slice { ranges } => {
            let &(rx, f) = z.known.get(ins.first()?)?;
            let (sl, sh) = (ranges.get(rx.lo)?.0 as i64, ranges.get(rx.hi)?.0 as i64);
            // idx'[hi] + sh - idx'[lo] - sl > c.
            Some((
                Region {
                    c: rx.c.checked_sub(sh)?.checked_add(sl)?,
                    ..rx
                },
                f,
            ))
        }
        Op::Select { axis, .. } => {
            let &(rx, f) = z.known.get(ins.first()?)?;
            let drop = |a: usize| match a.cmp(axis) {
                std::cmp::Ordering::Less => Some(a),
                std::cmp::Ordering::Equal => None,
                std::cmp::Ordering::Greater => Some(a - 1),
            };
            Some((
                Region {
                    lo: drop(rx.lo)?,
                    hi: drop(rx.hi)?,
                    ..rx
                },
                f,
            ))
        }
        Op::Reduce { op, axes, keepdim } => {
            let &(rx, f) = z.known.get(ins.first()?)?;
            if axes.contains(&rx.lo) || axes.contains(&rx.hi) {
                return None;
            }
            let kept = matches!(
                (op, f),
                (ReduceOp::Sum | ReduceOp::Mean, Fill::Zero) | (ReduceOp::Max | ReduceOp::Min, _)
            );
            let shift = |a: usize| {
                if *keepdim {
                    a
                } else {
                    a - axes.iter().filter(|&&r| r < a).count()
                }
            };
            kept.then_some((
                Region {
                    lo: shift(rx.lo),
                    hi: shift(rx.hi),
                    c: rx.c,
                },
                f,
            ))
        }
        _ => None,
    }
}

/// The region of `n` that none of its uses reads, if every use agrees on one.
fn backward(g: &Graph, z: &Zeros, n: NodeId) -> Option<Region> {
    let users = g.users(n);
    if users.is_empty() {
        return None;
    }
    let mut found: Option<Region> = None;
    for u in users {
        let un = g.node(u);
        for (pos, &x) in un.inputs.iter().enumerate() {
            if x != n {
                continue;
            }
            let r = unread_through(g, z, u, pos)?;
            match found {
                None => found = Some(r),
                Some(f) if f == r => {}
                Some(_) => return None,
            }
        }
    }
    found
}

/// The region of input `pos` of `u` (in that input's axes) that `u` does not pass on to
/// anything read.
fn unread_through(g: &Graph, z: &Zeros, u: NodeId, pos: usize) -> Option<Region> {
    let un = g.node(u);
    let x = *un.inputs.get(pos)?;
    let elementwise = un.op.is_elementwise();
    // Where `u` selects another operand, or multiplies by a known zero, `x` is not read.
    let masked = match un.op {
        Op::Where if pos == 1 => match operand(g, z, un.inputs[0], u) {
            Some((r, Fill::Zero)) => Some(r),
            _ => None,
        },
        Op::Binary(BinaryOp::Mul) => {
            let other = un.inputs[1 - pos.min(1)];
            match operand(g, z, other, u) {
                Some((r, Fill::Zero)) if un.inputs.len() == 2 => Some(r),
                _ => None,
            }
        }
        _ => None,
    };
    if let Some(r) = masked {
        return to_in(g, x, u, r);
    }
    let ru = *z.unread.get(&u)?;
    match &un.op {
        _ if elementwise => to_in(g, x, u, ru),
        Op::Permute { perm } => Some(Region {
            lo: *perm.get(ru.lo)?,
            hi: *perm.get(ru.hi)?,
            c: ru.c,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::test_graph as graph;

    /// The nodes of `g` whose op is named `name`, in id order.
    fn nodes(g: &Graph, name: &str) -> Vec<NodeId> {
        g.node_ids()
            .filter(|&n| g.node(n).op.name() == name)
            .collect()
    }

    #[test]
    fn causal_softmax_rows_and_their_gradient_mask() {
        let g = graph(
            "model t {
                input s: f32[2, 4, 4]
                let m = where(tril(ones([4, 4], bool)), s * 0.5, -inf)
                let e = exp(m - max(m, axis: -1, keepdim: true))
                let y = transpose(e / sum(e, axis: -1, keepdim: true))
                output y
            }",
        );
        let z = Zeros::of(&g);
        let upper = Region { lo: 1, hi: 2, c: 0 };
        let tri = nodes(&g, "tril")[0];
        assert_eq!(
            z.known.get(&tri),
            Some(&(Region { lo: 0, hi: 1, c: 0 }, Fill::Zero))
        );
        let masked = nodes(&g, "where")[0];
        assert_eq!(z.known.get(&masked), Some(&(upper, Fill::NegInf)));
        assert_eq!(z.zero(nodes(&g, "exp")[0]), Some(upper));
        assert_eq!(z.zero(nodes(&g, "div")[0]), Some(upper));
        // Transposed: zero where row - column > 0.
        let t = nodes(&g, "permute")[0];
        assert_eq!(z.zero(t), Some(Region { lo: 2, hi: 1, c: 0 }));
        // The scaled scores are not read above the diagonal; the input and the row
        // statistics are read everywhere (the input is part of the interface only through
        // its uses: its one use is the scaling).
        assert_eq!(z.unread.get(&nodes(&g, "mul")[0]), Some(&upper));
        assert_eq!(z.unread.get(&nodes(&g, "reduce.max")[0]), None);
        assert_eq!(z.unread.get(&t), None);
    }

    #[test]
    fn triu_and_slices_move_the_diagonal() {
        let g = graph(
            "model t {
                input x: f32[6, 6]
                let u = triu(x, k: 1)
                let y = u[2:6, 0:4]
                output y
            }",
        );
        let z = Zeros::of(&g);
        // triu(k = 1) zeroes j - i < 1, i.e. i - j > -1.
        assert_eq!(
            z.zero(nodes(&g, "triu")[0]),
            Some(Region {
                lo: 1,
                hi: 0,
                c: -1
            })
        );
        // Rows from 2: (i' + 2) - j' > -1, i.e. i' - j' > -3.
        assert_eq!(
            z.zero(nodes(&g, "slice")[0]),
            Some(Region {
                lo: 1,
                hi: 0,
                c: -3
            })
        );
        assert!(z.unread.is_empty());
    }

    #[test]
    fn a_product_with_a_zero_does_not_read_the_other_factor() {
        let g = graph(
            "model t {
                input x: f32[4, 4]
                input y: f32[4, 4]
                let p = tril(x) * (y + 1.0)
                let y = sum(p, axis: -1)
                output y
            }",
        );
        let z = Zeros::of(&g);
        let lower = Region { lo: 0, hi: 1, c: 0 };
        assert_eq!(z.zero(nodes(&g, "mul")[0]), Some(lower));
        assert_eq!(z.unread.get(&nodes(&g, "add")[0]), Some(&lower));
        // The sum over the rows reads every element of the product.
        assert_eq!(z.unread.get(&nodes(&g, "mul")[0]), None);
    }
}
