//! Lowering graph nodes into kernel expressions.
//!
//! [`Builder::value`] gives the expression of node `n` at a multi-index: a load when `n`
//! has a buffer, otherwise `n`'s own expression over its operands' values (the node is
//! fused). Views only transform the index. When an index could leave an operand's bounds
//! (concat branches, convolution padding, embedding ids), it is clamped and the value is
//! masked, so no load ever reads outside its buffer.
//!
//! Matmuls become [`Matmul`] anchors over strided operands. With
//! [`Decisions::conv_gemm`], convolutions and their gradients do too, as implicit
//! GEMMs whose operands are [`Gather`]s: the value of an input window at (row, k), built
//! by the same `guarded`/`window`/`untap` arithmetic as the direct loops (`conv_gemm`).

use super::{
    Attn, AttnGrad, ExprId, ExprPool, Gather, Kernel, Matmul, MmAxis, Operand, Red, Skip, Store,
    VTy, Var, E,
};
use crate::analysis::zeros::{Region, Zeros};
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, PoolKind, ReduceOp, Scalar};
use std::collections::BTreeSet;

/// Why a kernel could not be built as decided.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The node must get a buffer of its own (a matmul operand that is not a strided view
    /// of a buffer, a matmul that cannot be an epilogue's anchor, ...). Fusion retries.
    #[error("node %{} must be materialized", .0.index())]
    Materialize(NodeId),
    #[error("kernel lowering: {0}")]
    Internal(String),
}

type Res<T> = Result<T, LowerError>;

/// What fusion decided, as the lowering needs it.
pub struct Decisions<'a> {
    pub g: &'a Graph,
    /// Nodes with a buffer (leaves included).
    pub materialized: &'a BTreeSet<NodeId>,
    /// Physical layouts of buffers that are not row-major in their logical axes: the
    /// logical axis of each physical axis, outermost first (`[0, 2, 3, 1]` is NHWC for a
    /// logical NCHW tensor).
    pub layouts: &'a std::collections::BTreeMap<NodeId, Vec<usize>>,
    /// CUDA: convolutions may become implicit-GEMM anchors, and a large f16/bf16 matmul
    /// (f32 under TF32) may read a B contiguous along `k` in place.
    pub implicit_gemm: bool,
    /// Convolutions (one group, f32 or one 16-bit dtype) may become implicit-GEMM anchors:
    /// on CUDA always, on the CPU within [`cpu_conv_gemm_ok`]'s bounds.
    pub conv_gemm: bool,
    /// An f32 matmul may read a B contiguous along `k` in place (CUDA without TF32).
    pub k_major_f32: bool,
    /// Structural zeros and unread regions, for the matmuls' [`Skip`]s.
    pub zeros: &'a Zeros,
}

impl Decisions<'_> {
    /// The physical order of `n`'s axes (identity when row-major).
    pub fn layout(&self, n: NodeId) -> Vec<usize> {
        match self.layouts.get(&n) {
            Some(p) => p.clone(),
            None => (0..self.g.ty(n).rank()).collect(),
        }
    }
}

/// True for ops lowered as a matmul anchor: f32, f16 or bf16 operands of the result's
/// dtype (accumulation is f32 in every case), both of rank 2 or more.
pub fn matmul_anchor_ok(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    matches!(node.op, Op::MatMul)
        && matches!(node.ty.dtype, DType::F32 | DType::F16 | DType::BF16)
        && node
            .inputs
            .iter()
            .all(|&i| g.ty(i).rank() >= 2 && g.ty(i).dtype == node.ty.dtype)
}

/// Output tiles of the FFMA implicit GEMM below which a weight gradient splits its `k`.
const SPLIT_K_TILES: usize = crate::target::TARGET.sms;
/// The least `k` each split of a weight gradient sums.
const SPLIT_K_MIN_DEPTH: usize = 1024;

/// Bytes of a panel of a CPU implicit GEMM's B, `k` rows (of one split) times the panel's
/// columns: the budget that sizes the panels threads take and the splits of `k`
/// ([`crate::kernel::CpuPanels`]; the back end gathers blocks into the runtime's buffers,
/// a chunk of `k` at a time).
pub const CPU_PACK_B_BYTES: usize = 128 * 1024;
/// The greatest `k` of one split of a CPU implicit GEMM (at least one column tile of B
/// within the panel budget); a weight gradient splits its `k` below it.
pub const CPU_MAX_K: usize = CPU_PACK_B_BYTES / (8 * 4);
/// The greatest window (`k`) of a CPU convolution or input gradient run as an implicit GEMM:
/// twice [`CPU_MAX_K`], so that 3×3 windows over 512 channels (ResNet's last stage, VGG) take
/// it.
pub const CPU_MAX_WINDOW_K: usize = 2 * CPU_MAX_K;

/// How many slices of `k` a convolution's weight gradient is split into when lowered as an
/// implicit GEMM (1: not split). Its `k` is every output pixel of the batch (131072 for the
/// stem of a ResNet on CIFAR at batch 128) while its output is small (64 × 27). On CUDA,
/// unsplit, a handful of blocks would run the whole sum; on the CPU (`cuda` false) each
/// split keeps within the panel budget (`CPU_PACK_B_BYTES`): all of A's rows where threads
/// take panels of B's columns, else all of B's columns (where a split of one output row
/// still does). The split slices add into a zeroed buffer.
pub fn conv_split_k(g: &Graph, n: NodeId, cuda: bool) -> usize {
    let node = g.node(n);
    let Op::Conv2dGradWeight { groups: 1, .. } = node.op else {
        return 1;
    };
    if node.ty.dtype != DType::F32 || node.inputs.iter().any(|&i| g.ty(i).dtype != DType::F32) {
        return 1;
    }
    let wd = node.ty.dims();
    let dy = g.ty(node.inputs[1]).dims();
    if wd.len() != 4 || dy.len() != 4 {
        return 1;
    }
    let (m, ncols) = (wd[0], wd[1] * wd[2] * wd[3]);
    let k = dy[0] * dy[2] * dy[3];
    if !cuda {
        // Splits are whole output rows (runs of `ow` pixels). Where threads take panels of
        // the columns (`Matmul::cpu_panels`: fewer rows than columns), A's rows are packed
        // whole and B a column tile at a time, so A bounds the split; otherwise every
        // column of B must fit the panel.
        let (run, runs) = (dy[3].max(1), dy[0] * dy[2]);
        let rows = m.div_ceil(4) * 4;
        let cols = ncols.div_ceil(8) * 8;
        let packed = if super::CpuPanels::by_columns(m, ncols) {
            rows
        } else {
            cols
        };
        let depth = (CPU_PACK_B_BYTES / (4 * packed)).max(run).min(CPU_MAX_K);
        let per_split = (depth / run).max(1);
        return runs.div_ceil(per_split).clamp(1, 4096);
    }
    // Operands widened from 16 bits (mixed precision's weight gradients) run on the
    // tensor cores' 128×128 tiles, f32 ones on the FFMA SGEMM's 128×128 (or 128×64,
    // 64×128) tiles: stage 3 of the cnn (256 × 2304) is 36 tiles. Outputs the SGEMM
    // refuses (fewer than 65536 elements) run on 64×64 tiles with these (more) splits.
    let tile = 128;
    let tiles = m.div_ceil(tile) * ncols.div_ceil(tile);
    // Thin outputs take the per-element path, which does not split.
    if tiles >= SPLIT_K_TILES || k < 2 * SPLIT_K_MIN_DEPTH || m < 16 || ncols < 16 {
        return 1;
    }
    // About two waves of blocks.
    (2 * SPLIT_K_TILES)
        .div_ceil(tiles)
        .min(k / SPLIT_K_MIN_DEPTH)
        .clamp(1, 256)
}

/// Whether `n` is a cast of a 16-bit float to f32 (mixed precision widening an operand).
pub fn widening(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    matches!(node.op, Op::Cast { to: DType::F32 })
        && node
            .inputs
            .first()
            .is_some_and(|&x| matches!(g.ty(x).dtype, DType::F16 | DType::BF16))
}

/// Whether the CPU runs convolution `n` as an implicit GEMM: `k` (the window, or a weight
/// gradient's split of the pixels) fits the packed buffers and every run of `k`'s innermost
/// axis fits a split.
pub fn cpu_conv_gemm_ok(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    let d1 = g.ty(node.inputs[1]).dims();
    if d1.len() != 4 {
        return false;
    }
    match node.op {
        Op::Conv2d { .. } => d1[1] * d1[2] * d1[3] <= CPU_MAX_WINDOW_K,
        Op::Conv2dGradInput { .. } => d1[0] * d1[2] * d1[3] <= CPU_MAX_WINDOW_K,
        Op::Conv2dGradWeight { .. } => d1[3] <= CPU_MAX_K,
        _ => false,
    }
}

