//! The builtin functions of TDSL (the primitive set of LANGUAGE.md): their argument lists
//! and how each lowers to graph ops.

use super::lower::{shape_of, Lowerer};
use super::value::{fold_unary, Value};
use crate::ir::{BinaryOp, DType, NodeId, Op, PoolKind, ReduceOp, Scalar, Shape, UnaryOp};
use tcc_grammar::ast::{Arg, Ident};
use tcc_grammar::span::Span;

/// A builtin's parameters, in positional order, and which may be omitted.
struct Spec {
    name: &'static str,
    params: &'static [&'static str],
    optional: &'static [&'static str],
}

const fn spec(
    name: &'static str,
    params: &'static [&'static str],
    optional: &'static [&'static str],
) -> Spec {
    Spec {
        name,
        params,
        optional,
    }
}

const UNARY: [&str; 15] = [
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "recip", "tanh", "sigmoid", "relu", "gelu",
    "silu", "sin", "cos", "erf",
];

const SPECS: &[Spec] = &[
    spec("maximum", &["a", "b"], &[]),
    spec("minimum", &["a", "b"], &[]),
    spec("pow", &["a", "b"], &[]),
    spec("where", &["cond", "a", "b"], &[]),
    spec("cast", &["x", "dtype"], &[]),
    spec("sum", &["x", "axis", "keepdim"], &["axis", "keepdim"]),
    spec("mean", &["x", "axis", "keepdim"], &["axis", "keepdim"]),
    spec("max", &["x", "axis", "keepdim"], &["axis", "keepdim"]),
    spec("min", &["x", "axis", "keepdim"], &["axis", "keepdim"]),
    spec("argmax", &["x", "axis", "keepdim"], &["axis", "keepdim"]),
    spec("reshape", &["x", "shape"], &[]),
    spec("transpose", &["x"], &[]),
    spec("permute", &["x", "perm"], &[]),
    spec("broadcast_to", &["x", "shape"], &[]),
    spec("concat", &["tensors", "axis"], &["axis"]),
    spec("split", &["x", "n", "axis"], &["axis"]),
    spec("squeeze", &["x", "axis"], &[]),
    spec("unsqueeze", &["x", "axis"], &[]),
    spec("zeros", &["shape", "dtype"], &["dtype"]),
    spec("ones", &["shape", "dtype"], &["dtype"]),
    spec("full", &["shape", "value", "dtype"], &["dtype"]),
    spec("arange", &["n"], &[]),
    spec("tril", &["x", "k"], &["k"]),
    spec("triu", &["x", "k"], &["k"]),
    spec(
        "conv2d",
        &["x", "w", "stride", "padding", "groups"],
        &["stride", "padding", "groups"],
    ),
    spec(
        "max_pool2d",
        &["x", "k", "stride", "padding"],
        &["stride", "padding"],
    ),
    spec(
        "avg_pool2d",
        &["x", "k", "stride", "padding"],
        &["stride", "padding"],
    ),
    spec("embedding", &["table", "ids"], &[]),
    spec("dropout", &["x", "p"], &[]),
    spec("grad", &["y", "x"], &[]),
];

/// True if `name` is a builtin function.
pub fn is_builtin(name: &str) -> bool {
    UNARY.contains(&name) || SPECS.iter().any(|s| s.name == name)
}

/// Every builtin's name (for "did you mean" suggestions).
pub fn names() -> impl Iterator<Item = &'static str> {
    UNARY.iter().copied().chain(SPECS.iter().map(|s| s.name))
}

type Args = Vec<Option<(Value, Span)>>;

/// Lowers a call of builtin `callee`.
pub fn lower_builtin<'a>(
    lw: &mut Lowerer<'a, '_>,
    callee: &'a Ident,
    args: &'a [Arg],
    span: Span,
) -> Value {
    let name = callee.name.as_str();
    let (params, optional): (&[&str], &[&str]) = if UNARY.contains(&name) {
        (&["x"], &[])
    } else {
        match SPECS.iter().find(|s| s.name == name) {
            Some(s) => (s.params, s.optional),
            None => return Value::Poison,
        }
    };
    let Some(vals) = lw.bind_call_args(name, params, optional, args, span) else {
        return Value::Poison;
    };
    let mut b = Builtin {
        lw,
        name,
        vals,
        span,
    };
    b.lower().unwrap_or(Value::Poison)
}

