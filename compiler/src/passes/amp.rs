//! Mixed precision (`--amp bf16|f16`): the policy table and the `amp` stage that applies it.
//!
//! The policy is [`precision`], one row per op, the way autocast's op lists work:
//!
//! | precision | ops | operands | result |
//! |---|---|---|---|
//! | [`Precision::Low`] | `matmul`, `conv2d` and its input gradient, fused attention and its gradient | 16-bit (f32 accumulation; the gradient's row statistics stay f32) | 16-bit (attention's row statistics f32) |
//! | [`Precision::Rounded`] | `conv2d`'s weight gradient (a param's gradient, summed over the batch: split along `k`, its parts add up in f32) | rounded to 16 bits, then widened (what tensor cores multiply, f32 accumulation) | f32 |
//! | [`Precision::Full`] | `exp log sqrt rsqrt recip sin cos pow`, every reduction (so softmax, norms and losses), `embedding`'s weight gradient | f32 | f32 |
//! | [`Precision::Widest`] | other elementwise ops, `where`, views, `concat`, pooling, `dropout`, `embedding` | the widest float dtype among them (literals, fills and params broadcast onto the result, such as a bias, adopt it) | that dtype |
//! | [`Precision::AsIs`] | leaves (inputs, params, state, literals), `cast`, `argmax` | unchanged | unchanged |
//!
//! Params, their optimizer state and the gradients the optimizer applies stay f32 (master
//! weights): params and state are leaves, every update mixes them with f32, and the
//! gradients ([`Graph::grads`], with the sums of their contributions) are forced to their
//! declared dtype. A 16-bit weight copy is a `cast` of the param, made where the first
//! tensor-core op of the forward pass reads it and again where the backward pass first
//! does ([`reusable`]: the f32 param is persistent, so the copy need not live across the
//! turn). Values are stored between kernels in the dtype the
//! policy gives them, so a 16-bit result costs half the arena; inside a kernel every float
//! is computed in f32 and a 16-bit value is rounded where it is made.
//!
//! One rewrite beside the table: a strict sign test in the backward pass (`x > 0` or
//! `x < 0`: relu's mask) of an f32 value that a 16-bit op also reads tests that op's 16-bit
//! copy instead, so the f32 value need not live into the backward pass (a strict test of
//! the rounded value differs only where the value rounds to 0, below half the 16-bit
//! dtype's smallest subnormal; autocast's 16-bit activations give the same mask).
//!
//! Another ([`stored_16_bit`]): an f32 result of an op of the `Full` row (`exp`, ...) that
//! a tensor-core op reads, and that every other reader takes as it takes a 16-bit
//! activation (elementwise ops, through reshapes and permutes), is stored only as its
//! 16-bit copy: the attention probabilities the backward pass rebuilds are rounded once
//! where they are made, and the f32 copy (gpt: 96 MiB at the peak) and the kernel that
//! rounded it are gone.
//!
//! A third ([`forward_16_bit`]): a forward activation computed in f32 (a `relu` after a
//! batch norm, whose f32 statistics make it f32) that a tensor-core op reads, and that
//! residual arithmetic with f32 operands reads too, is stored only as its 16-bit copy, as
//! autocast stores a convolutional network's activations: the residual sum reads the
//! rounded value, and a backward pass that rebuilds the next block's output reads the
//! copy it keeps anyway (with free recomputation's kernels of their own, the cnn under
//! bf16: 314 -> 286 MiB).
//!
//! Casts keep the marks of the reader that needs them, and a cast of a recomputed value is
//! recomputed too (`Node::recomputed`), so free recomputation (`remat::step::free`) finds
//! a kernel to store the 16-bit clone a backward product reads.
//!
//! The stage runs last among the graph stages (after fused attention, which it then gives
//! 16-bit operands), so every rewrite before it sees the program as written;
//! outputs keep their declared dtypes (a cast back where the policy changed them).

use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, TensorType, TypeError, UnaryOp};
use std::collections::{BTreeMap, BTreeSet};

/// Where an op computes under mixed precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Float operands in the 16-bit dtype; result 16-bit.
    Low,
    /// Float operands rounded to the 16-bit dtype and widened back to f32; result f32: a
    /// contraction on tensor cores whose result must stay f32 (its 16-bit operands are
    /// the ones the forward op and the input gradient read, and the widening is a load).
    Rounded,
    /// Float operands widened to f32; result f32.
    Full,
    /// Float operands brought to the widest float dtype among them.
    Widest,
    /// Left as written.
    AsIs,
}

