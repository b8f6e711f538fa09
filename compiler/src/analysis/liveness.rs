//! Buffers and their lifetimes over a schedule.
//!
//! Every node's result lives in a buffer. Several nodes share one buffer when
//! - the node is a view (reshape, permute, broadcast_to, slice, select): it reads its
//!   operand's bytes in place and keeps them alive;
//! - the node is elementwise and takes its operand's bytes in place: the operand is the
//!   latest value in its buffer, has the result's shape and byte size, is not a view, nothing
//!   reads that buffer after this op, and it is not an input, output, param or state (chains
//!   of elementwise ops thus run in one buffer);
//! - the node is the new value of an optimizer update: it is written into the param's (or
//!   state's) persistent bytes.
//!
//! A buffer defined at step `t` and last read at step `u` lives `[t, u + 1)`; outputs live to
//! the end of the step; inputs from step 0 (the caller fills them before the step);
//! params and optimizer state always. Scalar literals get no buffer: kernels embed them.

use crate::ir::{Graph, NodeId, Op};
use std::collections::BTreeMap;

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BufferKind {
    /// Params and optimizer state: live across steps.
    Persistent,
    /// Filled by the caller before each step.
    Input,
    /// Everything else (outputs included).
    Transient,
}

/// One buffer of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The node that allocates it.
    pub owner: NodeId,
    pub bytes: u64,
    pub kind: BufferKind,
    /// Lifetime `[start, end)` in schedule steps.
    pub start: usize,
    pub end: usize,
    /// Every node whose result lives in this buffer (owner first).
    pub nodes: Vec<NodeId>,
    /// True if an output of the model lives here.
    pub output: bool,
}

/// Buffers of a graph under a schedule.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    pub order: Vec<NodeId>,
    pub buffers: Vec<Buffer>,
    /// The buffer each node's result lives in (`None` for scalar literals).
    pub buffer_of: BTreeMap<NodeId, usize>,
    /// Nodes that took an operand's bytes in place.
    pub in_place: Vec<NodeId>,
}

impl Liveness {
    /// Largest total bytes of transient and input buffers live at one step.
    pub fn max_live(&self) -> u64 {
        self.peak().1.max(0) as u64
    }

    /// The first step at which the transient and input buffers live reach
    /// [`Liveness::max_live`].
    pub fn peak_step(&self) -> usize {
        self.peak().0
    }

    /// The first step with the most transient and input bytes live, and those bytes.
    fn peak(&self) -> (usize, i128) {
        let n = self.order.len() + 1;
        let mut delta = vec![0i128; n + 1];
        for b in self
            .buffers
            .iter()
            .filter(|b| b.kind != BufferKind::Persistent)
        {
            delta[b.start.min(n)] += b.bytes as i128;
            delta[b.end.min(n)] -= b.bytes as i128;
        }
        let (mut cur, mut best, mut at) = (0i128, i128::MIN, 0);
        for (i, d) in delta.into_iter().enumerate() {
            cur += d;
            if cur > best {
                (best, at) = (cur, i);
            }
        }
        (at, best)
    }

    /// Bytes of the persistent buffers.
    pub fn persistent_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .filter(|b| b.kind == BufferKind::Persistent)
            .map(|b| b.bytes)
            .sum()
    }

    /// Sum of all non-persistent buffers: the memory with no reuse at all.
    pub fn no_reuse_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .filter(|b| b.kind != BufferKind::Persistent)
            .map(|b| b.bytes)
            .sum()
    }
}

