//! Kernel IR → PTX text (`.target sm_90`, or `sm_90a` for a module with Hopper's `wgmma`),
//! one `.entry` per kernel.
//!
//! Every entry takes the arena base address as its only parameter (runtime/ARTIFACT.md).
//! Thread mapping: the leading domain axes down to the loop of the deepest hoisted
//! reduction are spread over threads (one thread per point); the remaining axes, and every
//! reduction, are loops inside the thread, with each expression node computed once in the
//! loop of its innermost variable (the same rule as the CPU back end, so a row statistic is
//! computed once per row). Where those per-point reductions are long, or the point has
//! many elements left (a row of a softmax, a layer norm or a loss), a block of threads takes
//! each point instead: the reductions are shared among its threads (strided loads, warp
//! shuffles, shared memory) and its threads then stride over the point's elements, so that
//! their loads and stores are coalesced. Many points whose rows lie along the reduction
//! (a softmax's row statistics, its gradient) take a warp each instead of a block.
//!
//! Index arithmetic is 64-bit, except that a division or remainder by a constant whose
//! dividend is known (`index_ranges`) to lie in `[0, 2^31)` runs in 32 bits.
//!
//! Pointwise kernels whose innermost axis is contiguous and aligned for every store and
//! every load that varies along it move 4 elements per access (`ld/st.global.v4`, 16 bytes
//! of f32/i32, 8 of f16/bf16; broadcast loads stay scalar) and each thread handles one or
//! two such vectors, computing the lanes exactly as the scalar path does
//! (`vector_plan`); the others keep one point per thread.
//!
//! Matmul kernels ([`Matmul`], then the fused epilogue per output element):
//! - f16/bf16 matmuls of at least one 128×128 tile whose operands are contiguous along `k`
//!   or along `m`/`n` run on `wgmma` (sm_90a): 128×128 or 128×256 tiles, four stages of
//!   swizzled dynamic shared memory ([`wgmma`]);
//! - other f16/bf16 operands, and f32 operands when [`PtxOptions::allow_tf32`] is set, run on
//!   tensor cores (`mma.sync` m16n8k16 / m16n8k8 TF32, f32 accumulation): 128×128 block
//!   tiles, `cp.async` double buffering, `ldmatrix` fragments (`emit_mma_matmul`);
//! - exact f32 runs on FFMA: 128×128 tiles with 8×8 per thread (128×64 with 8×4, or 64×128
//!   with 4×8, where `n` or `m` is at most 64) when the output is large enough for at least
//!   132 such blocks (`emit_sgemm`), else 64×64 tiles with 4×4 per thread (`k` staged 16
//!   deep; grid `(⌈n/64⌉, ⌈m/64⌉, batch)`); 128×128 tiles that would fill their waves
//!   badly run stream-K: one wave of blocks shares their `k` stages evenly, and a tile's
//!   first block adds the others' partials in a fixed order ([`stream_k`]);
//! - small or thin matmuls, and batches beyond the grid's `z` limit, give one output
//!   element per thread with an FMA loop over `k`;
//! - implicit GEMMs (convolutions and their gradients, whose operands are gathers and
//!   whose rows and columns span several domain axes) take the 64×64 FFMA tiles or the
//!   per-element loop: each tile slot evaluates its gather at a clamped row and `k` (what
//!   depends on the row alone is computed once, before the `k` loop) and stores 0 out of
//!   range. With `split_k`, blocks along `z` each sum one slice of `k` and add it into
//!   the zeroed output with `red.global.add` (the sum's order, hence its last bits, may
//!   change from run to run, as with the scatter kernels).
//!
//! Math: `exp` is `ex2.approx` of `x·log2 e`; `log` is `lg2.approx`; `tanh` is computed
//! from `exp` (a polynomial near 0) because `tanh.approx` is only good to about 1e-3;
//! `erf` uses Abramowitz–Stegun 7.1.26 (absolute error below 1.5e-7); min/max propagate
//! NaN (`.NaN`); integer division floors and gives 0 for a zero divisor, as on the CPU.

use super::clif::sites;
use crate::ir::{BinaryOp, DType, NodeId, UnaryOp};
use crate::kernel::lower::reachable;
use crate::kernel::{Affine, ExprId, ExprPool, Gather, Kernel, Matmul, MmAxis, Red, VTy, Var, E};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

mod attention;
mod stream_k;
mod wgmma;

/// The module's dynamic shared memory (declared when a kernel launches with some).
const DYN_SHARED: &str = "tcc_dyn_s";

/// Threads per block of every kernel.
pub const BLOCK: u32 = 256;
/// Streaming multiprocessors of the GPU whose waves the tile choices count (an H100 or
/// H200 has 132).
pub const SMS: usize = 132;
/// Threads of a warp: in block mode, the group that takes one point when points are many
/// and each reads a row along its reduction (a softmax's row statistics, its gradient's
/// rows of up to 4096).
const WARP: u32 = 32;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PtxError {
    #[error("buffer of node %{0} has no arena offset")]
    NoOffset(usize),
    #[error("kernel {kernel}: {message}")]
    Unsupported { kernel: String, message: String },
}

type Res<T> = Result<T, PtxError>;

/// Launch shape of one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    /// Bytes of the scratch region at [`PtxOptions::scratch_offset`] the kernel uses (0:
    /// none). Kernels that use it must not overlap.
    pub scratch_bytes: u64,
}

/// Options of the PTX back end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PtxOptions {
    /// f32 matmuls may run on TF32 tensor cores (operands rounded to 10-bit mantissas,
    /// f32 accumulation); otherwise they stay exact f32 FFMA.
    pub allow_tf32: bool,
    /// Arena offset of the scratch region that stream-K matmuls share (after the plan's
    /// buffers; [`LaunchShape::scratch_bytes`]).
    pub scratch_offset: u64,
}

/// Translates kernels to one PTX module; returns the text and each kernel's launch shape.
pub fn emit_module(
    kernels: &[Kernel],
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    opts: PtxOptions,
) -> Res<(String, Vec<LaunchShape>)> {
    let mut body = String::new();
    let mut launches = Vec::new();
    for k in kernels {
        let (text, launch) = emit_kernel(k, offset_of, opts)?;
        body.push_str(&text);
        body.push('\n');
        launches.push(launch);
    }
    // `wgmma` needs the architecture-specific target (sm_90a: Hopper only).
    let target = if body.contains("wgmma.") {
        "sm_90a"
    } else {
        "sm_90"
    };
    let mut out = format!(
        "//\n// Generated by tcc\n//\n\n.version 8.0\n.target {target}\n.address_size 64\n\n"
    );
    if launches.iter().any(|l| l.shared_bytes > 0) {
        let _ = writeln!(out, ".extern .shared .align 1024 .b8 {DYN_SHARED}[];\n");
    }
    out.push_str(&body);
    Ok((out, launches))
}

/// Bytes of the scratch region (after the plan's buffers, at
/// [`PtxOptions::scratch_offset`]) the kernel's code will use: a stream-K matmul's flags and
/// partial tiles ([`stream_k`]), or 0. Known before the arena's offsets (the f32 matmuls
/// that take the SGEMM do not depend on them), so the plan can make room first.
pub fn scratch_bytes(k: &Kernel, opts: PtxOptions) -> u64 {
    match &k.matmul {
        Some(mm) if k.attention.is_none() && MmaKind::of(mm, opts).is_none() => sgemm_grid(mm)
            .and_then(|g| g.stream_k)
            .map_or(0, stream_k::scratch_bytes),
        _ => 0,
    }
}

fn f32_lit(v: f32) -> String {
    format!("0f{:08X}", v.to_bits())
}

struct LoopCtx {
    head: String,
    exit: String,
    iv: String,
}

struct Px<'a> {
    k: &'a Kernel,
    offset_of: &'a dyn Fn(NodeId) -> Option<u64>,
    body: String,
    counts: HashMap<&'static str, u32>,
    labels: u32,
    cache: HashMap<ExprId, String>,
    journal: Vec<Vec<ExprId>>,
    vars: HashMap<Var, String>,
    site: Vec<Option<Var>>,
    live: Vec<ExprId>,
    acc: Option<String>,
    arena: String,
    /// Block mode: the reductions computed by the whole group of threads of a point (`tid`
    /// strides over their range, then warp shuffles, and across warps shared memory,
    /// combine the partial results).
    block_reductions: Vec<ExprId>,
    /// The thread's index in its group: in block mode the threads of one point.
    tid: String,
    /// Threads that share one point in block mode: [`BLOCK`], or one warp ([`WARP`]).
    group: u32,
    /// Bounds of every integer node, where known (`index_ranges`): an index division or
    /// remainder by a constant runs in 32 bits when its dividend fits.
    ranges: Vec<Option<(i64, i64)>>,
    /// Loads (and selects over them) read only as arms of a load tree at their own site:
    /// not made at their site, but as the tree's one load ([`Px::load_tree`]).
    deferred: HashSet<ExprId>,
}

/// Interval bounds of the pool's i64 nodes: variables span their loops (domain,
/// reduction and gather variables), and sums, products, divisions and remainders by
/// constants, clamps and selects follow. `None` where unknown or beyond 2^62.
fn index_ranges(k: &Kernel) -> Vec<Option<(i64, i64)>> {
    let mut ext: HashMap<Var, usize> = HashMap::new();
    for (i, &d) in k.domain.iter().enumerate() {
        ext.insert(i as Var, d);
    }
    for e in &k.pool.nodes {
        if let E::Reduce { vars, .. } | E::ArgMax { vars, .. } = e {
            for &(v, n) in vars {
                ext.insert(v, n);
            }
        }
    }
    if let Some(mm) = &k.matmul {
        for (op, rows, cols) in [(&mm.a, mm.m, mm.k), (&mm.b, mm.k, mm.n)] {
            if let Some(g) = &op.gather {
                ext.insert(g.row, rows);
                ext.insert(g.col, cols);
            }
        }
    }
    const LIM: i128 = 1 << 62;
    let fit = |lo: i128, hi: i128| -> Option<(i64, i64)> {
        (lo >= -LIM && hi <= LIM).then_some((lo as i64, hi as i64))
    };
    let mut out: Vec<Option<(i64, i64)>> = Vec::with_capacity(k.pool.nodes.len());
    for (i, e) in k.pool.nodes.iter().enumerate() {
        let get = |x: &ExprId| out.get(x.0 as usize).copied().flatten();
        let r = if k.pool.ty(ExprId(i as u32)) != VTy::I64 {
            None
        } else {
            match e {
                E::Var(v) => ext.get(v).map(|&n| (0, n.saturating_sub(1) as i64)),
                E::Int(c) => Some((*c, *c)),
                E::Bin(op, a, b) => match (get(a), get(b), op) {
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Add) => {
                        fit(al as i128 + bl as i128, ah as i128 + bh as i128)
                    }
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Sub) => {
                        fit(al as i128 - bh as i128, ah as i128 - bl as i128)
                    }
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Mul) => {
                        let p = [
                            al as i128 * bl as i128,
                            al as i128 * bh as i128,
                            ah as i128 * bl as i128,
                            ah as i128 * bh as i128,
                        ];
                        let lo = p.iter().copied().min().unwrap_or(0);
                        let hi = p.iter().copied().max().unwrap_or(0);
                        fit(lo, hi)
                    }
                    (Some((al, ah)), Some((c, c2)), BinaryOp::Div) if c == c2 && c > 0 => {
                        Some((al / c, ah / c))
                    }
                    (Some((al, ah)), Some((c, c2)), BinaryOp::Rem) if c == c2 && c > 0 => {
                        if al >= 0 {
                            Some((0, ah.min(c - 1)))
                        } else {
                            Some((-(c - 1), c - 1))
                        }
                    }
                    _ => None,
                },
                E::IMin(a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.min(bl), ah.min(bh))),
                    _ => None,
                },
                E::IMax(a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.max(bl), ah.max(bh))),
                    _ => None,
                },
                E::Select(_, a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.min(bl), ah.max(bh))),
                    _ => None,
                },
                _ => None,
            }
        };
        out.push(r);
    }
    out
}

/// Register class prefix and declared type of a value type.
fn class(t: VTy) -> &'static str {
    match t {
        VTy::F32 => "f",
        VTy::I32 => "r",
        VTy::I64 => "rd",
        VTy::Bool => "p",
    }
}

impl<'a> Px<'a> {
    fn new(
        k: &'a Kernel,
        offset_of: &'a dyn Fn(NodeId) -> Option<u64>,
        site: Vec<Option<Var>>,
        live: Vec<ExprId>,
    ) -> Self {
        Px {
            k,
            offset_of,
            body: String::new(),
            counts: HashMap::new(),
            labels: 0,
            cache: HashMap::new(),
            journal: Vec::new(),
            vars: HashMap::new(),
            site,
            live,
            acc: None,
            arena: String::new(),
            block_reductions: Vec::new(),
            tid: String::new(),
            group: BLOCK,
            ranges: index_ranges(k),
            deferred: HashSet::new(),
        }
        .with_deferred_trees()
    }

    fn with_deferred_trees(mut self) -> Self {
        let (k, site) = (self.k, &self.site);
        let tree = select_trees(k, &self.live, &|_| true, &|_| true);
        let (outside, readers) = tree_readers(k, &self.live, &tree);
        self.deferred = self
            .live
            .iter()
            .copied()
            .filter(|x| {
                let leaf = tree.contains_key(x) || matches!(k.pool.get(*x), E::Load { .. });
                leaf && !outside.contains(x)
                    && readers.get(x).is_some_and(|us| {
                        us.iter().all(|u| site[u.0 as usize] == site[x.0 as usize])
                    })
            })
            .collect();
        self
    }

    /// Loads the arena's base address (the entry's parameter) into `self.arena`.
    fn load_arena(&mut self) {
        let arena = self.fresh("rd");
        self.line(format!("ld.param.u64 {arena}, [arena];"));
        self.line(format!("cvta.to.global.u64 {arena}, {arena};"));
        self.arena = arena;
    }

    /// The entry's text: header, register declarations, `shared` (declarations of shared
    /// arrays, one a line), then the body.
    fn finish(&self, shared: &str) -> String {
        self.finish_bounded(shared, None)
    }

    /// [`Self::finish`] with launch bounds `(threads a block, blocks an SM)`: ptxas keeps
    /// the registers within what that many blocks leave each thread.
    fn finish_bounded(&self, shared: &str, bounds: Option<(u32, u32)>) -> String {
        let k = self.k;
        let bounds = bounds
            .map(|(t, b)| format!(".maxntid {t}, 1, 1\n.minnctapersm {b}\n"))
            .unwrap_or_default();
        let mut text = format!(
            "// {}\n.visible .entry {}(\n\t.param .u64 arena\n)\n{bounds}{{\n",
            k.describe, k.name
        );
        let mut classes: Vec<(&&str, &u32)> = self.counts.iter().collect();
        classes.sort();
        for (p, n) in classes {
            let t = match *p {
                "f" => ".f32",
                "r" => ".b32",
                "rd" => ".b64",
                "h" => ".b16",
                _ => ".pred",
            };
            let _ = writeln!(text, "\t.reg {t} %{p}<{n}>;");
        }
        text.push_str(shared);
        text.push_str(&self.body);
        text.push_str("}\n");
        text
    }

    fn unsupported(&self, m: impl Into<String>) -> PtxError {
        PtxError::Unsupported {
            kernel: self.k.name.clone(),
            message: m.into(),
        }
    }

    fn fresh(&mut self, prefix: &'static str) -> String {
        let c = self.counts.entry(prefix).or_insert(0);
        let r = format!("%{prefix}{c}");
        *c += 1;
        r
    }

    fn reg(&mut self, t: VTy) -> String {
        self.fresh(class(t))
    }

    fn line(&mut self, s: impl AsRef<str>) {
        self.body.push('\t');
        self.body.push_str(s.as_ref());
        self.body.push('\n');
    }

    fn label(&mut self, what: &str) -> String {
        self.labels += 1;
        format!("$L_{what}_{}", self.labels)
    }

    fn remember(&mut self, e: ExprId, r: String) {
        self.cache.insert(e, r);
        if let Some(j) = self.journal.last_mut() {
            j.push(e);
        }
    }

    fn imm64(&mut self, v: i64) -> String {
        let r = self.fresh("rd");
        self.line(format!("mov.s64 {r}, {v};"));
        r
    }

    fn open_loop(&mut self, start: &str, end: &str) -> LoopCtx {
        let iv = self.fresh("rd");
        let head = self.label("head");
        let exit = self.label("exit");
        self.line(format!("mov.s64 {iv}, {start};"));
        self.body.push_str(&format!("{head}:\n"));
        let p = self.fresh("p");
        self.line(format!("setp.ge.s64 {p}, {iv}, {end};"));
        self.line(format!("@{p} bra {exit};"));
        self.journal.push(Vec::new());
        LoopCtx { head, exit, iv }
    }

    fn close_loop(&mut self, l: LoopCtx) {
        self.line(format!("add.s64 {}, {}, 1;", l.iv, l.iv));
        self.line(format!("bra.uni {};", l.head));
        self.body.push_str(&format!("{}:\n", l.exit));
        if let Some(keys) = self.journal.pop() {
            for key in keys {
                self.cache.remove(&key);
            }
        }
    }

    fn address(&mut self, buf: NodeId, dtype: DType, idx: &str) -> Res<String> {
        let off = (self.offset_of)(buf).ok_or(PtxError::NoOffset(buf.index()))?;
        let base = self.fresh("rd");
        let arena = self.arena.clone();
        self.line(format!("add.s64 {base}, {arena}, {off};"));
        let a = self.fresh("rd");
        self.line(format!(
            "mad.lo.s64 {a}, {idx}, {}, {base};",
            dtype.size_bytes()
        ));
        Ok(a)
    }

    fn load(&mut self, addr: &str, dtype: DType) -> String {
        match dtype {
            DType::F32 => {
                let r = self.fresh("f");
                self.line(format!("ld.global.f32 {r}, [{addr}];"));
                r
            }
            DType::I32 => {
                let r = self.fresh("r");
                self.line(format!("ld.global.s32 {r}, [{addr}];"));
                r
            }
            DType::Bool => {
                let b = self.fresh("r");
                self.line(format!("ld.global.u8 {b}, [{addr}];"));
                let p = self.fresh("p");
                self.line(format!("setp.ne.u32 {p}, {b}, 0;"));
                p
            }
            DType::F16 | DType::BF16 => {
                let h = self.fresh("h");
                self.line(format!("ld.global.b16 {h}, [{addr}];"));
                let r = self.fresh("f");
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                self.line(format!("cvt.f32.{t} {r}, {h};"));
                r
            }
        }
    }

    fn store(&mut self, addr: &str, dtype: DType, v: &str, accumulate: bool) -> Res<()> {
        match (dtype, accumulate) {
            (DType::F32, false) => self.line(format!("st.global.f32 [{addr}], {v};")),
            (DType::F32, true) => self.line(format!("red.global.add.f32 [{addr}], {v};")),
            (DType::I32, false) => self.line(format!("st.global.s32 [{addr}], {v};")),
            (DType::I32, true) => self.line(format!("red.global.add.s32 [{addr}], {v};")),
            (DType::Bool, false) => {
                let b = self.fresh("r");
                self.line(format!("selp.u32 {b}, 1, 0, {v};"));
                self.line(format!("st.global.u8 [{addr}], {b};"));
            }
            (DType::F16 | DType::BF16, false) => {
                let h = self.fresh("h");
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                self.line(format!("cvt.rn.{t}.f32 {h}, {v};"));
                self.line(format!("st.global.b16 [{addr}], {h};"));
            }
            _ => return Err(self.unsupported(format!("accumulating store of {dtype}"))),
        }
        Ok(())
    }

    fn emit_site(&mut self, v: Option<Var>) -> Res<()> {
        for e in Kernel::at_site(&self.live, &self.site, v) {
            if self.deferred.contains(&e) {
                continue;
            }
            self.emit(e)?;
        }
        Ok(())
    }

    fn stores(&mut self) -> Res<()> {
        for (addr, s, val) in self.store_values()? {
            self.store(&addr, s.dtype, &val, s.accumulate)?;
        }
        Ok(())
    }

    /// The kernel's stores with their addresses and values computed, not yet stored.
    fn store_values(&mut self) -> Res<Vec<(String, crate::kernel::Store, String)>> {
        let mut out = Vec::new();
        for s in self.k.stores.clone() {
            let idx = self.emit(s.index)?;
            let val = self.emit(s.value)?;
            let addr = self.address(s.buf, s.dtype, &idx)?;
            out.push((addr, s, val));
        }
        Ok(out)
    }

    /// Binds the variables `dims` (innermost last) to the digits of the linear index
    /// `lin` (u32), in 64-bit registers.
    fn bind_linear(&mut self, lin: &str, dims: &[(Var, usize)]) {
        let exts: Vec<usize> = dims.iter().map(|d| d.1).collect();
        self.digits(lin, &exts, false, |px, i, r| {
            let r64 = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {r64}, {r};"));
            px.vars.insert(dims[i].0, r64);
        });
    }

    /// The digits of the linear index `lin` (u32, or u64 where `wide`) in the mixed radix
    /// `exts` (row-major: the last digit varies fastest; the first is what is left),
    /// innermost first, each handed to `each` with its position as soon as it is computed.
    fn digits(
        &mut self,
        lin: &str,
        exts: &[usize],
        wide: bool,
        mut each: impl FnMut(&mut Self, usize, String),
    ) {
        let (ty, class) = if wide { ("u64", "rd") } else { ("u32", "r") };
        let mut rest = lin.to_string();
        for (i, &ext) in exts.iter().enumerate().rev() {
            let r = self.fresh(class);
            if i == 0 {
                self.line(format!("mov.{ty} {r}, {rest};"));
            } else {
                self.line(format!("rem.{ty} {r}, {rest}, {ext};"));
                let q = self.fresh(class);
                self.line(format!("div.{ty} {q}, {rest}, {ext};"));
                rest = q;
            }
            each(self, i, r);
        }
    }

