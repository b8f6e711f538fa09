//! Kernel IR: what one fused kernel computes, in the form both back ends read.
//!
//! A [`Kernel`] is a loop nest over an index space (`domain`, row-major, outermost first)
//! and a list of [`Store`]s: for every point of the domain, each store writes one value to
//! `buffer[index]`. Values are expressions in an [`ExprPool`]: a DAG of interned nodes
//! (equal sub-expressions are one node, so a value used twice is computed once) over
//! - loop variables (`v0`.. for the domain, fresh ones for reductions) and integer index
//!   arithmetic,
//! - loads of a buffer at an element index (the layout of views is nothing but this index
//!   arithmetic: permute, slice, broadcast and reshape cost no copy),
//! - elementwise math, selects and casts,
//! - structured reductions over extra loop variables ([`E::Reduce`], [`E::ArgMax`]); a
//!   back end evaluates a node at the outermost loop where all its variables are bound, so
//!   a row reduction inside a per-element kernel runs once per row (softmax, layer norm).
//!
//! Matmul kernels are a structured form ([`Matmul`]): the back end owns the loop nest (tiled,
//! vectorised) and the stores read its accumulator through [`E::Acc`] (the fused epilogue).
//!
//! Buffers are named by the graph node that owns them; once planned, [`offsets::Offsets`]
//! gives every buffer the kernels access its arena offset.

pub mod fuse;
pub mod layout;
pub mod lower;
pub mod offsets;
pub mod peak;
pub mod print;
pub mod sites;
pub mod verify;

use crate::ir::{BinaryOp, DType, NodeId, UnaryOp};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Kernels of one step in launch order: what the fusion (`fuse`) gives the analyses, the
/// plan and the back ends.
#[derive(Clone, Debug)]
pub struct Fused {
    pub kernels: Vec<Kernel>,
    /// Nodes with a buffer (leaves included).
    pub materialized: BTreeSet<NodeId>,
    /// The node order the kernels follow.
    pub order: Vec<NodeId>,
    /// Buffers laid out other than row-major (see `lower::Decisions::layouts`).
    pub layouts: BTreeMap<NodeId, Vec<usize>>,
    /// Stored nodes that take the bytes of a buffer their kernel reads for the last time
    /// (stored node -> that buffer's node): an elementwise kernel's result written over an
    /// operand that dies there, each element where it was read ([`peak::in_place`]).
    pub in_place: BTreeMap<NodeId, NodeId>,
    /// How fusion was weighed against the peak ([`peak::limit_peak`]).
    pub peak: peak::PeakReport,
    /// Rounds of decisions and kernel building the last fusion pass took (a kernel that
    /// cannot be built as decided gives nodes buffers and the pass runs again).
    pub rounds: usize,
}

/// Type of a value inside a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VTy {
    /// Every float dtype computes in f32 (f16/bf16 convert on load and store).
    F32,
    I32,
    /// Indices and loop variables.
    I64,
    Bool,
}

impl VTy {
    /// The compute type of a storage dtype.
    pub fn of(d: DType) -> VTy {
        match d {
            DType::F32 | DType::F16 | DType::BF16 => VTy::F32,
            DType::I32 => VTy::I32,
            DType::Bool => VTy::Bool,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            VTy::F32 => "f32",
            VTy::I32 => "i32",
            VTy::I64 => "i64",
            VTy::Bool => "bool",
        }
    }
}

/// Reduction combiners.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Red {
    Sum,
    /// NaN if any element is NaN.
    Max,
    Min,
}

impl Red {
    pub fn name(self) -> &'static str {
        match self {
            Red::Sum => "sum",
            Red::Max => "max",
            Red::Min => "min",
        }
    }
}

/// Index of an expression node in its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExprId(pub u32);

/// A loop variable.
pub type Var = u32;

/// One expression node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum E {
    /// A loop variable (i64).
    Var(Var),
    /// An i64 constant (indices).
    Int(i64),
    /// An f32 constant, by its bits (so the node can be hashed).
    F32(u32),
    I32(i32),
    Bool(bool),
    /// `buf[index]`, where `buf` is the buffer of a graph node; converted to the compute
    /// type of `dtype`. The index is always in bounds (lowering clamps where it must).
    Load {
        buf: NodeId,
        dtype: DType,
        index: ExprId,
    },
    Un(UnaryOp, ExprId),
    /// Same-typed operands; comparisons give `Bool`. Integer `/` and `%` round toward
    /// negative infinity (i32) and give 0 when dividing by 0; on i64 indices they truncate.
    Bin(BinaryOp, ExprId, ExprId),
    /// `min`/`max` of i64 indices (clamping).
    IMin(ExprId, ExprId),
    IMax(ExprId, ExprId),
    Select(ExprId, ExprId, ExprId),
    Cast(VTy, ExprId),
    /// An f32 rounded to the nearest value of a 16-bit float dtype (f16 or bf16), as a
    /// store and load of that dtype would give: a 16-bit value computed inside a kernel
    /// holds what the interpreter's 16-bit op gives.
    Round(DType, ExprId),
    /// Reduction of `body` over fresh variables `vars` (extents), row-major order.
    Reduce {
        op: Red,
        vars: Vec<(Var, usize)>,
        body: ExprId,
    },
    /// Row-major linear index (i64) over `vars` of the first maximum of `body` (NaN counts
    /// as the maximum).
    ArgMax {
        vars: Vec<(Var, usize)>,
        body: ExprId,
    },
    /// Dropout's uniform draw in [0, 1) for element `index` (see `eager::dropout_uniform`).
    Uniform {
        seed: u64,
        index: ExprId,
    },
    /// The accumulator of the kernel's matmul at the current domain point.
    Acc,
}

/// An interned expression DAG.
#[derive(Clone, Debug, Default)]
pub struct ExprPool {
    pub nodes: Vec<E>,
    pub tys: Vec<VTy>,
    /// Fx hashing: interning is the hottest map of fusion; only looked up, never iterated.
    intern: rustc_hash::FxHashMap<E, ExprId>,
    next_var: Var,
}

impl ExprPool {
    pub fn get(&self, id: ExprId) -> &E {
        &self.nodes[id.0 as usize]
    }

    pub fn ty(&self, id: ExprId) -> VTy {
        self.tys[id.0 as usize]
    }

