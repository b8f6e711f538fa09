//! The canonical text form of a graph: the only thing snapshots see.
//!
//! Nodes are printed in the graph's deterministic topological order and renumbered `%0, %1,
//! …` in that order, so the text does not depend on how the graph was edited. Given the
//! source map, each line ends with the `line:col` of the user code it came from.

use super::graph::{Graph, NodeId};
use std::collections::HashMap;
use std::fmt::Write;
use tcc_grammar::span::SourceMap;

/// Prints `graph` as text. `sources` adds `@line:col` to each node.
pub fn print(graph: &Graph, sources: Option<&SourceMap>) -> String {
    let mut out = String::new();
    let order = match graph.topo_order() {
        Some(o) => o,
        None => {
            // A cyclic graph has no canonical order; print in id order so the cycle can be
            // inspected (the verifier reports it).
            graph.node_ids().collect()
        }
    };
    let number: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let name = |id: NodeId| match number.get(&id) {
        Some(i) => format!("%{i}"),
        None => "%?".to_string(),
    };
    let _ = writeln!(out, "model {} {{", graph.name);
    for &id in &order {
        let node = graph.node(id);
        let mut line = format!("  {} = {}", name(id), node.op.name());
        for (i, &input) in node.inputs.iter().enumerate() {
            line.push_str(if i == 0 { " " } else { ", " });
            line.push_str(&name(input));
        }
        let attrs = node.op.attrs();
        if !attrs.is_empty() {
            line.push(' ');
            line.push_str(&attrs);
        }
        let _ = write!(line, " : {}", node.ty);
        if let Some(c) = node.checkpoint {
            let _ = write!(line, " checkpoint={c}");
        }
        if let Some(sources) = sources {
            let loc = sources.location(node.span);
            let _ = write!(line, "  @{}:{}", loc.line, loc.col);
        }
        let _ = writeln!(out, "{line}");
    }
    for (n, id) in &graph.outputs {
        let _ = writeln!(out, "  output {n} = {}", name(*id));
    }
    for (target, value) in &graph.updates {
        let _ = writeln!(out, "  update {} <- {}", name(*target), name(*value));
    }
    for s in &graph.stacks {
        let pieces: Vec<String> = s.pieces.iter().map(|&p| name(p)).collect();
        let _ = writeln!(
            out,
            "  stack {} : {} = [{}]",
            s.name,
            s.ty,
            pieces.join(", ")
        );
    }
    if let Some(t) = &graph.train {
        let _ = writeln!(out, "  train {} minimize {}", t.optimizer, name(t.loss));
    }
    let _ = writeln!(out, "}}");
    out
}