/// The policy: the precision of every op (see the module doc's table).
pub fn precision(op: &Op) -> Precision {
    use Precision::*;
    match op {
        // Fused attention reads 16-bit `q`, `k` and `v` (tensor cores where the kernel
        // takes them), computes in f32 and stores a 16-bit output, as SDPA does under
        // autocast; its row statistics stay f32 (the op's type).
        Op::MatMul
        | Op::Conv2d { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Attention { .. }
        | Op::AttentionLse { .. }
        | Op::AttentionGrad { .. } => Low,
        // A weight gradient is a param's gradient (kept f32) summed over the whole batch:
        // it accumulates in f32 from 16-bit operands, split over k where k is long.
        Op::Conv2dGradWeight { .. } => Rounded,
        Op::Unary(
            UnaryOp::Exp
            | UnaryOp::Log
            | UnaryOp::Sqrt
            | UnaryOp::Rsqrt
            | UnaryOp::Recip
            | UnaryOp::Sin
            | UnaryOp::Cos,
        )
        | Op::Binary(crate::ir::BinaryOp::Pow)
        | Op::Reduce { .. }
        | Op::EmbeddingGrad { .. } => Full,
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::BroadcastTo { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Select { .. }
        | Op::Pool2d { .. }
        | Op::Pool2dGrad { .. }
        | Op::Embedding
        | Op::Dropout { .. }
        | Op::Tri { .. } => Widest,
        Op::Input { .. }
        | Op::Param { .. }
        | Op::State { .. }
        | Op::Literal { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::Cast { .. }
        | Op::ArgMax { .. }
        | Op::AllReduce
        | Op::ReduceScatter { .. }
        | Op::AllGather { .. }
        | Op::Shard { .. }
        | Op::Grad => AsIs,
    }
}

/// The 16-bit dtype of `--amp`, if it names one.
pub fn low_dtype(name: &str) -> Option<DType> {
    match name {
        "bf16" => Some(DType::BF16),
        "f16" => Some(DType::F16),
        _ => None,
    }
}

/// Literals and fills take the dtype of what they meet instead of imposing theirs.
fn adopts(op: &Op) -> bool {
    matches!(op, Op::Literal { .. } | Op::Full { .. })
}

/// Whether `n` is a param (or input or state) seen through views and casts.
fn is_param_view(g: &Graph, n: NodeId) -> bool {
    matches!(
        leaf_of_view(g, n),
        Some(Op::Param { .. } | Op::Input { .. } | Op::State { .. })
    )
}

/// The leaf `n` is a view of (through views and casts), or `None` where it is computed.
fn leaf_of_view(g: &Graph, mut n: NodeId) -> Option<&Op> {
    loop {
        let node = g.node(n);
        match node.op {
            Op::Param { .. } | Op::Input { .. } | Op::State { .. } => return Some(&node.op),
            Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::BroadcastTo { .. }
            | Op::Select { .. }
            | Op::Slice { .. }
            | Op::Cast { .. } => n = node.inputs[0],
            _ => return None,
        }
    }
}

/// The wider of two float dtypes (f16 and bf16 meet in f32).
fn wider(a: DType, b: DType) -> DType {
    if a == b {
        a
    } else {
        DType::F32
    }
}

/// The gradients the optimizer applies and, below them, the sums of their contributions
/// read by nothing else: these keep their declared dtype.
fn master_gradients(g: &Graph) -> BTreeSet<NodeId> {
    let mut forced: BTreeSet<NodeId> = g.grads.iter().map(|&(_, d)| d).collect();
    let mut stack: Vec<NodeId> = forced.iter().copied().collect();
    while let Some(n) = stack.pop() {
        let node = g.node(n);
        let sums = matches!(
            node.op,
            Op::Binary(crate::ir::BinaryOp::Add | crate::ir::BinaryOp::Mul)
        );
        if !sums {
            continue;
        }
        for &o in &node.inputs {
            let inner_sum = matches!(g.node(o).op, Op::Binary(crate::ir::BinaryOp::Add));
            if inner_sum && g.users(o) == [n] && forced.insert(o) {
                stack.push(o);
            }
        }
    }
    forced
}

/// Applies the policy with `low` (bf16 or f16) as the 16-bit dtype. Node order is kept (a
/// swap [`cast_lhs`] leaves unread is dropped); casts are added just before their first
/// reader.
pub fn apply(g: &Graph, low: DType) -> Result<Graph, TypeError> {
    apply_with_dtypes(g, low).map(|(h, _)| h)
}

/// The dtype the policy with `low` stores each value of `g` in: its 16-bit copy where the
/// step keeps only that (a product, an activation a product reads), f32 where it is
/// computed and kept in f32. What the recomputation reports count a value's bytes by under
/// `--amp` (`remat::step`), which runs before this pass.
pub fn stored_dtypes(g: &Graph, low: DType) -> Result<BTreeMap<NodeId, DType>, TypeError> {
    apply_with_dtypes(g, low).map(|(_, d)| d)
}

/// [`apply`], and [`stored_dtypes`]: the policy applied once to learn each value's dtype,
/// then again with the forward activations [`forward_16_bit`] picks from those stored as
/// their 16-bit copies only.
fn apply_with_dtypes(g: &Graph, low: DType) -> Result<(Graph, BTreeMap<NodeId, DType>), TypeError> {
    let (h, dtypes) = apply_policy(g, low, &BTreeSet::new())?;
    let kept = interface_values(g);
    let order = g.topo_order().unwrap_or_default();
    let mut copies: BTreeSet<NodeId> = order
        .into_iter()
        .filter(|&n| forward_16_bit(g, n, &kept, &dtypes))
        .collect();
    // A copy whose arithmetic reader no longer computes in f32 with it (its other operand
    // is a broadcast param that adopts the 16-bit dtype, or another copy) is dropped, and
    // the policy applied again: the set only shrinks.
    while !copies.is_empty() {
        let (h2, d2) = apply_policy(g, low, &copies)?;
        let narrowed: BTreeSet<NodeId> = copies
            .iter()
            .copied()
            .filter(|&n| {
                arithmetic_readers(g, n)
                    .iter()
                    .any(|u| d2.get(u) != Some(&DType::F32))
            })
            .collect();
        if narrowed.is_empty() {
            return Ok((h2, d2));
        }
        copies.retain(|n| !narrowed.contains(n));
    }
    Ok((h, dtypes))
}

/// The binary arithmetic ops that read `n`, seen through reshapes and permutes.
fn arithmetic_readers(g: &Graph, n: NodeId) -> Vec<NodeId> {
    let mut out = Vec::new();
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        for u in g.users(x) {
            match g.node(u).op {
                Op::Reshape { .. } | Op::Permute { .. } => stack.push(u),
                ref op if arithmetic(op) => out.push(u),
                _ => {}
            }
        }
    }
    out
}

/// Values the interface names (outputs, updates, the loss, the gradients the optimizer
/// applies): they keep their dtype where they are made.
fn interface_values(g: &Graph) -> BTreeSet<NodeId> {
    g.outputs
        .iter()
        .map(|(_, o)| *o)
        .chain(g.updates.iter().flat_map(|&(t, v)| [t, v]))
        .chain(g.train.as_ref().map(|t| t.loss))
        .chain(master_gradients(g))
        .collect()
}

/// The policy, with the forward values in `copies` stored only as their 16-bit copies.
fn apply_policy(
    g: &Graph,
    low: DType,
    copies: &BTreeSet<NodeId>,
) -> Result<(Graph, BTreeMap<NodeId, DType>), TypeError> {
    let order = g
        .topo_order()
        .ok_or_else(|| TypeError::new("E0002", "cyclic graph", "before mixed precision"))?;
    let forced = master_gradients(g);
    let kept = interface_values(g);
    let mut h = Graph::new(g.name.clone());
    let mut map: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    // (value in h, dtype) -> its cast, per micro-batch of the reader (a micro-batched
    // step casts a param once per micro-batch, so each copy lives only while its
    // micro-batch runs: `schedule::micro_segments`); (literal or fill in g, dtype) -> its
    // copy in h.
    let segment = crate::passes::schedule::segments(g, &order);
    let last = segment.values().copied().max().unwrap_or(0);
    let mut casts_by: BTreeMap<u32, BTreeMap<(NodeId, DType), NodeId>> = BTreeMap::new();
    let mut adopted: BTreeMap<(NodeId, DType), NodeId> = BTreeMap::new();
    // Swaps whose readers now read a swapped cast instead ([`cast_lhs`]).
    let mut swapped: Vec<NodeId> = Vec::new();
    let missing = || TypeError::new("E0002", "operand out of order", "in mixed precision");
    for &n in &order {
        let node = g.node(n);
        let casts = casts_by
            .entry(segment.get(&n).copied().unwrap_or(0))
            .or_default();
        let ins: Vec<NodeId> = node
            .inputs
            .iter()
            .map(|i| map.get(i).copied().ok_or_else(missing))
            .collect::<Result<_, _>>()?;
        let want = match precision(&node.op) {
            Precision::Low => Some(low),
            Precision::Full | Precision::Rounded => Some(DType::F32),
            Precision::AsIs => None,
            Precision::Widest if forced.contains(&n) => Some(node.ty.dtype),
            Precision::Widest => {
                // Operands that set the dtype: not literals or fills, and not a param
                // broadcast onto the result (a bias or gain adopts the activation's dtype,
                // as a bias inside autocast's 16-bit `linear` does), unless all are.
                let numel = node.ty.shape.numel();
                let setting = |skip_broadcast_params: bool| {
                    node.inputs
                        .iter()
                        .zip(&ins)
                        .filter(|(o, _)| !adopts(&g.node(**o).op))
                        .filter(|(o, _)| {
                            !skip_broadcast_params
                                || g.ty(**o).shape.numel() == numel
                                || !is_param_view(g, **o)
                        })
                        .map(|(_, &i)| h.ty(i).dtype)
                        .filter(|d| d.is_float())
                        .reduce(wider)
                };
                setting(true).or_else(|| setting(false))
            }
        };
        let rounded = precision(&node.op) == Precision::Rounded;
        let mut new_ins = Vec::with_capacity(ins.len());
        for (pos, (&old, &i)) in node.inputs.iter().zip(&ins).enumerate() {
            let dt = h.ty(i).dtype;
            // An attention gradient's row statistics (`lse`, `delta`) stay f32.
            let stats = matches!(node.op, Op::AttentionGrad { .. }) && pos >= 4;
            let Some(w) =
                want.filter(|&w| !stats && dt.is_float() && (dt != w || rounded && dt != low))
            else {
                new_ins.push(i);
                continue;
            };
            let src = g.node(old);
            let x = if adopts(&src.op) {
                if let Some(&x) = adopted.get(&(old, w)) {
                    x
                } else {
                    let op = match &src.op {
                        Op::Literal { value, .. } => Op::Literal {
                            value: *value,
                            dtype: w,
                        },
                        Op::Full { value, ty } => Op::Full {
                            value: *value,
                            ty: TensorType::new(w, ty.shape.clone()),
                        },
                        other => other.clone(),
                    };
                    let x = h.add(op, vec![], src.span, src.checkpoint)?;
                    copy_marks(&mut h, x, src);
                    adopted.insert((old, w), x);
                    x
                }
            } else if rounded && dt != low {
                let x16 = cast(&mut h, casts, i, low, node)?;
                cast(&mut h, casts, x16, w, node)?
            } else if pos == 0 && matches!(node.op, Op::MatMul) {
                cast_lhs(&mut h, casts, i, w, node, &mut swapped)?
            } else {
                cast(&mut h, casts, i, w, node)?
            };
            new_ins.push(x);
        }
        // A cast whose operand already has its dtype is the operand.
        if let Op::Cast { to } = node.op {
            if h.ty(new_ins[0]).dtype == to {
                map.insert(n, new_ins[0]);
                continue;
            }
        }
        // A sign test of a value whose 16-bit copy the forward pass made (relu's mask in
        // its backward pass) reads that copy, so the f32 value need not live until then.
        if let Some(x16) = sign_test_copy(g, node, (&new_ins, &ins), &mut h, casts, low)? {
            // The literal 0 in the 16-bit dtype, as any literal meeting it adopts it.
            let lit = node.inputs[1];
            let zero = match adopted.get(&(lit, low)) {
                Some(&z) => z,
                None => {
                    let src = g.node(lit);
                    let z = h.add(
                        Op::Literal {
                            value: crate::ir::types::Scalar::Float(0.0),
                            dtype: low,
                        },
                        vec![],
                        src.span,
                        src.checkpoint,
                    )?;
                    copy_marks(&mut h, z, src);
                    adopted.insert((lit, low), z);
                    z
                }
            };
            let id = h.add(node.op.clone(), vec![x16, zero], node.span, node.checkpoint)?;
            rebuilt_marks(&mut h, id, node);
            map.insert(n, id);
            continue;
        }
        let id = h.add(node.op.clone(), new_ins, node.span, node.checkpoint)?;
        rebuilt_marks(&mut h, id, node);
        let id = if forced.contains(&n) && h.ty(id).dtype != node.ty.dtype {
            cast(&mut h, casts, id, node.ty.dtype, node)?
        } else if h.ty(id).dtype == DType::F32
            && (copies.contains(&n) || stored_16_bit(g, n, &kept))
        {
            cast(&mut h, casts, id, low, node)?
        } else {
            id
        };
        map.insert(n, id);
    }
    let stored: BTreeMap<NodeId, DType> = map.iter().map(|(&n, &i)| (n, h.ty(i).dtype)).collect();
    let casts = casts_by.entry(last).or_default();
    let m = |i: &NodeId| map.get(i).copied().ok_or_else(missing);
    // The interface keeps its dtypes: outputs and updated values are cast back.
    let mut back = |h: &mut Graph, old: NodeId, dtype: DType| -> Result<NodeId, TypeError> {
        let new = m(&old)?;
        if h.ty(new).dtype == dtype {
            return Ok(new);
        }
        cast(h, casts, new, dtype, g.node(old))
    };
    let mut outputs = Vec::with_capacity(g.outputs.len());
    for (name, o) in &g.outputs {
        outputs.push((name.clone(), back(&mut h, *o, g.ty(*o).dtype)?));
    }
    let mut updates = Vec::with_capacity(g.updates.len());
    for &(t, v) in &g.updates {
        updates.push((m(&t)?, back(&mut h, v, g.ty(t).dtype)?));
    }
    h.outputs = outputs;
    h.updates = updates;
    h.train = match &g.train {
        Some(t) => Some(crate::ir::TrainSpec {
            loss: m(&t.loss)?,
            ..t.clone()
        }),
        None => None,
    };
    h.inputs = g.inputs.iter().map(m).collect::<Result<_, _>>()?;
    h.params = g.params.iter().map(m).collect::<Result<_, _>>()?;
    h.states = g.states.iter().map(m).collect::<Result<_, _>>()?;
    h.grads = g
        .grads
        .iter()
        .map(|(p, d)| Ok((m(p)?, m(d)?)))
        .collect::<Result<_, TypeError>>()?;
    h.ranks = g.ranks;
    h.micro_batches = g.micro_batches;
    h.loss_chunks = g.loss_chunks;
    h.shards = g.shards.clone();
    h.stacks = g
        .stacks
        .iter()
        .map(|s| {
            Ok(crate::ir::Stack {
                pieces: s.pieces.iter().map(m).collect::<Result<_, _>>()?,
                ..s.clone()
            })
        })
        .collect::<Result<_, _>>()?;
    h.checks = g.checks.clone();
    // A swap left with no reader is dropped, with the reshapes below it that only it read
    // (the others keep their order).
    let grads: BTreeSet<NodeId> = h.grads.iter().map(|&(_, d)| d).collect();
    let mut dropped: BTreeSet<NodeId> = BTreeSet::new();
    let mut stack = swapped;
    while let Some(x) = stack.pop() {
        if dropped.contains(&x) || grads.contains(&x) {
            continue;
        }
        let below = h.node(x).inputs.first().copied();
        if !h.remove_if_unused(x) {
            continue;
        }
        dropped.insert(x);
        if let Some(b) = below.filter(|&b| matches!(h.node(b).op, Op::Reshape { .. })) {
            stack.push(b);
        }
    }
    if !dropped.is_empty() {
        let order: Vec<NodeId> = h.node_ids().collect();
        h = h.reordered(&order);
    }
    Ok((h, stored))
}

/// Whether the f32 result of `n`, a backward-pass elementwise op that computes in f32
/// (`exp`, `log`, ...), is stored only as its 16-bit copy: a tensor-core op reads it (so
/// that copy is made anyway), and every other reader is arithmetic that takes a 16-bit
/// operand as it takes a 16-bit activation (widened as it loads, computing in f32), seen
/// through reshapes and permutes (not an output's). The attention probabilities the
/// backward pass rebuilds are the case: `pᵀ do`'s operand, and a factor of
/// `p (dp - rowsum(do o))`, whose `dp` is itself a 16-bit matmul result and whose
/// `rowsum(do o)` is f32 (so that product stays f32). Storing `p` once in 16 bits, by the
/// kernel that makes it, saves the f32 copy (gpt: 96 MiB at the peak) and the kernel that
/// rounds it. Forward values keep f32 where a non-tensor-core op reads them (an arithmetic
/// reader whose other operands are 16-bit or literals would compute a 16-bit result from
/// the copy, as autocast does not), but for the activations of [`forward_16_bit`], whose
/// arithmetic readers stay f32; reductions, comparisons and the interface (`kept`) keep
/// reading f32.
fn stored_16_bit(g: &Graph, n: NodeId, kept: &BTreeSet<NodeId>) -> bool {
    let node = g.node(n);
    let f32_op = matches!(node.op, Op::Unary(_)) && precision(&node.op) == Precision::Full;
    if !node.backward || !f32_op || node.ty.dtype != DType::F32 || kept.contains(&n) {
        return false;
    }
    let mut tensor_core = false;
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        for u in g.users(x) {
            let reader = g.node(u);
            match &reader.op {
                Op::Reshape { .. } | Op::Permute { .. } if !kept.contains(&u) => stack.push(u),
                Op::MatMul | Op::Conv2d { .. } | Op::Conv2dGradInput { .. } => tensor_core = true,
                // Arithmetic (a comparison keeps the f32 value: [`sign_test_copy`] says
                // which ones may test the 16-bit copy).
                op if (matches!(op, Op::Unary(_)) || arithmetic(op))
                    && precision(op) == Precision::Widest
                    && !kept.contains(&u) => {}
                Op::Where if reader.inputs.first() != Some(&x) && !kept.contains(&u) => {}
                _ => return false,
            }
        }
    }
    tensor_core
}

/// Binary arithmetic that computes a value from its operands (not a comparison).
fn arithmetic(op: &Op) -> bool {
    matches!(
        op,
        Op::Binary(
            BinaryOp::Add
                | BinaryOp::Sub
                | BinaryOp::Mul
                | BinaryOp::Div
                | BinaryOp::Maximum
                | BinaryOp::Minimum
        )
    )
}

/// Whether the f32 result of `n`, a forward elementwise op of the `Widest` row (an
/// activation: the cnn's `relu` after a batch norm, whose statistics keep it f32), is
/// stored only as its 16-bit copy, as autocast stores a 16-bit network's activations: a
/// tensor-core op reads it (so the copy is made anyway), an arithmetic op reads it too
/// (otherwise the copy is all that is stored already), and every other reader, seen
/// through reshapes and permutes, still computes what it did from the rounded value:
/// arithmetic whose other operands are f32 values (`dtypes`, the policy's first pass; not
/// literals, so the result stays f32: a residual sum), or a strict sign test against 0
/// (relu's mask, which [`sign_test_copy`] already points at the copy). The f32 activation
/// then never lives past its kernel: where the backward pass rebuilds a later activation
/// from it (a residual block's output from the block's input), it reads the copy.
fn forward_16_bit(
    g: &Graph,
    n: NodeId,
    kept: &BTreeSet<NodeId>,
    dtypes: &BTreeMap<NodeId, DType>,
) -> bool {
    use crate::ir::BinaryOp::{Gt, Lt};
    let node = g.node(n);
    if node.backward
        || !node.op.is_elementwise()
        || precision(&node.op) != Precision::Widest
        || dtypes.get(&n) != Some(&DType::F32)
        || kept.contains(&n)
    {
        return false;
    }
    let f32_value = |o: NodeId| !adopts(&g.node(o).op) && dtypes.get(&o) == Some(&DType::F32);
    let (mut tensor_core, mut residual) = (false, false);
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        for u in g.users(x) {
            let reader = g.node(u);
            let others_f32 = || {
                reader
                    .inputs
                    .iter()
                    .filter(|&&o| o != x)
                    .all(|&o| f32_value(o))
            };
            match &reader.op {
                // A product reads the 16-bit copy (a weight gradient, the param's gradient
                // the interface names, rounds its operands to it).
                Op::MatMul | Op::Conv2d { .. } | Op::Conv2dGradInput { .. } => tensor_core = true,
                Op::Conv2dGradWeight { .. } => {}
                _ if kept.contains(&u) => return false,
                Op::Reshape { .. } | Op::Permute { .. } => stack.push(u),
                Op::Binary(Gt | Lt)
                    if reader.backward
                        && reader.inputs.first() == Some(&x)
                        && reader.inputs.get(1).is_some_and(|&z| {
                            matches!(g.node(z).op, Op::Literal { value, .. }
                                if value == crate::ir::types::Scalar::Float(0.0))
                        }) => {}
                op if arithmetic(op)
                    && precision(op) == Precision::Widest
                    && !reader.inputs.iter().all(|&o| o == x)
                    && others_f32() =>
                {
                    residual = true
                }
                _ => return false,
            }
        }
    }
    tensor_core && residual
}