    /// Interns `e` of type `ty`.
    pub fn add(&mut self, e: E, ty: VTy) -> ExprId {
        if let Some(&id) = self.intern.get(&e) {
            return id;
        }
        let id = ExprId(self.nodes.len() as u32);
        self.nodes.push(e.clone());
        self.tys.push(ty);
        self.intern.insert(e, id);
        id
    }

    pub fn fresh_var(&mut self) -> Var {
        let v = self.next_var;
        self.next_var += 1;
        v
    }

    /// Reserves variables `0..n` for the domain.
    pub fn reserve_vars(&mut self, n: u32) {
        self.next_var = self.next_var.max(n);
    }

    pub fn var(&mut self, v: Var) -> ExprId {
        self.add(E::Var(v), VTy::I64)
    }

    pub fn int(&mut self, v: i64) -> ExprId {
        self.add(E::Int(v), VTy::I64)
    }

    pub fn f32(&mut self, v: f32) -> ExprId {
        self.add(E::F32(v.to_bits()), VTy::F32)
    }

    /// The constant `v` in type `ty`.
    pub fn constant(&mut self, v: f64, ty: VTy) -> ExprId {
        match ty {
            VTy::F32 => self.f32(v as f32),
            VTy::I32 => self.add(E::I32(v as i32), VTy::I32),
            VTy::I64 => self.int(v as i64),
            VTy::Bool => self.add(E::Bool(v != 0.0), VTy::Bool),
        }
    }

    fn int_value(&self, id: ExprId) -> Option<i64> {
        match self.get(id) {
            E::Int(v) => Some(*v),
            _ => None,
        }
    }

    /// `a + b` on i64 with constant folding.
    pub fn iadd(&mut self, a: ExprId, b: ExprId) -> ExprId {
        match (self.int_value(a), self.int_value(b)) {
            (Some(x), Some(y)) => self.int(x + y),
            (Some(0), _) => b,
            (_, Some(0)) => a,
            _ => self.add(E::Bin(BinaryOp::Add, a, b), VTy::I64),
        }
    }

    /// `a * b` on i64 with constant folding.
    pub fn imul(&mut self, a: ExprId, b: ExprId) -> ExprId {
        match (self.int_value(a), self.int_value(b)) {
            (Some(x), Some(y)) => self.int(x * y),
            (Some(0), _) | (_, Some(0)) => self.int(0),
            (Some(1), _) => b,
            (_, Some(1)) => a,
            _ => self.add(E::Bin(BinaryOp::Mul, a, b), VTy::I64),
        }
    }

    pub fn imul_c(&mut self, a: ExprId, c: i64) -> ExprId {
        let c = self.int(c);
        self.imul(a, c)
    }

    pub fn iadd_c(&mut self, a: ExprId, c: i64) -> ExprId {
        let c = self.int(c);
        self.iadd(a, c)
    }

    /// `a / c` for an index `a` that is known non-negative, simplified through
    /// [`Affine`] when `a` is affine in bounded variables.
    pub fn idiv_c(&mut self, a: ExprId, c: i64, ext: &dyn Fn(Var) -> Option<usize>) -> ExprId {
        if c == 1 {
            return a;
        }
        if let Some(af) = self.affine(a) {
            if let Some((hi, _lo)) = af.split(c, ext) {
                return self.from_affine(&hi);
            }
            // a = g * hi + lo with 0 <= lo < g for a factor g of c: a / c = hi / (c / g).
            if let Some((g, hi, _lo)) = af.factor_split(c, ext) {
                let hi = self.from_affine(&hi);
                return self.idiv_c(hi, c / g, ext);
            }
        }
        if let Some((hi, lo, lo_fits)) = self.split_sum(a, c, ext) {
            if lo_fits {
                return hi;
            }
            let cc = self.int(c);
            let q = self.add(E::Bin(BinaryOp::Div, lo, cc), VTy::I64);
            return self.iadd(hi, q);
        }
        let cc = self.int(c);
        self.add(E::Bin(BinaryOp::Div, a, cc), VTy::I64)
    }

    /// `a % c` for a non-negative index `a`, simplified like [`ExprPool::idiv_c`].
    pub fn irem_c(&mut self, a: ExprId, c: i64, ext: &dyn Fn(Var) -> Option<usize>) -> ExprId {
        if c == 1 {
            return self.int(0);
        }
        if let Some(af) = self.affine(a) {
            if let Some((_hi, lo)) = af.split(c, ext) {
                return self.from_affine(&lo);
            }
            // a = g * hi + lo as in `idiv_c`: a % c = (hi % (c / g)) * g + lo.
            if let Some((g, hi, lo)) = af.factor_split(c, ext) {
                let hi = self.from_affine(&hi);
                let r = self.irem_c(hi, c / g, ext);
                let r = self.imul_c(r, g);
                let lo = self.from_affine(&lo);
                return self.iadd(r, lo);
            }
        }
        if let Some((_hi, lo, lo_fits)) = self.split_sum(a, c, ext) {
            if lo_fits {
                return lo;
            }
            let cc = self.int(c);
            return self.add(E::Bin(BinaryOp::Rem, lo, cc), VTy::I64);
        }
        let cc = self.int(c);
        self.add(E::Bin(BinaryOp::Rem, a, cc), VTy::I64)
    }

    /// Splits a non-negative index `a = c * hi + lo` over its summands (where [`Affine`]
    /// cannot: a summand is a clamp, a quotient or a remainder of the views below a concat):
    /// summands whose coefficient `c` divides go to `hi`, the rest to `lo`, which must be
    /// non-negative (so `a / c = hi + lo / c` and `a % c = lo % c`). The flag says `lo`
    /// stays below `c` (then `a / c = hi`, `a % c = lo`). `None` when a part may be
    /// negative or `lo` is all of `a`.
    fn split_sum(
        &mut self,
        a: ExprId,
        c: i64,
        ext: &dyn Fn(Var) -> Option<usize>,
    ) -> Option<(ExprId, ExprId, bool)> {
        if c <= 0 {
            return None;
        }
        let mut terms = Vec::new();
        let c0 = self.summands(a, 1, &mut terms)?;
        let (mut hi, mut lo) = (self.int(c0.div_euclid(c)), self.int(c0.rem_euclid(c)));
        let (mut lo_min, mut lo_max) = (c0.rem_euclid(c), c0.rem_euclid(c));
        let mut hi_min = c0.div_euclid(c);
        let mut moved = false;
        for (x, k) in terms {
            let (xmin, xmax) = self.range(x, ext)?;
            if k % c == 0 {
                let t = self.imul_c(x, k / c);
                hi = self.iadd(hi, t);
                hi_min =
                    hi_min.checked_add((k / c).checked_mul(if k > 0 { xmin } else { xmax })?)?;
                moved = true;
            } else {
                let t = self.imul_c(x, k);
                lo = self.iadd(lo, t);
                let (p, q) = (k.checked_mul(xmin)?, k.checked_mul(xmax)?);
                lo_min = lo_min.checked_add(p.min(q))?;
                lo_max = lo_max.checked_add(p.max(q))?;
            }
        }
        let fits = lo_max < c;
        (lo_min >= 0 && hi_min >= 0 && (moved || fits)).then_some((hi, lo, fits))
    }

