//! Micro-batching (`--micro-batches K`): a `train` step's batch computed as K slices, one
//! after another, inside one compiled step, so only one slice's activations are live at a
//! time; the gradients of the slices add up (in place, as each slice's are ready) and the
//! optimizer runs once.
//!
//! The model is lowered twice: at its batch `B` (the constant that sizes the most inputs'
//! first axis) and at `B/K`. The two graphs must have the same nodes, differing at most in
//! shapes and fill values (E0542 otherwise: a condition, index or attribute computed from
//! the batch size); a node whose shape differs between them carries the batch (on exactly
//! one axis, `K` times longer in the first). The step built here is the first graph with
//! every such node replaced by K copies of the second graph's node, each reading its own
//! slice of the inputs:
//!
//! - a node that carries the batch takes the slice-sized op (its shapes), its fill value
//!   from the whole batch's (`x / B` still divides by `B`);
//! - a node that does not carry the batch but reads one that does combines the samples:
//!   a `sum` or `mean` over the batch axis, or a matmul contracting it (a sum). It is
//!   computed per slice and the K results combined (`mean` as the mean of the slices'
//!   means: the slices are equal), which is exact;
//! - every other node is the whole batch's, computed once.
//!
//! A value that combines the samples and is then read back by per-sample values (a batch
//! norm's statistics) would make the slices run in lockstep, so nothing would be saved:
//! that is an error naming the op, as are ops that would mix samples across slices (a
//! slice or concat along the batch axis, `arange` over it, a reshape that makes the batch
//! a minor axis) or pick particular samples (an index into the batch, a `max` or `min`
//! over it, whose gradient at a tie between slices would differ from the whole batch's). Outputs that carry the batch are the slices' results concatenated.
//! Each slice's dropout draws its own mask (the seed mixed with the slice number), so a
//! step with dropout differs from the whole batch's in its draws, not in distribution.
//! Each slice's nodes are marked with its number ([`crate::ir::Node::micro_batch`]); the
//! schedule runs the slices in order (`passes/schedule.rs`).
//!
//! [`compile_step`] splits the same way a region of a whole-batch step alone: its loss head
//! (see there), with the rest of the step on the whole batch.

use super::{compile, ModelSelection, Options, Sources};
use crate::ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, Scalar, TrainSpec};
use std::collections::{BTreeMap, BTreeSet};
use tcc_grammar::ast::{DimExpr, ExprKind, Item, StmtKind};
use tcc_grammar::diag::Diagnostic;
use tcc_grammar::span::{FileId, Span};

/// The front end with `--micro-batches k`: lowers the selected model at its batch and at
/// `batch / k` and builds the split step (see the module doc). `k` of 1 is [`compile`].
pub fn compile_micro_batched(
    sources: &mut Sources,
    opts: &Options,
    k: usize,
) -> Result<super::Lowered, Vec<Diagnostic>> {
    let mut whole = compile(sources, opts)?;
    if k <= 1 {
        return Ok(whole);
    }
    if whole.graphs.len() != 1 {
        return Err(vec![Diagnostic::error(
            "E0540",
            "`--micro-batches` applies to one model: pick it with `--model NAME`",
        )]);
    }
    let full = whole.graphs.remove(0);
    let (name, input, span) = batch_const(sources, &full)?;
    let batch = batch_size(&full, &input);
    if batch == 0 || !batch.is_multiple_of(k) {
        return Err(vec![Diagnostic::error(
            "E0541",
            format!("`--micro-batches {k}` does not divide the batch `{name}` = {batch}"),
        )
        .with_primary(span, "the batch is this input's first axis")
        .with_note(format!(
            "each of the {k} micro-batches must hold the same number of samples; pick a \
             divisor of {batch}, or size the batch with `--set {name}=…`"
        ))]);
    }
    let mut slice_opts = opts.clone();
    slice_opts
        .sets
        .push((name.clone(), (batch / k).to_string()));
    slice_opts.models = ModelSelection::One(Some(full.name.clone()));
    let at = format!(
        "while lowering `{}` at `{name}` = {} for `--micro-batches {k}` (the batch is {batch})",
        full.name,
        batch / k
    );
    let mut sliced = compile(sources, &slice_opts).map_err(|ds| {
        ds.into_iter()
            .map(|d| d.with_note(at.clone()))
            .collect::<Vec<_>>()
    })?;
    let Some(part) = sliced.graphs.pop() else {
        return Err(vec![internal("the sliced model did not lower")]);
    };
    let graph = split(&full, &part, k, &name)?;
    Ok(super::Lowered {
        graphs: vec![graph],
        warnings: whole.warnings,
    })
}