/// The 16-bit copy to compare instead, where `node` is a backward-pass strict sign test
/// of an f32 value (`x > 0` or `x < 0`: relu's mask) and a reader that takes 16-bit
/// operands (a convolution, a matmul) makes that value's `low` copy anyway (made here, with
/// that reader's marks, if this test comes first). A strict test of the rounded value
/// holds only where it holds of the value: it differs only for magnitudes below half the
/// 16-bit dtype's smallest subnormal (bf16: 5e-41; f16: 3e-8), which round to 0, as
/// autocast's 16-bit activations do. (`>=` and `<=` are left alone: a tiny negative value
/// rounds to -0, and `-0 >= 0` holds.)
fn sign_test_copy(
    g: &Graph,
    node: &crate::ir::Node,
    (new_ins, ins): (&[NodeId], &[NodeId]),
    h: &mut Graph,
    casts: &mut BTreeMap<(NodeId, DType), NodeId>,
    low: DType,
) -> Result<Option<NodeId>, TypeError> {
    use crate::ir::BinaryOp::{Gt, Lt};
    if !node.backward || !matches!(node.op, Op::Binary(Gt | Lt)) || node.inputs.len() != 2 {
        return Ok(None);
    }
    let zero = matches!(g.node(node.inputs[1]).op,
        Op::Literal { value, .. } if value == crate::ir::types::Scalar::Float(0.0));
    let (Some(&x), Some(&old)) = (ins.first(), node.inputs.first()) else {
        return Ok(None);
    };
    if !zero || new_ins.first() != Some(&x) || h.ty(x).dtype != DType::F32 {
        return Ok(None);
    }
    // The copy's marks are its first reader's: a forward one where there is one.
    let readers: Vec<NodeId> = g
        .users(old)
        .into_iter()
        .filter(|&u| {
            matches!(
                precision(&g.node(u).op),
                Precision::Low | Precision::Rounded
            )
        })
        .collect();
    let reader = readers
        .iter()
        .copied()
        .find(|&u| !g.node(u).backward)
        .or_else(|| readers.first().copied());
    match reader {
        Some(u) => cast(h, casts, x, low, g.node(u)).map(Some),
        None => Ok(None),
    }
}