    /// Binds the domain variables from `first` on to the registers `at`, in order.
    fn bind_point<'s>(&mut self, first: usize, at: impl IntoIterator<Item = &'s String>) {
        for (q, x) in at.into_iter().enumerate() {
            self.vars.insert((first + q) as Var, x.clone());
        }
    }

    /// The copies of a loop over `n` points striding by `group` threads that one trip
    /// runs: 4 (or 2) where they divide the points evenly, so that each thread has that
    /// many loads in flight (gpt's softmax, a warp per row of 512: 0.098 → 0.091 ms a
    /// layer on an H100, its row statistics and loss rows 10–20% faster, the step 64.03 →
    /// 63.88 ms).
    fn unroll(n: usize, group: u32) -> usize {
        [4, 2]
            .into_iter()
            .find(|&u| n.is_multiple_of(group as usize * u))
            .unwrap_or(1)
    }

    /// Emits one copy of a strided loop's body: `lin + u·group` bound to `dims`, then
    /// `body`; what it computed leaves the cache afterwards (the next copy has other
    /// variables).
    fn loop_copy<T>(
        &mut self,
        lin: &str,
        (u, group): (usize, u32),
        dims: &[(Var, usize)],
        body: impl FnOnce(&mut Self) -> Res<T>,
    ) -> Res<T> {
        self.journal.push(Vec::new());
        let at = if u == 0 {
            lin.to_string()
        } else {
            let r = self.fresh("r");
            self.line(format!("add.u32 {r}, {lin}, {};", u * group as usize));
            r
        };
        self.bind_linear(&at, dims);
        let out = body(self);
        if let Some(keys) = self.journal.pop() {
            for key in keys {
                self.cache.remove(&key);
            }
        }
        out
    }

    /// The per-element matmul (fallback for small or huge-batch matmuls): one output
    /// element per thread (its domain variables already bound), an FMA loop over `k`,
    /// then the fused epilogue.
    fn matmul_per_element(&mut self, mm: &Matmul) -> Res<()> {
        let nb = mm.batch.len();
        let acc = self.fresh("f");
        self.line(format!("mov.f32 {acc}, {};", f32_lit(0.0)));
        let mut abase = self.imm64(mm.a.base);
        let mut bbase = self.imm64(mm.b.base);
        for d in 0..nb {
            let v = self.vars.get(&(d as Var)).cloned().unwrap_or_default();
            let (sa, sb) = (mm.a.batch_strides[d], mm.b.batch_strides[d]);
            let na = self.fresh("rd");
            self.line(format!("mad.lo.s64 {na}, {v}, {sa}, {abase};"));
            abase = na;
            let nb2 = self.fresh("rd");
            self.line(format!("mad.lo.s64 {nb2}, {v}, {sb}, {bbase};"));
            bbase = nb2;
        }
        // The flattened row and column of this element.
        let flat = |px: &mut Self, first: usize, dims: &[usize]| -> String {
            let mut lin = px.vars.get(&(first as Var)).cloned().unwrap_or_default();
            for (q, &d) in dims.iter().enumerate().skip(1) {
                let v = px
                    .vars
                    .get(&((first + q) as Var))
                    .cloned()
                    .unwrap_or_default();
                let t = px.fresh("rd");
                px.line(format!("mad.lo.s64 {t}, {lin}, {d}, {v};"));
                lin = t;
            }
            lin
        };
        let i = flat(self, nb, &mm.rows);
        let j = flat(self, nb + mm.rows.len(), &mm.cols);
        let arow = self.fresh("rd");
        self.line(format!("mad.lo.s64 {arow}, {i}, {}, {abase};", mm.a.rs));
        let bcol = self.fresh("rd");
        self.line(format!("mad.lo.s64 {bcol}, {j}, {}, {bbase};", mm.b.cs));
        let (av_fixed, a_nodes) = self.fixed_nodes(mm.a.gather.as_ref(), true);
        let a_fixed = self.gather_fixed_part(&a_nodes, av_fixed, &i)?;
        let (bv_fixed, b_nodes) = self.fixed_nodes(mm.b.gather.as_ref(), false);
        let b_fixed = self.gather_fixed_part(&b_nodes, bv_fixed, &j)?;
        let l = self.open_loop("0", &mm.k.to_string());
        let av = match &mm.a.gather {
            Some(g) => self.gather(g, &i, &l.iv, &a_fixed)?,
            None => {
                let ai = self.fresh("rd");
                self.line(format!("mad.lo.s64 {ai}, {}, {}, {arow};", l.iv, mm.a.cs));
                let aa = self.address(mm.a.buf, mm.a.dtype, &ai)?;
                self.load(&aa, mm.a.dtype)
            }
        };
        let bv = match &mm.b.gather {
            Some(g) => self.gather(g, &l.iv, &j, &b_fixed)?,
            None => {
                let bi = self.fresh("rd");
                self.line(format!("mad.lo.s64 {bi}, {}, {}, {bcol};", l.iv, mm.b.rs));
                let ba = self.address(mm.b.buf, mm.b.dtype, &bi)?;
                self.load(&ba, mm.b.dtype)
            }
        };
        self.line(format!("fma.rn.f32 {acc}, {av}, {bv}, {acc};"));
        self.close_loop(l);
        self.acc = Some(acc);
        self.stores()?;
        Ok(())
    }

    fn emit(&mut self, e: ExprId) -> Res<String> {
        if let Some(r) = self.cache.get(&e) {
            return Ok(r.clone());
        }
        let node = self.k.pool.get(e).clone();
        let ty = self.k.pool.ty(e);
        let r = match node {
            E::Var(v) => self
                .vars
                .get(&v)
                .cloned()
                .ok_or_else(|| self.unsupported(format!("variable v{v} is not bound here")))?,
            E::Int(v) => self.imm64(v),
            E::F32(bits) => {
                let r = self.fresh("f");
                self.line(format!("mov.f32 {r}, 0f{bits:08X};"));
                r
            }
            E::I32(v) => {
                let r = self.fresh("r");
                self.line(format!("mov.s32 {r}, {v};"));
                r
            }
            E::Bool(v) => {
                let t = self.fresh("r");
                self.line(format!("mov.u32 {t}, {};", u32::from(v)));
                let p = self.fresh("p");
                self.line(format!("setp.ne.u32 {p}, {t}, 0;"));
                p
            }
            E::Acc => self
                .acc
                .clone()
                .ok_or_else(|| self.unsupported("accumulator outside a matmul"))?,
            E::Load { buf, dtype, index } => {
                let i = self.emit(index)?;
                let a = self.address(buf, dtype, &i)?;
                self.load(&a, dtype)
            }
            E::Un(op, a) => {
                let x = self.emit(a)?;
                self.unary(op, self.k.pool.ty(a), &x)?
            }
            E::Bin(op @ (BinaryOp::Div | BinaryOp::Rem), a, b)
                if self.narrow_divisor(a, b).is_some() =>
            {
                // A non-negative index below 2^31 over a positive constant: 32-bit
                // division (a 64-bit one is a long subroutine).
                let c = self.narrow_divisor(a, b).unwrap_or(1);
                let x = self.emit(a)?;
                let (x32, q) = (self.fresh("r"), self.fresh("r"));
                self.line(format!("cvt.u32.u64 {x32}, {x};"));
                let ins = if op == BinaryOp::Div { "div" } else { "rem" };
                self.line(format!("{ins}.u32 {q}, {x32}, {c};"));
                let r = self.fresh("rd");
                self.line(format!("cvt.u64.u32 {r}, {q};"));
                r
            }
            E::Bin(op, a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.binary(op, self.k.pool.ty(a), &x, &y)?
            }
            E::IMin(a, b) | E::IMax(a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                let r = self.fresh("rd");
                let op = if matches!(node, E::IMin(..)) {
                    "min"
                } else {
                    "max"
                };
                self.line(format!("{op}.s64 {r}, {x}, {y};"));
                r
            }
            E::Select(c, a, b) => match self.load_tree(e) {
                // One load from the chosen address, not a load of every arm.
                Some(dtype) => {
                    let addr = self.tree_address(e)?;
                    self.load(&addr, dtype)
                }
                None => {
                    let cv = self.emit(c)?;
                    let x = self.emit(a)?;
                    let y = self.emit(b)?;
                    self.select(ty, &cv, &x, &y)
                }
            },
            E::Cast(to, a) => {
                let x = self.emit(a)?;
                self.cast(self.k.pool.ty(a), to, &x)
            }
            E::Uniform { seed, index } => {
                let i = self.emit(index)?;
                self.uniform(seed, &i)
            }
            E::Reduce { op, vars, body } if self.block_reductions.contains(&e) => {
                self.block_reduce(op, &vars, body, ty)?
            }
            E::Reduce { op, vars, body } => self.reduce(op, &vars, body, ty)?,
            E::ArgMax { vars, body } => self.argmax(&vars, body)?,
        };
        self.remember(e, r.clone());
        Ok(r)
    }

    /// The element type of a select tree over loads not yet made (`select(c, load, select(c2,
    /// load, load))`: a concat reading its pieces), whose leaves all have that type.
    fn load_tree(&self, e: ExprId) -> Option<DType> {
        if self.cache.contains_key(&e) {
            return None;
        }
        match *self.k.pool.get(e) {
            E::Load { dtype, .. } => Some(dtype),
            E::Select(_, a, b) => {
                let d = self.load_tree(a)?;
                (self.load_tree(b)? == d).then_some(d)
            }
            _ => None,
        }
    }

    /// The byte address a load tree ([`Self::load_tree`]) reads: each select picks between
    /// its arms' addresses (every leaf's index is in range wherever the kernel runs, as when
    /// every arm was loaded).
    fn tree_address(&mut self, e: ExprId) -> Res<String> {
        match *self.k.pool.get(e) {
            E::Load { buf, dtype, index } => {
                let i = self.emit(index)?;
                self.address(buf, dtype, &i)
            }
            E::Select(c, a, b) => {
                let cv = self.emit(c)?;
                let x = self.tree_address(a)?;
                let y = self.tree_address(b)?;
                Ok(self.select(VTy::I64, &cv, &x, &y))
            }
            _ => Err(self.unsupported("a select over something other than loads")),
        }
    }

    /// The constant divisor of `a / b` (or `a % b`) when both fit 32-bit unsigned
    /// arithmetic: `b` a positive constant, `a` known to lie in `[0, 2^31)`.
    fn narrow_divisor(&self, a: ExprId, b: ExprId) -> Option<i64> {
        if self.k.pool.ty(a) != VTy::I64 {
            return None;
        }
        let c = match self.k.pool.get(b) {
            E::Int(c) if *c > 0 && *c < 1 << 31 => *c,
            _ => return None,
        };
        match self.ranges.get(a.0 as usize).copied().flatten() {
            Some((lo, hi)) if lo >= 0 && hi < 1 << 31 => Some(c),
            _ => None,
        }
    }

    /// An operand element of an implicit GEMM: the gather's value with its row and column
    /// bound (`cache`: nodes already computed for this row, kept by the caller).
    fn gather(
        &mut self,
        g: &Gather,
        row: &str,
        col: &str,
        cache: &HashMap<ExprId, String>,
    ) -> Res<String> {
        let saved = std::mem::replace(&mut self.cache, cache.clone());
        self.vars.insert(g.row, row.to_string());
        self.vars.insert(g.col, col.to_string());
        let v = self.emit(g.value);
        self.cache = saved;
        v
    }

    /// `nodes` (a gather's nodes that depend only on its variable `fixed`, from
    /// [`fixed_nodes`]) computed for `fixed = at`: the cache [`Self::gather`] starts from
    /// while `fixed` keeps that value (a tile row's coordinates, hoisted out of the `k`
    /// loop).
    fn gather_fixed_part(
        &mut self,
        nodes: &[ExprId],
        fixed: Var,
        at: &str,
    ) -> Res<HashMap<ExprId, String>> {
        let saved = self.cache.clone();
        if nodes.is_empty() {
            return Ok(saved);
        }
        self.vars.insert(fixed, at.to_string());
        for &e in nodes {
            self.emit(e)?;
        }
        Ok(std::mem::replace(&mut self.cache, saved))
    }

    /// A gathered operand's nodes that depend only on `fixed` (its row for A, its column
    /// for B), for [`Self::gather_fixed_part`]; empty for a strided operand.
    fn fixed_nodes(&self, g: Option<&Gather>, a_side: bool) -> (Var, Vec<ExprId>) {
        let Some(g) = g else {
            return (0, Vec::new());
        };
        let fixed = if a_side { g.row } else { g.col };
        let free = crate::kernel::lower::free_vars(&self.k.pool);
        let nodes = reachable(&self.k.pool, &[g.value])
            .into_iter()
            .filter(|e| {
                let f = &free[e.0 as usize];
                !f.is_empty() && f.iter().all(|&v| v == fixed)
            })
            .collect();
        (fixed, nodes)
    }

    fn select(&mut self, ty: VTy, c: &str, a: &str, b: &str) -> String {
        let r = self.reg(ty);
        match ty {
            VTy::Bool => {
                let t1 = self.fresh("p");
                let nc = self.fresh("p");
                let t2 = self.fresh("p");
                self.line(format!("and.pred {t1}, {c}, {a};"));
                self.line(format!("not.pred {nc}, {c};"));
                self.line(format!("and.pred {t2}, {nc}, {b};"));
                self.line(format!("or.pred {r}, {t1}, {t2};"));
            }
            VTy::F32 => self.line(format!("selp.f32 {r}, {a}, {b}, {c};")),
            VTy::I32 => self.line(format!("selp.b32 {r}, {a}, {b}, {c};")),
            VTy::I64 => self.line(format!("selp.b64 {r}, {a}, {b}, {c};")),
        }
        r
    }

    fn reduction_loops(&mut self, vars: &[(Var, usize)], body: ExprId) -> Res<Vec<LoopCtx>> {
        let mut open = Vec::new();
        for &(v, ext) in vars {
            let l = self.open_loop("0", &ext.to_string());
            self.vars.insert(v, l.iv.clone());
            let sub = reachable(&self.k.pool, &[body]);
            for e in sub {
                if self.site[e.0 as usize] == Some(v) {
                    self.emit(e)?;
                }
            }
            open.push(l);
        }
        Ok(open)
    }

    fn reduce(&mut self, op: Red, vars: &[(Var, usize)], body: ExprId, ty: VTy) -> Res<String> {
        let acc = self.reg(ty);
        match (op, ty) {
            (Red::Sum, VTy::F32) => self.line(format!("mov.f32 {acc}, {};", f32_lit(0.0))),
            (Red::Max, VTy::F32) => {
                self.line(format!("mov.f32 {acc}, {};", f32_lit(f32::NEG_INFINITY)))
            }
            (Red::Min, VTy::F32) => {
                self.line(format!("mov.f32 {acc}, {};", f32_lit(f32::INFINITY)))
            }
            (Red::Sum, VTy::I32) => self.line(format!("mov.s32 {acc}, 0;")),
            (Red::Max, VTy::I32) => self.line(format!("mov.s32 {acc}, {};", i32::MIN)),
            (Red::Min, VTy::I32) => self.line(format!("mov.s32 {acc}, {};", i32::MAX)),
            (Red::Sum, VTy::I64) => self.line(format!("mov.s64 {acc}, 0;")),
            _ => return Err(self.unsupported(format!("{} over {}", op.name(), ty.name()))),
        }
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let t = match ty {
            VTy::F32 => "f32",
            VTy::I32 => "s32",
            _ => "s64",
        };
        match (op, ty) {
            (Red::Sum, _) => self.line(format!("add.{t} {acc}, {acc}, {x};")),
            (Red::Max, VTy::F32) => self.line(format!("max.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Min, VTy::F32) => self.line(format!("min.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Max, _) => self.line(format!("max.{t} {acc}, {acc}, {x};")),
            (Red::Min, _) => self.line(format!("min.{t} {acc}, {acc}, {x};")),
        }
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(acc)
    }

    /// A reduction computed by all threads of the block: each takes every `BLOCK`-th point
    /// of the flattened range, then the partial results meet through warp shuffles and
    /// shared memory; every thread gets the result.
    fn block_reduce(
        &mut self,
        op: Red,
        vars: &[(Var, usize)],
        body: ExprId,
        ty: VTy,
    ) -> Res<String> {
        let (t, init) = match (op, ty) {
            (Red::Sum, VTy::F32) => ("f32", f32_lit(0.0)),
            (Red::Max, VTy::F32) => ("f32", f32_lit(f32::NEG_INFINITY)),
            (Red::Min, VTy::F32) => ("f32", f32_lit(f32::INFINITY)),
            (Red::Sum, VTy::I32) => ("s32", "0".to_string()),
            (Red::Max, VTy::I32) => ("s32", i32::MIN.to_string()),
            (Red::Min, VTy::I32) => ("s32", i32::MAX.to_string()),
            _ => return Err(self.unsupported(format!("block {} over {}", op.name(), ty.name()))),
        };
        let combine = |px: &mut Self, acc: &str, x: &str| match (op, t) {
            (Red::Sum, _) => px.line(format!("add.{t} {acc}, {acc}, {x};")),
            (Red::Max, "f32") => px.line(format!("max.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Min, "f32") => px.line(format!("min.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Max, _) => px.line(format!("max.{t} {acc}, {acc}, {x};")),
            (Red::Min, _) => px.line(format!("min.{t} {acc}, {acc}, {x};")),
        };
        let acc = self.reg(ty);
        self.line(format!(
            "mov.{} {acc}, {init};",
            if t == "f32" { "f32" } else { "s32" }
        ));
        let tid = self.tid.clone();
        let group = self.group;
        let last = vars.last().map_or(1, |v| v.1);
        // The group's threads stride over the innermost variable when it is long enough
        // (the outer ones are serial loops: no division per element); otherwise over the
        // flattened range, split with 32-bit division.
        let split = if last >= group as usize || vars.len() == 1 {
            vars.len().saturating_sub(1)
        } else {
            0
        };
        let (serial, strided) = (&vars[..split], vars[split..].to_vec());
        let mut outer = Vec::new();
        for &(v, ext) in serial {
            let l = self.open_loop("0", &ext.to_string());
            self.vars.insert(v, l.iv.clone());
            outer.push(l);
        }
        let n: usize = strided.iter().map(|v| v.1).product();
        if n > u32::MAX as usize - group as usize {
            return Err(self.unsupported("a block reduction over more than 2^32 points"));
        }
        // for (lin = tid; lin < n; lin += group·unroll): the copies' terms first, then
        // their sum in the order of the points (the same as one copy a trip).
        let lin = self.fresh("r");
        let head = self.label("bhead");
        let exit = self.label("bexit");
        self.line(format!("mov.u32 {lin}, {tid};"));
        self.body.push_str(&format!("{head}:\n"));
        let p = self.fresh("p");
        self.line(format!("setp.ge.u32 {p}, {lin}, {n};"));
        self.line(format!("@{p} bra {exit};"));
        let unroll = Self::unroll(n, group);
        let mut terms = Vec::with_capacity(unroll);
        for u in 0..unroll {
            terms.push(self.loop_copy(&lin, (u, group), &strided, |px| px.emit(body))?);
        }
        for x in &terms {
            combine(self, &acc, x);
        }
        self.line(format!(
            "add.u32 {lin}, {lin}, {};",
            group as usize * unroll
        ));
        self.line(format!("bra.uni {head};"));
        self.body.push_str(&format!("{exit}:\n"));
        while let Some(l) = outer.pop() {
            self.close_loop(l);
        }
        // Warp, then block.
        let other = self.reg(ty);
        if group == WARP {
            // One warp a point: a butterfly leaves the result in every lane.
            for off in [16, 8, 4, 2, 1] {
                self.line(format!("shfl.sync.bfly.b32 {other}, {acc}, {off}, 31, -1;"));
                combine(self, &acc, &other);
            }
            return Ok(acc);
        }
        let warp_reduce = |px: &mut Self, acc: &str, other: &str| {
            for off in [16, 8, 4, 2, 1] {
                px.line(format!("shfl.sync.down.b32 {other}, {acc}, {off}, 31, -1;"));
                combine(px, acc, other);
            }
        };
        warp_reduce(self, &acc, &other);
        let lane = self.fresh("r");
        let warp = self.fresh("r");
        self.line(format!("and.b32 {lane}, {tid}, 31;"));
        self.line(format!("shr.u32 {warp}, {tid}, 5;"));
        let addr = self.fresh("r");
        let pl = self.fresh("p");
        self.line("bar.sync 0;");
        self.line(format!("setp.eq.u32 {pl}, {lane}, 0;"));
        self.line(format!("mov.u32 {addr}, red_smem;"));
        let wa = self.fresh("r");
        self.line(format!("mad.lo.u32 {wa}, {warp}, 4, {addr};"));
        self.line(format!("@{pl} st.shared.b32 [{wa}], {acc};"));
        self.line("bar.sync 0;");
        let la = self.fresh("r");
        self.line(format!("mad.lo.u32 {la}, {lane}, 4, {addr};"));
        let pw = self.fresh("p");
        self.line(format!("setp.lt.u32 {pw}, {lane}, {};", BLOCK / 32));
        self.line(format!("mov.b32 {acc}, {init};"));
        self.line(format!("@{pw} ld.shared.b32 {acc}, [{la}];"));
        warp_reduce(self, &acc, &other);
        let p0 = self.fresh("p");
        self.line(format!("setp.eq.u32 {p0}, {tid}, 0;"));
        self.line(format!("@{p0} st.shared.b32 [{addr}], {acc};"));
        self.line("bar.sync 0;");
        self.line(format!("ld.shared.b32 {acc}, [{addr}];"));
        self.line("bar.sync 0;");
        Ok(acc)
    }

    fn argmax(&mut self, vars: &[(Var, usize)], body: ExprId) -> Res<String> {
        let ty = self.k.pool.ty(body);
        let best = self.reg(ty);
        let besti = self.fresh("rd");
        let count = self.fresh("rd");
        match ty {
            VTy::F32 => self.line(format!("mov.f32 {best}, {};", f32_lit(f32::NEG_INFINITY))),
            VTy::I32 => self.line(format!("mov.s32 {best}, {};", i32::MIN)),
            _ => return Err(self.unsupported("argmax over bool")),
        }
        self.line(format!("mov.s64 {besti}, 0;"));
        self.line(format!("mov.s64 {count}, 0;"));
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let better = self.fresh("p");
        let first = self.fresh("p");
        self.line(format!("setp.eq.s64 {first}, {count}, 0;"));
        match ty {
            VTy::F32 => {
                let gt = self.fresh("p");
                let xn = self.fresh("p");
                let bn = self.fresh("p");
                self.line(format!("setp.gt.f32 {gt}, {x}, {best};"));
                self.line(format!("setp.nan.f32 {xn}, {x}, {x};"));
                self.line(format!("setp.num.f32 {bn}, {best}, {best};"));
                self.line(format!("and.pred {xn}, {xn}, {bn};"));
                self.line(format!("or.pred {better}, {gt}, {xn};"));
            }
            _ => self.line(format!("setp.gt.s32 {better}, {x}, {best};")),
        }
        self.line(format!("or.pred {better}, {better}, {first};"));
        let sel = if ty == VTy::F32 { "f32" } else { "b32" };
        self.line(format!("selp.{sel} {best}, {x}, {best}, {better};"));
        self.line(format!("selp.b64 {besti}, {count}, {besti}, {better};"));
        self.line(format!("add.s64 {count}, {count}, 1;"));
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(besti)
    }

    fn uniform(&mut self, seed: u64, i: &str) -> String {
        let s0 = crate::eager::kernels::splitmix64(seed ^ 0xD1B5_4A32_D192_ED03);
        let z = self.fresh("rd");
        self.line(format!("add.u64 {z}, {i}, 0x{s0:016X};"));
        self.line(format!(
            "add.u64 {z}, {z}, 0x{:016X};",
            0x9E37_79B9_7F4A_7C15u64
        ));
        let t = self.fresh("rd");
        for (sh, mul) in [
            (30, Some(0xBF58_476D_1CE4_E5B9u64)),
            (27, Some(0x94D0_49BB_1331_11EBu64)),
            (31, None),
        ] {
            self.line(format!("shr.u64 {t}, {z}, {sh};"));
            self.line(format!("xor.b64 {z}, {z}, {t};"));
            if let Some(m) = mul {
                self.line(format!("mul.lo.u64 {z}, {z}, 0x{m:016X};"));
            }
        }
        self.line(format!("shr.u64 {z}, {z}, 40;"));
        let f = self.fresh("f");
        self.line(format!("cvt.rn.f32.u64 {f}, {z};"));
        self.line(format!(
            "mul.f32 {f}, {f}, {};",
            f32_lit(1.0 / (1u64 << 24) as f32)
        ));
        f
    }

    fn exp(&mut self, x: &str) -> String {
        let t = self.fresh("f");
        self.line(format!(
            "mul.f32 {t}, {x}, {};",
            f32_lit(std::f32::consts::LOG2_E)
        ));
        let r = self.fresh("f");
        self.line(format!("ex2.approx.f32 {r}, {t};"));
        r
    }

    fn tanh(&mut self, x: &str) -> String {
        let a = self.fresh("f");
        self.line(format!("abs.f32 {a}, {x};"));
        let x2 = self.fresh("f");
        self.line(format!("mul.f32 {x2}, {x}, {x};"));
        let p = self.fresh("f");
        self.line(format!(
            "mov.f32 {p}, {};",
            f32_lit((62.0f64 / 2835.0) as f32)
        ));
        for c in [-17.0f64 / 315.0, 2.0 / 15.0, -1.0 / 3.0] {
            self.line(format!("fma.rn.f32 {p}, {p}, {x2}, {};", f32_lit(c as f32)));
        }
        let small = self.fresh("f");
        self.line(format!("mul.f32 {small}, {x2}, {p};"));
        self.line(format!("fma.rn.f32 {small}, {small}, {x}, {x};"));
        let ac = self.fresh("f");
        self.line(format!("min.f32 {ac}, {a}, {};", f32_lit(9.0)));
        self.line(format!("add.f32 {ac}, {ac}, {ac};"));
        let e = self.exp(&ac);
        let big = self.fresh("f");
        self.line(format!("add.f32 {big}, {e}, {};", f32_lit(1.0)));
        self.line(format!("div.rn.f32 {big}, {}, {big};", f32_lit(2.0)));
        self.line(format!("sub.f32 {big}, {}, {big};", f32_lit(1.0)));
        self.line(format!("copysign.f32 {big}, {x}, {big};"));
        let p2 = self.fresh("p");
        self.line(format!("setp.lt.f32 {p2}, {a}, {};", f32_lit(0.3)));
        let r = self.fresh("f");
        self.line(format!("selp.f32 {r}, {small}, {big}, {p2};"));
        r
    }

    fn erf(&mut self, x: &str) -> String {
        // Abramowitz & Stegun 7.1.26.
        let a = self.fresh("f");
        self.line(format!("abs.f32 {a}, {x};"));
        let t = self.fresh("f");
        self.line(format!(
            "fma.rn.f32 {t}, {a}, {}, {};",
            f32_lit(0.327_591_1),
            f32_lit(1.0)
        ));
        self.line(format!("rcp.rn.f32 {t}, {t};"));
        let p = self.fresh("f");
        self.line(format!("mov.f32 {p}, {};", f32_lit(1.061_405_4)));
        for c in [-1.453_152_1f32, 1.421_413_7, -0.284_496_72, 0.254_829_6] {
            self.line(format!("fma.rn.f32 {p}, {p}, {t}, {};", f32_lit(c)));
        }
        self.line(format!("mul.f32 {p}, {p}, {t};"));
        let na2 = self.fresh("f");
        self.line(format!("mul.f32 {na2}, {a}, {a};"));
        self.line(format!("neg.f32 {na2}, {na2};"));
        let e = self.exp(&na2);
        let r = self.fresh("f");
        self.line(format!("mul.f32 {r}, {p}, {e};"));
        self.line(format!("sub.f32 {r}, {}, {r};", f32_lit(1.0)));
        self.line(format!("copysign.f32 {r}, {x}, {r};"));
        r
    }

    fn unary(&mut self, op: UnaryOp, ty: VTy, x: &str) -> Res<String> {
        match ty {
            VTy::F32 => {
                let r = self.fresh("f");
                match op {
                    UnaryOp::Neg => self.line(format!("neg.f32 {r}, {x};")),
                    UnaryOp::Abs => self.line(format!("abs.f32 {r}, {x};")),
                    UnaryOp::Exp => return Ok(self.exp(x)),
                    UnaryOp::Log => {
                        self.line(format!("lg2.approx.f32 {r}, {x};"));
                        self.line(format!(
                            "mul.f32 {r}, {r}, {};",
                            f32_lit(std::f32::consts::LN_2)
                        ));
                    }
                    UnaryOp::Sqrt => self.line(format!("sqrt.rn.f32 {r}, {x};")),
                    UnaryOp::Rsqrt => {
                        self.line(format!("sqrt.rn.f32 {r}, {x};"));
                        self.line(format!("rcp.rn.f32 {r}, {r};"));
                    }
                    UnaryOp::Recip => self.line(format!("rcp.rn.f32 {r}, {x};")),
                    UnaryOp::Tanh => return Ok(self.tanh(x)),
                    UnaryOp::Sigmoid | UnaryOp::Silu => {
                        let n = self.fresh("f");
                        self.line(format!("neg.f32 {n}, {x};"));
                        let e = self.exp(&n);
                        self.line(format!("add.f32 {r}, {e}, {};", f32_lit(1.0)));
                        let num = if op == UnaryOp::Silu {
                            x.to_string()
                        } else {
                            f32_lit(1.0)
                        };
                        self.line(format!("div.rn.f32 {r}, {num}, {r};"));
                    }
                    UnaryOp::Relu => {
                        let p = self.fresh("p");
                        self.line(format!("setp.gt.f32 {p}, {x}, {};", f32_lit(0.0)));
                        self.line(format!("selp.f32 {r}, {x}, {}, {p};", f32_lit(0.0)));
                    }
                    UnaryOp::Gelu => {
                        let c = (2.0f64 / std::f64::consts::PI).sqrt() as f32;
                        let t = self.fresh("f");
                        self.line(format!("mul.f32 {t}, {x}, {x};"));
                        self.line(format!("mul.f32 {t}, {t}, {x};"));
                        self.line(format!("fma.rn.f32 {t}, {t}, {}, {x};", f32_lit(0.044715)));
                        self.line(format!("mul.f32 {t}, {t}, {};", f32_lit(c)));
                        let th = self.tanh(&t);
                        self.line(format!("add.f32 {r}, {th}, {};", f32_lit(1.0)));
                        self.line(format!("mul.f32 {r}, {r}, {x};"));
                        self.line(format!("mul.f32 {r}, {r}, {};", f32_lit(0.5)));
                    }
                    UnaryOp::Sin => self.line(format!("sin.approx.f32 {r}, {x};")),
                    UnaryOp::Cos => self.line(format!("cos.approx.f32 {r}, {x};")),
                    UnaryOp::Erf => return Ok(self.erf(x)),
                    UnaryOp::Not => return Err(self.unsupported("`not` of a float")),
                }
                Ok(r)
            }
            VTy::I32 | VTy::I64 => {
                let t = if ty == VTy::I32 { "s32" } else { "s64" };
                let r = self.reg(ty);
                match op {
                    UnaryOp::Neg => self.line(format!("neg.{t} {r}, {x};")),
                    UnaryOp::Abs => self.line(format!("abs.{t} {r}, {x};")),
                    UnaryOp::Relu => self.line(format!("max.{t} {r}, {x}, 0;")),
                    _ => return Err(self.unsupported(format!("{} of an integer", op.name()))),
                }
                Ok(r)
            }
            VTy::Bool => match op {
                UnaryOp::Not => {
                    let r = self.fresh("p");
                    self.line(format!("not.pred {r}, {x};"));
                    Ok(r)
                }
                _ => Err(self.unsupported(format!("{} of a bool", op.name()))),
            },
        }
    }

    fn binary(&mut self, op: BinaryOp, ty: VTy, x: &str, y: &str) -> Res<String> {
        use BinaryOp as B;
        let cmp = |op: BinaryOp, float: bool| -> &'static str {
            match (op, float) {
                (B::Eq, _) => "eq",
                (B::Ne, true) => "neu",
                (B::Ne, false) => "ne",
                (B::Lt, _) => "lt",
                (B::Le, _) => "le",
                (B::Gt, _) => "gt",
                _ => "ge",
            }
        };
        if op.is_comparison() && ty != VTy::Bool {
            let p = self.fresh("p");
            let t = match ty {
                VTy::F32 => "f32",
                VTy::I32 => "s32",
                _ => "s64",
            };
            self.line(format!(
                "setp.{}.{t} {p}, {x}, {y};",
                cmp(op, ty == VTy::F32)
            ));
            return Ok(p);
        }
        match ty {
            VTy::F32 => {
                let r = self.fresh("f");
                match op {
                    B::Add => self.line(format!("add.f32 {r}, {x}, {y};")),
                    B::Sub => self.line(format!("sub.f32 {r}, {x}, {y};")),
                    B::Mul => self.line(format!("mul.f32 {r}, {x}, {y};")),
                    B::Div => self.line(format!("div.rn.f32 {r}, {x}, {y};")),
                    B::Rem => {
                        let q = self.fresh("f");
                        self.line(format!("div.rn.f32 {q}, {x}, {y};"));
                        self.line(format!("cvt.rmi.f32.f32 {q}, {q};"));
                        self.line(format!("mul.f32 {q}, {q}, {y};"));
                        self.line(format!("sub.f32 {r}, {x}, {q};"));
                    }
                    B::Pow => {
                        let l = self.fresh("f");
                        self.line(format!("lg2.approx.f32 {l}, {x};"));
                        self.line(format!("mul.f32 {l}, {l}, {y};"));
                        self.line(format!("ex2.approx.f32 {r}, {l};"));
                    }
                    B::Maximum => self.line(format!("max.NaN.f32 {r}, {x}, {y};")),
                    B::Minimum => self.line(format!("min.NaN.f32 {r}, {x}, {y};")),
                    _ => return Err(self.unsupported("logical op on floats")),
                }
                Ok(r)
            }
            VTy::I32 => {
                let r = self.fresh("r");
                match op {
                    B::Add => self.line(format!("add.s32 {r}, {x}, {y};")),
                    B::Sub => self.line(format!("sub.s32 {r}, {x}, {y};")),
                    B::Mul => self.line(format!("mul.lo.s32 {r}, {x}, {y};")),
                    B::Div | B::Rem => return Ok(self.floor_divmod(op, x, y)),
                    B::Pow => {
                        let (fx, fy) = (self.fresh("f"), self.fresh("f"));
                        self.line(format!("cvt.rn.f32.s32 {fx}, {x};"));
                        self.line(format!("cvt.rn.f32.s32 {fy}, {y};"));
                        let p = self.binary(B::Pow, VTy::F32, &fx, &fy)?;
                        self.line(format!("cvt.rni.s32.f32 {r}, {p};"));
                    }
                    B::Maximum => self.line(format!("max.s32 {r}, {x}, {y};")),
                    B::Minimum => self.line(format!("min.s32 {r}, {x}, {y};")),
                    _ => return Err(self.unsupported("logical op on i32")),
                }
                Ok(r)
            }
            VTy::I64 => {
                let r = self.fresh("rd");
                let ins = match op {
                    B::Add => "add.s64",
                    B::Sub => "sub.s64",
                    B::Mul => "mul.lo.s64",
                    B::Div => "div.s64",
                    B::Rem => "rem.s64",
                    B::Maximum => "max.s64",
                    B::Minimum => "min.s64",
                    _ => return Err(self.unsupported("op on indices")),
                };
                self.line(format!("{ins} {r}, {x}, {y};"));
                Ok(r)
            }
            VTy::Bool => {
                let r = self.fresh("p");
                match op {
                    B::And => self.line(format!("and.pred {r}, {x}, {y};")),
                    B::Or => self.line(format!("or.pred {r}, {x}, {y};")),
                    B::Ne => self.line(format!("xor.pred {r}, {x}, {y};")),
                    B::Eq => {
                        self.line(format!("xor.pred {r}, {x}, {y};"));
                        self.line(format!("not.pred {r}, {r};"));
                    }
                    _ => return Err(self.unsupported(format!("{} of bools", op.name()))),
                }
                Ok(r)
            }
        }
    }

    fn floor_divmod(&mut self, op: BinaryOp, x: &str, y: &str) -> String {
        let pz = self.fresh("p");
        let d = self.fresh("r");
        self.line(format!("setp.eq.s32 {pz}, {y}, 0;"));
        self.line(format!("selp.s32 {d}, 1, {y}, {pz};"));
        let q = self.fresh("r");
        let rm = self.fresh("r");
        self.line(format!("div.s32 {q}, {x}, {d};"));
        self.line(format!("rem.s32 {rm}, {x}, {d};"));
        let (p1, p2, p3) = (self.fresh("p"), self.fresh("p"), self.fresh("p"));
        self.line(format!("setp.ne.s32 {p1}, {rm}, 0;"));
        self.line(format!("setp.lt.s32 {p2}, {rm}, 0;"));
        self.line(format!("setp.lt.s32 {p3}, {d}, 0;"));
        self.line(format!("xor.pred {p2}, {p2}, {p3};"));
        self.line(format!("and.pred {p1}, {p1}, {p2};"));
        let r = self.fresh("r");
        if op == BinaryOp::Div {
            self.line(format!("sub.s32 {r}, {q}, 1;"));
            self.line(format!("selp.s32 {r}, {r}, {q}, {p1};"));
        } else {
            self.line(format!("add.s32 {r}, {rm}, {d};"));
            self.line(format!("selp.s32 {r}, {r}, {rm}, {p1};"));
        }
        self.line(format!("selp.s32 {r}, 0, {r}, {pz};"));
        r
    }

    fn cast(&mut self, from: VTy, to: VTy, x: &str) -> String {
        if from == to {
            return x.to_string();
        }
        let r = self.reg(to);
        match (from, to) {
            (VTy::F32, VTy::Bool) => self.line(format!("setp.neu.f32 {r}, {x}, {};", f32_lit(0.0))),
            (VTy::F32, VTy::I32) => self.line(format!("cvt.rzi.s32.f32 {r}, {x};")),
            (VTy::F32, _) => self.line(format!("cvt.rzi.s64.f32 {r}, {x};")),
            (VTy::I32, VTy::I64) => self.line(format!("cvt.s64.s32 {r}, {x};")),
            (VTy::I64, VTy::I32) => self.line(format!("cvt.u32.u64 {r}, {x};")),
            (VTy::I32, VTy::F32) => self.line(format!("cvt.rn.f32.s32 {r}, {x};")),
            (VTy::I64, VTy::F32) => self.line(format!("cvt.rn.f32.s64 {r}, {x};")),
            (VTy::I32, _) => self.line(format!("setp.ne.s32 {r}, {x}, 0;")),
            (VTy::I64, _) => self.line(format!("setp.ne.s64 {r}, {x}, 0;")),
            (VTy::Bool, VTy::F32) => self.line(format!(
                "selp.f32 {r}, {}, {}, {x};",
                f32_lit(1.0),
                f32_lit(0.0)
            )),
            (VTy::Bool, VTy::I32) => self.line(format!("selp.s32 {r}, 1, 0, {x};")),
            (VTy::Bool, _) => self.line(format!("selp.s64 {r}, 1, 0, {x};")),
        }
        r
    }
}

