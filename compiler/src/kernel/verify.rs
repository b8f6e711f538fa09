//! Verifier of the kernel IR: what fusion produced ([`verify_kernels`]) and how the memory
//! plan lays it out ([`verify_planned`]).
//!
//! The contract it checks (see `fuse.rs` and `analysis::liveness::kernel_liveness`):
//! - buffers are named by graph nodes; a kernel loads a leaf (input, param, state) or a
//!   buffer an EARLIER kernel stored (a kernel never reads what it stores itself, except
//!   the in-place update below); several kernels may store into one buffer (the pieces of a
//!   concat stored in place, a zero fill and the accumulating kernel after it);
//! - an accumulating store (`+=`: scatter, split-K) adds into a buffer an earlier kernel
//!   wrote (its zero fill);
//! - an optimizer update's new value (`g.updates`: `(target, value)`) is stored over its
//!   target's bytes: no kernel after the one that stores it may load the target (that would
//!   read the new value as the old one), and that kernel reads the target only at the index
//!   where it stores the new value, never through a matmul or attention operand;
//! - no kernel stores into a leaf directly; every output and update value is stored by some
//!   kernel (or is a leaf);
//! - every access stays inside its buffer, and loads and stores use the buffer's dtype (a
//!   stored value has the buffer's compute type);
//! - every expression id is a node of the kernel's pool, built after its operands (the
//!   verifier never panics on a malformed pool: it reports it).
//!
//! Index bounds are proved, not guessed: an index that is affine in the loop variables
//! gets its exact range over the domain ([`ExprPool::affine`]); any other index gets a
//! sound interval (clamps, quotients, remainders and argmax results are bounded; values
//! loaded from memory, such as embedding ids before their clamp, are not). An access is
//! reported only when it provably leaves its buffer (exact affine range, or an interval
//! entirely outside); one whose interval cannot be bounded, or is wider than the buffer
//! without being affine, is skipped (counted in [`KernelReport::unproven`]).
//!
//! Not checked: a gather operand's `buf` (the node it views, which may have no buffer: its
//! loads are checked instead); an attention kernel's `o`/`lse` operand strides against its
//! stores (the stores' indices are checked); whether a stored node is in
//! `Fused::materialized` (the plan's buffers are the stored nodes); races between
//! iterations of one kernel (`Kernel::parallel`).
//!
//! Cost: linear in the kernels' expression pools, plus `n log n` in the buffers for the
//! plan's overlap sweep.

use super::{ExprId, ExprPool, Fused, Kernel, Operand, VTy, Var, E};
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op};
use crate::plan::{Plan, ALIGN};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A broken invariant of the kernels or of their memory plan. `kernel` is the kernel's
/// index in launch order, `name` its name; buffers are graph node ids (`%id`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("kernel {kernel} `{name}`: expression #{expr} is not in the kernel's pool ({len} nodes) or refers to a later node")]
    BadExpr {
        kernel: usize,
        name: String,
        expr: usize,
        len: usize,
    },
    #[error("kernel {kernel} `{name}`: {what} names %{buf}, which is no node of the graph")]
    UnknownBuffer {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
    },
    #[error("kernel {kernel} `{name}`: store to %{buf}, an {leaf} (a leaf is written only by the caller or through its update value)")]
    StoreToLeaf {
        kernel: usize,
        name: String,
        buf: usize,
        leaf: &'static str,
    },
    #[error("kernel {kernel} `{name}`: {what} reads %{buf}, which is no input, param or state and which no earlier kernel writes")]
    ReadBeforeWrite {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
    },
    #[error("kernel {kernel} `{name}`: store adds into %{buf}, which no earlier kernel writes (no zero fill before it)")]
    AccumulateUnwritten {
        kernel: usize,
        name: String,
        buf: usize,
    },
    #[error("kernel {kernel} `{name}`: {what} reads %{buf} after kernel {writer} stored its new value %{value} over it")]
    ReadAfterUpdate {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
        value: usize,
        writer: usize,
    },
    #[error("kernel {kernel} `{name}`: {what} reads %{buf} where the kernel does not store its new value %{value} (an in-place update reads only where it writes)")]
    InPlaceHazard {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
        value: usize,
    },
    #[error("kernel {kernel} `{name}`: {what} of %{buf} reaches element {element}, the buffer has {len}")]
    OutOfBounds {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
        store: bool,
        element: i64,
        len: u64,
    },
    #[error("kernel {kernel} `{name}`: {what} of %{buf} uses {found}, the buffer is {expected}")]
    DTypeMismatch {
        kernel: usize,
        name: String,
        buf: usize,
        what: String,
        found: DType,
        expected: DType,
    },
    #[error("kernel {kernel} `{name}`: store {store} to %{buf} writes a {found} value into {dtype} (computed as {expected})")]
    ValueType {
        kernel: usize,
        name: String,
        buf: usize,
        store: usize,
        found: &'static str,
        expected: &'static str,
        dtype: DType,
    },
    #[error("%{buf} ({what}) is stored by no kernel")]
    NeverWritten { buf: usize, what: String },
    #[error("kernel {kernel} `{name}`: %{buf} has no arena offset in the plan")]
    Unplanned {
        kernel: usize,
        name: String,
        buf: usize,
    },
    #[error("kernel {kernel} `{name}`: %{buf} is at offset {offset}, not {ALIGN}-byte aligned")]
    Misaligned {
        kernel: usize,
        name: String,
        buf: usize,
        offset: u64,
    },
    #[error(
        "kernel {kernel} `{name}`: %{buf} spans [{offset}, {end}), past the arena's {arena} bytes"
    )]
    PastArena {
        kernel: usize,
        name: String,
        buf: usize,
        offset: u64,
        end: u64,
        arena: u64,
    },
    #[error("kernel {kernel} `{name}`: %{buf} spans [{offset}, {end}), inside the scratch region [{scratch}, {arena})")]
    InScratch {
        kernel: usize,
        name: String,
        buf: usize,
        offset: u64,
        end: u64,
        scratch: u64,
        arena: u64,
    },
    #[error("kernel {kernel} `{name}`: update value %{buf} is planned at offset {offset}, not over its target %{target} at {target_offset}")]
    UpdateNotInPlace {
        kernel: usize,
        name: String,
        buf: usize,
        offset: u64,
        target: usize,
        target_offset: u64,
    },
    #[error("kernel {kernel} `{name}`: %{buf} stored in place of %{donor}, but {why}")]
    BadInPlace {
        kernel: usize,
        name: String,
        buf: usize,
        donor: usize,
        why: String,
    },
    #[error("kernel {kernel} `{name}`: %{a} [{a_offset}, {a_end}) and %{b} [{b_offset}, {b_end}) are both live and overlap in the arena")]
    Overlap {
        kernel: usize,
        name: String,
        a: usize,
        a_offset: u64,
        a_end: u64,
        b: usize,
        b_offset: u64,
        b_end: u64,
    },
}

