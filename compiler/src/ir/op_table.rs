//! Each op's facts in one place: what the elementwise ops are called, which dtypes they take,
//! their reference formulas and the algebraic facts the analyses use, and which class every
//! graph op belongs to.
//!
//! The formulas here are THE reference: compile-time folding of scalars
//! (`front::value`) and the eager interpreter (`eager::kernels`) both call them, and every
//! back end must agree with them (the CPU and GPU tests compare against the interpreter).
//! Consumers ask the op ([`Op::is_elementwise`], [`UnaryOp::preserves_zero`], …) instead of
//! listing variants themselves, so a new op is classified once, here.
//!
//! Composite activations that the primitives express exactly belong in the TDSL prelude
//! (`front/prelude.tdsl`, like `softplus`), not here: they need no table row and no back-end
//! code. `gelu`, `silu` and `sigmoid` stay primitives because that costs: written in the
//! prelude, their backward passes fuse worse. Measured on `examples/gpt.tdsl` (CUDA kernels
//! and arena, primitive -> prelude): gelu 410 -> 446 kernels, 3.55 -> 4.11 GiB; the same
//! model with silu 410 -> 422 kernels; with sigmoid 398 -> 410 kernels, 2.99 -> 3.55 GiB.

use super::ops::{BinaryOp, Op, PoolKind, UnaryOp};
use super::types::DType;

/// The dtypes an elementwise op takes (its operands all share one dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Takes {
    Bool,
    /// f32, f16, bf16 or i32.
    Numeric,
    /// f32, f16 or bf16.
    Float,
    Any,
}

impl Takes {
    pub fn accepts(self, dtype: DType) -> bool {
        match self {
            Takes::Bool => dtype == DType::Bool,
            Takes::Numeric => dtype.is_numeric(),
            Takes::Float => dtype.is_float(),
            Takes::Any => true,
        }
    }

    /// What a diagnostic says was expected.
    pub fn describe(self) -> &'static str {
        match self {
            Takes::Bool => "bool",
            Takes::Numeric | Takes::Any => "a numeric dtype (f32, f16, bf16, i32)",
            Takes::Float => "a float dtype (f32, f16, bf16)",
        }
    }
}

/// One row of the unary table.
#[derive(Clone, Copy)]
pub struct UnarySpec {
    /// The builtin's name (and the printer's).
    pub name: &'static str,
    pub takes: Takes,
    /// The reference formula on numbers (on bools: 0 is false, 1 is true).
    pub f: fn(f64) -> f64,
    /// The formula on i32 (`Some` exactly when `takes` is [`Takes::Numeric`]).
    pub int: Option<fn(i32) -> i32>,
    /// `f(0) == 0`: a zero region of the operand stays zero.
    pub preserves_zero: bool,
    /// `f(-inf) == 0`, relied on by the zeros analysis (a masked score becomes a zero:
    /// `exp`, `relu`).
    pub zero_at_neg_inf: bool,
    /// Defined, finite and continuous on every real number (else only on positive ones).
    pub on_all_reals: bool,
}