    /// Adds `scale ×` the summands of `e` to `out` (atoms with their coefficients) and
    /// returns `scale ×` its constant.
    pub fn summands(&self, e: ExprId, scale: i64, out: &mut Vec<(ExprId, i64)>) -> Option<i64> {
        if self.ty(e) != VTy::I64 {
            return None;
        }
        match self.get(e) {
            E::Int(v) => v.checked_mul(scale),
            E::Bin(BinaryOp::Add, a, b) => {
                let (a, b) = (*a, *b);
                self.summands(a, scale, out)?
                    .checked_add(self.summands(b, scale, out)?)
            }
            E::Bin(BinaryOp::Mul, a, b) => match (self.int_value(*a), self.int_value(*b)) {
                (Some(k), _) => self.summands(*b, scale.checked_mul(k)?, out),
                (_, Some(k)) => self.summands(*a, scale.checked_mul(k)?, out),
                _ => {
                    out.push((e, scale));
                    Some(0)
                }
            },
            _ => {
                out.push((e, scale));
                Some(0)
            }
        }
    }

    /// Bounds `[min, max]` of an i64 index expression, where variables range over their
    /// extents (`ext`); `None` where unknown.
    pub fn range(&self, e: ExprId, ext: &dyn Fn(Var) -> Option<usize>) -> Option<(i64, i64)> {
        let r = |x: &ExprId| self.range(*x, ext);
        match self.get(e) {
            E::Int(v) => Some((*v, *v)),
            E::Var(v) => Some((0, (ext(*v)? as i64 - 1).max(0))),
            E::Bin(BinaryOp::Add, a, b) => {
                let ((p, q), (s, t)) = (r(a)?, r(b)?);
                Some((p.checked_add(s)?, q.checked_add(t)?))
            }
            E::Bin(BinaryOp::Mul, a, b) => {
                let ((p, q), (s, t)) = (r(a)?, r(b)?);
                let c = [
                    p.checked_mul(s)?,
                    p.checked_mul(t)?,
                    q.checked_mul(s)?,
                    q.checked_mul(t)?,
                ];
                Some((*c.iter().min()?, *c.iter().max()?))
            }
            E::Bin(BinaryOp::Div, a, b) => {
                let ((p, q), k) = (r(a)?, self.int_value(*b)?);
                (p >= 0 && k > 0).then_some((p / k, q / k))
            }
            E::Bin(BinaryOp::Rem, a, b) => {
                let ((p, q), k) = (r(a)?, self.int_value(*b)?);
                if p < 0 || k <= 0 {
                    None
                } else if q < k {
                    Some((p, q))
                } else {
                    Some((0, k - 1))
                }
            }
            E::IMin(a, b) => {
                let ((p, q), (s, t)) = (r(a)?, r(b)?);
                Some((p.min(s), q.min(t)))
            }
            E::IMax(a, b) => {
                let ((p, q), (s, t)) = (r(a)?, r(b)?);
                Some((p.max(s), q.max(t)))
            }
            _ => None,
        }
    }

    /// `root` with variable `v` replaced by `with` (nodes that do not read `v` are kept).
    pub fn substitute(&mut self, root: ExprId, v: Var, with: ExprId) -> ExprId {
        let mut memo: HashMap<ExprId, ExprId> = HashMap::new();
        self.substitute_in(root, v, with, &mut memo)
    }

    fn substitute_in(
        &mut self,
        e: ExprId,
        v: Var,
        with: ExprId,
        memo: &mut HashMap<ExprId, ExprId>,
    ) -> ExprId {
        if let Some(&r) = memo.get(&e) {
            return r;
        }
        let node = self.get(e).clone();
        let mut sub = |p: &mut ExprPool, x: ExprId| p.substitute_in(x, v, with, memo);
        let rebuilt = match node {
            E::Var(w) if w == v => None,
            E::Var(_) | E::Int(_) | E::F32(_) | E::I32(_) | E::Bool(_) | E::Acc => Some(node),
            E::Load { buf, dtype, index } => Some(E::Load {
                buf,
                dtype,
                index: sub(self, index),
            }),
            E::Un(op, a) => Some(E::Un(op, sub(self, a))),
            E::Cast(t, a) => Some(E::Cast(t, sub(self, a))),
            E::Round(d, a) => Some(E::Round(d, sub(self, a))),
            E::Bin(op, a, b) => Some(E::Bin(op, sub(self, a), sub(self, b))),
            E::IMin(a, b) => Some(E::IMin(sub(self, a), sub(self, b))),
            E::IMax(a, b) => Some(E::IMax(sub(self, a), sub(self, b))),
            E::Select(c, a, b) => Some(E::Select(sub(self, c), sub(self, a), sub(self, b))),
            E::Reduce { op, vars, body } => Some(E::Reduce {
                op,
                vars,
                body: sub(self, body),
            }),
            E::ArgMax { vars, body } => Some(E::ArgMax {
                vars,
                body: sub(self, body),
            }),
            E::Uniform { seed, index } => Some(E::Uniform {
                seed,
                index: sub(self, index),
            }),
        };
        let r = match rebuilt {
            None => with,
            Some(n) => {
                let ty = self.ty(e);
                self.add(n, ty)
            }
        };
        memo.insert(e, r);
        r
    }