/// The fewest rows of the loss head's product a chunk keeps (smaller products lose more
/// of the GPU to their edges than the memory is worth).
const MIN_CHUNK_ROWS: usize = 256;
/// The most chunks the loss head is computed in by default.
const MAX_CHUNKS: usize = 4;
/// A loss head is chunked by default where its product is at least this many times the
/// bytes of the per-sample value it reads (a vocabulary's logits against the hidden
/// states), and at least [`MIN_HEAD_BYTES`].
const MIN_GROWTH: usize = 4;
const MIN_HEAD_BYTES: usize = 1 << 20;

/// The front end of a step: [`compile_micro_batched`] with `micro_batches` over 1, else the
/// program with its loss head computed in chunks (`loss_chunks`: `None` chooses, `Some(1)`
/// keeps the head whole, `Some(k)` asks for `k` chunks).
///
/// The loss head is the largest of the last products of a weight (a param, through views)
/// that the loss of a `train` step depends on (no other such product lies between it and
/// the loss: a transformer's fc1 is not one, however small `V`), where its result carries
/// the batch and grows it (a language model's logits, `[B, T, V]` from `[B, T, D]`), with
/// every per-sample value
/// computed from it down to the loss (softmax, cross-entropy). It is
/// split as `--micro-batches` splits a whole step, but alone: the rest of the step runs
/// on the whole batch, each chunk reads its slice of the head's operand, and its
/// gradients are made as soon as the chunk's loss terms are (the schedule runs each
/// chunk's forward and backward together, `passes/schedule.rs`), so only one chunk's
/// logits are live at a time. The result is the same but for the order of the loss's
/// sum. By default the head is chunked where it is at least [`MIN_GROWTH`] times its
/// operand and [`MIN_HEAD_BYTES`], into the most chunks (at most [`MAX_CHUNKS`]) that
/// divide the batch and keep [`MIN_CHUNK_ROWS`] rows each, and not where it draws random
/// numbers (dropout's masks would be drawn per chunk).
pub fn compile_step(
    sources: &mut Sources,
    opts: &Options,
    micro_batches: usize,
    loss_chunks: Option<usize>,
) -> Result<super::Lowered, Vec<Diagnostic>> {
    if micro_batches > 1 || loss_chunks == Some(1) {
        if loss_chunks.is_some_and(|c| c > 1) {
            return Err(vec![Diagnostic::error(
                "E0547",
                "`--loss-chunks` and `--micro-batches` do not combine: each micro-batch \
                 already computes its own slice of the loss head",
            )]);
        }
        return compile_micro_batched(sources, opts, micro_batches);
    }
    let mut whole = compile(sources, opts)?;
    match chunked_head(sources, opts, &whole, loss_chunks) {
        Ok(Some(g)) => whole.graphs = vec![g],
        Ok(None) => {}
        Err(d) if loss_chunks.is_some() => return Err(d),
        // Chosen by default: where the head cannot be split, it stays whole.
        Err(_) => {}
    }
    Ok(whole)
}