/// What [`check_kernels`] found: the errors, and the accesses whose index it could not
/// bound (kernel index, buffer, what), which it skipped.
#[derive(Clone, Debug, Default)]
pub struct KernelReport {
    pub errors: Vec<KernelError>,
    pub unproven: Vec<(usize, NodeId, String)>,
}

/// Checks the kernels of a fusion against its graph (see the module doc).
pub fn verify_kernels(g: &Graph, fused: &Fused) -> Result<(), Vec<KernelError>> {
    let r = check_kernels(g, fused);
    if r.errors.is_empty() {
        Ok(())
    } else {
        Err(r.errors)
    }
}

fn leaf_kind(g: &Graph, n: NodeId) -> Option<&'static str> {
    match g.get(n).map(|x| &x.op) {
        Some(Op::Input { .. }) => Some("input"),
        Some(Op::Param { .. }) => Some("param"),
        Some(Op::State { .. }) => Some("optimizer state"),
        _ => None,
    }
}

/// Bounds `[lo, hi]` of an i64 value; `None` on a side where unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Iv {
    lo: Option<i64>,
    hi: Option<i64>,
}

const UNKNOWN: Iv = Iv { lo: None, hi: None };

fn exact(v: i64) -> Iv {
    Iv {
        lo: Some(v),
        hi: Some(v),
    }
}

/// Calls `f` on each operand of an expression node, in order.
fn for_children(e: &E, f: impl FnMut(ExprId)) {
    crate::kernel::lower::children(e).into_iter().for_each(f);
}

/// Per-kernel analysis of its pool: which nodes are well formed (children before the node,
/// as interning builds them), variable extents, and intervals of the i64 nodes.
struct PoolFacts {
    /// Node `i` and everything below it refer only to earlier nodes of the pool.
    ok: Vec<bool>,
    ext: HashMap<Var, usize>,
    iv: Vec<Iv>,
}