/// How many leading domain axes are spread over threads: all of them, unless a reduction
/// is hoisted to the loop of an axis (then up to that axis, so it is computed once).
fn parallel_axes(k: &Kernel, site: &[Option<Var>], live: &[ExprId]) -> usize {
    let rank = k.domain.len();
    let mut p = rank;
    for &e in live {
        if matches!(k.pool.get(e), E::Reduce { .. } | E::ArgMax { .. }) {
            match site[e.0 as usize] {
                Some(v) if (v as usize) < rank => p = p.min(v as usize + 1),
                Some(_) => {}
                None => p = 0,
            }
        }
    }
    p
}

/// Tiled matmul: rows of the block tile.
const TILE_M: usize = 64;
/// Tiled matmul: columns of the block tile.
const TILE_N: usize = 64;
/// Tiled matmul: depth of one `k` step staged through shared memory.
const TILE_K: usize = 16;
/// Row stride (in floats) of the shared tiles `[TILE_K][TILE_STRIDE]`: padded by 4 so
/// that transposing stores spread over the banks while rows stay 16-byte aligned.
const TILE_STRIDE: usize = TILE_M + 4;

/// The grid of the tiled matmul, or `None` where the per-element path is used instead
/// (non-f32 operands, small or thin outputs, or a grid that does not fit).
fn tiled_grid(mm: &Matmul) -> Option<[u32; 3]> {
    if mm.a.dtype != DType::F32 || mm.b.dtype != DType::F32 {
        return None;
    }
    // Small outputs take the per-element path, unless k is split (then the tiles are
    // what spreads the work).
    if mm.m < 16 || mm.n < 16 || (mm.m * mm.n < 4096 && mm.split_k <= 1) {
        return None;
    }
    // Split-K: the blocks of one output tile are consecutive along z.
    let batch: usize = mm.batch.iter().product::<usize>() * mm.split_k.max(1);
    let (gx, gy) = (mm.n.div_ceil(TILE_N), mm.m.div_ceil(TILE_M));
    if batch == 0 || batch > 65535 || gy > 65535 || gx > i32::MAX as usize {
        return None;
    }
    Some([gx as u32, gy as u32, batch as u32])
}

/// The `k` each split of a split-K matmul sums: a whole number of `TILE_K` steps.
fn split_depth(mm: &Matmul) -> usize {
    mm.k.div_ceil(mm.split_k.max(1)).div_ceil(TILE_K) * TILE_K
}