    /// `root` with variable `v` replaced by the index `with`, the index arithmetic above it
    /// simplified again for the variables' extents (`ext`): quotients and remainders of
    /// non-negative sums split through [`ExprPool::idiv_c`] / [`ExprPool::irem_c`], and a
    /// clamp whose bound its operand's range already keeps is dropped. Unflattening `k =
    /// t * L + u` (`t` the run, `u` the position in it) gives back `t` and `u` themselves.
    pub fn substitute_index(
        &mut self,
        root: ExprId,
        v: Var,
        with: ExprId,
        ext: &dyn Fn(Var) -> Option<usize>,
    ) -> ExprId {
        let mut memo: HashMap<ExprId, ExprId> = HashMap::new();
        for e in lower::reachable(self, &[root]) {
            let node = self.get(e).clone();
            let m = |x: &ExprId| memo.get(x).copied().unwrap_or(*x);
            let int = self.ty(e) == VTy::I64;
            let r = match node {
                E::Var(w) if w == v => with,
                E::Bin(BinaryOp::Add, a, b) if int => self.iadd(m(&a), m(&b)),
                E::Bin(BinaryOp::Mul, a, b) if int => self.imul(m(&a), m(&b)),
                E::Bin(op @ (BinaryOp::Div | BinaryOp::Rem), a, b) if int => {
                    let (a, b) = (m(&a), m(&b));
                    let c = self.int_value(b).filter(|&c| c > 0);
                    let nonneg = self.range(a, ext).is_some_and(|(lo, _)| lo >= 0);
                    match c {
                        Some(c) if nonneg && op == BinaryOp::Div => self.idiv_c(a, c, ext),
                        Some(c) if nonneg => self.irem_c(a, c, ext),
                        _ => self.add(E::Bin(op, a, b), VTy::I64),
                    }
                }
                E::IMax(a, b) | E::IMin(a, b) => {
                    let max = matches!(node, E::IMax(..));
                    let (a, b) = (m(&a), m(&b));
                    match (self.range(a, ext), self.range(b, ext)) {
                        (Some(ra), Some(rb)) if max && ra.0 >= rb.1 => a,
                        (Some(ra), Some(rb)) if max && rb.0 >= ra.1 => b,
                        (Some(ra), Some(rb)) if !max && ra.1 <= rb.0 => a,
                        (Some(ra), Some(rb)) if !max && rb.1 <= ra.0 => b,
                        _ if max => self.add(E::IMax(a, b), VTy::I64),
                        _ => self.add(E::IMin(a, b), VTy::I64),
                    }
                }
                E::Var(_) | E::Int(_) | E::F32(_) | E::I32(_) | E::Bool(_) | E::Acc => e,
                E::Load { buf, dtype, index } => self.add(
                    E::Load {
                        buf,
                        dtype,
                        index: m(&index),
                    },
                    self.ty(e),
                ),
                E::Un(op, a) => self.add(E::Un(op, m(&a)), self.ty(e)),
                E::Cast(t, a) => self.add(E::Cast(t, m(&a)), t),
                E::Round(d, a) => self.add(E::Round(d, m(&a)), VTy::F32),
                E::Bin(op, a, b) => self.add(E::Bin(op, m(&a), m(&b)), self.ty(e)),
                E::Select(c, a, b) => self.select(m(&c), m(&a), m(&b)),
                E::Reduce { op, vars, body } => self.add(
                    E::Reduce {
                        op,
                        vars,
                        body: m(&body),
                    },
                    self.ty(e),
                ),
                E::ArgMax { vars, body } => self.add(
                    E::ArgMax {
                        vars,
                        body: m(&body),
                    },
                    self.ty(e),
                ),
                E::Uniform { seed, index } => self.add(
                    E::Uniform {
                        seed,
                        index: m(&index),
                    },
                    self.ty(e),
                ),
            };
            memo.insert(e, r);
        }
        memo.get(&root).copied().unwrap_or(root)
    }

    /// `min(max(a, lo), hi)` on i64.
    pub fn clamp(&mut self, a: ExprId, lo: i64, hi: i64) -> ExprId {
        let l = self.int(lo);
        let h = self.int(hi);
        let m = self.add(E::IMax(a, l), VTy::I64);
        self.add(E::IMin(m, h), VTy::I64)
    }

    pub fn bin(&mut self, op: BinaryOp, a: ExprId, b: ExprId) -> ExprId {
        let ty = if op.is_comparison() || op.is_logical() {
            VTy::Bool
        } else {
            self.ty(a)
        };
        self.add(E::Bin(op, a, b), ty)
    }

    pub fn un(&mut self, op: UnaryOp, a: ExprId) -> ExprId {
        let ty = self.ty(a);
        self.add(E::Un(op, a), ty)
    }

    pub fn select(&mut self, c: ExprId, a: ExprId, b: ExprId) -> ExprId {
        if let E::Bool(v) = self.get(c) {
            return if *v { a } else { b };
        }
        if a == b {
            return a;
        }
        let ty = self.ty(a);
        self.add(E::Select(c, a, b), ty)
    }

    pub fn and(&mut self, a: ExprId, b: ExprId) -> ExprId {
        match (self.get(a), self.get(b)) {
            (E::Bool(true), _) => b,
            (_, E::Bool(true)) => a,
            _ => self.add(E::Bin(BinaryOp::And, a, b), VTy::Bool),
        }
    }

    /// `a` (f32) rounded to 16-bit `dtype`; other dtypes leave it as it is.
    pub fn round(&mut self, dtype: DType, a: ExprId) -> ExprId {
        let exact = matches!(self.get(a), E::Load { dtype: d, .. } | E::Round(d, _) if *d == dtype);
        if !matches!(dtype, DType::F16 | DType::BF16) || self.ty(a) != VTy::F32 || exact {
            return a;
        }
        self.add(E::Round(dtype, a), VTy::F32)
    }

    pub fn cast(&mut self, to: VTy, a: ExprId) -> ExprId {
        if self.ty(a) == to {
            return a;
        }
        self.add(E::Cast(to, a), to)
    }

    /// The affine form `c0 + Σ c_i v_i` of an index expression, if it is one.
    pub fn affine(&self, id: ExprId) -> Option<Affine> {
        self.affine_by(id, &|_| None)
    }

    /// [`ExprPool::affine`] where `atom` gives the affine form of the nodes that are neither
    /// constants, variables, sums nor products by constants (`None`: not affine).
    pub fn affine_by(&self, id: ExprId, atom: &dyn Fn(ExprId) -> Option<Affine>) -> Option<Affine> {
        match self.get(id) {
            E::Int(v) => Some(Affine {
                c0: *v,
                terms: Vec::new(),
            }),
            E::Var(v) => Some(Affine {
                c0: 0,
                terms: vec![(*v, 1)],
            }),
            E::Bin(BinaryOp::Add, a, b) if self.ty(id) == VTy::I64 => {
                match (self.affine_by(*a, atom), self.affine_by(*b, atom)) {
                    (Some(x), Some(y)) => Some(x.plus(&y)),
                    _ => self.affine_paired(id, atom),
                }
            }
            E::Bin(BinaryOp::Mul, a, b) if self.ty(id) == VTy::I64 => {
                match (self.int_value(*a), self.int_value(*b)) {
                    (Some(c), _) => Some(self.affine_by(*b, atom)?.scaled(c)),
                    (_, Some(c)) => Some(self.affine_by(*a, atom)?.scaled(c)),
                    _ => atom(id),
                }
            }
            _ => atom(id),
        }
    }