/// The loop order of a CPU kernel whose root is convolution `n` (or its input gradient)
/// stored channels-first (an output of the step, a param's gradient): `[N, H, W, C]`, so
/// that its implicit GEMM's rows lead the domain as they must; its stores follow the
/// buffer's layout. `None` where the convolution is not an implicit GEMM on the CPU or
/// its buffer is channels-last already.
pub fn cpu_conv_domain(d: &Decisions<'_>, n: NodeId) -> Option<Vec<usize>> {
    let g = d.g;
    // The convolution is the root or fused below it through elementwise ops of its shape
    // (its epilogue).
    let mut stack = vec![n];
    let mut conv = None;
    while let Some(x) = stack.pop() {
        let op = &g.node(x).op;
        if matches!(op, Op::Conv2d { .. } | Op::Conv2dGradInput { .. }) {
            conv = Some(x);
            break;
        }
        if x == n || (!d.materialized.contains(&x) && op.is_elementwise()) {
            stack.extend(
                g.node(x)
                    .inputs
                    .iter()
                    .filter(|&&i| !d.materialized.contains(&i) && g.ty(i).shape == g.ty(n).shape),
            );
        }
    }
    let c = conv?;
    let node = g.node(c);
    let groups = match node.op {
        Op::Conv2d { groups, .. } | Op::Conv2dGradInput { groups, .. } => groups,
        _ => return None,
    };
    let order = vec![0, 2, 3, 1];
    let ok = d.conv_gemm
        && !d.implicit_gemm
        && groups == 1
        && node.ty.dtype.is_float()
        && node.ty.rank() == 4
        && node.inputs.iter().all(|&i| g.ty(i).dtype == node.ty.dtype)
        && cpu_conv_gemm_ok(g, c)
        && d.layout(n) != order;
    ok.then_some(order)
}

/// The logical axes of a convolution's result that are its implicit GEMM's rows.
fn conv_row_axes(op: &Op) -> &'static [usize] {
    match op {
        Op::Conv2dGradWeight { .. } => &[0],
        _ => &[0, 2, 3],
    }
}

/// Builds one kernel.
pub struct Builder<'a> {
    d: &'a Decisions<'a>,
    pub pool: ExprPool,
    ext: rustc_hash::FxHashMap<Var, usize>,
    domain: Vec<usize>,
    dvars: Vec<ExprId>,
    root: NodeId,
    /// Further nodes this kernel computes and stores (never loads) beside `root`.
    guests: Vec<NodeId>,
    pub matmul: Option<(NodeId, Matmul)>,
    memo: rustc_hash::FxHashMap<(NodeId, Vec<ExprId>), ExprId>,
    /// Fused nodes visited (root excluded).
    pub fused: BTreeSet<NodeId>,
    /// Reductions made for fused (non-root) nodes, to check where they are evaluated.
    pub fused_reductions: Vec<(ExprId, NodeId)>,
    /// Products met after the kernel's anchor: each needs a buffer of its own. Lowering goes
    /// on past them (with a placeholder value) so that one fusion round finds them all: a
    /// sum of N products (a weight's gradient over N unrolled steps) took N rounds, each
    /// rebuilding every kernel (1,000 steps: quadratic, 36 s).
    pub extra_anchors: Vec<NodeId>,
    /// Whether the caller reads [`Self::extra_anchors`] (fusion's main kernels); other
    /// builders fail at the first extra product, as before.
    pub defer_extra_anchors: bool,
}

fn contiguous_strides(dims: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1] as i64;
    }
    s
}

