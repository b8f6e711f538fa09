//! The operations of the graph IR and their shape/dtype rules.
//!
//! [`infer`] is the single source of truth for what an op produces from its operands: the
//! front end calls it while building the graph (turning a [`TypeError`] into a located
//! diagnostic) and the verifier calls it again on every node after every pass.

use super::types::{DType, Scalar, Shape, TensorType};
use std::fmt;

/// Elementwise one-operand ops. Their names, dtypes, formulas and facts are in
/// [`super::op_table`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Sigmoid,
    Relu,
    Gelu,
    /// `gelu`'s derivative, `d/dx gelu(x)`: what the backward pass of `gelu` multiplies
    /// its gradient by, one op (one rounding under `--amp`) instead of a dozen. Not a
    /// TDSL builtin.
    GeluGrad,
    Silu,
    Sin,
    Cos,
    Erf,
    Not,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 17] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::Silu,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Erf,
        UnaryOp::Not,
    ];
}

/// Elementwise two-operand ops (NumPy broadcasting); their table is in [`super::op_table`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Pow,
    Maximum,
    Minimum,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 16] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Rem,
        BinaryOp::Pow,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::And,
        BinaryOp::Or,
    ];
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    Max,
    Avg,
}

impl PoolKind {
    /// `max` or `avg`, as the builtins spell it.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Max => "max",
            PoolKind::Avg => "avg",
        }
    }
}

/// How a parameter is initialised when the caller does not load it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Normal {
        mean: f64,
        std: f64,
    },
    Uniform {
        lo: f64,
        hi: f64,
    },
    /// No initialiser: the caller must load the param (safetensors, by name).
    External,
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => write!(f, "zeros"),
            Init::Ones => write!(f, "ones"),
            Init::Normal { mean, std } => write!(f, "normal({mean:?}, {std:?})"),
            Init::Uniform { lo, hi } => write!(f, "uniform({lo:?}, {hi:?})"),
            Init::External => write!(f, "external"),
        }
    }
}