/// The step with its loss head in chunks (see [`compile_step`]), or `None` where it is
/// kept whole.
fn chunked_head(
    sources: &mut Sources,
    opts: &Options,
    whole: &super::Lowered,
    want: Option<usize>,
) -> Result<Option<Graph>, Vec<Diagnostic>> {
    let refuse = |why: &str| -> Result<Option<Graph>, Vec<Diagnostic>> {
        match want {
            Some(k) => Err(vec![Diagnostic::error(
                "E0548",
                format!("`--loss-chunks {k}` cannot split this program's loss head: {why}"),
            )]),
            None => Ok(None),
        }
    };
    let [full] = whole.graphs.as_slice() else {
        return refuse("it applies to one model: pick it with `--model NAME`");
    };
    let Some(train) = &full.train else {
        return refuse("the program has no `train` statement");
    };
    let order = full
        .topo_order()
        .ok_or_else(|| vec![internal("the lowered graph has a cycle")])?;
    // What the loss depends on.
    let mut feeds: BTreeSet<NodeId> = BTreeSet::from([train.loss]);
    for &n in order.iter().rev() {
        if feeds.contains(&n) {
            feeds.extend(full.node(n).inputs.iter().copied());
        }
    }
    // A product of a weight (a param, seen through views): attention's scores are not a
    // head.
    let weighs = |n: NodeId| {
        full.node(n)
            .inputs
            .iter()
            .any(|&i| matches!(full.node(full.view_root(i)).op, Op::Param { .. }))
    };
    // The last products of a weight before the loss: no other one lies between them and
    // it (a transformer's fc1 is not one, whatever its size); of those, the largest.
    let product = |n: NodeId| full.node(n).op == Op::MatMul && feeds.contains(&n) && weighs(n);
    let mut before_product: BTreeSet<NodeId> = BTreeSet::new();
    for &n in order.iter().rev() {
        if feeds.contains(&n) && (product(n) || before_product.contains(&n)) {
            before_product.extend(full.node(n).inputs.iter().copied());
        }
    }
    let head = order
        .iter()
        .copied()
        .filter(|&n| product(n) && !before_product.contains(&n))
        .max_by_key(|&n| (full.ty(n).size_bytes(), std::cmp::Reverse(n)));
    let Some(head) = head else {
        return refuse("the loss is computed from no product with a weight");
    };
    if want.is_none() {
        // Before lowering the program again: the head against its other operand.
        let operand = full
            .node(head)
            .inputs
            .iter()
            .filter(|&&i| !matches!(full.node(full.view_root(i)).op, Op::Param { .. }))
            .map(|&i| full.ty(i).size_bytes())
            .max()
            .unwrap_or(0);
        let bytes = full.ty(head).size_bytes();
        if bytes < MIN_HEAD_BYTES || bytes < MIN_GROWTH * operand {
            return Ok(None);
        }
    }
    let (name, input, _) = batch_const(sources, full).map_err(as_loss_chunks)?;
    let batch = batch_size(full, &input);
    let dims = full.ty(head).dims();
    let rows = dims[..dims.len().saturating_sub(1)]
        .iter()
        .product::<usize>();
    let k = match want {
        Some(k) if k > 0 && batch > 0 && batch.is_multiple_of(k) => k,
        Some(k) => {
            return Err(vec![Diagnostic::error(
                "E0541",
                format!("`--loss-chunks {k}` does not divide the batch `{name}` = {batch}"),
            )])
        }
        None => match (2..=MAX_CHUNKS)
            .rev()
            .find(|&k| batch.is_multiple_of(k) && rows / k >= MIN_CHUNK_ROWS)
        {
            Some(k) => k,
            None => return Ok(None),
        },
    };
    let mut slice_opts = opts.clone();
    slice_opts
        .sets
        .push((name.clone(), (batch / k).to_string()));
    slice_opts.models = ModelSelection::One(Some(full.name.clone()));
    let Some(part) = compile(sources, &slice_opts)?.graphs.pop() else {
        return Err(vec![internal("the sliced model did not lower")]);
    };
    let (order, carries) = carriers(full, &part, k, &name).map_err(as_loss_chunks)?;
    if !carries.contains_key(&head) {
        return refuse("its last product with a weight does not carry the batch");
    }
    // The head and every per-sample value computed from it.
    let mut region: BTreeSet<NodeId> = BTreeSet::from([head]);
    for &n in &order {
        if carries.contains_key(&n) && full.node(n).inputs.iter().any(|i| region.contains(i)) {
            region.insert(n);
        }
    }
    if full.outputs.iter().any(|(_, v)| region.contains(v)) {
        return refuse("a per-sample value of the head is an output of the step");
    }
    if region
        .iter()
        .any(|&n| matches!(full.node(n).op, Op::Dropout { .. }))
    {
        return refuse("it draws random numbers (dropout), which would be drawn per chunk");
    }
    let mut g = split_region(full, &part, k, &name, &order, &carries, Some(&region))
        .map_err(as_loss_chunks)?;
    g.loss_chunks = Some(k);
    Ok(Some(g))
}

/// The first axis of the input named `input` (0 where there is none).
fn batch_size(full: &Graph, input: &str) -> usize {
    full.inputs
        .iter()
        .find(|&&i| matches!(&full.node(i).op, Op::Input { name: n, .. } if n == input))
        .and_then(|&i| full.ty(i).dims().first().copied())
        .unwrap_or(0)
}

/// The diagnostics of the split that micro-batching shares, worded for `--loss-chunks`.
fn as_loss_chunks(ds: Vec<Diagnostic>) -> Vec<Diagnostic> {
    let reword = |t: &str| t.replace("`--micro-batches`", "`--loss-chunks`");
    ds.into_iter()
        .map(|mut d| {
            d.message = reword(&d.message);
            d.notes = d.notes.iter().map(|n| reword(n)).collect();
            d
        })
        .collect()
}

fn internal(msg: &str) -> Diagnostic {
    Diagnostic::error("E0002", format!("internal compiler error: {msg}"))
}

/// An input's declaration: its name, the constant its first axis names (if it is one), its
/// span and its rank.
type InputDecl = (String, Option<String>, Span, usize);