/// Classic shared-memory SGEMM: a 64×64 output tile per block of 256 threads, each thread
/// holding a 4×4 micro-tile (rows `ty*4 + r`, columns `tx + 16*c`) in registers; A and B
/// are staged 16 deep through shared memory (`mm_as[k][row]`, `mm_bs[k][col]`). Every
/// thread runs every `bar.sync`: out-of-range loads read 0 and out-of-range elements skip
/// only their epilogue.
fn emit_tiled_matmul(
    k: &Kernel,
    mm: &Matmul,
    grid: [u32; 3],
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offset_of, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let row_bytes = TILE_STRIDE * 4;

    let FfmaTile {
        t,
        tx,
        ty,
        origin:
            TileOrigin {
                abase,
                bbase,
                abuf,
                bbuf,
                row0,
                col0,
                ..
            },
        split,
    } = ffma_tile(&mut px, mm, (TILE_M, TILE_N), mm.split_k, false)?;
    let (sa, sb) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {sa}, mm_as;"));
    px.line(format!("mov.u32 {sb}, mm_bs;"));

    // Load slots: each thread moves 4 elements of A and 4 of B per step. The fast
    // thread index runs along the operand's unit stride so that a warp reads contiguous
    // memory: along k for A when A.cs == 1, else along rows; along columns for B unless
    // only B.rs is 1.
    struct Slot {
        /// Shared byte address of the element.
        smem: String,
        /// Element index of the operand at k = 0 (base + batch + row/col part).
        base: String,
        /// In-range row (A) or column (B).
        ok: String,
        /// k offset inside the step.
        kk: String,
        /// The row (A) or column (B), clamped into range (gathers).
        at: String,
    }
    let slots = |px: &mut Px,
                 k_fast: bool,
                 extent: usize,
                 stride: i64,
                 first: &str,
                 opbase: &str,
                 smem0: &str,
                 gathered: bool|
     -> Vec<Slot> {
        let mut out = Vec::new();
        for r in 0..4u32 {
            // (kk, x): x is the row of A or the column of B inside the tile.
            let (kk, x) = (px.fresh("r"), px.fresh("r"));
            if k_fast {
                px.line(format!("and.b32 {kk}, {t}, {};", TILE_K - 1));
                px.line(format!("shr.u32 {x}, {t}, 4;"));
                px.line(format!("add.u32 {x}, {x}, {};", 16 * r));
            } else {
                px.line(format!("and.b32 {x}, {t}, {};", TILE_M - 1));
                px.line(format!("shr.u32 {kk}, {t}, 6;"));
                px.line(format!("add.u32 {kk}, {kk}, {};", 4 * r));
            }
            let smem = px.fresh("r");
            px.line(format!("mad.lo.u32 {smem}, {kk}, {TILE_STRIDE}, {x};"));
            px.line(format!("mad.lo.u32 {smem}, {smem}, 4, {smem0};"));
            let g = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {g}, {x};"));
            px.line(format!("add.s64 {g}, {g}, {first};"));
            let ok = px.fresh("p");
            px.line(format!("setp.lt.s64 {ok}, {g}, {extent};"));
            let base = px.fresh("rd");
            px.line(format!("mad.lo.s64 {base}, {g}, {stride}, {opbase};"));
            let kk64 = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {kk64}, {kk};"));
            let at = if gathered {
                let at = px.fresh("rd");
                px.line(format!("min.s64 {at}, {g}, {};", extent.saturating_sub(1)));
                at
            } else {
                String::new()
            };
            out.push(Slot {
                smem,
                base,
                ok,
                kk: kk64,
                at,
            });
        }
        out
    };
    let a_fast = mm.a.gather.as_ref().map_or(mm.a.cs == 1, |g| g.k_fast);
    let a_slots = slots(
        &mut px,
        a_fast,
        m,
        mm.a.rs,
        &row0,
        &abase,
        &sa,
        mm.a.gather.is_some(),
    );
    let b_k_fast =
        mm.b.gather
            .as_ref()
            .map_or(mm.b.rs == 1 && mm.b.cs != 1, |g| g.k_fast);
    let b_slots = slots(
        &mut px,
        b_k_fast,
        n,
        mm.b.cs,
        &col0,
        &bbase,
        &sb,
        mm.b.gather.is_some(),
    );
    // Gathers: what depends on a slot's row (A) or column (B) alone, once per slot;
    // `fixed[side][slot]`.
    let mut fixed: [Vec<HashMap<ExprId, String>>; 2] = [Vec::new(), Vec::new()];
    for (side, (slots, g)) in [(&a_slots, &mm.a.gather), (&b_slots, &mm.b.gather)]
        .into_iter()
        .enumerate()
    {
        let (var, nodes) = px.fixed_nodes(g.as_ref(), side == 0);
        for s in slots.iter() {
            fixed[side].push(px.gather_fixed_part(&nodes, var, &s.at)?);
        }
    }

    // Shared addresses this thread's compute reads at kk = 0.
    let (ra, rb) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mad.lo.u32 {ra}, {ty}, 16, {sa};"));
    px.line(format!("mad.lo.u32 {rb}, {tx}, 4, {sb};"));

    let accs: Vec<String> = (0..16).map(|_| px.fresh("f")).collect();
    for a in &accs {
        px.line(format!("mov.f32 {a}, {};", f32_lit(0.0)));
    }
    let av: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
    let bv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();

    // for (k0 = 0; k0 < K; k0 += TILE_K): the condition is uniform over the block. A
    // split-K block runs its slice [s * depth, (s + 1) * depth) only.
    let k0 = px.fresh("rd");
    let head = px.label("kstep");
    let exit = px.label("kdone");
    let kend = match &split {
        Some(s) => {
            let depth = split_depth(mm);
            px.line(format!("mul.lo.s64 {k0}, {s}, {depth};"));
            let e = px.fresh("rd");
            px.line(format!("add.s64 {e}, {k0}, {depth};"));
            px.line(format!("min.s64 {e}, {e}, {kd};"));
            e
        }
        None => {
            px.line(format!("mov.s64 {k0}, 0;"));
            kd.to_string()
        }
    };
    px.body.push_str(&format!("{head}:\n"));
    let pk = px.fresh("p");
    px.line(format!("setp.ge.s64 {pk}, {k0}, {kend};"));
    px.line(format!("@{pk} bra.uni {exit};"));
    let sides = [
        (&a_slots, &abuf, mm.a.cs, &mm.a.gather, true),
        (&b_slots, &bbuf, mm.b.rs, &mm.b.gather, false),
    ];
    for (side, (slots, buf, kstride, gather, a_side)) in sides.into_iter().enumerate() {
        for (si, s) in slots.iter().enumerate() {
            let kg = px.fresh("rd");
            px.line(format!("add.s64 {kg}, {k0}, {};", s.kk));
            let p = px.fresh("p");
            px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {};", s.ok));
            if let Some(g) = gather {
                // Clamped coordinates keep every load in bounds; out-of-range slots
                // store 0.
                let kc = px.fresh("rd");
                px.line(format!("min.s64 {kc}, {kg}, {};", kd.saturating_sub(1)));
                let cache = &fixed[side][si];
                let v = if a_side {
                    px.gather(g, &s.at, &kc, cache)?
                } else {
                    px.gather(g, &kc, &s.at, cache)?
                };
                let z = px.fresh("f");
                px.line(format!("selp.f32 {z}, {v}, {}, {p};", f32_lit(0.0)));
                px.line(format!("st.shared.f32 [{}], {z};", s.smem));
                continue;
            }
            let idx = px.fresh("rd");
            px.line(format!("mad.lo.s64 {idx}, {kg}, {kstride}, {};", s.base));
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {idx}, 4, {buf};"));
            let v = px.fresh("f");
            px.line(format!("mov.f32 {v}, {};", f32_lit(0.0)));
            px.line(format!("@{p} ld.global.f32 {v}, [{addr}];"));
            px.line(format!("st.shared.f32 [{}], {v};", s.smem));
        }
    }
    px.line("bar.sync 0;");
    for kk in 0..TILE_K {
        let off = kk * row_bytes;
        px.line(format!(
            "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{ra}+{off}];",
            av[0], av[1], av[2], av[3]
        ));
        for (c, b) in bv.iter().enumerate() {
            px.line(format!("ld.shared.f32 {b}, [{rb}+{}];", off + c * 64));
        }
        for r in 0..4 {
            for c in 0..4 {
                let a = &accs[r * 4 + c];
                px.line(format!("fma.rn.f32 {a}, {}, {}, {a};", av[r], bv[c]));
            }
        }
    }
    px.line("bar.sync 0;");
    px.line(format!("add.s64 {k0}, {k0}, {TILE_K};"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));

    // Epilogue, element by element: rows ty*4 + r, columns tx + 16*c.
    let mut rows = Vec::new();
    for r in 0..4u32 {
        let (i, ok) = (px.fresh("rd"), px.fresh("p"));
        px.line(format!("mad.wide.u32 {i}, {ty}, 4, {row0};"));
        px.line(format!("add.s64 {i}, {i}, {r};"));
        px.line(format!("setp.lt.s64 {ok}, {i}, {m};"));
        rows.push((i, ok));
    }
    let mut cols = Vec::new();
    for c in 0..4u32 {
        let (j, ok) = (px.fresh("rd"), px.fresh("p"));
        px.line(format!("cvt.u64.u32 {j}, {tx};"));
        px.line(format!("add.s64 {j}, {j}, {col0};"));
        px.line(format!("add.s64 {j}, {j}, {};", 16 * c));
        px.line(format!("setp.lt.s64 {ok}, {j}, {n};"));
        cols.push((j, ok));
    }
    epilogue(
        &mut px,
        mm,
        &rows,
        &cols,
        &|r, c| accs[r * 4 + c].clone(),
        false,
        0,
    )?;
    px.line("ret;");
    let tile = TILE_K * TILE_STRIDE;
    let shared = format!(
        "\t.shared .align 16 .f32 mm_as[{tile}];\n\t.shared .align 16 .f32 mm_bs[{tile}];\n"
    );
    Ok((
        px.finish(&shared),
        LaunchShape {
            grid,
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}

fn emit_kernel(
    k: &Kernel,
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    opts: PtxOptions,
) -> Res<(String, LaunchShape)> {
    if let Some(at) = &k.attention {
        return attention::emit(k, at, offset_of);
    }
    if let Some(mm) = &k.matmul {
        if let Some(plan) = wgmma::plan(mm, offset_of) {
            return wgmma::emit(k, mm, &plan, offset_of);
        }
        if let Some((kind, grid)) = mma_grid(mm, opts) {
            return emit_mma_matmul(k, mm, kind, grid, offset_of);
        }
        if let Some(sg) = sgemm_grid(mm) {
            return emit_sgemm(k, mm, sg, offset_of, opts.scratch_offset);
        }
        if let Some(grid) = tiled_grid(mm) {
            return emit_tiled_matmul(k, mm, grid, offset_of);
        }
    }
    let live = k.live_nodes();
    let site = sites(k);
    let rank = k.domain.len();
    // Axes outside every reduction: the points a thread (or a block) computes.
    let p0 = if k.matmul.is_some() {
        rank
    } else {
        parallel_axes(k, &site, &live)
    };
    // Trailing axes of extent 1 need no loop: they are parallel too.
    let par = if k.domain[p0..].iter().all(|&d| d == 1) {
        rank
    } else {
        p0
    };
    // Block mode: one block per point of the first `p0` axes. The reductions computed
    // once per point (sited at the last of those axes) are shared among the block's
    // threads; then the threads stride over the point's remaining elements (a row of a
    // softmax, a layer norm or a loss), so that their loads and stores are coalesced.
    let boundary = p0.checked_sub(1).map(|d| d as Var);
    let top: Vec<ExprId> = if k.matmul.is_none() {
        live.iter()
            .copied()
            .filter(|&e| {
                matches!(k.pool.get(e), E::Reduce { .. })
                    && site[e.0 as usize] == boundary
                    && matches!(k.pool.ty(e), VTy::F32 | VTy::I32)
            })
            .collect()
    } else {
        Vec::new()
    };
    let longest = top
        .iter()
        .map(|&e| match k.pool.get(e) {
            E::Reduce { vars, .. } => vars.iter().map(|v| v.1).product::<usize>(),
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    let argmax_at_top = live
        .iter()
        .any(|&e| matches!(k.pool.get(e), E::ArgMax { .. }) && site[e.0 as usize] == boundary);
    let block_points: u64 = k.domain[..p0]
        .iter()
        .map(|&d| d as u64)
        .product::<u64>()
        .max(1);
    let inner: u64 = k.domain[p0..].iter().map(|&d| d as u64).product();
    // With one element per point, a block per point pays off when there are too few
    // points to fill the GPU with one thread each; with many points (a convolution's
    // outputs) one thread per point wins. With whole rows per point, a thread per row
    // would read its row alone (uncoalesced): a block per row wins once rows are long.
    // Many points whose rows lie along the reduction (gpt's 49152 softmax rows of 512)
    // take a warp each: a thread per row read 0.7 TB/s on an H100, and a block of 256 per
    // row of a few thousand elements spent its time in barriers. Accumulating stores (a
    // scatter's `+=`) stay atomic: each element is still stored by one thread (gpt's
    // embedding gradient, fused with a row reduction, ran 4096 threads for 1.3 ms).
    // A row statistic alone (one element per point) takes a warp per row also when there
    // are a few thousand rows of at most 2048 (gpt's RMS norm statistics, 4096 rows of 768:
    // 14.2 → 10.4 µs on an H100). With the row's elements stored as well (the norm's
    // backward), a block per row stays faster (23.2 µs against 25.9).
    let many = block_points > 16384;
    let along_rows = !top.is_empty() && rows_along_reduction(k, &top, boundary);
    let along = many && along_rows;
    let warp_rows = along || (along_rows && inner <= 1 && block_points >= 2048 && longest <= 2048);
    let block_mode = !top.is_empty()
        && !argmax_at_top
        && inner <= u32::MAX as u64 - BLOCK as u64
        && block_points < 1 << 31
        && if inner <= 1 {
            longest >= 64 && (!many || along)
        } else {
            longest >= 64 || inner >= 64
        };
    let group = if block_mode && warp_rows && inner <= 4096 {
        WARP
    } else {
        BLOCK
    };
    let par = if block_mode { p0 } else { par };
    let points: u64 = k.domain[..par]
        .iter()
        .map(|&d| d as u64)
        .product::<u64>()
        .max(1);
    let threads: u64 = if block_mode {
        points * group as u64
    } else {
        points
    };
    if !block_mode && k.matmul.is_none() && par == rank {
        if let Some(plan) = vector_plan(k, &site, &live, offset_of) {
            return emit_vector_pointwise(k, offset_of, site, live, &plan);
        }
    }
    let mut px = Px::new(k, offset_of, site, live);
    if block_mode {
        px.block_reductions = top;
        px.group = group;
    }
    px.load_arena();
    let (a, b, c) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {a}, %ctaid.x;"));
    px.line(format!("mov.u32 {b}, %ntid.x;"));
    px.line(format!("mov.u32 {c}, %tid.x;"));
    px.tid = c.clone();
    let tid = px.fresh("rd");
    let done = px.label("done");
    if block_mode && group == WARP {
        // One warp per point: the point is the block index times the warps of a block
        // plus the warp's; the thread's index in its group is its lane.
        let (w, lane) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("shr.u32 {w}, {c}, 5;"));
        px.line(format!("and.b32 {lane}, {c}, 31;"));
        px.line(format!("mul.wide.u32 {tid}, {a}, {};", BLOCK / WARP));
        let w64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {w64}, {w};"));
        px.line(format!("add.u64 {tid}, {tid}, {w64};"));
        let pd = px.fresh("p");
        px.line(format!("setp.ge.u64 {pd}, {tid}, {points};"));
        px.line(format!("@{pd} bra {done};"));
        px.tid = lane;
    } else if block_mode {
        // One block per point: the point is the block index.
        px.line(format!("cvt.u64.u32 {tid}, {a};"));
    } else {
        px.line(format!("mul.wide.u32 {tid}, {a}, {b};"));
        let c64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {c64}, {c};"));
        px.line(format!("add.u64 {tid}, {tid}, {c64};"));
        let pd = px.fresh("p");
        px.line(format!("setp.ge.u64 {pd}, {tid}, {threads};"));
        px.line(format!("@{pd} bra {done};"));
    }
    // Thread index → the parallel axes (row-major), in 32-bit arithmetic when the index
    // fits (64-bit division is a long subroutine on the GPU).
    if points < u32::MAX as u64 {
        let r = px.fresh("r");
        px.line(format!("cvt.u32.u64 {r}, {tid};"));
        let dims: Vec<(Var, usize)> = (0..par).map(|d| (d as Var, k.domain[d])).collect();
        px.bind_linear(&r, &dims);
    } else {
        px.digits(&tid, &k.domain[..par], true, |px, d, v| {
            px.vars.insert(d as Var, v);
        });
    }
    if let Some(mm) = &k.matmul {
        px.matmul_per_element(mm)?;
    } else {
        px.emit_site(None)?;
        for d in 0..par {
            px.emit_site(Some(d as Var))?;
        }
        if block_mode {
            // for (lin = tid; lin < inner; lin += group): the point's remaining elements.
            let lin = px.fresh("r");
            let head = px.label("ihead");
            let tidr = px.tid.clone();
            px.line(format!("mov.u32 {lin}, {tidr};"));
            px.body.push_str(&format!("{head}:\n"));
            let pe = px.fresh("p");
            px.line(format!("setp.ge.u32 {pe}, {lin}, {inner};"));
            px.line(format!("@{pe} bra {done};"));
            // Unrolled as the reductions are: every copy's values, then their stores
            // (a load after a store could not be moved above it).
            let dims: Vec<(Var, usize)> = (par..rank).map(|d| (d as Var, k.domain[d])).collect();
            let unroll = Px::unroll(inner as usize, group);
            let mut stores = Vec::new();
            for u in 0..unroll {
                let copy = px.loop_copy(&lin, (u, group), &dims, |px| {
                    for d in par..rank {
                        px.emit_site(Some(d as Var))?;
                    }
                    px.store_values()
                })?;
                stores.extend(copy);
            }
            for (addr, s, val) in stores {
                px.store(&addr, s.dtype, &val, s.accumulate)?;
            }
            px.line(format!(
                "add.u32 {lin}, {lin}, {};",
                group as usize * unroll
            ));
            px.line(format!("bra.uni {head};"));
        } else {
            let mut open = Vec::new();
            for d in par..rank {
                let l = px.open_loop("0", &k.domain[d].to_string());
                px.vars.insert(d as Var, l.iv.clone());
                px.emit_site(Some(d as Var))?;
                open.push(l);
            }
            px.stores()?;
            while let Some(l) = open.pop() {
                px.close_loop(l);
            }
        }
    }
    px.body.push_str(&format!("{done}:\n\tret;\n"));
    let shared = if block_mode && group == BLOCK {
        format!("\t.shared .align 4 .b8 red_smem[{}];\n", BLOCK / 32 * 4)
    } else {
        String::new()
    };
    let text = px.finish(&shared);
    let grid = threads.div_ceil(BLOCK as u64);
    let grid = u32::try_from(grid).map_err(|_| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: format!("{threads} threads do not fit one grid"),
    })?;
    Ok((
        text,
        LaunchShape {
            grid: [grid.max(1), 1, 1],
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}

/// True when some load of the reductions in `top` is contiguous along the innermost
/// reduction variable but not along the point's innermost axis `point`: the data a warp
/// per point reads in one access is then one contiguous run.
fn rows_along_reduction(k: &Kernel, top: &[ExprId], point: Option<Var>) -> bool {
    let inner: Vec<Var> = top
        .iter()
        .filter_map(|&e| match k.pool.get(e) {
            E::Reduce { vars, .. } => vars.last().map(|v| v.0),
            _ => None,
        })
        .collect();
    k.pool.nodes.iter().any(|n| {
        let E::Load { index, .. } = n else {
            return false;
        };
        k.pool.affine(*index).is_some_and(|af| {
            inner.iter().any(|&v| af.coef(v) == 1) && point.is_none_or(|p| af.coef(p) != 1)
        })
    })
}

/// Elements per vector access of the vectorized pointwise path (16 bytes of f32 or i32,
/// 8 bytes of f16/bf16).
const VEC: usize = 4;
/// Vectors per thread of the vectorized pointwise path when there are many: their loads
/// are all issued before any math, so more bytes are in flight per thread.
const VEC_UNITS: usize = 2;

/// The vectorized form of a pointwise kernel: which loads become vector loads, how many
/// vectors each thread handles and how many threads there are.
struct VecPlan {
    /// The live loads that vary along the innermost axis, in pool order (less those read only
    /// through a load tree).
    loads: Vec<ExprId>,
    /// Roots of select trees over such loads whose conditions do not vary along the innermost
    /// axis (a concat along an outer axis): each is one vector load from the chosen address.
    trees: Vec<(ExprId, DType)>,
    units: usize,
    threads: u32,
}

/// Decides whether a kernel whose axes are all spread over threads can move `VEC`
/// consecutive points of its innermost axis per vector: every store, and every load that
/// varies along that axis, must have an affine index with coefficient 1 on it whose other
/// part is a multiple of `VEC`, a dtype with a vector form (not bool) and a buffer at an
/// arena offset aligned to the vector's bytes; the innermost extent must be a multiple of
/// `VEC`; no reductions, no accumulating stores. Loads that do not vary along the innermost
/// axis (broadcasts) stay scalar and are loaded once per vector.
fn vector_plan(
    k: &Kernel,
    site: &[Option<Var>],
    live: &[ExprId],
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
) -> Option<VecPlan> {
    let rank = k.domain.len();
    let last = rank.checked_sub(1)? as Var;
    let inner = *k.domain.last()?;
    if inner < VEC || inner % VEC != 0 || k.stores.is_empty() || k.matmul.is_some() {
        return None;
    }
    let aligned = |buf: NodeId, dtype: DType, index: ExprId| {
        vector_access(k, offset_of, buf, dtype, index, last)
    };
    for s in &k.stores {
        if s.accumulate || !aligned(s.buf, s.dtype, s.index) {
            return None;
        }
    }
    let mut loads = Vec::new();
    // Loads aligned only once their clamps are dropped: a piece of a concat along the
    // innermost axis, admitted as the arm of a load tree whose conditions pick it for
    // whole vectors (then lane 0 is in the piece's range, and so are the other lanes).
    // A concat is what gives a select's arm a clamped index: its conditions pick a piece
    // exactly where that piece's clamps do nothing.
    let mut clamped = Vec::new();
    for &e in live {
        match k.pool.get(e) {
            E::Reduce { .. } | E::ArgMax { .. } | E::Acc => return None,
            E::Load { buf, dtype, index } if site[e.0 as usize] == Some(last) => {
                if !aligned(*buf, *dtype, *index) {
                    let af = unclamped_affine(&k.pool, *index)?;
                    if !vector_affine(k, offset_of, *buf, *dtype, &af, last) {
                        return None;
                    }
                    clamped.push(e);
                }
                loads.push(e);
            }
            _ => {}
        }
    }
    let (loads, trees) = vector_load_trees(k, site, live, loads, last);
    if loads.iter().any(|e| clamped.contains(e)) {
        return None;
    }
    let points: u64 = k.domain.iter().map(|&d| d as u64).product();
    let vectors = points / VEC as u64;
    if vectors == 0 || vectors > i32::MAX as u64 {
        return None;
    }
    let units = if vectors.is_multiple_of(VEC_UNITS as u64) && vectors >= 1 << 18 {
        VEC_UNITS
    } else {
        1
    };
    Some(VecPlan {
        loads,
        trees,
        units,
        threads: (vectors / units as u64) as u32,
    })
}

/// Select trees over loads (`select(c, load, select(c2, load, load))`, as a concat reads its
/// pieces): each select whose arms are both `leaf_ok` loads or such selects, with one element
/// type, and whose condition is `cond_ok`, with that type.
fn select_trees(
    k: &Kernel,
    live: &[ExprId],
    leaf_ok: &dyn Fn(ExprId) -> bool,
    cond_ok: &dyn Fn(ExprId) -> bool,
) -> HashMap<ExprId, DType> {
    let mut order = live.to_vec();
    order.sort();
    let mut tree: HashMap<ExprId, DType> = HashMap::new();
    for &e in &order {
        let E::Select(c, a, b) = *k.pool.get(e) else {
            continue;
        };
        let leaf = |x: ExprId| match *k.pool.get(x) {
            E::Load { dtype, .. } if leaf_ok(x) => Some(dtype),
            _ => tree.get(&x).copied(),
        };
        if let (Some(da), Some(db)) = (leaf(a), leaf(b)) {
            if da == db && cond_ok(c) {
                tree.insert(e, da);
            }
        }
    }
    tree
}

/// For the load trees `tree`: the nodes read other than as a tree select's arm (a store
/// reads its value and index), and each node's tree selects that read it as an arm.
fn tree_readers(
    k: &Kernel,
    live: &[ExprId],
    tree: &HashMap<ExprId, DType>,
) -> (HashSet<ExprId>, HashMap<ExprId, Vec<ExprId>>) {
    let mut outside = HashSet::new();
    let mut readers: HashMap<ExprId, Vec<ExprId>> = HashMap::new();
    for &e in live {
        let node = k.pool.get(e);
        for x in crate::kernel::lower::children(node) {
            match node {
                E::Select(c, ..) if tree.contains_key(&e) && *c != x => {
                    readers.entry(x).or_default().push(e)
                }
                _ => {
                    outside.insert(x);
                }
            }
        }
    }
    for s in &k.stores {
        outside.insert(s.value);
        outside.insert(s.index);
    }
    (outside, readers)
}

/// Whether an access of `buf[index]` can move `VEC` consecutive elements along variable
/// `along` at once: a dtype with a vector form, a buffer at an arena offset aligned to the
/// vector's bytes, and an affine index with coefficient 1 on `along` whose other part (over
/// domain variables) is a multiple of `VEC`.
fn vector_access(
    k: &Kernel,
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    buf: NodeId,
    dtype: DType,
    index: ExprId,
    along: Var,
) -> bool {
    k.pool
        .affine(index)
        .is_some_and(|af| vector_affine(k, offset_of, buf, dtype, &af, along))
}

/// [`vector_access`] for the affine index `af`.
fn vector_affine(
    k: &Kernel,
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    buf: NodeId,
    dtype: DType,
    af: &Affine,
    along: Var,
) -> bool {
    matches!(dtype, DType::F32 | DType::I32 | DType::F16 | DType::BF16)
        && offset_of(buf).is_some_and(|off| off % (VEC * dtype.size_bytes()) as u64 == 0)
        && whole_vectors(k, af, along)
}

/// Whether `af` moves by 1 along `along` and is a multiple of `VEC` where `along` is: a
/// vector of `VEC` consecutive points from a multiple of `VEC` has consecutive values from
/// a multiple of `VEC`.
fn whole_vectors(k: &Kernel, af: &Affine, along: Var) -> bool {
    let v = VEC as i64;
    af.coef(along) == 1
        && af.c0 % v == 0
        && af
            .terms
            .iter()
            .all(|&(x, c)| x == along || ((x as usize) < k.domain.len() && c % v == 0))
}

/// The affine form of an index with its clamps dropped, where each clamp's bounds are
/// whole vectors (`max(x, lo)` with `lo` a multiple of `VEC`, `min(x, hi)` with `hi + 1`
/// one): a vector of consecutive `x` from a multiple of `VEC` lies wholly inside them or
/// wholly outside.
fn unclamped_affine(pool: &ExprPool, e: ExprId) -> Option<Affine> {
    let v = VEC as i64;
    let int = |x: ExprId| match *pool.get(x) {
        E::Int(c) => Some(c),
        _ => None,
    };
    pool.affine_by(e, &|x| match *pool.get(x) {
        E::IMax(y, lo) if int(lo)? % v == 0 => unclamped_affine(pool, y),
        E::IMin(y, hi) if (int(hi)? + 1) % v == 0 => unclamped_affine(pool, y),
        _ => None,
    })
}

/// Whether condition `c` has one value for the `VEC` lanes of a vector along `last`: it does
/// not vary along `last`, or it compares `x` (affine, coefficient 1 on `last`, the rest
/// whole vectors) with a constant that starts a vector (`x < C`, `x >= C`, `C` a multiple of
/// `VEC`), as a concat along the innermost axis picks its pieces.
fn uniform_condition(k: &Kernel, site: &[Option<Var>], c: ExprId, last: Var) -> bool {
    if site[c.0 as usize] != Some(last) {
        return true;
    }
    let v = VEC as i64;
    let E::Bin(op, x, y) = *k.pool.get(c) else {
        return false;
    };
    let bound = match (op, k.pool.get(y)) {
        (BinaryOp::Lt | BinaryOp::Ge, E::Int(b)) => *b,
        (BinaryOp::Le | BinaryOp::Gt, E::Int(b)) => b.saturating_add(1),
        _ => return false,
    };
    bound % v == 0
        && k.pool
            .affine(x)
            .is_some_and(|af| whole_vectors(k, &af, last))
}

/// Splits the vector loads of [`vector_plan`] into plain ones and the roots of load trees
/// whose conditions are the same for the `VEC` lanes (they do not vary along the innermost
/// axis). A load read only by tree selects is not made on its own (a concat of 12 pieces
/// read 12 vectors for each one it wrote).
fn vector_load_trees(
    k: &Kernel,
    site: &[Option<Var>],
    live: &[ExprId],
    loads: Vec<ExprId>,
    last: Var,
) -> (Vec<ExprId>, Vec<(ExprId, DType)>) {
    let tree = select_trees(k, live, &|x| loads.contains(&x), &|c| {
        uniform_condition(k, site, c, last)
    });
    if tree.is_empty() {
        return (loads, Vec::new());
    }
    let (outside, _) = tree_readers(k, live, &tree);
    let plain = loads.into_iter().filter(|x| outside.contains(x)).collect();
    let mut roots: Vec<(ExprId, DType)> = tree
        .into_iter()
        .filter(|(e, _)| outside.contains(e))
        .collect();
    roots.sort();
    (plain, roots)
}

/// One vector of the vectorized pointwise path, between its loads and its math.
struct VecUnit {
    /// Registers of the domain variables (the innermost one at lane 0).
    vars: Vec<String>,
    /// Nodes computed for this vector that do not vary along the innermost axis.
    hoisted: Vec<(ExprId, String)>,
    /// Each vector load's lane registers (f32 or i32 compute registers).
    loads: Vec<(ExprId, Vec<String>)>,
    /// Byte address of each store at lane 0.
    stores: Vec<String>,
}

impl Px<'_> {
    /// Pops the innermost cache scope: its nodes leave the cache and are returned.
    fn pop_scope(&mut self) -> Vec<(ExprId, String)> {
        let keys = self.journal.pop().unwrap_or_default();
        keys.into_iter()
            .filter_map(|key| self.cache.remove(&key).map(|r| (key, r)))
            .collect()
    }

    /// `VEC` consecutive elements at `addr`, converted to their compute type.
    fn vector_load(&mut self, addr: &str, dtype: DType) -> Vec<String> {
        match dtype {
            DType::F16 | DType::BF16 => {
                let hs: Vec<String> = (0..VEC).map(|_| self.fresh("h")).collect();
                self.line(format!("ld.global.v4.b16 {{{}}}, [{addr}];", hs.join(", ")));
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                hs.iter()
                    .map(|h| {
                        let r = self.fresh("f");
                        self.line(format!("cvt.f32.{t} {r}, {h};"));
                        r
                    })
                    .collect()
            }
            _ => {
                let (p, t) = if dtype == DType::I32 {
                    ("r", "b32")
                } else {
                    ("f", "f32")
                };
                let rs: Vec<String> = (0..VEC).map(|_| self.fresh(p)).collect();
                self.line(format!("ld.global.v4.{t} {{{}}}, [{addr}];", rs.join(", ")));
                rs
            }
        }
    }

    /// Stores `VEC` compute values to consecutive elements at `addr`.
    fn vector_store(&mut self, addr: &str, dtype: DType, vals: &[String]) {
        match dtype {
            DType::F16 | DType::BF16 => {
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                let hs: Vec<String> = vals
                    .iter()
                    .map(|v| {
                        let h = self.fresh("h");
                        self.line(format!("cvt.rn.{t}.f32 {h}, {v};"));
                        h
                    })
                    .collect();
                self.line(format!("st.global.v4.b16 [{addr}], {{{}}};", hs.join(", ")));
            }
            _ => {
                let t = if dtype == DType::I32 { "b32" } else { "f32" };
                self.line(format!(
                    "st.global.v4.{t} [{addr}], {{{}}};",
                    vals.join(", ")
                ));
            }
        }
    }
}

/// The vectorized pointwise kernel (see [`vector_plan`]): thread `t` handles vectors
/// `t + u * threads` for `u < units`, so that a warp's accesses stay contiguous. Each vector
/// is decoded into the domain variables, its vector loads are issued (all units' loads before
/// any math), then every lane computes the stored values exactly as the scalar path does, one
/// point at a time, and each store writes one vector.
fn emit_vector_pointwise(
    k: &Kernel,
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    site: Vec<Option<Var>>,
    live: Vec<ExprId>,
    plan: &VecPlan,
) -> Res<(String, LaunchShape)> {
    let rank = k.domain.len();
    let last = rank - 1;
    let mut px = Px::new(k, offset_of, site, live);
    px.load_arena();
    let (a, b, c) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {a}, %ctaid.x;"));
    px.line(format!("mov.u32 {b}, %ntid.x;"));
    px.line(format!("mov.u32 {c}, %tid.x;"));
    px.tid = c.clone();
    let tid = px.fresh("r");
    px.line(format!("mad.lo.u32 {tid}, {a}, {b}, {c};"));
    let done = px.label("done");
    let pd = px.fresh("p");
    px.line(format!("setp.ge.u32 {pd}, {tid}, {};", plan.threads));
    px.line(format!("@{pd} bra {done};"));
    px.emit_site(None)?;
    let mut units = Vec::new();
    for u in 0..plan.units {
        let q = px.fresh("r");
        px.line(format!(
            "add.u32 {q}, {tid}, {};",
            u as u64 * plan.threads as u64
        ));
        px.journal.push(Vec::new());
        // Vector index → domain variables (the innermost counts vectors).
        let exts: Vec<usize> = (0..rank)
            .map(|d| {
                if d == last {
                    k.domain[d] / VEC
                } else {
                    k.domain[d]
                }
            })
            .collect();
        let mut vars = vec![String::new(); rank];
        px.digits(&q, &exts, false, |px, d, v32| {
            let v = px.fresh("rd");
            if d == last {
                px.line(format!("mul.wide.u32 {v}, {v32}, {VEC};"));
            } else {
                px.line(format!("cvt.u64.u32 {v}, {v32};"));
            }
            px.vars.insert(d as Var, v.clone());
            vars[d] = v;
        });
        for d in 0..last {
            px.emit_site(Some(d as Var))?;
        }
        // Addresses at lane 0 and the vector loads.
        px.journal.push(Vec::new());
        let mut loads = Vec::new();
        for &e in &plan.loads {
            if let E::Load { buf, dtype, index } = *k.pool.get(e) {
                let i = px.emit(index)?;
                let addr = px.address(buf, dtype, &i)?;
                loads.push((e, px.vector_load(&addr, dtype)));
            }
        }
        for &(e, dtype) in &plan.trees {
            let addr = px.tree_address(e)?;
            loads.push((e, px.vector_load(&addr, dtype)));
        }
        let mut stores = Vec::new();
        for s in &k.stores {
            let i = px.emit(s.index)?;
            stores.push(px.address(s.buf, s.dtype, &i)?);
        }
        px.pop_scope();
        let hoisted = px.pop_scope();
        units.push(VecUnit {
            vars,
            hoisted,
            loads,
            stores,
        });
    }
    for unit in units {
        for (e, r) in &unit.hoisted {
            px.cache.insert(*e, r.clone());
        }
        for (d, v) in unit.vars.iter().enumerate() {
            px.vars.insert(d as Var, v.clone());
        }
        let mut vals: Vec<Vec<String>> = vec![Vec::new(); k.stores.len()];
        for l in 0..VEC {
            let lane = if l == 0 {
                unit.vars[last].clone()
            } else {
                let r = px.fresh("rd");
                px.line(format!("add.s64 {r}, {}, {l};", unit.vars[last]));
                r
            };
            px.vars.insert(last as Var, lane);
            px.journal.push(Vec::new());
            for (e, regs) in &unit.loads {
                px.remember(*e, regs[l].clone());
            }
            for (si, s) in k.stores.iter().enumerate() {
                let v = px.emit(s.value)?;
                vals[si].push(v);
            }
            px.pop_scope();
        }
        for ((s, addr), v) in k.stores.iter().zip(&unit.stores).zip(&vals) {
            px.vector_store(addr, s.dtype, v);
        }
        for (e, _) in &unit.hoisted {
            px.cache.remove(e);
        }
    }
    px.body.push_str(&format!("{done}:\n\tret;\n"));
    let text = px.finish("");
    let grid = plan.threads.div_ceil(BLOCK);
    Ok((
        text,
        LaunchShape {
            grid: [grid.max(1), 1, 1],
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}

/// Precision of the tensor-core matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MmaKind {
    F16,
    Bf16,
    /// f32 operands rounded to TF32 (`--allow-tf32` only).
    Tf32,
}

/// Tensor-core matmul: rows and columns of the block tile (8 warps, each 64×32).
const MMA_BM: usize = 128;
const MMA_BN: usize = 128;
/// Bytes of one row of the A tile in shared memory (`k` staged 32 halves or 16 floats
/// deep, plus 16 bytes of padding so that `ldmatrix`'s eight 16-byte rows fall in distinct
/// banks).
const MMA_A_ROW: usize = 80;
/// Bytes of the A tile of one stage.
const MMA_A_BYTES: usize = MMA_BM * MMA_A_ROW;

impl MmaKind {
    fn of(mm: &Matmul, opts: PtxOptions) -> Option<MmaKind> {
        if !mm.is_plain() {
            return None;
        }
        match (mm.a.dtype, mm.b.dtype) {
            (DType::F16, DType::F16) => Some(MmaKind::F16),
            (DType::BF16, DType::BF16) => Some(MmaKind::Bf16),
            (DType::F32, DType::F32) if opts.allow_tf32 => Some(MmaKind::Tf32),
            _ => None,
        }
    }

    fn elem_bytes(self) -> usize {
        if self == MmaKind::Tf32 {
            4
        } else {
            2
        }
    }

    /// Elements of `k` per stage.
    fn bk(self) -> usize {
        64 / self.elem_bytes()
    }

    /// Elements per 16-byte chunk.
    fn chunk(self) -> usize {
        16 / self.elem_bytes()
    }

    /// Bytes of one row (one `k`) of the B tile in shared memory, padded so that the
    /// fragment reads hit distinct banks: 16 bytes for `ldmatrix` (eight 16-byte rows),
    /// 32 for TF32's 32-bit loads (rows `tg = 0..4` eight banks apart, columns `g = 0..8`).
    fn b_row(self) -> usize {
        MMA_BN * self.elem_bytes() + if self == MmaKind::Tf32 { 32 } else { 16 }
    }

    fn stage_bytes(self) -> usize {
        MMA_A_BYTES + self.bk() * self.b_row()
    }

    fn instr(self) -> &'static str {
        match self {
            MmaKind::F16 => "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            MmaKind::Bf16 => "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            MmaKind::Tf32 => "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        }
    }
}

/// The grid of the tensor-core matmul, or `None` where it does not apply.
fn mma_grid(mm: &Matmul, opts: PtxOptions) -> Option<(MmaKind, [u32; 3])> {
    let kind = MmaKind::of(mm, opts)?;
    if mm.m < 16 || mm.n < 16 || mm.m * mm.n < 4096 || mm.k == 0 {
        return None;
    }
    let batch: usize = mm.batch.iter().product();
    let (gx, gy) = (mm.n.div_ceil(MMA_BN), mm.m.div_ceil(MMA_BM));
    if batch == 0 || batch > 65535 || gy > 65535 || gx > i32::MAX as usize {
        return None;
    }
    Some((kind, [gx as u32, gy as u32, batch as u32]))
}

/// Tensor-core matmul (`mma.sync`, f32 accumulation) with the fused epilogue: 128×128 block
/// tiles of 256 threads (8 warps of 64×32, each 4×4 `mma` tiles of 16×8), `k` staged 64
/// bytes deep through two shared-memory buffers, the next stage's copies
/// (`cp.async` 16-byte chunks where the operand is contiguous and aligned, else element
/// loads) overlapping the current stage's math. A fragments come from `ldmatrix`; B
/// fragments from `ldmatrix.trans` (f16/bf16) or 32-bit shared loads (TF32, rounded with
/// `cvt.rna.tf32.f32`, as are the A fragments). Out-of-range chunks read zeros; every
/// thread runs every barrier and only out-of-range elements skip their epilogue.
fn emit_mma_matmul(
    k: &Kernel,
    mm: &Matmul,
    kind: MmaKind,
    grid: [u32; 3],
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offset_of, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let eb = kind.elem_bytes();
    let (bk, ch, b_row) = (kind.bk(), kind.chunk(), kind.b_row());
    let stage = kind.stage_bytes();

    let WarpTile {
        t,
        lane,
        warp,
        g,
        tg,
        origin:
            TileOrigin {
                abase,
                bbase,
                abuf,
                aoff,
                bbuf,
                boff,
                row0,
                col0,
            },
    } = warp_tile(&mut px, mm, MMA_BM, MMA_BN)?;
    let (wm, wn) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {wm}, {warp}, 1;"));
    px.line(format!("shr.u32 {wn}, {warp}, 1;"));
    let sbase = px.fresh("r");
    px.line(format!("mov.u32 {sbase}, mm_s;"));

    // Whole 16-byte chunks (`cp.async`) where the operand is contiguous along the chunk and
    // every chunk starts aligned; otherwise element by element.
    let c = ch as i64;
    let aligned = |o: &crate::kernel::Operand, off: u64| {
        o.base % c == 0 && o.batch_strides.iter().all(|s| s % c == 0) && off.is_multiple_of(16)
    };
    let a_fast = mm.a.cs == 1 && kd % ch == 0 && mm.a.rs % c == 0 && aligned(&mm.a, aoff);
    let b_fast = mm.b.cs == 1 && n % ch == 0 && mm.b.rs % c == 0 && aligned(&mm.b, boff);

    // Each thread moves chunks `t` and `t + 256` of each tile. A: 4 chunks a row of 128
    // rows; B: `bk` rows of `MMA_BN / ch` chunks.
    let mut a_slots = Vec::new();
    let mut b_slots = Vec::new();
    for i in 0..2u32 {
        let cidx = px.fresh("r");
        px.line(format!("add.u32 {cidx}, {t}, {};", 256 * i));
        // A.
        let (row, kc) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("shr.u32 {row}, {cidx}, 2;"));
        px.line(format!("and.b32 {kc}, {cidx}, 3;"));
        let g_row = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {g_row}, {row};"));
        px.line(format!("add.s64 {g_row}, {g_row}, {row0};"));
        let ok = px.fresh("p");
        px.line(format!("setp.lt.s64 {ok}, {g_row}, {m};"));
        let base = px.fresh("rd");
        px.line(format!("mad.lo.s64 {base}, {g_row}, {}, {abase};", mm.a.rs));
        a_slots.push((row, kc, base, ok));
        // B.
        let cpr = (MMA_BN / ch) as u32;
        let (krow, nc) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("div.u32 {krow}, {cidx}, {cpr};"));
        px.line(format!("rem.u32 {nc}, {cidx}, {cpr};"));
        let g_col = px.fresh("rd");
        px.line(format!("mul.wide.u32 {g_col}, {nc}, {ch};"));
        px.line(format!("add.s64 {g_col}, {g_col}, {col0};"));
        let ok = px.fresh("p");
        px.line(format!("setp.lt.s64 {ok}, {g_col}, {n};"));
        let base = px.fresh("rd");
        px.line(format!("mad.lo.s64 {base}, {g_col}, {}, {bbase};", mm.b.cs));
        b_slots.push((krow, nc, base, ok, g_col));
    }
    // Shared offsets and the k offset of each slot (registers, since they depend on %tid).
    let mut a_sm = Vec::new();
    for (row, kc, base, ok) in &a_slots {
        let so = px.fresh("r");
        px.line(format!("mul.lo.u32 {so}, {row}, {MMA_A_ROW};"));
        px.line(format!("mad.lo.u32 {so}, {kc}, 16, {so};"));
        let kk = px.fresh("rd");
        px.line(format!("mul.wide.u32 {kk}, {kc}, {ch};"));
        let b2 = px.fresh("rd");
        px.line(format!("mad.lo.s64 {b2}, {kk}, {}, {base};", mm.a.cs));
        a_sm.push((so, kk, b2, ok.clone()));
    }
    let mut b_sm = Vec::new();
    for (krow, nc, base, ok, g_col) in &b_slots {
        let so = px.fresh("r");
        px.line(format!("mul.lo.u32 {so}, {krow}, {b_row};"));
        px.line(format!("mad.lo.u32 {so}, {nc}, 16, {so};"));
        px.line(format!("add.u32 {so}, {so}, {MMA_A_BYTES};"));
        let kk = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {kk}, {krow};"));
        let b2 = px.fresh("rd");
        px.line(format!("mad.lo.s64 {b2}, {kk}, {}, {base};", mm.b.rs));
        b_sm.push((so, kk, b2, ok.clone(), g_col.clone()));
    }

    // Moves the stage of `k0` (i64 register) into the buffer at shared byte `st` (u32).
    let load_stage = |px: &mut Px, st: &str, k0: &str| {
        let ld = if eb == 2 { "b16" } else { "b32" };
        let cls = if eb == 2 { "h" } else { "r" };
        // A: chunk at row, k = k0 + kk .. + ch.
        for (so, kk, base, ok) in &a_sm {
            let dst = px.fresh("r");
            px.line(format!("add.u32 {dst}, {st}, {so};"));
            let kg = px.fresh("rd");
            px.line(format!("add.s64 {kg}, {k0}, {kk};"));
            let idx = px.fresh("rd");
            px.line(format!("mad.lo.s64 {idx}, {k0}, {}, {base};", mm.a.cs));
            if a_fast {
                let p = px.fresh("p");
                px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {ok};"));
                chunk_copy(px, &dst, &abuf, &idx, &p, eb);
            } else {
                for e in 0..ch {
                    let p = px.fresh("p");
                    let ke = px.fresh("rd");
                    px.line(format!("add.s64 {ke}, {kg}, {e};"));
                    px.line(format!("setp.lt.and.s64 {p}, {ke}, {kd}, {ok};"));
                    let ie = px.fresh("rd");
                    px.line(format!("mad.lo.s64 {ie}, {e}, {}, {idx};", mm.a.cs));
                    let addr = px.fresh("rd");
                    px.line(format!("mad.lo.s64 {addr}, {ie}, {eb}, {abuf};"));
                    let v = px.fresh(cls);
                    px.line(format!("mov.{ld} {v}, 0;"));
                    px.line(format!("@{p} ld.global.{ld} {v}, [{addr}];"));
                    px.line(format!("st.shared.{ld} [{dst}+{}], {v};", e * eb));
                }
            }
        }
        // B: chunk at k = k0 + kk, columns col .. + ch.
        for (so, kk, base, ok, g_col) in &b_sm {
            let dst = px.fresh("r");
            px.line(format!("add.u32 {dst}, {st}, {so};"));
            let kg = px.fresh("rd");
            px.line(format!("add.s64 {kg}, {k0}, {kk};"));
            let idx = px.fresh("rd");
            px.line(format!("mad.lo.s64 {idx}, {k0}, {}, {base};", mm.b.rs));
            let pk = px.fresh("p");
            px.line(format!("setp.lt.s64 {pk}, {kg}, {kd};"));
            if b_fast {
                let p = px.fresh("p");
                px.line(format!("and.pred {p}, {pk}, {ok};"));
                chunk_copy(px, &dst, &bbuf, &idx, &p, eb);
            } else {
                for e in 0..ch {
                    let p = px.fresh("p");
                    let ce = px.fresh("rd");
                    px.line(format!("add.s64 {ce}, {g_col}, {e};"));
                    px.line(format!("setp.lt.and.s64 {p}, {ce}, {n}, {pk};"));
                    let ie = px.fresh("rd");
                    px.line(format!("mad.lo.s64 {ie}, {e}, {}, {idx};", mm.b.cs));
                    let addr = px.fresh("rd");
                    px.line(format!("mad.lo.s64 {addr}, {ie}, {eb}, {bbuf};"));
                    let v = px.fresh(cls);
                    px.line(format!("mov.{ld} {v}, 0;"));
                    px.line(format!("@{p} ld.global.{ld} {v}, [{addr}];"));
                    px.line(format!("st.shared.{ld} [{dst}+{}], {v};", e * eb));
                }
            }
        }
        px.line("cp.async.commit_group;");
    };

    // Fragment addresses (relative to the stage). A (`ldmatrix.x4`): lane l reads row
    // `l % 16` of the warp's 16-row tile at k offset `(l / 16) * 16` bytes.
    let a_ld = px.fresh("r");
    let tmp = px.fresh("r");
    px.line(format!("and.b32 {tmp}, {lane}, 15;"));
    px.line(format!("mad.lo.u32 {tmp}, {wm}, 64, {tmp};"));
    px.line(format!("mul.lo.u32 {a_ld}, {tmp}, {MMA_A_ROW};"));
    let hi = px.fresh("r");
    px.line(format!("shr.u32 {hi}, {lane}, 4;"));
    px.line(format!("mad.lo.u32 {a_ld}, {hi}, 16, {a_ld};"));
    px.line(format!("add.u32 {a_ld}, {a_ld}, {sbase};"));
    let b_ld = px.fresh("r");
    if kind == MmaKind::Tf32 {
        // B (32-bit loads): b0 at (k = tg, n = g), b1 at k + 4.
        let col = px.fresh("r");
        px.line(format!("mad.lo.u32 {col}, {wn}, 32, {g};"));
        px.line(format!("mul.lo.u32 {b_ld}, {tg}, {b_row};"));
        px.line(format!("mad.lo.u32 {b_ld}, {col}, 4, {b_ld};"));
    } else {
        // B (`ldmatrix.x4.trans`): lane l reads k row `l % 16` at column
        // `wn*32 + (l / 16) * 8` (two 8-column tiles).
        let col = px.fresh("r");
        px.line(format!("mad.lo.u32 {col}, {wn}, 32, 0;"));
        px.line(format!("mad.lo.u32 {col}, {hi}, 8, {col};"));
        px.line(format!("and.b32 {tmp}, {lane}, 15;"));
        px.line(format!("mul.lo.u32 {b_ld}, {tmp}, {b_row};"));
        px.line(format!("mad.lo.u32 {b_ld}, {col}, 2, {b_ld};"));
    }
    px.line(format!("add.u32 {b_ld}, {b_ld}, {};", MMA_A_BYTES));
    px.line(format!("add.u32 {b_ld}, {b_ld}, {sbase};"));

    // Accumulators acc[mi][nj][r].
    let accs: Vec<String> = (0..64).map(|_| px.fresh("f")).collect();
    for a in &accs {
        px.line(format!("mov.f32 {a}, {};", f32_lit(0.0)));
    }
    let af: Vec<String> = (0..16).map(|_| px.fresh("r")).collect();
    let bf: Vec<String> = (0..8).map(|_| px.fresh("r")).collect();

    let nk = kd.div_ceil(bk);
    let zero = px.fresh("rd");
    px.line(format!("mov.s64 {zero}, 0;"));
    load_stage(&mut px, &sbase, &zero);
    let kt = px.fresh("r");
    px.line(format!("mov.u32 {kt}, 0;"));
    let head = px.label("mma_k");
    let wait0 = px.label("mma_wait0");
    let synced = px.label("mma_sync");
    px.body.push_str(&format!("{head}:\n"));
    let ktn = px.fresh("r");
    px.line(format!("add.u32 {ktn}, {kt}, 1;"));
    let pn = px.fresh("p");
    px.line(format!("setp.ge.u32 {pn}, {ktn}, {nk};"));
    px.line(format!("@{pn} bra.uni {wait0};"));
    {
        let st = px.fresh("r");
        px.line(format!("and.b32 {st}, {ktn}, 1;"));
        px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {sbase};"));
        let k0 = px.fresh("rd");
        px.line(format!("mul.wide.u32 {k0}, {ktn}, {bk};"));
        load_stage(&mut px, &st, &k0);
        px.line("cp.async.wait_group 1;");
        px.line(format!("bra.uni {synced};"));
    }
    px.body.push_str(&format!("{wait0}:\n"));
    px.line("cp.async.wait_group 0;");
    px.body.push_str(&format!("{synced}:\n"));
    px.line("bar.sync 0;");
    let cur = px.fresh("r");
    px.line(format!("and.b32 {cur}, {kt}, 1;"));
    px.line(format!("mul.lo.u32 {cur}, {cur}, {stage};"));
    let (ac, bc) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("add.u32 {ac}, {a_ld}, {cur};"));
    px.line(format!("add.u32 {bc}, {b_ld}, {cur};"));
    let mk = if kind == MmaKind::Tf32 { 8 } else { 16 };
    for ks in 0..bk / mk {
        let kbytes = ks * mk * eb;
        for mi in 0..4 {
            let r = &af[mi * 4..mi * 4 + 4];
            px.line(format!(
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{}}}, [{ac}+{}];",
                r.join(", "),
                mi * 16 * MMA_A_ROW + kbytes
            ));
            if kind == MmaKind::Tf32 {
                for x in r {
                    px.line(format!("cvt.rna.tf32.f32 {x}, {x};"));
                }
            }
        }
        if kind == MmaKind::Tf32 {
            for nj in 0..4 {
                for h in 0..2 {
                    let x = &bf[nj * 2 + h];
                    let off = (ks * 8 + 4 * h) * b_row + nj * 8 * 4;
                    px.line(format!("ld.shared.b32 {x}, [{bc}+{off}];"));
                    px.line(format!("cvt.rna.tf32.f32 {x}, {x};"));
                }
            }
        } else {
            for p in 0..2 {
                px.line(format!(
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{}}}, [{bc}+{}];",
                    bf[p * 4..p * 4 + 4].join(", "),
                    ks * 16 * b_row + p * 16 * 2
                ));
            }
        }
        for mi in 0..4 {
            for nj in 0..4 {
                let d = accs[(mi * 4 + nj) * 4..(mi * 4 + nj) * 4 + 4].join(", ");
                px.line(format!(
                    "{} {{{d}}}, {{{}}}, {{{}, {}}}, {{{d}}};",
                    kind.instr(),
                    af[mi * 4..mi * 4 + 4].join(", "),
                    bf[nj * 2],
                    bf[nj * 2 + 1]
                ));
            }
        }
    }
    px.line("bar.sync 0;");
    px.line(format!("mov.u32 {kt}, {ktn};"));
    let more = px.fresh("p");
    px.line(format!("setp.lt.u32 {more}, {kt}, {nk};"));
    px.line(format!("@{more} bra.uni {head};"));

    // Epilogue: acc[mi][nj][2h + c] is row wm*64 + mi*16 + g + 8h, column
    // wn*32 + nj*8 + 2tg + c of the block tile.
    let (rb, cb) = (px.fresh("rd"), px.fresh("rd"));
    let t32 = px.fresh("r");
    px.line(format!("mad.lo.u32 {t32}, {wm}, 64, {g};"));
    px.line(format!("cvt.u64.u32 {rb}, {t32};"));
    px.line(format!("add.s64 {rb}, {rb}, {row0};"));
    px.line(format!("mad.lo.u32 {t32}, {wn}, 32, 0;"));
    px.line(format!("mad.lo.u32 {t32}, {tg}, 2, {t32};"));
    px.line(format!("cvt.u64.u32 {cb}, {t32};"));
    px.line(format!("add.s64 {cb}, {cb}, {col0};"));
    let rows = epilogue_coords(&mut px, &rb, m, 8, &|ri| (ri / 2) * 16 + (ri % 2) * 8);
    let cols = epilogue_coords(&mut px, &cb, n, 8, &|ci| (ci / 2) * 8 + ci % 2);
    epilogue(
        &mut px,
        mm,
        &rows,
        &cols,
        &|ri, ci| {
            let (mi, h, nj, c) = (ri / 2, ri % 2, ci / 2, ci % 2);
            accs[(mi * 4 + nj) * 4 + h * 2 + c].clone()
        },
        false,
        0,
    )?;
    px.line("ret;");
    let shared = format!("\t.shared .align 128 .b8 mm_s[{}];\n", 2 * stage);
    Ok((
        px.finish(&shared),
        LaunchShape {
            grid,
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}

/// What every register-tiled matmul starts from: the operands' element bases for this
/// block's batch, their buffers' byte addresses and arena offsets (none for a gathered
/// operand, whose loads are in its expression), and the first row and column of the
/// `bm`×`bn` block tile (block `(bx, by)`, batch `bz`).
struct TileOrigin {
    abase: String,
    bbase: String,
    abuf: String,
    aoff: u64,
    bbuf: String,
    boff: u64,
    row0: String,
    col0: String,
}

fn tile_origin(
    px: &mut Px,
    mm: &Matmul,
    bx: &str,
    by: &str,
    bz: &str,
    bm: usize,
    bn: usize,
) -> Res<TileOrigin> {
    let (abase, bbase) = batch_bases(px, mm, bz);
    let (abuf, aoff) = match mm.a.gather {
        None => operand_buffer(px, mm.a.buf)?,
        Some(_) => (String::new(), 0),
    };
    let (bbuf, boff) = match mm.b.gather {
        None => operand_buffer(px, mm.b.buf)?,
        Some(_) => (String::new(), 0),
    };
    let (row0, col0) = (px.fresh("rd"), px.fresh("rd"));
    px.line(format!("mul.wide.u32 {row0}, {by}, {bm};"));
    px.line(format!("mul.wide.u32 {col0}, {bx}, {bn};"));
    Ok(TileOrigin {
        abase,
        bbase,
        abuf,
        aoff,
        bbuf,
        boff,
        row0,
        col0,
    })
}

/// What both tensor-core matmuls start from: the thread's lane and warp, the lane's
/// fragment row `g = lane / 4` and column pair `tg = lane % 4`, and the tile's origin.
struct WarpTile {
    t: String,
    lane: String,
    warp: String,
    g: String,
    tg: String,
    origin: TileOrigin,
}

fn warp_tile(px: &mut Px, mm: &Matmul, bm: usize, bn: usize) -> Res<WarpTile> {
    let (bx, by, bz, t) = block_prologue(px);
    let (lane, warp, g, tg) = (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {lane}, {t}, 31;"));
    px.line(format!("shr.u32 {warp}, {t}, 5;"));
    px.line(format!("shr.u32 {g}, {lane}, 2;"));
    px.line(format!("and.b32 {tg}, {lane}, 3;"));
    let origin = tile_origin(px, mm, &bx, &by, &bz, bm, bn)?;
    Ok(WarpTile {
        t,
        lane,
        warp,
        g,
        tg,
        origin,
    })
}

/// One 16-byte `cp.async` from element `idx` of the buffer at `buf` to shared byte `dst`,
/// or 16 zero bytes when `p` is false (the source address then stays at `buf`).
fn chunk_copy(px: &mut Px, dst: &str, buf: &str, idx: &str, p: &str, eb: usize) {
    let addr = px.fresh("rd");
    px.line(format!("mad.lo.s64 {addr}, {idx}, {eb}, {buf};"));
    px.line(format!("selp.b64 {addr}, {addr}, {buf}, {p};"));
    let size = px.fresh("r");
    px.line(format!("selp.u32 {size}, 16, 0, {p};"));
    px.line(format!(
        "cp.async.cg.shared.global [{dst}], [{addr}], 16, {size};"
    ));
}

/// Large-tile FFMA SGEMM: rows and columns of the block tile (one of them is 64 where the
/// matmul's `m` or `n` is at most 64, as in attention's `[T, T] @ [T, 64]`).
const SG_BM: usize = 128;
const SG_BN: usize = 128;
/// Depth of one `k` stage.
const SG_BK: usize = 8;
/// Floats per shared row (`[k][m]` for A, `[k][n]` for B), padded by 4.
const SG_STRIDE: usize = 132;
/// Bytes of one operand's 8-deep slice of a stage.
const SG_TILE: usize = SG_BK * SG_STRIDE * 4;

/// 8-deep slices of one stage of the `bm`×`bn` SGEMM: two for a 64-wide tile, which has few
/// warps an SM to hide each stage's loads and barrier (gpt's causal attention gradients
/// `dv`, `dq`, `dk`: 0.123, 0.120, 0.128 → 0.111, 0.108, 0.115 ms on an H100; the step
/// 70.41 → 70.30 ms), one for 128×128 (there a second slice's loads take it to 143
/// registers: one block an SM).
fn sgemm_slices(bm: usize, bn: usize) -> usize {
    if bm == 64 || bn == 64 {
        2
    } else {
        1
    }
}

/// The large-tile SGEMM's launch: grid, block tile and `k` slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SgGrid {
    grid: [u32; 3],
    tile: (usize, usize),
    /// Stream-K: the blocks (the grid's `x`) that share the tiles' stages ([`stream_k`]).
    stream_k: Option<usize>,
}

/// The grid of the large-tile SGEMM (exact f32), or `None` where the 64×64 one is used.
fn sgemm_grid(mm: &Matmul) -> Option<SgGrid> {
    if mm.a.dtype != DType::F32 || mm.b.dtype != DType::F32 || !mm.is_plain() {
        return None;
    }
    // A side of at most 64 takes a 64-wide tile: a 128-wide one would idle half its
    // threads' products (gpt's attention matmuls ran the 64×64 tiles at 23 TFLOP/s).
    let (bm, bn) = if (32..=64).contains(&mm.n) && mm.m >= SG_BM {
        (SG_BM, 64)
    } else if (32..=64).contains(&mm.m) && mm.n >= SG_BN {
        (64, SG_BN)
    } else if mm.m >= 64 && mm.n >= 64 && mm.m * mm.n >= 1 << 16 {
        (SG_BM, SG_BN)
    } else {
        return None;
    };
    let batch: usize = mm.batch.iter().product();
    let (gx, gy) = (mm.n.div_ceil(bn), mm.m.div_ceil(bm));
    // Stream-K for 128×128 tiles that fill their waves badly (and skip no terms).
    if (bm, bn) == (SG_BM, SG_BN) && mm.skip.is_empty() {
        let tiles = gx.saturating_mul(gy).saturating_mul(batch);
        if let Some(ctas) = stream_k::choose(tiles, mm.k.div_ceil(SG_BK)) {
            return Some(SgGrid {
                grid: [ctas as u32, 1, 1],
                tile: (bm, bn),
                stream_k: Some(ctas),
            });
        }
    }
    let gz = batch;
    if batch == 0 || gz > 65535 || gy > 65535 || gx > i32::MAX as usize {
        return None;
    }
    // Too few blocks to fill the GPU (132 SMs on an H100/H200): the 64×64 tiles give four
    // times as many (mlp's 256×1024 layers: 0.98 ms per step with 128×128, 0.51 with 64×64).
    if gx * gy * gz < SG_MIN_BLOCKS {
        return None;
    }
    Some(SgGrid {
        grid: [gx as u32, gy as u32, gz as u32],
        tile: (bm, bn),
        stream_k: None,
    })
}

/// Fewest blocks for the large-tile SGEMM: one per SM. Requiring two waves (264) was
/// measured slower: the gpt step went from 116.6 to 118.9 ms on an H100 (its weight
/// gradients of 144 tiles then took the 64×64 path).
const SG_MIN_BLOCKS: usize = SMS;

/// Blocks of the large-tile SGEMM that share an SM (its launch bounds).
const SG_BLOCKS_PER_SM: u32 = 2;

/// The deepest `k` for which the SGEMM's epilogue stores vectors (see [`emit_sgemm`]).
const SG_VECTOR_STORES_MAX_K: usize = 128;

/// FFMA SGEMM with 128×128 block tiles of 256 threads, each thread an 8×8 register tile
/// (rows `ty*4 + {0..4} + {0, 64}`, columns `tx*4 + {0..4} + {0, 64}`, read from shared
/// memory as float4s; a 64-wide side keeps only the first group of 4, and its operand's
/// loads past 64 are out of range), `k` staged 8 deep through two shared buffers: the next
/// stage is loaded into registers (float4 loads where the operand is contiguous and
/// aligned, along `k` or along its rows/columns, whichever is contiguous: [`SgSlot`])
/// while the current one is multiplied, then stored to the other buffer; one barrier a
/// stage. A B contiguous along `k` is read in place (gpt: 86 kernels a step fewer, 75.5 →
/// 72.7 ms on an H100).
fn emit_sgemm(
    k: &Kernel,
    mm: &Matmul,
    SgGrid {
        grid,
        tile: (bm, bn),
        stream_k,
    }: SgGrid,
    offset_of: &dyn Fn(NodeId) -> Option<u64>,
    scratch: u64,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offset_of, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let row_bytes = SG_STRIDE * 4;
    // A stage is `sub` slices of 8 `k`, each thread moving 4 elements of each operand per
    // slice; `tile` is one operand's bytes of a stage.
    let sub = sgemm_slices(bm, bn);
    let bk = SG_BK * sub;
    let tile = SG_TILE * sub;

    let nk = kd.div_ceil(bk);
    let (tile_of, seg) = match stream_k {
        None => (ffma_tile(&mut px, mm, (bm, bn), 1, true)?, None),
        Some(ctas) => {
            let (c, _, _, t) = block_prologue(&mut px);
            let (tx, ty) = thread_xy(&mut px, &t);
            let batch = mm.batch.iter().product();
            let tiles = (n.div_ceil(bn), m.div_ceil(bm), batch);
            let (seg, [x, y, z]) = stream_k::open(&mut px, &c, ctas, tiles, nk);
            let origin = tile_origin(&mut px, mm, &x, &y, &z, bm, bn)?;
            let tile = FfmaTile {
                t,
                tx,
                ty,
                origin,
                split: None,
            };
            (tile, Some(seg))
        }
    };
    let FfmaTile {
        t,
        tx,
        ty,
        origin:
            TileOrigin {
                abase,
                bbase,
                abuf,
                aoff,
                bbuf,
                boff,
                row0,
                col0,
            },
        split: _,
    } = tile_of;
    // Rows and columns of the thread's register tile: groups of 4, 64 apart.
    let (tr, tc) = (bm / 16, bn / 16);
    let sbase = px.fresh("r");
    px.line(format!("mov.u32 {sbase}, mm_s;"));

    let aligned4 = |o: &crate::kernel::Operand, off: u64| {
        o.base % 4 == 0 && o.batch_strides.iter().all(|s| s % 4 == 0) && off.is_multiple_of(16)
    };
    // A vector slot of a `k` that whole stages tile loads a stage from its number alone
    // (gpt's 4096×3072×768 products: 40 → 26 instructions of the loop beside its products
    // and shared loads).
    let stage_bytes = |vector: bool, k_stride: i64| {
        let bytes = u64::try_from(k_stride).ok()?.checked_mul(4 * bk as u64)?;
        let whole = vector && bytes > 0 && kd.is_multiple_of(bk);
        // The stage step is an immediate of `mad.wide.u32`, a slice's an address offset.
        (whole && bytes <= i32::MAX as u64).then_some(bytes)
    };
    // A moves along k where it is contiguous along k (or along neither), else along its
    // rows; B along its columns where contiguous along them (or along neither), else
    // along k (a transposed view, read in place rather than copied).
    let a_k = !(mm.a.cs != 1 && mm.a.rs == 1);
    let a_vec = if a_k {
        mm.a.cs == 1 && kd % 4 == 0 && mm.a.rs % 4 == 0
    } else {
        m % 4 == 0 && mm.a.cs % 4 == 0
    } && aligned4(&mm.a, aoff);
    let b_k = mm.b.cs != 1 && mm.b.rs == 1;
    let b_vec = if b_k {
        kd % 4 == 0 && mm.b.cs % 4 == 0
    } else {
        mm.b.cs == 1 && n % 4 == 0 && mm.b.rs % 4 == 0
    } && aligned4(&mm.b, boff);
    let a = SgSlot::new(
        &mut px,
        &t,
        SgSide {
            k_major: a_k,
            vector: a_vec,
            first: &row0,
            extent: m,
            outer_stride: mm.a.rs,
            k_stride: mm.a.cs,
            base: &abase,
            buf: &abuf,
            shared: 0,
            stage_bytes: stage_bytes(a_vec, mm.a.cs),
        },
    );
    let b = SgSlot::new(
        &mut px,
        &t,
        SgSide {
            k_major: b_k,
            vector: b_vec,
            first: &col0,
            extent: n,
            outer_stride: mm.b.cs,
            k_stride: mm.b.rs,
            base: &bbase,
            buf: &bbuf,
            shared: tile,
            stage_bytes: stage_bytes(b_vec, mm.b.rs),
        },
    );
    let ra: Vec<String> = (0..4 * sub).map(|_| px.fresh("f")).collect();
    let rb: Vec<String> = (0..4 * sub).map(|_| px.fresh("f")).collect();
    // Loads stage `k0` (i64 register) into ra/rb, slice by slice, zeros out of range;
    // staged slots load stage `stage` (u32), or the last one (`last`) past it.
    let load_regs = |px: &mut Px, k0: &str, stage: &str, last: Option<&str>| {
        let stage = match last {
            Some(last) if a.staged() || b.staged() => {
                let (l, st) = (px.fresh("r"), px.fresh("r"));
                px.line(format!("sub.u32 {l}, {last}, 1;"));
                px.line(format!("min.u32 {st}, {stage}, {l};"));
                st
            }
            _ => stage.to_string(),
        };
        for (slot, regs) in [(&a, &ra), (&b, &rb)] {
            if !slot.staged() {
                for r in regs {
                    px.line(format!("mov.f32 {r}, {};", f32_lit(0.0)));
                }
            }
        }
        let mut ks = k0.to_string();
        for (s, (ra, rb)) in ra.chunks(4).zip(rb.chunks(4)).enumerate() {
            if s > 0 && !(a.staged() && b.staged()) {
                ks = px.fresh("rd");
                px.line(format!("add.s64 {ks}, {k0}, {};", s * SG_BK));
            }
            for (slot, regs) in [(&a, ra), (&b, rb)] {
                if slot.staged() {
                    slot.load_stage(px, &stage, s, regs);
                } else {
                    slot.load(px, &ks, kd, regs);
                }
            }
        }
    };
    // Stores ra and rb to the stage at `st` (`[k][m]` and `[k][n]` in shared memory).
    let store_regs = |px: &mut Px, st: &str| {
        for (s, (ra, rb)) in ra.chunks(4).zip(rb.chunks(4)).enumerate() {
            a.store(px, st, s * SG_TILE, ra);
            b.store(px, st, s * SG_TILE, rb);
        }
    };
    // Compute read addresses (stage-relative): A rows ty*4, B columns tx*4.
    let (rda, rdb) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mad.lo.u32 {rda}, {ty}, 16, {sbase};"));
    px.line(format!("mad.lo.u32 {rdb}, {tx}, 16, {sbase};"));
    px.line(format!("add.u32 {rdb}, {rdb}, {tile};"));
    let accs: Vec<String> = (0..tr * tc).map(|_| px.fresh("f")).collect();
    for a in &accs {
        px.line(format!("mov.f32 {a}, {};", f32_lit(0.0)));
    }
    let av: Vec<String> = (0..tr).map(|_| px.fresh("f")).collect();
    let bv: Vec<String> = (0..tc).map(|_| px.fresh("f")).collect();

    // The stages this tile sums: all of them, those its skips leave, or its stream-K
    // segment.
    let range = match &seg {
        Some(s) => Some((s.kb.clone(), s.ke.clone())),
        None => stage_range(&mut px, mm, &row0, &col0, (bm, bn), bk),
    };
    let done = range.as_ref().map(|_| px.label("sg_done"));
    if nk > 0 {
        let (kt, last) = match (&range, &done) {
            (Some((kb, ke)), Some(done)) => {
                let empty = px.fresh("p");
                px.line(format!("setp.ge.u32 {empty}, {kb}, {ke};"));
                px.line(format!("@{empty} bra.uni {done};"));
                let k0 = px.fresh("rd");
                px.line(format!("mul.wide.u32 {k0}, {kb}, {bk};"));
                load_regs(&mut px, &k0, kb, None);
                let st = px.fresh("r");
                px.line(format!("and.b32 {st}, {kb}, 1;"));
                px.line(format!("mad.lo.u32 {st}, {st}, {}, {sbase};", 2 * tile));
                store_regs(&mut px, &st);
                px.line("bar.sync 0;");
                let kt = px.fresh("r");
                px.line(format!("mov.u32 {kt}, {kb};"));
                (kt, ke.clone())
            }
            _ => {
                let (zero, first) = (px.fresh("rd"), px.fresh("r"));
                px.line(format!("mov.s64 {zero}, 0;"));
                px.line(format!("mov.u32 {first}, 0;"));
                load_regs(&mut px, &zero, &first, None);
                store_regs(&mut px, &sbase);
                px.line("bar.sync 0;");
                let kt = px.fresh("r");
                px.line(format!("mov.u32 {kt}, 0;"));
                (kt, nk.to_string())
            }
        };
        let head = px.label("sg_k");
        px.body.push_str(&format!("{head}:\n"));
        let ktn = px.fresh("r");
        px.line(format!("add.u32 {ktn}, {kt}, 1;"));
        let more = px.fresh("p");
        px.line(format!("setp.lt.u32 {more}, {ktn}, {last};"));
        // The next stage's loads stay in the loop's one basic block, before the products,
        // so that their latency overlaps them (behind a branch ptxas sank them below the
        // products: 0.35 of the step). Past the range's last stage, loads read zeros out
        // of range, the next stage where the range ends before `k`, or (staged slots)
        // the range's last stage again, all into the idle buffer.
        let k0 = px.fresh("rd");
        px.line(format!("mul.wide.u32 {k0}, {ktn}, {bk};"));
        load_regs(&mut px, &k0, &ktn, Some(&last));
        let cur = px.fresh("r");
        px.line(format!("and.b32 {cur}, {kt}, 1;"));
        px.line(format!("mul.lo.u32 {cur}, {cur}, {};", 2 * tile));
        let (ca, cb) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("add.u32 {ca}, {rda}, {cur};"));
        px.line(format!("add.u32 {cb}, {rdb}, {cur};"));
        for kk in 0..bk {
            let off = (kk / SG_BK) * SG_TILE + (kk % SG_BK) * row_bytes;
            for (h, regs) in av.chunks(4).enumerate() {
                px.line(format!(
                    "ld.shared.v4.f32 {{{}}}, [{ca}+{}];",
                    regs.join(", "),
                    off + h * 256
                ));
            }
            for (h, regs) in bv.chunks(4).enumerate() {
                px.line(format!(
                    "ld.shared.v4.f32 {{{}}}, [{cb}+{}];",
                    regs.join(", "),
                    off + h * 256
                ));
            }
            for r in 0..tr {
                for c in 0..tc {
                    let a = &accs[r * tc + c];
                    px.line(format!("fma.rn.f32 {a}, {}, {}, {a};", av[r], bv[c]));
                }
            }
        }
        // After the last stage this fills the idle buffer with zeros, or (staged slots,
        // ranges ending before `k`) with a stage no one reads: harmless.
        let nxt = px.fresh("r");
        px.line(format!("and.b32 {nxt}, {ktn}, 1;"));
        px.line(format!("mad.lo.u32 {nxt}, {nxt}, {}, {sbase};", 2 * tile));
        store_regs(&mut px, &nxt);
        px.line("bar.sync 0;");
        px.line(format!("mov.u32 {kt}, {ktn};"));
        px.line(format!("@{more} bra.uni {head};"));
    }
    if let Some(done) = done {
        px.body.push_str(&format!("{done}:\n"));
    }
    let shared = format!("\t.shared .align 16 .b8 mm_s[{}];\n", 4 * tile);
    if let Some(seg) = &seg {
        stream_k::finish_tile(&mut px, seg, &accs, scratch);
    }
    let bounds = {
        // Epilogue: acc[r][c] is row ty*4 + r%4 + 64*(r/4), column tx*4 + c%4 + 64*(c/4).
        let (rb0, cb0) = (px.fresh("rd"), px.fresh("rd"));
        px.line(format!("mul.wide.u32 {rb0}, {ty}, 4;"));
        px.line(format!("add.s64 {rb0}, {rb0}, {row0};"));
        px.line(format!("mul.wide.u32 {cb0}, {tx}, 4;"));
        px.line(format!("add.s64 {cb0}, {cb0}, {col0};"));
        let rows = epilogue_coords(&mut px, &rb0, m, tr, &|r| (r % 4) + 64 * (r / 4));
        let cols = epilogue_coords(&mut px, &cb0, n, tc, &|c| (c % 4) + 64 * (c / 4));
        // A short `k` leaves the stores a large share of the time: gpt's attention scores
        // (k = 64, a 512×512 output a head) took 0.18 ms with scalar stores, 0.11 with
        // vectors. A long `k` keeps scalar stores: ptxas puts a vector's accumulators in
        // four consecutive registers, which took the loop from 127 registers to 159 (or
        // spills within two blocks an SM), and the 4096³ GEMM from 2.93 to 3.09–3.37 ms.
        let vectors = kd <= SG_VECTOR_STORES_MAX_K && epilogue_vectors(&px, mm);
        let acc = |r: usize, c: usize| accs[r * tc + c].clone();
        // A short `k` leaves the epilogue's loads most of the time too: their latency
        // is overlapped ([`EPILOGUE_PREFETCH_REGS`]). After a long `k` loop it was not
        // worth their registers (gpt's gelu gradient spilled, its step +0.7 ms).
        let prefetch = if kd <= SG_VECTOR_STORES_MAX_K {
            EPILOGUE_PREFETCH_REGS
        } else {
            0
        };
        epilogue(&mut px, mm, &rows, &cols, &acc, vectors, prefetch)?;
        // With vector stores, launch bounds keep two blocks an SM (at most 128 registers a
        // thread). So do they with staged slots, whose stage pointers took some epilogues
        // to 129–136 registers (one block an SM): gpt's step 66.3 → 64.7 ms with staged
        // slots and bounds on an H100, a 4096×3072×768 product 0.461 → 0.436 ms (0.442
        // without bounds). Otherwise ptxas stays under 128 by itself, and bounds were
        // measured slower (4096³: 2.93 → 3.09 ms; gpt's k = 512 attention matmuls +20%,
        // both before staged slots).
        if let Some(seg) = &seg {
            stream_k::close(&mut px, seg);
        }
        (vectors || a.staged() || b.staged() || seg.is_some()).then_some((BLOCK, SG_BLOCKS_PER_SM))
    };
    px.line("ret;");
    Ok((
        px.finish_bounded(&shared, bounds),
        LaunchShape {
            grid,
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: stream_k.map_or(0, stream_k::scratch_bytes),
        },
    ))
}

/// The `bk`-deep stages `[kb, ke)` (u32 registers) that the `bm`×`bn` tile at `row0`,
/// `col0` (i64 registers) must sum, given the matmul's [`Skip`]s; `None` without skips (every
/// stage). A skip over `i` and `j` that holds on the whole tile empties the range; one over
/// `k` and `i` or `j` bounds it (causal attention's `p @ v` sums `k <= i`: a quarter to all
/// of the stages, by row tile).
fn stage_range(
    px: &mut Px,
    mm: &Matmul,
    row0: &str,
    col0: &str,
    (bm, bn): (usize, usize),
    bk: usize,
) -> Option<(String, String)> {
    if mm.skip.is_empty() {
        return None;
    }
    // The tile's least and greatest index along i and j.
    let first = |a: MmAxis| if a == MmAxis::I { row0 } else { col0 };
    let extent = |a: MmAxis| if a == MmAxis::I { bm } else { bn };
    let (kb, ke) = (px.fresh("rd"), px.fresh("rd"));
    px.line(format!("mov.s64 {kb}, 0;"));
    px.line(format!("mov.s64 {ke}, {};", mm.k));
    for s in &mm.skip {
        let t = px.fresh("rd");
        match (s.lo, s.hi) {
            // Every term of the tile has idx(hi) - idx(lo) > c: no stage.
            (MmAxis::I, MmAxis::J) | (MmAxis::J, MmAxis::I) => {
                px.line(format!("sub.s64 {t}, {}, {};", first(s.hi), first(s.lo)));
                let least = s.c.saturating_add(extent(s.lo) as i64 - 1);
                let p = px.fresh("p");
                px.line(format!("setp.gt.s64 {p}, {t}, {least};"));
                px.line(format!("@{p} mov.s64 {ke}, 0;"));
            }
            // k - x > c adds nothing: k < x + c + 1 for the tile's greatest x.
            (lo, MmAxis::K) => {
                let end = s.c.saturating_add(extent(lo) as i64);
                px.line(format!("add.s64 {t}, {}, {end};", first(lo)));
                px.line(format!("min.s64 {ke}, {ke}, {t};"));
            }
            // x - k > c adds nothing: k >= x - c for the tile's least x.
            (MmAxis::K, hi) => {
                px.line(format!("sub.s64 {t}, {}, {};", first(hi), s.c));
                px.line(format!("max.s64 {kb}, {kb}, {t};"));
            }
            _ => {}
        }
    }
    // Whole stages: kb rounded down, ke up, both within [0, stages].
    let (b, e) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("max.s64 {ke}, {ke}, 0;"));
    px.line(format!("add.s64 {ke}, {ke}, {};", bk - 1));
    px.line(format!("div.s64 {ke}, {ke}, {bk};"));
    px.line(format!("div.s64 {kb}, {kb}, {bk};"));
    px.line(format!("cvt.u32.u64 {b}, {kb};"));
    px.line(format!("cvt.u32.u64 {e}, {ke};"));
    Some((b, e))
}

/// One operand of the SGEMM as [`SgSlot::new`] sets it up.
struct SgSide<'a> {
    /// The slot runs along `k` (4 consecutive `k` of one row or column, stored transposed)
    /// rather than along the rows or columns (one `k`, 4 consecutive ones, one vector
    /// store).
    k_major: bool,
    /// One 16-byte load per stage (contiguous, aligned, whole groups of 4) rather than 4.
    vector: bool,
    /// The tile's first row (A) or column (B), and their count.
    first: &'a str,
    extent: usize,
    /// Element strides along rows or columns (A's `rs`, B's `cs`) and along `k`.
    outer_stride: i64,
    k_stride: i64,
    /// The operand's element base for this batch, its buffer's byte address, and the
    /// stage-relative byte offset of its tile in shared memory.
    base: &'a str,
    buf: &'a str,
    shared: usize,
    /// Bytes from one stage to the next where the slot loads vectors and every stage lies
    /// inside `k` (`k` a multiple of the stage depth), so a stage needs no range check along
    /// `k` and no zeros: `None` otherwise, or where the step does not fit a u32.
    stage_bytes: Option<u64>,
}