/// One graph operation. Attributes needed to compute the result type live in the op.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Fed by the caller every run.
    Input {
        name: String,
        ty: TensorType,
    },
    /// Persistent state.
    Param {
        name: String,
        ty: TensorType,
        init: Init,
    },
    /// Optimizer state: persistent like a param, zero-initialised, updated by `train` but
    /// not differentiated.
    State {
        name: String,
        ty: TensorType,
    },
    /// A scalar constant.
    Literal {
        value: Scalar,
        dtype: DType,
    },
    /// A tensor filled with one value (`zeros`, `ones`, `full`).
    Full {
        value: Scalar,
        ty: TensorType,
    },
    /// `arange(n)`: i32[n] holding 0..n.
    Arange {
        n: usize,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `where(cond, a, b)`.
    Where,
    Cast {
        to: DType,
    },
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keepdim: bool,
    },
    /// Index of the maximum along `axis` (all axes, flattened, when `None`); i32.
    ArgMax {
        axis: Option<usize>,
        keepdim: bool,
    },
    Reshape {
        shape: Shape,
    },
    Permute {
        perm: Vec<usize>,
    },
    BroadcastTo {
        shape: Shape,
    },
    Concat {
        axis: usize,
    },
    /// Per-axis half-open ranges `[start, end)`; rank is kept. A view when layout allows.
    Slice {
        ranges: Vec<(usize, usize)>,
    },
    /// `x[i]` along `axis`: drops the axis. A view.
    Select {
        axis: usize,
        index: usize,
    },
    /// NumPy `matmul`.
    MatMul,
    Conv2d {
        stride: [usize; 2],
        padding: [usize; 2],
        groups: usize,
    },
    Pool2d {
        kind: PoolKind,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    },
    /// `embedding(table, ids)`: rows of `table` gathered by i32 `ids`.
    Embedding,
    Dropout {
        p: f64,
        seed: u64,
    },
    /// `tril` (upper = false) / `triu` (upper = true) over the last two axes, diagonal `k`.
    Tri {
        upper: bool,
        k: i64,
    },
    /// `grad(y, x)`: operands `[y, x]`; expanded by autodiff.
    Grad,
    /// Gradient of conv2d with respect to its input: operands `[dy, w]`, result `input`.
    Conv2dGradInput {
        stride: [usize; 2],
        padding: [usize; 2],
        groups: usize,
        input: Shape,
    },
    /// Gradient of conv2d with respect to its weight: operands `[x, dy]`, result `weight`.
    Conv2dGradWeight {
        stride: [usize; 2],
        padding: [usize; 2],
        groups: usize,
        weight: Shape,
    },
    /// Gradient of a pooling op: operands `[x, dy]`, result shaped like `x`.
    Pool2dGrad {
        kind: PoolKind,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    },
    /// Gradient of `embedding` with respect to the table (scatter-add of rows): operands
    /// `[ids, dy]`, result `[vocab, D]`.
    EmbeddingGrad {
        vocab: usize,
    },
    /// Fused scaled dot-product attention `softmax(mask(q kᵀ · scale)) v` over
    /// operands `[q [.., T, D], k [.., S, D], v [.., S, E]]` (equal leading dims), result
    /// `[.., T, E]`, in the operands' dtype (one float dtype for all three; computed in
    /// f32). `causal` keeps the scores with `j - i <= S - T` (the prelude's
    /// `tril(ones([T, S]), k: S - T)`). Not written by programs: `passes::attention`
    /// introduces it on CUDA in place of the prelude's composite, whose probabilities it
    /// never stores.
    Attention {
        causal: bool,
        scale: f32,
    },
    /// The row log-sum-exp of attention's masked, scaled scores: operands `[q, k]` as for
    /// [`Op::Attention`], result `[.., T]` (f32). The attention kernel over the same `q`
    /// and `k` stores it alongside its output; the backward pass rebuilds the
    /// probabilities from it (`exp(s - lse)`).
    AttentionLse {
        causal: bool,
        scale: f32,
    },
    /// The gradient of [`Op::Attention`] (flash attention's backward pass): operands
    /// `[q, k, v, dout [.., T, E], lse [.., T, 1], delta [.., T, 1]]`, with `lse` the
    /// forward's row statistics and `delta = rowsum(dout ∘ o)`, both f32. It rebuilds the
    /// probabilities `p = exp(mask(q kᵀ · scale) - lse)` block by block and never stores
    /// them: `ds = p (dout vᵀ - delta)`. With `kv: false` the result is `dq = scale · ds k`
    /// `[.., T, D]`; with `kv: true` it is `[.., S, D + E]`, `dk = scale · dsᵀ q` then
    /// `dv = pᵀ dout` along the last axis. In `q`'s dtype. Not written by programs:
    /// `passes::attention` introduces it on CUDA under mixed precision, or in f32 with
    /// `--flash-backward`.
    AttentionGrad {
        causal: bool,
        scale: f32,
        kv: bool,
    },
    /// Sum of its operand over the ranks of a data-parallel step (`--gpus N`): every rank
    /// runs the same step on its own slice of the batch and gets the sum of all ranks'
    /// operands. Not written by programs: autodiff puts one on each param's gradient when
    /// the step is built for several ranks. One rank alone computes the identity (what the
    /// interpreter and a single session do); its kernel copies the operand into the
    /// result's buffer, which the runtime's data-parallel executors then sum in place
    /// across the ranks (NCCL on CUDA). The operand is never written.
    AllReduce,
    /// This rank's shard of the sum over the ranks (`--zero 1`): the operand's `ranks · S`
    /// elements, in logical order, summed over the ranks; rank `r` gets elements
    /// `[r·S, (r+1)·S)` as `[S]`. Autodiff puts one on each gradient of a ZeRO-1 step.
    ReduceScatter {
        ranks: usize,
    },
    /// Every rank's `[S]` operand in rank order, as `shape` (`ranks · S` elements): the
    /// updated shards of a ZeRO-1 step's param, gathered into the param.
    AllGather {
        ranks: usize,
        shape: Shape,
    },
    /// This rank's slice of its operand (flattened, logical order): elements
    /// `[r·S, (r+1)·S)` of its `n`, zero past `n`, as `[S]` with `S = ⌈n / ranks⌉`. The
    /// param shard a ZeRO-1 rank updates. Copies within the rank; collective because its
    /// result depends on the rank.
    ///
    /// The kernels of these three read the operand and write the result (rank 0's
    /// elements, as if alone), so the plan orders and places them like any kernel; the
    /// data-parallel executors run the collective in their place, and a single session
    /// refuses a step that has them.
    Shard {
        ranks: usize,
    },
}

impl Op {
    /// Short name used by the printer.
    pub fn name(&self) -> String {
        match self {
            Op::Input { .. } => "input".into(),
            Op::Param { .. } => "param".into(),
            Op::Literal { .. } => "literal".into(),
            Op::Full { .. } => "full".into(),
            Op::Arange { .. } => "arange".into(),
            Op::Unary(u) => u.name().into(),
            Op::Binary(b) => b.name().into(),
            Op::Where => "where".into(),
            Op::Cast { .. } => "cast".into(),
            Op::Reduce { op, .. } => format!("reduce.{}", op.name()),
            Op::ArgMax { .. } => "argmax".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Permute { .. } => "permute".into(),
            Op::BroadcastTo { .. } => "broadcast_to".into(),
            Op::Concat { .. } => "concat".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Select { .. } => "select".into(),
            Op::MatMul => "matmul".into(),
            Op::Conv2d { .. } => "conv2d".into(),
            Op::Pool2d { kind, .. } => format!("{}_pool2d", kind.name()),
            Op::Embedding => "embedding".into(),
            Op::Dropout { .. } => "dropout".into(),
            Op::Tri { upper: false, .. } => "tril".into(),
            Op::Tri { upper: true, .. } => "triu".into(),
            Op::Grad => "grad".into(),
            Op::State { .. } => "state".into(),
            Op::Conv2dGradInput { .. } => "conv2d_grad_input".into(),
            Op::Conv2dGradWeight { .. } => "conv2d_grad_weight".into(),
            Op::Pool2dGrad { kind, .. } => format!("{}_pool2d_grad", kind.name()),
            Op::EmbeddingGrad { .. } => "embedding_grad".into(),
            Op::Attention { .. } => "attention".into(),
            Op::AttentionLse { .. } => "attention_lse".into(),
            Op::AttentionGrad { kv: false, .. } => "attention_grad_q".into(),
            Op::AttentionGrad { kv: true, .. } => "attention_grad_kv".into(),
            Op::AllReduce => "all_reduce".into(),
            Op::ReduceScatter { .. } => "reduce_scatter".into(),
            Op::AllGather { .. } => "all_gather".into(),
            Op::Shard { .. } => "shard".into(),
        }
    }