    /// The affine form of a sum whose quotient and remainder summands pair up:
    /// `(x / c) * (k * c) + (x % c) * k = x * k` (a reshape read back through the shape
    /// it came from: `[4096] -> [8, 512] -> [4096]`).
    fn affine_paired(&self, id: ExprId, atom: &dyn Fn(ExprId) -> Option<Affine>) -> Option<Affine> {
        let mut terms = Vec::new();
        let c0 = self.summands(id, 1, &mut terms)?;
        let mut acc = Affine {
            c0,
            terms: Vec::new(),
        };
        let mut used = vec![false; terms.len()];
        for i in 0..terms.len() {
            let (e, k) = terms[i];
            let E::Bin(BinaryOp::Rem, x, cc) = self.get(e) else {
                continue;
            };
            let Some(c) = self.int_value(*cc) else {
                continue;
            };
            let quotient = |&j: &usize| {
                let (q, kq) = terms[j];
                !used[j]
                    && Some(kq) == k.checked_mul(c)
                    && matches!(self.get(q), E::Bin(BinaryOp::Div, y, d)
                        if y == x && self.int_value(*d) == Some(c))
            };
            if let Some(j) = (0..terms.len()).find(quotient) {
                used[i] = true;
                used[j] = true;
                acc = acc.plus(&self.affine_by(*x, atom)?.scaled(k));
            }
        }
        if !used.contains(&true) {
            return None;
        }
        for (&(e, k), _) in terms.iter().zip(&used).filter(|(_, u)| !**u) {
            acc = acc.plus(&self.affine_by(e, atom)?.scaled(k));
        }
        Some(acc)
    }

    /// `e` rebuilt from its affine form where it is affine only through quotients and
    /// remainders that pair up ([`ExprPool::affine`]): a reshape read back costs no division.
    pub fn tidy(&mut self, e: ExprId) -> ExprId {
        if !self.divides(e) {
            return e;
        }
        match self.affine(e) {
            Some(af) => self.from_affine(&af),
            None => e,
        }
    }

    /// Whether `e` has a quotient or a remainder.
    fn divides(&self, e: ExprId) -> bool {
        match self.get(e) {
            E::Bin(BinaryOp::Div | BinaryOp::Rem, ..) => true,
            E::Bin(_, a, b) => self.divides(*a) || self.divides(*b),
            _ => false,
        }
    }

    /// Builds the expression of an affine form (terms in variable order: deterministic).
    pub fn from_affine(&mut self, a: &Affine) -> ExprId {
        let mut acc = self.int(a.c0);
        for &(v, c) in &a.terms {
            let x = self.var(v);
            let t = self.imul_c(x, c);
            acc = self.iadd(acc, t);
        }
        acc
    }
}

/// `c0 + Σ c_i v_i`, terms sorted by variable, no zero coefficients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Affine {
    pub c0: i64,
    pub terms: Vec<(Var, i64)>,
}

impl Affine {
    fn normalized(mut self) -> Affine {
        self.terms.sort_unstable();
        let mut out: Vec<(Var, i64)> = Vec::new();
        for (v, c) in self.terms {
            match out.last_mut() {
                Some((w, d)) if *w == v => *d += c,
                _ => out.push((v, c)),
            }
        }
        out.retain(|&(_, c)| c != 0);
        Affine {
            c0: self.c0,
            terms: out,
        }
    }

    pub fn plus(&self, o: &Affine) -> Affine {
        let mut terms = self.terms.clone();
        terms.extend_from_slice(&o.terms);
        Affine {
            c0: self.c0 + o.c0,
            terms,
        }
        .normalized()
    }

    pub fn scaled(&self, c: i64) -> Affine {
        Affine {
            c0: self.c0 * c,
            terms: self.terms.iter().map(|&(v, k)| (v, k * c)).collect(),
        }
        .normalized()
    }

    /// Coefficient of `v`.
    pub fn coef(&self, v: Var) -> i64 {
        self.terms
            .iter()
            .find(|t| t.0 == v)
            .map(|t| t.1)
            .unwrap_or(0)
    }

    /// Splits `self = c * hi + lo` with `0 <= lo < c` for every value of the variables
    /// (extents from `ext`), when the terms allow it exactly: terms whose coefficient `c`
    /// divides go to `hi`, the rest (and the constant) must stay within `[0, c)`.
    pub fn split(&self, c: i64, ext: &dyn Fn(Var) -> Option<usize>) -> Option<(Affine, Affine)> {
        if c <= 0 {
            return None;
        }
        let mut hi = Affine {
            c0: self.c0.div_euclid(c),
            terms: Vec::new(),
        };
        let mut lo = Affine {
            c0: self.c0.rem_euclid(c),
            terms: Vec::new(),
        };
        let (mut min, mut max) = (lo.c0, lo.c0);
        for &(v, k) in &self.terms {
            if k % c == 0 {
                hi.terms.push((v, k / c));
            } else {
                let e = ext(v)? as i64;
                let span = k * (e - 1).max(0);
                if span < 0 {
                    min += span;
                } else {
                    max += span;
                }
                lo.terms.push((v, k));
            }
        }
        (min >= 0 && max < c).then_some((hi, lo))
    }

    /// [`Affine::split`] by the greatest factor `g` of `c` (1 < g < c) that a term's
    /// coefficient shares with it and that splits: `(g, hi, lo)`.
    pub fn factor_split(
        &self,
        c: i64,
        ext: &dyn Fn(Var) -> Option<usize>,
    ) -> Option<(i64, Affine, Affine)> {
        if c <= 1 {
            return None;
        }
        let mut gs: Vec<i64> = self
            .terms
            .iter()
            .map(|&(_, k)| gcd(k.unsigned_abs(), c as u64) as i64)
            .filter(|&g| g > 1 && g < c)
            .collect();
        gs.sort_unstable_by(|a, b| b.cmp(a));
        gs.dedup();
        gs.into_iter()
            .find_map(|g| self.split(g, ext).map(|(hi, lo)| (g, hi, lo)))
    }
}

