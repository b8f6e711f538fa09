//! Small graph-building helpers for autodiff and optimizer lowering: every node they make
//! carries the span of the forward node it derives from.

use crate::ir::{
    BinaryOp, DType, Graph, NodeId, Op, ReduceOp, Scalar, Shape, TensorType, TypeError, UnaryOp,
};
use tcc_grammar::span::Span;

/// A cursor that adds nodes with one span.
pub struct Builder<'g> {
    pub g: &'g mut Graph,
    pub span: Span,
    pub checkpoint: Option<u32>,
}

pub type R = Result<NodeId, TypeError>;

impl<'g> Builder<'g> {
    pub fn new(g: &'g mut Graph, span: Span) -> Self {
        Builder {
            g,
            span,
            checkpoint: None,
        }
    }

    pub fn ty(&self, id: NodeId) -> TensorType {
        self.g.ty(id).clone()
    }

    pub fn add(&mut self, op: Op, inputs: Vec<NodeId>) -> R {
        let id = self.g.add(op, inputs, self.span, self.checkpoint)?;
        self.g.mark_backward(id);
        Ok(id)
    }

    pub fn lit(&mut self, v: f64, dtype: DType) -> R {
        let value = match dtype {
            DType::I32 => Scalar::Int(v as i64),
            DType::Bool => Scalar::Bool(v != 0.0),
            _ => Scalar::Float(v),
        };
        self.add(Op::Literal { value, dtype }, vec![])
    }

    pub fn full(&mut self, v: f64, ty: TensorType) -> R {
        let value = match ty.dtype {
            DType::I32 => Scalar::Int(v as i64),
            DType::Bool => Scalar::Bool(v != 0.0),
            _ => Scalar::Float(v),
        };
        self.add(Op::Full { value, ty }, vec![])
    }

    pub fn un(&mut self, op: UnaryOp, x: NodeId) -> R {
        self.add(Op::Unary(op), vec![x])
    }

    pub fn bin(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> R {
        self.add(Op::Binary(op), vec![a, b])
    }

    pub fn add2(&mut self, a: NodeId, b: NodeId) -> R {
        self.bin(BinaryOp::Add, a, b)
    }

    pub fn sub(&mut self, a: NodeId, b: NodeId) -> R {
        self.bin(BinaryOp::Sub, a, b)
    }

    pub fn mul(&mut self, a: NodeId, b: NodeId) -> R {
        self.bin(BinaryOp::Mul, a, b)
    }

    pub fn div(&mut self, a: NodeId, b: NodeId) -> R {
        self.bin(BinaryOp::Div, a, b)
    }

    /// `x * c` for a compile-time constant `c` in x's dtype.
    pub fn scale(&mut self, x: NodeId, c: f64) -> R {
        let l = self.lit(c, self.g.ty(x).dtype)?;
        self.mul(x, l)
    }

    /// `c - x` for a compile-time constant `c`.
    pub fn rsub(&mut self, c: f64, x: NodeId) -> R {
        let l = self.lit(c, self.g.ty(x).dtype)?;
        self.sub(l, x)
    }

    pub fn neg(&mut self, x: NodeId) -> R {
        self.un(UnaryOp::Neg, x)
    }

    pub fn reshape(&mut self, x: NodeId, shape: Shape) -> R {
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.add(Op::Reshape { shape }, vec![x])
    }

    pub fn permute(&mut self, x: NodeId, perm: Vec<usize>) -> R {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x);
        }
        self.add(Op::Permute { perm }, vec![x])
    }

    pub fn transpose(&mut self, x: NodeId) -> R {
        let r = self.g.ty(x).rank();
        let mut perm: Vec<usize> = (0..r).collect();
        if r >= 2 {
            perm.swap(r - 2, r - 1);
        }
        self.permute(x, perm)
    }

    pub fn broadcast_to(&mut self, x: NodeId, shape: Shape) -> R {
        if self.g.ty(x).shape == shape {
            return Ok(x);
        }
        self.add(Op::BroadcastTo { shape }, vec![x])
    }

    pub fn sum(&mut self, x: NodeId, axes: Vec<usize>, keepdim: bool) -> R {
        if axes.is_empty() {
            return Ok(x);
        }
        self.add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes,
                keepdim,
            },
            vec![x],
        )
    }

    pub fn cast(&mut self, x: NodeId, to: DType) -> R {
        if self.g.ty(x).dtype == to {
            return Ok(x);
        }
        self.add(Op::Cast { to }, vec![x])
    }

    pub fn where_(&mut self, c: NodeId, a: NodeId, b: NodeId) -> R {
        self.add(Op::Where, vec![c, a, b])
    }

    /// `where(c, x, 0)`.
    pub fn mask(&mut self, c: NodeId, x: NodeId) -> R {
        let z = self.lit(0.0, self.g.ty(x).dtype)?;
        self.where_(c, x, z)
    }

    /// Sums a gradient of a broadcast result back to the operand's shape.
    pub fn sum_to(&mut self, g: NodeId, shape: &Shape) -> R {
        let gt = self.g.ty(g);
        if &gt.shape == shape {
            return Ok(g);
        }
        let (gr, sr) = (gt.rank(), shape.rank());
        let lead = gr.saturating_sub(sr);
        let mut axes: Vec<usize> = (0..lead).collect();
        for i in 0..sr {
            if shape.dims()[i] == 1 && gt.dims()[lead + i] != 1 {
                axes.push(lead + i);
            }
        }
        let s = self.sum(g, axes, true)?;
        self.reshape(s, shape.clone())
    }
}
