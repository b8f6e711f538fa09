//! In-step index checks: an `embedding` whose ids the step computes (not an input, whose
//! values `Session::set_input` checks against the bound the artifact records) gets an
//! output counting the ids outside `[0, vocabulary)`. The compiled kernels clamp such an
//! id to stay inside the table; the runtime reads the count after every step and fails
//! the step when it is not zero, so an out-of-range id is an error on the CPU and on a
//! GPU as it is in the interpreter, which stops at the op itself.
//!
//! Expects: a lowered graph (before autodiff). Guarantees: the graph with, for each such
//! embedding, a scalar f32 output named `tcc.check.N` and its [`StepCheck`] in
//! `g.checks`; nothing else changes.

use crate::ir::{BinaryOp, DType, Graph, Op, ReduceOp, Scalar, StepCheck, TypeError};
use tcc_runtime::artifact::CHECK_PREFIX;

/// The pass.
pub fn index_checks(g: &mut Graph) -> Result<(), TypeError> {
    let embeddings: Vec<_> = g
        .node_ids()
        .filter(|&n| matches!(g.node(n).op, Op::Embedding))
        .collect();
    for e in embeddings {
        let node = g.node(e);
        let (Some(&table), Some(&ids)) = (node.inputs.first(), node.inputs.get(1)) else {
            continue;
        };
        let span = node.span;
        if matches!(g.node(g.view_root(ids)).op, Op::Input { .. }) {
            continue;
        }
        let Some(&vocab) = g.ty(table).dims().first() else {
            continue;
        };
        let what = match &g.node(g.view_root(table)).op {
            Op::Param { name, .. } => format!("embedding into `{name}`"),
            _ => "embedding".to_string(),
        };
        let add = |g: &mut Graph, op: Op, inputs: Vec<_>| g.add(op, inputs, span, None);
        let lit = |v: i64| Op::Literal {
            value: Scalar::Int(v),
            dtype: DType::I32,
        };
        let zero = add(g, lit(0), vec![])?;
        let bound = add(g, lit(vocab as i64), vec![])?;
        let below = add(g, Op::Binary(BinaryOp::Lt), vec![ids, zero])?;
        let above = add(g, Op::Binary(BinaryOp::Ge), vec![ids, bound])?;
        let bad = add(g, Op::Binary(BinaryOp::Or), vec![below, above])?;
        let ones = add(g, Op::Cast { to: DType::F32 }, vec![bad])?;
        let axes: Vec<usize> = (0..g.ty(ones).dims().len()).collect();
        let count = if axes.is_empty() {
            ones
        } else {
            add(
                g,
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes,
                    keepdim: false,
                },
                vec![ones],
            )?
        };
        let output = format!("{CHECK_PREFIX}{}", g.checks.len());
        g.outputs.push((output.clone(), count));
        g.checks.push(StepCheck {
            output,
            what,
            bound: vocab as u64,
            kind: tcc_runtime::artifact::CheckKind::IndexRange,
        });
    }
    Ok(())
}