/// The 4 elements of one operand a thread of the SGEMM moves per stage: rows or columns
/// `t/2`, `k` from `(t%2)*4` when `k_major`; `k` row `t/32`, rows or columns from
/// `(t%32)*4` otherwise.
struct SgSlot {
    k_major: bool,
    vector: bool,
    extent: usize,
    outer_stride: i64,
    k_stride: i64,
    buf: String,
    /// First global row or column, its range check (k-major: the slot's only one), the
    /// slot's first `k` in the stage, the element index at `k = 0`, and the shared offset.
    outer: String,
    ok: String,
    kq: String,
    base: String,
    st: String,
    /// Bytes between stages and the byte address of the slot's elements at stage 0, where
    /// every stage lies inside `k` (see [`SgSide::stage_bytes`]).
    staged: Option<(u64, String)>,
}

impl SgSlot {
    fn new(px: &mut Px, t: &str, s: SgSide) -> SgSlot {
        let (x0, x1) = (px.fresh("r"), px.fresh("r"));
        let (outer, kq) = if s.k_major {
            px.line(format!("shr.u32 {x0}, {t}, 1;"));
            px.line(format!("and.b32 {x1}, {t}, 1;"));
            px.line(format!("shl.b32 {x1}, {x1}, 2;"));
            (x0, x1)
        } else {
            px.line(format!("shr.u32 {x0}, {t}, 5;"));
            px.line(format!("and.b32 {x1}, {t}, 31;"));
            px.line(format!("shl.b32 {x1}, {x1}, 2;"));
            (x1, x0)
        };
        let g = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {g}, {outer};"));
        px.line(format!("add.s64 {g}, {g}, {};", s.first));
        let ok = px.fresh("p");
        px.line(format!("setp.lt.s64 {ok}, {g}, {};", s.extent));
        let kq64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {kq64}, {kq};"));
        let base = px.fresh("rd");
        px.line(format!(
            "mad.lo.s64 {base}, {g}, {}, {};",
            s.outer_stride, s.base
        ));
        px.line(format!(
            "mad.lo.s64 {base}, {kq64}, {}, {base};",
            s.k_stride
        ));
        let st = px.fresh("r");
        px.line(format!("mul.lo.u32 {st}, {kq}, {};", SG_STRIDE * 4));
        px.line(format!("mad.lo.u32 {st}, {outer}, 4, {st};"));
        if s.shared > 0 {
            px.line(format!("add.u32 {st}, {st}, {};", s.shared));
        }
        // A staged slot reads its row or column clamped into range: every load is then in
        // bounds and unconditional (a predicated load would keep the registers live across
        // the loop, past two blocks an SM), and rows or columns out of range only reach
        // products that are never stored.
        let staged = s.stage_bytes.map(|bytes| {
            let (gc, ptr) = (px.fresh("rd"), px.fresh("rd"));
            // The last row, or (a vector across rows or columns) the last whole vector.
            let width = if s.k_major { 1 } else { 4 };
            px.line(format!(
                "min.s64 {gc}, {g}, {};",
                s.extent.max(width) - width
            ));
            px.line(format!(
                "mad.lo.s64 {ptr}, {gc}, {}, {};",
                s.outer_stride, s.base
            ));
            px.line(format!("mad.lo.s64 {ptr}, {kq64}, {}, {ptr};", s.k_stride));
            px.line(format!("mad.lo.s64 {ptr}, {ptr}, 4, {};", s.buf));
            (bytes, ptr)
        });
        SgSlot {
            k_major: s.k_major,
            vector: s.vector,
            extent: s.extent,
            outer_stride: s.outer_stride,
            k_stride: s.k_stride,
            buf: s.buf.to_string(),
            outer: g,
            ok,
            kq: kq64,
            base,
            st,
            staged,
        }
    }