/// A matmul's left operand `x` as `to`. Where `x` is a computed value seen through a swap
/// of its last two axes, the value is cast and the cast is swapped: both tensor-core paths
/// read a left operand contiguous along its rows as it lies (wgmma's MN-major tiles,
/// `mma.sync`'s `[k][row]` tiles), so no kernel transposes it (a transposing copy reads
/// across rows: 0.21 ms a layer for gpt's attention probabilities on an H100). Below the
/// swap, reshapes are looked through for a cast the backward pass already made (the loss's
/// logit gradient, cast for the input gradient and read swapped by the weight gradient):
/// that cast is reshaped and swapped, so the value is cast once.
///
/// Params, inputs and state keep their transposed copies (a weight's is made once a step);
/// right operands keep theirs (`mma.sync` reads a right operand contiguous along `k` only
/// element by element).
fn cast_lhs(
    h: &mut Graph,
    casts: &mut BTreeMap<(NodeId, DType), NodeId>,
    x: NodeId,
    to: DType,
    at: &crate::ir::Node,
    swapped: &mut Vec<NodeId>,
) -> Result<NodeId, TypeError> {
    if let Some(&c) = casts.get(&(x, to)).filter(|&&c| reusable(h, c, x, at)) {
        return Ok(c);
    }
    let node = h.node(x).clone();
    let swaps_last_two = crate::passes::transpose_matmuls::is_swap(h, x);
    let Some(&src) = node.inputs.first().filter(|_| swaps_last_two) else {
        return cast(h, casts, x, to, at);
    };
    if is_param_view(h, src) || h.ty(src).dtype != DType::F32 {
        return cast(h, casts, x, to, at);
    }
    // A cast of `src` seen through reshapes, made in the same pass (forward or backward: a
    // forward copy is not kept alive for the backward pass), and the reshapes above it.
    let mut chain = Vec::new();
    let mut y = src;
    let found = loop {
        match casts.get(&(y, to)) {
            Some(&c) if at.backward == h.node(c).backward => break Some(c),
            _ => {}
        }
        match (&h.node(y).op, h.node(y).inputs.first()) {
            (Op::Reshape { .. }, Some(&below)) => {
                chain.push(y);
                y = below;
            }
            _ => break None,
        }
    };
    let mut c = match found {
        Some(c) => c,
        None if casts.contains_key(&(src, to)) => {
            chain.clear();
            let c = h.add(Op::Cast { to }, vec![src], at.span, at.checkpoint)?;
            copy_marks(h, c, at);
            recomputed_with(h, c, src);
            c
        }
        None => {
            chain.clear();
            cast(h, casts, src, to, at)?
        }
    };
    for &v in chain.iter().rev() {
        let op = h.node(v).op.clone();
        c = h.add(op, vec![c], at.span, at.checkpoint)?;
        copy_marks(h, c, at);
    }
    let y = h.add(node.op.clone(), vec![c], at.span, at.checkpoint)?;
    copy_marks(h, y, at);
    casts.insert((x, to), y);
    swapped.push(x);
    Ok(y)
}

