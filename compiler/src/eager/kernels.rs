//! One reference implementation per op, written for clarity, not speed (loops over
//! row-major data in f64). These define what every back end must compute.
//!
//! Conventions where the language leaves room (back ends follow them):
//! - integer `/` rounds toward negative infinity and `%` takes the divisor's sign (Python);
//!   division by zero is an error;
//! - float→int casts truncate toward zero and saturate (NaN → 0); a value is true when ≠ 0;
//! - `avg_pool2d` divides by the full window (padding counts, PyTorch's default);
//!   `max_pool2d` ignores padding;
//! - `argmax` and `max`'s gradient pick ties as the reduction defines (first index; equal
//!   shares);
//! - dropout keeps element `i` when `uniform(seed, i) >= p` (see [`dropout_uniform`]) and
//!   scales kept values by `1 / (1 - p)`.

use super::tensor::{
    broadcast_strides, contiguous_strides, for_each_offset, round, Data, Precision, Tensor,
};
use super::EagerError;
use crate::ir::{BinaryOp, DType, IntFault, Op, PoolKind, ReduceOp, Scalar, TensorType, UnaryOp};
pub use crate::rng::splitmix64;

type Res = Result<Tensor, EagerError>;

fn internal(m: impl Into<String>) -> EagerError {
    EagerError::Internal(m.into())
}

fn floats(t: &Tensor) -> Result<&[f64], EagerError> {
    match &t.data {
        Data::F(v) => Ok(v),
        _ => Err(internal(format!("expected float data for {}", t.ty))),
    }
}

fn ints(t: &Tensor) -> Result<&[i32], EagerError> {
    match &t.data {
        Data::I(v) => Ok(v),
        _ => Err(internal(format!("expected i32 data for {}", t.ty))),
    }
}

fn bools(t: &Tensor) -> Result<&[bool], EagerError> {
    match &t.data {
        Data::B(v) => Ok(v),
        _ => Err(internal(format!("expected bool data for {}", t.ty))),
    }
}

/// Builds a result of type `ty` from f64 values, rounding on store.
fn store_f(ty: &TensorType, v: Vec<f64>, p: Precision) -> Tensor {
    let data = match ty.dtype {
        DType::I32 => Data::I(v.into_iter().map(|x| x as i32).collect()),
        DType::Bool => Data::B(v.into_iter().map(|x| x != 0.0).collect()),
        d => Data::F(v.into_iter().map(|x| round(d, x, p)).collect()),
    };
    Tensor {
        ty: ty.clone(),
        data,
    }
}

/// Gathers `src` through an offset map into a fresh tensor of type `ty`.
fn gather(src: &Tensor, ty: &TensorType, offsets: &[usize]) -> Tensor {
    let data = match &src.data {
        Data::F(v) => Data::F(offsets.iter().map(|&o| v[o]).collect()),
        Data::I(v) => Data::I(offsets.iter().map(|&o| v[o]).collect()),
        Data::B(v) => Data::B(offsets.iter().map(|&o| v[o]).collect()),
    };
    Tensor {
        ty: ty.clone(),
        data,
    }
}

fn offsets(shape: &[usize], strides: &[usize], base: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(shape.iter().product());
    for_each_offset(shape, &[strides], &[base], |_, o| out.push(o[0]));
    out
}

/// The dropout draw for element `i` of a dropout with `seed`: uniform in [0, 1) with 24 bits.
pub fn dropout_uniform(seed: u64, i: u64) -> f64 {
    let h = splitmix64(splitmix64(seed ^ 0xD1B5_4A32_D192_ED03).wrapping_add(i));
    (h >> 40) as f64 / (1u64 << 24) as f64
}

/// The table's integer formula, with its fault as the interpreter reports it.
fn binary_i(b: BinaryOp, x: i32, y: i32) -> Result<i64, EagerError> {
    b.eval_i32(x, y).map_err(|f| match f {
        IntFault::DivisionByZero => EagerError::DivisionByZero,
        IntFault::NotInteger => internal(format!("`{}` on i32", b.name())),
    })
}

