//! Values of the front end's lowering interpreter, and compile-time scalar folding.

use crate::ir::{BinaryOp, DType, NodeId, UnaryOp};

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

/// Folds an elementwise binary op (`what` as the program spells it) on two compile-time
/// scalars. Integers stay exact (checked); numbers use the op's reference formula
/// ([`BinaryOp::eval`]), as the interpreter does at run time. `Err` says why it cannot.
pub fn fold_binary(op: BinaryOp, what: &str, a: &Value, b: &Value) -> Result<Value, String> {
    use BinaryOp as B;
    use Value::*;
    let bit = |v: bool| f64::from(u8::from(v));
    match (op, a, b) {
        (B::And | B::Or | B::Eq | B::Ne, Bool(x), Bool(y)) => {
            Ok(Bool(op.eval(bit(*x), bit(*y)) != 0.0))
        }
        (B::And | B::Or, _, _) => Err(format!(
            "`{what}` needs booleans, found {} and {}",
            a.kind(),
            b.kind()
        )),
        (_, Int(x), Int(y)) => {
            let (x, y) = (*x, *y);
            let overflow = || format!("integer overflow in {x} {what} {y}");
            match op {
                B::Add => x.checked_add(y).map(Int).ok_or_else(overflow),
                B::Sub => x.checked_sub(y).map(Int).ok_or_else(overflow),
                B::Mul => x.checked_mul(y).map(Int).ok_or_else(overflow),
                B::Div | B::Rem if y == 0 => Err(format!("division by zero in {x} {what} 0")),
                // Exact integer division stays an integer (`D / H` in shapes); otherwise the
                // result is a number.
                B::Div if x.checked_rem(y) == Some(0) => {
                    x.checked_div(y).map(Int).ok_or_else(overflow)
                }
                B::Div => Ok(Float(x as f64 / y as f64)),
                B::Rem => x.checked_rem_euclid(y).map(Int).ok_or_else(overflow),
                B::Pow => Ok(Float(op.eval(x as f64, y as f64))),
                B::Maximum => Ok(Int(x.max(y))),
                B::Minimum => Ok(Int(x.min(y))),
                B::Eq => Ok(Bool(x == y)),
                B::Ne => Ok(Bool(x != y)),
                B::Lt => Ok(Bool(x < y)),
                B::Le => Ok(Bool(x <= y)),
                B::Gt => Ok(Bool(x > y)),
                B::Ge => Ok(Bool(x >= y)),
                B::And | B::Or => Err(format!("`{what}` needs booleans")),
            }
        }
        _ => {
            let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
                return Err(format!(
                    "`{what}` is not defined for {} and {}",
                    a.kind(),
                    b.kind()
                ));
            };
            let v = op.eval(x, y);
            Ok(if op.spec().yields_bool {
                Bool(v != 0.0)
            } else {
                Float(v)
            })
        }
    }
}

/// Folds a one-argument builtin (`sqrt`, `exp`, …) or unary minus (`neg`) on a compile-time
/// number with the op's reference formula ([`UnaryOp::eval`]); integers stay exact where
/// the op takes them.
pub fn fold_unary(name: &str, v: &Value) -> Result<Value, String> {
    let op = match name {
        "neg" => UnaryOp::Neg,
        _ => UnaryOp::from_builtin(name).ok_or_else(|| format!("`{name}` cannot be folded"))?,
    };
    match (op, v) {
        (UnaryOp::Neg, Value::Int(x)) => {
            return x
                .checked_neg()
                .map(Value::Int)
                .ok_or_else(|| "integer overflow".to_string())
        }
        (UnaryOp::Neg, Value::Float(_)) => {}
        (UnaryOp::Neg, _) => return Err(format!("cannot negate {}", v.kind())),
        (UnaryOp::Abs, Value::Int(x)) => return Ok(Value::Int(x.saturating_abs())),
        (UnaryOp::Relu, Value::Int(x)) => return Ok(Value::Int((*x).max(0))),
        _ => {}
    }
    let Some(x) = v.as_f64() else {
        return Err(format!("`{name}` needs a number, found {}", v.kind()));
    };
    Ok(Value::Float(op.eval(x)))
}