/// Whether reader `at` may read `c`, the cast of `x` made first: yes, but for a weight's
/// forward copy read in the backward pass, which casts the weight again there rather than
/// keep the forward's copy alive across the turn (the f32 weight is persistent, so the
/// second copy costs no memory but its own bytes while its reader runs: the cnn's 16-bit
/// conv weights, 16 MiB at its bf16 peak; gpt's recomputed fc1 products, 12 copies,
/// 54 MiB). An input's copy made in the forward pass is kept for the backward pass's
/// products instead: the f32 input would otherwise live until then, at twice the bytes (a
/// recomputed reader still casts an input again: it reads the f32 input anyway). Nor is a widening of a
/// 16-bit value to f32 made in the forward pass read in the backward pass, or one made for
/// another reader read by a weight gradient: the reader widens as it loads, in its own
/// kernel (a shared widening would be stored in f32 between the two, and a weight
/// gradient reading it would leave the tensor cores).
fn reusable(h: &Graph, c: NodeId, x: NodeId, at: &crate::ir::Node) -> bool {
    let widening = h.ty(c).dtype == DType::F32 && h.ty(x).dtype != DType::F32;
    if widening && ((at.backward && !h.node(c).backward) || precision(&at.op) == Precision::Rounded)
    {
        return false;
    }
    if h.node(c).backward {
        return true;
    }
    let persistent = matches!(
        leaf_of_view(h, x),
        Some(Op::Param { .. } | Op::State { .. })
    );
    if at.recomputed.is_some() {
        return !is_param_view(h, x);
    }
    !(at.backward && persistent)
}