/// Evaluates one op. `ty` is the node's result type.
pub fn eval(op: &Op, ty: &TensorType, ins: &[&Tensor], p: Precision) -> Res {
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Grad => Err(internal(
            format!("`{}` is not evaluated as an op", op.name()),
        )),
        Op::Literal { value, .. } | Op::Full { value, .. } => {
            let n = ty.shape.numel();
            let data = match (value, ty.dtype) {
                (Scalar::Bool(b), _) => Data::B(vec![*b; n]),
                (Scalar::Int(i), DType::I32) => Data::I(vec![*i as i32; n]),
                (Scalar::Int(i), d) => Data::F(vec![round(d, *i as f64, p); n]),
                (Scalar::Float(f), DType::I32) => Data::I(vec![*f as i32; n]),
                (Scalar::Float(f), d) => Data::F(vec![round(d, *f, p); n]),
            };
            Ok(Tensor {
                ty: ty.clone(),
                data,
            })
        }
        Op::Arange { n } => Ok(Tensor::from_i32(vec![*n], (0..*n as i32).collect())),
        Op::Unary(u) => {
            let x = ins[0];
            match (&x.data, u) {
                (Data::B(v), UnaryOp::Not) => Ok(Tensor {
                    ty: ty.clone(),
                    data: Data::B(v.iter().map(|b| !b).collect()),
                }),
                (Data::I(v), _) => {
                    let data = v.iter().map(|&a| u.eval_i32(a)).collect::<Option<_>>();
                    Ok(Tensor {
                        ty: ty.clone(),
                        data: Data::I(
                            data.ok_or_else(|| internal(format!("`{}` on i32", u.name())))?,
                        ),
                    })
                }
                (Data::F(v), _) => Ok(store_f(ty, v.iter().map(|&a| u.eval(a)).collect(), p)),
                _ => Err(internal("unary op on wrong data")),
            }
        }
        Op::Binary(b) => {
            let (x, y) = (ins[0], ins[1]);
            let sx = broadcast_strides(x.dims(), ty.dims());
            let sy = broadcast_strides(y.dims(), ty.dims());
            let n = ty.shape.numel();
            match (&x.data, &y.data) {
                (Data::F(a), Data::F(c)) => {
                    let mut out = Vec::with_capacity(n);
                    for_each_offset(ty.dims(), &[&sx, &sy], &[0, 0], |_, o| {
                        out.push(b.eval(a[o[0]], c[o[1]]))
                    });
                    Ok(store_f(ty, out, p))
                }
                (Data::I(a), Data::I(c)) => {
                    let mut out = Vec::with_capacity(n);
                    let mut err = None;
                    for_each_offset(ty.dims(), &[&sx, &sy], &[0, 0], |_, o| {
                        match binary_i(*b, a[o[0]], c[o[1]]) {
                            Ok(v) => out.push(v),
                            Err(e) => {
                                err.get_or_insert(e);
                                out.push(0);
                            }
                        }
                    });
                    if let Some(e) = err {
                        return Err(e);
                    }
                    let data = if ty.dtype == DType::Bool {
                        Data::B(out.iter().map(|&v| v != 0).collect())
                    } else {
                        Data::I(out.iter().map(|&v| v as i32).collect())
                    };
                    Ok(Tensor {
                        ty: ty.clone(),
                        data,
                    })
                }
                (Data::B(a), Data::B(c)) => {
                    let mut out = Vec::with_capacity(n);
                    for_each_offset(ty.dims(), &[&sx, &sy], &[0, 0], |_, o| {
                        let bit = |v: bool| f64::from(u8::from(v));
                        out.push(b.eval(bit(a[o[0]]), bit(c[o[1]])) != 0.0)
                    });
                    Ok(Tensor {
                        ty: ty.clone(),
                        data: Data::B(out),
                    })
                }
                _ => Err(internal("binary op on mismatched data")),
            }
        }
        Op::Where => {
            let (c, a, b) = (ins[0], ins[1], ins[2]);
            let sc = broadcast_strides(c.dims(), ty.dims());
            let sa = broadcast_strides(a.dims(), ty.dims());
            let sb = broadcast_strides(b.dims(), ty.dims());
            let cv = bools(c)?;
            let mut pick = Vec::with_capacity(ty.shape.numel());
            for_each_offset(ty.dims(), &[&sc, &sa, &sb], &[0, 0, 0], |_, o| {
                pick.push((cv[o[0]], o[1], o[2]))
            });
            let data = match (&a.data, &b.data) {
                (Data::F(x), Data::F(y)) => Data::F(
                    pick.iter()
                        .map(|&(k, i, j)| if k { x[i] } else { y[j] })
                        .collect(),
                ),
                (Data::I(x), Data::I(y)) => Data::I(
                    pick.iter()
                        .map(|&(k, i, j)| if k { x[i] } else { y[j] })
                        .collect(),
                ),
                (Data::B(x), Data::B(y)) => Data::B(
                    pick.iter()
                        .map(|&(k, i, j)| if k { x[i] } else { y[j] })
                        .collect(),
                ),
                _ => return Err(internal("where on mismatched data")),
            };
            Ok(Tensor {
                ty: ty.clone(),
                data,
            })
        }
        Op::Cast { to } => {
            let x = ins[0];
            let data = match (&x.data, to) {
                (Data::F(v), DType::I32) => Data::I(
                    v.iter()
                        .map(|&a| if a.is_nan() { 0 } else { a as i32 })
                        .collect(),
                ),
                (Data::F(v), DType::Bool) => Data::B(v.iter().map(|&a| a != 0.0).collect()),
                (Data::F(v), d) => Data::F(v.iter().map(|&a| round(*d, a, p)).collect()),
                (Data::I(v), DType::I32) => Data::I(v.clone()),
                (Data::I(v), DType::Bool) => Data::B(v.iter().map(|&a| a != 0).collect()),
                (Data::I(v), d) => Data::F(v.iter().map(|&a| round(*d, a as f64, p)).collect()),
                (Data::B(v), DType::Bool) => Data::B(v.clone()),
                (Data::B(v), DType::I32) => Data::I(v.iter().map(|&a| i32::from(a)).collect()),
                (Data::B(v), _) => Data::F(v.iter().map(|&a| if a { 1.0 } else { 0.0 }).collect()),
            };
            Ok(Tensor {
                ty: ty.clone(),
                data,
            })
        }
        Op::Reduce { op: r, axes, .. } => reduce(*r, axes, ins[0], ty, p),
        Op::ArgMax { axis, .. } => argmax(*axis, ins[0], ty),
        Op::Reshape { .. } => Ok(Tensor {
            ty: ty.clone(),
            data: ins[0].data.clone(),
        }),
        Op::Permute { perm } => {
            let x = ins[0];
            let xs = x.strides();
            let s: Vec<usize> = perm.iter().map(|&a| xs[a]).collect();
            Ok(gather(x, ty, &offsets(ty.dims(), &s, 0)))
        }
        Op::BroadcastTo { .. } => {
            let x = ins[0];
            let s = broadcast_strides(x.dims(), ty.dims());
            Ok(gather(x, ty, &offsets(ty.dims(), &s, 0)))
        }
        Op::Slice { ranges } => {
            let x = ins[0];
            let xs = x.strides();
            let base: usize = ranges.iter().zip(&xs).map(|(&(s, _), &st)| s * st).sum();
            Ok(gather(x, ty, &offsets(ty.dims(), &xs, base)))
        }
        Op::Select { axis, index } => {
            let x = ins[0];
            let mut xs = x.strides();
            let base = index * xs[*axis];
            xs.remove(*axis);
            Ok(gather(x, ty, &offsets(ty.dims(), &xs, base)))
        }
        Op::Concat { axis } => {
            let mut out = Tensor::zeros(ty.clone());
            let os = contiguous_strides(ty.dims());
            let mut off = 0;
            for x in ins {
                let dst = offsets(x.dims(), &os, off * os[*axis]);
                match (&mut out.data, &x.data) {
                    (Data::F(o), Data::F(v)) => dst.iter().zip(v).for_each(|(&d, &s)| o[d] = s),
                    (Data::I(o), Data::I(v)) => dst.iter().zip(v).for_each(|(&d, &s)| o[d] = s),
                    (Data::B(o), Data::B(v)) => dst.iter().zip(v).for_each(|(&d, &s)| o[d] = s),
                    _ => return Err(internal("concat of mismatched data")),
                }
                off += x.dims()[*axis];
            }
            Ok(out)
        }
        Op::MatMul => matmul(ins[0], ins[1], ty, p),
        // One rank: the sum over the ranks is its own operand.
        Op::AllReduce => Ok(ins[0].clone()),
        Op::ReduceScatter { .. } | Op::AllGather { .. } | Op::Shard { .. } => Err(internal(
            "a ZeRO-1 step (`--zero 1`) runs only on its ranks, not in the interpreter",
        )),
        Op::Attention { causal, scale } => {
            let out = attention(ins[0], ins[1], Some(ins[2]), *causal, *scale)?;
            Ok(store_f(ty, out, p))
        }
        Op::AttentionLse { causal, scale } => {
            let out = attention(ins[0], ins[1], None, *causal, *scale)?;
            Ok(store_f(ty, out, p))
        }
        Op::AttentionGrad { causal, scale, kv } => {
            let out = attention_grad(ins, *causal, *scale, *kv)?;
            Ok(store_f(ty, out, p))
        }
        Op::Conv2d {
            stride,
            padding,
            groups,
        } => conv(
            ConvPass::Forward,
            ins[0],
            ins[1],
            ty,
            *stride,
            *padding,
            *groups,
            p,
        ),
        Op::Conv2dGradInput {
            stride,
            padding,
            groups,
            ..
        } => conv(
            ConvPass::GradInput,
            ins[0],
            ins[1],
            ty,
            *stride,
            *padding,
            *groups,
            p,
        ),
        Op::Conv2dGradWeight {
            stride,
            padding,
            groups,
            ..
        } => conv(
            ConvPass::GradWeight,
            ins[0],
            ins[1],
            ty,
            *stride,
            *padding,
            *groups,
            p,
        ),
        Op::Pool2d {
            kind,
            kernel,
            stride,
            padding,
        } => pool(*kind, ins[0], ty, *kernel, *stride, *padding, p),
        Op::Pool2dGrad {
            kind,
            kernel,
            stride,
            padding,
        } => pool_grad(*kind, ins[0], ins[1], ty, *kernel, *stride, *padding, p),
        Op::Embedding => {
            let (table, ids) = (ins[0], ins[1]);
            let (v, d) = (table.dims()[0], table.dims()[1]);
            let tv = floats(table)?;
            let mut out = Vec::with_capacity(ty.shape.numel());
            for &i in ints(ids)? {
                if i < 0 || i as usize >= v {
                    return Err(EagerError::IndexOutOfRange {
                        what: "embedding id",
                        index: i as i64,
                        bound: v,
                    });
                }
                out.extend_from_slice(&tv[i as usize * d..(i as usize + 1) * d]);
            }
            Ok(store_f(ty, out, p))
        }
        Op::EmbeddingGrad { vocab } => {
            let (ids, dy) = (ins[0], ins[1]);
            let d = ty.dims()[1];
            let g = floats(dy)?;
            let mut out = vec![0.0; vocab * d];
            for (k, &i) in ints(ids)?.iter().enumerate() {
                if i < 0 || i as usize >= *vocab {
                    return Err(EagerError::IndexOutOfRange {
                        what: "embedding id",
                        index: i as i64,
                        bound: *vocab,
                    });
                }
                let row = i as usize * d;
                for j in 0..d {
                    out[row + j] += g[k * d + j];
                }
            }
            Ok(store_f(ty, out, p))
        }
        Op::Dropout { p: prob, seed } => {
            let x = floats(ins[0])?;
            let scale = 1.0 / (1.0 - prob);
            let out = x
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    if dropout_uniform(*seed, i as u64) >= *prob {
                        v * scale
                    } else {
                        0.0
                    }
                })
                .collect();
            Ok(store_f(ty, out, p))
        }
        Op::Tri { upper, k } => {
            let x = ins[0];
            let r = x.dims().len();
            let (rows, cols) = (x.dims()[r - 2], x.dims()[r - 1]);
            let keep = |idx: usize| {
                let j = (idx % cols) as i64;
                let i = ((idx / cols) % rows) as i64;
                if *upper {
                    j - i >= *k
                } else {
                    j - i <= *k
                }
            };
            let data = match &x.data {
                Data::F(v) => Data::F(
                    v.iter()
                        .enumerate()
                        .map(|(i, &a)| if keep(i) { a } else { 0.0 })
                        .collect(),
                ),
                Data::I(v) => Data::I(
                    v.iter()
                        .enumerate()
                        .map(|(i, &a)| if keep(i) { a } else { 0 })
                        .collect(),
                ),
                Data::B(v) => Data::B(v.iter().enumerate().map(|(i, &a)| a && keep(i)).collect()),
            };
            Ok(Tensor {
                ty: ty.clone(),
                data,
            })
        }
    }
}