/// The greatest common divisor (0 with 0 gives 0).
pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// One store of a kernel: `buf[index] = value` (or `+=` when `accumulate`).
#[derive(Clone, Debug, PartialEq)]
pub struct Store {
    pub buf: NodeId,
    pub dtype: DType,
    pub index: ExprId,
    pub value: ExprId,
    pub accumulate: bool,
}

/// A matmul operand: `buf[base + Σ batch_i * batch_strides_i + row * rs + col * cs]`
/// (element strides; 0 broadcasts), or, with `gather`, any expression of the row and the
/// column (an implicit GEMM's view of a convolution's input windows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operand {
    pub buf: NodeId,
    pub dtype: DType,
    pub base: i64,
    pub batch_strides: Vec<i64>,
    pub rs: i64,
    pub cs: i64,
    pub gather: Option<Gather>,
}

/// An operand element computed by an expression of the kernel's pool: `value` with `row`
/// and `col` bound to the element's row and column. It reads only in-range elements for
/// rows and columns in range (padding is a masked, clamped load). `k_fast` says which way
/// its memory is contiguous: along `k` (the column of A, the row of B) or across it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gather {
    pub row: Var,
    pub col: Var,
    pub value: ExprId,
    pub k_fast: bool,
    /// `k` is a row-major flattening whose innermost axis has this extent (a window's
    /// channels, a row of output pixels): the CPU back end packs an operand run by run.
    pub k_inner: usize,
}

/// `C[batch.., i, j] = Σ_k A[batch.., i, k] * B[batch.., k, j]` with f32 accumulation.
/// The kernel's domain is `batch ++ rows ++ cols`, where `m` is the product of `rows` and
/// `n` that of `cols` (a plain matmul has `rows == [m]`, `cols == [n]`; a convolution as an
/// implicit GEMM has rows `[N, H, W]`); stores read the result through [`E::Acc`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matmul {
    pub batch: Vec<usize>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub rows: Vec<usize>,
    pub cols: Vec<usize>,
    /// Split-K: blocks sharing an output tile each sum a slice of `k` and add their part
    /// into the zeroed output (the kernel's only store accumulates the bare result). 1:
    /// no split.
    pub split_k: usize,
    /// Terms `A[i, k]·B[k, j]` that add nothing to any value read (structural zeros of an
    /// operand, or output elements no one reads: [`crate::analysis::zeros`]); a back end
    /// may skip them. Empty for most matmuls.
    pub skip: Vec<Skip>,
}

/// An axis of a matmul's iteration space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmAxis {
    I,
    J,
    K,
}

impl MmAxis {
    fn name(self) -> &'static str {
        match self {
            MmAxis::I => "i",
            MmAxis::J => "j",
            MmAxis::K => "k",
        }
    }
}

/// The terms of a matmul with `idx(hi) - idx(lo) > c` (causal attention's `softmax(q kᵀ)
/// v` skips `k - i > 0`, its scores `j - i > 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skip {
    pub lo: MmAxis,
    pub hi: MmAxis,
    pub c: i64,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}>{}", self.hi.name(), self.lo.name(), self.c)
    }
}

/// How the CPU back end shares an implicit GEMM (both operands gathered) out: `k` in
/// `splits` slices of `per_split` runs of `run` (at most `ks_max` values), the output in
/// `mtiles` row tiles of 4 and `ntiles` column tiles of 8, the columns in `npan` panels of
/// `pt` tiles (sized by `lower::CPU_PACK_B_BYTES`); a call's rows or panels go to the
/// runtime's GEMM helper in blocks (`back::clif`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuPanels {
    pub run: i64,
    pub runs: i64,
    pub splits: i64,
    pub per_split: i64,
    pub ks_max: i64,
    pub mtiles: i64,
    pub ntiles: i64,
    pub pt: i64,
    pub npan: i64,
    /// Threads take panels of columns (each call gathers all of A's rows) instead of row
    /// tiles (each call gathers all of B's columns). A call gathers the operand it does
    /// not split in full, so the split is along the larger side: a weight gradient (`m` =
    /// output channels, `n` = the window) splits its panels.
    pub by_panels: bool,
}

impl CpuPanels {
    /// Row tiles of 4 and column tiles of 8.
    pub const MR: i64 = 4;
    pub const NR: i64 = 8;

    /// Whether an implicit GEMM of `m` rows and `n` columns splits its columns rather than
    /// its rows across threads, when A fits the panel bound (`by_panels`).
    pub fn by_columns(m: usize, n: usize) -> bool {
        m < n && n > Self::NR as usize
    }

    /// The items of `[0, extent)` a CPU call's `[lo, hi)` ranges over: panels or row tiles.
    pub fn extent(&self) -> i64 {
        if self.by_panels {
            self.npan
        } else {
            self.mtiles
        }
    }
}

impl Matmul {
    /// The CPU tiling of an implicit GEMM; `None` unless both operands are gathered.
    pub fn cpu_panels(&self) -> Option<CpuPanels> {
        let (Some(ga), Some(_)) = (&self.a.gather, &self.b.gather) else {
            return None;
        };
        let pack = lower::CPU_PACK_B_BYTES as i64;
        let (mr, nr) = (CpuPanels::MR, CpuPanels::NR);
        let (m, n) = (self.m as i64, self.n as i64);
        let run = (ga.k_inner as i64).max(1);
        let runs = self.k as i64 / run;
        let splits = (self.split_k as i64).clamp(1, runs.max(1));
        let per_split = (runs + splits - 1) / splits;
        let ks_max = per_split * run;
        let mtiles = (m + mr - 1) / mr;
        let ntiles = (n + nr - 1) / nr;
        let tile_bytes = (ks_max * nr * 4).max(1);
        let fit = (pack / tile_bytes).clamp(1, ntiles.max(1));
        // Panels on threads: A whole must fit the same bound as a panel of B, and there
        // must be panels to share: up to 16 of them.
        let by_panels = CpuPanels::by_columns(self.m, self.n) && mtiles * mr * ks_max * 4 <= pack;
        let pt = if by_panels {
            fit.min((ntiles + 15) / 16).max(1)
        } else {
            fit
        };
        let npan = (ntiles + pt - 1) / pt;
        Some(CpuPanels {
            run,
            runs,
            splits,
            per_split,
            ks_max,
            mtiles,
            ntiles,
            pt,
            npan,
            by_panels,
        })
    }

