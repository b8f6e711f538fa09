//! The IR verifier: runs after every pass in tests and debug builds.
//!
//! Checks that the graph is acyclic, that edges mirror operand lists, that every node's
//! recorded type is what its op's shape rule gives for its operands, and that the model's
//! interface (inputs, params, outputs, train loss) points at live nodes of the right kind.

use super::graph::{Graph, NodeId};
use super::ops::{infer, Op};
use super::types::{DType, TensorType};
use std::collections::BTreeSet;

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("IR verifier: {0}")]
pub struct VerifyError(pub String);

/// Checks every invariant; returns all violations found.
pub fn verify(graph: &Graph) -> Result<(), Vec<VerifyError>> {
    let mut errs = Vec::new();
    let mut err = |m: String| errs.push(VerifyError(m));
    if graph.topo_order().is_none() {
        err("graph has a cycle".into());
    }
    let g = graph.petgraph();
    for id in graph.node_ids() {
        let node = graph.node(id);
        let mut edge_inputs: Vec<(u32, usize)> = g
            .edges_directed(id.0, petgraph::Direction::Incoming)
            .map(|e| (*e.weight(), petgraph::visit::EdgeRef::source(&e).index()))
            .collect();
        edge_inputs.sort();
        let listed: Vec<(u32, usize)> = node
            .inputs
            .iter()
            .enumerate()
            .map(|(i, n)| (i as u32, n.index()))
            .collect();
        if edge_inputs != listed {
            err(format!(
                "node {} ({}): edges do not match its operand list",
                id.index(),
                node.op.name()
            ));
            continue;
        }
        let tys: Vec<&TensorType> = match node
            .inputs
            .iter()
            .map(|&i| graph.get(i).map(|n| &n.ty))
            .collect::<Option<Vec<_>>>()
        {
            Some(t) => t,
            None => {
                err(format!("node {}: operand is missing", id.index()));
                continue;
            }
        };
        match infer(&node.op, &tys) {
            Ok(ty) if ty == node.ty => {}
            Ok(ty) => err(format!(
                "node {} ({}): recorded type {} but its operands give {}",
                id.index(),
                node.op.name(),
                node.ty,
                ty
            )),
            Err(e) => err(format!(
                "node {} ({}): operands rejected: {e}",
                id.index(),
                node.op.name()
            )),
        }
    }
    let mut names = BTreeSet::new();
    for &i in graph
        .inputs
        .iter()
        .chain(&graph.params)
        .chain(&graph.states)
    {
        match graph.get(i).map(|n| &n.op) {
            Some(Op::Input { name, .. })
            | Some(Op::Param { name, .. })
            | Some(Op::State { name, .. }) => {
                if !names.insert(name.clone()) {
                    err(format!("input/param name `{name}` appears twice"));
                }
            }
            _ => err(format!(
                "interface node {} is not an input or param",
                i.index()
            )),
        }
    }
    for (name, id) in &graph.outputs {
        if graph.get(*id).is_none() {
            err(format!("output `{name}` refers to a removed node"));
        }
    }
    // A stack's layers: its leading axis's count of distinct params or states of its
    // type without that axis (the persistent layout and the interpreter index them so).
    for s in &graph.stacks {
        let layer =
            s.ty.dims()
                .split_first()
                .map(|(&l, rest)| (l, rest.to_vec()));
        let distinct: BTreeSet<NodeId> = s.pieces.iter().copied().collect();
        let ok = layer.is_some_and(|(l, rest)| {
            l == s.pieces.len()
                && distinct.len() == l
                && s.pieces.iter().all(|&p| {
                    graph.get(p).is_some_and(|n| {
                        n.op.is_persistent() && n.ty.dtype == s.ty.dtype && n.ty.dims() == rest
                    })
                })
        });
        if !ok {
            err(format!(
                "stack `{}` : {} does not hold one param or state a layer",
                s.name, s.ty
            ));
        }
    }
    let mut targets = BTreeSet::new();
    for (target, value) in &graph.updates {
        match (graph.get(*target), graph.get(*value)) {
            (Some(t), Some(v)) => {
                if !t.op.is_persistent() {
                    err(format!(
                        "update target {} is not a param or state",
                        target.index()
                    ));
                }
                if t.ty != v.ty {
                    err(format!(
                        "update of {} ({}) with a value of type {}",
                        target.index(),
                        t.ty,
                        v.ty
                    ));
                }
                if !targets.insert(*target) {
                    err(format!("{} is updated twice", target.index()));
                }
            }
            _ => err("update refers to a removed node".into()),
        }
    }
    if let Some(t) = &graph.train {
        match graph.get(t.loss) {
            Some(n) if n.ty == TensorType::scalar(DType::F32) => {}
            Some(n) => err(format!("train loss has type {}, expected f32[]", n.ty)),
            None => err("train loss refers to a removed node".into()),
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}
