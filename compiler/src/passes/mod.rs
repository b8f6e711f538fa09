//! The pass pipeline: one table, [`PIPELINE`], lists every graph-to-graph pass in order
//! with why it sits there. `--print-after=PASS|all` and `--stop-after=PASS` come from it,
//! and the IR verifier runs after every pass in tests and debug builds.

pub mod attention;
pub mod schedule;
pub mod split_reductions;
pub mod transpose_matmuls;

use crate::ir::{verify::verify, Graph, NodeId};
use tcc_grammar::diag::Diagnostic;

/// One pass.
pub struct Pass {
    pub name: &'static str,
    /// Why the pass sits where it does.
    pub why: &'static str,
    pub run: fn(&mut Graph) -> Result<(), Vec<Diagnostic>>,
}

/// Every pass, in the order they run after the front end (`lower`).
pub const PIPELINE: &[Pass] = &[
    Pass {
        name: "autodiff",
        why: "first: every later pass sees the whole step (forward, backward and optimizer) and no `grad` node",
        run: crate::autodiff::expand,
    },
    Pass {
        name: "schedule",
        why: "last before planning: the order fixes every buffer's lifetime, so it is chosen once the graph's ops are final",
        run: schedule::schedule,
    },
];

/// The name of the front end's output, accepted by `--print-after` and `--stop-after`.
pub const LOWER: &str = "lower";

/// Names `--print-after`/`--stop-after` accept.
pub fn pass_names() -> Vec<&'static str> {
    std::iter::once(LOWER)
        .chain(PIPELINE.iter().map(|p| p.name))
        .collect()
}

/// How to run the pipeline.
#[derive(Clone, Debug, Default)]
pub struct PipelineOptions {
    /// Print the graph after these passes (`all` for every one).
    pub print_after: Vec<String>,
    /// Stop after this pass.
    pub stop_after: Option<String>,
    /// Verify after every pass (always on in debug builds).
    pub verify: bool,
}

/// Runs the pipeline on `graph`. `print` receives `(pass name, graph)` for each requested
/// print; returns the timing of each pass in milliseconds.
pub fn run(
    graph: &mut Graph,
    opts: &PipelineOptions,
    mut print: impl FnMut(&str, &Graph),
) -> Result<Vec<(&'static str, f64)>, Vec<Diagnostic>> {
    let wants = |name: &str| opts.print_after.iter().any(|p| p == name || p == "all");
    if wants(LOWER) {
        print(LOWER, graph);
    }
    let mut times = Vec::new();
    if opts.stop_after.as_deref() == Some(LOWER) {
        return Ok(times);
    }
    for pass in PIPELINE {
        let start = std::time::Instant::now();
        (pass.run)(graph)?;
        times.push((pass.name, start.elapsed().as_secs_f64() * 1e3));
        if opts.verify || cfg!(debug_assertions) {
            if let Err(errs) = verify(graph) {
                return Err(errs
                    .into_iter()
                    .map(|e| {
                        Diagnostic::error(
                            "E0002",
                            format!("internal compiler error after pass `{}`: {e}", pass.name),
                        )
                    })
                    .collect());
            }
        }
        if wants(pass.name) {
            print(pass.name, graph);
        }
        if opts.stop_after.as_deref() == Some(pass.name) {
            break;
        }
    }
    Ok(times)
}

/// Rewrites `g` node by node in its order, for the compile-time splits: `expand(h, n)`
/// adds to `h` the nodes that replace `n` and returns them in order (the last one of
/// `n`'s type takes its uses), or `None` to keep `n`. Nodes added but not used (a
/// replacement of another type) are dropped. Returns `g` itself when nothing changed.
pub fn replace_in_order(
    g: &Graph,
    mut expand: impl FnMut(&mut Graph, NodeId) -> Option<Vec<NodeId>>,
) -> Graph {
    let Some(order) = g.topo_order() else {
        return g.clone();
    };
    let mut h = g.clone();
    let mut new_order: Vec<NodeId> = Vec::with_capacity(order.len());
    let mut changed = false;
    for n in order {
        match expand(&mut h, n) {
            Some(added) if added.last().is_some_and(|&l| h.ty(l) == h.ty(n)) => {
                if let Some(&last) = added.last() {
                    h.replace_all_uses(n, last);
                }
                h.remove(n);
                new_order.extend(added);
                changed = true;
            }
            _ => new_order.push(n),
        }
    }
    if !changed {
        return g.clone();
    }
    let keep: std::collections::BTreeSet<NodeId> = new_order.iter().copied().collect();
    let stray: Vec<NodeId> = h.node_ids().filter(|x| !keep.contains(x)).collect();
    for x in stray {
        h.remove(x);
    }
    h.reordered(&new_order)
}
