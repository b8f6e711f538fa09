//! The dataflow graph: typed node ids over a petgraph `StableDiGraph`.
//!
//! Each node holds an [`Op`], its operands in order, its result type and the source span it
//! came from. Edges mirror operands (edge weight = operand position) so petgraph algorithms
//! (topological order, cycle checks) see the same structure. Analyses keep their results in
//! side tables keyed by [`NodeId`]; nothing but the program itself lives here.

use super::ops::{infer, Op, TypeError};
use super::types::TensorType;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::BinaryHeap;
use tcc_grammar::span::Span;

/// A node of the graph. Stable across removals of other nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub NodeIndex<u32>);

impl NodeId {
    pub fn index(self) -> usize {
        self.0.index()
    }
}

/// One operation and what it produces.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub ty: TensorType,
    /// Where in the user's program this node comes from (prelude code is attributed to the
    /// user's call site).
    pub span: Span,
    /// The `checkpoint { }` region the node was made in, if any.
    pub checkpoint: Option<u32>,
    /// Made by autodiff: a gradient, an optimizer update or a recomputed forward value
    /// (rematerialization tells forward values from the backward pass that reads them).
    pub backward: bool,
    /// The outermost call of a user function the node was made in (one per call: a
    /// model's blocks, for per-block checkpointing).
    pub block: Option<u32>,
    /// A forward value recomputed for the backward pass (a clone made by
    /// `remat::step::apply`), naming the value it recomputes by its id in the graph it was
    /// cloned in: fusion may store it from another kernel of its shape rather than give it
    /// a kernel of its own, and remat finds the clones of its choices after later stages
    /// renumbered the graph.
    pub recomputed: Option<NodeId>,
    /// The micro-batch of a step split with `--micro-batches K` that this node computes
    /// on (set on the forward nodes of each slice by [`crate::front::micro_batch`]; the
    /// nodes computed from them inherit it in the schedule, which runs the micro-batches
    /// one after another).
    pub micro_batch: Option<u32>,
}

/// Optimizers of `train OPT minimize LOSS`, with every argument resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

impl std::fmt::Display for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => write!(
                f,
                "sgd(lr: {lr:?}, momentum: {momentum:?}, weight_decay: {weight_decay:?})"
            ),
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => write!(
                f,
                "adam(lr: {lr:?}, beta1: {beta1:?}, beta2: {beta2:?}, eps: {eps:?})"
            ),
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => write!(
                f,
                "adamw(lr: {lr:?}, beta1: {beta1:?}, beta2: {beta2:?}, eps: {eps:?}, weight_decay: {weight_decay:?})"
            ),
        }
    }
}

/// `train OPT minimize LOSS`, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSpec {
    pub optimizer: Optimizer,
    pub loss: NodeId,
    pub span: Span,
}

/// Moves the nodes of `moved` within `order[range]` after the range's other nodes, each
/// part in its own order (a schedule's reordering: what a node feeds runs after it).
pub fn sink(
    order: &mut [NodeId],
    range: std::ops::RangeInclusive<usize>,
    moved: &std::collections::BTreeSet<NodeId>,
) {
    let Some(part) = order.get_mut(range) else {
        return;
    };
    let (mut stay, go): (Vec<NodeId>, Vec<NodeId>) = part.iter().partition(|n| !moved.contains(n));
    stay.extend(go);
    part.copy_from_slice(&stay);
}