    /// What a CPU call's `[lo, hi)` ranges over: an implicit GEMM's panels or row tiles
    /// ([`Matmul::cpu_panels`]), otherwise row tiles of 4 of every batch index.
    pub fn cpu_extent(&self) -> u64 {
        match self.cpu_panels() {
            Some(p) => p.extent() as u64,
            None => self.batch.iter().product::<usize>() as u64 * self.m.div_ceil(4) as u64,
        }
    }

    /// Both operands strided and the domain `batch ++ [m, n]`: what every matmul path
    /// handles (gathers and split rows or columns only the FFMA SGEMM, the tiled FFMA
    /// path, the tensor cores' implicit GEMM for 16-bit runs, and the per-element one).
    pub fn is_plain(&self) -> bool {
        self.a.gather.is_none()
            && self.b.gather.is_none()
            && self.rows.len() == 1
            && self.cols.len() == 1
            && self.split_k == 1
    }
}

/// Fused attention (`graph::Op::Attention`): for every batch index and query row `i`,
/// `o[i, :] = Σ_j softmax_j(mask(q[i] · k[j] · scale)) v[j, :]` and `lse[i]`, the row
/// log-sum-exp, without storing the scores. Operands are strided views (`q`: rows `t`,
/// columns `d`; `k`: `s` × `d`; `v`: `s` × `e`); outputs too (`lse`'s `cs` is unused).
/// `causal` keeps `j - i <= s - t`. The back end owns the loops; the kernel's stores
/// name the buffers written (for liveness), their values are not evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Attn {
    pub batch: Vec<usize>,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub e: usize,
    pub causal: bool,
    pub scale: f32,
    pub q: Operand,
    pub k: Operand,
    pub v: Option<Operand>,
    pub o: Option<Operand>,
    pub lse: Option<Operand>,
    /// The backward pass ([`crate::ir::Op::AttentionGrad`]): `o` is then its result.
    pub grad: Option<AttnGrad>,
}

/// What an attention gradient kernel reads besides `q`, `k` and `v`, and which gradient it
/// stores: `dq` (`[t, d]`), or with `kv` `dk` then `dv` along the row (`[s, d + e]`).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnGrad {
    pub kv: bool,
    /// The output's gradient, rows `t`, columns `e`.
    pub dout: Operand,
    /// The forward's row statistics and `rowsum(dout ∘ o)` (f32, one column each).
    pub lse: Operand,
    pub delta: Operand,
}

impl Attn {
    /// The operands the kernel reads: (what, operand, rows, columns).
    pub fn reads(&self) -> Vec<(&'static str, &Operand, usize, usize)> {
        let mut v = vec![
            ("attention q", &self.q, self.t, self.d),
            ("attention k", &self.k, self.s, self.d),
        ];
        if let Some(x) = &self.v {
            v.push(("attention v", x, self.s, self.e));
        }
        if let Some(gr) = &self.grad {
            v.push(("attention dout", &gr.dout, self.t, self.e));
            v.push(("attention lse", &gr.lse, self.t, 1));
            v.push(("attention delta", &gr.delta, self.t, 1));
        }
        v
    }
}

/// One fused kernel.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub name: String,
    pub domain: Vec<usize>,
    pub pool: ExprPool,
    pub stores: Vec<Store>,
    pub matmul: Option<Matmul>,
    /// A fused attention kernel (CUDA only).
    pub attention: Option<Attn>,
    /// Graph nodes computed by this kernel (root last), for descriptions.
    pub nodes: Vec<NodeId>,
    /// False when stores accumulate (iterations of the outer loop may touch the same
    /// element).
    pub parallel: bool,
    /// One line naming the fused ops.
    pub describe: String,
    /// An `all_reduce`'s kernel, with its operand: the kernel copies the operand into the
    /// result's buffer, which the ranks of a data-parallel step then sum in place (on one
    /// rank the kernel alone is the whole op).
    pub collective: Option<NodeId>,
}

impl Kernel {
    /// Extent of the outermost loop (what the runtime splits across threads).
    pub fn outer_extent(&self) -> u64 {
        self.domain.first().copied().unwrap_or(1) as u64
    }

    /// The expression nodes the stores need (pool order, children first). The pool may
    /// hold nodes interned while lowering that nothing uses.
    pub fn live_nodes(&self) -> Vec<ExprId> {
        let roots: Vec<ExprId> = self
            .stores
            .iter()
            .flat_map(|s| [s.index, s.value])
            .collect();
        lower::reachable(&self.pool, &roots)
    }

    /// Every buffer the kernel loads from.
    pub fn loads(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .live_nodes()
            .into_iter()
            .filter_map(|e| match self.pool.get(e) {
                E::Load { buf, .. } => Some(*buf),
                _ => None,
            })
            .collect();
        v.extend(self.operand_loads());
        v.sort();
        v.dedup();
        v
    }

    /// The buffers the matmul's operands read: a strided operand's buffer, every load of a
    /// gather (unsorted, with repeats).
    pub fn operand_loads(&self) -> Vec<NodeId> {
        let mut v = Vec::new();
        if let Some(at) = &self.attention {
            v.extend(at.reads().into_iter().map(|(_, o, _, _)| o.buf));
        }
        if let Some(mm) = &self.matmul {
            for op in [&mm.a, &mm.b] {
                match &op.gather {
                    None => v.push(op.buf),
                    Some(gt) => v.extend(
                        lower::reachable(&self.pool, &[gt.value])
                            .into_iter()
                            .filter_map(|e| match self.pool.get(e) {
                                E::Load { buf, .. } => Some(*buf),
                                _ => None,
                            }),
                    ),
                }
            }
        }
        v
    }