fn reduce(r: ReduceOp, axes: &[usize], x: &Tensor, ty: &TensorType, p: Precision) -> Res {
    // Output offsets: keep-dim strides with reduced axes set to 0.
    let kept: Vec<usize> = x
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let ks = contiguous_strides(&kept);
    let os: Vec<usize> = ks
        .iter()
        .enumerate()
        .map(|(i, &s)| if axes.contains(&i) { 0 } else { s })
        .collect();
    let n_out = ty.shape.numel();
    let count: usize = axes.iter().map(|&a| x.dims()[a]).product();
    let vals = x.to_f64();
    let init = match r {
        ReduceOp::Sum | ReduceOp::Mean => 0.0,
        ReduceOp::Max => f64::NEG_INFINITY,
        ReduceOp::Min => f64::INFINITY,
    };
    let mut acc = vec![init; n_out];
    let mut nan = vec![false; n_out];
    for_each_offset(x.dims(), &[&os], &[0], |k, o| {
        let v = vals[k];
        let a = &mut acc[o[0]];
        match r {
            ReduceOp::Sum | ReduceOp::Mean => *a += v,
            ReduceOp::Max => {
                if v.is_nan() {
                    nan[o[0]] = true;
                } else if v > *a {
                    *a = v
                }
            }
            ReduceOp::Min => {
                if v.is_nan() {
                    nan[o[0]] = true;
                } else if v < *a {
                    *a = v
                }
            }
        }
    });
    for (a, &isnan) in acc.iter_mut().zip(&nan) {
        if isnan {
            *a = f64::NAN;
        }
        if r == ReduceOp::Mean {
            *a /= count.max(1) as f64;
        }
    }
    Ok(store_f(ty, acc, p))
}