/// The user's declarations of a model's inputs (the file's only model when `model` is
/// `None`), in order.
fn input_decls(text: &str, file: FileId, model: Option<&str>) -> Vec<InputDecl> {
    let Ok(prog) = tcc_grammar::parse(text, file) else {
        return Vec::new();
    };
    let consts: Vec<String> = prog
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Const(c) => Some(c.name.name.clone()),
            _ => None,
        })
        .collect();
    let models: Vec<_> = prog
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Model(m) if model.is_none_or(|n| m.name.name == n) => Some(m),
            _ => None,
        })
        .collect();
    let [m] = models.as_slice() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for s in &m.body.stmts {
        let StmtKind::Input { name, ty } = &s.kind else {
            continue;
        };
        let first = match ty.dims.as_deref() {
            Some([DimExpr::Expr(e), ..]) => match &e.kind {
                ExprKind::Name(n) if consts.contains(n) => Some(n.clone()),
                _ => None,
            },
            _ => None,
        };
        let rank = ty.dims.as_ref().map_or(0, Vec::len);
        out.push((name.name.clone(), first, s.span, rank));
    }
    out
}

/// The name of the constant that sizes a program's batch (see [`compile_micro_batched`]),
/// if it has one: `tcc fit` tries the micro-batch counts that divide it as it grows.
pub fn batch_name(text: &str, model: Option<&str>) -> Option<String> {
    let decls = input_decls(text, FileId::default(), model);
    most_sized(&decls)
}

/// The constant that sizes the most inputs' first axis; on a tie, the one sizing the
/// input of the highest rank (`x: f32[B, D]` over `w0: f32[D]`), then the earliest.
fn most_sized(decls: &[InputDecl]) -> Option<String> {
    let score = |c: &str| {
        let sized = decls.iter().filter(|d| d.1.as_deref() == Some(c));
        (sized.clone().count(), sized.map(|d| d.3).max().unwrap_or(0))
    };
    let mut best: Option<&str> = None;
    for c in decls.iter().filter_map(|d| d.1.as_deref()) {
        if best.is_none_or(|b| score(c) > score(b)) {
            best = Some(c);
        }
    }
    best.map(str::to_string)
}

/// The constant that sizes the batch ([`most_sized`]), the first input it sizes and that
/// input's span.
fn batch_const(sources: &Sources, full: &Graph) -> Result<(String, String, Span), Vec<Diagnostic>> {
    let decls = input_decls(sources.text(sources.user), sources.user, Some(&full.name));
    most_sized(&decls)
        .and_then(|c| {
            decls
                .iter()
                .find(|d| d.1.as_deref() == Some(c.as_str()))
                .map(|d| (c.clone(), d.0.clone(), d.2))
        })
        .ok_or_else(|| {
            vec![Diagnostic::error(
                "E0540",
                format!(
                    "`--micro-batches` cannot find the batch of `{}`: no input's first axis \
                     is a constant",
                    full.name
                ),
            )
            .with_note(
                "declare the batch as a constant and size the inputs' first axis with it: \
                 `const B = 64`, `input x: f32[B, 784]`",
            )]
        })
}

/// The nodes that carry the batch, and on which axis.
type Carries = BTreeMap<NodeId, Batch>;

/// Where a value carries the batch: its axis, in both graphs.
#[derive(Clone, Copy)]
struct Batch {
    axis: usize,
}

/// The step of `full` (at the whole batch) computed as `k` slices of `part` (the same
/// program at `1/k` of the batch); see the module doc.
pub fn split(full: &Graph, part: &Graph, k: usize, batch: &str) -> Result<Graph, Vec<Diagnostic>> {
    if full.train.is_none() {
        return Err(vec![Diagnostic::error(
            "E0540",
            "`--micro-batches` needs a training step: it splits a `train` step's batch and \
             adds up the gradients, and this program has no `train` statement",
        )]);
    }
    let (order, carries) = carriers(full, part, k, batch)?;
    let mut out = split_region(full, part, k, batch, &order, &carries, None)?;
    out.micro_batches = Some(k);
    Ok(out)
}