impl<'a> Builder<'a> {
    pub fn new(d: &'a Decisions<'a>, root: NodeId, domain: Vec<usize>) -> Builder<'a> {
        let mut pool = ExprPool::default();
        pool.reserve_vars(domain.len() as u32);
        let mut ext = rustc_hash::FxHashMap::default();
        let mut dvars = Vec::new();
        for (i, &e) in domain.iter().enumerate() {
            ext.insert(i as Var, e);
            dvars.push(pool.var(i as Var));
        }
        Builder {
            d,
            pool,
            ext,
            domain,
            dvars,
            root,
            guests: Vec::new(),
            matmul: None,
            memo: Default::default(),
            fused: BTreeSet::new(),
            fused_reductions: Vec::new(),
            extra_anchors: Vec::new(),
            defer_extra_anchors: false,
        }
    }

    /// Lets the kernel compute `guests` too (each stored by the caller), where it would
    /// load them from their buffers.
    pub fn with_guests(mut self, guests: Vec<NodeId>) -> Self {
        self.guests = guests;
        self
    }

    pub fn domain_vars(&self) -> Vec<ExprId> {
        self.dvars.clone()
    }

    fn fresh(&mut self, extent: usize) -> (Var, ExprId) {
        let v = self.pool.fresh_var();
        self.ext.insert(v, extent);
        (v, self.pool.var(v))
    }

    /// Element index of logical index `idx` in `n`'s buffer (its physical layout).
    pub fn buffer_index(&mut self, n: NodeId, idx: &[ExprId]) -> ExprId {
        let dims = self.d.g.ty(n).dims().to_vec();
        let p = self.d.layout(n);
        let pidx: Vec<ExprId> = p.iter().map(|&a| idx[a]).collect();
        let pdims: Vec<usize> = p.iter().map(|&a| dims[a]).collect();
        self.linear(&pidx, &pdims)
    }

    /// The logical index of a kernel whose domain is `n`'s physical shape.
    pub fn logical_index(&self, n: NodeId) -> Vec<ExprId> {
        self.index_in(&self.d.layout(n))
    }

    /// The logical index of the domain point when the domain runs over the logical axes
    /// in order `p` (outermost first).
    pub fn index_in(&self, p: &[usize]) -> Vec<ExprId> {
        let mut idx = self.dvars.clone();
        for (i, &a) in p.iter().enumerate() {
            if let Some(&v) = self.dvars.get(i) {
                idx[a] = v;
            }
        }
        idx
    }

    /// The index into the last node of `chain` (reshapes and permutes, each the next's
    /// operand, the first reading `n`) of the element at `idx` in `n`: the views' index
    /// maps run backwards.
    pub fn view_up(&mut self, n: NodeId, idx: &[ExprId], chain: &[NodeId]) -> Vec<ExprId> {
        let g = self.d.g;
        let mut cur = idx.to_vec();
        let mut dims = g.ty(n).dims().to_vec();
        for &v in chain {
            let out_dims = g.ty(v).dims().to_vec();
            cur = match &g.node(v).op {
                Op::Permute { perm } => perm.iter().map(|&p| cur[p]).collect(),
                _ => {
                    let lin = self.linear(&cur, &dims);
                    self.unflatten(lin, &out_dims)
                }
            };
            dims = out_dims;
        }
        cur
    }

    /// Row-major linear index of `idx` in `dims`.
    pub fn linear(&mut self, idx: &[ExprId], dims: &[usize]) -> ExprId {
        let s = contiguous_strides(dims);
        let mut acc = self.pool.int(0);
        for (i, &x) in idx.iter().enumerate() {
            if dims[i] == 1 {
                // The index of a size-1 axis is 0 (dropping it keeps equal indices equal).
                continue;
            }
            let t = self.pool.imul_c(x, s[i]);
            acc = self.pool.iadd(acc, t);
        }
        acc
    }

    fn idiv(&mut self, a: ExprId, c: i64) -> ExprId {
        let ext = &self.ext;
        self.pool.idiv_c(a, c, &|v| ext.get(&v).copied())
    }

    fn irem(&mut self, a: ExprId, c: i64) -> ExprId {
        let ext = &self.ext;
        self.pool.irem_c(a, c, &|v| ext.get(&v).copied())
    }

    fn unflatten(&mut self, lin: ExprId, dims: &[usize]) -> Vec<ExprId> {
        let s = contiguous_strides(dims);
        (0..dims.len())
            .map(|i| {
                let q = self.idiv(lin, s[i]);
                if i == 0 {
                    q
                } else {
                    self.irem(q, dims[i] as i64)
                }
            })
            .collect()
    }

    /// The index of an operand of shape `od` broadcast to an output indexed by `idx`.
    fn broadcast(&mut self, idx: &[ExprId], od: &[usize]) -> Vec<ExprId> {
        let off = idx.len() - od.len();
        od.iter()
            .enumerate()
            .map(|(i, &d)| {
                if d == 1 {
                    self.pool.int(0)
                } else {
                    idx[off + i]
                }
            })
            .collect()
    }

    /// Value of `n` at `idx`, with indices clamped into bounds and the value replaced by
    /// `fill` where `guard` is false.
    fn guarded(&mut self, n: NodeId, idx: &[ExprId], guard: ExprId, fill: f64) -> Res<ExprId> {
        let dims = self.d.g.ty(n).dims().to_vec();
        let cl: Vec<ExprId> = idx
            .iter()
            .zip(&dims)
            .map(|(&x, &d)| self.pool.clamp(x, 0, d as i64 - 1))
            .collect();
        let v = self.value(n, &cl)?;
        let ty = self.pool.ty(v);
        let f = self.pool.constant(fill, ty);
        Ok(self.pool.select(guard, v, f))
    }

    fn in_range(&mut self, x: ExprId, hi: usize) -> ExprId {
        let z = self.pool.int(0);
        let h = self.pool.int(hi as i64);
        let a = self.pool.bin(BinaryOp::Ge, x, z);
        let b = self.pool.bin(BinaryOp::Lt, x, h);
        self.pool.and(a, b)
    }

    fn scalar(&mut self, v: Scalar, dtype: DType) -> ExprId {
        let ty = VTy::of(dtype);
        match v {
            Scalar::Float(f) => self.pool.constant(f, ty),
            Scalar::Int(i) => self.pool.constant(i as f64, ty),
            Scalar::Bool(b) => self.pool.constant(if b { 1.0 } else { 0.0 }, ty),
        }
    }

    /// The expression of node `n` at multi-index `idx` (one i64 per axis of `n`).
    pub fn value(&mut self, n: NodeId, idx: &[ExprId]) -> Res<ExprId> {
        let key = (n, idx.to_vec());
        if let Some(&e) = self.memo.get(&key) {
            return Ok(e);
        }
        let e = self.value_uncached(n, idx)?;
        // A 16-bit value computed here (not stored by this kernel) is rounded as the
        // interpreter rounds it; what the kernel stores is rounded by the store.
        let stored = n == self.root || self.guests.contains(&n);
        let e = if stored {
            e
        } else {
            self.pool.round(self.d.g.node(n).ty.dtype, e)
        };
        self.memo.insert(key, e);
        Ok(e)
    }

    fn value_uncached(&mut self, n: NodeId, idx: &[ExprId]) -> Res<ExprId> {
        let g = self.d.g;
        let node = g.node(n);
        let is_root = n == self.root || self.guests.contains(&n);
        if !is_root && self.d.materialized.contains(&n) {
            let index = self.buffer_index(n, idx);
            let index = self.pool.tidy(index);
            return Ok(self.pool.add(
                E::Load {
                    buf: n,
                    dtype: node.ty.dtype,
                    index,
                },
                VTy::of(node.ty.dtype),
            ));
        }
        if !is_root && !matches!(node.op, Op::Literal { .. }) {
            self.fused.insert(n);
        }
        if let Some(r) = self.conv_gemm_rows(n, idx) {
            return self.conv_gemm(n, idx, r);
        }
        let dims = node.ty.dims().to_vec();
        let ins = node.inputs.clone();
        let ity = |k: usize| g.ty(ins[k]).clone();
        let out_ty = VTy::of(node.ty.dtype);
        match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Grad => Err(
                LowerError::Internal(format!("`{}` has no expression", node.op.name())),
            ),
            Op::Literal { value, dtype } => Ok(self.scalar(*value, *dtype)),
            Op::Full { value, ty } => Ok(self.scalar(*value, ty.dtype)),
            Op::Arange { .. } => Ok(self.pool.cast(VTy::I32, idx[0])),
            Op::Unary(u) => {
                let i0 = self.broadcast(idx, ity(0).dims());
                let x = self.value(ins[0], &i0)?;
                Ok(self.pool.un(*u, x))
            }
            Op::Binary(b) => {
                let i0 = self.broadcast(idx, ity(0).dims());
                let i1 = self.broadcast(idx, ity(1).dims());
                let x = self.value(ins[0], &i0)?;
                let y = self.value(ins[1], &i1)?;
                Ok(self.pool.bin(*b, x, y))
            }
            Op::Where => {
                let i0 = self.broadcast(idx, ity(0).dims());
                let i1 = self.broadcast(idx, ity(1).dims());
                let i2 = self.broadcast(idx, ity(2).dims());
                let c = self.value(ins[0], &i0)?;
                let a = self.value(ins[1], &i1)?;
                let b = self.value(ins[2], &i2)?;
                Ok(self.pool.select(c, a, b))
            }
            Op::Cast { to } => {
                let x = self.value(ins[0], idx)?;
                Ok(self.pool.cast(VTy::of(*to), x))
            }
            Op::Reshape { .. } => {
                let lin = self.linear(idx, &dims);
                let in_dims = ity(0).dims().to_vec();
                let i0 = self.unflatten(lin, &in_dims);
                self.value(ins[0], &i0)
            }
            Op::Permute { perm } => {
                let mut i0 = vec![self.pool.int(0); perm.len()];
                for (a, &p) in perm.iter().enumerate() {
                    i0[p] = idx[a];
                }
                self.value(ins[0], &i0)
            }
            Op::BroadcastTo { .. } => {
                let i0 = self.broadcast(idx, ity(0).dims());
                self.value(ins[0], &i0)
            }
            Op::Slice { ranges } => {
                let i0: Vec<ExprId> = idx
                    .iter()
                    .zip(ranges)
                    .map(|(&x, &(s, _))| self.pool.iadd_c(x, s as i64))
                    .collect();
                self.value(ins[0], &i0)
            }
            Op::Select { axis, index } => {
                let mut i0 = idx.to_vec();
                let c = self.pool.int(*index as i64);
                i0.insert(*axis, c);
                self.value(ins[0], &i0)
            }
            Op::Concat { axis } => {
                // Last operand first; each earlier one wins below its end.
                let mut starts = Vec::new();
                let mut s = 0usize;
                for &i in &ins {
                    starts.push(s);
                    s += g.ty(i).dims()[*axis];
                }
                let mut acc: Option<ExprId> = None;
                for k in (0..ins.len()).rev() {
                    let len = g.ty(ins[k]).dims()[*axis];
                    if len == 0 {
                        continue;
                    }
                    // The piece is lowered at a fresh index of its own extent, which the
                    // views below it simplify as any bounded index (gpt's q, k and v
                    // gradients: 22 divisions an element fewer), then clamped in place.
                    let mut ik = idx.to_vec();
                    let shifted = self.pool.iadd_c(idx[*axis], -(starts[k] as i64));
                    let (w, wv) = self.fresh(len);
                    ik[*axis] = wv;
                    let v = self.value(ins[k], &ik)?;
                    let clamped = self.pool.clamp(shifted, 0, len as i64 - 1);
                    let v = self.pool.substitute(v, w, clamped);
                    acc = Some(match acc {
                        None => v,
                        Some(later) => {
                            let end = self.pool.int((starts[k] + len) as i64);
                            let c = self.pool.bin(BinaryOp::Lt, idx[*axis], end);
                            self.pool.select(c, v, later)
                        }
                    });
                }
                acc.ok_or_else(|| LowerError::Internal("empty concat".into()))
            }
            Op::Embedding => {
                let (table, ids) = (ins[0], ins[1]);
                let td = g.ty(table).dims().to_vec();
                let r = idx.len();
                let id = self.value(ids, &idx[..r - 1])?;
                let id64 = self.pool.cast(VTy::I64, id);
                let row = self.pool.clamp(id64, 0, td[0] as i64 - 1);
                self.value(table, &[row, idx[r - 1]])
            }
            Op::Dropout { p, seed } => {
                let x = self.value(ins[0], idx)?;
                let lin = self.linear(idx, &dims);
                let u = self.pool.add(
                    E::Uniform {
                        seed: *seed,
                        index: lin,
                    },
                    VTy::F32,
                );
                let pc = self.pool.f32(*p as f32);
                let keep = self.pool.bin(BinaryOp::Ge, u, pc);
                let sc = self.pool.f32((1.0 / (1.0 - p)) as f32);
                let scaled = self.pool.bin(BinaryOp::Mul, x, sc);
                let z = self.pool.f32(0.0);
                Ok(self.pool.select(keep, scaled, z))
            }
            Op::Tri { upper, k } => {
                let x = self.value(ins[0], idx)?;
                let r = idx.len();
                let neg_i = self.pool.imul_c(idx[r - 2], -1);
                let diff = self.pool.iadd(idx[r - 1], neg_i);
                let kc = self.pool.int(*k);
                let keep = if *upper {
                    self.pool.bin(BinaryOp::Ge, diff, kc)
                } else {
                    self.pool.bin(BinaryOp::Le, diff, kc)
                };
                let z = self.pool.constant(0.0, out_ty);
                Ok(self.pool.select(keep, x, z))
            }
            Op::Reduce { op, axes, keepdim } => {
                let xd = ity(0).dims().to_vec();
                let mut vars = Vec::new();
                let mut ix = Vec::with_capacity(xd.len());
                let mut o = 0usize;
                let mut count = 1usize;
                for (a, &d) in xd.iter().enumerate() {
                    if axes.contains(&a) {
                        let (v, ve) = self.fresh(d);
                        vars.push((v, d));
                        ix.push(ve);
                        count *= d;
                        if *keepdim {
                            o += 1;
                        }
                    } else {
                        ix.push(idx[o]);
                        o += 1;
                    }
                }
                let body = self.value(ins[0], &ix)?;
                let red = match op {
                    ReduceOp::Sum | ReduceOp::Mean => Red::Sum,
                    ReduceOp::Max => Red::Max,
                    ReduceOp::Min => Red::Min,
                };
                let ty = self.pool.ty(body);
                let r = self.pool.add(
                    E::Reduce {
                        op: red,
                        vars,
                        body,
                    },
                    ty,
                );
                self.note_reduction(r, n);
                if *op == ReduceOp::Mean {
                    let c = self.pool.constant(count.max(1) as f64, ty);
                    Ok(self.pool.bin(BinaryOp::Div, r, c))
                } else {
                    Ok(r)
                }
            }
            Op::ArgMax { axis, keepdim } => {
                let xd = ity(0).dims().to_vec();
                let mut vars = Vec::new();
                let mut ix = Vec::new();
                let mut o = 0usize;
                for (a, &d) in xd.iter().enumerate() {
                    if axis.is_none_or(|ax| ax == a) {
                        let (v, ve) = self.fresh(d);
                        vars.push((v, d));
                        ix.push(ve);
                        if *keepdim {
                            o += 1;
                        }
                    } else {
                        ix.push(idx[o]);
                        o += 1;
                    }
                }
                let body = self.value(ins[0], &ix)?;
                let r = self.pool.add(E::ArgMax { vars, body }, VTy::I64);
                self.note_reduction(r, n);
                Ok(self.pool.cast(VTy::I32, r))
            }
            Op::MatMul => self.matmul_value(n, idx),
            Op::Conv2d {
                stride,
                padding,
                groups,
            } => {
                let (x, w) = (ins[0], ins[1]);
                let (xd, wd) = (g.ty(x).dims().to_vec(), g.ty(w).dims().to_vec());
                let (cpg, kh, kw) = (wd[1], wd[2], wd[3]);
                let opg = (wd[0] / (*groups).max(1)) as i64;
                let (vc, c) = self.fresh(cpg);
                let (vi, i) = self.fresh(kh);
                let (vj, j) = self.fresh(kw);
                let grp = self.idiv(idx[1], opg);
                let gbase = self.pool.imul_c(grp, cpg as i64);
                let ch = self.pool.iadd(gbase, c);
                let (ih, iw, gd) =
                    self.window([idx[2], idx[3]], *stride, [i, j], *padding, [xd[2], xd[3]]);
                let xv = self.guarded(x, &[idx[0], ch, ih, iw], gd, 0.0)?;
                let wv = self.value(w, &[idx[1], c, i, j])?;
                let body = self.pool.bin(BinaryOp::Mul, xv, wv);
                Ok(self.reduction(n, Red::Sum, vec![(vc, cpg), (vi, kh), (vj, kw)], body))
            }
            Op::Conv2dGradInput {
                stride,
                padding,
                groups,
                ..
            } => {
                let (dy, w) = (ins[0], ins[1]);
                let (yd, wd) = (g.ty(dy).dims().to_vec(), g.ty(w).dims().to_vec());
                let (cpg, kh, kw) = (wd[1] as i64, wd[2], wd[3]);
                let opg = wd[0] / (*groups).max(1);
                let (vo, oo) = self.fresh(opg);
                let (vi, i) = self.fresh(kh);
                let (vj, j) = self.fresh(kw);
                let grp = self.idiv(idx[1], cpg);
                let cc = self.irem(idx[1], cpg);
                let obase = self.pool.imul_c(grp, opg as i64);
                let o = self.pool.iadd(obase, oo);
                let (oh, gh) = self.untap(idx[2], stride[0], i, padding[0], yd[2]);
                let (ow, gw) = self.untap(idx[3], stride[1], j, padding[1], yd[3]);
                let gd = self.pool.and(gh, gw);
                let gv = self.guarded(dy, &[idx[0], o, oh, ow], gd, 0.0)?;
                let wv = self.value(w, &[o, cc, i, j])?;
                let body = self.pool.bin(BinaryOp::Mul, gv, wv);
                Ok(self.reduction(n, Red::Sum, vec![(vo, opg), (vi, kh), (vj, kw)], body))
            }
            Op::Conv2dGradWeight {
                stride,
                padding,
                groups,
                ..
            } => {
                let (x, dy) = (ins[0], ins[1]);
                let (xd, yd) = (g.ty(x).dims().to_vec(), g.ty(dy).dims().to_vec());
                let cpg = dims[1] as i64;
                let opg = (dims[0] / (*groups).max(1)) as i64;
                let (vn, nn) = self.fresh(yd[0]);
                let (vh, oh) = self.fresh(yd[2]);
                let (vw, ow) = self.fresh(yd[3]);
                let grp = self.idiv(idx[0], opg);
                let gbase = self.pool.imul_c(grp, cpg);
                let ch = self.pool.iadd(gbase, idx[1]);
                let (ih, iw, gd) = self.window(
                    [oh, ow],
                    *stride,
                    [idx[2], idx[3]],
                    *padding,
                    [xd[2], xd[3]],
                );
                let xv = self.guarded(x, &[nn, ch, ih, iw], gd, 0.0)?;
                let gv = self.value(dy, &[nn, idx[0], oh, ow])?;
                let body = self.pool.bin(BinaryOp::Mul, xv, gv);
                Ok(self.reduction(
                    n,
                    Red::Sum,
                    vec![(vn, yd[0]), (vh, yd[2]), (vw, yd[3])],
                    body,
                ))
            }
            Op::Pool2d {
                kind,
                kernel,
                stride,
                padding,
            } => {
                let x = ins[0];
                let xd = g.ty(x).dims().to_vec();
                let (vi, i) = self.fresh(kernel[0]);
                let (vj, j) = self.fresh(kernel[1]);
                let (ih, iw, gd) =
                    self.window([idx[2], idx[3]], *stride, [i, j], *padding, [xd[2], xd[3]]);
                let vars = vec![(vi, kernel[0]), (vj, kernel[1])];
                match kind {
                    PoolKind::Max => {
                        let body =
                            self.guarded(x, &[idx[0], idx[1], ih, iw], gd, f64::NEG_INFINITY)?;
                        Ok(self.reduction(n, Red::Max, vars, body))
                    }
                    PoolKind::Avg => {
                        let body = self.guarded(x, &[idx[0], idx[1], ih, iw], gd, 0.0)?;
                        let s = self.reduction(n, Red::Sum, vars, body);
                        let area = self.pool.f32((kernel[0] * kernel[1]) as f32);
                        Ok(self.pool.bin(BinaryOp::Div, s, area))
                    }
                }
            }
            Op::Pool2dGrad {
                kind: PoolKind::Avg,
                kernel,
                stride,
                padding,
            } => {
                let dy = ins[1];
                let yd = g.ty(dy).dims().to_vec();
                let (vi, i) = self.fresh(kernel[0]);
                let (vj, j) = self.fresh(kernel[1]);
                let (oh, gh) = self.untap(idx[2], stride[0], i, padding[0], yd[2]);
                let (ow, gw) = self.untap(idx[3], stride[1], j, padding[1], yd[3]);
                let gd = self.pool.and(gh, gw);
                let body = self.guarded(dy, &[idx[0], idx[1], oh, ow], gd, 0.0)?;
                let s = self.reduction(n, Red::Sum, vec![(vi, kernel[0]), (vj, kernel[1])], body);
                let area = self.pool.f32((kernel[0] * kernel[1]) as f32);
                Ok(self.pool.bin(BinaryOp::Div, s, area))
            }
            Op::Pool2dGrad {
                kind: PoolKind::Max,
                ..
            }
            | Op::EmbeddingGrad { .. } => Err(LowerError::Internal(format!(
                "`{}` is a scatter kernel, not an expression",
                node.op.name()
            ))),
            Op::Attention { .. } | Op::AttentionLse { .. } | Op::AttentionGrad { .. } => {
                Err(LowerError::Internal(format!(
                    "`{}` is an attention kernel, not an expression",
                    node.op.name()
                )))
            }
            // Fusion gives the operand and the result buffers; the kernel copies one into
            // the other, which the ranks then reduce in place.
            Op::AllReduce => self.value(ins[0], idx),
            // The placeholders the data-parallel executors replace by the collective (see
            // `Op::Shard`): rank 0's elements, as if alone.
            Op::ReduceScatter { .. } | Op::Shard { .. } => {
                let in_dims = ity(0).dims().to_vec();
                let i0 = self.unflatten(idx[0], &in_dims);
                self.value(ins[0], &i0)
            }
            Op::AllGather { .. } => {
                let lin = self.linear(idx, &dims);
                let shard = ity(0).shape.numel() as i64;
                let i0 = self.irem(lin, shard);
                self.value(ins[0], &[i0])
            }
        }
    }

    /// The input position of a 2-D window tap and whether it lies inside the `hw` image:
    /// `(o * stride + tap - pad)` per axis.
    fn window(
        &mut self,
        o: [ExprId; 2],
        stride: [usize; 2],
        tap: [ExprId; 2],
        pad: [usize; 2],
        hw: [usize; 2],
    ) -> (ExprId, ExprId, ExprId) {
        let ih = self.tap(o[0], stride[0], tap[0], pad[0]);
        let iw = self.tap(o[1], stride[1], tap[1], pad[1]);
        let gh = self.in_range(ih, hw[0]);
        let gw = self.in_range(iw, hw[1]);
        (ih, iw, self.pool.and(gh, gw))
    }

    /// `o * stride + tap - pad`.
    fn tap(&mut self, o: ExprId, stride: usize, tap: ExprId, pad: usize) -> ExprId {
        let a = self.pool.imul_c(o, stride as i64);
        let b = self.pool.iadd(a, tap);
        self.pool.iadd_c(b, -(pad as i64))
    }

    /// The output position `o` with `o * stride + tap - pad == i`, and whether it exists.
    fn untap(
        &mut self,
        i: ExprId,
        stride: usize,
        tap: ExprId,
        pad: usize,
        out: usize,
    ) -> (ExprId, ExprId) {
        let nt = self.pool.imul_c(tap, -1);
        let a = self.pool.iadd_c(i, pad as i64);
        let t = self.pool.iadd(a, nt);
        let z = self.pool.int(0);
        let nonneg = self.pool.bin(BinaryOp::Ge, t, z);
        if stride == 1 {
            let inr = self.in_range(t, out);
            return (t, self.pool.and(nonneg, inr));
        }
        // Divide max(t, 0): where t < 0 the guard is false anyway, and a non-negative
        // dividend lets back ends divide in 32 bits.
        let s = self.pool.int(stride as i64);
        let tp = self.pool.add(E::IMax(t, z), VTy::I64);
        let q = self.pool.add(E::Bin(BinaryOp::Div, tp, s), VTy::I64);
        let r = self.pool.add(E::Bin(BinaryOp::Rem, tp, s), VTy::I64);
        let exact = self.pool.bin(BinaryOp::Eq, r, z);
        let inr = self.in_range(q, out);
        let a = self.pool.and(nonneg, exact);
        (q, self.pool.and(a, inr))
    }

    fn reduction(&mut self, n: NodeId, op: Red, vars: Vec<(Var, usize)>, body: ExprId) -> ExprId {
        let ty = self.pool.ty(body);
        let r = self.pool.add(E::Reduce { op, vars, body }, ty);
        self.note_reduction(r, n);
        r
    }

    fn note_reduction(&mut self, r: ExprId, n: NodeId) {
        if n != self.root {
            self.fused_reductions.push((r, n));
        }
    }

    /// A product after the kernel's anchor: recorded in [`Self::extra_anchors`] (the kernel
    /// is not built: fusion gives them buffers and runs again) and a placeholder value.
    fn extra_anchor(&mut self, n: NodeId) -> Res<ExprId> {
        if !self.defer_extra_anchors {
            return Err(LowerError::Materialize(n));
        }
        self.extra_anchors.push(n);
        Ok(self.pool.constant(0.0, VTy::F32))
    }

    /// A matmul: the kernel's anchor when it can be (float, ranks ≥ 2, evaluated at the
    /// kernel's own domain point), else a sum over `k`.
    fn matmul_value(&mut self, n: NodeId, idx: &[ExprId]) -> Res<ExprId> {
        let g = self.d.g;
        let node = g.node(n);
        let dims = node.ty.dims().to_vec();
        if matmul_anchor_ok(g, n) {
            let identity = idx == self.dvars.as_slice() && dims == self.domain;
            if identity && self.matmul.is_some() {
                return self.extra_anchor(n);
            }
            if !identity {
                return Err(LowerError::Materialize(n));
            }
            let mm = self.matmul_spec(n)?;
            self.matmul = Some((n, mm));
            return Ok(self.pool.add(E::Acc, VTy::F32));
        }
        // General form: promote 1-D operands, broadcast batch dims.
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let (ad, bd) = (g.ty(a).dims().to_vec(), g.ty(b).dims().to_vec());
        let kdim = ad[ad.len() - 1];
        let (vk, k) = self.fresh(kdim);
        let r = idx.len();
        let ai: Vec<ExprId> = if ad.len() == 1 {
            vec![k]
        } else {
            let bo = if bd.len() == 1 { r } else { r - 1 };
            let mut batch_idx: Vec<ExprId> = idx[..bo - 1].to_vec();
            let i = idx[bo - 1];
            let bdims = &ad[..ad.len() - 2];
            batch_idx = self.broadcast(&batch_idx, bdims);
            batch_idx.push(i);
            batch_idx.push(k);
            batch_idx
        };
        let bi: Vec<ExprId> = if bd.len() == 1 {
            vec![k]
        } else {
            let j = idx[r - 1];
            let nb = if ad.len() == 1 { r - 1 } else { r - 2 };
            let bdims = &bd[..bd.len() - 2];
            let mut batch_idx = self.broadcast(&idx[..nb], bdims);
            batch_idx.push(k);
            batch_idx.push(j);
            batch_idx
        };
        let x = self.value(a, &ai)?;
        let y = self.value(b, &bi)?;
        let body = self.pool.bin(BinaryOp::Mul, x, y);
        Ok(self.reduction(n, Red::Sum, vec![(vk, kdim)], body))
    }

    /// When convolution `n` at `idx` is lowered as an implicit GEMM, how many leading
    /// domain axes are its rows (`None`: it is not). It is when: [`Decisions::conv_gemm`]
    /// (on the CPU within [`cpu_conv_gemm_ok`]), f32 (or one 16-bit dtype throughout: loads
    /// widen to f32, the tiles accumulate in f32), one group, and
    /// evaluated at the kernel's own domain point (every logical axis one domain variable
    /// of the same extent) with its GEMM rows as the domain's leading axes (`[N, H, W]` of
    /// a channels-last output; `O` of a weight gradient).
    fn conv_gemm_rows(&self, n: NodeId, idx: &[ExprId]) -> Option<usize> {
        let g = self.d.g;
        let node = g.node(n);
        let groups = match &node.op {
            Op::Conv2d { groups, .. }
            | Op::Conv2dGradInput { groups, .. }
            | Op::Conv2dGradWeight { groups, .. } => *groups,
            _ => return None,
        };
        if !self.d.conv_gemm
            || (!self.d.implicit_gemm && !cpu_conv_gemm_ok(g, n))
            || groups != 1
            || !node.ty.dtype.is_float()
            || node.inputs.iter().any(|&i| g.ty(i).dtype != node.ty.dtype)
            || idx.len() != 4
            || self.domain.len() != 4
        {
            return None;
        }
        let dims = node.ty.dims();
        // The domain position of each logical axis; an axis of extent 1 may be the
        // constant 0 instead (a broadcast index).
        let mut pos: [Option<usize>; 4] = [None; 4];
        let mut seen = [false; 4];
        for (l, &e) in idx.iter().enumerate() {
            match self.dvars.iter().position(|&v| v == e) {
                Some(p) if self.domain[p] == dims[l] && !seen[p] => {
                    seen[p] = true;
                    pos[l] = Some(p);
                }
                None if dims[l] == 1 && matches!(self.pool.get(e), E::Int(0)) => {}
                _ => return None,
            }
        }
        // Unmapped domain axes must have extent 1.
        if (0..4).any(|p| !seen[p] && self.domain[p] != 1) {
            return None;
        }
        let row_axes = conv_row_axes(&node.op);
        let is_row = |l: usize| row_axes.contains(&l);
        let r = (0..4)
            .filter(|&l| is_row(l))
            .filter_map(|l| pos[l])
            .max()
            .map_or(0, |p| p + 1);
        let cols_after = (0..4)
            .filter(|&l| !is_row(l))
            .filter_map(|l| pos[l])
            .all(|p| p >= r);
        (cols_after && (1..4).contains(&r)).then_some(r)
    }

    /// A convolution or one of its gradients as an implicit GEMM: the kernel's anchor, with
    /// both operands gathered from the inputs' windows, over `r` row axes (see
    /// [`Self::conv_gemm_rows`]).
    ///
    /// | op | rows | columns | k (fastest last) | A | B |
    /// |---|---|---|---|---|---|
    /// | conv2d | n, oh, ow | o | i, j, c | x window | w |
    /// | grad input | n, h, w | c | i, j, o | dy (untapped) | w |
    /// | grad weight | o | c, i, j (domain order) | n, oh, ow | dy | x window |
    ///
    /// With channels-last activations, `k`'s fastest axis is the contiguous channel axis of
    /// the gathered activation (conv2d and grad input).
    fn conv_gemm(&mut self, n: NodeId, idx: &[ExprId], r: usize) -> Res<ExprId> {
        if self.matmul.is_some() {
            return self.extra_anchor(n);
        }
        let g = self.d.g;
        let node = g.node(n).clone();
        let (i0, i1) = (node.inputs[0], node.inputs[1]);
        let (d0, d1) = (g.ty(i0).dims().to_vec(), g.ty(i1).dims().to_vec());
        let rows = self.domain[..r].to_vec();
        let cols = self.domain[r..].to_vec();
        let (m, nc) = (
            rows.iter().product::<usize>(),
            cols.iter().product::<usize>(),
        );
        // Logical coordinates of a flattened row (or column) index.
        let coords = |b: &mut Self, lin: ExprId, dims: &[usize], first: usize| {
            let parts = b.unflatten(lin, dims);
            // Axes of extent 1 outside the domain's mapping are 0.
            let zero = b.pool.int(0);
            let mut out: Vec<Option<ExprId>> = idx
                .iter()
                .map(|&e| matches!(b.pool.get(e), E::Int(0)).then_some(zero))
                .collect();
            for (q, p) in parts.into_iter().enumerate() {
                let dv = b.dvars[first + q];
                if let Some(l) = idx.iter().position(|&e| e == dv) {
                    out[l] = Some(p);
                }
            }
            out
        };
        let channels_last = |b: &Self, x: NodeId| b.d.layout(x) == [0, 2, 3, 1];
        // k: the window of the weight's input channels (conv2d), of its output channels
        // (input gradient), or every output pixel of the batch (weight gradient); the
        // products of the same dims of the second operand in each case.
        let k = match node.op {
            Op::Conv2d { .. } => d1[1] * d1[2] * d1[3],
            _ => d1[0] * d1[2] * d1[3],
        };
        // The innermost axis of `k`'s order: the channels of a window, the columns of the
        // output gradient's pixels.
        let k_inner = match node.op {
            Op::Conv2d { .. } => d1[1],
            Op::Conv2dGradInput { .. } => d1[0],
            _ => d1[3],
        };
        // A's (row, k) and B's (k, column), and the logical coordinates of both.
        let (vr, row) = self.fresh(m);
        let (vk, kk) = self.fresh(k);
        let (vk2, kk2) = self.fresh(k);
        let (vc, col) = self.fresh(nc);
        let rc = coords(self, row, &rows, 0);
        let cc = coords(self, col, &cols, r);
        let saved = std::mem::take(&mut self.fused);
        let operands = match node.op {
            Op::Conv2d {
                stride, padding, ..
            } => {
                let (c, kh, kw) = (d1[1], d1[2], d1[3]);
                let ([Some(nn), _, Some(oh), Some(ow)], [_, Some(o), _, _]) = (&rc[..], &cc[..])
                else {
                    return Err(self.internal("conv2d coordinates"));
                };
                let (nn, oh, ow, o) = (*nn, *oh, *ow, *o);
                let (ci, ii, jj) = self.split_k(kk, kh, kw, c);
                let (ih, iw, gd) = self.window([oh, ow], stride, [ii, jj], padding, [d0[2], d0[3]]);
                let a = self.guarded(i0, &[nn, ci, ih, iw], gd, 0.0)?;
                let (ci2, ii2, jj2) = self.split_k(kk2, kh, kw, c);
                let b = self.value(i1, &[o, ci2, ii2, jj2])?;
                ((a, channels_last(self, i0)), (b, true))
            }
            Op::Conv2dGradInput {
                stride, padding, ..
            } => {
                let (o, kh, kw) = (d1[0], d1[2], d1[3]);
                let ([Some(nn), _, Some(h), Some(w)], [_, Some(ch), _, _]) = (&rc[..], &cc[..])
                else {
                    return Err(self.internal("conv2d_grad_input coordinates"));
                };
                let (nn, h, w, ch) = (*nn, *h, *w, *ch);
                let (oi, ii, jj) = self.split_k(kk, kh, kw, o);
                let (oh, gh) = self.untap(h, stride[0], ii, padding[0], d0[2]);
                let (ow, gw) = self.untap(w, stride[1], jj, padding[1], d0[3]);
                let gd = self.pool.and(gh, gw);
                let a = self.guarded(i0, &[nn, oi, oh, ow], gd, 0.0)?;
                let (oi2, ii2, jj2) = self.split_k(kk2, kh, kw, o);
                let b = self.value(i1, &[oi2, ch, ii2, jj2])?;
                ((a, channels_last(self, i0)), (b, false))
            }
            Op::Conv2dGradWeight {
                stride, padding, ..
            } => {
                // Operands [x, dy]; A is dy (rows o), B the windows of x.
                let ([Some(o), _, _, _], [_, Some(ch), Some(ii), Some(jj)]) = (&rc[..], &cc[..])
                else {
                    return Err(self.internal("conv2d_grad_weight coordinates"));
                };
                let (o, ch, ii, jj) = (*o, *ch, *ii, *jj);
                let pix = [d1[0], d1[2], d1[3]];
                let kd = self.unflatten(kk, &pix);
                let a = self.value(i1, &[kd[0], o, kd[1], kd[2]])?;
                let kd2 = self.unflatten(kk2, &pix);
                let (ih, iw, gd) =
                    self.window([kd2[1], kd2[2]], stride, [ii, jj], padding, [d0[2], d0[3]]);
                let b = self.guarded(i0, &[kd2[0], ch, ih, iw], gd, 0.0)?;
                ((a, !channels_last(self, i1)), (b, !channels_last(self, i0)))
            }
            _ => return Err(self.internal("not a convolution")),
        };
        let ((av, a_fast), (bv, b_fast)) = operands;
        let (ar, ac, br, bc) = (vr, vk, vk2, vc);
        // A gather holding a reduction would run it per element of every tile: give the
        // operand a buffer instead.
        for (v, x) in [(av, i0), (bv, i1)] {
            let has_reduction = reachable(&self.pool, &[v])
                .into_iter()
                .any(|e| matches!(self.pool.get(e), E::Reduce { .. } | E::ArgMax { .. }));
            if has_reduction {
                self.fused = saved;
                return Err(LowerError::Materialize(x));
            }
        }
        let fused = std::mem::replace(&mut self.fused, saved);
        self.fused.extend(fused);
        let operand = |buf: NodeId, row: Var, col: Var, value: ExprId, k_fast: bool| Operand {
            buf,
            dtype: DType::F32,
            base: 0,
            batch_strides: Vec::new(),
            rs: 0,
            cs: 0,
            gather: Some(Gather {
                row,
                col,
                value,
                k_fast,
                k_inner,
            }),
        };
        let (abuf, bbuf) = match node.op {
            Op::Conv2dGradWeight { .. } => (i1, i0),
            _ => (i0, i1),
        };
        let mm = Matmul {
            batch: Vec::new(),
            m,
            n: nc,
            k,
            a: operand(abuf, ar, ac, av, a_fast),
            b: operand(bbuf, br, bc, bv, b_fast),
            rows,
            cols,
            split_k: 1,
            skip: Vec::new(),
        };
        self.matmul = Some((n, mm));
        Ok(self.pool.add(E::Acc, VTy::F32))
    }

    /// `k = (i * kw + j) * c + ch`: the tap-major, channel-minor order of a window.
    fn split_k(&mut self, k: ExprId, kh: usize, kw: usize, c: usize) -> (ExprId, ExprId, ExprId) {
        let parts = self.unflatten(k, &[kh, kw, c]);
        (parts[2], parts[0], parts[1])
    }

    fn internal(&self, what: &str) -> LowerError {
        LowerError::Internal(format!("implicit GEMM: unexpected {what}"))
    }

    /// Strides of a matmul operand that is a strided view of a buffer.
    fn operand(&mut self, x: NodeId, batch: &[usize], rows: usize, cols: usize) -> Res<Operand> {
        let xd = self.d.g.ty(x).dims().to_vec();
        let mut vars = Vec::new();
        let mut bidx = Vec::new();
        for &d in batch {
            let (v, e) = self.fresh(d);
            vars.push(v);
            bidx.push(e);
        }
        let (vr, r) = self.fresh(rows);
        let (vc, c) = self.fresh(cols);
        let mut idx = self.broadcast(&bidx, &xd[..xd.len() - 2]);
        idx.push(r);
        idx.push(c);
        let saved = std::mem::take(&mut self.fused);
        let v = self.value(x, &idx)?;
        let fused = std::mem::replace(&mut self.fused, saved);
        let (buf, dtype, index) = match self.pool.get(v) {
            E::Load { buf, dtype, index } => (*buf, *dtype, *index),
            _ => return Err(LowerError::Materialize(x)),
        };
        let Some(af) = self.pool.affine(index) else {
            return Err(LowerError::Materialize(x));
        };
        self.fused.extend(fused);
        let known: Vec<Var> = vars.iter().copied().chain([vr, vc]).collect();
        if af.terms.iter().any(|t| !known.contains(&t.0)) {
            return Err(LowerError::Materialize(x));
        }
        Ok(Operand {
            buf,
            dtype,
            base: af.c0,
            batch_strides: vars.iter().map(|&v| af.coef(v)).collect(),
            rs: af.coef(vr),
            cs: af.coef(vc),
            gather: None,
        })
    }

    fn matmul_spec(&mut self, n: NodeId) -> Res<Matmul> {
        let g = self.d.g;
        let node = g.node(n);
        let dims = node.ty.dims().to_vec();
        let r = dims.len();
        let (m, nn) = (dims[r - 2], dims[r - 1]);
        let k = g.ty(node.inputs[0]).dims()[g.ty(node.inputs[0]).rank() - 1];
        let batch = dims[..r - 2].to_vec();
        let a = self.operand(node.inputs[0], &batch, m, k)?;
        let b = self.operand(node.inputs[1], &batch, k, nn)?;
        // The tiled loops read rows of B as vectors: a B that is not contiguous along its
        // columns (a transposed view) is copied once, contiguously. Except on CUDA for an
        // f16/bf16 B (f32 under TF32) contiguous along `k` and large enough for Hopper's
        // wgmma tiles, which read it as it lies (K-major), and for an f32 B contiguous
        // along `k` without TF32, which every FFMA path loads along `k` (gpt: 84 copies of
        // weights and of attention's `k^T` a step fewer), or on the CPU, whose GEMM helper
        // packs B from any layout.
        let tensor_core = match b.dtype {
            DType::F16 | DType::BF16 => true,
            // `k_major_f32` is off on CUDA exactly under TF32.
            DType::F32 => !self.d.k_major_f32,
            _ => false,
        };
        // Elements of a 16-byte chunk, and of the 128 bytes of `k` of a wgmma stage.
        let chunk = 16 / b.dtype.size_bytes().max(1) as i64;
        let k_major_wgmma = self.d.implicit_gemm
            && tensor_core
            && a.dtype == b.dtype
            && b.rs == 1
            && b.cs > 0
            && b.cs % chunk == 0
            && m >= 128
            && nn >= 128
            && k as i64 >= 8 * chunk
            && k.is_multiple_of(chunk as usize);
        let k_major_f32 =
            self.d.k_major_f32 && b.dtype == DType::F32 && a.dtype == DType::F32 && b.rs == 1;
        if b.cs != 1 && nn > 1 && !k_major_wgmma && !k_major_f32 {
            return Err(LowerError::Materialize(node.inputs[1]));
        }
        Ok(Matmul {
            batch,
            m,
            n: nn,
            k,
            a,
            b,
            rows: vec![m],
            cols: vec![nn],
            split_k: 1,
            skip: self.skips(n),
        })
    }

    /// The terms of matmul `n` that its operands' structural zeros and its unread outputs
    /// let a back end skip.
    fn skips(&self, n: NodeId) -> Vec<Skip> {
        let g = self.d.g;
        let node = g.node(n);
        let mut out = Vec::new();
        // The last two axes of each tensor, as axes of the iteration space.
        let mut add = |x: NodeId, r: Option<Region>, axes: [MmAxis; 2]| {
            let rank = g.ty(x).rank();
            let Some(r) = r else { return };
            let at = |a: usize| match rank.checked_sub(a) {
                Some(2) => Some(axes[0]),
                Some(1) => Some(axes[1]),
                _ => None,
            };
            if let (Some(lo), Some(hi)) = (at(r.lo), at(r.hi)) {
                out.push(Skip { lo, hi, c: r.c });
            }
        };
        let (a, b) = (node.inputs[0], node.inputs[1]);
        if g.ty(a).rank() >= 2 && g.ty(b).rank() >= 2 {
            add(a, self.d.zeros.zero(a), [MmAxis::I, MmAxis::K]);
            add(b, self.d.zeros.zero(b), [MmAxis::K, MmAxis::J]);
            add(
                n,
                self.d.zeros.unread.get(&n).copied(),
                [MmAxis::I, MmAxis::J],
            );
        }
        out
    }

    /// Finishes the kernel with the given stores.
    pub fn finish(self, name: String, stores: Vec<Store>, parallel: bool) -> Kernel {
        let mut nodes: Vec<NodeId> = self.fused.iter().copied().collect();
        nodes.extend(&self.guests);
        nodes.push(self.root);
        let describe = nodes
            .iter()
            .map(|&x| format!("{} %{}", self.d.g.node(x).op.name(), x.index()))
            .collect::<Vec<_>>()
            .join(", ");
        let root = self.d.g.node(self.root);
        let collective = root
            .op
            .is_collective()
            .then(|| root.inputs.first().copied())
            .flatten();
        Kernel {
            name,
            domain: self.domain,
            pool: self.pool,
            stores,
            matmul: self.matmul.map(|m| m.1),
            attention: None,
            nodes,
            parallel,
            describe,
            collective,
        }
    }
}