    /// Whether [`Self::load_stage`] applies (no range checks along `k`, no zeros).
    fn staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Loads slice `slice` of stage `stage` (u32 register, a stage inside `k`) into `regs`:
    /// one address from the stage number, one vector load of the clamped row or column.
    fn load_stage(&self, px: &mut Px, stage: &str, slice: usize, regs: &[String]) {
        let Some((bytes, ptr)) = &self.staged else {
            return;
        };
        let addr = px.fresh("rd");
        px.line(format!("mad.wide.u32 {addr}, {stage}, {bytes}, {ptr};"));
        let off = slice as i64 * SG_BK as i64 * self.k_stride * 4;
        px.line(format!(
            "ld.global.v4.f32 {{{}}}, [{addr}+{off}];",
            regs.join(", ")
        ));
    }

    /// Loads the stage starting at `k0` (i64 register) into `regs` (left as they are,
    /// zeros, out of range).
    fn load(&self, px: &mut Px, k0: &str, kd: usize, regs: &[String]) {
        let (buf, ok) = (&self.buf, &self.ok);
        let kg = px.fresh("rd");
        px.line(format!("add.s64 {kg}, {k0}, {};", self.kq));
        let k_ok = if self.k_major {
            None
        } else {
            let p = px.fresh("p");
            px.line(format!("setp.lt.s64 {p}, {kg}, {kd};"));
            Some(p)
        };
        let idx = px.fresh("rd");
        px.line(format!(
            "mad.lo.s64 {idx}, {k0}, {}, {};",
            self.k_stride, self.base
        ));
        if self.vector {
            let p = px.fresh("p");
            match &k_ok {
                None => px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {ok};")),
                Some(pk) => px.line(format!("and.pred {p}, {pk}, {ok};")),
            }
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {idx}, 4, {buf};"));
            px.line(format!(
                "@{p} ld.global.v4.f32 {{{}}}, [{addr}];",
                regs.join(", ")
            ));
            return;
        }
        let step = if self.k_major {
            self.k_stride
        } else {
            self.outer_stride
        };
        for (e, r) in regs.iter().enumerate() {
            let (at, p) = (px.fresh("rd"), px.fresh("p"));
            match &k_ok {
                None => {
                    px.line(format!("add.s64 {at}, {kg}, {e};"));
                    px.line(format!("setp.lt.and.s64 {p}, {at}, {kd}, {ok};"));
                }
                Some(pk) => {
                    px.line(format!("add.s64 {at}, {}, {e};", self.outer));
                    px.line(format!("setp.lt.and.s64 {p}, {at}, {}, {pk};", self.extent));
                }
            }
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {e}, {step}, {idx};"));
            px.line(format!("mad.lo.s64 {addr}, {addr}, 4, {buf};"));
            px.line(format!("@{p} ld.global.f32 {r}, [{addr}];"));
        }
    }