/// A program's nodes in order, and which of them carry the batch (on which axis): the
/// nodes whose shape differs between `full` (the whole batch) and `part` (`1/k` of it).
/// Errors where the two lowerings differ in more than shapes.
fn carriers(
    full: &Graph,
    part: &Graph,
    k: usize,
    batch: &str,
) -> Result<(Vec<NodeId>, Carries), Vec<Diagnostic>> {
    let order = full
        .topo_order()
        .ok_or_else(|| vec![internal("the lowered graph has a cycle")])?;
    let differs = |why: String| {
        vec![Diagnostic::error(
            "E0542",
            format!("the batch `{batch}` changes the program's structure ({why})"),
        )
        .with_note(
            "`--micro-batches` needs a program whose ops do not depend on the batch size \
             (no loop or condition over it)",
        )]
    };
    if part.node_count() != full.node_count() {
        return Err(differs(format!(
            "{} ops at the whole batch, {} at a micro-batch",
            full.node_count(),
            part.node_count()
        )));
    }
    for &n in &order {
        let (a, b) = (full.node(n), part.get(n));
        let same = b.is_some_and(|b| a.inputs == b.inputs && same_but_shapes(&a.op, &b.op));
        if !same {
            return Err(vec![Diagnostic::error(
                "E0542",
                format!(
                    "`{}` depends on the batch `{batch}` in more than its shape",
                    a.op.name()
                ),
            )
            .with_primary(
                a.span,
                format!("this differs between the batch and a micro-batch of 1/{k} of it"),
            )
            .with_note(
                "`--micro-batches` needs a program whose ops do not depend on the batch size \
                 (no loop, condition, index or attribute computed from it)",
            )]);
        }
    }
    let err = |n: NodeId, code: &'static str, msg: String, label: &str| {
        split_error(full, batch, n, code, msg, label)
    };
    // Which nodes carry the batch, and on which axis.
    let mut carries: BTreeMap<NodeId, Batch> = BTreeMap::new();
    for &n in &order {
        let (a, b) = (full.ty(n).dims(), part.ty(n).dims());
        if a == b {
            continue;
        }
        let axes: Vec<usize> = (0..a.len().min(b.len()))
            .filter(|&i| a[i] != b[i])
            .collect();
        match axes.as_slice() {
            [ax] if a.len() == b.len() && a[*ax] == b[*ax] * k => {
                carries.insert(n, Batch { axis: *ax });
            }
            [ax] if a.len() == b.len() => {
                return Err(err(
                    n,
                    "E0543",
                    format!(
                        "`{}` makes an axis that does not grow in step with the batch: {} for \
                         the whole batch, {} for a micro-batch",
                        full.node(n).op.name(),
                        full.ty(n),
                        part.ty(n)
                    ),
                    &format!("axis {ax} is not {k} times its micro-batch size"),
                ))
            }
            _ => {
                return Err(err(
                    n,
                    "E0543",
                    format!(
                        "`{}` pairs samples with samples: its result is {} for the whole \
                         batch",
                        full.node(n).op.name(),
                        full.ty(n)
                    ),
                    "this value holds more than one axis that grows with the batch",
                ))
            }
        }
    }
    Ok((order, carries))
}

/// The diagnostic of a node that cannot be split.
fn split_error(
    full: &Graph,
    batch: &str,
    n: NodeId,
    code: &'static str,
    msg: String,
    label: &str,
) -> Vec<Diagnostic> {
    vec![Diagnostic::error(code, msg)
        .with_primary(full.node(n).span, label.to_string())
        .with_note(format!(
            "`--micro-batches` runs the batch `{batch}` as slices of its samples, one \
             after another; an op that mixes samples of different slices cannot be split"
        ))]
}