fn argmax(axis: Option<usize>, x: &Tensor, ty: &TensorType) -> Res {
    let vals = x.to_f64();
    let better = |a: f64, b: f64| a > b || (a.is_nan() && !b.is_nan());
    let out = match axis {
        None => {
            let mut best = 0usize;
            for (i, &v) in vals.iter().enumerate() {
                if better(v, vals[best]) {
                    best = i;
                }
            }
            vec![best as i32; ty.shape.numel()]
        }
        Some(a) => {
            let dims = x.dims();
            let inner: usize = dims[a + 1..].iter().product();
            let len = dims[a];
            let outer: usize = dims[..a].iter().product();
            let mut out = Vec::with_capacity(outer * inner);
            for o in 0..outer {
                for i in 0..inner {
                    let base = o * len * inner + i;
                    let mut best = 0usize;
                    for k in 1..len {
                        if better(vals[base + k * inner], vals[base + best * inner]) {
                            best = k;
                        }
                    }
                    out.push(best as i32);
                }
            }
            out
        }
    };
    Ok(Tensor {
        ty: ty.clone(),
        data: Data::I(out),
    })
}

fn matmul(a: &Tensor, b: &Tensor, ty: &TensorType, p: Precision) -> Res {
    // Promote 1-D operands to matrices, broadcast batch dims.
    let ad: Vec<usize> = if a.dims().len() == 1 {
        vec![1, a.dims()[0]]
    } else {
        a.dims().to_vec()
    };
    let bd: Vec<usize> = if b.dims().len() == 1 {
        vec![b.dims()[0], 1]
    } else {
        b.dims().to_vec()
    };
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let n = bd[bd.len() - 1];
    let ab = &ad[..ad.len() - 2];
    let bb = &bd[..bd.len() - 2];
    let rank = ab.len().max(bb.len());
    let mut batch = vec![1usize; rank];
    for i in 0..rank {
        let x = if i + ab.len() >= rank {
            ab[i + ab.len() - rank]
        } else {
            1
        };
        let y = if i + bb.len() >= rank {
            bb[i + bb.len() - rank]
        } else {
            1
        };
        batch[i] = x.max(y);
    }
    // Matrix-index strides for a and b over the broadcast batch.
    let sa: Vec<usize> = broadcast_strides(ab, &batch)
        .iter()
        .map(|s| s * m * k)
        .collect();
    let sb: Vec<usize> = broadcast_strides(bb, &batch)
        .iter()
        .map(|s| s * k * n)
        .collect();
    let av = floats_or_ints(a);
    let bv = floats_or_ints(b);
    let nb: usize = batch.iter().product();
    let mut out = vec![0.0; nb * m * n];
    let mut bi = 0;
    for_each_offset(&batch, &[&sa, &sb], &[0, 0], |_, o| {
        let (ao, bo) = (o[0], o[1]);
        let c = &mut out[bi * m * n..(bi + 1) * m * n];
        for i in 0..m {
            let crow = &mut c[i * n..(i + 1) * n];
            for kk in 0..k {
                let x = av[ao + i * k + kk];
                if x == 0.0 {
                    continue;
                }
                let brow = &bv[bo + kk * n..bo + (kk + 1) * n];
                for (cj, &bj) in crow.iter_mut().zip(brow) {
                    *cj += x * bj;
                }
            }
        }
        bi += 1;
    });
    Ok(store_f(ty, out, p))
}