    /// The attributes as the printer shows them (`axes=[1] keepdim=true`), or empty.
    pub fn attrs(&self) -> String {
        fn list(v: &[usize]) -> String {
            Shape(v.to_vec()).to_string()
        }
        match self {
            Op::Input { name, .. } | Op::State { name, .. } => name.clone(),
            Op::Param { name, init, .. } => format!("{name} init={init}"),
            Op::Literal { value, .. } => value.to_string(),
            Op::Full { value, .. } => value.to_string(),
            Op::Arange { n } => format!("n={n}"),
            Op::Cast { to } => format!("to={to}"),
            Op::Reduce { axes, keepdim, .. } => format!("axes={} keepdim={keepdim}", list(axes)),
            Op::ArgMax { axis, keepdim } => match axis {
                Some(a) => format!("axis={a} keepdim={keepdim}"),
                None => format!("axis=all keepdim={keepdim}"),
            },
            Op::Reshape { shape } => format!("shape={shape}"),
            Op::Permute { perm } => format!("perm={}", list(perm)),
            Op::BroadcastTo { shape } => format!("shape={shape}"),
            Op::Concat { axis } => format!("axis={axis}"),
            Op::Slice { ranges } => {
                let parts: Vec<String> = ranges.iter().map(|(s, e)| format!("{s}:{e}")).collect();
                format!("[{}]", parts.join(", "))
            }
            Op::Select { axis, index } => format!("axis={axis} index={index}"),
            Op::Conv2d {
                stride,
                padding,
                groups,
            }
            | Op::Conv2dGradInput {
                stride,
                padding,
                groups,
                ..
            }
            | Op::Conv2dGradWeight {
                stride,
                padding,
                groups,
                ..
            } => format!(
                "stride={} padding={} groups={groups}",
                list(stride),
                list(padding)
            ),
            Op::Pool2d {
                kernel,
                stride,
                padding,
                ..
            }
            | Op::Pool2dGrad {
                kernel,
                stride,
                padding,
                ..
            } => format!(
                "kernel={} stride={} padding={}",
                list(kernel),
                list(stride),
                list(padding)
            ),
            Op::Dropout { p, seed } => format!("p={p:?} seed={seed}"),
            Op::EmbeddingGrad { vocab } => format!("vocab={vocab}"),
            Op::Tri { k, .. } => format!("k={k}"),
            Op::Attention { causal, scale }
            | Op::AttentionLse { causal, scale }
            | Op::AttentionGrad { causal, scale, .. } => {
                format!("causal={causal} scale={scale:?}")
            }
            Op::ReduceScatter { ranks } | Op::Shard { ranks } => format!("ranks={ranks}"),
            Op::AllGather { ranks, shape } => format!("ranks={ranks} shape={shape}"),
            _ => String::new(),
        }
    }

    /// How many operands the op takes (`None`: any number ≥ 1).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. }
            | Op::Param { .. }
            | Op::State { .. }
            | Op::Literal { .. }
            | Op::Full { .. }
            | Op::Arange { .. } => 0,
            Op::Unary(_)
            | Op::Cast { .. }
            | Op::Reduce { .. }
            | Op::ArgMax { .. }
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::BroadcastTo { .. }
            | Op::Slice { .. }
            | Op::Select { .. }
            | Op::Pool2d { .. }
            | Op::Dropout { .. }
            | Op::Tri { .. }
            | Op::AllReduce
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::Shard { .. } => 1,
            Op::Binary(_)
            | Op::MatMul
            | Op::Conv2d { .. }
            | Op::Embedding
            | Op::Grad
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradWeight { .. }
            | Op::Pool2dGrad { .. }
            | Op::EmbeddingGrad { .. }
            | Op::AttentionLse { .. } => 2,
            Op::Where | Op::Attention { .. } => 3,
            Op::AttentionGrad { .. } => 6,
            Op::Concat { .. } => return None,
        })
    }
}

/// Why an op cannot take the operands it was given. `message` is the headline,
/// `detail` goes under the span; both speak of shapes and dtypes as the program wrote them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}: {detail}")]
pub struct TypeError {
    pub code: &'static str,
    pub message: String,
    pub detail: String,
}