/// The step of `full` with the nodes of `region` that carry the batch (every such node
/// when `region` is `None`) computed as `k` slices of `part`'s; see the module doc. A
/// node of the region reads a carrying value from outside it through a slice of it.
fn split_region(
    full: &Graph,
    part: &Graph,
    k: usize,
    batch: &str,
    order: &[NodeId],
    carries: &BTreeMap<NodeId, Batch>,
    region: Option<&BTreeSet<NodeId>>,
) -> Result<Graph, Vec<Diagnostic>> {
    let err = |n: NodeId, code: &'static str, msg: String, label: &str| {
        split_error(full, batch, n, code, msg, label)
    };
    let split_here = |n: NodeId| region.is_none_or(|r| r.contains(&n));
    // Values computed from the samples: carried, or combined from carried ones.
    let mut derived: BTreeMap<NodeId, NodeId> = BTreeMap::new(); // value → its combining op
    let blocks = order
        .iter()
        .filter_map(|&n| full.node(n).block)
        .max()
        .map_or(0, |b| b + 1);
    let mut out = Graph::new(full.name.clone());
    let mut whole: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    let mut slices: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    // (carrying value outside the region, slice) → its slice.
    let mut cut: BTreeMap<(NodeId, usize), NodeId> = BTreeMap::new();
    let at = |e: crate::ir::TypeError, n: NodeId| {
        vec![Diagnostic::error(e.code, e.message.clone())
            .with_primary(full.node(n).span, e.detail.clone())]
    };
    for &n in order {
        let node = full.node(n);
        let carried_in: Vec<NodeId> = node
            .inputs
            .iter()
            .copied()
            .filter(|i| slices.contains_key(i))
            .collect();
        if let Some(&Batch { axis }) = carries.get(&n).filter(|_| split_here(n)) {
            check_carrier(full, part, n, carries, axis, &err)?;
            if let Some(&i) = node.inputs.iter().find(|i| derived.contains_key(i)) {
                let source = derived[&i];
                let (at_source, at_reader) = (full.node(source).span, node.span);
                let d = Diagnostic::error(
                    "E0544",
                    format!(
                        "`{}` combines the samples of the batch, and per-sample values read \
                         its result back",
                        full.node(source).op.name()
                    ),
                );
                // One call (a prelude function such as `batch_norm`) may do both.
                let d = if at_source == at_reader {
                    d.with_primary(at_source, "this combines the whole batch and reads it back")
                } else {
                    d.with_primary(at_source, "this combines the whole batch")
                        .with_secondary(at_reader, "and this per-sample value reads it")
                };
                return Err(vec![d.with_note(
                    "with `--micro-batches` every slice would need every other slice's samples \
                     first (a batch norm's statistics do this), so the slices could not run \
                     one after another; train on the whole batch, or normalize over features \
                     (`layer_norm`)",
                )]);
            }
            if let Op::Input { .. } = node.op {
                // The input stays whole (the caller fills it); the slices read it.
                let id = out
                    .add(node.op.clone(), vec![], node.span, None)
                    .map_err(|e| at(e, n))?;
                whole.insert(n, id);
            }
            let mut copies = Vec::with_capacity(k);
            for s in 0..k {
                let id = if let Op::Input { .. } = node.op {
                    let dims = part.ty(n).dims();
                    let ranges = dims
                        .iter()
                        .enumerate()
                        .map(|(i, &d)| if i == 0 { (s * d, (s + 1) * d) } else { (0, d) })
                        .collect();
                    out.add(Op::Slice { ranges }, vec![whole[&n]], node.span, None)
                        .map_err(|e| at(e, n))?
                } else {
                    let op = match (&part.node(n).op, &node.op) {
                        (Op::Full { ty, .. }, Op::Full { value, .. }) => Op::Full {
                            value: *value,
                            ty: ty.clone(),
                        },
                        (Op::Dropout { p, seed }, _) => Op::Dropout {
                            p: *p,
                            seed: mix(*seed, s),
                        },
                        (op, _) => op.clone(),
                    };
                    let mut inputs = Vec::with_capacity(node.inputs.len());
                    for &i in &node.inputs {
                        inputs.push(
                            read(&mut out, i, s, &slices, &whole, carries, part, &mut cut)
                                .map_err(|e| at(e, n))?,
                        );
                    }
                    out.add(op, inputs, node.span, node.checkpoint)
                        .map_err(|e| at(e, n))?
                };
                out.set_micro_batch(id, s as u32);
                if let Some(b) = node.block {
                    out.set_block(id, b + (s as u32) * blocks);
                }
                copies.push(id);
            }
            slices.insert(n, copies);
            continue;
        }
        if !carried_in.is_empty() {
            // Combines the samples: per slice, then across the slices.
            let combine = combining(full, n, carries).ok_or_else(|| {
                err(
                    n,
                    "E0545",
                    format!(
                        "`{}` over the batch cannot be split into micro-batches",
                        node.op.name()
                    ),
                    "this takes particular samples of the whole batch (an index, a max or \
                     min, an argmax), not a sum or mean of them",
                )
            })?;
            let mut acc: Option<NodeId> = None;
            for s in 0..k {
                let mut inputs = Vec::with_capacity(node.inputs.len());
                for &i in &node.inputs {
                    inputs.push(
                        read(&mut out, i, s, &slices, &whole, carries, part, &mut cut)
                            .map_err(|e| at(e, n))?,
                    );
                }
                let id = out
                    .add(part.node(n).op.clone(), inputs, node.span, node.checkpoint)
                    .map_err(|e| at(e, n))?;
                out.set_micro_batch(id, s as u32);
                acc = Some(match acc {
                    None => id,
                    Some(a) => {
                        let c = out
                            .add(Op::Binary(combine), vec![a, id], node.span, node.checkpoint)
                            .map_err(|e| at(e, n))?;
                        out.set_micro_batch(c, s as u32);
                        c
                    }
                });
            }
            let mut id = acc.ok_or_else(|| vec![internal("no micro-batch")])?;
            if matches!(
                node.op,
                Op::Reduce {
                    op: ReduceOp::Mean,
                    ..
                }
            ) {
                let dtype = out.ty(id).dtype;
                let l = out
                    .add(
                        Op::Literal {
                            value: Scalar::Float(1.0 / k as f64),
                            dtype,
                        },
                        vec![],
                        node.span,
                        None,
                    )
                    .map_err(|e| at(e, n))?;
                id = out
                    .add(Op::Binary(BinaryOp::Mul), vec![id, l], node.span, None)
                    .map_err(|e| at(e, n))?;
            }
            derived.insert(n, n);
            whole.insert(n, id);
            continue;
        }
        if let Some(&source) = node.inputs.iter().find_map(|i| derived.get(i)) {
            derived.insert(n, source);
        }
        let inputs = node
            .inputs
            .iter()
            .map(|i| whole.get(i).copied())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| vec![internal("a value outside the split reads one inside it")])?;
        let id = out
            .add(node.op.clone(), inputs, node.span, node.checkpoint)
            .map_err(|e| at(e, n))?;
        if let Some(b) = node.block {
            out.set_block(id, b);
        }
        whole.insert(n, id);
    }
    // Inputs keep their declaration order (they were added in it).
    for (name, v) in &full.outputs {
        let id = match (slices.get(v), carries.get(v)) {
            (Some(c), Some(&Batch { axis })) => out
                .add(Op::Concat { axis }, c.clone(), full.node(*v).span, None)
                .map_err(|e| at(e, *v))?,
            _ => whole[v],
        };
        out.outputs.push((name.clone(), id));
    }
    if let Some(t) = &full.train {
        let Some(&loss) = whole.get(&t.loss) else {
            return Err(err(
                t.loss,
                "E0546",
                "the loss holds a value per sample".to_string(),
                "`train` minimizes this",
            ));
        };
        out.train = Some(TrainSpec {
            optimizer: t.optimizer,
            loss,
            span: t.span,
        });
    }
    Ok(out)
}