struct Builtin<'l, 'a, 'd> {
    lw: &'l mut Lowerer<'a, 'd>,
    name: &'l str,
    vals: Args,
    span: Span,
}

impl<'l, 'a, 'd> Builtin<'l, 'a, 'd> {
    fn err<T>(
        &mut self,
        code: &'static str,
        msg: impl Into<String>,
        span: Span,
        label: impl Into<String>,
    ) -> Option<T> {
        self.lw.error(code, msg, span, label);
        None
    }

    fn arg(&self, i: usize) -> Option<(Value, Span)> {
        self.vals.get(i).cloned().flatten()
    }

    fn span_of(&self, i: usize) -> Span {
        self.arg(i).map(|(_, s)| s).unwrap_or(self.span)
    }

    fn tensor(&mut self, i: usize) -> Option<NodeId> {
        match self.arg(i) {
            Some((Value::Tensor(id), _)) => Some(id),
            Some((Value::Poison, _)) | None => None,
            Some((v, s)) => {
                let what = self.name;
                self.err(
                    "E0212",
                    format!("`{what}` needs a tensor here"),
                    s,
                    format!("found {}", v.kind()),
                )
            }
        }
    }

    fn int(&mut self, i: usize, default: Option<i64>) -> Option<i64> {
        match self.arg(i) {
            Some((Value::Int(n), _)) => Some(n),
            None => default,
            Some((Value::Poison, _)) => None,
            Some((v, s)) => {
                let what = self.name;
                self.err(
                    "E0216",
                    format!("`{what}` needs a compile-time integer here"),
                    s,
                    format!("found {}", v.kind()),
                )
            }
        }
    }

    fn boolean(&mut self, i: usize, default: bool) -> Option<bool> {
        match self.arg(i) {
            Some((Value::Bool(b), _)) => Some(b),
            None => Some(default),
            Some((Value::Poison, _)) => None,
            Some((v, s)) => self.err(
                "E0216",
                "expected `true` or `false`",
                s,
                format!("found {}", v.kind()),
            ),
        }
    }

    fn dtype(&mut self, i: usize, default: DType) -> Option<DType> {
        match self.arg(i) {
            Some((Value::DType(d), _)) => Some(d),
            None => Some(default),
            Some((Value::Poison, _)) => None,
            Some((v, s)) => self.err(
                "E0213",
                "expected a dtype",
                s,
                format!(
                    "found {}; expected one of f32, f16, bf16, i32, bool",
                    v.kind()
                ),
            ),
        }
    }

    fn ints(&mut self, i: usize) -> Option<Vec<i64>> {
        match self.arg(i) {
            Some((Value::List(vs), s)) => {
                let mut out = Vec::with_capacity(vs.len());
                for v in vs {
                    match v {
                        Value::Int(n) => out.push(n),
                        Value::Poison => return None,
                        other => {
                            return self.err(
                                "E0216",
                                "expected a list of compile-time integers",
                                s,
                                format!("it holds {}", other.kind()),
                            )
                        }
                    }
                }
                Some(out)
            }
            Some((Value::Poison, _)) | None => None,
            Some((v, s)) => self.err(
                "E0216",
                "expected a list of integers `[…]`",
                s,
                format!("found {}", v.kind()),
            ),
        }
    }

    /// An int or a `[h, w]` pair.
    fn pair(&mut self, i: usize, default: [usize; 2]) -> Option<[usize; 2]> {
        let s = self.span_of(i);
        let v = match self.arg(i) {
            None => return Some(default),
            Some((Value::Int(n), _)) => vec![n, n],
            Some((Value::List(_), _)) => self.ints(i)?,
            Some((Value::Poison, _)) => return None,
            Some((v, _)) => {
                return self.err(
                    "E0216",
                    "expected an integer or a pair `[h, w]`",
                    s,
                    format!("found {}", v.kind()),
                )
            }
        };
        if v.len() != 2 || v.iter().any(|&x| x < 0) {
            return self.err(
                "E0216",
                "expected an integer or a pair `[h, w]` of non-negative integers",
                s,
                format!("found {v:?}"),
            );
        }
        Some([v[0] as usize, v[1] as usize])
    }