impl TypeError {
    pub fn new(code: &'static str, message: impl Into<String>, detail: impl Into<String>) -> Self {
        TypeError {
            code,
            message: message.into(),
            detail: detail.into(),
        }
    }
}

/// NumPy broadcasting of two shapes (align on the right; a dimension of 1 stretches).
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Result<Shape, TypeError> {
    let (ad, bd) = (a.dims(), b.dims());
    let n = ad.len().max(bd.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i < ad.len() {
            ad[ad.len() - 1 - i]
        } else {
            1
        };
        let y = if i < bd.len() {
            bd[bd.len() - 1 - i]
        } else {
            1
        };
        out[n - 1 - i] = if x == y || y == 1 {
            x
        } else if x == 1 {
            y
        } else {
            return Err(TypeError::new(
                "E0302",
                "shapes cannot be broadcast together",
                format!(
                    "{a} and {b}: dimension {} from the right is {x} vs {y}",
                    i + 1
                ),
            ));
        };
    }
    Ok(Shape(out))
}

/// The "dimension k from the right" part of a broadcast error.
fn broadcast_axis_detail(e: &TypeError) -> &str {
    e.detail
        .split_once(": ")
        .map_or(e.detail.as_str(), |(_, d)| d)
}

fn same_dtype(what: &str, a: DType, b: DType) -> Result<(), TypeError> {
    if a != b {
        return Err(TypeError::new(
            "E0401",
            format!("dtype mismatch in {what}"),
            format!("{a} vs {b} (tcc never converts between tensor dtypes implicitly; use cast)"),
        ));
    }
    Ok(())
}

fn wrong_dtype(op: &str, dtype: DType, expected: &str) -> TypeError {
    TypeError::new(
        "E0402",
        format!("`{op}` does not take {dtype}"),
        format!("found {dtype}, expected {expected}"),
    )
}

fn check_axis(op: &str, axis: usize, rank: usize) -> Result<(), TypeError> {
    if axis >= rank {
        return Err(TypeError::new(
            "E0306",
            format!("axis out of range in `{op}`"),
            format!("axis {axis} for a tensor of rank {rank}"),
        ));
    }
    Ok(())
}

fn image_out(input: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = pad.checked_mul(2)?.checked_add(input)?;
    if stride == 0 || kernel == 0 || padded < kernel {
        return None;
    }
    Some((padded - kernel) / stride + 1)
}

