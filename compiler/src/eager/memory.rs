//! Eager memory accounting: what PyTorch-style allocate-and-free execution of a graph
//! holds in memory, op by op.
//!
//! The model, for a graph in its execution order (forward in program order, then the
//! backward pass, then the optimizer, as autodiff lays them out):
//! - **persistent**: params and optimizer state, live the whole time;
//! - **inputs**: owned by the caller, live the whole step;
//! - **transient**: every other result is allocated when its op runs and freed right after
//!   the last op that reads it (outputs live to the end of the step). An op's result is
//!   allocated while its operands are still live, so the peak is measured after each
//!   allocation and before the frees that follow it.
//!
//! Views (reshape, permute, broadcast_to, slice, select) allocate nothing: they share their
//! operand's storage and keep it alive, as PyTorch views do. The last op of each optimizer
//! update writes into the param or state in place (PyTorch's `param.add_`), so it allocates
//! nothing either. Because autodiff puts backward nodes after the forward ones, forward
//! activations that the backward pass reads stay live until that backward op has run, and
//! gradients live until the optimizer step reads them: PyTorch autograd's behaviour.

use crate::ir::{Graph, NodeId, Op};
use std::collections::BTreeMap;

/// What kind of memory a buffer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    Param,
    OptimizerState,
    Input,
    Transient,
}

/// The accounting of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct EagerMemory {
    /// Execution order the accounting follows.
    pub order: Vec<NodeId>,
    pub param_bytes: u64,
    pub state_bytes: u64,
    pub input_bytes: u64,
    /// Largest transient bytes live at once.
    pub peak_transient_bytes: u64,
    /// Position in `order` of the op at which the peak occurs.
    pub peak_position: usize,
    /// Transient bytes live right after each op's allocation.
    pub timeline: Vec<u64>,
    /// Transient buffers live at the peak, largest first: (node that allocated it, bytes).
    pub live_at_peak: Vec<(NodeId, u64)>,
    /// Sum of every transient allocation (memory with no reuse at all).
    pub total_transient_bytes: u64,
}

impl EagerMemory {
    pub fn persistent_bytes(&self) -> u64 {
        self.param_bytes + self.state_bytes
    }

    /// Peak of everything: persistent + inputs + transient.
    pub fn peak_bytes(&self) -> u64 {
        self.persistent_bytes() + self.input_bytes + self.peak_transient_bytes
    }
}

/// True for ops whose eager result aliases their first operand.
pub fn is_view(op: &Op) -> bool {
    op.is_view_candidate()
}

/// Computes the eager accounting of `g` in its deterministic topological order.
pub fn account(g: &Graph) -> EagerMemory {
    let order = g.topo_order().unwrap_or_else(|| g.node_ids().collect());
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let end = order.len();
    // Storage owner of each node.
    let update_target: BTreeMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    let mut owner: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    for &n in &order {
        let node = g.node(n);
        let o = if let Some(&t) = update_target.get(&n) {
            owner.get(&t).copied().unwrap_or(t)
        } else if is_view(&node.op) {
            owner
                .get(&node.inputs[0])
                .copied()
                .unwrap_or(node.inputs[0])
        } else {
            n
        };
        owner.insert(n, o);
    }
    let category = |n: NodeId| match g.node(n).op {
        Op::Param { .. } => Category::Param,
        Op::State { .. } => Category::OptimizerState,
        Op::Input { .. } => Category::Input,
        _ => Category::Transient,
    };
    // Last use of each storage.
    let mut last_use: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in &order {
        let o = owner[&n];
        let p = pos[&n];
        let e = last_use.entry(o).or_insert(p);
        *e = (*e).max(p);
        for i in &g.node(n).inputs {
            let oi = owner[i];
            let e = last_use.entry(oi).or_insert(p);
            *e = (*e).max(p);
        }
    }
    for (_, o) in &g.outputs {
        last_use.insert(owner[o], end);
    }
    let mut frees: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
    for (&o, &p) in &last_use {
        frees.entry(p).or_default().push(o);
    }
    let (mut param_bytes, mut state_bytes, mut input_bytes) = (0u64, 0u64, 0u64);
    let mut live: BTreeMap<NodeId, u64> = BTreeMap::new();
    let mut cur = 0u64;
    let mut peak = 0u64;
    let mut peak_position = 0;
    let mut live_at_peak = Vec::new();
    let mut timeline = Vec::with_capacity(order.len());
    let mut total = 0u64;
    for (i, &n) in order.iter().enumerate() {
        let bytes = g.ty(n).size_bytes() as u64;
        match category(n) {
            Category::Param => param_bytes += bytes,
            Category::OptimizerState => state_bytes += bytes,
            Category::Input => input_bytes += bytes,
            Category::Transient => {
                if owner[&n] == n {
                    live.insert(n, bytes);
                    cur += bytes;
                    total += bytes;
                }
            }
        }
        timeline.push(cur);
        if cur > peak {
            peak = cur;
            peak_position = i;
            live_at_peak = live.iter().map(|(&k, &v)| (k, v)).collect();
        }
        if let Some(dead) = frees.get(&i) {
            for o in dead {
                if let Some(b) = live.remove(o) {
                    cur -= b;
                }
            }
        }
    }
    live_at_peak.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    EagerMemory {
        order,
        param_bytes,
        state_bytes,
        input_bytes,
        peak_transient_bytes: peak,
        peak_position,
        timeline,
        live_at_peak,
        total_transient_bytes: total,
    }
}