/// Attention over `[q [.., T, D], k [.., S, D], v [.., S, E]]` as the prelude computes
/// it (`softmax(mask(q kᵀ · scale)) v`, in f64): the `[.., T, E]` output, or without `v`
/// the `[.., T]` row log-sum-exp of the masked, scaled scores.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: Option<&Tensor>,
    causal: bool,
    scale: f32,
) -> Result<Vec<f64>, EagerError> {
    let (qd, kd) = (q.dims(), k.dims());
    let r = qd.len();
    if r < 2 || kd.len() != r {
        return Err(internal("attention operands of the wrong rank"));
    }
    let (t, s, d) = (qd[r - 2], kd[r - 2], qd[r - 1]);
    let e = v.map_or(0, |v| v.dims().last().copied().unwrap_or(0));
    let batch: usize = qd[..r - 2].iter().product();
    let (qv, kv) = (floats(q)?, floats(k)?);
    let vv = match v {
        Some(v) => floats(v)?,
        None => &[],
    };
    let scale = f64::from(scale);
    // `tril(ones([T, S]), k: S - T)` keeps `j <= i + S - T`.
    let keep = |i: usize, j: usize| !causal || j + t <= i + s;
    let mut out = Vec::with_capacity(batch * t * e.max(1));
    let mut row = vec![0.0f64; s];
    for b in 0..batch {
        for i in 0..t {
            let qi = &qv[(b * t + i) * d..(b * t + i + 1) * d];
            let mut mx = f64::NEG_INFINITY;
            for (j, rj) in row.iter_mut().enumerate() {
                *rj = if keep(i, j) {
                    let kj = &kv[(b * s + j) * d..(b * s + j + 1) * d];
                    qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>() * scale
                } else {
                    f64::NEG_INFINITY
                };
                mx = mx.max(*rj);
            }
            let sum: f64 = row.iter().map(|&x| (x - mx).exp()).sum();
            if v.is_none() {
                out.push(mx + sum.ln());
                continue;
            }
            let mut o = vec![0.0f64; e];
            for (j, &x) in row.iter().enumerate() {
                let pj = (x - mx).exp() / sum;
                if pj == 0.0 {
                    continue;
                }
                let vj = &vv[(b * s + j) * e..(b * s + j + 1) * e];
                o.iter_mut().zip(vj).for_each(|(o, &y)| *o += pj * y);
            }
            out.extend(o);
        }
    }
    Ok(out)
}