/// Free variables of every node of a pool (variables not bound by a reduction inside).
pub fn free_vars(pool: &ExprPool) -> Vec<BTreeSet<Var>> {
    let mut out: Vec<BTreeSet<Var>> = Vec::with_capacity(pool.nodes.len());
    for e in &pool.nodes {
        let mut s = BTreeSet::new();
        let take = |c: &ExprId, s: &mut BTreeSet<Var>| {
            s.extend(out[c.0 as usize].iter().copied());
        };
        match e {
            E::Var(v) => {
                s.insert(*v);
            }
            E::Int(_) | E::F32(_) | E::I32(_) | E::Bool(_) | E::Acc => {}
            E::Load { index, .. } => take(index, &mut s),
            E::Un(_, a) | E::Cast(_, a) | E::Round(_, a) => take(a, &mut s),
            E::Bin(_, a, b) | E::IMin(a, b) | E::IMax(a, b) => {
                take(a, &mut s);
                take(b, &mut s);
            }
            E::Select(c, a, b) => {
                take(c, &mut s);
                take(a, &mut s);
                take(b, &mut s);
            }
            E::Reduce { vars, body, .. } | E::ArgMax { vars, body } => {
                take(body, &mut s);
                for (v, _) in vars {
                    s.remove(v);
                }
            }
            E::Uniform { index, .. } => take(index, &mut s),
        }
        out.push(s);
    }
    out
}