/// `x` as `to`, one cast per value and dtype, carrying the marks of the node that first
/// needs it (see [`reusable`]).
fn cast(
    h: &mut Graph,
    casts: &mut BTreeMap<(NodeId, DType), NodeId>,
    x: NodeId,
    to: DType,
    at: &crate::ir::Node,
) -> Result<NodeId, TypeError> {
    if let Some(&c) = casts.get(&(x, to)).filter(|&&c| reusable(h, c, x, at)) {
        return Ok(c);
    }
    let c = h.add(Op::Cast { to }, vec![x], at.span, at.checkpoint)?;
    copy_marks(h, c, at);
    recomputed_with(h, c, x);
    // A weight gradient's widening is its own (see [`reusable`]): not offered to others.
    let widening = to == DType::F32 && h.ty(x).dtype != DType::F32;
    if !(widening && precision(&at.op) == Precision::Rounded) {
        casts.insert((x, to), c);
    }
    Ok(c)
}

/// Marks cast `c` of `x` recomputed where `x` is: the 16-bit copy of a recomputed value is
/// part of its recomputation (what the backward product reads, so what fusion must store
/// in a kernel of its shape).
fn recomputed_with(h: &mut Graph, c: NodeId, x: NodeId) {
    if let Some(of) = h.node(x).recomputed {
        h.mark_recomputed(c, of);
    }
}