/// One compiled model: the graph plus its interface.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    graph: StableDiGraph<Node, u32>,
    /// Inputs in declaration order.
    pub inputs: Vec<NodeId>,
    /// Params in declaration order (a split stack's layers in its place, [`Stack`]).
    pub params: Vec<NodeId>,
    /// Optimizer state in creation order.
    pub states: Vec<NodeId>,
    /// `output` names and the values they return, in order.
    pub outputs: Vec<(String, NodeId)>,
    pub train: Option<TrainSpec>,
    /// End-of-step assignments `(param or state, new value)`, made by autodiff for `train`:
    /// after every node has run, each target takes its new value (in place).
    pub updates: Vec<(NodeId, NodeId)>,
    /// `(param, gradient)` for every param `train` updates: the gradient the optimizer
    /// applies (after any loss-scale unscaling). Mixed precision keeps these f32.
    pub grads: Vec<(NodeId, NodeId)>,
    /// The ranks of a data-parallel step (`--gpus N`: autodiff seeded the loss's gradient
    /// with `1/N` and put an `all_reduce` on every gradient the optimizer applies); `None`
    /// for a step that runs alone.
    pub ranks: Option<usize>,
    /// ZeRO-1 (`--zero 1`): each optimizer state that holds one rank's shard of a param's
    /// state, by name, with that param's name (the whole state is shaped like the param).
    pub shards: std::collections::BTreeMap<String, String>,
    /// The micro-batches of a step split with `--micro-batches K`
    /// ([`crate::front::micro_batch`]); `None` for a step over its whole batch at once.
    pub micro_batches: Option<usize>,
    /// The chunks the loss head of a step is computed in
    /// ([`crate::front::micro_batch::compile_step`]; its nodes are marked as micro-batches
    /// are); `None` where it is computed whole.
    pub loss_chunks: Option<usize>,
    /// In-step checks: for each output that counts the out-of-range values an op was
    /// handed ([`crate::passes::index_checks`]) or sums the magnitudes of the params the
    /// updates of `train` write ([`crate::autodiff`]), what it guards.
    pub checks: Vec<StepCheck>,
    /// Params (and their optimizer state) declared `[L, …]` that the step holds as one
    /// param a layer ([`crate::autodiff::stacks`]): the whole tensor the program and the
    /// artifact name, and its pieces, laid out back to back in the persistent region.
    pub stacks: Vec<Stack>,
}

/// A persistent tensor `[L, …]` held as `L` params (or states) of its layers' type, named
/// `NAME[l]` (`NAME[l].SUFFIX` for an optimizer state), which lie back to back where the
/// whole tensor lies. Everything outside the compiler (the artifact, saved params, the
/// interpreter's values) sees only the whole tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Stack {
    pub name: String,
    pub ty: TensorType,
    /// The layers' nodes, in order: params or states, each of `ty` without its first axis.
    pub pieces: Vec<NodeId>,
}

/// An output the runtime checks after every step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepCheck {
    /// The output's name (it starts with [`tcc_runtime::artifact::CHECK_PREFIX`]).
    pub output: String,
    /// What is checked, for the error: "embedding into `table`".
    pub what: String,
    /// The index bound of an index check (0 for a finite check).
    pub bound: u64,
    pub kind: tcc_runtime::artifact::CheckKind,
}

/// The largest tensor a program may make, in bytes (1 TiB): far above any device's
/// memory, far below where byte counts and offsets could overflow.
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;