/// Nodes reachable from `roots` (children before parents, each once).
pub fn reachable(pool: &ExprPool, roots: &[ExprId]) -> Vec<ExprId> {
    let mut seen = vec![false; pool.nodes.len()];
    let mut stack: Vec<ExprId> = roots.to_vec();
    while let Some(x) = stack.pop() {
        if std::mem::replace(&mut seen[x.0 as usize], true) {
            continue;
        }
        stack.extend(children(pool.get(x)));
    }
    // Pool order is already a topological order (children are interned first).
    (0..pool.nodes.len() as u32)
        .map(ExprId)
        .filter(|x| seen[x.0 as usize])
        .collect()
}

/// Operands of an expression node (at most three, held inline: fusion and every analysis
/// walk pools through this, and a vector per node was much of their time).
pub fn children(e: &E) -> Children {
    let (ids, len) = match e {
        E::Var(_) | E::Int(_) | E::F32(_) | E::I32(_) | E::Bool(_) | E::Acc => ([ExprId(0); 3], 0),
        E::Load { index, .. } | E::Uniform { index, .. } => ([*index, ExprId(0), ExprId(0)], 1),
        E::Un(_, a) | E::Cast(_, a) | E::Round(_, a) => ([*a, ExprId(0), ExprId(0)], 1),
        E::Bin(_, a, b) | E::IMin(a, b) | E::IMax(a, b) => ([*a, *b, ExprId(0)], 2),
        E::Select(c, a, b) => ([*c, *a, *b], 3),
        E::Reduce { body, .. } | E::ArgMax { body, .. } => ([*body, ExprId(0), ExprId(0)], 1),
    };
    Children { ids, len }
}