/// Slice `s` of value `i` (of `full`) as a split node reads it: its own slice's copy, a
/// slice of a carrying value that is computed whole (an input, or a value outside the
/// region), or the value itself.
#[allow(clippy::too_many_arguments)]
fn read(
    out: &mut Graph,
    i: NodeId,
    s: usize,
    slices: &BTreeMap<NodeId, Vec<NodeId>>,
    whole: &BTreeMap<NodeId, NodeId>,
    carries: &BTreeMap<NodeId, Batch>,
    part: &Graph,
    cut: &mut BTreeMap<(NodeId, usize), NodeId>,
) -> Result<NodeId, crate::ir::TypeError> {
    if let Some(c) = slices.get(&i) {
        return Ok(c[s]);
    }
    let missing = || {
        crate::ir::TypeError::new(
            "E0002",
            "internal compiler error: operand out of order",
            "while splitting the batch",
        )
    };
    let &w = whole.get(&i).ok_or_else(missing)?;
    let Some(&Batch { axis }) = carries.get(&i) else {
        return Ok(w);
    };
    if let Some(&c) = cut.get(&(i, s)) {
        return Ok(c);
    }
    let d = part.ty(i).dims().get(axis).copied().ok_or_else(missing)?;
    let ranges = out
        .ty(w)
        .dims()
        .iter()
        .enumerate()
        .map(|(a, &n)| {
            if a == axis {
                (s * d, (s + 1) * d)
            } else {
                (0, n)
            }
        })
        .collect();
    let span = out.node(w).span;
    let id = out.add(Op::Slice { ranges }, vec![w], span, None)?;
    out.set_micro_batch(id, s as u32);
    cut.insert((i, s), id);
    Ok(id)
}

/// Whether two lowerings of one op differ at most in what the batch size changes: the
/// shapes of inputs, fills, reshapes, broadcasts and `arange`, a slice's ranges (checked
/// further where the value carries the batch), and a literal's or fill's value (the whole
/// batch's is used: `x / B` still divides by `B`).
fn same_but_shapes(a: &Op, b: &Op) -> bool {
    match (a, b) {
        // Shapes: a param or state sized by the batch is refused where it carries it.
        (Op::Input { name: x, .. }, Op::Input { name: y, .. })
        | (Op::State { name: x, .. }, Op::State { name: y, .. }) => x == y,
        (
            Op::Param {
                name: x, init: i, ..
            },
            Op::Param {
                name: y, init: j, ..
            },
        ) => x == y && i == j,
        (Op::Full { .. }, Op::Full { .. })
        | (Op::Literal { .. }, Op::Literal { .. })
        | (Op::Reshape { .. }, Op::Reshape { .. })
        | (Op::BroadcastTo { .. }, Op::BroadcastTo { .. })
        | (Op::Arange { .. }, Op::Arange { .. }) => true,
        (Op::Slice { ranges: x }, Op::Slice { ranges: y }) => x.len() == y.len(),
        _ => a == b,
    }
}