/// The result type of `op` applied to operands of types `ins`.
pub fn infer(op: &Op, ins: &[&TensorType]) -> Result<TensorType, TypeError> {
    if let Some(n) = op.arity() {
        if ins.len() != n {
            return Err(TypeError::new(
                "E0203",
                format!("`{}` takes {n} operand(s)", op.name()),
                format!("given {}", ins.len()),
            ));
        }
    } else if ins.is_empty() {
        return Err(TypeError::new(
            "E0203",
            format!("`{}` needs at least one operand", op.name()),
            "given none",
        ));
    }
    match op {
        Op::Input { ty, .. } | Op::Param { ty, .. } | Op::State { ty, .. } => {
            if ty.dims().contains(&0) {
                return Err(TypeError::new(
                    "E0316",
                    "zero-sized dimension",
                    format!("{ty} has a dimension of 0"),
                ));
            }
            Ok(ty.clone())
        }
        Op::Literal { dtype, .. } => Ok(TensorType::scalar(*dtype)),
        Op::Full { ty, .. } => Ok(ty.clone()),
        Op::Arange { n } => {
            if *n == 0 {
                return Err(TypeError::new(
                    "E0316",
                    "empty `arange`",
                    "n must be at least 1",
                ));
            }
            Ok(TensorType::new(DType::I32, vec![*n]))
        }
        Op::Unary(u) => {
            let x = ins[0];
            if !u.accepts(x.dtype) {
                return Err(wrong_dtype(u.name(), x.dtype, u.spec().takes.describe()));
            }
            Ok(x.clone())
        }
        Op::Binary(b) => {
            let (x, y) = (ins[0], ins[1]);
            same_dtype(&format!("`{}`", b.name()), x.dtype, y.dtype)?;
            if !b.accepts(x.dtype) {
                return Err(wrong_dtype(b.name(), x.dtype, b.spec().takes.describe()));
            }
            let shape = broadcast_shapes(&x.shape, &y.shape).map_err(|e| {
                let detail = format!("{x} and {y}: {}", broadcast_axis_detail(&e));
                TypeError::new(e.code, e.message, detail)
            })?;
            let dtype = if b.is_comparison() {
                DType::Bool
            } else {
                x.dtype
            };
            Ok(TensorType { dtype, shape })
        }
        Op::Where => {
            let (c, a, b) = (ins[0], ins[1], ins[2]);
            if c.dtype != DType::Bool {
                return Err(wrong_dtype("where", c.dtype, "a bool condition"));
            }
            same_dtype("`where`", a.dtype, b.dtype)?;
            let s = broadcast_shapes(&c.shape, &a.shape)?;
            let s = broadcast_shapes(&s, &b.shape)?;
            Ok(TensorType::new(a.dtype, s))
        }
        Op::Cast { to } => Ok(TensorType::new(*to, ins[0].shape.clone())),
        Op::Reduce {
            op: r,
            axes,
            keepdim,
        } => {
            let x = ins[0];
            let ok = match r {
                ReduceOp::Mean => x.dtype.is_float(),
                _ => x.dtype.is_numeric(),
            };
            if !ok {
                let expected = if *r == ReduceOp::Mean {
                    "a float dtype"
                } else {
                    "a numeric dtype"
                };
                return Err(wrong_dtype(r.name(), x.dtype, expected));
            }
            for (i, &a) in axes.iter().enumerate() {
                check_axis(r.name(), a, x.rank())?;
                if axes[..i].contains(&a) {
                    return Err(TypeError::new(
                        "E0306",
                        format!("repeated axis in `{}`", r.name()),
                        format!("axis {a} appears twice"),
                    ));
                }
            }
            let dims = x
                .dims()
                .iter()
                .enumerate()
                .filter_map(|(i, &d)| match (axes.contains(&i), keepdim) {
                    (false, _) => Some(d),
                    (true, true) => Some(1),
                    (true, false) => None,
                })
                .collect::<Vec<_>>();
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::ArgMax { axis, keepdim } => {
            let x = ins[0];
            if !x.dtype.is_numeric() {
                return Err(wrong_dtype("argmax", x.dtype, "a numeric dtype"));
            }
            let dims = match axis {
                Some(a) => {
                    check_axis("argmax", *a, x.rank())?;
                    let mut d = x.dims().to_vec();
                    if *keepdim {
                        d[*a] = 1;
                    } else {
                        d.remove(*a);
                    }
                    d
                }
                None if *keepdim => vec![1; x.rank()],
                None => vec![],
            };
            Ok(TensorType::new(DType::I32, dims))
        }
        Op::Reshape { shape } => {
            let x = ins[0];
            if x.shape.numel() != shape.numel() {
                return Err(TypeError::new(
                    "E0303",
                    "reshape changes the number of elements",
                    format!(
                        "{} has {} elements, {shape} has {}",
                        x,
                        x.shape.numel(),
                        shape.numel()
                    ),
                ));
            }
            Ok(TensorType::new(x.dtype, shape.clone()))
        }
        Op::Permute { perm } => {
            let x = ins[0];
            let mut seen = vec![false; x.rank()];
            let valid = perm.len() == x.rank()
                && perm
                    .iter()
                    .all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
            if !valid {
                return Err(TypeError::new(
                    "E0307",
                    "invalid permutation",
                    format!(
                        "{} is not a permutation of the {} axes of {x}",
                        Shape(perm.clone()),
                        x.rank()
                    ),
                ));
            }
            let dims = perm.iter().map(|&p| x.dims()[p]).collect::<Vec<_>>();
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::BroadcastTo { shape } => {
            let x = ins[0];
            let ok = broadcast_shapes(&x.shape, shape)
                .map(|s| &s == shape)
                .unwrap_or(false);
            if !ok {
                return Err(TypeError::new(
                    "E0314",
                    "cannot broadcast to that shape",
                    format!("{x} does not broadcast to {shape}"),
                ));
            }
            Ok(TensorType::new(x.dtype, shape.clone()))
        }
        Op::Concat { axis } => {
            let first = ins[0];
            check_axis("concat", *axis, first.rank())?;
            let mut total = 0usize;
            for (i, t) in ins.iter().enumerate() {
                same_dtype("`concat`", first.dtype, t.dtype)?;
                let ok = t.rank() == first.rank()
                    && t.dims()
                        .iter()
                        .zip(first.dims())
                        .enumerate()
                        .all(|(a, (x, y))| a == *axis || x == y);
                if !ok {
                    return Err(TypeError::new(
                        "E0304",
                        "concat operands differ outside the concat axis",
                        format!("operand 0 is {first}, operand {i} is {t} (axis {axis})"),
                    ));
                }
                total += t.dims()[*axis];
            }
            let mut dims = first.dims().to_vec();
            dims[*axis] = total;
            Ok(TensorType::new(first.dtype, dims))
        }
        Op::Slice { ranges } => {
            let x = ins[0];
            if ranges.len() != x.rank() {
                return Err(TypeError::new(
                    "E0308",
                    "slice rank differs from the tensor's",
                    format!("{} ranges for {x}", ranges.len()),
                ));
            }
            for (a, (&(s, e), &d)) in ranges.iter().zip(x.dims()).enumerate() {
                if s >= e || e > d {
                    return Err(TypeError::new(
                        "E0308",
                        "slice out of range",
                        format!("{s}:{e} on axis {a} of {x} (size {d})"),
                    ));
                }
            }
            let dims = ranges.iter().map(|(s, e)| e - s).collect::<Vec<_>>();
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::Select { axis, index } => {
            let x = ins[0];
            check_axis("index", *axis, x.rank())?;
            if *index >= x.dims()[*axis] {
                return Err(TypeError::new(
                    "E0308",
                    "index out of range",
                    format!("index {index} on axis {axis} of {x}"),
                ));
            }
            let mut dims = x.dims().to_vec();
            dims.remove(*axis);
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::MatMul => infer_matmul(ins[0], ins[1]),
        Op::Conv2d {
            stride,
            padding,
            groups,
        } => infer_conv(ins[0], ins[1], *stride, *padding, *groups),
        Op::Pool2d {
            kind,
            kernel,
            stride,
            padding,
        } => {
            let x = ins[0];
            let name = op.name();
            if x.rank() != 4 {
                return Err(TypeError::new(
                    "E0310",
                    format!("`{name}` needs a 4-D input [N, C, H, W]"),
                    format!("found {x}"),
                ));
            }
            if !(x.dtype.is_float() || (*kind == PoolKind::Max && x.dtype.is_numeric())) {
                return Err(wrong_dtype(&name, x.dtype, "a float dtype"));
            }
            let mut dims = x.dims().to_vec();
            for i in 0..2 {
                if padding[i].saturating_mul(2) > kernel[i] {
                    return Err(TypeError::new(
                        "E0310",
                        format!("`{name}` padding is more than half the window"),
                        format!("padding {} with window {}", padding[i], kernel[i]),
                    ));
                }
                dims[2 + i] =
                    image_out(dims[2 + i], kernel[i], stride[i], padding[i]).ok_or_else(|| {
                        TypeError::new(
                            "E0310",
                            format!("`{name}` window does not fit the input"),
                            format!(
                                "window {} stride {} padding {} on {x}",
                                Shape(kernel.to_vec()),
                                Shape(stride.to_vec()),
                                Shape(padding.to_vec())
                            ),
                        )
                    })?;
            }
            Ok(TensorType::new(x.dtype, dims))
        }
        Op::Embedding => {
            let (table, ids) = (ins[0], ins[1]);
            if table.rank() != 2 {
                return Err(TypeError::new(
                    "E0313",
                    "`embedding` table must be 2-D [V, D]",
                    format!("found {table}"),
                ));
            }
            if ids.dtype != DType::I32 {
                return Err(wrong_dtype("embedding ids", ids.dtype, "i32"));
            }
            let mut dims = ids.dims().to_vec();
            dims.push(table.dims()[1]);
            Ok(TensorType::new(table.dtype, dims))
        }
        Op::Dropout { p, .. } => {
            let x = ins[0];
            if !x.dtype.is_float() {
                return Err(wrong_dtype("dropout", x.dtype, "a float dtype"));
            }
            if !(0.0..1.0).contains(p) {
                return Err(TypeError::new(
                    "E0316",
                    "dropout probability out of range",
                    format!("p = {p:?}, expected 0 <= p < 1"),
                ));
            }
            Ok(x.clone())
        }
        Op::Tri { upper, .. } => {
            let x = ins[0];
            if x.rank() < 2 {
                return Err(TypeError::new(
                    "E0313",
                    format!(
                        "`{}` needs at least 2 axes",
                        if *upper { "triu" } else { "tril" }
                    ),
                    format!("found {x}"),
                ));
            }
            Ok(x.clone())
        }
        Op::Grad => {
            let (y, x) = (ins[0], ins[1]);
            if y.rank() != 0 || y.dtype != DType::F32 {
                return Err(TypeError::new(
                    "E0501",
                    "`grad` needs a scalar f32 value to differentiate",
                    format!("found {y}, expected f32[]"),
                ));
            }
            if !x.dtype.is_float() {
                return Err(wrong_dtype(
                    "grad",
                    x.dtype,
                    "a float tensor to differentiate by",
                ));
            }
            Ok(x.clone())
        }
        Op::Conv2dGradInput {
            stride,
            padding,
            groups,
            input,
        } => {
            let (dy, w) = (ins[0], ins[1]);
            let x = TensorType::new(dy.dtype, input.clone());
            let fwd = infer_conv(&x, w, *stride, *padding, *groups)?;
            if fwd.shape != dy.shape {
                return Err(TypeError::new(
                    "E0305",
                    "conv2d input gradient shape mismatch",
                    format!("dy {dy} but conv2d of {x} with {w} gives {fwd}"),
                ));
            }
            Ok(x)
        }
        Op::Conv2dGradWeight {
            stride,
            padding,
            groups,
            weight,
        } => {
            let (x, dy) = (ins[0], ins[1]);
            let w = TensorType::new(x.dtype, weight.clone());
            let fwd = infer_conv(x, &w, *stride, *padding, *groups)?;
            if fwd.shape != dy.shape || fwd.dtype != dy.dtype {
                return Err(TypeError::new(
                    "E0305",
                    "conv2d weight gradient shape mismatch",
                    format!("dy {dy} but conv2d of {x} with {w} gives {fwd}"),
                ));
            }
            Ok(w)
        }
        Op::Pool2dGrad {
            kind,
            kernel,
            stride,
            padding,
        } => {
            let (x, dy) = (ins[0], ins[1]);
            let fwd = infer(
                &Op::Pool2d {
                    kind: *kind,
                    kernel: *kernel,
                    stride: *stride,
                    padding: *padding,
                },
                &[x],
            )?;
            if &fwd != dy {
                return Err(TypeError::new(
                    "E0310",
                    "pooling gradient shape mismatch",
                    format!("dy {dy} but pooling {x} gives {fwd}"),
                ));
            }
            Ok(x.clone())
        }
        Op::EmbeddingGrad { vocab } => {
            let (ids, dy) = (ins[0], ins[1]);
            if ids.dtype != DType::I32 {
                return Err(wrong_dtype("embedding ids", ids.dtype, "i32"));
            }
            let ok = dy.rank() == ids.rank() + 1 && dy.dims()[..ids.rank()] == *ids.dims();
            if !ok || *vocab == 0 {
                return Err(TypeError::new(
                    "E0313",
                    "embedding gradient shape mismatch",
                    format!("ids {ids}, dy {dy}"),
                ));
            }
            Ok(TensorType::new(
                dy.dtype,
                vec![*vocab, dy.dims()[ids.rank()]],
            ))
        }
        Op::Attention { .. } => {
            let (q, k, v) = (ins[0], ins[1], ins[2]);
            infer_attention(q, k, Some(v))
        }
        Op::AttentionLse { .. } => infer_attention(ins[0], ins[1], None),
        Op::AttentionGrad { kv, .. } => infer_attention_grad(ins, *kv),
        Op::AllReduce => {
            let x = ins[0];
            if !x.dtype.is_numeric() {
                return Err(wrong_dtype(
                    "all_reduce operand",
                    x.dtype,
                    "a numeric dtype",
                ));
            }
            Ok(x.clone())
        }
        Op::ReduceScatter { ranks } | Op::Shard { ranks } => {
            let x = ins[0];
            if !x.dtype.is_numeric() {
                return Err(wrong_dtype(
                    &format!("{} operand", op.name()),
                    x.dtype,
                    "a numeric dtype",
                ));
            }
            let n = x.shape.numel();
            if *ranks == 0 || (matches!(op, Op::ReduceScatter { .. }) && !n.is_multiple_of(*ranks))
            {
                return Err(TypeError::new(
                    "E0002",
                    "a reduce_scatter needs a whole shard per rank",
                    format!("{n} elements over {ranks} ranks"),
                ));
            }
            Ok(TensorType::new(x.dtype, vec![n.div_ceil(*ranks)]))
        }
        Op::AllGather { ranks, shape } => {
            let x = ins[0];
            let whole = TensorType::new(x.dtype, shape.0.clone());
            if x.rank() != 1 || x.shape.numel() * ranks != whole.shape.numel() {
                return Err(TypeError::new(
                    "E0002",
                    "an all_gather gathers one [S] shard per rank",
                    format!("{ranks} shards of {} into {shape}", x.shape),
                ));
            }
            Ok(whole)
        }
    }
}

/// `[q [.., T, D], k [.., S, D], v [.., S, E]]` → `[.., T, E]`; without `v`, the row
/// statistics `[.., T]`.
fn infer_attention(
    q: &TensorType,
    k: &TensorType,
    v: Option<&TensorType>,
) -> Result<TensorType, TypeError> {
    let r = q.rank();
    let mismatch = || {
        let v = v.map_or(String::new(), |v| format!(", v {v}"));
        TypeError::new(
            "E0301",
            "attention operands do not match",
            format!("q {q}, k {k}{v}"),
        )
    };
    if !matches!(q.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(wrong_dtype("attention", q.dtype, "f32, bf16 or f16"));
    }
    // `k` and `v` in `q`'s dtype: the error names the one that is not.
    if let Some(other) = [Some(k), v]
        .into_iter()
        .flatten()
        .find(|t| t.dtype != q.dtype)
    {
        return Err(wrong_dtype("attention", other.dtype, q.dtype.name()));
    }
    if r < 2 || k.rank() != r || k.dims()[..r - 2] != q.dims()[..r - 2] {
        return Err(mismatch());
    }
    if k.dims()[r - 1] != q.dims()[r - 1] {
        return Err(mismatch());
    }
    let mut dims = q.dims()[..r - 1].to_vec();
    if let Some(v) = v {
        if v.rank() != r || v.dims()[..r - 1] != k.dims()[..r - 1] {
            return Err(mismatch());
        }
        dims.push(v.dims()[r - 1]);
    }
    // The output in the operands' dtype (computed in f32), the row statistics in f32.
    let dtype = if v.is_some() { q.dtype } else { DType::F32 };
    Ok(TensorType::new(dtype, dims))
}

/// `[q, k, v, dout [.., T, E], lse [.., T, 1], delta [.., T, 1]]` → `dq [.., T, D]`, or
/// (`kv`) `[.., S, D + E]`.
fn infer_attention_grad(ins: &[&TensorType], kv: bool) -> Result<TensorType, TypeError> {
    let (q, k, v, dout, lse, delta) = (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5]);
    let o = infer_attention(q, k, Some(v))?;
    let mut rows = o.dims()[..o.rank() - 1].to_vec();
    rows.push(1);
    let stat_ok = |x: &TensorType| x.dtype == DType::F32 && x.dims() == rows;
    if dout.dtype != q.dtype || dout.dims() != o.dims() || !stat_ok(lse) || !stat_ok(delta) {
        return Err(TypeError::new(
            "E0301",
            "attention gradient operands do not match",
            format!("output {o}, dout {dout}, lse {lse}, delta {delta}"),
        ));
    }
    let r = q.rank();
    let dims = if kv {
        let mut d = k.dims().to_vec();
        d[r - 1] += v.dims()[r - 1];
        d
    } else {
        q.dims().to_vec()
    };
    Ok(TensorType::new(q.dtype, dims))
}

fn infer_matmul(a: &TensorType, b: &TensorType) -> Result<TensorType, TypeError> {
    same_dtype("`@`", a.dtype, b.dtype)?;
    if !a.dtype.is_numeric() {
        return Err(wrong_dtype("@", a.dtype, "a numeric dtype"));
    }
    if a.rank() == 0 || b.rank() == 0 {
        return Err(TypeError::new(
            "E0301",
            "matmul needs operands of at least one dimension",
            format!("{a} @ {b}: use `*` to scale by a scalar"),
        ));
    }
    let ka = a.dims()[a.rank() - 1];
    let kb = if b.rank() == 1 {
        b.dims()[0]
    } else {
        b.dims()[b.rank() - 2]
    };
    if ka != kb {
        return Err(TypeError::new(
            "E0301",
            "matmul inner dimensions differ",
            format!("{a} @ {b}: {ka} ≠ {kb}"),
        ));
    }
    let batch_a = Shape(a.dims()[..a.rank().saturating_sub(2)].to_vec());
    let batch_b = Shape(b.dims()[..b.rank().saturating_sub(2)].to_vec());
    let batch = broadcast_shapes(&batch_a, &batch_b).map_err(|e| {
        TypeError::new(
            "E0302",
            "matmul batch dimensions cannot be broadcast together",
            format!("{a} @ {b}: {}", e.detail),
        )
    })?;
    let mut dims = batch.0;
    if a.rank() >= 2 {
        dims.push(a.dims()[a.rank() - 2]);
    }
    if b.rank() >= 2 {
        dims.push(b.dims()[b.rank() - 1]);
    }
    Ok(TensorType::new(a.dtype, dims))
}

fn infer_conv(
    x: &TensorType,
    w: &TensorType,
    stride: [usize; 2],
    padding: [usize; 2],
    groups: usize,
) -> Result<TensorType, TypeError> {
    let err = |m: &str, d: String| TypeError::new("E0305", m.to_string(), d);
    same_dtype("`conv2d`", x.dtype, w.dtype)?;
    if !x.dtype.is_float() {
        return Err(wrong_dtype("conv2d", x.dtype, "a float dtype"));
    }
    if x.rank() != 4 || w.rank() != 4 {
        return Err(err(
            "conv2d needs x [N, C, H, W] and w [O, C/groups, KH, KW]",
            format!("found x {x} and w {w}"),
        ));
    }
    let (c, o) = (x.dims()[1], w.dims()[0]);
    if groups == 0 || c % groups != 0 || o % groups != 0 {
        return Err(err(
            "conv2d groups must divide both channel counts",
            format!("groups = {groups}, input channels {c}, output channels {o}"),
        ));
    }
    if w.dims()[1] != c / groups {
        return Err(err(
            "conv2d channel mismatch",
            format!(
                "x {x} has {c} channels, so w needs {} (C/groups) in axis 1, found w {w}",
                c / groups
            ),
        ));
    }
    let mut dims = vec![x.dims()[0], o, 0, 0];
    for i in 0..2 {
        dims[2 + i] = image_out(x.dims()[2 + i], w.dims()[2 + i], stride[i], padding[i])
            .ok_or_else(|| {
                err(
                    "conv2d kernel larger than the padded input",
                    format!(
                        "x {x}, w {w}, stride {}, padding {}",
                        Shape(stride.to_vec()),
                        Shape(padding.to_vec())
                    ),
                )
            })?;
    }
    Ok(TensorType::new(x.dtype, dims))
}

/// Largest head dimension (`D` and `E`) of an [`Op::Attention`]: the fused kernel's register
/// tiles hold a row block's output, `E / 16` columns a thread.
pub const MAX_ATTENTION_HEAD_DIM: usize = 128;

/// Head dimensions an [`Op::Attention`] takes (the graph rewrite makes one only for these,
/// and the PTX back end implements exactly these): multiples of 16 up to
/// [`MAX_ATTENTION_HEAD_DIM`].
pub fn attention_supported(d: usize, e: usize) -> bool {
    let ok = |x: usize| x > 0 && x <= MAX_ATTENTION_HEAD_DIM && x.is_multiple_of(16);
    ok(d) && ok(e)
}