impl PoolFacts {
    fn of(k: &Kernel) -> PoolFacts {
        let pool = &k.pool;
        let n = pool.nodes.len();
        let mut ext: HashMap<Var, usize> = HashMap::new();
        for (i, &d) in k.domain.iter().enumerate() {
            ext.insert(i as Var, d);
        }
        for e in &pool.nodes {
            if let E::Reduce { vars, .. } | E::ArgMax { vars, .. } = e {
                ext.extend(vars.iter().copied());
            }
        }
        if let Some(mm) = &k.matmul {
            for (op, rows, cols) in [(&mm.a, mm.m, mm.k), (&mm.b, mm.k, mm.n)] {
                if let Some(gt) = &op.gather {
                    ext.insert(gt.row, rows);
                    ext.insert(gt.col, cols);
                }
            }
        }
        let mut ok = vec![true; n];
        let mut iv = vec![UNKNOWN; n];
        for i in 0..n {
            let e = &pool.nodes[i];
            // A node needs its type too (`ExprPool::affine` reads it).
            let mut good = i < pool.tys.len();
            for_children(e, |c| {
                let c = c.0 as usize;
                good &= c < i && ok[c];
            });
            ok[i] = good;
            if !good || pool.tys.get(i) != Some(&VTy::I64) {
                continue;
            }
            let get = |x: &ExprId| iv[x.0 as usize];
            let konst = |x: &ExprId| match pool.nodes[x.0 as usize] {
                E::Int(v) => Some(v),
                _ => None,
            };
            iv[i] = match e {
                E::Int(v) => exact(*v),
                E::Var(v) => match ext.get(v).and_then(|&d| last_index(d)) {
                    Some(h) => Iv {
                        lo: Some(0),
                        hi: Some(h),
                    },
                    None => UNKNOWN,
                },
                E::Bin(BinaryOp::Add, a, b) => {
                    let (a, b) = (get(a), get(b));
                    Iv {
                        lo: a.lo.zip(b.lo).and_then(|(x, y)| x.checked_add(y)),
                        hi: a.hi.zip(b.hi).and_then(|(x, y)| x.checked_add(y)),
                    }
                }
                E::Bin(BinaryOp::Sub, a, b) => {
                    let (a, b) = (get(a), get(b));
                    Iv {
                        lo: a.lo.zip(b.hi).and_then(|(x, y)| x.checked_sub(y)),
                        hi: a.hi.zip(b.lo).and_then(|(x, y)| x.checked_sub(y)),
                    }
                }
                E::Bin(BinaryOp::Mul, a, b) => mul(get(a), get(b)),
                E::Bin(BinaryOp::Div, a, b) => match (get(a), konst(b)) {
                    (Iv { lo: Some(l), hi }, Some(c)) if l >= 0 && c > 0 => Iv {
                        lo: Some(l / c),
                        hi: hi.map(|h| h / c),
                    },
                    _ => UNKNOWN,
                },
                E::Bin(BinaryOp::Rem, a, b) => match (get(a), konst(b)) {
                    (Iv { lo: Some(l), hi }, Some(c)) if l >= 0 && c > 0 => match hi {
                        Some(h) if h < c => Iv {
                            lo: Some(l),
                            hi: Some(h),
                        },
                        _ => Iv {
                            lo: Some(0),
                            hi: Some(c - 1),
                        },
                    },
                    // Truncating: |a % c| < |c|.
                    (_, Some(c)) if c != 0 && c != i64::MIN => {
                        let m = c.abs() - 1;
                        Iv {
                            lo: Some(-m),
                            hi: Some(m),
                        }
                    }
                    _ => UNKNOWN,
                },
                E::IMin(a, b) => {
                    let (a, b) = (get(a), get(b));
                    Iv {
                        lo: a.lo.zip(b.lo).map(|(x, y)| x.min(y)),
                        hi: match (a.hi, b.hi) {
                            (Some(x), Some(y)) => Some(x.min(y)),
                            (x, y) => x.or(y),
                        },
                    }
                }
                E::IMax(a, b) => {
                    let (a, b) = (get(a), get(b));
                    Iv {
                        lo: match (a.lo, b.lo) {
                            (Some(x), Some(y)) => Some(x.max(y)),
                            (x, y) => x.or(y),
                        },
                        hi: a.hi.zip(b.hi).map(|(x, y)| x.max(y)),
                    }
                }
                E::Select(_, a, b) => {
                    let (a, b) = (get(a), get(b));
                    Iv {
                        lo: a.lo.zip(b.lo).map(|(x, y)| x.min(y)),
                        hi: a.hi.zip(b.hi).map(|(x, y)| x.max(y)),
                    }
                }
                E::Cast(_, a) if pool.tys.get(a.0 as usize) == Some(&VTy::Bool) => Iv {
                    lo: Some(0),
                    hi: Some(1),
                },
                E::Cast(_, a) if pool.tys.get(a.0 as usize) == Some(&VTy::I64) => get(a),
                E::ArgMax { vars, .. } => {
                    let total = vars
                        .iter()
                        .try_fold(1i64, |acc, &(_, d)| acc.checked_mul(i64::try_from(d).ok()?));
                    match total {
                        Some(t) if t > 0 => Iv {
                            lo: Some(0),
                            hi: Some(t - 1),
                        },
                        _ => UNKNOWN,
                    }
                }
                _ => UNKNOWN,
            };
        }
        PoolFacts { ok, ext, iv }
    }