/// The tanh form of GELU (what `gelu` means in TDSL).
fn gelu(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// `d/dx gelu(x)`: with `u = c (x + a x^3)` and `t = tanh(u)`,
/// `0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)`.
fn gelu_grad(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let a = 0.044715;
    let t = (c * (x + a * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x)
}

fn relu(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn truth(c: bool) -> f64 {
    if c {
        1.0
    } else {
        0.0
    }
}

impl UnaryOp {
    /// The op's row of the table.
    pub fn spec(self) -> UnarySpec {
        use Takes::{Bool, Float, Numeric};
        // name, takes, f, int, f(0) == 0, f(-inf) == 0, on all reals
        let row = |name, takes, f: fn(f64) -> f64, int, zero, ninf, reals| UnarySpec {
            name,
            takes,
            f,
            int,
            preserves_zero: zero,
            zero_at_neg_inf: ninf,
            on_all_reals: reals,
        };
        match self {
            UnaryOp::Neg => row(
                "neg",
                Numeric,
                |x| -x,
                Some(i32::wrapping_neg),
                true,
                false,
                true,
            ),
            UnaryOp::Abs => row(
                "abs",
                Numeric,
                f64::abs,
                Some(i32::wrapping_abs),
                true,
                false,
                true,
            ),
            UnaryOp::Exp => row("exp", Float, f64::exp, None, false, true, true),
            UnaryOp::Log => row("log", Float, f64::ln, None, false, false, false),
            UnaryOp::Sqrt => row("sqrt", Float, f64::sqrt, None, true, false, false),
            UnaryOp::Rsqrt => row(
                "rsqrt",
                Float,
                |x| 1.0 / x.sqrt(),
                None,
                false,
                false,
                false,
            ),
            UnaryOp::Recip => row("recip", Float, |x| 1.0 / x, None, false, false, false),
            UnaryOp::Tanh => row("tanh", Float, f64::tanh, None, true, false, true),
            UnaryOp::Sigmoid => row("sigmoid", Float, sigmoid, None, false, false, true),
            UnaryOp::Relu => row(
                "relu",
                Numeric,
                relu,
                Some(|a: i32| a.max(0)),
                true,
                true,
                true,
            ),
            UnaryOp::Gelu => row("gelu", Float, gelu, None, true, false, true),
            UnaryOp::GeluGrad => row("gelu_grad", Float, gelu_grad, None, false, false, true),
            UnaryOp::Silu => row("silu", Float, |x| x * sigmoid(x), None, true, false, true),
            UnaryOp::Sin => row("sin", Float, f64::sin, None, true, false, true),
            UnaryOp::Cos => row("cos", Float, f64::cos, None, false, false, true),
            UnaryOp::Erf => row("erf", Float, libm::erf, None, true, false, true),
            UnaryOp::Not => row("not", Bool, |x| truth(x == 0.0), None, false, false, true),
        }
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The builtin of that name (`not` is spelled `!` in TDSL, and `gelu_grad` is made
    /// only by the backward pass: neither is a builtin).
    pub fn from_builtin(name: &str) -> Option<UnaryOp> {
        UnaryOp::ALL
            .into_iter()
            .find(|op| op.name() == name && !matches!(op, UnaryOp::Not | UnaryOp::GeluGrad))
    }

    /// Which dtypes the op accepts.
    pub fn accepts(self, dtype: DType) -> bool {
        self.spec().takes.accepts(dtype)
    }

    /// The reference value of the op at `x`.
    pub fn eval(self, x: f64) -> f64 {
        (self.spec().f)(x)
    }

    /// The reference value on an i32 (`None` for ops that take floats only).
    pub fn eval_i32(self, x: i32) -> Option<i32> {
        self.spec().int.map(|f| f(x))
    }

    /// `f(0) == 0`.
    pub fn preserves_zero(self) -> bool {
        self.spec().preserves_zero
    }

    /// `f(-inf) == 0`.
    pub fn zero_at_neg_inf(self) -> bool {
        self.spec().zero_at_neg_inf
    }

    /// Defined, finite and continuous on every real number.
    pub fn on_all_reals(self) -> bool {
        self.spec().on_all_reals
    }
}

/// Why an integer op has no value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntFault {
    DivisionByZero,
    /// The op does not take integers.
    NotInteger,
}

/// One row of the binary table.
#[derive(Clone, Copy)]
pub struct BinarySpec {
    pub name: &'static str,
    pub takes: Takes,
    /// The result is bool (comparisons and logical ops); else the operands' dtype.
    pub yields_bool: bool,
    /// The reference formula on numbers (bools as 0 and 1; a bool result as 0 or 1).
    pub f: fn(f64, f64) -> f64,
    /// The formula on i32 operands (a bool result as 0 or 1).
    pub int: fn(i32, i32) -> Result<i64, IntFault>,
}

fn nan_or(x: f64, y: f64, f: fn(f64, f64) -> f64) -> f64 {
    if x.is_nan() || y.is_nan() {
        f64::NAN
    } else {
        f(x, y)
    }
}

/// Integer division rounding toward negative infinity.
fn floor_div(x: i32, y: i32) -> Result<i64, IntFault> {
    if y == 0 {
        return Err(IntFault::DivisionByZero);
    }
    let (x, y) = (x as i64, y as i64);
    Ok(x.div_euclid(y) - i64::from(y < 0 && x.rem_euclid(y) != 0))
}

/// The remainder of [`floor_div`]: it takes the divisor's sign.
fn floor_rem(x: i32, y: i32) -> Result<i64, IntFault> {
    if y == 0 {
        return Err(IntFault::DivisionByZero);
    }
    let r = (x as i64) % (y as i64);
    Ok(if r != 0 && ((r < 0) != (y < 0)) {
        r + y as i64
    } else {
        r
    })
}

impl BinaryOp {
    /// The op's row of the table.
    pub fn spec(self) -> BinarySpec {
        use Takes::{Any, Bool, Float, Numeric};
        type F = fn(f64, f64) -> f64;
        type I = fn(i32, i32) -> Result<i64, IntFault>;
        let row = |name, takes, yields_bool, f: F, int: I| BinarySpec {
            name,
            takes,
            yields_bool,
            f,
            int,
        };
        match self {
            BinaryOp::Add => row(
                "add",
                Numeric,
                false,
                |x, y| x + y,
                |x, y| Ok(x.wrapping_add(y) as i64),
            ),
            BinaryOp::Sub => row(
                "sub",
                Numeric,
                false,
                |x, y| x - y,
                |x, y| Ok(x.wrapping_sub(y) as i64),
            ),
            BinaryOp::Mul => row(
                "mul",
                Numeric,
                false,
                |x, y| x * y,
                |x, y| Ok(x.wrapping_mul(y) as i64),
            ),
            BinaryOp::Div => row("div", Numeric, false, |x, y| x / y, floor_div),
            BinaryOp::Rem => row(
                "rem",
                Numeric,
                false,
                |x, y| x - y * (x / y).floor(),
                floor_rem,
            ),
            BinaryOp::Pow => row("pow", Float, false, f64::powf, |x, y| {
                Ok((x as f64).powf(y as f64) as i64)
            }),
            BinaryOp::Maximum => row(
                "maximum",
                Numeric,
                false,
                |x, y| nan_or(x, y, f64::max),
                |x, y| Ok(x.max(y) as i64),
            ),
            BinaryOp::Minimum => row(
                "minimum",
                Numeric,
                false,
                |x, y| nan_or(x, y, f64::min),
                |x, y| Ok(x.min(y) as i64),
            ),
            BinaryOp::Eq => row(
                "eq",
                Any,
                true,
                |x, y| truth(x == y),
                |x, y| Ok(i64::from(x == y)),
            ),
            BinaryOp::Ne => row(
                "ne",
                Any,
                true,
                |x, y| truth(x != y),
                |x, y| Ok(i64::from(x != y)),
            ),
            BinaryOp::Lt => row(
                "lt",
                Numeric,
                true,
                |x, y| truth(x < y),
                |x, y| Ok(i64::from(x < y)),
            ),
            BinaryOp::Le => row(
                "le",
                Numeric,
                true,
                |x, y| truth(x <= y),
                |x, y| Ok(i64::from(x <= y)),
            ),
            BinaryOp::Gt => row(
                "gt",
                Numeric,
                true,
                |x, y| truth(x > y),
                |x, y| Ok(i64::from(x > y)),
            ),
            BinaryOp::Ge => row(
                "ge",
                Numeric,
                true,
                |x, y| truth(x >= y),
                |x, y| Ok(i64::from(x >= y)),
            ),
            BinaryOp::And => row(
                "and",
                Bool,
                true,
                |x, y| truth(x != 0.0 && y != 0.0),
                |_, _| Err(IntFault::NotInteger),
            ),
            BinaryOp::Or => row(
                "or",
                Bool,
                true,
                |x, y| truth(x != 0.0 || y != 0.0),
                |_, _| Err(IntFault::NotInteger),
            ),
        }
    }

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// `== != < <= > >=`: numbers in, bool out.
    pub fn is_comparison(self) -> bool {
        let s = self.spec();
        s.yields_bool && s.takes != Takes::Bool
    }

    /// `&& ||`: bools in, bool out.
    pub fn is_logical(self) -> bool {
        self.spec().takes == Takes::Bool
    }

    pub fn accepts(self, dtype: DType) -> bool {
        self.spec().takes.accepts(dtype)
    }

    /// The reference value of the op at `(x, y)`.
    pub fn eval(self, x: f64, y: f64) -> f64 {
        (self.spec().f)(x, y)
    }

    /// The reference value on i32 operands.
    pub fn eval_i32(self, x: i32, y: i32) -> Result<i64, IntFault> {
        (self.spec().int)(x, y)
    }
}

/// What kind of computation a graph op is: the classes fusion, layout, liveness and
/// rematerialisation reason about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    /// Fed from outside the step: `input`, `param`, `state`.
    Leaf,
    /// A scalar constant, inlined wherever it is read.
    Scalar,
    /// A tensor computed from its index alone: `full`, `arange`.
    Fill,
    /// Each result element from the operand elements at the same (broadcast) index:
    /// unary and binary ops, `where`, `cast`.
    Elementwise,
    /// Each result element from at most one element of each operand, at a computed index:
    /// `tril`/`triu`, `dropout`, `concat`, `embedding`.
    Indexed,
    /// May alias its operand's bytes (the layout pass decides): reshape, permute,
    /// broadcast, slice, select.
    View,
    /// A loop over operand elements per result element: `reduce`, `argmax`.
    Reduction,
    /// A sum of products (matmul-like): `matmul`, `conv2d` and its gradients.
    Contraction,
    /// A pooling window per result element: pooling, and the average pool's gradient.
    Window,
    /// Accumulated into a zeroed result: `embedding_grad`, the max pool's gradient.
    Scatter,
    /// Fused attention and its row statistics.
    Attention,
    /// `grad`: expanded by autodiff, never computed.
    Symbolic,
    /// Combined across the ranks of a data-parallel step: `all_reduce`, `reduce_scatter`,
    /// `all_gather`, `shard`. Its operand and its result each get a buffer, and its kernel
    /// computes nothing else.
    Collective,
}

impl Op {
    /// The op's class.
    pub fn class(&self) -> OpClass {
        match self {
            Op::Input { .. } | Op::Param { .. } | Op::State { .. } => OpClass::Leaf,
            Op::Literal { .. } => OpClass::Scalar,
            Op::Full { .. } | Op::Arange { .. } => OpClass::Fill,
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => OpClass::Elementwise,
            Op::Tri { .. } | Op::Dropout { .. } | Op::Concat { .. } | Op::Embedding => {
                OpClass::Indexed
            }
            Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::BroadcastTo { .. }
            | Op::Slice { .. }
            | Op::Select { .. } => OpClass::View,
            Op::Reduce { .. } | Op::ArgMax { .. } => OpClass::Reduction,
            Op::MatMul
            | Op::Conv2d { .. }
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradWeight { .. } => OpClass::Contraction,
            Op::Pool2d { .. }
            | Op::Pool2dGrad {
                kind: PoolKind::Avg,
                ..
            } => OpClass::Window,
            Op::Pool2dGrad {
                kind: PoolKind::Max,
                ..
            }
            | Op::EmbeddingGrad { .. } => OpClass::Scatter,
            Op::Attention { .. } | Op::AttentionLse { .. } | Op::AttentionGrad { .. } => {
                OpClass::Attention
            }
            Op::Grad => OpClass::Symbolic,
            Op::AllReduce | Op::ReduceScatter { .. } | Op::AllGather { .. } | Op::Shard { .. } => {
                OpClass::Collective
            }
        }
    }

    /// `input`, `param` or `state`.
    pub fn is_leaf(&self) -> bool {
        self.class() == OpClass::Leaf
    }

    /// `param` or `state`: kept across steps (an update may write it).
    pub fn is_persistent(&self) -> bool {
        matches!(self, Op::Param { .. } | Op::State { .. })
    }

    /// Leaves, constants and `grad`: no FLOPs, nothing to recompute.
    pub fn is_source(&self) -> bool {
        matches!(
            self.class(),
            OpClass::Leaf | OpClass::Scalar | OpClass::Fill | OpClass::Symbolic
        )
    }

    /// Same-index elementwise ops (which may write their result over an operand).
    pub fn is_elementwise(&self) -> bool {
        self.class() == OpClass::Elementwise
    }

    /// Ops that compute each result element on its own, with no loop: elementwise, indexed
    /// and fills (fusion inlines them into their readers).
    pub fn is_pointwise(&self) -> bool {
        matches!(
            self.class(),
            OpClass::Elementwise | OpClass::Indexed | OpClass::Fill
        )
    }

    /// True for ops whose result can be a view of their operand (no data movement when the
    /// layout allows): the layout pass decides.
    pub fn is_view_candidate(&self) -> bool {
        self.class() == OpClass::View
    }

    /// Matmul-like: `matmul`, `conv2d` and its gradients.
    pub fn is_contraction(&self) -> bool {
        self.class() == OpClass::Contraction
    }

    /// Ops whose result elements each loop over operand elements: reductions, contractions
    /// and pooling windows (fusion anchors).
    pub fn is_reduction_like(&self) -> bool {
        matches!(
            self.class(),
            OpClass::Reduction | OpClass::Contraction | OpClass::Window
        )
    }

    /// Computed by accumulating into a zeroed buffer.
    pub fn is_scatter(&self) -> bool {
        self.class() == OpClass::Scatter
    }

    /// Combined across data-parallel ranks (`all_reduce`).
    pub fn is_collective(&self) -> bool {
        self.class() == OpClass::Collective
    }

    /// Image ops over `[N, C, H, W]`: convolutions, pooling and their gradients.
    pub fn is_spatial(&self) -> bool {
        matches!(
            self,
            Op::Conv2d { .. }
                | Op::Conv2dGradInput { .. }
                | Op::Conv2dGradWeight { .. }
                | Op::Pool2d { .. }
                | Op::Pool2dGrad { .. }
        )
    }

    /// True when the op reads operand `k` many times per result element (so a recomputed
    /// operand would be recomputed many times).
    pub fn reads_operand_repeatedly(&self, k: usize) -> bool {
        match self.class() {
            OpClass::Contraction | OpClass::Window | OpClass::Attention => true,
            OpClass::Scatter => matches!(self, Op::Pool2dGrad { .. }),
            OpClass::Indexed => matches!(self, Op::Embedding) && k == 0,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unary ops that take numbers (all but the logical `not`).
    fn numeric_unary() -> impl Iterator<Item = UnaryOp> {
        UnaryOp::ALL
            .into_iter()
            .filter(|op| op.spec().takes != Takes::Bool)
    }

    #[test]
    fn the_zero_facts_match_the_formulas() {
        for op in numeric_unary() {
            assert_eq!(op.preserves_zero(), op.eval(0.0) == 0.0, "{}", op.name());
            // Sound, not complete: `sigmoid` and `recip` also give 0 there, but the zeros
            // analysis has only ever relied on `exp` and `relu`.
            if op.zero_at_neg_inf() {
                assert_eq!(op.eval(f64::NEG_INFINITY), 0.0, "{}", op.name());
            }
        }
        assert_eq!(numeric_unary().count() + 1, UnaryOp::ALL.len());
    }

    #[test]
    fn ops_on_all_reals_are_finite_on_negative_numbers() {
        for op in numeric_unary() {
            for x in [-3.5, -1.0, -1e-3, 0.25, 2.0] {
                if op.on_all_reals() {
                    assert!(op.eval(x).is_finite(), "{}({x})", op.name());
                }
            }
            if !op.on_all_reals() {
                assert!(!op.eval(-1.0).is_finite() || !op.eval(0.0).is_finite());
            }
        }
    }

    #[test]
    fn formulas_at_hand_checked_points() {
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(near(UnaryOp::Sigmoid.eval(0.0), 0.5));
        assert!(near(UnaryOp::Silu.eval(2.0), 2.0 / (1.0 + (-2.0f64).exp())));
        assert!(near(UnaryOp::Gelu.eval(1.0), 0.841_191_990_607_477_2));
        for x in [-4.0, -1.5, -0.3, 0.0, 0.7, 2.5] {
            let h = 1e-5;
            let fd = (UnaryOp::Gelu.eval(x + h) - UnaryOp::Gelu.eval(x - h)) / (2.0 * h);
            assert!((UnaryOp::GeluGrad.eval(x) - fd).abs() < 1e-9, "gelu'({x})");
        }
        assert!(near(UnaryOp::Erf.eval(1.0), 0.842_700_792_949_714_9));
        assert!(near(UnaryOp::Rsqrt.eval(4.0), 0.5));
        assert_eq!(UnaryOp::Relu.eval_i32(-3), Some(0));
        assert_eq!(UnaryOp::Abs.eval_i32(i32::MIN), Some(i32::MIN));
        assert_eq!(UnaryOp::Exp.eval_i32(1), None);
        assert_eq!(BinaryOp::Rem.eval(-7.5, 2.0), 0.5);
        assert_eq!(BinaryOp::Rem.eval_i32(7, -2), Ok(-1));
        assert_eq!(BinaryOp::Div.eval_i32(-7, 2), Ok(-4));
        assert_eq!(BinaryOp::Div.eval_i32(1, 0), Err(IntFault::DivisionByZero));
        assert_eq!(BinaryOp::And.eval_i32(1, 1), Err(IntFault::NotInteger));
        assert!(BinaryOp::Maximum.eval(f64::NAN, 1.0).is_nan());
        assert_eq!(BinaryOp::Ge.eval(1.0, 1.0), 1.0);
    }

    #[test]
    fn int_formulas_exactly_for_numeric_ops() {
        for op in UnaryOp::ALL {
            assert_eq!(
                op.spec().int.is_some(),
                op.spec().takes == Takes::Numeric,
                "{}",
                op.name()
            );
        }
        for op in BinaryOp::ALL {
            assert_eq!(op.is_logical(), op.eval_i32(1, 1).is_err(), "{}", op.name());
        }
    }

    #[test]
    fn classes() {
        assert!(Op::Unary(UnaryOp::Exp).is_elementwise());
        assert!(Op::Embedding.is_pointwise() && !Op::Embedding.is_elementwise());
        assert!(Op::Embedding.reads_operand_repeatedly(0));
        assert!(!Op::Embedding.reads_operand_repeatedly(1));
        assert!(Op::MatMul.is_contraction() && Op::MatMul.is_reduction_like());
        assert!(Op::EmbeddingGrad { vocab: 3 }.is_scatter());
        assert!(!Op::EmbeddingGrad { vocab: 3 }.reads_operand_repeatedly(1));
        assert!(Op::Grad.is_source() && !Op::Grad.is_leaf());
        assert!(!Op::Literal {
            value: crate::ir::Scalar::Int(0),
            dtype: DType::I32
        }
        .is_pointwise());
    }
}