/// The operands [`children`] returns, in order; a slice by `Deref`.
#[derive(Clone, Copy, Debug)]
pub struct Children {
    ids: [ExprId; 3],
    len: usize,
}

impl std::ops::Deref for Children {
    type Target = [ExprId];
    fn deref(&self) -> &[ExprId] {
        &self.ids[..self.len]
    }
}

impl IntoIterator for Children {
    type Item = ExprId;
    type IntoIter = std::iter::Take<std::array::IntoIter<ExprId, 3>>;
    fn into_iter(self) -> Self::IntoIter {
        self.ids.into_iter().take(self.len)
    }
}

/// A convolution weight gradient split along `k` ([`conv_split_k`]): the implicit GEMM
/// whose blocks add their slice's sum into the buffer (zeroed by a kernel before it).
/// `None` when it cannot be an implicit GEMM here (the caller lowers it as usual).
pub fn split_k_kernel(
    d: &Decisions<'_>,
    n: NodeId,
    splits: usize,
    name: String,
) -> Res<Option<Kernel>> {
    let g = d.g;
    let node = g.node(n);
    let layout = d.layout(n);
    let dims = node.ty.dims().to_vec();
    let mut b = Builder::new(d, n, layout.iter().map(|&a| dims[a]).collect());
    let idx = b.logical_index(n);
    let Some(r) = b.conv_gemm_rows(n, &idx) else {
        return Ok(None);
    };
    let value = b.conv_gemm(n, &idx, r)?;
    match &mut b.matmul {
        Some((_, mm)) => mm.split_k = splits,
        None => return Ok(None),
    }
    let index = b.buffer_index(n, &idx);
    let st = Store {
        buf: n,
        dtype: node.ty.dtype,
        index,
        value,
        accumulate: true,
    };
    // On the CPU every split of a row tile runs in the thread that owns the tile, so
    // threads still write disjoint rows.
    Ok(Some(b.finish(name, vec![st], !d.implicit_gemm)))
}