    fn valid(&self, e: ExprId) -> bool {
        self.ok.get(e.0 as usize).copied().unwrap_or(false)
    }

    /// The exact range of an affine index over the variables' extents.
    fn affine_range(&self, pool: &ExprPool, e: ExprId) -> Option<(i64, i64)> {
        if !self.valid(e) {
            return None;
        }
        let af = pool.affine(e)?;
        let (mut lo, mut hi) = (af.c0, af.c0);
        for &(v, c) in &af.terms {
            let span = c.checked_mul(last_index(*self.ext.get(&v)?)?)?;
            if span < 0 {
                lo = lo.checked_add(span)?;
            } else {
                hi = hi.checked_add(span)?;
            }
        }
        Some((lo, hi))
    }
}

/// The last index `d - 1` of an extent (`None` for an empty or huge one).
fn last_index(d: usize) -> Option<i64> {
    i64::try_from(d).ok()?.checked_sub(1).filter(|&h| h >= 0)
}

fn mul(a: Iv, b: Iv) -> Iv {
    match (a.lo, a.hi, b.lo, b.hi) {
        (Some(p), Some(q), Some(s), Some(t)) => {
            let c = [
                p.checked_mul(s),
                p.checked_mul(t),
                q.checked_mul(s),
                q.checked_mul(t),
            ];
            if c.iter().any(Option::is_none) {
                return UNKNOWN;
            }
            let c = c.map(|x| x.unwrap_or(0));
            Iv {
                lo: c.iter().min().copied(),
                hi: c.iter().max().copied(),
            }
        }
        _ => UNKNOWN,
    }
}

/// Whether an access `[lo, hi]` into `len` elements is proved inside (`Ok(true)`), proved
/// outside (`Err(element)`, the first extreme that leaves), or unknown (`Ok(false)`).
fn bound(facts: &PoolFacts, pool: &ExprPool, e: ExprId, len: u64) -> Result<bool, i64> {
    let len = i64::try_from(len).unwrap_or(i64::MAX);
    let outside = |lo: i64, hi: i64| {
        if lo < 0 {
            Some(lo)
        } else if hi >= len {
            Some(hi)
        } else {
            None
        }
    };
    let iv = facts.iv.get(e.0 as usize).copied().unwrap_or(UNKNOWN);
    if let (Some(lo), Some(hi)) = (iv.lo, iv.hi) {
        if outside(lo, hi).is_none() {
            return Ok(true);
        }
    }
    if let Some((lo, hi)) = facts.affine_range(pool, e) {
        return match outside(lo, hi) {
            None => Ok(true),
            Some(x) => Err(x),
        };
    }
    // Not affine: only an interval wholly outside is a proof.
    if let Some(lo) = iv.lo.filter(|&l| l >= len) {
        return Err(lo);
    }
    if let Some(hi) = iv.hi.filter(|&h| h < 0) {
        return Err(hi);
    }
    Ok(false)
}

/// Range `[lo, hi]` of a strided operand's element index over `batch ++ [rows, cols]`.
fn operand_range(op: &Operand, batch: &[usize], rows: usize, cols: usize) -> Option<(i64, i64)> {
    if op.batch_strides.len() != batch.len() {
        return None;
    }
    let (mut lo, mut hi) = (op.base, op.base);
    let axes = op
        .batch_strides
        .iter()
        .zip(batch)
        .chain([(&op.rs, &rows), (&op.cs, &cols)]);
    for (&s, &d) in axes {
        let span = s.checked_mul(last_index(d)?)?;
        if span < 0 {
            lo = lo.checked_add(span)?;
        } else {
            hi = hi.checked_add(span)?;
        }
    }
    Some((lo, hi))
}

/// One buffer access of a kernel: the node named, the dtype used, and how to bound it.
struct Access {
    buf: NodeId,
    dtype: DType,
    what: String,
    range: Range,
}

enum Range {
    Expr(ExprId),
    Strided(Option<(i64, i64)>),
}