/// [`Op::AttentionGrad`]: `dq`, or `dk` and `dv` side by side, from the probabilities
/// rebuilt with the forward's row statistics.
fn attention_grad(
    ins: &[&Tensor],
    causal: bool,
    scale: f32,
    kv: bool,
) -> Result<Vec<f64>, EagerError> {
    let [q, k, v, dout, lse, delta] = ins else {
        return Err(internal("attention_grad takes six operands"));
    };
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    let r = qd.len();
    if r < 2 || kd.len() != r || vd.len() != r {
        return Err(internal("attention_grad operands of the wrong rank"));
    }
    let (t, s, d, e) = (qd[r - 2], kd[r - 2], qd[r - 1], vd[r - 1]);
    let batch: usize = qd[..r - 2].iter().product();
    let (qv, kvals, vv) = (floats(q)?, floats(k)?, floats(v)?);
    let (dov, lv, dl) = (floats(dout)?, floats(lse)?, floats(delta)?);
    let need = |x: &[f64], n: usize| {
        if x.len() == n {
            Ok(())
        } else {
            Err(internal("attention_grad operands of the wrong size"))
        }
    };
    need(qv, batch * t * d)?;
    need(kvals, batch * s * d)?;
    need(vv, batch * s * e)?;
    need(dov, batch * t * e)?;
    need(lv, batch * t)?;
    need(dl, batch * t)?;
    let scale = f64::from(scale);
    let keep = |i: usize, j: usize| !causal || j + t <= i + s;
    let width = if kv { d + e } else { d };
    let rows = if kv { s } else { t };
    let mut out = vec![0.0f64; batch * rows * width];
    for b in 0..batch {
        for i in 0..t {
            let qi = &qv[(b * t + i) * d..(b * t + i + 1) * d];
            let doi = &dov[(b * t + i) * e..(b * t + i + 1) * e];
            let (l, dlt) = (lv[b * t + i], dl[b * t + i]);
            for j in (0..s).filter(|&j| keep(i, j)) {
                let kj = &kvals[(b * s + j) * d..(b * s + j + 1) * d];
                let vj = &vv[(b * s + j) * e..(b * s + j + 1) * e];
                let sc = qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>() * scale;
                let pj = (sc - l).exp();
                let dp: f64 = doi.iter().zip(vj).map(|(x, y)| x * y).sum();
                let ds = pj * (dp - dlt) * scale;
                if kv {
                    let row = &mut out[(b * s + j) * width..(b * s + j + 1) * width];
                    let (dk, dv) = row.split_at_mut(d);
                    dk.iter_mut().zip(qi).for_each(|(o, x)| *o += ds * x);
                    dv.iter_mut().zip(doi).for_each(|(o, x)| *o += pj * x);
                } else {
                    let row = &mut out[(b * t + i) * d..(b * t + i + 1) * d];
                    row.iter_mut().zip(kj).for_each(|(o, x)| *o += ds * x);
                }
            }
        }
    }
    Ok(out)
}