    fn axis(&mut self, axis: i64, rank: usize, span: Span) -> Option<usize> {
        let r = rank as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if a < 0 || a >= r {
            let name = self.name;
            return self.err(
                "E0306",
                format!("axis out of range in `{name}`"),
                span,
                format!("axis {axis} for a tensor of rank {rank}"),
            );
        }
        Some(a as usize)
    }

    fn shape(&mut self, i: usize) -> Option<Shape> {
        let s = self.span_of(i);
        let v = self.ints(i)?;
        match shape_of(&v.iter().map(|&n| Value::Int(n)).collect::<Vec<_>>()) {
            Some(sh) => Some(sh),
            None => self.err(
                "E0316",
                "dimensions must be positive",
                s,
                format!("found {v:?}"),
            ),
        }
    }

    fn add(&mut self, op: Op, inputs: Vec<NodeId>) -> Option<Value> {
        match self.lw.add(op, inputs, self.span) {
            Value::Poison => None,
            v => Some(v),
        }
    }

    fn lower(&mut self) -> Option<Value> {
        let name = self.name;
        if let Some(op) = UnaryOp::from_builtin(name) {
            return match self.arg(0)? {
                (Value::Tensor(id), _) => self.add(Op::Unary(op), vec![id]),
                (v, s) if v.is_scalar() => match fold_unary(name, &v) {
                    Ok(r) => Some(r),
                    Err(m) => self.err(
                        "E0212",
                        format!("cannot evaluate `{name}` at compile time"),
                        s,
                        m,
                    ),
                },
                (Value::Poison, _) => None,
                (v, s) => self.err(
                    "E0212",
                    format!("`{name}` needs a tensor or a number"),
                    s,
                    format!("found {}", v.kind()),
                ),
            };
        }
        match name {
            "maximum" | "minimum" | "pow" => {
                let op = match name {
                    "maximum" => BinaryOp::Maximum,
                    "minimum" => BinaryOp::Minimum,
                    _ => BinaryOp::Pow,
                };
                let (a, _) = self.arg(0)?;
                let (b, _) = self.arg(1)?;
                match self.lw.elementwise2(op, name, a, b, self.span) {
                    Value::Poison => None,
                    v => Some(v),
                }
            }
            "where" => self.lower_where(),
            "cast" => {
                let to = self.dtype(1, DType::F32)?;
                match self.arg(0)? {
                    (Value::Tensor(id), _) => {
                        if self.lw.ty(id).dtype == to {
                            Some(Value::Tensor(id))
                        } else {
                            self.add(Op::Cast { to }, vec![id])
                        }
                    }
                    (v, s) if v.is_scalar() => self.lw.literal(&v, to, s).map(Value::Tensor),
                    (Value::Poison, _) => None,
                    (v, s) => self.err(
                        "E0212",
                        "`cast` needs a tensor",
                        s,
                        format!("found {}", v.kind()),
                    ),
                }
            }
            "sum" | "mean" | "max" | "min" => {
                let op = match name {
                    "sum" => ReduceOp::Sum,
                    "mean" => ReduceOp::Mean,
                    "max" => ReduceOp::Max,
                    _ => ReduceOp::Min,
                };
                let x = self.tensor(0)?;
                let rank = self.lw.ty(x).rank();
                let keepdim = self.boolean(2, false)?;
                let axes = match self.arg(1) {
                    None => (0..rank).collect(),
                    Some(_) => self.axes(1, rank)?,
                };
                self.add(Op::Reduce { op, axes, keepdim }, vec![x])
            }
            "argmax" => {
                let x = self.tensor(0)?;
                let rank = self.lw.ty(x).rank();
                let keepdim = self.boolean(2, false)?;
                let axis = match self.arg(1) {
                    None => None,
                    Some(_) => {
                        let s = self.span_of(1);
                        let a = self.int(1, None)?;
                        Some(self.axis(a, rank, s)?)
                    }
                };
                self.add(Op::ArgMax { axis, keepdim }, vec![x])
            }
            "reshape" => {
                let x = self.tensor(0)?;
                let s = self.span_of(1);
                let dims = self.ints(1)?;
                let t = self.lw.ty(x);
                let shape = infer_reshape(&dims, t.shape.numel()).map_err(|m| {
                    self.lw.error(
                        "E0303",
                        "invalid reshape",
                        s,
                        format!("{t} to {dims:?}: {m}"),
                    );
                });
                self.add(Op::Reshape { shape: shape.ok()? }, vec![x])
            }
            "transpose" => {
                let x = self.tensor(0)?;
                let r = self.lw.ty(x).rank();
                if r < 2 {
                    let t = self.lw.ty(x);
                    let s = self.span_of(0);
                    return self.err(
                        "E0313",
                        "`transpose` needs at least 2 axes",
                        s,
                        format!("found {t}"),
                    );
                }
                let mut perm: Vec<usize> = (0..r).collect();
                perm.swap(r - 2, r - 1);
                self.add(Op::Permute { perm }, vec![x])
            }
            "permute" => {
                let x = self.tensor(0)?;
                let r = self.lw.ty(x).rank();
                let s = self.span_of(1);
                let raw = self.ints(1)?;
                let mut perm = Vec::with_capacity(raw.len());
                for a in raw {
                    perm.push(self.axis(a, r, s)?);
                }
                self.add(Op::Permute { perm }, vec![x])
            }
            "broadcast_to" => {
                let x = self.tensor(0)?;
                let shape = self.shape(1)?;
                self.add(Op::BroadcastTo { shape }, vec![x])
            }
            "concat" => {
                let s = self.span_of(0);
                let items = match self.arg(0)? {
                    // A tuple (what `split` returns) reads as the list of its tensors.
                    (Value::List(vs) | Value::Tuple(vs), _) => vs,
                    (Value::Poison, _) => return None,
                    (v, _) => {
                        return self.err(
                            "E0212",
                            "`concat` takes a list of tensors `[a, b, …]`",
                            s,
                            format!("found {}", v.kind()),
                        )
                    }
                };
                let mut ids = Vec::with_capacity(items.len());
                for v in items {
                    match v {
                        Value::Tensor(id) => ids.push(id),
                        Value::Poison => return None,
                        other => {
                            return self.err(
                                "E0212",
                                "`concat` takes a list of tensors",
                                s,
                                format!("it holds {}", other.kind()),
                            )
                        }
                    }
                }
                if ids.is_empty() {
                    return self.err(
                        "E0304",
                        "`concat` of nothing",
                        s,
                        "give at least one tensor",
                    );
                }
                let rank = self.lw.ty(ids[0]).rank();
                let a = self.int(1, Some(0))?;
                let axis_span = self.span_of(1);
                let axis = self.axis(a, rank, axis_span)?;
                self.add(Op::Concat { axis }, ids)
            }
            "split" => {
                let x = self.tensor(0)?;
                let t = self.lw.ty(x);
                let n_span = self.span_of(1);
                let n = self.int(1, None)?;
                let a = self.int(2, Some(0))?;
                let axis_span = self.span_of(2);
                let axis = self.axis(a, t.rank(), axis_span)?;
                let d = t.dims()[axis];
                if n <= 0 || !d.is_multiple_of(n as usize) {
                    return self.err(
                        "E0309",
                        "`split` into unequal parts",
                        n_span,
                        format!("axis {axis} of {t} has size {d}, not divisible into {n} parts"),
                    );
                }
                let part = d / n as usize;
                let mut outs = Vec::with_capacity(n as usize);
                for i in 0..n as usize {
                    let mut ranges: Vec<(usize, usize)> =
                        t.dims().iter().map(|&d| (0, d)).collect();
                    ranges[axis] = (i * part, (i + 1) * part);
                    outs.push(self.add(Op::Slice { ranges }, vec![x])?);
                }
                Some(Value::Tuple(outs))
            }
            "squeeze" => {
                let x = self.tensor(0)?;
                let t = self.lw.ty(x);
                let s = self.span_of(1);
                let a = self.int(1, None)?;
                let axis = self.axis(a, t.rank(), s)?;
                if t.dims()[axis] != 1 {
                    return self.err(
                        "E0315",
                        "`squeeze` of an axis that is not 1",
                        s,
                        format!("axis {axis} of {t} has size {}", t.dims()[axis]),
                    );
                }
                let mut dims = t.dims().to_vec();
                dims.remove(axis);
                self.add(Op::Reshape { shape: Shape(dims) }, vec![x])
            }
            "unsqueeze" => {
                let x = self.tensor(0)?;
                let t = self.lw.ty(x);
                let s = self.span_of(1);
                let a = self.int(1, None)?;
                let axis = self.axis(a, t.rank() + 1, s)?;
                let mut dims = t.dims().to_vec();
                dims.insert(axis, 1);
                self.add(Op::Reshape { shape: Shape(dims) }, vec![x])
            }
            "zeros" | "ones" | "full" => {
                let shape = self.shape(0)?;
                let (value, dtype_idx) = match name {
                    "zeros" => (Value::Int(0), 1),
                    "ones" => (Value::Int(1), 1),
                    _ => (self.arg(1)?.0, 2),
                };
                let default = match value {
                    Value::Bool(_) => DType::Bool,
                    _ => DType::F32,
                };
                let dtype = self.dtype(dtype_idx, default)?;
                let vspan = self.span_of(if name == "full" { 1 } else { 0 });
                let scalar = match (&value, dtype) {
                    (Value::Int(v), DType::Bool) if name != "full" => Scalar::Bool(*v != 0),
                    (Value::Bool(b), DType::Bool) => Scalar::Bool(*b),
                    (Value::Int(v), DType::I32) if i32::try_from(*v).is_ok() => Scalar::Int(*v),
                    (v, d) if d.is_float() && v.as_f64().is_some() => {
                        Scalar::Float(v.as_f64().unwrap_or(0.0))
                    }
                    (Value::Poison, _) => return None,
                    (v, d) => {
                        return self.err(
                            "E0403",
                            format!("fill value does not fit {d}"),
                            vspan,
                            format!("found {}", v.kind()),
                        )
                    }
                };
                self.add(
                    Op::Full {
                        value: scalar,
                        ty: crate::ir::TensorType::new(dtype, shape),
                    },
                    vec![],
                )
            }
            "arange" => {
                let s = self.span_of(0);
                let n = self.int(0, None)?;
                if n <= 0 {
                    return self.err(
                        "E0316",
                        "`arange` needs a positive length",
                        s,
                        format!("found {n}"),
                    );
                }
                self.add(Op::Arange { n: n as usize }, vec![])
            }
            "tril" | "triu" => {
                let x = self.tensor(0)?;
                let k = self.int(1, Some(0))?;
                self.add(
                    Op::Tri {
                        upper: name == "triu",
                        k,
                    },
                    vec![x],
                )
            }
            "conv2d" => {
                let x = self.tensor(0)?;
                let w = self.tensor(1)?;
                let stride = self.pair(2, [1, 1])?;
                let padding = self.pair(3, [0, 0])?;
                let gs = self.span_of(4);
                let groups = self.int(4, Some(1))?;
                if groups <= 0 || stride.contains(&0) {
                    return self.err(
                        "E0305",
                        "conv2d stride and groups must be positive",
                        gs,
                        "found 0 or less",
                    );
                }
                self.add(
                    Op::Conv2d {
                        stride,
                        padding,
                        groups: groups as usize,
                    },
                    vec![x, w],
                )
            }
            "max_pool2d" | "avg_pool2d" => {
                let x = self.tensor(0)?;
                let kernel = self.pair(1, [1, 1])?;
                let stride = self.pair(2, kernel)?;
                let padding = self.pair(3, [0, 0])?;
                if kernel.contains(&0) || stride.contains(&0) {
                    let s = self.span_of(1);
                    return self.err(
                        "E0310",
                        "pooling window and stride must be positive",
                        s,
                        "found 0",
                    );
                }
                let kind = if name == "max_pool2d" {
                    PoolKind::Max
                } else {
                    PoolKind::Avg
                };
                self.add(
                    Op::Pool2d {
                        kind,
                        kernel,
                        stride,
                        padding,
                    },
                    vec![x],
                )
            }
            "embedding" => {
                let table = self.tensor(0)?;
                let ids = self.tensor(1)?;
                self.add(Op::Embedding, vec![table, ids])
            }
            "dropout" => {
                let x = self.tensor(0)?;
                let s = self.span_of(1);
                let p = match self.arg(1)? {
                    (v, _) if v.as_f64().is_some() => v.as_f64().unwrap_or(0.0),
                    (Value::Poison, _) => return None,
                    (v, _) => {
                        return self.err(
                            "E0216",
                            "dropout probability must be a compile-time number",
                            s,
                            format!("found {}", v.kind()),
                        )
                    }
                };
                if p == 0.0 {
                    return Some(Value::Tensor(x));
                }
                let seed = self.lw.next_seed();
                self.add(Op::Dropout { p, seed }, vec![x])
            }
            "grad" => {
                let y = self.tensor(0)?;
                let x = self.tensor(1)?;
                self.add(Op::Grad, vec![y, x])
            }
            _ => None,
        }
    }