/// Loads of a kernel: live `E::Load`s (of the stores and of gathers), strided matmul and
/// attention operands. Reports malformed expression ids.
fn loads_of(ki: usize, k: &Kernel, facts: &PoolFacts, errs: &mut Vec<KernelError>) -> Vec<Access> {
    let pool = &k.pool;
    let mut roots: Vec<ExprId> = k.stores.iter().flat_map(|s| [s.index, s.value]).collect();
    let mut out = Vec::new();
    let mut operands: Vec<(&str, &Operand, Vec<usize>, usize, usize)> = Vec::new();
    if let Some(mm) = &k.matmul {
        operands.push(("matmul operand A", &mm.a, mm.batch.clone(), mm.m, mm.k));
        operands.push(("matmul operand B", &mm.b, mm.batch.clone(), mm.k, mm.n));
    }
    if let Some(at) = &k.attention {
        for (what, o, rows, cols) in at.reads() {
            operands.push((what, o, at.batch.clone(), rows, cols));
        }
    }
    for (what, op, batch, rows, cols) in operands {
        match &op.gather {
            // A gather names the node it views; what it reads are its loads.
            Some(gt) => roots.push(gt.value),
            None => out.push(Access {
                buf: op.buf,
                dtype: op.dtype,
                what: what.to_string(),
                range: Range::Strided(operand_range(op, &batch, rows, cols)),
            }),
        }
    }
    let mut seen = vec![false; pool.nodes.len()];
    let mut stack = Vec::new();
    for r in roots {
        if facts.valid(r) {
            stack.push(r);
        } else {
            errs.push(KernelError::BadExpr {
                kernel: ki,
                name: k.name.clone(),
                expr: r.0 as usize,
                len: pool.nodes.len(),
            });
        }
    }
    while let Some(x) = stack.pop() {
        if std::mem::replace(&mut seen[x.0 as usize], true) {
            continue;
        }
        let e = &pool.nodes[x.0 as usize];
        // Valid nodes have valid children.
        for_children(e, |c| stack.push(c));
        if let E::Load { buf, dtype, index } = e {
            out.push(Access {
                buf: *buf,
                dtype: *dtype,
                what: "load".into(),
                range: Range::Expr(*index),
            });
        }
    }
    out
}