/// Every tensor's element count and bytes must be representable and at most
/// [`MAX_TENSOR_BYTES`] (E0317), so no later stage computes a size that overflows.
fn check_size(ty: &TensorType) -> Result<(), TypeError> {
    let bytes = ty
        .dims()
        .iter()
        .try_fold(ty.dtype.size_bytes() as u64, |a, &d| {
            a.checked_mul(d as u64)
        });
    match bytes {
        Some(b) if b <= MAX_TENSOR_BYTES => Ok(()),
        _ => Err(TypeError::new(
            "E0317",
            format!("tensor {ty} is too large"),
            format!(
                "{} bytes; a tensor may hold at most {} bytes (1 TiB)",
                bytes.map_or_else(|| "more than 2^64".to_string(), |b| b.to_string()),
                MAX_TENSOR_BYTES
            ),
        )),
    }
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            ..Graph::default()
        }
    }

    /// Adds a node after checking its operands with the op's shape rule.
    pub fn add(
        &mut self,
        op: Op,
        inputs: Vec<NodeId>,
        span: Span,
        checkpoint: Option<u32>,
    ) -> Result<NodeId, TypeError> {
        let ty = {
            let tys: Vec<&TensorType> = inputs.iter().map(|&i| &self.graph[i.0].ty).collect();
            infer(&op, &tys)?
        };
        check_size(&ty)?;
        let is_input = matches!(op, Op::Input { .. });
        let is_param = matches!(op, Op::Param { .. });
        let is_state = matches!(op, Op::State { .. });
        let id = NodeId(self.graph.add_node(Node {
            op,
            inputs: inputs.clone(),
            ty,
            span,
            checkpoint,
            backward: false,
            block: None,
            recomputed: None,
            micro_batch: None,
        }));
        for (pos, src) in inputs.iter().enumerate() {
            self.graph.add_edge(src.0, id.0, pos as u32);
        }
        if is_input {
            self.inputs.push(id);
        }
        if is_param {
            self.params.push(id);
        }
        if is_state {
            self.states.push(id);
        }
        Ok(id)
    }

    /// Marks a node as made by autodiff (see [`Node::backward`]).
    pub fn mark_backward(&mut self, id: NodeId) {
        if let Some(n) = self.graph.node_weight_mut(id.0) {
            n.backward = true;
        }
    }

    /// Marks a node as a recomputed forward value (see [`Node::recomputed`]).
    pub fn mark_recomputed(&mut self, id: NodeId, of: NodeId) {
        if let Some(n) = self.graph.node_weight_mut(id.0) {
            n.recomputed = Some(of);
        }
    }

    /// Records the user-function call a node was made in (see [`Node::block`]).
    pub fn set_block(&mut self, id: NodeId, block: u32) {
        if let Some(n) = self.graph.node_weight_mut(id.0) {
            n.block = Some(block);
        }
    }

    /// Records the micro-batch a node computes on (see [`Node::micro_batch`]).
    pub fn set_micro_batch(&mut self, id: NodeId, k: u32) {
        if let Some(n) = self.graph.node_weight_mut(id.0) {
            n.micro_batch = Some(k);
        }
    }

    /// Forgets every `checkpoint { }` region (`--remat none`).
    pub fn clear_checkpoints(&mut self) {
        for n in self.graph.node_weights_mut() {
            n.checkpoint = None;
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[id.0]
    }

    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.graph.node_weight(id.0)
    }

    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.graph[id.0].ty
    }

    /// The values the caller reads after a step: outputs, and the params and state the step
    /// updates with their new values.
    pub fn read_by_caller(&self) -> std::collections::BTreeSet<NodeId> {
        self.outputs
            .iter()
            .map(|(_, o)| *o)
            .chain(self.updates.iter().flat_map(|&(t, v)| [t, v]))
            .collect()
    }

    pub fn node_count(&self) -> usize {
        self.graph.node_count()
    }

    /// Node ids in insertion order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.graph.node_indices().map(NodeId)
    }

    /// The node whose buffer `n` reads through a chain of views (`n` itself when it is no
    /// view candidate; a param is never a view, so a param's views lead to it).
    pub fn view_root(&self, mut n: NodeId) -> NodeId {
        while self.node(n).op.is_view_candidate() {
            match self.node(n).inputs.first() {
                Some(&i) => n = i,
                None => break,
            }
        }
        n
    }

    /// The nodes that hold the parameter gradients `roots` (gradients the optimizer applies,
    /// as in [`Graph::grads`]): the roots and, through the adds, concats, casts, views and
    /// collectives (a data-parallel step's reductions) that build them, every contribution
    /// whose only uses lead there (a layer's weight-gradient product, the pieces of a
    /// stacked parameter's gradient).
    pub fn gradient_nodes(
        &self,
        roots: impl IntoIterator<Item = NodeId>,
    ) -> std::collections::BTreeSet<NodeId> {
        let mut set: std::collections::BTreeSet<NodeId> = roots.into_iter().collect();
        let grads: std::collections::BTreeSet<NodeId> =
            self.grads.iter().map(|&(_, d)| d).collect();
        let mut stack: Vec<NodeId> = set.iter().copied().collect();
        while let Some(n) = stack.pop() {
            let node = self.node(n);
            let through = matches!(
                node.op,
                Op::Binary(super::ops::BinaryOp::Add) | Op::Concat { .. } | Op::Cast { .. }
            ) || node.op.is_view_candidate()
                || node.op.is_collective()
                || grads.contains(&n);
            if !through {
                continue;
            }
            for &i in &node.inputs {
                let op = &self.node(i).op;
                if set.contains(&i) || op.is_leaf() || matches!(op, Op::Literal { .. }) {
                    continue;
                }
                if self.users(i).iter().all(|u| set.contains(u)) {
                    set.insert(i);
                    stack.push(i);
                }
            }
        }
        set
    }

    /// The nodes that read `id`'s result, each once, in id order.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .graph
            .edges_directed(id.0, Direction::Outgoing)
            .map(|e| NodeId(e.target()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Removes a node nobody reads. Returns false (and does nothing) if it still has users
    /// or is part of the model's interface.
    pub fn remove_if_unused(&mut self, id: NodeId) -> bool {
        let used = self
            .graph
            .edges_directed(id.0, Direction::Outgoing)
            .next()
            .is_some()
            || self.outputs.iter().any(|(_, o)| *o == id)
            || self.train.as_ref().is_some_and(|t| t.loss == id)
            || self.inputs.contains(&id)
            || self.params.contains(&id)
            || self.states.contains(&id)
            || self.updates.iter().any(|(t, v)| *t == id || *v == id);
        if used {
            return false;
        }
        self.graph.remove_node(id.0).is_some()
    }

    /// Makes `user` read `new` wherever it reads `old` (other readers are left alone).
    pub fn replace_use_in(&mut self, user: NodeId, old: NodeId, new: NodeId) {
        let edges: Vec<_> = self
            .graph
            .edges_directed(user.0, Direction::Incoming)
            .filter(|e| e.source() == old.0)
            .map(|e| e.id())
            .collect();
        for e in edges {
            if let Some(pos) = self.graph.remove_edge(e) {
                self.graph.add_edge(new.0, user.0, pos);
                if let Some(n) = self.graph.node_weight_mut(user.0) {
                    if let Some(slot) = n.inputs.get_mut(pos as usize) {
                        *slot = new;
                    }
                }
            }
        }
    }

    /// Makes every reader of `old` (operands, outputs, train loss, updates) read `new`
    /// instead. Types must agree; `old` is left without users.
    pub fn replace_all_uses(&mut self, old: NodeId, new: NodeId) {
        for u in self.users(old) {
            self.replace_use_in(u, old, new);
        }
        for (_, o) in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
        if let Some(t) = &mut self.train {
            if t.loss == old {
                t.loss = new;
            }
        }
        for (_, v) in self.updates.iter_mut().chain(self.grads.iter_mut()) {
            if *v == old {
                *v = new;
            }
        }
    }

    /// Removes a node and its edges unconditionally (callers make sure nothing reads it).
    pub fn remove(&mut self, id: NodeId) {
        self.graph.remove_node(id.0);
        self.inputs.retain(|&i| i != id);
        self.params.retain(|&i| i != id);
        self.states.retain(|&i| i != id);
        self.grads.retain(|&(p, d)| p != id && d != id);
    }

    /// A copy with nodes renumbered in topological order (ids become execution order).
    pub fn compacted(&self) -> Graph {
        let order = self
            .topo_order()
            .unwrap_or_else(|| self.node_ids().collect());
        self.reordered(&order)
    }

    /// A copy with nodes renumbered in `order`, which must be a topological order of every
    /// node: the copy's deterministic topological order is `order`.
    pub fn reordered(&self, order: &[NodeId]) -> Graph {
        let order = order.to_vec();
        let mut out = Graph::new(self.name.clone());
        let mut map: std::collections::BTreeMap<NodeId, NodeId> = std::collections::BTreeMap::new();
        for old in order {
            let n = self.node(old);
            let inputs: Vec<NodeId> = n
                .inputs
                .iter()
                .filter_map(|i| map.get(i).copied())
                .collect();
            let id = NodeId(out.graph.add_node(Node {
                op: n.op.clone(),
                inputs: inputs.clone(),
                ty: n.ty.clone(),
                span: n.span,
                checkpoint: n.checkpoint,
                backward: n.backward,
                block: n.block,
                recomputed: n.recomputed,
                micro_batch: n.micro_batch,
            }));
            for (pos, src) in inputs.iter().enumerate() {
                out.graph.add_edge(src.0, id.0, pos as u32);
            }
            map.insert(old, id);
        }
        let m = |i: &NodeId| map.get(i).copied();
        out.inputs = self.inputs.iter().filter_map(m).collect();
        out.params = self.params.iter().filter_map(m).collect();
        out.states = self.states.iter().filter_map(m).collect();
        out.outputs = self
            .outputs
            .iter()
            .filter_map(|(n, i)| m(i).map(|j| (n.clone(), j)))
            .collect();
        out.train = self.train.as_ref().and_then(|t| {
            m(&t.loss).map(|loss| TrainSpec {
                optimizer: t.optimizer,
                loss,
                span: t.span,
            })
        });
        out.updates = self
            .updates
            .iter()
            .filter_map(|(t, v)| Some((m(t)?, m(v)?)))
            .collect();
        out.grads = self
            .grads
            .iter()
            .filter_map(|(p, d)| Some((m(p)?, m(d)?)))
            .collect();
        out.ranks = self.ranks;
        out.shards = self.shards.clone();
        out.micro_batches = self.micro_batches;
        out.loss_chunks = self.loss_chunks;
        out.checks = self.checks.clone();
        out.stacks = self
            .stacks
            .iter()
            .map(|s| Stack {
                pieces: s.pieces.iter().filter_map(m).collect(),
                ..s.clone()
            })
            .collect();
        out
    }

    /// A deterministic topological order: among ready nodes, the smallest id first. For a
    /// graph built in program order this is program order. `None` if there is a cycle.
    pub fn topo_order(&self) -> Option<Vec<NodeId>> {
        // Inputs not yet ordered, by node index (a removed node's slot stays unused).
        let mut indegree: Vec<usize> =
            vec![0; petgraph::visit::NodeIndexable::node_bound(&self.graph)];
        let mut ready: BinaryHeap<std::cmp::Reverse<NodeIndex<u32>>> = BinaryHeap::new();
        for n in self.graph.node_indices() {
            let d = self.graph.node_weight(n).map_or(0, |w| w.inputs.len());
            indegree[n.index()] = d;
            if d == 0 {
                ready.push(std::cmp::Reverse(n));
            }
        }
        let mut order = Vec::with_capacity(self.graph.node_count());
        while let Some(std::cmp::Reverse(n)) = ready.pop() {
            order.push(NodeId(n));
            for e in self.graph.edges_directed(n, Direction::Outgoing) {
                match indegree.get_mut(e.target().index()) {
                    Some(d) if *d > 0 => {
                        *d -= 1;
                        if *d == 0 {
                            ready.push(std::cmp::Reverse(e.target()));
                        }
                    }
                    _ => {}
                }
            }
        }
        (order.len() == self.graph.node_count()).then_some(order)
    }

    /// The stack `n` is a piece of, and which layer it is.
    pub fn stack_of(&self, n: NodeId) -> Option<(&Stack, usize)> {
        self.stacks
            .iter()
            .find_map(|s| Some((s, s.pieces.iter().position(|&p| p == n)?)))
    }

    /// The persistent tensors as the program names them, in the order of `params` then
    /// `states`: `(node, name, type)` for each param and state, and for a stack the whole
    /// tensor, given at its first piece (its other pieces are left out).
    pub fn persistent_tensors(&self) -> Vec<(NodeId, String, TensorType)> {
        let mut out = Vec::new();
        for &n in self.params.iter().chain(&self.states) {
            match self.stack_of(n) {
                Some((s, 0)) => out.push((n, s.name.clone(), s.ty.clone())),
                Some(_) => {}
                None => match &self.node(n).op {
                    Op::Param { name, ty, .. } | Op::State { name, ty } => {
                        out.push((n, name.clone(), ty.clone()))
                    }
                    _ => {}
                },
            }
        }
        out
    }

    /// The underlying petgraph graph, for analyses.
    pub fn petgraph(&self) -> &StableDiGraph<Node, u32> {
        &self.graph
    }
}