    fn axes(&mut self, i: usize, rank: usize) -> Option<Vec<usize>> {
        let s = self.span_of(i);
        let raw = match self.arg(i)? {
            (Value::Int(a), _) => vec![a],
            (Value::List(_), _) => self.ints(i)?,
            (Value::Poison, _) => return None,
            (v, _) => {
                return self.err(
                    "E0216",
                    "`axis` must be an integer or a list of integers",
                    s,
                    format!("found {}", v.kind()),
                )
            }
        };
        let mut out = Vec::with_capacity(raw.len());
        for a in raw {
            let ax = self.axis(a, rank, s)?;
            if out.contains(&ax) {
                return self.err(
                    "E0306",
                    "repeated axis",
                    s,
                    format!("axis {a} appears twice"),
                );
            }
            out.push(ax);
        }
        out.sort_unstable();
        Some(out)
    }

    fn lower_where(&mut self) -> Option<Value> {
        let (c, cs) = self.arg(0)?;
        let (a, as_) = self.arg(1)?;
        let (b, bs) = self.arg(2)?;
        let c = match c {
            // A compile-time condition picks a branch.
            Value::Bool(true) => return Some(a),
            Value::Bool(false) => return Some(b),
            Value::Tensor(id) => id,
            Value::Poison => return None,
            other => {
                return self.err(
                    "E0212",
                    "`where` needs a bool tensor condition",
                    cs,
                    format!("found {}", other.kind()),
                )
            }
        };
        let dtype = match (&a, &b) {
            (Value::Tensor(x), _) | (_, Value::Tensor(x)) => self.lw.ty(*x).dtype,
            (Value::Bool(_), _) => DType::Bool,
            (Value::Int(_), Value::Int(_)) => DType::I32,
            _ => DType::F32,
        };
        let mut ids = vec![c];
        for (v, s) in [(a, as_), (b, bs)] {
            match v {
                Value::Tensor(id) => ids.push(id),
                v if v.is_scalar() => ids.push(self.lw.literal(&v, dtype, s)?),
                Value::Poison => return None,
                other => {
                    return self.err(
                        "E0212",
                        "`where` branches must be tensors or numbers",
                        s,
                        format!("found {}", other.kind()),
                    )
                }
            }
        }
        self.add(Op::Where, ids)
    }
}

/// Resolves a reshape target with at most one `-1`.
fn infer_reshape(dims: &[i64], numel: usize) -> Result<Shape, String> {
    let holes = dims.iter().filter(|&&d| d == -1).count();
    if holes > 1 {
        return Err("only one dimension may be -1".into());
    }
    if dims.iter().any(|&d| d == 0 || d < -1) {
        return Err("dimensions must be positive (or one -1)".into());
    }
    let known: usize = dims
        .iter()
        .filter(|&&d| d > 0)
        .fold(1usize, |a, &d| a.saturating_mul(d as usize));
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        if d == -1 {
            if known == 0 || !numel.is_multiple_of(known) {
                return Err(format!("{numel} elements do not divide into {known}"));
            }
            out.push(numel / known);
        } else {
            out.push(d as usize);
        }
    }
    let total = out.iter().fold(1usize, |a, &d| a.saturating_mul(d));
    if total != numel {
        return Err(format!("{numel} elements cannot take a shape of {total}"));
    }
    Ok(Shape(out))
}