/// The marks of `node` on its rebuilt copy `id`: [`copy_marks`], and a recomputed forward
/// value stays one (so fusion stores it in a backward kernel of its shape and free
/// recomputation weighs it). A cast takes only its reader's [`copy_marks`], and is
/// recomputed where its operand is ([`recomputed_with`]).
fn rebuilt_marks(h: &mut Graph, id: NodeId, node: &crate::ir::Node) {
    copy_marks(h, id, node);
    if let Some(of) = node.recomputed {
        h.mark_recomputed(id, of);
    }
}

fn copy_marks(h: &mut Graph, id: NodeId, like: &crate::ir::Node) {
    if like.backward {
        h.mark_backward(id);
    }
    if let Some(b) = like.block {
        h.set_block(id, b);
    }
    if let Some(m) = like.micro_batch {
        h.set_micro_batch(id, m);
    }
}

/// The step's numerics: mixed precision (`--amp`), loss scaling (`--loss-scale`) and the
/// finite check of the updated params (`--no-finite-check`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Amp {
    /// The 16-bit dtype (bf16 or f16); `None`: the program's own dtypes.
    pub dtype: Option<DType>,
    /// Dynamic loss scaling of `train` (on by default for f16).
    pub loss_scale: Option<crate::autodiff::scale::LossScale>,
    /// `--no-finite-check`: no in-step check that the params `train` updates stay finite
    /// ([`crate::autodiff::expand_data_parallel`]). Loss scaling has its own.
    pub no_finite_check: bool,
}