/// [`verify_kernels`] with the accesses it could not bound.
pub fn check_kernels(g: &Graph, fused: &Fused) -> KernelReport {
    let mut rep = KernelReport::default();
    let errs = &mut rep.errors;
    let target_of: HashMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    let value_of: HashMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (t, v)).collect();
    // Node -> first kernel storing it.
    let mut written: HashMap<NodeId, usize> = HashMap::new();
    for (ki, k) in fused.kernels.iter().enumerate() {
        let name = || k.name.clone();
        let facts = PoolFacts::of(k);
        let pool = &k.pool;
        let runs = !k.domain.contains(&0);
        let numel = |n: NodeId| g.get(n).map(|x| x.ty.shape.numel() as u64);
        // Stores of update values in this kernel: target -> (value, store index).
        let mut updates_here: HashMap<NodeId, (NodeId, ExprId)> = HashMap::new();
        for (si, s) in k.stores.iter().enumerate() {
            let what = format!("store {si}");
            let Some(node) = g.get(s.buf) else {
                errs.push(KernelError::UnknownBuffer {
                    kernel: ki,
                    name: name(),
                    buf: s.buf.index(),
                    what,
                });
                continue;
            };
            if let Some(leaf) = leaf_kind(g, s.buf) {
                errs.push(KernelError::StoreToLeaf {
                    kernel: ki,
                    name: name(),
                    buf: s.buf.index(),
                    leaf,
                });
            }
            if s.dtype != node.ty.dtype {
                errs.push(KernelError::DTypeMismatch {
                    kernel: ki,
                    name: name(),
                    buf: s.buf.index(),
                    what: what.clone(),
                    found: s.dtype,
                    expected: node.ty.dtype,
                });
            }
            for e in [s.index, s.value] {
                if !facts.valid(e) {
                    errs.push(KernelError::BadExpr {
                        kernel: ki,
                        name: name(),
                        expr: e.0 as usize,
                        len: pool.nodes.len(),
                    });
                }
            }
            if let Some(&vt) = pool.tys.get(s.value.0 as usize) {
                let expected = VTy::of(node.ty.dtype);
                if vt != expected && facts.valid(s.value) {
                    errs.push(KernelError::ValueType {
                        kernel: ki,
                        name: name(),
                        buf: s.buf.index(),
                        store: si,
                        found: vt.name(),
                        expected: expected.name(),
                        dtype: node.ty.dtype,
                    });
                }
            }
            if s.accumulate && written.get(&s.buf).is_none_or(|&w| w >= ki) {
                errs.push(KernelError::AccumulateUnwritten {
                    kernel: ki,
                    name: name(),
                    buf: s.buf.index(),
                });
            }
            if runs && facts.valid(s.index) {
                match bound(&facts, pool, s.index, numel(s.buf).unwrap_or(0)) {
                    Ok(true) => {}
                    Ok(false) => rep.unproven.push((ki, s.buf, what.clone())),
                    Err(element) => errs.push(KernelError::OutOfBounds {
                        kernel: ki,
                        name: name(),
                        buf: s.buf.index(),
                        what: what.clone(),
                        store: true,
                        element,
                        len: numel(s.buf).unwrap_or(0),
                    }),
                }
            }
            if let Some(&t) = target_of.get(&s.buf) {
                updates_here.entry(t).or_insert((s.buf, s.index));
            }
        }
        for a in loads_of(ki, k, &facts, errs) {
            let Some(node) = g.get(a.buf) else {
                errs.push(KernelError::UnknownBuffer {
                    kernel: ki,
                    name: name(),
                    buf: a.buf.index(),
                    what: a.what,
                });
                continue;
            };
            if a.dtype != node.ty.dtype {
                errs.push(KernelError::DTypeMismatch {
                    kernel: ki,
                    name: name(),
                    buf: a.buf.index(),
                    what: a.what.clone(),
                    found: a.dtype,
                    expected: node.ty.dtype,
                });
            }
            if leaf_kind(g, a.buf).is_some() {
                // The old value of an updated leaf: before its update, or in its update's
                // kernel at the index stored.
                if let Some(&v) = value_of.get(&a.buf) {
                    match (written.get(&v), updates_here.get(&a.buf)) {
                        (Some(&w), _) if w < ki => errs.push(KernelError::ReadAfterUpdate {
                            kernel: ki,
                            name: name(),
                            buf: a.buf.index(),
                            what: a.what.clone(),
                            value: v.index(),
                            writer: w,
                        }),
                        (_, Some(&(v, at))) if !matches!(a.range, Range::Expr(i) if i == at) => {
                            errs.push(KernelError::InPlaceHazard {
                                kernel: ki,
                                name: name(),
                                buf: a.buf.index(),
                                what: a.what.clone(),
                                value: v.index(),
                            })
                        }
                        _ => {}
                    }
                }
            } else if written.get(&a.buf).is_none_or(|&w| w >= ki) {
                errs.push(KernelError::ReadBeforeWrite {
                    kernel: ki,
                    name: name(),
                    buf: a.buf.index(),
                    what: a.what.clone(),
                });
            }
            if !runs {
                continue;
            }
            let len = numel(a.buf).unwrap_or(0);
            let res = match a.range {
                Range::Expr(e) => bound(&facts, pool, e, len),
                Range::Strided(Some((lo, hi))) => {
                    let l = i64::try_from(len).unwrap_or(i64::MAX);
                    if lo < 0 {
                        Err(lo)
                    } else if hi >= l {
                        Err(hi)
                    } else {
                        Ok(true)
                    }
                }
                Range::Strided(None) => Ok(false),
            };
            match res {
                Ok(true) => {}
                Ok(false) => rep.unproven.push((ki, a.buf, a.what)),
                Err(element) => errs.push(KernelError::OutOfBounds {
                    kernel: ki,
                    name: name(),
                    buf: a.buf.index(),
                    what: a.what,
                    store: false,
                    element,
                    len,
                }),
            }
        }
        for s in &k.stores {
            written.entry(s.buf).or_insert(ki);
        }
    }
    check_in_place(g, fused, errs);
    let mut must: Vec<(NodeId, String)> = Vec::new();
    for (name, o) in &g.outputs {
        must.push((*o, format!("output `{name}`")));
    }
    for &(t, v) in &g.updates {
        must.push((v, format!("new value of %{}", t.index())));
    }
    for (n, what) in must {
        let literal = matches!(g.get(n).map(|x| &x.op), Some(Op::Literal { .. }));
        if !literal && leaf_kind(g, n).is_none() && !written.contains_key(&n) {
            errs.push(KernelError::NeverWritten {
                buf: n.index(),
                what,
            });
        }
    }
    rep
}

/// The contract of values stored in place (`Fused::in_place`): the one kernel storing the
/// value reads the buffer it is written over only at its store's index (never through a
/// matmul, gather or attention operand), no later kernel reads or stores that buffer, and
/// both have the same bytes.
fn check_in_place(g: &Graph, fused: &Fused, errs: &mut Vec<KernelError>) {
    for (&n, &d) in &fused.in_place {
        let storing: Vec<usize> = (0..fused.kernels.len())
            .filter(|&ki| fused.kernels[ki].stores.iter().any(|s| s.buf == n))
            .collect();
        let bad = |kernel: usize, why: String| KernelError::BadInPlace {
            kernel,
            name: fused
                .kernels
                .get(kernel)
                .map_or(String::new(), |k| k.name.clone()),
            buf: n.index(),
            donor: d.index(),
            why,
        };
        let [ki] = storing.as_slice() else {
            errs.push(bad(0, format!("{} kernels store it", storing.len())));
            continue;
        };
        let k = &fused.kernels[*ki];
        let same_bytes = match (g.get(n), g.get(d)) {
            (Some(a), Some(b)) => a.ty.size_bytes() == b.ty.size_bytes(),
            _ => false,
        };
        if !same_bytes {
            errs.push(bad(*ki, "their bytes differ".into()));
        }
        let [s] = k.stores.as_slice() else {
            errs.push(bad(*ki, "its kernel stores several values".into()));
            continue;
        };
        if s.accumulate || k.attention.is_some() || k.operand_loads().contains(&d) {
            errs.push(bad(
                *ki,
                "its kernel accumulates or reads it as an operand".into(),
            ));
        }
        let elsewhere = k.live_nodes().into_iter().any(|e| {
            matches!(k.pool.get(e), E::Load { buf, index, .. } if *buf == d && *index != s.index)
        });
        if elsewhere {
            errs.push(bad(
                *ki,
                "its kernel reads it at another index than it stores".into(),
            ));
        }
        if let Some(later) = (ki + 1..fused.kernels.len()).find(|&j| {
            let kj = &fused.kernels[j];
            kj.loads().contains(&d) || kj.stores.iter().any(|s| s.buf == d)
        }) {
            errs.push(bad(
                later,
                "a later kernel accesses the buffer written over".into(),
            ));
        }
    }
}