    /// Stores `regs` to the stage at shared address `stage`, `at` bytes in (the slice).
    fn store(&self, px: &mut Px, stage: &str, at: usize, regs: &[String]) {
        let d = px.fresh("r");
        px.line(format!("add.u32 {d}, {stage}, {};", self.st));
        if self.k_major {
            for (e, r) in regs.iter().enumerate() {
                px.line(format!(
                    "st.shared.f32 [{d}+{}], {r};",
                    at + e * SG_STRIDE * 4
                ));
            }
        } else {
            let addr = if at > 0 { format!("{d}+{at}") } else { d };
            px.line(format!(
                "st.shared.v4.f32 [{addr}], {{{}}};",
                regs.join(", ")
            ));
        }
    }
}

/// The start of every block-tiled kernel: the arena base, the block index and the thread
/// index (`px.tid`).
fn block_prologue(px: &mut Px) -> (String, String, String, String) {
    px.load_arena();
    let (bx, by, bz, t) = (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {bx}, %ctaid.x;"));
    px.line(format!("mov.u32 {by}, %ctaid.y;"));
    px.line(format!("mov.u32 {bz}, %ctaid.z;"));
    px.line(format!("mov.u32 {t}, %tid.x;"));
    px.tid = t.clone();
    (bx, by, bz, t)
}

/// What both FFMA tiled matmuls start from: the thread index split 16×16 (`tx`, `ty`),
/// split-K's slice and the tile's origin.
struct FfmaTile {
    t: String,
    tx: String,
    ty: String,
    origin: TileOrigin,
    /// Split-K: this block's slice of `k` (u64).
    split: Option<String>,
}

/// The thread's column and row (`tx`, `ty`) of the 16×16 threads of an FFMA tile.
fn thread_xy(px: &mut Px, t: &str) -> (String, String) {
    let (tx, ty) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {tx}, {t}, 15;"));
    px.line(format!("shr.u32 {ty}, {t}, 4;"));
    (tx, ty)
}

/// `k_split`: blocks along `z` that share an output tile, each summing a part of `k`.
/// `balance`: the tiles' `k` ranges come from the matmul's skips, and the blocks take the
/// tiles in [`heavy_first`] order.
fn ffma_tile(
    px: &mut Px,
    mm: &Matmul,
    (bm, bn): (usize, usize),
    k_split: usize,
    balance: bool,
) -> Res<FfmaTile> {
    let (bx, by, bz, t) = block_prologue(px);
    let (tx, ty) = thread_xy(px, &t);
    let (bx, by, bz) = match balance.then(|| heavy_first(px, mm, (bm, bn), [&bx, &by, &bz])) {
        Some(Some(b)) => b,
        _ => (bx, by, bz),
    };
    let (bz, split) = if k_split > 1 {
        let (b, s, s64) = (px.fresh("r"), px.fresh("r"), px.fresh("rd"));
        px.line(format!("div.u32 {b}, {bz}, {k_split};"));
        px.line(format!("rem.u32 {s}, {bz}, {k_split};"));
        px.line(format!("cvt.u64.u32 {s64}, {s};"));
        (b, Some(s64))
    } else {
        (bz, None)
    };
    let origin = tile_origin(px, mm, &bx, &by, &bz, bm, bn)?;
    Ok(FfmaTile {
        t,
        tx,
        ty,
        origin,
        split,
    })
}

/// Block indices `(x, y, z)` that take the tiles heaviest first, where a skip over `k` and
/// the rows (or columns) gives each row (or column) of tiles its own count of stages:
/// causal attention's `p @ v` and `ds @ k` sum 1 to 4 stages of 128 by row tile, `pᵀ @ do`
/// and `dsᵀ @ q` 4 to 1. Blocks start in the order of their linear index, so that the
/// long tiles start first and the short ones fill in behind them; in the launch's order
/// (`y` faster than the heads along `z`) every SM took tiles of one row (132 SMs, 4 rows),
/// and the busiest SM ran 1.5 times the mean. `None` without such a skip.
fn heavy_first(
    px: &mut Px,
    mm: &Matmul,
    (bm, bn): (usize, usize),
    [bx, by, bz]: [&str; 3],
) -> Option<(String, String, String)> {
    // The axis along which the stages vary, and whether they grow along it.
    let (rows, grows) = mm.skip.iter().find_map(|s| match (s.lo, s.hi) {
        (MmAxis::I, MmAxis::K) => Some((true, true)),
        (MmAxis::J, MmAxis::K) => Some((false, true)),
        (MmAxis::K, MmAxis::I) => Some((true, false)),
        (MmAxis::K, MmAxis::J) => Some((false, false)),
        _ => None,
    })?;
    let (gx, gy) = (mm.n.div_ceil(bn), mm.m.div_ceil(bm));
    let batch: usize = mm.batch.iter().product();
    if gx.checked_mul(gy)?.checked_mul(batch)? > u32::MAX as usize {
        return None;
    }
    // The linear index, read back as (the axis's tile, the batch, the other axis's tile),
    // the first the slowest.
    let lin = px.fresh("r");
    px.line(format!(
        "// tiles heaviest first: {} tiles, stages {} along them",
        if rows { "row" } else { "column" },
        if grows { "growing" } else { "shrinking" }
    ));
    px.line(format!("mad.lo.u32 {lin}, {bz}, {gy}, {by};"));
    px.line(format!("mad.lo.u32 {lin}, {lin}, {gx}, {bx};"));
    let (tiles, other) = if rows { (gy, gx) } else { (gx, gy) };
    let mut digits = [String::new(), String::new(), String::new()];
    px.digits(&lin, &[tiles, batch, other], false, |_, i, r| digits[i] = r);
    let [idx, z, o] = digits;
    if grows {
        px.line(format!("sub.u32 {idx}, {}, {idx};", tiles - 1));
    }
    Some(if rows { (o, idx, z) } else { (idx, o, z) })
}

fn batch_bases(px: &mut Px, mm: &Matmul, bz: &str) -> (String, String) {
    let nb = mm.batch.len();
    let mut rest = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {rest}, {bz};"));
    for d in (0..nb).rev() {
        let v = px.fresh("rd");
        if d == 0 {
            px.line(format!("mov.u64 {v}, {rest};"));
        } else {
            let ext = mm.batch[d];
            px.line(format!("rem.u64 {v}, {rest}, {ext};"));
            let q = px.fresh("rd");
            px.line(format!("div.u64 {q}, {rest}, {ext};"));
            rest = q;
        }
        px.vars.insert(d as Var, v);
    }
    let mut abase = px.imm64(mm.a.base);
    let mut bbase = px.imm64(mm.b.base);
    for d in 0..nb {
        let v = px.vars.get(&(d as Var)).cloned().unwrap_or_default();
        let (sa, sb) = (mm.a.batch_strides[d], mm.b.batch_strides[d]);
        let na = px.fresh("rd");
        px.line(format!("mad.lo.s64 {na}, {v}, {sa}, {abase};"));
        abase = na;
        let nb2 = px.fresh("rd");
        px.line(format!("mad.lo.s64 {nb2}, {v}, {sb}, {bbase};"));
        bbase = nb2;
    }
    (abase, bbase)
}

/// The byte address of an operand's buffer, and its arena offset.
fn operand_buffer(px: &mut Px, buf: NodeId) -> Res<(String, u64)> {
    let off = (px.offset_of)(buf).ok_or(PtxError::NoOffset(buf.index()))?;
    let r = px.fresh("rd");
    let arena = px.arena.clone();
    px.line(format!("add.s64 {r}, {arena}, {off};"));
    Ok((r, off))
}

/// The coordinates (row-major over `dims`) of the flattened index in register `lin`;
/// `lin` itself for one axis. 32-bit division when the product fits. Out-of-range
/// indices give garbage coordinates (callers guard them).
fn split_index(px: &mut Px, lin: &str, dims: &[usize]) -> Vec<String> {
    if dims.len() <= 1 {
        return vec![lin.to_string()];
    }
    let total: usize = dims.iter().product();
    let mut out = vec![String::new(); dims.len()];
    if total < 1 << 31 {
        let mut rest = px.fresh("r");
        px.line(format!("cvt.u32.u64 {rest}, {lin};"));
        for d in (0..dims.len()).rev() {
            let v = px.fresh("rd");
            if d == 0 {
                px.line(format!("cvt.u64.u32 {v}, {rest};"));
            } else {
                let (r, q) = (px.fresh("r"), px.fresh("r"));
                px.line(format!("rem.u32 {r}, {rest}, {};", dims[d]));
                px.line(format!("div.u32 {q}, {rest}, {};", dims[d]));
                px.line(format!("cvt.u64.u32 {v}, {r};"));
                rest = q;
            }
            out[d] = v;
        }
    } else {
        px.digits(lin, dims, true, |_, d, v| out[d] = v);
    }
    out
}

/// `count` output coordinates `base + at(i)` with their in-range predicates.
fn epilogue_coords(
    px: &mut Px,
    base: &str,
    extent: usize,
    count: usize,
    at: &dyn Fn(usize) -> usize,
) -> Vec<(String, String)> {
    (0..count)
        .map(|i| {
            let (x, ok) = (px.fresh("rd"), px.fresh("p"));
            px.line(format!("add.s64 {x}, {base}, {};", at(i)));
            px.line(format!("setp.lt.s64 {ok}, {x}, {extent};"));
            (x, ok)
        })
        .collect()
}

/// The kernel's stores at one output element, in a cache scope of their own: `at` are the
/// domain coordinates after the batch axes (the row's, then the column's), `acc` the
/// accumulator.
fn store_point(
    px: &mut Px,
    mm: &Matmul,
    at: &[String],
    acc: String,
    loaded: &[(ExprId, String)],
) -> Res<()> {
    let nb = mm.batch.len();
    px.journal.push(Vec::new());
    px.bind_point(nb, at);
    for (e, r) in loaded {
        px.remember(*e, r.clone());
    }
    px.acc = Some(acc);
    px.stores()?;
    px.pop_scope();
    Ok(())
}

/// The kernel's stores at `VEC` consecutive output elements of one row (the coordinates
/// `ats`, the accumulators `accs`), as one vector store each: every lane's values are
/// computed in a cache scope of its own, then each store writes them at lane 0's address.
fn store_vector(
    px: &mut Px,
    mm: &Matmul,
    ats: &[Vec<String>],
    accs: &[String],
    loaded: &[Vec<(ExprId, String)>],
) -> Res<()> {
    let nb = mm.batch.len();
    let stores = px.k.stores.clone();
    let mut vals: Vec<Vec<String>> = vec![Vec::new(); stores.len()];
    let mut addrs = Vec::new();
    for (lane, (at, acc)) in ats.iter().zip(accs).enumerate() {
        px.journal.push(Vec::new());
        px.bind_point(nb, at);
        for (e, r) in loaded.get(lane).into_iter().flatten() {
            px.remember(*e, r.clone());
        }
        px.acc = Some(acc.clone());
        for (si, s) in stores.iter().enumerate() {
            vals[si].push(px.emit(s.value)?);
            if lane == 0 {
                let i = px.emit(s.index)?;
                addrs.push(px.address(s.buf, s.dtype, &i)?);
            }
        }
        px.pop_scope();
    }
    for ((s, addr), v) in stores.iter().zip(&addrs).zip(&vals) {
        px.vector_store(addr, s.dtype, v);
    }
    Ok(())
}

/// Whether a plain matmul's epilogue can store `VEC` consecutive columns at once: every
/// store writes a vector-storable dtype, without accumulating, at an index with coefficient
/// 1 on the column whose other part is a multiple of `VEC`, into a buffer aligned to the
/// vector's bytes (so a tile's aligned groups of `VEC` columns are whole vectors, all in
/// range or all out).
fn epilogue_vectors(px: &Px, mm: &Matmul) -> bool {
    let k = px.k;
    if mm.cols.len() != 1 || mm.rows.len() != 1 || !mm.n.is_multiple_of(VEC) {
        return false;
    }
    let col = (mm.batch.len() + 1) as Var;
    !k.stores.is_empty()
        && k.stores
            .iter()
            .all(|s| !s.accumulate && vector_access(k, px.offset_of, s.buf, s.dtype, s.index, col))
}

/// Registers an epilogue gives to loads issued ahead of their use: rows of the register
/// tile come in batches whose loads (all of them, or a row's where one row takes more) are
/// issued before the batch's first store. Loaded where each value is computed, they waited
/// for one another through the stores between them (ptxas does not move a load above a
/// store that may alias it).
const EPILOGUE_PREFETCH_REGS: usize = 64;

/// The loads of the kernel's stored values outside reductions (a select over loads as one),
/// in pool order, each with whether its index reads a column's variable.
fn epilogue_loads(px: &Px, mm: &Matmul) -> Vec<(ExprId, bool)> {
    let k = px.k;
    let first_col = mm.batch.len() + mm.rows.len();
    let by_col = first_col..first_col + mm.cols.len();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stack: Vec<ExprId> = k.stores.iter().flat_map(|s| [s.value, s.index]).collect();
    while let Some(e) = stack.pop() {
        if !seen.insert(e) || px.cache.contains_key(&e) {
            continue;
        }
        match k.pool.get(e) {
            E::Reduce { .. } | E::ArgMax { .. } => {}
            E::Load { .. } => out.push(e),
            E::Select(..) if px.load_tree(e).is_some() => out.push(e),
            node => stack.extend(crate::kernel::lower::children(node)),
        }
    }
    if out.is_empty() {
        return Vec::new();
    }
    out.sort();
    let free = crate::kernel::lower::free_vars(&k.pool);
    out.into_iter()
        .map(|e| {
            let cols = free[e.0 as usize]
                .iter()
                .any(|&v| by_col.contains(&(v as usize)));
            (e, cols)
        })
        .collect()
}

/// The loads of [`epilogue_loads`] at every in-range point of `rows` (all columns, in groups
/// of `width` sharing their first column's predicate), issued now: for each row and column
/// the registers holding them, to seed that point's cache when its value is computed. A
/// load that reads no column's variable is made once a row.
#[allow(clippy::type_complexity)]
fn prefetch_epilogue(
    px: &mut Px,
    mm: &Matmul,
    loads: &[(ExprId, bool)],
    rows: &[(&(String, String), &Vec<String>)],
    cols: &[(String, String)],
    col_at: &[Vec<String>],
    width: usize,
) -> Res<Vec<Vec<Vec<(ExprId, String)>>>> {
    let nb = mm.batch.len();
    // The column's variable where groups are vectors (one row and one column variable).
    let col = (nb + 1) as Var;
    let mut out = vec![vec![Vec::new(); cols.len()]; rows.len()];
    if loads.is_empty() {
        return Ok(out);
    }
    for (r, ((_, pi), row_at)) in rows.iter().enumerate() {
        let skip_row = px.label("skip");
        px.line(format!("@!{pi} bra {skip_row};"));
        px.journal.push(Vec::new());
        px.bind_point(nb, row_at.iter());
        let mut row_loads = Vec::new();
        for &(e, by_col) in loads {
            if !by_col {
                row_loads.push((e, px.emit(e)?));
            }
        }
        px.pop_scope();
        for g in (0..cols.len()).step_by(width) {
            let skip = px.label("skip");
            px.line(format!("@!{} bra {skip};", cols[g].1));
            // Lane `l`'s element of each vector load of the group.
            let mut lanes: Vec<(ExprId, Vec<String>)> = Vec::new();
            for c in g..(g + width).min(cols.len()) {
                px.journal.push(Vec::new());
                px.bind_point(nb, row_at.iter().chain(&col_at[c]));
                let mut regs = row_loads.clone();
                for (e, reg) in &row_loads {
                    px.remember(*e, reg.clone());
                }
                if width == VEC && c == g {
                    for &(e, by_col) in loads {
                        match *px.k.pool.get(e) {
                            E::Load { buf, dtype, index }
                                if by_col
                                    && vector_access(
                                        px.k,
                                        px.offset_of,
                                        buf,
                                        dtype,
                                        index,
                                        col,
                                    ) =>
                            {
                                let i = px.emit(index)?;
                                let a = px.address(buf, dtype, &i)?;
                                lanes.push((e, px.vector_load(&a, dtype)));
                            }
                            _ => {}
                        }
                    }
                }
                for (e, vals) in &lanes {
                    px.remember(*e, vals[c - g].clone());
                    regs.push((*e, vals[c - g].clone()));
                }
                for &(e, by_col) in loads {
                    if by_col && lanes.iter().all(|(x, _)| *x != e) {
                        regs.push((e, px.emit(e)?));
                    }
                }
                px.pop_scope();
                out[r][c] = regs;
            }
            px.body.push_str(&format!("{skip}:\n"));
        }
        px.body.push_str(&format!("{skip_row}:\n"));
    }
    Ok(out)
}

/// The fused epilogue of a register-tiled matmul: the kernel's stores at every in-range
/// (row, column) pair, with the accumulator `acc(r, c)`. `vectors`: the columns come in
/// groups of `VEC` consecutive ones, the first of each a multiple of `VEC` (the FFMA SGEMM's
/// layout), and [`epilogue_vectors`] holds: each group is stored as vectors. The values'
/// loads are issued ahead, a batch of rows at a time ([`EPILOGUE_PREFETCH_REGS`]).
fn epilogue(
    px: &mut Px,
    mm: &Matmul,
    rows: &[(String, String)],
    cols: &[(String, String)],
    acc: &dyn Fn(usize, usize) -> String,
    vectors: bool,
    prefetch_regs: usize,
) -> Res<()> {
    // The domain coordinates of each row and column (an implicit GEMM's rows span
    // several axes).
    let row_at: Vec<Vec<String>> = rows
        .iter()
        .map(|(i, _)| split_index(px, i, &mm.rows))
        .collect();
    let col_at: Vec<Vec<String>> = cols
        .iter()
        .map(|(j, _)| split_index(px, j, &mm.cols))
        .collect();
    let width = if vectors && cols.len().is_multiple_of(VEC) {
        VEC
    } else {
        1
    };
    let loads = if prefetch_regs > 0 {
        epilogue_loads(px, mm)
    } else {
        Vec::new()
    };
    let per_row: usize = loads
        .iter()
        .map(|&(_, by_col)| if by_col { cols.len() } else { 1 })
        .sum();
    let batch = (1..=rows.len())
        .rev()
        .find(|&d| rows.len().is_multiple_of(d) && d * per_row <= prefetch_regs)
        .unwrap_or(1);
    for r0 in (0..rows.len()).step_by(batch.max(1)) {
        let these: Vec<_> = rows[r0..r0 + batch].iter().zip(&row_at[r0..]).collect();
        let loaded = prefetch_epilogue(px, mm, &loads, &these, cols, &col_at, width)?;
        for (r, ((_, pi), loaded)) in these.iter().map(|x| x.0).zip(&loaded).enumerate() {
            let r = r0 + r;
            for g in (0..cols.len()).step_by(width) {
                let skip = px.label("skip");
                let p = px.fresh("p");
                px.line(format!("and.pred {p}, {pi}, {};", cols[g].1));
                px.line(format!("@!{p} bra {skip};"));
                let ats: Vec<Vec<String>> = (g..g + width)
                    .map(|c| row_at[r].iter().chain(&col_at[c]).cloned().collect())
                    .collect();
                if width == VEC {
                    let accs: Vec<String> = (g..g + width).map(|c| acc(r, c)).collect();
                    store_vector(px, mm, &ats, &accs, &loaded[g..g + width])?;
                } else {
                    store_point(px, mm, &ats[0], acc(r, g), &loaded[g])?;
                }
                px.body.push_str(&format!("{skip}:\n"));
            }
        }
    }
    Ok(())
}