/// A dropout seed for micro-batch `s` (0 keeps it).
fn mix(seed: u64, s: usize) -> u64 {
    seed ^ (s as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// How the slices' results of a node that combines the samples add up, or `None` for a
/// node that does not combine them (it reads samples by place).
fn combining(g: &Graph, n: NodeId, carries: &BTreeMap<NodeId, Batch>) -> Option<BinaryOp> {
    let node = g.node(n);
    let axis_of = |i: usize| carries.get(&node.inputs[i]).map(|b| b.axis);
    match &node.op {
        Op::Reduce { op, axes, .. } => {
            let a = axis_of(0)?;
            if !axes.contains(&a) {
                return None;
            }
            // A max or min over the batch is refused: its value splits exactly, but a tie
            // between micro-batches would take its gradient whole where the whole batch's
            // reduce shares it.
            match op {
                ReduceOp::Sum | ReduceOp::Mean => Some(BinaryOp::Add),
                ReduceOp::Max | ReduceOp::Min => None,
            }
        }
        Op::MatMul => {
            let (a, b) = (g.ty(node.inputs[0]), g.ty(node.inputs[1]));
            let lhs = axis_of(0).is_none_or(|x| x + 1 == a.rank());
            let rhs = axis_of(1).is_none_or(|x| {
                if b.rank() == 1 {
                    x == 0
                } else {
                    x + 2 == b.rank()
                }
            });
            (lhs && rhs).then_some(BinaryOp::Add)
        }
        _ => None,
    }
}

/// The checks on a node that carries the batch on `axis`: nothing in it may mix samples of
/// different slices.
fn check_carrier(
    full: &Graph,
    part: &Graph,
    n: NodeId,
    carries: &BTreeMap<NodeId, Batch>,
    axis: usize,
    err: &dyn Fn(NodeId, &'static str, String, &str) -> Vec<Diagnostic>,
) -> Result<(), Vec<Diagnostic>> {
    let node = full.node(n);
    let name = node.op.name();
    let axis_of = |i: usize| carries.get(&node.inputs[i]).map(|b| b.axis);
    let fail = |label: &str| {
        Err(err(
            n,
            "E0543",
            format!("`{name}` mixes the samples of the batch"),
            label,
        ))
    };
    match &node.op {
        Op::Input { .. } if axis != 0 => fail("the batch must be this input's first axis"),
        Op::Param { .. } | Op::State { .. } => fail("a param sized by the batch"),
        Op::Arange { .. } => fail("this numbers the samples of the whole batch"),
        Op::Slice { ranges } => {
            // All of the batch axis (of the operand), and the same ranges elsewhere.
            let i = node.inputs[0];
            let all =
                |r: &[(usize, usize)], g: &Graph| r.get(axis) == Some(&(0, g.ty(i).dims()[axis]));
            let ok = match &part.node(n).op {
                Op::Slice { ranges: p } => {
                    all(ranges, full)
                        && all(p, part)
                        && (0..ranges.len()).all(|a| a == axis || ranges[a] == p[a])
                }
                _ => false,
            };
            if ok {
                Ok(())
            } else {
                fail("this slices the batch axis, or slices another axis by the batch size")
            }
        }
        Op::Concat { axis: c } if *c == axis => fail("this concatenates along the batch axis"),
        Op::Reshape { .. } => {
            let Some(a) = axis_of(0) else { return Ok(()) };
            let before =
                |g: &Graph, v: NodeId, ax: usize| g.ty(v).dims()[..ax].iter().product::<usize>();
            let i = node.inputs[0];
            if before(part, i, a) == before(part, n, axis) {
                Ok(())
            } else {
                fail("this reshape moves the batch off its place in the order of the elements")
            }
        }
        Op::MatMul => {
            let (a, b) = (full.ty(node.inputs[0]), full.ty(node.inputs[1]));
            let contracts = axis_of(0).is_some_and(|x| x + 1 == a.rank())
                || axis_of(1).is_some_and(|x| {
                    if b.rank() == 1 {
                        x == 0
                    } else {
                        x + 2 == b.rank()
                    }
                });
            if contracts {
                fail("this matmul contracts the batch axis")
            } else {
                Ok(())
            }
        }
        Op::Conv2d { .. } | Op::Pool2d { .. } => {
            if axis_of(0) == Some(0) && (node.inputs.len() < 2 || axis_of(1).is_none()) {
                Ok(())
            } else {
                fail("a convolution's or pooling's batch must be its input's first axis")
            }
        }
        Op::Attention { .. } | Op::Tri { .. } => {
            let ok = (0..node.inputs.len())
                .all(|i| axis_of(i).is_none_or(|x| x + 2 < full.ty(node.inputs[i]).rank()));
            if ok {
                Ok(())
            } else {
                fail("the batch must be one of the leading axes here, not the last two")
            }
        }
        Op::Embedding if axis_of(0).is_some() => fail("a table sized by the batch"),
        Op::Grad => fail("`grad` over a micro-batched step"),
        _ => Ok(()),
    }
}
