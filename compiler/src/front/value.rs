//! Values of the front end's lowering interpreter, and compile-time scalar folding.

use crate::ir::{DType, NodeId};
use tcc_grammar::ast::BinOp;

/// What a TDSL expression evaluates to while lowering.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A graph value.
    Tensor(NodeId),
    /// Compile-time scalars (constants, loop variables, shape variables, literals).
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    DType(DType),
    /// `[a, b, …]`: shapes, axes, tensor lists for `concat`.
    List(Vec<Value>),
    /// Several results (`split`).
    Tuple(Vec<Value>),
    /// The result of an expression that already reported an error; anything built from it
    /// is poison too, so one mistake gives one error.
    Poison,
}

impl Value {
    /// How the value reads in an error message.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Tensor(_) => "a tensor",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Bool(_) => "a boolean",
            Value::Str(_) => "a string",
            Value::DType(_) => "a dtype",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Poison => "an invalid value",
        }
    }

    pub fn is_scalar(&self) -> bool {
        matches!(self, Value::Int(_) | Value::Float(_) | Value::Bool(_))
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(v) => Some(*v as f64),
            Value::Float(v) => Some(*v),
            _ => None,
        }
    }
}

/// Folds a binary operator on two compile-time scalars. `Err` says why it cannot.
pub fn fold_binary(op: BinOp, a: &Value, b: &Value) -> Result<Value, String> {
    use Value::*;
    let sym = op.symbol();
    match (op, a, b) {
        (BinOp::And, Bool(x), Bool(y)) => Ok(Bool(*x && *y)),
        (BinOp::Or, Bool(x), Bool(y)) => Ok(Bool(*x || *y)),
        (BinOp::And | BinOp::Or, _, _) => Err(format!(
            "`{sym}` needs booleans, found {} and {}",
            a.kind(),
            b.kind()
        )),
        (BinOp::Eq, Bool(x), Bool(y)) => Ok(Bool(x == y)),
        (BinOp::Ne, Bool(x), Bool(y)) => Ok(Bool(x != y)),
        (_, Int(x), Int(y)) => {
            let (x, y) = (*x, *y);
            let overflow = || format!("integer overflow in {x} {sym} {y}");
            match op {
                BinOp::Add => x.checked_add(y).map(Int).ok_or_else(overflow),
                BinOp::Sub => x.checked_sub(y).map(Int).ok_or_else(overflow),
                BinOp::Mul => x.checked_mul(y).map(Int).ok_or_else(overflow),
                BinOp::Div | BinOp::Rem if y == 0 => {
                    Err(format!("division by zero in {x} {sym} 0"))
                }
                // Exact integer division stays an integer (`D / H` in shapes); otherwise the
                // result is a number.
                BinOp::Div if x.checked_rem(y) == Some(0) => {
                    x.checked_div(y).map(Int).ok_or_else(overflow)
                }
                BinOp::Div => Ok(Float(x as f64 / y as f64)),
                BinOp::Rem => x.checked_rem_euclid(y).map(Int).ok_or_else(overflow),
                BinOp::Eq => Ok(Bool(x == y)),
                BinOp::Ne => Ok(Bool(x != y)),
                BinOp::Lt => Ok(Bool(x < y)),
                BinOp::Le => Ok(Bool(x <= y)),
                BinOp::Gt => Ok(Bool(x > y)),
                BinOp::Ge => Ok(Bool(x >= y)),
                BinOp::MatMul => Err("`@` needs tensors".to_string()),
                BinOp::And | BinOp::Or => Err(format!("`{sym}` needs booleans")),
            }
        }
        _ => {
            let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
                return Err(format!(
                    "`{sym}` is not defined for {} and {}",
                    a.kind(),
                    b.kind()
                ));
            };
            match op {
                BinOp::Add => Ok(Float(x + y)),
                BinOp::Sub => Ok(Float(x - y)),
                BinOp::Mul => Ok(Float(x * y)),
                BinOp::Div => Ok(Float(x / y)),
                BinOp::Rem => Ok(Float(x % y)),
                BinOp::Eq => Ok(Bool(x == y)),
                BinOp::Ne => Ok(Bool(x != y)),
                BinOp::Lt => Ok(Bool(x < y)),
                BinOp::Le => Ok(Bool(x <= y)),
                BinOp::Gt => Ok(Bool(x > y)),
                BinOp::Ge => Ok(Bool(x >= y)),
                BinOp::MatMul => Err("`@` needs tensors".to_string()),
                BinOp::And | BinOp::Or => Err(format!("`{sym}` needs booleans")),
            }
        }
    }
}

/// Folds a one-argument builtin (`sqrt`, `exp`, …) or unary minus on a compile-time number.
pub fn fold_unary(name: &str, v: &Value) -> Result<Value, String> {
    if name == "neg" {
        return match v {
            Value::Int(x) => x
                .checked_neg()
                .map(Value::Int)
                .ok_or_else(|| "integer overflow".to_string()),
            Value::Float(x) => Ok(Value::Float(-x)),
            _ => Err(format!("cannot negate {}", v.kind())),
        };
    }
    if name == "abs" {
        if let Value::Int(x) = v {
            return Ok(Value::Int(x.saturating_abs()));
        }
    }
    if name == "relu" {
        if let Value::Int(x) = v {
            return Ok(Value::Int((*x).max(0)));
        }
    }
    let Some(x) = v.as_f64() else {
        return Err(format!("`{name}` needs a number, found {}", v.kind()));
    };
    let y = match name {
        "abs" => x.abs(),
        "exp" => x.exp(),
        "log" => x.ln(),
        "sqrt" => x.sqrt(),
        "rsqrt" => 1.0 / x.sqrt(),
        "recip" => 1.0 / x,
        "tanh" => x.tanh(),
        "sigmoid" => 1.0 / (1.0 + (-x).exp()),
        "relu" => x.max(0.0),
        "sin" => x.sin(),
        "cos" => x.cos(),
        "silu" => x / (1.0 + (-x).exp()),
        "gelu" => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        "erf" => erf(x),
        _ => return Err(format!("`{name}` cannot be folded")),
    };
    Ok(Value::Float(y))
}

/// The error function (Abramowitz–Stegun 7.1.26 refined by one Newton step is not needed for
/// compile-time constants; this is accurate to ~1e-7).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    if x >= 0.0 {
        y
    } else {
        -y
    }
}