    /// The live nodes computed in the loop of variable `v` (`None`: before every loop),
    /// given each node's loop (see `kernel::sites`).
    pub fn at_site(live: &[ExprId], site: &[Option<Var>], v: Option<Var>) -> Vec<ExprId> {
        live.iter()
            .copied()
            .filter(|e| site[e.0 as usize] == v)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Evaluates an i64 index expression at `vals` (variables by number); i64 `/` and `%`
    /// truncate as in the back ends.
    fn eval(p: &ExprPool, e: ExprId, vals: &[i64]) -> i64 {
        let r = |x: &ExprId| eval(p, *x, vals);
        match p.get(e) {
            E::Int(v) => *v,
            E::Var(v) => vals[*v as usize],
            E::Bin(BinaryOp::Add, a, b) => r(a) + r(b),
            E::Bin(BinaryOp::Mul, a, b) => r(a) * r(b),
            E::Bin(BinaryOp::Div, a, b) => r(a) / r(b),
            E::Bin(BinaryOp::Rem, a, b) => r(a) % r(b),
            E::IMin(a, b) => r(a).min(r(b)),
            E::IMax(a, b) => r(a).max(r(b)),
            other => panic!("not an index: {other:?}"),
        }
    }

    fn count(p: &ExprPool, root: ExprId, op: BinaryOp) -> usize {
        crate::kernel::lower::reachable(p, &[root])
            .into_iter()
            .filter(|&x| matches!(p.get(x), E::Bin(o, _, _) if *o == op))
            .count()
    }

    /// A concat piece's index (`clamp(v1 - 16, 0, 23)`) under a row-major flattening and a
    /// split into `[.., 2, 12]`: quotients and remainders of the sum keep only the clamp.
    #[test]
    fn sums_split_around_bounded_summands() {
        let ext = |v: Var| [3usize, 40][v as usize..].first().copied();
        let mut p = ExprPool::default();
        p.reserve_vars(2);
        let (v0, v1) = (p.var(0), p.var(1));
        let shifted = p.iadd_c(v1, -16);
        let piece = p.clamp(shifted, 0, 23);
        let row = p.imul_c(v0, 24);
        let flat = p.iadd(row, piece);
        let outer = p.idiv_c(flat, 12, &ext);
        let half = p.irem_c(outer, 2, &ext);
        let inner = p.irem_c(flat, 12, &ext);
        let whole = p.idiv_c(flat, 24, &ext);
        for (e, divs, rems) in [(half, 1, 0), (inner, 0, 1), (whole, 0, 0)] {
            assert_eq!(count(&p, e, BinaryOp::Div), divs);
            assert_eq!(count(&p, e, BinaryOp::Rem), rems);
        }
        for a in 0..3 {
            for b in 0..40 {
                let f = eval(&p, flat, &[a, b]);
                assert_eq!(eval(&p, half, &[a, b]), (f / 12) % 2);
                assert_eq!(eval(&p, inner, &[a, b]), f % 12);
                assert_eq!(eval(&p, whole, &[a, b]), f / 24);
            }
        }
        assert_eq!(p.range(piece, &ext), Some((0, 23)));
        assert_eq!(p.range(half, &ext), Some((0, 1)));
    }

    /// A `[64, 16]` tensor reshaped to `[8, 8, 16]` and back (the reshapes of gpt's logits
    /// gradient): the flat index `v0 * 16 + v1` divided by 128 is `v0 / 8`, and the
    /// quotient and remainder recombine into an affine index again.
    #[test]
    fn reshapes_read_back_are_affine() {
        let ext = |v: Var| [64usize, 16][v as usize..].first().copied();
        let mut p = ExprPool::default();
        p.reserve_vars(2);
        let (v0, v1) = (p.var(0), p.var(1));
        let row = p.imul_c(v0, 16);
        let flat = p.iadd(row, v1);
        let outer = p.idiv_c(flat, 128, &ext);
        let rest = p.irem_c(flat, 128, &ext);
        let inner = p.idiv_c(rest, 16, &ext);
        assert_eq!(count(&p, outer, BinaryOp::Div), 1);
        let back = p.imul_c(outer, 8);
        let back = p.iadd(back, inner);
        let back = p.imul_c(back, 16);
        let col = p.irem_c(rest, 16, &ext);
        let back = p.iadd(back, col);
        let af = p.affine(back);
        assert_eq!(af, p.affine(flat));
        assert_eq!(af.map(|a| a.terms), Some(vec![(0, 16), (1, 1)]));
        for a in 0..64 {
            for b in 0..16 {
                let f = a * 16 + b;
                assert_eq!(eval(&p, outer, &[a, b]), f / 128);
                assert_eq!(eval(&p, rest, &[a, b]), f % 128);
                assert_eq!(eval(&p, back, &[a, b]), f);
            }
        }
        // A quotient without its remainder stays as it is.
        let lone = p.imul_c(outer, 8);
        let lone = p.iadd(lone, v1);
        assert_eq!(p.affine(lone), None);
    }

    /// A window's `k = (i * 3 + j) * 32 + c`, unflattened as the lowering does and read
    /// back with `k = t * 32 + u`: the channel is `u`, the tap `t` (no division left for
    /// `c`), and a clamp the range already keeps is gone.
    #[test]
    fn substituted_runs_simplify() {
        let mut p = ExprPool::default();
        p.reserve_vars(1);
        let (kv, t, u) = (p.fresh_var(), p.fresh_var(), p.fresh_var());
        let ext = |v: Var| match v {
            _ if v == kv => Some(288),
            _ if v == t => Some(9),
            _ if v == u => Some(32),
            _ => Some(5),
        };
        let k = p.var(kv);
        let c = p.irem_c(k, 32, &ext);
        let tap = p.idiv_c(k, 32, &ext);
        let i = p.idiv_c(tap, 3, &ext);
        let j = p.irem_c(tap, 3, &ext);
        let cc = p.clamp(c, 0, 31);
        let row = p.var(0);
        let a = p.imul_c(row, 7);
        let idx = p.iadd(a, cc);
        let ti = p.var(t);
        let ti = p.imul_c(ti, 32);
        let ui = p.var(u);
        let with = p.iadd(ti, ui);
        let c2 = p.substitute_index(c, kv, with, &ext);
        assert_eq!(p.get(c2), &E::Var(u));
        let tap2 = p.substitute_index(tap, kv, with, &ext);
        assert_eq!(p.get(tap2), &E::Var(t));
        let idx2 = p.substitute_index(idx, kv, with, &ext);
        let af = p.affine(idx2).expect("the clamp folds away");
        assert_eq!(af.terms, vec![(0, 7), (u, 1)]);
        for tt in 0..9 {
            for uu in 0..32 {
                let kk = tt * 32 + uu;
                let (i2, j2) = (
                    p.substitute_index(i, kv, with, &ext),
                    p.substitute_index(j, kv, with, &ext),
                );
                let vals = |x: i64| {
                    let mut v = vec![0i64; 4];
                    v[t as usize] = tt;
                    v[u as usize] = uu;
                    v[kv as usize] = x;
                    v
                };
                assert_eq!(eval(&p, i2, &vals(0)), eval(&p, i, &vals(kk)));
                assert_eq!(eval(&p, j2, &vals(0)), eval(&p, j, &vals(kk)));
            }
        }
    }
}