impl Amp {
    /// `--amp NAME` (`off`, `bf16` or `f16`) with its default loss scaling.
    pub fn named(name: &str) -> Option<Amp> {
        if name == "off" {
            return Some(Amp::default());
        }
        let dtype = low_dtype(name)?;
        Some(Amp {
            dtype: Some(dtype),
            loss_scale: (dtype == DType::F16).then(Default::default),
            no_finite_check: false,
        })
    }

    /// The step `g` under this setting: the policy applied, or `g` as it is when off.
    pub fn apply_to(&self, g: &Graph) -> Result<Graph, TypeError> {
        match self.dtype {
            Some(low) => apply(g, low),
            None => Ok(g.clone()),
        }
    }

    /// `bf16`, `f16` or `off`.
    pub fn name(&self) -> &'static str {
        match self.dtype {
            Some(d) => d.name(),
            None => "off",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::BinaryOp;

    /// An `exp` that a matmul reads and an elementwise op reads beside it is stored only as
    /// its 16-bit copy, which both read (the recomputed attention probabilities); one that a
    /// reduction also reads, or that is an output, keeps its f32 value for them.
    #[test]
    fn an_f32_result_a_matmul_reads_is_stored_16_bit_where_every_reader_takes_it() {
        let mut g = crate::front::test_graph(
            "model t {
                input x: f32[4, 8]
                input w: f32[8, 8]
                input d: f32[4, 8]
                let p = exp(x)
                output y = p @ w
                output z = sum(p * d)
                let q = exp(d)
                output u = q @ w
                output s = sum(q)
                let r = exp(w)
                output v = x @ r
                output r = r
            }",
        );
        // In the forward pass the rule leaves them alone: `p`'s product reads it in f32.
        let forward = apply(&g, DType::BF16).unwrap_or_else(|e| panic!("{e:?}"));
        let p = forward
            .node_ids()
            .find(|&n| forward.node(n).op == Op::Unary(UnaryOp::Exp));
        let f32_readers = p.map_or(0, |p| {
            let users = forward.users(p);
            users
                .iter()
                .filter(|&&u| !matches!(forward.node(u).op, Op::Cast { .. }))
                .count()
        });
        assert_eq!(f32_readers, 1, "the forward p * d reads p in f32");
        // The three `exp`s play the backward pass.
        let marked: Vec<NodeId> = g
            .node_ids()
            .filter(|&n| g.node(n).op == Op::Unary(UnaryOp::Exp))
            .collect();
        for &n in &marked {
            g.mark_backward(n);
        }
        let h = apply(&g, DType::BF16).unwrap_or_else(|e| panic!("{e:?}"));
        let exps: Vec<NodeId> = h
            .node_ids()
            .filter(|&n| h.node(n).op == Op::Unary(UnaryOp::Exp))
            .collect();
        assert_eq!(exps.len(), 3);
        let readers = |n: NodeId| -> Vec<Op> {
            let mut ops: Vec<Op> = h.users(n).iter().map(|&u| h.node(u).op.clone()).collect();
            ops.sort_by_key(|o| format!("{o:?}"));
            ops
        };
        // p: read only through its bf16 copy, by the matmul and the product.
        assert_eq!(readers(exps[0]), [Op::Cast { to: DType::BF16 }]);
        let copy = h.users(exps[0])[0];
        let copy_readers = readers(copy);
        assert!(copy_readers.contains(&Op::MatMul), "{copy_readers:?}");
        // q: its sum reads the f32 value.
        assert!(readers(exps[1])
            .iter()
            .any(|o| matches!(o, Op::Reduce { .. })));
        // r: an output keeps its f32 value.
        assert!(h.outputs.iter().any(|(_, o)| *o == exps[2]));
    }

    /// In the backward pass, `x > 0` of an f32 value a matmul also reads tests the matmul's
    /// bf16 copy; `x >= 0` keeps the f32 value (a tiny negative rounds to -0, and
    /// `-0 >= 0` holds), and so does a test in the forward pass.
    #[test]
    fn only_strict_backward_sign_tests_read_the_16_bit_copy() {
        let mut g = crate::front::test_graph(
            "model t {
                input x: f32[4, 8]
                input w: f32[8, 8]
                let s = exp(x)
                output y = s @ w
                output gt = where(s > 0.0, 1.0, 0.0)
                output ge = where(s >= 0.0, 1.0, 0.0)
                output fwd = where(s > 0.0, 2.0, 0.0)
            }",
        );
        let tests: Vec<NodeId> = g
            .node_ids()
            .filter(|&n| matches!(g.node(n).op, Op::Binary(BinaryOp::Gt | BinaryOp::Ge)))
            .collect();
        // The first two tests play the backward pass.
        for &n in &tests[..2] {
            g.mark_backward(n);
        }
        let h = apply(&g, DType::BF16).unwrap_or_else(|e| panic!("{e:?}"));
        let read = |op: BinaryOp, backward: bool| -> Vec<DType> {
            h.node_ids()
                .filter(|&n| h.node(n).op == Op::Binary(op) && h.node(n).backward == backward)
                .map(|n| h.ty(h.node(n).inputs[0]).dtype)
                .collect()
        };
        assert_eq!(read(BinaryOp::Gt, true), [DType::BF16]);
        assert_eq!(read(BinaryOp::Ge, true), [DType::F32]);
        assert_eq!(read(BinaryOp::Gt, false), [DType::F32]);
    }
}