/// Scatter kernels: `embedding_grad` and `max_pool2d_grad` accumulate into a zeroed
/// buffer; this builds the accumulating kernel (the zero fill is a separate kernel).
/// The kernel of attention node `n` (or of an `attention_lse` node no attention kernel
/// stores), storing the row statistics `lse` too when given.
pub fn attention_kernel(
    d: &Decisions<'_>,
    n: NodeId,
    lse: Option<NodeId>,
    name: String,
) -> Res<Kernel> {
    let g = d.g;
    let node = g.node(n);
    let (causal, scale, with_v, grad) = match node.op {
        Op::Attention { causal, scale } => (causal, scale, true, None),
        Op::AttentionLse { causal, scale } => (causal, scale, false, None),
        Op::AttentionGrad { causal, scale, kv } => (causal, scale, true, Some(kv)),
        _ => {
            return Err(LowerError::Internal(
                "attention kernel of another op".into(),
            ))
        }
    };
    let (q, k) = (node.inputs[0], node.inputs[1]);
    let qd = g.ty(q).dims().to_vec();
    let r = qd.len();
    if r < 2 {
        return Err(LowerError::Internal("attention of rank < 2".into()));
    }
    let (t, dd, s) = (qd[r - 2], qd[r - 1], g.ty(k).dims()[r - 2]);
    let batch = qd[..r - 2].to_vec();
    let mut b = Builder::new(d, n, node.ty.dims().to_vec());
    let qo = b.operand(q, &batch, t, dd)?;
    let ko = b.operand(k, &batch, s, dd)?;
    let (vo, e) = if with_v {
        let v = node.inputs[2];
        let e = g.ty(v).dims()[r - 1];
        (Some(b.operand(v, &batch, s, e)?), e)
    } else {
        (None, 0)
    };
    let grad = match grad {
        Some(kv) => {
            let (dout, lse, delta) = (node.inputs[3], node.inputs[4], node.inputs[5]);
            let dout_o = b.operand(dout, &batch, t, e)?;
            // The tensor-core kernel stages `q`, `k`, `v` and `dout` in 16-byte chunks:
            // rows contiguous and 8-element aligned, or the operand gets a buffer of its
            // own (which is).
            for (x, o) in [(q, &qo), (k, &ko), (dout, &dout_o)]
                .into_iter()
                .chain(vo.as_ref().map(|o| (node.inputs[2], o)))
            {
                let aligned = o.cs == 1
                    && o.rs % 8 == 0
                    && o.base % 8 == 0
                    && o.batch_strides.iter().all(|s| s % 8 == 0);
                if !aligned && !d.materialized.contains(&x) {
                    return Err(LowerError::Materialize(x));
                }
            }
            Some(AttnGrad {
                kv,
                dout: dout_o,
                lse: b.operand(lse, &batch, t, 1)?,
                delta: b.operand(delta, &batch, t, 1)?,
            })
        }
        None => None,
    };
    let idx = b.domain_vars();
    let acc = b.pool.add(E::Acc, VTy::F32);
    let mut stores = Vec::new();
    let mut out = |b: &mut Builder, x: NodeId, idx: &[ExprId]| -> Res<Operand> {
        let index = b.buffer_index(x, idx);
        stores.push(Store {
            buf: x,
            dtype: g.ty(x).dtype,
            index,
            value: acc,
            accumulate: false,
        });
        let af = b
            .pool
            .affine(index)
            .ok_or_else(|| LowerError::Internal("attention output is not strided".into()))?;
        let coef = |i: usize| match b.pool.get(idx[i]) {
            E::Var(v) => af.coef(*v),
            _ => 0,
        };
        Ok(Operand {
            buf: x,
            dtype: g.ty(x).dtype,
            base: af.c0,
            batch_strides: (0..batch.len()).map(coef).collect(),
            rs: coef(batch.len()),
            cs: if idx.len() > batch.len() + 1 {
                coef(batch.len() + 1)
            } else {
                0
            },
            gather: None,
        })
    };
    let (o, lse_out) = if with_v {
        let o = out(&mut b, n, &idx)?;
        let l = match lse {
            Some(l) => Some(out(&mut b, l, &idx[..r - 1])?),
            None => None,
        };
        (Some(o), l)
    } else {
        (None, Some(out(&mut b, n, &idx)?))
    };
    let mut kernel = b.finish(name, stores, true);
    if let Some(l) = lse.filter(|_| with_v) {
        kernel.nodes.insert(kernel.nodes.len() - 1, l);
        kernel.describe = format!("{}, attention_lse %{}", kernel.describe, l.index());
    }
    kernel.attention = Some(Attn {
        batch,
        t,
        s,
        d: dd,
        e,
        causal,
        scale,
        q: qo,
        k: ko,
        v: vo,
        o,
        lse: lse_out,
        grad,
    });
    Ok(kernel)
}