fn floats_or_ints(t: &Tensor) -> std::borrow::Cow<'_, [f64]> {
    match &t.data {
        Data::F(v) => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(t.to_f64()),
    }
}

/// Visits every (output position, kernel tap, input position) of a conv2d: calls
/// `f(n, o, oh, ow, c, kh, kw, ih, iw)` for taps inside the input.
#[allow(clippy::too_many_arguments)]
fn conv_taps(
    xd: &[usize],
    wd: &[usize],
    yd: &[usize],
    stride: [usize; 2],
    padding: [usize; 2],
    mut f: impl FnMut([usize; 9]),
) {
    let (nb, h, w) = (xd[0], xd[2], xd[3]);
    let (cout, cpg, kh, kw) = (wd[0], wd[1], wd[2], wd[3]);
    let (ho, wo) = (yd[2], yd[3]);
    for n in 0..nb {
        for o in 0..cout {
            for oh in 0..ho {
                for ow in 0..wo {
                    for cc in 0..cpg {
                        for i in 0..kh {
                            let ih = (oh * stride[0] + i) as isize - padding[0] as isize;
                            if ih < 0 || ih as usize >= h {
                                continue;
                            }
                            for j in 0..kw {
                                let iw = (ow * stride[1] + j) as isize - padding[1] as isize;
                                if iw < 0 || iw as usize >= w {
                                    continue;
                                }
                                f([n, o, oh, ow, cc, i, j, ih as usize, iw as usize]);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn idx4(d: &[usize], a: usize, b: usize, c: usize, e: usize) -> usize {
    ((a * d[1] + b) * d[2] + c) * d[3] + e
}

/// Which of the three convolution products to compute.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ConvPass {
    /// `y = conv(x, w)` from operands `[x, w]`.
    Forward,
    /// `dx` from operands `[dy, w]`.
    GradInput,
    /// `dw` from operands `[x, dy]`.
    GradWeight,
}

/// The three convolution products share one loop over every (output, tap, input) triple;
/// only which two arrays are multiplied and where the product accumulates differ.
#[allow(clippy::too_many_arguments)]
fn conv(
    pass: ConvPass,
    a: &Tensor,
    b: &Tensor,
    ty: &TensorType,
    stride: [usize; 2],
    padding: [usize; 2],
    groups: usize,
    p: Precision,
) -> Res {
    let (av, bv) = (floats(a)?, floats(b)?);
    let (xd, wd, yd) = match pass {
        ConvPass::Forward => (a.dims(), b.dims(), ty.dims()),
        ConvPass::GradInput => (ty.dims(), b.dims(), a.dims()),
        ConvPass::GradWeight => (a.dims(), ty.dims(), b.dims()),
    };
    let cpg = wd[1];
    let opg = wd[0] / groups.max(1);
    let mut out = vec![0.0; ty.shape.numel()];
    conv_taps(
        xd,
        wd,
        yd,
        stride,
        padding,
        |[n, o, oh, ow, cc, i, j, ih, iw]| {
            let c = (o / opg) * cpg + cc;
            let (xi, wi, yi) = (
                idx4(xd, n, c, ih, iw),
                idx4(wd, o, cc, i, j),
                idx4(yd, n, o, oh, ow),
            );
            match pass {
                ConvPass::Forward => out[yi] += av[xi] * bv[wi],
                ConvPass::GradInput => out[xi] += av[yi] * bv[wi],
                ConvPass::GradWeight => out[wi] += av[xi] * bv[yi],
            }
        },
    );
    Ok(store_f(ty, out, p))
}

/// Visits every pooling window: `f(out_index, taps)` where taps are input indices inside the
/// image; `area` is the full window size.
fn pool_windows(
    xd: &[usize],
    yd: &[usize],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    mut f: impl FnMut(usize, &[usize]),
) {
    let mut taps = Vec::with_capacity(kernel[0] * kernel[1]);
    for n in 0..yd[0] {
        for c in 0..yd[1] {
            for oh in 0..yd[2] {
                for ow in 0..yd[3] {
                    taps.clear();
                    for i in 0..kernel[0] {
                        let ih = (oh * stride[0] + i) as isize - padding[0] as isize;
                        if ih < 0 || ih as usize >= xd[2] {
                            continue;
                        }
                        for j in 0..kernel[1] {
                            let iw = (ow * stride[1] + j) as isize - padding[1] as isize;
                            if iw < 0 || iw as usize >= xd[3] {
                                continue;
                            }
                            taps.push(idx4(xd, n, c, ih as usize, iw as usize));
                        }
                    }
                    f(idx4(yd, n, c, oh, ow), &taps);
                }
            }
        }
    }
}

fn pool(
    kind: PoolKind,
    x: &Tensor,
    ty: &TensorType,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    p: Precision,
) -> Res {
    let xv = x.to_f64();
    let area = (kernel[0] * kernel[1]) as f64;
    let mut out = vec![0.0; ty.shape.numel()];
    pool_windows(x.dims(), ty.dims(), kernel, stride, padding, |o, taps| {
        out[o] = match kind {
            PoolKind::Max => taps
                .iter()
                .map(|&t| xv[t])
                .fold(f64::NEG_INFINITY, f64::max),
            PoolKind::Avg => taps.iter().map(|&t| xv[t]).sum::<f64>() / area,
        };
    });
    Ok(store_f(ty, out, p))
}

#[allow(clippy::too_many_arguments)]
fn pool_grad(
    kind: PoolKind,
    x: &Tensor,
    dy: &Tensor,
    ty: &TensorType,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    p: Precision,
) -> Res {
    let xv = x.to_f64();
    let gv = floats(dy)?;
    let area = (kernel[0] * kernel[1]) as f64;
    let mut out = vec![0.0; ty.shape.numel()];
    pool_windows(
        x.dims(),
        dy.dims(),
        kernel,
        stride,
        padding,
        |o, taps| match kind {
            PoolKind::Max => {
                if let Some(&best) = taps
                    .iter()
                    .reduce(|a, b| if xv[*b] > xv[*a] { b } else { a })
                {
                    out[best] += gv[o];
                }
            }
            PoolKind::Avg => {
                for &t in taps {
                    out[t] += gv[o] / area;
                }
            }
        },
    );
    Ok(store_f(ty, out, p))
}