/// One storage of the arena: where it is and when it is live.
struct Storage {
    node: NodeId,
    offset: u64,
    end: u64,
    first: usize,
    last: usize,
}

/// Checks the plan of fused kernels: every buffer a kernel accesses has an aligned offset,
/// fits the arena and stays out of the scratch region; an update value shares its target's
/// bytes; and no two buffers live at the same kernel share a byte. Lifetimes come from the
/// kernels themselves (a buffer lives from the first kernel that accesses it to the last;
/// params and state always; inputs from the first kernel; outputs to the last), not from
/// the plan's liveness, so a planner bug shows.
pub fn verify_planned(g: &Graph, fused: &Fused, plan: &Plan) -> Result<(), Vec<KernelError>> {
    let mut errs = Vec::new();
    let nk = fused.kernels.len();
    let kname = |k: usize| {
        fused
            .kernels
            .get(k)
            .map_or(String::new(), |x| x.name.clone())
    };
    let target_of: HashMap<NodeId, NodeId> = g.updates.iter().map(|&(t, v)| (v, t)).collect();
    // A value stored in place lives in the bytes it is written over (a chain of them in
    // the first one's).
    let storage = |n: NodeId| {
        let mut x = n;
        for _ in 0..=fused.in_place.len() {
            match fused.in_place.get(&x) {
                Some(&d) => x = d,
                None => break,
            }
        }
        target_of.get(&x).copied().unwrap_or(x)
    };
    let offset_of = |n: NodeId| {
        plan.liveness
            .buffer_of
            .get(&n)
            .and_then(|&b| plan.offsets.get(b).copied())
    };
    let bytes = |n: NodeId| g.get(n).map_or(0, |x| x.ty.size_bytes() as u64);
    // Storage node -> (first, last) step; nodes seen, with their first kernel. Step 0 is
    // the caller filling the inputs, step `k + 1` kernel `k` (as `kernel_liveness` counts):
    // inputs are live together at step 0, an input no kernel reads only then.
    let mut span: BTreeMap<NodeId, (usize, usize)> = BTreeMap::new();
    let mut first_access: BTreeMap<NodeId, usize> = BTreeMap::new();
    for (ki, k) in fused.kernels.iter().enumerate() {
        let named = k
            .stores
            .iter()
            .map(|s| s.buf)
            .chain(loads_checked(k))
            .filter(|&n| g.get(n).is_some());
        for n in named {
            first_access.entry(n).or_insert(ki);
            let e = span.entry(storage(n)).or_insert((ki + 1, ki + 1));
            e.1 = e.1.max(ki + 1);
        }
    }
    let end_step = nk;
    for &p in g.params.iter().chain(&g.states) {
        span.insert(p, (0, end_step));
    }
    for &i in &g.inputs {
        span.entry(i).or_insert((0, 0)).0 = 0;
    }
    for (_, o) in &g.outputs {
        if let Some(e) = span.get_mut(&storage(*o)) {
            e.1 = end_step;
        }
    }
    // `Plan::scratch_offset`, without underflow on a broken plan.
    let scratch = plan.arena_bytes.saturating_sub(plan.scratch_bytes);
    // Per storage checks, at the first kernel naming it (or its update value).
    let mut checked: BTreeSet<NodeId> = BTreeSet::new();
    for (&n, &ki) in &first_access {
        let Some(offset) = offset_of(n) else {
            errs.push(KernelError::Unplanned {
                kernel: ki,
                name: kname(ki),
                buf: n.index(),
            });
            continue;
        };
        let s = storage(n);
        let offset = match offset_of(s) {
            Some(to) if to != offset => {
                errs.push(KernelError::UpdateNotInPlace {
                    kernel: ki,
                    name: kname(ki),
                    buf: n.index(),
                    offset,
                    target: s.index(),
                    target_offset: to,
                });
                to
            }
            Some(to) => to,
            None => {
                // An update value planned, its target not: reported once.
                if checked.insert(s) {
                    errs.push(KernelError::Unplanned {
                        kernel: ki,
                        name: kname(ki),
                        buf: s.index(),
                    });
                }
                continue;
            }
        };
        let n = s;
        if !checked.insert(n) {
            continue;
        }
        if !offset.is_multiple_of(ALIGN) {
            errs.push(KernelError::Misaligned {
                kernel: ki,
                name: kname(ki),
                buf: n.index(),
                offset,
            });
        }
        let end = offset.saturating_add(bytes(n));
        if end > plan.arena_bytes {
            errs.push(KernelError::PastArena {
                kernel: ki,
                name: kname(ki),
                buf: n.index(),
                offset,
                end,
                arena: plan.arena_bytes,
            });
        } else if plan.scratch_bytes > 0 && end > scratch && bytes(n) > 0 {
            errs.push(KernelError::InScratch {
                kernel: ki,
                name: kname(ki),
                buf: n.index(),
                offset,
                end,
                scratch,
                arena: plan.arena_bytes,
            });
        }
    }
    // Overlap: a sweep over kernels with the live storages ordered by offset (pairwise
    // disjoint: a storage that overlaps one is reported and left out).
    let mut items: Vec<Storage> = span
        .iter()
        .filter_map(|(&n, &(first, last))| {
            let offset = offset_of(n)?;
            let b = bytes(n);
            (b > 0).then(|| Storage {
                node: n,
                offset,
                end: offset.saturating_add(b),
                first,
                last,
            })
        })
        .collect();
    items.sort_by_key(|s| (s.first, s.offset, s.node));
    let steps = nk + 1;
    let mut expire: Vec<Vec<usize>> = vec![Vec::new(); steps];
    let mut active: BTreeMap<(u64, usize), usize> = BTreeMap::new();
    let mut next = 0;
    for t in 0..steps {
        if t > 0 {
            for &i in &expire[t - 1] {
                active.remove(&(items[i].offset, i));
            }
        }
        while next < items.len() && items[next].first <= t {
            let i = next;
            next += 1;
            let it = &items[i];
            let mut clash = Vec::new();
            if let Some((_, &j)) = active.range(..(it.offset, usize::MAX)).next_back() {
                if items[j].end > it.offset {
                    clash.push(j);
                }
            }
            for (_, &j) in active.range((it.offset, usize::MAX)..) {
                if items[j].offset >= it.end {
                    break;
                }
                clash.push(j);
            }
            for &j in &clash {
                let o = &items[j];
                errs.push(KernelError::Overlap {
                    kernel: t.saturating_sub(1),
                    name: kname(t.saturating_sub(1)),
                    a: o.node.index(),
                    a_offset: o.offset,
                    a_end: o.end,
                    b: it.node.index(),
                    b_offset: it.offset,
                    b_end: it.end,
                });
            }
            if clash.is_empty() && it.last >= t {
                active.insert((it.offset, i), i);
                expire[it.last.min(steps - 1)].push(i);
            }
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

/// [`Kernel::loads`] without trusting the pool: expression ids out of range or
/// referring to later nodes are skipped (the verifier reports them).
fn loads_checked(k: &Kernel) -> Vec<NodeId> {
    let facts_ok = |e: ExprId| (e.0 as usize) < k.pool.nodes.len();
    let mut roots: Vec<ExprId> = k.stores.iter().flat_map(|s| [s.index, s.value]).collect();
    let mut out = Vec::new();
    let mut operands: Vec<&Operand> = Vec::new();
    if let Some(mm) = &k.matmul {
        operands.extend([&mm.a, &mm.b]);
    }
    if let Some(at) = &k.attention {
        operands.extend(at.reads().into_iter().map(|(_, o, _, _)| o));
    }
    for op in operands {
        match &op.gather {
            Some(gt) => roots.push(gt.value),
            None => out.push(op.buf),
        }
    }
    let mut seen = vec![false; k.pool.nodes.len()];
    let mut stack: Vec<ExprId> = roots.into_iter().filter(|&e| facts_ok(e)).collect();
    while let Some(x) = stack.pop() {
        if std::mem::replace(&mut seen[x.0 as usize], true) {
            continue;
        }
        let e = &k.pool.nodes[x.0 as usize];
        for_children(e, |c| {
            if c.0 < x.0 {
                stack.push(c)
            }
        });
        if let E::Load { buf, .. } = e {
            out.push(*buf);
        }
    }
    out.sort();
    out.dedup();
    out
}