pub fn scatter_kernel(d: &Decisions<'_>, n: NodeId, name: String) -> Res<Kernel> {
    let g = d.g;
    let node = g.node(n);
    match &node.op {
        Op::EmbeddingGrad { vocab } => {
            let (ids, dy) = (node.inputs[0], node.inputs[1]);
            let dd = g.ty(dy).dims().to_vec();
            let mut b = Builder::new(d, n, dd.clone());
            let idx = b.domain_vars();
            let r = idx.len();
            let gv = b.value(dy, &idx)?;
            let id = b.value(ids, &idx[..r - 1])?;
            let id64 = b.pool.cast(VTy::I64, id);
            let row = b.pool.clamp(id64, 0, *vocab as i64 - 1);
            let index = b.buffer_index(n, &[row, idx[r - 1]]);
            let st = Store {
                buf: n,
                dtype: node.ty.dtype,
                index,
                value: gv,
                accumulate: true,
            };
            Ok(b.finish(name, vec![st], false))
        }
        Op::Pool2dGrad {
            kind: PoolKind::Max,
            kernel,
            stride,
            padding,
        } => {
            let (x, dy) = (node.inputs[0], node.inputs[1]);
            let xd = g.ty(x).dims().to_vec();
            let yd = g.ty(dy).dims().to_vec();
            let mut b = Builder::new(d, n, yd);
            let idx = b.domain_vars();
            let (vi, i) = b.fresh(kernel[0]);
            let (vj, j) = b.fresh(kernel[1]);
            let (ih, iw, gd) =
                b.window([idx[2], idx[3]], *stride, [i, j], *padding, [xd[2], xd[3]]);
            let body = b.guarded(x, &[idx[0], idx[1], ih, iw], gd, f64::NEG_INFINITY)?;
            let am = b.pool.add(
                E::ArgMax {
                    vars: vec![(vi, kernel[0]), (vj, kernel[1])],
                    body,
                },
                VTy::I64,
            );
            let bi = b.idiv(am, kernel[1] as i64);
            let bj = b.irem(am, kernel[1] as i64);
            let th = b.tap(idx[2], stride[0], bi, padding[0]);
            let tw = b.tap(idx[3], stride[1], bj, padding[1]);
            let th = b.pool.clamp(th, 0, xd[2] as i64 - 1);
            let tw = b.pool.clamp(tw, 0, xd[3] as i64 - 1);
            let gv = b.value(dy, &idx)?;
            let index = b.buffer_index(n, &[idx[0], idx[1], th, tw]);
            let st = Store {
                buf: n,
                dtype: node.ty.dtype,
                index,
                value: gv,
                accumulate: true,
            };
            Ok(b.finish(name, vec![st], false))
        }
        _ => Err(LowerError::Internal(format!(
            "`{}` is not a scatter op",
            node.op.name()
        ))),
    }
}