/// Computes buffers and lifetimes of `g` executed in `order` (a topological order).
pub fn liveness(g: &Graph, order: &[NodeId]) -> Liveness {
    let n = order.len();
    // Node-level last reads.
    // By node index; `None` for a node nothing reads.
    let slots = order
        .iter()
        .flat_map(|&x| std::iter::once(x).chain(g.node(x).inputs.iter().copied()))
        .map(|x| x.index() + 1)
        .max()
        .unwrap_or(0);
    let mut last_read: Vec<Option<usize>> = vec![None; slots];
    for (t, &x) in order.iter().enumerate() {
        for i in &g.node(x).inputs {
            if let Some(e) = last_read.get_mut(i.index()) {
                *e = Some(e.map_or(t, |r| r.max(t)));
            }
        }
    }
    let last_read = |i: NodeId| last_read.get(i.index()).copied().flatten();
    let outputs: std::collections::BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    let update_target: BTreeMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    let mut lv = Liveness {
        order: order.to_vec(),
        ..Liveness::default()
    };
    // For each buffer, the last step at which any of its nodes is read (0 where none is):
    // kept as nodes join it, so the in-place test below need not walk a long chain of
    // nodes written over one buffer at every step.
    let mut read_until: Vec<usize> = Vec::new();
    let new_buffer = |lv: &mut Liveness, x: NodeId, kind: BufferKind, start: usize| {
        lv.buffers.push(Buffer {
            owner: x,
            bytes: g.ty(x).size_bytes() as u64,
            kind,
            start,
            end: start + 1,
            nodes: vec![x],
            output: false,
        });
        lv.buffers.len() - 1
    };
    for (t, &x) in order.iter().enumerate() {
        let node = g.node(x);
        let buf = match &node.op {
            Op::Literal { .. } => None,
            // A stack's layers lie back to back: all get their buffers at the first.
            Op::Param { .. } | Op::State { .. } => match g.stack_of(x) {
                Some((s, _)) => {
                    for &p in &s.pieces {
                        if !lv.buffer_of.contains_key(&p) {
                            let b = new_buffer(&mut lv, p, BufferKind::Persistent, 0);
                            lv.buffer_of.insert(p, b);
                        }
                    }
                    lv.buffer_of.get(&x).copied()
                }
                None => Some(new_buffer(&mut lv, x, BufferKind::Persistent, 0)),
            },
            Op::Input { .. } => Some(new_buffer(&mut lv, x, BufferKind::Input, 0)),
            _ if update_target.contains_key(&x) => update_target
                .get(&x)
                .and_then(|tg| lv.buffer_of.get(tg).copied()),
            op if op.is_view_candidate() => lv.buffer_of.get(&node.inputs[0]).copied(),
            // Elementwise ops may write their result over an operand.
            op if op.is_elementwise() => {
                // In place over an operand that dies here?
                let cand = node.inputs.iter().copied().find(|&i| {
                    let Some(&b) = lv.buffer_of.get(&i) else {
                        return false;
                    };
                    let buf = &lv.buffers[b];
                    buf.kind == BufferKind::Transient
                        && !buf.output
                        && buf.nodes.last() == Some(&i)
                        && !g.node(i).op.is_view_candidate()
                        && read_until.get(b).is_none_or(|&r| r <= t)
                        && g.ty(i).shape == node.ty.shape
                        && g.ty(i).size_bytes() == node.ty.size_bytes()
                        && last_read(i) == Some(t)
                        // No other operand reads the same bytes through another node.
                        && node.inputs.iter().all(|&o| o == i || lv.buffer_of.get(&o) != Some(&b))
                });
                match cand {
                    Some(i) => {
                        lv.in_place.push(x);
                        lv.buffer_of.get(&i).copied()
                    }
                    None => Some(new_buffer(&mut lv, x, BufferKind::Transient, t)),
                }
            }
            _ => Some(new_buffer(&mut lv, x, BufferKind::Transient, t)),
        };
        if let Some(b) = buf {
            lv.buffer_of.insert(x, b);
            if read_until.len() <= b {
                read_until.resize(b + 1, 0);
            }
            read_until[b] = read_until[b].max(last_read(x).unwrap_or(0));
            let bufm = &mut lv.buffers[b];
            if bufm.owner != x {
                bufm.nodes.push(x);
            }
            bufm.end = bufm.end.max(t + 1);
            if outputs.contains(&x) {
                bufm.output = true;
            }
        }
        for i in &node.inputs {
            if let Some(&b) = lv.buffer_of.get(i) {
                let bufm = &mut lv.buffers[b];
                bufm.end = bufm.end.max(t + 1);
            }
        }
    }
    for b in &mut lv.buffers {
        if b.kind == BufferKind::Persistent || b.output {
            b.end = n;
        }
        if b.kind == BufferKind::Persistent {
            b.start = 0;
        }
    }
    lv
}

/// Buffers and lifetimes of fused kernels: step 0 is the caller filling the inputs, step
/// `t + 1` is kernel `t` (so an input no kernel reads shares no step with a kernel's result,
/// as in one-op-at-a-time execution, while inputs never share bytes). Leaves (params, state,
/// inputs) and every node a kernel stores get a buffer; an update's new value is stored
/// into its target's buffer, and a value stored in place (`Fused::in_place`) into the
/// buffer it is written over; nothing else has one. A buffer lives from the first kernel
/// that writes it to one past the last kernel that reads it.
pub fn kernel_liveness(g: &Graph, fused: &crate::kernel::Fused) -> Liveness {
    let n = fused.kernels.len();
    let outputs: std::collections::BTreeSet<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    let update_target: BTreeMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    let mut lv = Liveness::default();
    let push = |lv: &mut Liveness, x: NodeId, kind: BufferKind, start: usize| {
        lv.buffers.push(Buffer {
            owner: x,
            bytes: g.ty(x).size_bytes() as u64,
            kind,
            start,
            end: start + 1,
            nodes: vec![x],
            output: outputs.contains(&x),
        });
        lv.buffer_of.insert(x, lv.buffers.len() - 1);
    };
    for &p in g.params.iter().chain(&g.states) {
        push(&mut lv, p, BufferKind::Persistent, 0);
    }
    for &i in &g.inputs {
        push(&mut lv, i, BufferKind::Input, 0);
    }
    for (t, k) in fused.kernels.iter().enumerate() {
        for s in &k.stores {
            if !lv.buffer_of.contains_key(&s.buf) {
                match update_target
                    .get(&s.buf)
                    .or_else(|| fused.in_place.get(&s.buf))
                    .and_then(|tg| lv.buffer_of.get(tg).copied())
                {
                    Some(b) => {
                        if fused.in_place.contains_key(&s.buf) {
                            lv.in_place.push(s.buf);
                        }
                        lv.buffer_of.insert(s.buf, b);
                        lv.buffers[b].nodes.push(s.buf);
                        if outputs.contains(&s.buf) {
                            lv.buffers[b].output = true;
                        }
                    }
                    None => push(&mut lv, s.buf, BufferKind::Transient, t + 1),
                }
            }
            if let Some(&b) = lv.buffer_of.get(&s.buf) {
                lv.buffers[b].end = lv.buffers[b].end.max(t + 2);
            }
        }
        for r in k.loads() {
            if let Some(&b) = lv.buffer_of.get(&r) {
                lv.buffers[b].end = lv.buffers[b].end.max(t + 2);
            }
        }
        lv.order.push(
            k.stores
                .first()
                .map_or(NodeId(Default::default()), |s| s.buf),
        );
    }
    for b in &mut lv.buffers {
        if b.kind == BufferKind::Persistent || b.output {
            b.end = n + 1;
        }
        if b.kind == BufferKind::Persistent {
            b.start = 0;
        }
    }
    lv
}
