//! Kernel IR → Cranelift IR (CLIF), one function per kernel, as text.
//!
//! Every kernel has the signature `(i64 arena, i64 lo, i64 hi, i64 helpers)` (see
//! `runtime/ARTIFACT.md`): its outermost loop runs over `[lo, hi)`. Loop kernels nest one
//! loop per domain axis; each expression node is computed once, in the loop of its
//! innermost variable (so row statistics are hoisted out of the column loop); reductions
//! open their own loops. Where shapes allow (f32 stores and loads contiguous along the
//! innermost axis, inline math only: see `Cg::simd_plan`), the innermost loop runs on f32x4
//! vectors while 4 lanes fit and the scalar loop takes the last `extent % 4` iterations.
//! f32 matmul kernels call the runtime's GEMM helper (`sgemm`, `runtime/ARTIFACT.md`) block
//! by block and run the fused epilogue over each block it returns: Cranelift lowers 128-bit
//! vectors only, and the helper runs the host's widest (AVX-512 where there is). Products
//! of f16/bf16 operands take a dot product per element. Implicit GEMMs (convolutions)
//! gather each block's operands into the thread's gather buffers, on f32x4 vectors where a
//! run is contiguous, and call `sgemm_gathered` (`Cg::gather_matmul`).
//!
//! Functions go through the Cranelift verifier before they are printed, so the text the
//! runtime receives is well-formed.

use super::divconst::DivBy;
use crate::ir::{BinaryOp, DType, NodeId, UnaryOp};
use crate::kernel::lower::{children, free_vars, reachable};
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{CpuPanels, ExprId, ExprPool, Kernel, Matmul, Red, VTy, Var, E};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I32, I32X4, I64, I8};
use cranelift_codegen::ir::{
    AbiParam, Block, Function, InstBuilder, MemFlagsData, Signature, Type, UserFuncName, Value,
};
use cranelift_codegen::isa::CallConv;
use cranelift_codegen::settings;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use std::collections::{BTreeSet, HashMap};

/// Slots of the helper table (runtime/ARTIFACT.md).
mod slot {
    pub const LOG: usize = 1;
    pub const SIN: usize = 3;
    pub const COS: usize = 4;
    pub const ERF: usize = 5;
    pub const POW: usize = 6;
    pub const F16_TO_F32: usize = 7;
    pub const F32_TO_F16: usize = 8;
    pub const SGEMM: usize = 11;
    pub const SGEMM_GATHERED: usize = 12;
    pub const GATHER_A: usize = 14;
    pub const GATHER_B: usize = 15;
    // The runtime's table order (`tcc_runtime::cpu::CPU_HELPERS` and the slots after it).
    const _: () = {
        use tcc_runtime::cpu as rt;
        assert!(rt::GATHER_A_SLOT == GATHER_A && rt::GATHER_B_SLOT == GATHER_B);
        assert!(rt::GEMM_CONTEXT_SLOT == SGEMM_GATHERED + 1);
        assert!(rt::CPU_HELPERS.len() == SGEMM_GATHERED + 1);
        assert!(matches!(rt::CPU_HELPERS[SGEMM].as_bytes(), b"sgemm"));
        assert!(matches!(
            rt::CPU_HELPERS[SGEMM_GATHERED].as_bytes(),
            b"sgemm_gathered"
        ));
        assert!(matches!(rt::CPU_HELPERS[LOG].as_bytes(), b"logf"));
        assert!(matches!(rt::CPU_HELPERS[POW].as_bytes(), b"powf"));
        assert!(matches!(
            rt::CPU_HELPERS[F16_TO_F32].as_bytes(),
            b"f16_to_f32"
        ));
    };
    // Slots 9 and 10 (bf16 <-> f32) stay in the runtime's table for artifacts built before
    // bf16 loads, stores and rounding were made inline.
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClifError {
    #[error("buffer of node %{0} has no arena offset")]
    NoOffset(usize),
    #[error("kernel {kernel}: Cranelift verifier: {message}")]
    Verify { kernel: String, message: String },
    #[error("kernel {kernel}: {message}")]
    Unsupported { kernel: String, message: String },
}

type Res<T> = Result<T, ClifError>;

fn cl_ty(t: VTy) -> Type {
    match t {
        VTy::F32 => F32,
        VTy::I32 => I32,
        VTy::I64 => I64,
        VTy::Bool => I8,
    }
}

fn flags() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Flags of vector loads and stores: they never trap, but a vector of 4 f32 at an element
/// index is only 4-byte aligned (without `aligned`, x64 does not fold the access into an SSE
/// operand, which would need 16).
fn vflags() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}

/// f32 lanes of the vectors of the innermost loop.
const LANES: i64 = 4;

/// How a Loop kernel's innermost domain loop runs on f32x4 vectors (see `Cg::simd_plan`).
struct SimdPlan {
    /// The innermost domain variable.
    inner: Var,
    /// Values computed outside the innermost loop that its vector code reads, splat once
    /// before the loop (ascending ids: deterministic).
    invariants: Vec<ExprId>,
}

/// Translates kernels to CLIF text, in order. `offsets` gives each buffer's arena offset.
///
/// Kernels are translated independently, so chunks of them go to the machine's cores and
/// their texts are joined in order: the same text on any number of threads. The error is
/// the first kernel's that fails (every chunk before a failed one is finished).
pub fn emit_module(kernels: &[Kernel], offsets: &Offsets) -> Res<String> {
    /// Stack of a translating thread: a kernel's expressions are walked recursively, as
    /// deep as the longest chain fused into it (a 10,000-term sum), so it gets the
    /// compiler thread's stack (`main.rs`; pages are reserved, committed only when used).
    const WORKER_STACK: usize = 1 << 30;
    use std::fmt::Write as _;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    const CHUNK: usize = 64;
    let chunk = |c: &[Kernel], fctx: &mut FunctionBuilderContext| -> Res<String> {
        let mut out = String::new();
        for k in c {
            let f = emit_kernel(k, offsets, fctx)?;
            // Writing into a `String` cannot fail.
            let _ = writeln!(out, "{}", f.display());
        }
        Ok(out)
    };
    let chunks: Vec<&[Kernel]> = kernels.chunks(CHUNK).collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16)
        .min(chunks.len());
    if threads <= 1 {
        return chunk(kernels, &mut FunctionBuilderContext::new());
    }
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let done: Option<Vec<(usize, Res<String>)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .stack_size(WORKER_STACK)
                    .spawn_scoped(s, || {
                        let mut fctx = FunctionBuilderContext::new();
                        let mut out = Vec::new();
                        while !failed.load(Relaxed) {
                            let i = next.fetch_add(1, Relaxed);
                            let Some(c) = chunks.get(i) else { break };
                            let r = chunk(c, &mut fctx);
                            failed.fetch_or(r.is_err(), Relaxed);
                            out.push((i, r));
                        }
                        out
                    })
                    .ok()
            })
            .collect();
        if workers.is_empty() {
            return None;
        }
        let done = workers
            .into_iter()
            // A worker that panicked (a compiler bug) panics here too, with its message.
            .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        Some(done)
    });
    let Some(mut done) = done else {
        // No thread could be started: translate on this one.
        return chunk(kernels, &mut FunctionBuilderContext::new());
    };
    done.sort_by_key(|(i, _)| *i);
    let mut done = done.into_iter();
    let mut out = String::new();
    for (want, c) in chunks.iter().enumerate() {
        match done.next() {
            Some((i, r)) if i == want => out.push_str(&r?),
            // Every chunk before the first failed one is finished (claimed in order).
            _ => {
                return Err(ClifError::Unsupported {
                    kernel: c.first().map_or_else(String::new, |k| k.name.clone()),
                    message: "the translation of this kernel did not finish".to_string(),
                })
            }
        }
    }
    Ok(out)
}

/// The target description the builder needs: 64-bit pointers, System V (the runtime
/// rewrites the calling convention for its host).
fn frontend_config() -> cranelift_codegen::isa::TargetFrontendConfig {
    cranelift_codegen::isa::TargetFrontendConfig {
        default_call_conv: CallConv::SystemV,
        pointer_width: target_lexicon::PointerWidth::U64,
        page_size_align_log2: 12,
    }
}

fn signature() -> Signature {
    let mut sig = Signature::new(CallConv::SystemV);
    for _ in 0..4 {
        sig.params.push(AbiParam::new(I64));
    }
    sig
}

/// Translates one kernel into a verified Cranelift function.
pub fn emit_kernel(
    k: &Kernel,
    offsets: &Offsets,
    fctx: &mut FunctionBuilderContext,
) -> Res<Function> {
    let mut func = Function::with_name_signature(UserFuncName::testcase(&k.name), signature());
    {
        let b = FunctionBuilder::new(&mut func, fctx);
        let prepared = match &k.matmul {
            Some(mm) if mm.a.gather.is_some() || mm.b.gather.is_some() => {
                Some(Gathers::prepare(k).map_err(|m| ClifError::Unsupported {
                    kernel: k.name.clone(),
                    message: m,
                })?)
            }
            _ => None,
        };
        let (k, gathers) = match prepared {
            Some((pk, g)) => (std::borrow::Cow::Owned(pk), Some(g)),
            None => (std::borrow::Cow::Borrowed(k), None),
        };
        let k = k.as_ref();
        let mut cg = Cg::new(b, k, offsets)?;
        cg.gathers = gathers;
        match &k.matmul {
            Some(mm) => cg.matmul(mm)?,
            None => cg.loops()?,
        }
        cg.b.ins().return_(&[]);
        cg.b.seal_all_blocks();
        cg.b.finalize(frontend_config());
    }
    let fl = settings::Flags::new(settings::builder());
    cranelift_codegen::verify_function(&func, &fl).map_err(|e| ClifError::Verify {
        kernel: k.name.clone(),
        message: e.to_string(),
    })?;
    Ok(func)
}

struct LoopCtx {
    header: Block,
    exit: Block,
    iv: Value,
}

struct Cg<'a, 'b> {
    b: FunctionBuilder<'b>,
    k: &'a Kernel,
    offsets: &'a Offsets,
    arena: Value,
    lo: Value,
    hi: Value,
    helpers: Value,
    vars: HashMap<Var, Value>,
    cache: HashMap<ExprId, Value>,
    /// Keys added to `cache` inside the loops being emitted (removed when a loop closes).
    journal: Vec<Vec<ExprId>>,
    /// The loop variable whose loop computes each node (`None`: the entry block).
    site: Vec<Option<Var>>,
    live: Vec<ExprId>,
    acc: Option<Value>,
    /// Vector values (f32x4, or i32x4 masks for bools) of the vector loop being emitted.
    vcache: HashMap<ExprId, Value>,
    /// The variable of the vector loop being emitted.
    vinner: Option<Var>,
    /// An implicit GEMM's operands as the packing loops read them.
    gathers: Option<Gathers>,
}

impl<'a, 'b> Cg<'a, 'b> {
    fn new(mut b: FunctionBuilder<'b>, k: &'a Kernel, offsets: &'a Offsets) -> Res<Cg<'a, 'b>> {
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let p = b.block_params(entry).to_vec();
        let live = k.live_nodes();
        let site = sites(k);
        Ok(Cg {
            b,
            k,
            offsets,
            arena: p[0],
            lo: p[1],
            hi: p[2],
            helpers: p[3],
            vars: HashMap::new(),
            cache: HashMap::new(),
            journal: Vec::new(),
            site,
            live,
            acc: None,
            vcache: HashMap::new(),
            vinner: None,
            gathers: None,
        })
    }

    fn unsupported(&self, m: impl Into<String>) -> ClifError {
        ClifError::Unsupported {
            kernel: self.k.name.clone(),
            message: m.into(),
        }
    }

    fn open_loop(&mut self, start: Value, end: Value) -> LoopCtx {
        let header = self.b.create_block();
        let body = self.b.create_block();
        let exit = self.b.create_block();
        self.b.append_block_param(header, I64);
        self.b.ins().jump(header, &[start.into()]);
        self.b.switch_to_block(header);
        let iv = self.b.block_params(header)[0];
        let c = self.b.ins().icmp(IntCC::SignedLessThan, iv, end);
        self.b.ins().brif(c, body, &[], exit, &[]);
        self.b.switch_to_block(body);
        self.journal.push(Vec::new());
        LoopCtx { header, exit, iv }
    }

    fn close_loop(&mut self, l: LoopCtx) {
        let next = self.b.ins().iadd_imm_s(l.iv, 1);
        self.close_loop_at(l, next);
    }

    /// Closes loop `l`, its next iteration at `next` (a step other than 1).
    fn close_loop_at(&mut self, l: LoopCtx, next: Value) {
        self.b.ins().jump(l.header, &[next.into()]);
        self.b.switch_to_block(l.exit);
        self.drop_scope();
    }

    /// Forgets the values cached in the innermost scope (a loop or an epilogue element):
    /// they do not dominate what is emitted after it.
    fn drop_scope(&mut self) {
        if let Some(keys) = self.journal.pop() {
            for key in keys {
                self.cache.remove(&key);
            }
        }
    }

    fn remember(&mut self, e: ExprId, v: Value) {
        self.cache.insert(e, v);
        if let Some(j) = self.journal.last_mut() {
            j.push(e);
        }
    }

    fn iconst(&mut self, v: i64) -> Value {
        self.b.ins().iconst(I64, v)
    }

    /// i64 `x / d` rounding toward zero, as `sdiv`, for a constant `d`: a multiply and
    /// shifts where `d` is positive ([`DivBy`]), since the runtime's JIT does not rewrite a
    /// constant division (`runtime/src/cpu.rs`).
    fn div_const(&mut self, x: Value, d: i64) -> Value {
        match DivBy::of(d) {
            DivBy::One => x,
            DivBy::Pow2(k) => {
                let sign = self.b.ins().sshr_imm_u(x, 63);
                let bias = self.b.ins().ushr_imm_u(sign, 64 - k as i64);
                let t = self.b.ins().iadd(x, bias);
                self.b.ins().sshr_imm_u(t, k as i64)
            }
            DivBy::Magic { m, add, s } => {
                let mc = self.iconst(m);
                let mut q = self.b.ins().smulhi(x, mc);
                if add {
                    q = self.b.ins().iadd(q, x);
                }
                if s > 0 {
                    q = self.b.ins().sshr_imm_u(q, s as i64);
                }
                let neg = self.b.ins().ushr_imm_u(q, 63);
                self.b.ins().iadd(q, neg)
            }
            DivBy::Plain => self.b.ins().sdiv_imm_s(x, d),
        }
    }

    /// i64 `x % d` with the sign of `x`, as `srem`, for a constant `d` (see
    /// [`Cg::div_const`]).
    fn rem_const(&mut self, x: Value, d: i64) -> Value {
        match DivBy::of(d) {
            DivBy::Plain => return self.b.ins().srem_imm_s(x, d),
            DivBy::One => return self.iconst(0),
            _ => {}
        }
        let q = self.div_const(x, d);
        let qd = self.b.ins().imul_imm_s(q, d);
        self.b.ins().isub(x, qd)
    }

    /// Emits every live node computed in the loop of `v` (or the entry block).
    fn emit_site(&mut self, v: Option<Var>) -> Res<()> {
        for e in Kernel::at_site(&self.live, &self.site, v) {
            self.emit(e)?;
        }
        Ok(())
    }

    fn loops(&mut self) -> Res<()> {
        self.emit_site(None)?;
        let plan = self.simd_plan();
        let domain = self.k.domain.clone();
        let mut open = Vec::new();
        if domain.is_empty() {
            let l = self.open_loop(self.lo, self.hi);
            open.push(l);
        }
        for (d, &ext) in domain.iter().enumerate() {
            let (mut start, end) = if d == 0 {
                (self.lo, self.hi)
            } else {
                let z = self.iconst(0);
                let e = self.iconst(ext as i64);
                (z, e)
            };
            if let Some(p) = plan.as_ref().filter(|p| p.inner == d as Var) {
                // Vectors of 4 while they fit; the scalar loop below takes the rest.
                start = self.vector_loop(p, start, end)?;
            }
            let l = self.open_loop(start, end);
            self.vars.insert(d as Var, l.iv);
            self.emit_site(Some(d as Var))?;
            open.push(l);
        }
        self.stores()?;
        while let Some(l) = open.pop() {
            self.close_loop(l);
        }
        Ok(())
    }

    /// Whether the innermost domain loop can run on f32x4 vectors, and what it then splats.
    ///
    /// It can when every store is a plain f32 store at an index of coefficient 1 in the
    /// innermost variable, and every value the stores need per iteration of that loop is
    /// vector arithmetic: f32 loads at indices of coefficient 1 (contiguous) or 0, inline
    /// f32 math, comparisons (lane masks), selects, bool/f32 casts, or values computed
    /// outside the loop. Helper calls, integer math on the loop variable other than affine
    /// indices, draws, reductions per element and other dtypes keep the scalar loop. A load
    /// from the bytes a store writes must read them at the store's index (lanes then see
    /// exactly what the scalar loop would).
    fn simd_plan(&self) -> Option<SimdPlan> {
        let k = self.k;
        let pool = &k.pool;
        if k.matmul.is_some() || k.stores.is_empty() {
            return None;
        }
        let inner = k.domain.len().checked_sub(1)? as Var;
        if (*k.domain.last()? as i64) < LANES {
            return None;
        }
        let mut stores = Vec::new();
        for s in &k.stores {
            if s.accumulate || s.dtype != DType::F32 || pool.ty(s.value) != VTy::F32 {
                return None;
            }
            let a = pool.affine(s.index)?;
            if a.coef(inner) != 1 {
                return None;
            }
            stores.push((self.offsets.get(s.buf)?, a));
        }
        let site = &self.site;
        let invariants =
            self.vector_values(inner, &stores, &|i| Some(*site.get(i)? == Some(inner)))?;
        Some(SimdPlan { inner, invariants })
    }

    /// Walks the stores' values of a vector loop over `inner` (`stores`: their buffers'
    /// offsets and affine indices); `per_lane(i)` says whether node `i` is computed per
    /// iteration. `None` unless every per-iteration node has a vector form: f32 loads at
    /// a coefficient of 0 or 1 in `inner` (one that reads bytes a store writes, at that
    /// store's index), the block's result (`E::Acc`), or an op of `vector_operands`.
    /// Otherwise the f32 and bool values computed outside the loop that it reads, splat
    /// once before it (ascending ids: deterministic).
    fn vector_values(
        &self,
        inner: Var,
        stores: &[(u64, crate::kernel::Affine)],
        per_lane: &dyn Fn(usize) -> Option<bool>,
    ) -> Option<Vec<ExprId>> {
        let pool = &self.k.pool;
        let mut seen = vec![false; pool.nodes.len()];
        let mut invariants = Vec::new();
        let mut stack: Vec<ExprId> = self.k.stores.iter().map(|s| s.value).collect();
        while let Some(e) = stack.pop() {
            let i = e.0 as usize;
            if std::mem::replace(seen.get_mut(i)?, true) {
                continue;
            }
            let ty = pool.ty(e);
            if !per_lane(i)? {
                if ty != VTy::F32 && ty != VTy::Bool {
                    return None;
                }
                invariants.push(e);
                continue;
            }
            match pool.get(e) {
                E::Acc => {}
                E::Load {
                    buf,
                    dtype: DType::F32,
                    index,
                } => {
                    let a = pool.affine(*index)?;
                    if !matches!(a.coef(inner), 0 | 1) {
                        return None;
                    }
                    let off = self.offsets.get(*buf)?;
                    if stores.iter().any(|(so, sa)| *so == off && *sa != a) {
                        return None;
                    }
                }
                _ => stack.extend(vector_operands(pool, e)?),
            }
        }
        invariants.sort_unstable();
        Some(invariants)
    }

    /// The vector loop of a Loop kernel over `[start, end)`: every store of the kernel on
    /// four lanes of the innermost variable (see [`Cg::vector_run`]).
    fn vector_loop(&mut self, p: &SimdPlan, start: Value, end: Value) -> Res<Value> {
        self.vector_run(p.inner, &p.invariants, start, end, &mut |cg, _| {
            // Every value before any store, as the scalar loop does.
            let mut vals = Vec::with_capacity(cg.k.stores.len());
            for s in &cg.k.stores {
                vals.push(cg.vemit(s.value)?);
            }
            for (s, v) in cg.k.stores.iter().zip(vals) {
                let idx = cg.emit(s.index)?;
                let addr = cg.address(s.buf, s.dtype, idx)?;
                cg.b.ins().store(vflags(), v, addr, 0);
            }
            Ok(())
        })
    }

    /// A loop of `inner` over `[start, end)` in steps of 4 while 4 lanes fit, `body`
    /// emitting each iteration's vector code (`inner` bound to its first lane); the
    /// `invariants` it reads are splat once before it. Returns the first index it did not
    /// run (where the scalar loop resumes).
    fn vector_run(
        &mut self,
        inner: Var,
        invariants: &[ExprId],
        start: Value,
        end: Value,
        body: &mut dyn FnMut(&mut Self, Value) -> Res<()>,
    ) -> Res<Value> {
        self.vcache.clear();
        // Scalar code first (a reduction among the invariants vectorises its own loop).
        let mut splats = Vec::with_capacity(invariants.len());
        for &e in invariants {
            let s = self.emit(e)?;
            let v = match self.k.pool.ty(e) {
                VTy::Bool => self.bool_mask(s),
                _ => self.b.ins().splat(F32X4, s),
            };
            splats.push((e, v));
        }
        self.vcache.clear();
        self.vcache.extend(splats);
        self.vinner = Some(inner);
        let header = self.b.create_block();
        let body_blk = self.b.create_block();
        let exit = self.b.create_block();
        self.b.append_block_param(header, I64);
        self.b.ins().jump(header, &[start.into()]);
        self.b.switch_to_block(header);
        let iv = self.b.block_params(header)[0];
        let next = self.b.ins().iadd_imm_s(iv, LANES);
        let fits = self.b.ins().icmp(IntCC::SignedLessThanOrEqual, next, end);
        self.b.ins().brif(fits, body_blk, &[], exit, &[]);
        self.b.switch_to_block(body_blk);
        self.journal.push(Vec::new());
        self.vars.insert(inner, iv);
        body(self, iv)?;
        self.b.ins().jump(header, &[next.into()]);
        self.b.switch_to_block(exit);
        self.drop_scope();
        self.vcache.clear();
        self.vinner = None;
        Ok(iv)
    }

    /// An i32x4 lane mask (all ones where true) from a scalar bool (i8 0 or 1).
    fn bool_mask(&mut self, b: Value) -> Value {
        let w = self.b.ins().uextend(I32, b);
        let m = self.b.ins().ineg(w);
        self.b.ins().splat(I32X4, m)
    }

    /// The vector value of `e` at lanes `v, v+1, v+2, v+3` of the innermost variable `v`
    /// (f32x4, or an i32x4 mask for bools); `simd_plan` accepted every node reached here.
    fn vemit(&mut self, e: ExprId) -> Res<Value> {
        if let Some(&v) = self.vcache.get(&e) {
            return Ok(v);
        }
        let inner = self
            .vinner
            .ok_or_else(|| self.unsupported("vector code outside a vector loop"))?;
        let node = self.k.pool.get(e).clone();
        let v = match node {
            E::Load { buf, dtype, index } if dtype == DType::F32 => {
                let coef = match self.k.pool.affine(index) {
                    Some(a) => Some(a.coef(inner)),
                    None => coef_of(&self.k.pool, index, inner),
                };
                let i = self.emit(index)?;
                let addr = self.address(buf, dtype, i)?;
                match coef {
                    Some(1) => self.b.ins().load(F32X4, vflags(), addr, 0),
                    Some(0) => {
                        let s = self.b.ins().load(F32, flags(), addr, 0);
                        self.b.ins().splat(F32X4, s)
                    }
                    _ => return Err(self.unsupported("vector load at a non-contiguous index")),
                }
            }
            E::Un(UnaryOp::Not, a) if self.k.pool.ty(e) == VTy::Bool => {
                let x = self.vemit(a)?;
                self.b.ins().bnot(x)
            }
            E::Un(op, a) => {
                let x = self.vemit(a)?;
                self.unary_f(F32X4, op, x)?
            }
            E::Bin(op, a, b) => {
                let x = self.vemit(a)?;
                let y = self.vemit(b)?;
                match (op, self.k.pool.ty(a)) {
                    (_, VTy::F32) => self.binary_f(F32X4, op, x, y)?,
                    (BinaryOp::And, VTy::Bool) => self.b.ins().band(x, y),
                    (BinaryOp::Or, VTy::Bool) => self.b.ins().bor(x, y),
                    _ => return Err(self.unsupported(format!("vector {}", op.name()))),
                }
            }
            E::Select(c, a, b) => {
                let m = self.vemit(c)?;
                let x = self.vemit(a)?;
                let y = self.vemit(b)?;
                self.fselect(F32X4, m, x, y)
            }
            E::Cast(VTy::Bool, a) => {
                let x = self.vemit(a)?;
                let z = self.fconst(F32X4, 0.0);
                self.b.ins().fcmp(FloatCC::NotEqual, x, z)
            }
            E::Cast(VTy::F32, a) => {
                let m = self.vemit(a)?;
                let one = self.fconst(F32X4, 1.0);
                let z = self.fconst(F32X4, 0.0);
                self.fselect(F32X4, m, one, z)
            }
            _ => return Err(self.unsupported("expression without a vector form")),
        };
        self.vcache.insert(e, v);
        Ok(v)
    }

    fn stores(&mut self) -> Res<()> {
        for s in self.k.stores.clone() {
            let idx = self.emit(s.index)?;
            let val = self.emit(s.value)?;
            let addr = self.address(s.buf, s.dtype, idx)?;
            if s.accumulate {
                let old = self.load_at(addr, s.dtype)?;
                let sum = match VTy::of(s.dtype) {
                    VTy::F32 => self.b.ins().fadd(old, val),
                    VTy::I32 => self.b.ins().iadd(old, val),
                    _ => return Err(self.unsupported("accumulating store of bool")),
                };
                self.store_at(addr, s.dtype, sum)?;
            } else {
                self.store_at(addr, s.dtype, val)?;
            }
        }
        Ok(())
    }

    fn address(&mut self, buf: NodeId, dtype: DType, idx: Value) -> Res<Value> {
        let off = self
            .offsets
            .get(buf)
            .ok_or(ClifError::NoOffset(buf.index()))?;
        let scaled = self.b.ins().imul_imm_s(idx, dtype.size_bytes() as i64);
        let base = self.b.ins().iadd_imm_s(self.arena, off as i64);
        Ok(self.b.ins().iadd(base, scaled))
    }

    fn helper(&mut self, slot: usize, args: &[Value], params: &[Type], ret: Type) -> Value {
        // The pointer is loaded at each call site: a value cached across loops could
        // fail to dominate its uses, and the load hits L1.
        let f = self
            .b
            .ins()
            .load(I64, flags(), self.helpers, (slot * 8) as i32);
        let mut sig = Signature::new(CallConv::SystemV);
        for &p in params {
            sig.params.push(AbiParam::new(p));
        }
        sig.returns.push(AbiParam::new(ret));
        let sr = self.b.import_signature(sig);
        let call = self.b.ins().call_indirect(sr, f, args);
        self.b.inst_results(call)[0]
    }

    fn load_at(&mut self, addr: Value, dtype: DType) -> Res<Value> {
        Ok(match dtype {
            DType::F32 => self.b.ins().load(F32, flags(), addr, 0),
            DType::I32 => self.b.ins().load(I32, flags(), addr, 0),
            DType::Bool => self.b.ins().load(I8, flags(), addr, 0),
            DType::BF16 => {
                // A bf16 is the top half of the f32 with the same bits: exact, no call.
                let bits = self.b.ins().uload16(I32, flags(), addr, 0);
                let wide = self.b.ins().ishl_imm_u(bits, 16);
                self.b.ins().bitcast(F32, MemFlagsData::new(), wide)
            }
            DType::F16 => {
                let bits = self.b.ins().uload16(I32, flags(), addr, 0);
                self.helper(slot::F16_TO_F32, &[bits], &[I32], F32)
            }
        })
    }

    /// The bf16 nearest to f32 `x` (ties to even; a NaN stays a quiet NaN), as the low 16
    /// bits of an i32: what the runtime's helper (`half::bf16::from_f32`) gives, without
    /// the call.
    fn f32_to_bf16_bits(&mut self, x: Value) -> Value {
        let bits = self.b.ins().bitcast(I32, MemFlagsData::new(), x);
        let hi = self.b.ins().ushr_imm_u(bits, 16);
        let lsb = self.b.ins().band_imm_s(hi, 1);
        let biased = self.b.ins().iadd_imm_s(bits, 0x7FFF);
        let rounded = self.b.ins().iadd(biased, lsb);
        let rounded = self.b.ins().ushr_imm_u(rounded, 16);
        let quiet = self.b.ins().bor_imm_s(hi, 0x40);
        let nan = self.b.ins().fcmp(FloatCC::Unordered, x, x);
        self.b.ins().select(nan, quiet, rounded)
    }

    fn store_at(&mut self, addr: Value, dtype: DType, v: Value) -> Res<()> {
        match dtype {
            DType::F32 | DType::I32 | DType::Bool => {
                self.b.ins().store(flags(), v, addr, 0);
            }
            DType::F16 => {
                let bits = self.helper(slot::F32_TO_F16, &[v], &[F32], I32);
                self.b.ins().istore16(flags(), bits, addr, 0);
            }
            DType::BF16 => {
                let bits = self.f32_to_bf16_bits(v);
                self.b.ins().istore16(flags(), bits, addr, 0);
            }
        }
        Ok(())
    }

    fn emit(&mut self, e: ExprId) -> Res<Value> {
        if let Some(&v) = self.cache.get(&e) {
            return Ok(v);
        }
        let node = self.k.pool.get(e).clone();
        let ty = self.k.pool.ty(e);
        let v = match node {
            E::Var(v) => *self
                .vars
                .get(&v)
                .ok_or_else(|| self.unsupported(format!("variable v{v} is not bound here")))?,
            E::Int(v) => self.iconst(v),
            E::F32(bits) => self.b.ins().f32const(f32::from_bits(bits)),
            E::I32(v) => self.b.ins().iconst(I32, v as i64),
            E::Bool(v) => self.b.ins().iconst(I8, v as i64),
            E::Acc => self
                .acc
                .ok_or_else(|| self.unsupported("accumulator outside a matmul"))?,
            E::Load { buf, dtype, index } => {
                let i = self.emit(index)?;
                let addr = self.address(buf, dtype, i)?;
                self.load_at(addr, dtype)?
            }
            E::Un(op, a) => {
                let x = self.emit(a)?;
                self.unary(op, self.k.pool.ty(a), x)?
            }
            E::Bin(op @ (BinaryOp::Div | BinaryOp::Rem), a, b)
                if self.k.pool.ty(a) == VTy::I64 && matches!(self.k.pool.get(b), E::Int(_)) =>
            {
                let x = self.emit(a)?;
                let E::Int(d) = *self.k.pool.get(b) else {
                    return Err(self.unsupported("a constant divisor"));
                };
                if op == BinaryOp::Div {
                    self.div_const(x, d)
                } else {
                    self.rem_const(x, d)
                }
            }
            E::Bin(op @ (BinaryOp::Div | BinaryOp::Rem), a, b)
                if self.k.pool.ty(a) == VTy::I32
                    && matches!(self.k.pool.get(b), E::I32(d) if *d > 0) =>
            {
                let x = self.emit(a)?;
                let E::I32(d) = *self.k.pool.get(b) else {
                    return Err(self.unsupported("a constant divisor"));
                };
                self.floor_divmod_const(op, x, d as i64)
            }
            E::Bin(op, a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.binary(op, self.k.pool.ty(a), x, y)?
            }
            E::IMin(a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.b.ins().smin(x, y)
            }
            E::IMax(a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.b.ins().smax(x, y)
            }
            E::Select(c, a, b) => {
                let cv = self.emit(c)?;
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.b.ins().select(cv, x, y)
            }
            E::Cast(to, a) => {
                let x = self.emit(a)?;
                self.cast(self.k.pool.ty(a), to, x)
            }
            E::Round(d, a) => {
                let x = self.emit(a)?;
                if d == DType::F16 {
                    let bits = self.helper(slot::F32_TO_F16, &[x], &[F32], I32);
                    self.helper(slot::F16_TO_F32, &[bits], &[I32], F32)
                } else {
                    let bits = self.f32_to_bf16_bits(x);
                    let wide = self.b.ins().ishl_imm_u(bits, 16);
                    self.b.ins().bitcast(F32, MemFlagsData::new(), wide)
                }
            }
            E::Uniform { seed, index } => {
                let i = self.emit(index)?;
                self.uniform(seed, i)
            }
            E::Reduce { op, vars, body } => self.reduce(e, op, &vars, body, ty)?,
            E::ArgMax { vars, body } => self.argmax(e, &vars, body)?,
        };
        self.remember(e, v);
        Ok(v)
    }

    /// Live nodes under `root` computed in the loop of `v`.
    fn emit_site_under(&mut self, root: ExprId, v: Var) -> Res<()> {
        let sub = reachable(&self.k.pool, &[root]);
        for e in sub {
            if self.site[e.0 as usize] == Some(v) {
                self.emit(e)?;
            }
        }
        Ok(())
    }

    fn reduction_loops(&mut self, vars: &[(Var, usize)], body: ExprId) -> Res<Vec<LoopCtx>> {
        let mut open = Vec::new();
        for &(v, ext) in vars {
            let z = self.iconst(0);
            let e = self.iconst(ext as i64);
            let l = self.open_loop(z, e);
            self.vars.insert(v, l.iv);
            self.emit_site_under(body, v)?;
            open.push(l);
        }
        Ok(open)
    }

    fn reduce(
        &mut self,
        _e: ExprId,
        op: Red,
        vars: &[(Var, usize)],
        body: ExprId,
        ty: VTy,
    ) -> Res<Value> {
        let t = cl_ty(ty);
        let acc = self.b.declare_var(t);
        let init = match (op, ty) {
            (Red::Sum, VTy::F32) => self.b.ins().f32const(0.0),
            (Red::Max, VTy::F32) => self.b.ins().f32const(f32::NEG_INFINITY),
            (Red::Min, VTy::F32) => self.b.ins().f32const(f32::INFINITY),
            (Red::Sum, _) => self.b.ins().iconst(t, 0),
            (Red::Max, VTy::I32) => self.b.ins().iconst(I32, i32::MIN as i64),
            (Red::Min, VTy::I32) => self.b.ins().iconst(I32, i32::MAX as i64),
            _ => return Err(self.unsupported(format!("{} over {}", op.name(), ty.name()))),
        };
        self.b.def_var(acc, init);
        if let Some(inv) = self.vector_reduction(vars, body, ty) {
            let (&(inner, ext), outer) = vars
                .split_last()
                .ok_or_else(|| self.unsupported("a reduction over no variables"))?;
            let open = self.reduction_loops(outer, body)?;
            // f32x4 partial results along `inner`, combined across lanes, then the last
            // `ext % 4` values one by one.
            let vacc = self.b.declare_var(F32X4);
            let vinit = self.b.ins().splat(F32X4, init);
            self.b.def_var(vacc, vinit);
            let z = self.iconst(0);
            let end = self.iconst(ext as i64);
            let start = self.vector_run(inner, &inv, z, end, &mut |cg, _| {
                let x = cg.vemit(body)?;
                let a = cg.b.use_var(vacc);
                let r = match op {
                    Red::Sum => cg.b.ins().fadd(a, x),
                    Red::Max => cg.b.ins().fmax(a, x),
                    Red::Min => cg.b.ins().fmin(a, x),
                };
                cg.b.def_var(vacc, r);
                Ok(())
            })?;
            let v = self.b.use_var(vacc);
            let lanes: Vec<Value> = (0..LANES as u8)
                .map(|i| self.b.ins().extractlane(v, i))
                .collect();
            let combine = |cg: &mut Self, x: Value, y: Value| match op {
                Red::Sum => cg.b.ins().fadd(x, y),
                Red::Max => cg.b.ins().fmax(x, y),
                Red::Min => cg.b.ins().fmin(x, y),
            };
            let l01 = combine(self, lanes[0], lanes[1]);
            let l23 = combine(self, lanes[2], lanes[3]);
            let h = combine(self, l01, l23);
            let a = self.b.use_var(acc);
            let a = combine(self, a, h);
            self.b.def_var(acc, a);
            let tail = self.open_loop(start, end);
            self.vars.insert(inner, tail.iv);
            self.emit_site_under(body, inner)?;
            let x = self.emit(body)?;
            let a = self.b.use_var(acc);
            let a = combine(self, a, x);
            self.b.def_var(acc, a);
            self.close_loop(tail);
            for l in open.into_iter().rev() {
                self.close_loop(l);
            }
            return Ok(self.b.use_var(acc));
        }
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let a = self.b.use_var(acc);
        let r = match (op, ty) {
            (Red::Sum, VTy::F32) => self.b.ins().fadd(a, x),
            (Red::Max, VTy::F32) => self.b.ins().fmax(a, x),
            (Red::Min, VTy::F32) => self.b.ins().fmin(a, x),
            (Red::Sum, _) => self.b.ins().iadd(a, x),
            (Red::Max, _) => self.b.ins().smax(a, x),
            (Red::Min, _) => self.b.ins().smin(a, x),
        };
        self.b.def_var(acc, r);
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(self.b.use_var(acc))
    }

    /// When an f32 reduction's innermost loop can run on f32x4 vectors (at least 8 values,
    /// a body with a vector form along it, not already inside a vector loop), the values
    /// its vector loop splats (`vector_invariants`).
    fn vector_reduction(
        &self,
        vars: &[(Var, usize)],
        body: ExprId,
        ty: VTy,
    ) -> Option<Vec<ExprId>> {
        let &(inner, ext) = vars.last()?;
        if ty != VTy::F32 || ext < 2 * LANES as usize || self.vinner.is_some() {
            return None;
        }
        self.vector_invariants(body, inner)
    }

    fn argmax(&mut self, _e: ExprId, vars: &[(Var, usize)], body: ExprId) -> Res<Value> {
        let ty = self.k.pool.ty(body);
        let t = cl_ty(ty);
        let best = self.b.declare_var(t);
        let besti = self.b.declare_var(I64);
        let count = self.b.declare_var(I64);
        let init = match ty {
            VTy::F32 => self.b.ins().f32const(f32::NEG_INFINITY),
            VTy::I32 => self.b.ins().iconst(I32, i32::MIN as i64),
            _ => return Err(self.unsupported("argmax over bool")),
        };
        self.b.def_var(best, init);
        let z = self.iconst(0);
        self.b.def_var(besti, z);
        self.b.def_var(count, z);
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let bv = self.b.use_var(best);
        let bi = self.b.use_var(besti);
        let c = self.b.use_var(count);
        let better = match ty {
            VTy::F32 => {
                let gt = self.b.ins().fcmp(FloatCC::GreaterThan, x, bv);
                let xn = self.b.ins().fcmp(FloatCC::Unordered, x, x);
                let bn = self.b.ins().fcmp(FloatCC::Ordered, bv, bv);
                let nan_wins = self.b.ins().band(xn, bn);
                let first = self.b.ins().icmp_imm_s(IntCC::Equal, c, 0);
                let a = self.b.ins().bor(gt, nan_wins);
                self.b.ins().bor(a, first)
            }
            _ => {
                let gt = self.b.ins().icmp(IntCC::SignedGreaterThan, x, bv);
                let first = self.b.ins().icmp_imm_s(IntCC::Equal, c, 0);
                self.b.ins().bor(gt, first)
            }
        };
        let nb = self.b.ins().select(better, x, bv);
        let ni = self.b.ins().select(better, c, bi);
        self.b.def_var(best, nb);
        self.b.def_var(besti, ni);
        let c1 = self.b.ins().iadd_imm_s(c, 1);
        self.b.def_var(count, c1);
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(self.b.use_var(besti))
    }

    fn uniform(&mut self, seed: u64, i: Value) -> Value {
        let s0 = crate::rng::splitmix64(seed ^ 0xD1B5_4A32_D192_ED03);
        let s = self.iconst(s0 as i64);
        let z = self.b.ins().iadd(s, i);
        let h = self.splitmix(z);
        let top = self.b.ins().ushr_imm_s(h, 40);
        let f = self.b.ins().fcvt_from_uint(F32, top);
        let scale = self.b.ins().f32const(1.0 / (1u64 << 24) as f32);
        self.b.ins().fmul(f, scale)
    }

    fn splitmix(&mut self, z: Value) -> Value {
        let z = self.b.ins().iadd_imm_s(z, 0x9E37_79B9_7F4A_7C15u64 as i64);
        let s = self.b.ins().ushr_imm_s(z, 30);
        let z = self.b.ins().bxor(z, s);
        let z = self.b.ins().imul_imm_s(z, 0xBF58_476D_1CE4_E5B9u64 as i64);
        let s = self.b.ins().ushr_imm_s(z, 27);
        let z = self.b.ins().bxor(z, s);
        let z = self.b.ins().imul_imm_s(z, 0x94D0_49BB_1331_11EBu64 as i64);
        let s = self.b.ins().ushr_imm_s(z, 31);
        self.b.ins().bxor(z, s)
    }

    /// The f32 constant `v` as a value of `ty` (`F32`, or `F32X4` splat).
    fn fconst(&mut self, ty: Type, v: f32) -> Value {
        let c = self.b.ins().f32const(v);
        if ty == F32X4 {
            self.b.ins().splat(F32X4, c)
        } else {
            c
        }
    }

    /// `cond ? a : b` on `ty`: a scalar `select` on an i8 bool, or for `F32X4` a
    /// `bitselect` on an i32x4 lane mask (all ones or all zeros per lane, as `fcmp` gives).
    fn fselect(&mut self, ty: Type, cond: Value, a: Value, b: Value) -> Value {
        if ty == F32X4 {
            let m = self.b.ins().bitcast(F32X4, MemFlagsData::new(), cond);
            self.b.ins().bitselect(m, a, b)
        } else {
            self.b.ins().select(cond, a, b)
        }
    }

    /// `max(x, lo)` for a non-NaN `lo`, NaN staying NaN, as `x < lo ? lo : x`: x64 lowers
    /// it to one `maxss`/`maxps` (`fmax` is a sequence that also orders zeros and NaNs,
    /// which a clamp to a constant does not need).
    fn clamp_lo(&mut self, ty: Type, x: Value, lo: Value) -> Value {
        let under = self.b.ins().fcmp(FloatCC::LessThan, x, lo);
        self.fselect(ty, under, lo, x)
    }

    /// `min(x, hi)` for a non-NaN `hi`, NaN staying NaN (`hi < x ? hi : x`: one `minss`/`minps`).
    fn clamp_hi(&mut self, ty: Type, x: Value, hi: Value) -> Value {
        let over = self.b.ins().fcmp(FloatCC::LessThan, hi, x);
        self.fselect(ty, over, hi, x)
    }

    /// `exp(x)` inline: Cody–Waite range reduction by ln 2 and a degree-7 polynomial,
    /// scaled by 2^k through the exponent bits (about 1 ulp; 0 below -87.3, inf above
    /// 88.7, NaN stays NaN). Inline code keeps exp-heavy kernels (softmax, sigmoid, GELU)
    /// free of calls. `ty` is `F32` or `F32X4` (the same operations per lane, so vector
    /// and scalar loops agree bit for bit).
    fn exp_inline(&mut self, ty: Type, x: Value) -> Value {
        self.exp_core(ty, x, true)
    }

    /// [`Cg::exp_inline`]; without `edges`, `x` below -86 gives e^-86 (4.4e-38) instead of
    /// 0 and above 88.72 gives 3.4e38 instead of inf, which saves two compares and two
    /// selects where the caller cannot tell: `1 + e` divides (sigmoid, SiLU, GELU) or
    /// `x` is already in range (tanh).
    fn exp_core(&mut self, ty: Type, x: Value, edges: bool) -> Value {
        let lo = self.fconst(ty, -86.0);
        let hi = self.fconst(ty, 88.72);
        let xc = self.clamp_lo(ty, x, lo);
        let xc = self.clamp_hi(ty, xc, hi);
        let log2e = self.fconst(ty, std::f32::consts::LOG2_E);
        let t = self.b.ins().fmul(xc, log2e);
        // k = round(t), ties to even, by adding and subtracting 1.5 * 2^23 (exact for
        // |t| < 2^22; here |t| <= 128): the low mantissa bits of the sum are k itself, which
        // gives 2^k below without a (saturating, branchy) float-to-int conversion. NaN stays
        // NaN through `r` and `p`.
        let magic = self.fconst(ty, 12_582_912.0);
        let j = self.b.ins().fadd(t, magic);
        let k = self.b.ins().fsub(j, magic);
        let c1 = self.fconst(ty, -0.693_359_4);
        let c2 = self.fconst(ty, 2.121_944_4e-4);
        let r = self.b.ins().fma(k, c1, xc);
        let r = self.b.ins().fma(k, c2, r);
        // 2 * (1 + r + r^2/2! + ... + r^7/7!), times 2^(k-1) below, so that k = 128 (x
        // near 88.7) stays a finite exponent. Estrin's scheme (pairs, then pairs of pairs)
        // on fused multiply-adds: 3 dependent steps after r^2 instead of Horner's 7, since
        // the chain's latency, not the operation count, bounds a pointwise loop.
        let c = |cg: &mut Self, v: f64| cg.fconst(ty, v as f32);
        let r2 = self.b.ins().fmul(r, r);
        let pair = |cg: &mut Self, hi: f64, lo: f64| {
            let h = c(cg, hi);
            let l = c(cg, lo);
            cg.b.ins().fma(h, r, l)
        };
        let p01 = pair(self, 2.0, 2.0);
        let p23 = pair(self, 2.0 / 6.0, 1.0);
        let p45 = pair(self, 2.0 / 120.0, 2.0 / 24.0);
        let p67 = pair(self, 2.0 / 5040.0, 2.0 / 720.0);
        let r4 = self.b.ins().fmul(r2, r2);
        let q0 = self.b.ins().fma(p23, r2, p01);
        let q1 = self.b.ins().fma(p67, r2, p45);
        let p = self.b.ins().fma(q1, r4, q0);
        // bits(j) = bits(1.5 * 2^23) + k, and bits(1.5 * 2^23) << 23 wraps to 0, so
        // (bits(j) + 126) << 23 is (k + 126) << 23: the exponent field of 2^(k-1).
        let bits = if ty == F32X4 {
            let ji = self.b.ins().bitcast(I32X4, MemFlagsData::new(), j);
            let b126 = self.b.ins().iconst(I32, 126);
            let b126 = self.b.ins().splat(I32X4, b126);
            let e = self.b.ins().iadd(ji, b126);
            let sh = self.b.ins().iconst(I32, 23);
            self.b.ins().ishl(e, sh)
        } else {
            let ji = self.b.ins().bitcast(I32, MemFlagsData::new(), j);
            let e = self.b.ins().iadd_imm_s(ji, 126);
            self.b.ins().ishl_imm_s(e, 23)
        };
        let scale = self.b.ins().bitcast(ty, MemFlagsData::new(), bits);
        let y = self.b.ins().fmul(p, scale);
        if !edges {
            return y;
        }
        let zero = self.fconst(ty, 0.0);
        let inf = self.fconst(ty, f32::INFINITY);
        let is_under = self.b.ins().fcmp(FloatCC::LessThan, x, lo);
        let y = self.fselect(ty, is_under, zero, y);
        let is_over = self.b.ins().fcmp(FloatCC::GreaterThan, x, hi);
        self.fselect(ty, is_over, inf, y)
    }

    /// GELU's shared start: `x^2`, `e = e^{-2u}` with `u = c (x + 0.044715 x^3)` (clamped
    /// below f32's overflow by [`Cg::exp_core`]), `1`, and `1 + e`.
    fn gelu_exp(&mut self, ty: Type, x: Value) -> (Value, Value, Value, Value) {
        let c = (2.0f64 / std::f64::consts::PI).sqrt();
        let x2 = self.b.ins().fmul(x, x);
        let k3 = self.fconst(ty, (-2.0 * c * 0.044715) as f32);
        let k1 = self.fconst(ty, (-2.0 * c) as f32);
        let w = self.b.ins().fma(x2, k3, k1);
        let v = self.b.ins().fmul(x, w);
        let e = self.exp_core(ty, v, false);
        let one = self.fconst(ty, 1.0);
        let d = self.b.ins().fadd(one, e);
        (x2, e, one, d)
    }

    /// `tanh(x)` inline: an odd Taylor polynomial below |x| = 0.3, `1 - 2 / (e^{2|x|} + 1)`
    /// with the sign restored above, ±1 beyond |x| = 9. `ty` as for [`Cg::exp_inline`].
    fn tanh_inline(&mut self, ty: Type, x: Value) -> Value {
        let a = self.b.ins().fabs(x);
        let x2 = self.b.ins().fmul(x, x);
        let coefs = [62.0 / 2835.0, -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0];
        let mut p = self.fconst(ty, coefs[0] as f32);
        for &c in &coefs[1..] {
            let m = self.b.ins().fmul(p, x2);
            let cc = self.fconst(ty, c as f32);
            p = self.b.ins().fadd(m, cc);
        }
        let x3 = self.b.ins().fmul(x2, x);
        let t = self.b.ins().fmul(x3, p);
        let small = self.b.ins().fadd(x, t);
        let nine = self.fconst(ty, 9.0);
        let ac = self.clamp_hi(ty, a, nine);
        let two_a = self.b.ins().fadd(ac, ac);
        let e = self.exp_core(ty, two_a, false);
        let one = self.fconst(ty, 1.0);
        let two = self.fconst(ty, 2.0);
        let d = self.b.ins().fadd(e, one);
        let q = self.b.ins().fdiv(two, d);
        let big = self.b.ins().fsub(one, q);
        let big = if ty == F32X4 {
            // copysign: the sign bit of `x`, the other bits of `big`.
            let sign = self.fconst(ty, -0.0);
            self.b.ins().bitselect(sign, x, big)
        } else {
            self.b.ins().fcopysign(big, x)
        };
        let thr = self.fconst(ty, 0.3);
        let is_small = self.b.ins().fcmp(FloatCC::LessThan, a, thr);
        self.fselect(ty, is_small, small, big)
    }

    fn call1(&mut self, slot: usize, x: Value) -> Value {
        self.helper(slot, &[x], &[F32], F32)
    }

    fn unary(&mut self, op: UnaryOp, ty: VTy, x: Value) -> Res<Value> {
        Ok(match ty {
            VTy::F32 => self.unary_f(F32, op, x)?,
            VTy::I32 | VTy::I64 => match op {
                UnaryOp::Neg => self.b.ins().ineg(x),
                UnaryOp::Abs => self.b.ins().iabs(x),
                UnaryOp::Relu => {
                    let z = self.b.ins().iconst(cl_ty(ty), 0);
                    self.b.ins().smax(x, z)
                }
                _ => return Err(self.unsupported(format!("{} of an integer", op.name()))),
            },
            VTy::Bool => match op {
                UnaryOp::Not => self.b.ins().bxor_imm_s(x, 1),
                _ => return Err(self.unsupported(format!("{} of a bool", op.name()))),
            },
        })
    }

    /// A unary op on f32 values of `ty` (`F32`, or `F32X4`: no helper calls there).
    fn unary_f(&mut self, ty: Type, op: UnaryOp, x: Value) -> Res<Value> {
        if ty == F32X4 && !simd_unary(op) {
            return Err(self.unsupported(format!("{} has no vector form", op.name())));
        }
        Ok(match op {
            UnaryOp::Neg => self.b.ins().fneg(x),
            UnaryOp::Abs => self.b.ins().fabs(x),
            UnaryOp::Exp => self.exp_inline(ty, x),
            UnaryOp::Log => self.call1(slot::LOG, x),
            UnaryOp::Sqrt => self.b.ins().sqrt(x),
            UnaryOp::Rsqrt => {
                let s = self.b.ins().sqrt(x);
                let one = self.fconst(ty, 1.0);
                self.b.ins().fdiv(one, s)
            }
            UnaryOp::Recip => {
                let one = self.fconst(ty, 1.0);
                self.b.ins().fdiv(one, x)
            }
            UnaryOp::Tanh => self.tanh_inline(ty, x),
            UnaryOp::Sigmoid | UnaryOp::Silu => {
                let n = self.b.ins().fneg(x);
                let e = self.exp_core(ty, n, false);
                let one = self.fconst(ty, 1.0);
                let d = self.b.ins().fadd(one, e);
                let num = if op == UnaryOp::Silu { x } else { one };
                self.b.ins().fdiv(num, d)
            }
            UnaryOp::Relu => {
                let z = self.fconst(ty, 0.0);
                let c = self.b.ins().fcmp(FloatCC::GreaterThan, x, z);
                self.fselect(ty, c, x, z)
            }
            UnaryOp::Gelu => {
                // 0.5 x (1 + tanh(u)) = x / (1 + e^{-2u}), u = c (x + 0.044715 x^3): one
                // exp and one division, no cancellation for negative x.
                let (_, _, _, d) = self.gelu_exp(ty, x);
                self.b.ins().fdiv(x, d)
            }
            UnaryOp::GeluGrad => {
                // With s = 1 / (1 + e), e = e^{-2u} (so gelu(x) = x s):
                // gelu'(x) = s (1 + 2 x (e s) u'), u' = c (1 + 3 a x^2), at x clamped to
                // [-9, 9] (NaN stays NaN): gelu' is 1 in f32 above 9 and below 1e-26 in
                // size under -9, where `x u'` would otherwise outgrow the clamped `s`.
                let c = (2.0f64 / std::f64::consts::PI).sqrt();
                let lo = self.fconst(ty, -9.0);
                let hi = self.fconst(ty, 9.0);
                let x = self.clamp_lo(ty, x, lo);
                let x = self.clamp_hi(ty, x, hi);
                let (x2, e, one, d) = self.gelu_exp(ty, x);
                let s = self.b.ins().fdiv(one, d);
                let du3 = self.fconst(ty, (3.0 * c * 0.044715) as f32);
                let duc = self.fconst(ty, c as f32);
                let du = self.b.ins().fma(x2, du3, duc);
                let es = self.b.ins().fmul(e, s);
                let q = self.b.ins().fmul(x, es);
                let q = self.b.ins().fmul(q, du);
                let two = self.fconst(ty, 2.0);
                let q = self.b.ins().fma(q, two, one);
                self.b.ins().fmul(s, q)
            }
            UnaryOp::Sin => self.call1(slot::SIN, x),
            UnaryOp::Cos => self.call1(slot::COS, x),
            UnaryOp::Erf => self.call1(slot::ERF, x),
            UnaryOp::Not => return Err(self.unsupported("`not` of a float")),
        })
    }

    fn binary(&mut self, op: BinaryOp, ty: VTy, x: Value, y: Value) -> Res<Value> {
        use BinaryOp as B;
        let icc = |op: BinaryOp| match op {
            B::Eq => IntCC::Equal,
            B::Ne => IntCC::NotEqual,
            B::Lt => IntCC::SignedLessThan,
            B::Le => IntCC::SignedLessThanOrEqual,
            B::Gt => IntCC::SignedGreaterThan,
            _ => IntCC::SignedGreaterThanOrEqual,
        };
        Ok(match ty {
            VTy::F32 => self.binary_f(F32, op, x, y)?,
            VTy::I32 => match op {
                B::Add => self.b.ins().iadd(x, y),
                B::Sub => self.b.ins().isub(x, y),
                B::Mul => self.b.ins().imul(x, y),
                B::Div | B::Rem => self.floor_divmod(op, x, y),
                B::Pow => {
                    let fx = self.b.ins().fcvt_from_sint(F32, x);
                    let fy = self.b.ins().fcvt_from_sint(F32, y);
                    let p = self.helper(slot::POW, &[fx, fy], &[F32, F32], F32);
                    self.b.ins().fcvt_to_sint_sat(I32, p)
                }
                B::Maximum => self.b.ins().smax(x, y),
                B::Minimum => self.b.ins().smin(x, y),
                B::And | B::Or => return Err(self.unsupported("logical op on i32")),
                c => self.b.ins().icmp(icc(c), x, y),
            },
            VTy::I64 => match op {
                B::Add => self.b.ins().iadd(x, y),
                B::Sub => self.b.ins().isub(x, y),
                B::Mul => self.b.ins().imul(x, y),
                B::Div => self.b.ins().sdiv(x, y),
                B::Rem => self.b.ins().srem(x, y),
                B::Maximum => self.b.ins().smax(x, y),
                B::Minimum => self.b.ins().smin(x, y),
                B::Pow | B::And | B::Or => return Err(self.unsupported("op on indices")),
                c => self.b.ins().icmp(icc(c), x, y),
            },
            VTy::Bool => match op {
                B::And => self.b.ins().band(x, y),
                B::Or => self.b.ins().bor(x, y),
                B::Eq => self.b.ins().icmp(IntCC::Equal, x, y),
                B::Ne => self.b.ins().icmp(IntCC::NotEqual, x, y),
                _ => return Err(self.unsupported(format!("{} of bools", op.name()))),
            },
        })
    }

    /// A binary op on f32 values of `ty` (`F32`, or `F32X4`: comparisons then give i32x4
    /// lane masks, and `pow` has no vector form).
    fn binary_f(&mut self, ty: Type, op: BinaryOp, x: Value, y: Value) -> Res<Value> {
        use BinaryOp as B;
        if ty == F32X4 && !simd_binary(op) {
            return Err(self.unsupported(format!("{} has no vector form", op.name())));
        }
        let fcc = |op: BinaryOp| match op {
            B::Eq => FloatCC::Equal,
            B::Ne => FloatCC::NotEqual,
            B::Lt => FloatCC::LessThan,
            B::Le => FloatCC::LessThanOrEqual,
            B::Gt => FloatCC::GreaterThan,
            _ => FloatCC::GreaterThanOrEqual,
        };
        Ok(match op {
            B::Add => self.b.ins().fadd(x, y),
            B::Sub => self.b.ins().fsub(x, y),
            B::Mul => self.b.ins().fmul(x, y),
            B::Div => self.b.ins().fdiv(x, y),
            B::Rem => {
                let q = self.b.ins().fdiv(x, y);
                let f = self.b.ins().floor(q);
                let m = self.b.ins().fmul(y, f);
                self.b.ins().fsub(x, m)
            }
            B::Pow => self.helper(slot::POW, &[x, y], &[F32, F32], F32),
            B::Maximum => self.b.ins().fmax(x, y),
            B::Minimum => self.b.ins().fmin(x, y),
            B::And | B::Or => return Err(self.unsupported("logical op on floats")),
            c => self.b.ins().fcmp(fcc(c), x, y),
        })
    }

    /// i32 `/` and `%` rounding toward negative infinity by a constant `d > 0`, as
    /// [`Cg::floor_divmod`] computes them, with the truncating quotient a multiply
    /// ([`Cg::div_const`]) instead of two divisions.
    fn floor_divmod_const(&mut self, op: BinaryOp, x: Value, d: i64) -> Value {
        let x64 = self.b.ins().sextend(I64, x);
        let q = self.div_const(x64, d);
        let qd = self.b.ins().imul_imm_s(q, d);
        let r = self.b.ins().isub(x64, qd);
        // With d > 0, a negative remainder moves the quotient down one and the remainder
        // up by d.
        let neg = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, r, 0);
        let res = if op == BinaryOp::Div {
            let qm = self.b.ins().iadd_imm_s(q, -1);
            self.b.ins().select(neg, qm, q)
        } else {
            let rp = self.b.ins().iadd_imm_s(r, d);
            self.b.ins().select(neg, rp, r)
        };
        self.b.ins().ireduce(I32, res)
    }

    /// i32 `/` and `%` rounding toward negative infinity; a zero divisor gives 0 (and
    /// `i32::MIN / -1` wraps), so the kernel never traps.
    fn floor_divmod(&mut self, op: BinaryOp, x: Value, y: Value) -> Value {
        let x64 = self.b.ins().sextend(I64, x);
        let y64 = self.b.ins().sextend(I64, y);
        let zero = self.iconst(0);
        let one = self.iconst(1);
        let yz = self.b.ins().icmp(IntCC::Equal, y64, zero);
        let ys = self.b.ins().select(yz, one, y64);
        let q = self.b.ins().sdiv(x64, ys);
        let r = self.b.ins().srem(x64, ys);
        // Adjust when the remainder is non-zero and its sign differs from the divisor's.
        let rnz = self.b.ins().icmp(IntCC::NotEqual, r, zero);
        let rneg = self.b.ins().icmp(IntCC::SignedLessThan, r, zero);
        let yneg = self.b.ins().icmp(IntCC::SignedLessThan, ys, zero);
        let differ = self.b.ins().bxor(rneg, yneg);
        let adj = self.b.ins().band(rnz, differ);
        let res = if op == BinaryOp::Div {
            let qm = self.b.ins().iadd_imm_s(q, -1);
            self.b.ins().select(adj, qm, q)
        } else {
            let rp = self.b.ins().iadd(r, ys);
            self.b.ins().select(adj, rp, r)
        };
        let res = self.b.ins().select(yz, zero, res);
        self.b.ins().ireduce(I32, res)
    }

    fn cast(&mut self, from: VTy, to: VTy, x: Value) -> Value {
        match (from, to) {
            (a, b) if a == b => x,
            (VTy::F32, VTy::Bool) => {
                let z = self.b.ins().f32const(0.0);
                self.b.ins().fcmp(FloatCC::NotEqual, x, z)
            }
            (VTy::F32, t) => self.b.ins().fcvt_to_sint_sat(cl_ty(t), x),
            (VTy::I32, VTy::I64) => self.b.ins().sextend(I64, x),
            (VTy::I64, VTy::I32) => self.b.ins().ireduce(I32, x),
            (VTy::I32 | VTy::I64, VTy::F32) => self.b.ins().fcvt_from_sint(F32, x),
            (VTy::I32 | VTy::I64, VTy::Bool) => self.b.ins().icmp_imm_s(IntCC::NotEqual, x, 0),
            (VTy::Bool, VTy::F32) => {
                let w = self.b.ins().uextend(I32, x);
                self.b.ins().fcvt_from_uint(F32, w)
            }
            (VTy::Bool, t) => self.b.ins().uextend(cl_ty(t), x),
            // (a, b) with a == b handled above.
            (_, _) => x,
        }
    }

    // ---- matmul ----

    fn matmul(&mut self, mm: &Matmul) -> Res<()> {
        if let Some(g) = self.gathers.take() {
            return self.gather_matmul(mm, &g);
        }
        if !mm.is_plain() {
            return Err(self.unsupported(
                "implicit-GEMM operands without a packing plan (`Gathers::prepare`)",
            ));
        }
        let strides = [mm.a.rs, mm.a.cs, mm.b.rs, mm.b.cs];
        if mm.a.dtype == DType::F32 && mm.b.dtype == DType::F32 && strides.iter().all(|&s| s >= 0) {
            return self.helper_matmul(mm);
        }
        // f16/bf16 operands (mixed precision), or a stride the helper refuses (none that
        // lowering makes today): a dot product per element, converted on load.
        const MR: i64 = 4;
        let m = mm.m as i64;
        let mtiles = (m + MR - 1) / MR;
        let nb = mm.batch.len();
        let xl = self.open_loop(self.lo, self.hi);
        let (i0, abase, bbase) = self.mm_tile(mm, xl.iv, mtiles, MR)?;
        let tile_end = self.b.ins().iadd_imm_s(i0, MR);
        let mconst = self.iconst(m);
        let iend = self.b.ins().smin(tile_end, mconst);
        let jstart = self.iconst(0);
        self.scalar_block(mm, abase, bbase, i0, iend, jstart, nb)?;
        self.close_loop(xl);
        Ok(())
    }

    /// An f32 product through the runtime's `sgemm` helper (`runtime/ARTIFACT.md`): this
    /// call's row tiles of 4 (`[lo, hi)`) go in blocks of at most `SGEMM_BLOCK_M` rows of
    /// one batch index, aligned to multiples of it, and each block's columns in blocks of
    /// `SGEMM_BLOCK_N`; the helper computes a block into its thread's scratch and the
    /// epilogue reads it element by element. A block starts at the first tile of the call
    /// or of an aligned group. An element's sum depends only on `k` (the helper's slices
    /// of it), not on the blocks, so any number of threads gives the same results.
    fn helper_matmul(&mut self, mm: &Matmul) -> Res<()> {
        use tcc_runtime::cpu::{SGEMM_BLOCK_M, SGEMM_BLOCK_N};
        const MR: i64 = 4;
        let bm = SGEMM_BLOCK_M as i64 / MR;
        let bn = SGEMM_BLOCK_N as i64;
        let (m, n, kk) = (mm.m as i64, mm.n as i64, mm.k as i64);
        let mtiles = (m + MR - 1) / MR;
        let a_at = self
            .offsets
            .get(mm.a.buf)
            .ok_or(ClifError::NoOffset(mm.a.buf.index()))? as i64;
        let b_at = self
            .offsets
            .get(mm.b.buf)
            .ok_or(ClifError::NoOffset(mm.b.buf.index()))? as i64;
        let xl = self.open_loop(self.lo, self.hi);
        let x = xl.iv;
        let it = self.rem_const(x, mtiles.max(1));
        let in_group = self.rem_const(it, bm);
        let first = self.b.ins().icmp(IntCC::Equal, x, self.lo);
        let aligned = self.b.ins().icmp_imm_s(IntCC::Equal, in_group, 0);
        let start = self.b.ins().bor(first, aligned);
        let work = self.b.create_block();
        let cont = self.b.create_block();
        self.b.ins().brif(start, work, &[], cont, &[]);
        self.b.switch_to_block(work);
        // Tiles of this block: to the end of the call, of the batch index or of the group.
        let to_hi = self.b.ins().isub(self.hi, x);
        let mt = self.iconst(mtiles);
        let to_batch = self.b.ins().isub(mt, it);
        let bmc = self.iconst(bm);
        let to_group = self.b.ins().isub(bmc, in_group);
        let cnt = self.b.ins().smin(to_hi, to_batch);
        let cnt = self.b.ins().smin(cnt, to_group);
        let (i0, abase, bbase) = self.mm_tile(mm, x, mtiles, MR)?;
        let rows = self.b.ins().imul_imm_s(cnt, MR);
        let mc = self.iconst(m);
        let left = self.b.ins().isub(mc, i0);
        let mh = self.b.ins().smin(rows, left);
        let arow = self.b.ins().imul_imm_s(i0, mm.a.rs);
        let ai = self.b.ins().iadd(abase, arow);
        let a_bytes = self.b.ins().imul_imm_s(ai, 4);
        let a_off = self.b.ins().iadd_imm_s(a_bytes, a_at);
        let z = self.iconst(0);
        let ncb = self.iconst((n + bn - 1) / bn);
        let jl = self.open_loop(z, ncb);
        let j0 = self.b.ins().imul_imm_s(jl.iv, bn);
        let nc = self.iconst(n);
        let left = self.b.ins().isub(nc, j0);
        let bnc = self.iconst(bn);
        let nh = self.b.ins().smin(bnc, left);
        let bcol = self.b.ins().imul_imm_s(j0, mm.b.cs);
        let bi = self.b.ins().iadd(bbase, bcol);
        let b_bytes = self.b.ins().imul_imm_s(bi, 4);
        let b_off = self.b.ins().iadd_imm_s(b_bytes, b_at);
        let kc = self.iconst(kk);
        let strides = [mm.a.rs, mm.a.cs, mm.b.rs, mm.b.cs].map(|s| self.iconst(s));
        let args = [
            self.helpers,
            mh,
            nh,
            kc,
            a_off,
            strides[0],
            strides[1],
            b_off,
            strides[2],
            strides[3],
        ];
        let c = self.helper(slot::SGEMM, &args, &[I64; 10], I64);
        self.block_epilogue(mm, c, [i0, mh], [j0, nh])?;
        self.close_loop(jl);
        self.b.ins().jump(cont, &[]);
        self.b.switch_to_block(cont);
        self.close_loop(xl);
        Ok(())
    }

    /// Decodes outer index `x` into (batch index, row tile): sets the batch variables and
    /// returns the first row and the operands' batch bases.
    fn mm_tile(
        &mut self,
        mm: &Matmul,
        x: Value,
        mtiles: i64,
        mr: i64,
    ) -> Res<(Value, Value, Value)> {
        let nb = mm.batch.len();
        let bflat = self.div_const(x, mtiles.max(1));
        let it = self.rem_const(x, mtiles.max(1));
        let i0 = self.b.ins().imul_imm_s(it, mr);
        let mut bidx = vec![bflat; nb];
        let mut rest = bflat;
        for d in (0..nb).rev() {
            let e = mm.batch[d] as i64;
            bidx[d] = self.rem_const(rest, e.max(1));
            rest = self.div_const(rest, e.max(1));
        }
        for (d, &v) in bidx.iter().enumerate() {
            self.vars.insert(d as Var, v);
        }
        let abase = self.operand_base(&mm.a, &bidx)?;
        let bbase = self.operand_base(&mm.b, &bidx)?;
        Ok((i0, abase, bbase))
    }

    fn elem_addr(&mut self, buf: NodeId, idx: Value, size: i64) -> Res<Value> {
        let off = self
            .offsets
            .get(buf)
            .ok_or(ClifError::NoOffset(buf.index()))?;
        let s = self.b.ins().imul_imm_s(idx, size);
        let base = self.b.ins().iadd_imm_s(self.arena, off as i64);
        Ok(self.b.ins().iadd(base, s))
    }

    fn operand_base(&mut self, o: &crate::kernel::Operand, bidx: &[Value]) -> Res<Value> {
        let mut acc = self.iconst(o.base);
        for (d, &st) in o.batch_strides.iter().enumerate() {
            if st != 0 {
                let t = self.b.ins().imul_imm_s(bidx[d], st);
                acc = self.b.ins().iadd(acc, t);
            }
        }
        Ok(acc)
    }

    /// Rows `[i0, iend)`, columns `[jstart, n)`, one dot product each, then the epilogue.
    #[allow(clippy::too_many_arguments)]
    fn scalar_block(
        &mut self,
        mm: &Matmul,
        abase: Value,
        bbase: Value,
        i0: Value,
        iend: Value,
        jstart: Value,
        nb: usize,
    ) -> Res<()> {
        let il = self.open_loop(i0, iend);
        let nend = self.iconst(mm.n as i64);
        let jl = self.open_loop(jstart, nend);
        let acc = self.b.declare_var(F32);
        let zero = self.b.ins().f32const(0.0);
        self.b.def_var(acc, zero);
        let arow = self.b.ins().imul_imm_s(il.iv, mm.a.rs);
        let arow = self.b.ins().iadd(abase, arow);
        let bcol = self.b.ins().imul_imm_s(jl.iv, mm.b.cs);
        let bcol = self.b.ins().iadd(bbase, bcol);
        let z = self.iconst(0);
        let kend = self.iconst(mm.k as i64);
        let kl = self.open_loop(z, kend);
        let ak = self.b.ins().imul_imm_s(kl.iv, mm.a.cs);
        let ai = self.b.ins().iadd(arow, ak);
        let bk = self.b.ins().imul_imm_s(kl.iv, mm.b.rs);
        let bi = self.b.ins().iadd(bcol, bk);
        let aaddr = self.elem_addr(mm.a.buf, ai, mm.a.dtype.size_bytes() as i64)?;
        let baddr = self.elem_addr(mm.b.buf, bi, mm.b.dtype.size_bytes() as i64)?;
        let a = self.load_at(aaddr, mm.a.dtype)?;
        let bv = self.load_at(baddr, mm.b.dtype)?;
        let p = self.b.ins().fmul(a, bv);
        let old = self.b.use_var(acc);
        let s = self.b.ins().fadd(old, p);
        self.b.def_var(acc, s);
        self.close_loop(kl);
        let v = self.b.use_var(acc);
        self.epilogue(nb, il.iv, jl.iv, v)?;
        self.close_loop(jl);
        self.close_loop(il);
        Ok(())
    }

    /// The stores at domain point `(batch.., i, j)` with the accumulator `acc`; everything
    /// computed here is dropped from the cache afterwards.
    fn epilogue(&mut self, nb: usize, i: Value, j: Value, acc: Value) -> Res<()> {
        self.vars.insert(nb as Var, i);
        self.vars.insert(nb as Var + 1, j);
        self.acc = Some(acc);
        self.journal.push(Vec::new());
        let r = self.stores();
        self.drop_scope();
        self.acc = None;
        r
    }
}

/// A range of a call's rows or columns, `[lo, hi)`, in blocks of `size`
/// (`Cg::gather_matmul`).
struct Span {
    lo: Value,
    hi: Value,
    size: i64,
}

/// How an implicit GEMM's `k` is gathered: runs of `run` steps, `chunk_k` steps a chunk.
struct GatherShape {
    run: i64,
    chunk_k: i64,
    /// Where A (B) is gathered k-major (`Across`): the rows (columns) of a block, which is
    /// then the stride of its steps.
    a_cap: Option<i64>,
    b_cap: Option<i64>,
}

/// One gathered operand of an implicit GEMM as the packing loops read it: `value` over
/// `side` (A's row or B's column) and `k = t * run + u` (`t` the run, `u` the position in
/// it), with the free variables of every node it reaches (pool order).
struct PackedOperand {
    value: ExprId,
    side: Var,
    t: Var,
    u: Var,
    nodes: Vec<(ExprId, BTreeSet<Var>)>,
    /// The same value with the side split as well, for gathering it step by step (where
    /// it is contiguous along its side, not along `k`); `None` for an operand whose value
    /// is contiguous along `k` (`kernel::Gather::k_fast`).
    across: Option<Across>,
}

/// An operand's value over `k = t * run + u` and its side `s = so * inner + si` (`si` the
/// position along the side's innermost axis, of extent `inner`): gathered k-major, each
/// step's sides contiguous, on vectors along `si` (`Cg::gather_across`).
struct Across {
    value: ExprId,
    so: Var,
    si: Var,
    inner: i64,
    nodes: Vec<(ExprId, BTreeSet<Var>)>,
}

/// Both operands of an implicit GEMM, prepared for the packing loops
/// (`Cg::gather_matmul`).
struct Gathers {
    a: PackedOperand,
    b: PackedOperand,
}

impl Gathers {
    /// A copy of kernel `k` whose pool also holds each gathered operand's value with `k`
    /// replaced by `t * run + u` and the index arithmetic simplified again: a window's
    /// `(tap, channel)` or a pixel's `(row, column)` read straight from `t` and `u`, so a
    /// run of `u` is a contiguous load where the layout allows.
    fn prepare(k: &Kernel) -> Result<(Kernel, Gathers), String> {
        let mm = k.matmul.as_ref().ok_or("no matmul")?;
        let (Some(ga), Some(gb)) = (&mm.a.gather, &mm.b.gather) else {
            return Err("an implicit GEMM with one strided operand".into());
        };
        let run = ga.k_inner;
        if run == 0 || gb.k_inner != run || mm.k % run != 0 || !mm.batch.is_empty() {
            return Err(format!(
                "implicit GEMM operands split k ({}) in runs of {} and {}",
                mm.k, ga.k_inner, gb.k_inner
            ));
        }
        let mut k2 = k.clone();
        let pool = &mut k2.pool;
        let (t, u) = (pool.fresh_var(), pool.fresh_var());
        let ext: HashMap<Var, usize> = [(ga.row, mm.m), (gb.col, mm.n), (t, mm.k / run), (u, run)]
            .into_iter()
            .collect();
        let extf = |v: Var| ext.get(&v).copied();
        let tv = pool.var(t);
        let tv = pool.imul_c(tv, run as i64);
        let uv = pool.var(u);
        let with = pool.iadd(tv, uv);
        let va = pool.substitute_index(ga.value, ga.col, with, &extf);
        let vb = pool.substitute_index(gb.value, gb.row, with, &extf);
        // The side split at its innermost axis, for operands not contiguous along `k`.
        let mut split = |value: ExprId, side: Var, extent: usize, dims: &[usize], fast: bool| {
            let inner = *dims.last()?;
            if fast || inner < LANES as usize || !extent.is_multiple_of(inner) {
                return None;
            }
            let (so, si) = (pool.fresh_var(), pool.fresh_var());
            let mut ext2 = ext.clone();
            ext2.insert(so, extent / inner);
            ext2.insert(si, inner);
            let sov = pool.var(so);
            let sov = pool.imul_c(sov, inner as i64);
            let siv = pool.var(si);
            let with = pool.iadd(sov, siv);
            let value = pool.substitute_index(value, side, with, &|v| ext2.get(&v).copied());
            Some((value, so, si, inner as i64))
        };
        let sa = split(va, ga.row, mm.m, &mm.rows, ga.k_fast);
        let sb = split(vb, gb.col, mm.n, &mm.cols, gb.k_fast);
        let free = free_vars(pool);
        let nodes = |root: ExprId| {
            reachable(pool, &[root])
                .into_iter()
                .map(|e| (e, free[e.0 as usize].clone()))
                .collect::<Vec<_>>()
        };
        let across = |split: Option<(ExprId, Var, Var, i64)>| {
            split.map(|(value, so, si, inner)| Across {
                value,
                so,
                si,
                inner,
                nodes: nodes(value),
            })
        };
        let a = PackedOperand {
            value: va,
            side: ga.row,
            t,
            u,
            nodes: nodes(va),
            across: across(sa),
        };
        let b = PackedOperand {
            value: vb,
            side: gb.col,
            t,
            u,
            nodes: nodes(vb),
            across: across(sb),
        };
        Ok((k2, Gathers { a, b }))
    }
}

/// The operands of `e` when it has a vector form in `Cg::vemit` whatever its operands read:
/// f32 unary and binary ops with SIMD forms, bool `!`, `&&` and `||`, f32 selects on a
/// bool, casts between bool and f32. `None`: no such form (loads are judged by the caller).
fn vector_operands(pool: &ExprPool, e: ExprId) -> Option<Vec<ExprId>> {
    let ty = pool.ty(e);
    Some(match pool.get(e) {
        E::Un(op, a) if ty == VTy::F32 && simd_unary(*op) => vec![*a],
        E::Un(UnaryOp::Not, a) if ty == VTy::Bool => vec![*a],
        E::Bin(op, a, b)
            if pool.ty(*a) == VTy::F32 && simd_binary(*op)
                || ty == VTy::Bool
                    && pool.ty(*a) == VTy::Bool
                    && matches!(op, BinaryOp::And | BinaryOp::Or) =>
        {
            vec![*a, *b]
        }
        E::Select(c, a, b) if ty == VTy::F32 && pool.ty(*c) == VTy::Bool => vec![*c, *a, *b],
        E::Cast(to, a)
            if matches!(
                (pool.ty(*a), *to),
                (VTy::F32, VTy::Bool) | (VTy::Bool, VTy::F32)
            ) =>
        {
            vec![*a]
        }
        _ => return None,
    })
}

/// The coefficient of variable `v` in index `e` when `e` is `c * v` plus terms that do not
/// read `v` (clamps and quotients of other variables included); `None` otherwise.
fn coef_of(pool: &ExprPool, e: ExprId, v: Var) -> Option<i64> {
    let mut terms = Vec::new();
    pool.summands(e, 1, &mut terms)?;
    let mut c = 0;
    for (x, k) in terms {
        match pool.get(x) {
            E::Var(w) if *w == v => c += k,
            _ if reachable(pool, &[x])
                .iter()
                .any(|y| matches!(pool.get(*y), E::Var(w) if *w == v)) =>
            {
                return None
            }
            _ => {}
        }
    }
    Some(c)
}

impl Cg<'_, '_> {
    /// An implicit GEMM (a convolution or one of its gradients, `kernel::Gather` operands)
    /// through the runtime's `sgemm_gathered` helper. This call's rows (row tiles of 4) or
    /// columns (panels of column tiles of 8, `CpuPanels::by_panels`) go in blocks; for each
    /// split of `k`, each block's operands are gathered, a chunk of `k` at a time (whole
    /// runs, up to 512 steps), into the thread's gather buffers (A's rows and B's columns,
    /// each contiguous along `k`, on vectors where a run is; or, for an operand contiguous
    /// along its side, such as a weight gradient's output gradient and windows in
    /// channels-last, k-major on vectors along the side), the helper adds each chunk's
    /// product to the block, and the epilogue stores the block. Where a split is one chunk
    /// (a convolution's window, mostly), a column block's B is gathered once for all the
    /// row blocks. Chunks start at fixed steps of each split, so every element sums in the
    /// same order on any number of threads.
    fn gather_matmul(&mut self, mm: &Matmul, g: &Gathers) -> Res<()> {
        use tcc_runtime::cpu::{GATHER_A_FLOATS, GATHER_B_FLOATS, SGEMM_BLOCK_M, SGEMM_BLOCK_N};
        const GK: i64 = 512;
        let p = mm
            .cpu_panels()
            .ok_or_else(|| self.unsupported("an implicit GEMM without gathered operands"))?;
        let (mr, nr) = (CpuPanels::MR, CpuPanels::NR);
        let (m, n, run) = (mm.m as i64, mm.n as i64, p.run);
        let chunk_runs = (GK / run).max(1);
        let chunk_k = chunk_runs * run;
        let single = p.per_split <= chunk_runs;
        // Rows and columns of a block: the gather buffers hold them at `chunk_k` steps
        // each (side-major, packed 4 at a time), or `chunk_k` steps of them (k-major): at
        // most the buffer's floats either way.
        let mb = (GATHER_A_FLOATS as i64 / chunk_k).min(SGEMM_BLOCK_M as i64) / mr * mr;
        let nb = (GATHER_B_FLOATS as i64 / chunk_k).min(SGEMM_BLOCK_N as i64) / mr * mr;
        if mb < mr || nb < mr {
            return Err(self.unsupported("a run of `k` longer than the gather buffers hold"));
        }
        let (r_lo, r_hi, c_lo, c_hi) = if p.by_panels {
            let c0 = self.b.ins().imul_imm_s(self.lo, p.pt * nr);
            let c1 = self.b.ins().imul_imm_s(self.hi, p.pt * nr);
            let nc = self.iconst(n);
            let c1 = self.b.ins().smin(c1, nc);
            (self.iconst(0), self.iconst(m), c0, c1)
        } else {
            let r0 = self.b.ins().imul_imm_s(self.lo, mr);
            let r1 = self.b.ins().imul_imm_s(self.hi, mr);
            let mc = self.iconst(m);
            let r1 = self.b.ins().smin(r1, mc);
            (r0, r1, self.iconst(0), self.iconst(n))
        };
        let rows = Span {
            lo: r_lo,
            hi: r_hi,
            size: mb,
        };
        let cols = Span {
            lo: c_lo,
            hi: c_hi,
            size: nb,
        };
        let a_across = self.across_plan(&g.a);
        let b_across = self.across_plan(&g.b);
        let shape = GatherShape {
            run,
            chunk_k,
            a_cap: a_across.as_ref().map(|_| mb),
            b_cap: b_across.as_ref().map(|_| nb),
        };
        let (a_across, b_across) = (a_across.as_deref(), b_across.as_deref());

        let z = self.iconst(0);
        let send = self.iconst(p.splits);
        let sl = self.open_loop(z, send);
        let t0 = self.b.ins().imul_imm_s(sl.iv, p.per_split);
        let t1 = self.b.ins().iadd_imm_s(t0, p.per_split);
        let rc = self.iconst(p.runs);
        let t1 = self.b.ins().smin(t1, rc);
        let nonempty = self.b.ins().icmp(IntCC::SignedLessThan, t0, t1);
        let split_blk = self.b.create_block();
        let split_end = self.b.create_block();
        self.b.ins().brif(nonempty, split_blk, &[], split_end, &[]);
        self.b.switch_to_block(split_blk);
        if single {
            let (cl, j0, nh) = self.open_block(&cols);
            self.gather_block(&g.b, b_across, slot::GATHER_B, j0, nh, n, [t0, t1], &shape)?;
            let (rl, i0, mh) = self.open_block(&rows);
            self.gather_block(&g.a, a_across, slot::GATHER_A, i0, mh, m, [t0, t1], &shape)?;
            let zero = self.iconst(0);
            let c = self.gathered_product([mh, nh], [t0, t1], zero, &shape);
            self.block_epilogue(mm, c, [i0, mh], [j0, nh])?;
            self.close_loop(rl);
            self.close_loop(cl);
        } else {
            let span = self.b.ins().isub(t1, t0);
            let span = self.b.ins().iadd_imm_s(span, chunk_runs - 1);
            let nchunks = self.div_const(span, chunk_runs);
            let c_var = self.b.declare_var(I64);
            let z = self.iconst(0);
            self.b.def_var(c_var, z);
            let (rl, i0, mh) = self.open_block(&rows);
            let (cl, j0, nh) = self.open_block(&cols);
            let z = self.iconst(0);
            let kl = self.open_loop(z, nchunks);
            let ta = self.b.ins().imul_imm_s(kl.iv, chunk_runs);
            let ta = self.b.ins().iadd(t0, ta);
            let tb = self.b.ins().iadd_imm_s(ta, chunk_runs);
            let tb = self.b.ins().smin(tb, t1);
            self.gather_block(&g.a, a_across, slot::GATHER_A, i0, mh, m, [ta, tb], &shape)?;
            self.gather_block(&g.b, b_across, slot::GATHER_B, j0, nh, n, [ta, tb], &shape)?;
            let later = self.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, kl.iv, 0);
            let accumulate = self.b.ins().uextend(I64, later);
            let c = self.gathered_product([mh, nh], [ta, tb], accumulate, &shape);
            self.b.def_var(c_var, c);
            self.close_loop(kl);
            let c = self.b.use_var(c_var);
            self.block_epilogue(mm, c, [i0, mh], [j0, nh])?;
            self.close_loop(cl);
            self.close_loop(rl);
        }
        self.b.ins().jump(split_end, &[]);
        self.b.switch_to_block(split_end);
        self.close_loop(sl);
        Ok(())
    }

    /// Opens the loop over the blocks of `span`; returns it with the block's first index
    /// and length.
    fn open_block(&mut self, span: &Span) -> (LoopCtx, Value, Value) {
        let len = self.b.ins().isub(span.hi, span.lo);
        let len = self.b.ins().iadd_imm_s(len, span.size - 1);
        let count = self.div_const(len, span.size);
        let z = self.iconst(0);
        let l = self.open_loop(z, count);
        let first = self.b.ins().imul_imm_s(l.iv, span.size);
        let first = self.b.ins().iadd(span.lo, first);
        let left = self.b.ins().isub(span.hi, first);
        let size = self.iconst(span.size);
        let len = self.b.ins().smin(size, left);
        (l, first, len)
    }

    /// The values an operand's k-major gather splats (`Cg::vector_invariants` along its
    /// side's innermost axis), when it has one (`Across`) and that axis is a vector.
    fn across_plan(&self, op: &PackedOperand) -> Option<Vec<ExprId>> {
        let ac = op.across.as_ref()?;
        self.vector_invariants(ac.value, ac.si)
    }

    /// Gathers `count` rows of A (or columns of B) from `first` over runs `[ta, tb)` into
    /// the gather buffer of table slot `slot_no`: k-major on vectors along the side where
    /// `across` gives the splats (`Cg::gather_across`), otherwise each side `chunk_k`
    /// floats apart (clamped to `extent - 1`), 4 at a time.
    #[allow(clippy::too_many_arguments)]
    fn gather_block(
        &mut self,
        op: &PackedOperand,
        across: Option<&[ExprId]>,
        slot_no: usize,
        first: Value,
        count: Value,
        extent: i64,
        [ta, tb]: [Value; 2],
        shape: &GatherShape,
    ) -> Res<()> {
        let mr = CpuPanels::MR;
        let buf = self
            .b
            .ins()
            .load(I64, flags(), self.helpers, (slot_no * 8) as i32);
        let cap = if slot_no == slot::GATHER_A {
            shape.a_cap
        } else {
            shape.b_cap
        };
        if let (Some(inv), Some(ac), Some(cap)) = (across, &op.across, cap) {
            return self.gather_across(op, ac, inv, buf, [first, count], [ta, tb], shape.run, cap);
        }
        let groups = self.b.ins().iadd_imm_s(count, mr - 1);
        let groups = self.div_const(groups, mr);
        let z = self.iconst(0);
        let gl = self.open_loop(z, groups);
        let off = self.b.ins().imul_imm_s(gl.iv, mr * shape.chunk_k * 4);
        let dst = self.b.ins().iadd(buf, off);
        let side0 = self.b.ins().imul_imm_s(gl.iv, mr);
        let side0 = self.b.ins().iadd(first, side0);
        self.pack_a(
            op,
            dst,
            side0,
            [ta, tb],
            shape.chunk_k,
            shape.run,
            extent,
            mr,
        )?;
        self.close_loop(gl);
        Ok(())
    }

    /// Gathers sides `[first, first + count)` of `op` over runs `[ta, tb)` k-major into
    /// `buf`: step `q` (from `ta`'s first) of side `s` at float `q * cap + s - first`. For
    /// each step the sides go in segments within one index of the side's outer axes (`so`),
    /// each on f32x4 vectors along its innermost axis (`si`, splatting `inv`) while 4 lanes
    /// fit, the rest one by one.
    #[allow(clippy::too_many_arguments)]
    fn gather_across(
        &mut self,
        op: &PackedOperand,
        ac: &Across,
        inv: &[ExprId],
        buf: Value,
        [first, count]: [Value; 2],
        [ta, tb]: [Value; 2],
        run: i64,
        cap: i64,
    ) -> Res<()> {
        let end = self.b.ins().iadd(first, count);
        let tl = self.open_loop(ta, tb);
        self.vars.insert(op.t, tl.iv);
        self.emit_level(&ac.nodes, op.t, &[op.t])?;
        let z = self.iconst(0);
        let rc = self.iconst(run);
        let ul = self.open_loop(z, rc);
        self.vars.insert(op.u, ul.iv);
        self.emit_level(&ac.nodes, op.u, &[op.t, op.u])?;
        let rel = self.b.ins().isub(tl.iv, ta);
        let q = self.b.ins().imul_imm_s(rel, run);
        let q = self.b.ins().iadd(q, ul.iv);
        let row = self.b.ins().imul_imm_s(q, cap);
        let row = self.b.ins().isub(row, first);
        let row = self.b.ins().imul_imm_s(row, 4);
        let base = self.b.ins().iadd(buf, row);
        // The segments: `s` from `first`, each to the end of its `so` or of the block.
        let segs = self.open_loop(first, end);
        let sv = segs.iv;
        let so = self.div_const(sv, ac.inner);
        let si0 = self.rem_const(sv, ac.inner);
        let left = self.b.ins().isub(end, sv);
        let inner = self.iconst(ac.inner);
        let room = self.b.ins().isub(inner, si0);
        let seg = self.b.ins().smin(left, room);
        let si1 = self.b.ins().iadd(si0, seg);
        self.vars.insert(ac.so, so);
        self.emit_level(&ac.nodes, ac.so, &[op.t, op.u, ac.so])?;
        let so_off = self.b.ins().imul_imm_s(so, ac.inner * 4);
        let sbase = self.b.ins().iadd(base, so_off);
        let start = self.vector_run(ac.si, inv, si0, si1, &mut |cg, iv| {
            let v = cg.vemit(ac.value)?;
            let off = cg.b.ins().imul_imm_s(iv, 4);
            let addr = cg.b.ins().iadd(sbase, off);
            cg.b.ins().store(vflags(), v, addr, 0);
            Ok(())
        })?;
        let sl = self.open_loop(start, si1);
        self.vars.insert(ac.si, sl.iv);
        let v = self.emit(ac.value)?;
        let off = self.b.ins().imul_imm_s(sl.iv, 4);
        let addr = self.b.ins().iadd(sbase, off);
        self.b.ins().store(flags(), v, addr, 0);
        self.close_loop(sl);
        let next = self.b.ins().iadd(sv, seg);
        self.close_loop_at(segs, next);
        self.close_loop(ul);
        self.close_loop(tl);
        Ok(())
    }

    /// `sgemm_gathered` on the gathered `mh` × `nh` block over runs `[ta, tb)`; returns the
    /// address of its result.
    fn gathered_product(
        &mut self,
        [mh, nh]: [Value; 2],
        [ta, tb]: [Value; 2],
        accumulate: Value,
        shape: &GatherShape,
    ) -> Value {
        let nt = self.b.ins().isub(tb, ta);
        let nk = self.b.ins().imul_imm_s(nt, shape.run);
        let zero = self.iconst(0);
        // Side-major: each side's steps contiguous; k-major: each step's sides.
        let (a_rs, a_cs) = match shape.a_cap {
            Some(cap) => (1, cap),
            None => (shape.chunk_k, 1),
        };
        let (b_rs, b_cs) = match shape.b_cap {
            Some(cap) => (cap, 1),
            None => (1, shape.chunk_k),
        };
        let [a_rs, a_cs, b_rs, b_cs] = [a_rs, a_cs, b_rs, b_cs].map(|x| self.iconst(x));
        let args = [
            self.helpers,
            mh,
            nh,
            nk,
            zero,
            a_rs,
            a_cs,
            zero,
            b_rs,
            b_cs,
            accumulate,
        ];
        self.helper(slot::SGEMM_GATHERED, &args, &[I64; 11], I64)
    }

    /// The epilogue over the block at `c` (rows `BLOCK_N` floats apart) of `mh` rows from
    /// `i0` and `nh` columns from `j0`, each index unflattened over the kernel's rows and
    /// columns (the domain variables after the batch's, bound by the caller).
    fn block_epilogue(
        &mut self,
        mm: &Matmul,
        c: Value,
        [i0, mh]: [Value; 2],
        [j0, nh]: [Value; 2],
    ) -> Res<()> {
        let bn = tcc_runtime::cpu::SGEMM_BLOCK_N as i64;
        let plan = self.epilogue_plan(mm);
        let acc_nodes: Vec<ExprId> = (0..self.k.pool.nodes.len() as u32)
            .map(ExprId)
            .filter(|&e| matches!(self.k.pool.get(e), E::Acc))
            .collect();
        let z = self.iconst(0);
        let el = self.open_loop(z, mh);
        let nb = mm.batch.len();
        let i = self.b.ins().iadd(i0, el.iv);
        self.bind_flat(i, &mm.rows, nb);
        let crow = self.b.ins().imul_imm_s(el.iv, bn * 4);
        let crow = self.b.ins().iadd(c, crow);
        let mut start = self.iconst(0);
        if let Some(p) = &plan {
            let j1 = self.b.ins().iadd(j0, nh);
            let acc_nodes = &acc_nodes;
            let next = self.vector_run(p.inner, &p.invariants, j0, j1, &mut |cg, j| {
                let q = cg.b.ins().isub(j, j0);
                let q = cg.b.ins().imul_imm_s(q, 4);
                let at = cg.b.ins().iadd(crow, q);
                let acc = cg.b.ins().load(F32X4, vflags(), at, 0);
                for &e in acc_nodes {
                    cg.vcache.insert(e, acc);
                }
                // Every value before any store, as the scalar loop does.
                let mut vals = Vec::with_capacity(cg.k.stores.len());
                for s in &cg.k.stores {
                    vals.push(cg.vemit(s.value)?);
                }
                for (s, v) in cg.k.stores.iter().zip(vals) {
                    let idx = cg.emit(s.index)?;
                    let addr = cg.address(s.buf, s.dtype, idx)?;
                    let v = if s.accumulate {
                        let old = cg.b.ins().load(F32X4, vflags(), addr, 0);
                        cg.b.ins().fadd(old, v)
                    } else {
                        v
                    };
                    cg.b.ins().store(vflags(), v, addr, 0);
                }
                Ok(())
            })?;
            start = self.b.ins().isub(next, j0);
        }
        let ql = self.open_loop(start, nh);
        let j = self.b.ins().iadd(j0, ql.iv);
        self.bind_flat(j, &mm.cols, nb + mm.rows.len());
        let cq = self.b.ins().imul_imm_s(ql.iv, 4);
        let ca = self.b.ins().iadd(crow, cq);
        let acc = self.b.ins().load(F32, flags(), ca, 0);
        self.acc = Some(acc);
        self.journal.push(Vec::new());
        // Every value before any store, as the vector loop above does.
        let res = self
            .k
            .stores
            .iter()
            .try_for_each(|s| self.emit(s.value).map(|_| ()))
            .and_then(|()| self.stores());
        self.drop_scope();
        self.acc = None;
        res?;
        self.close_loop(ql);
        self.close_loop(el);
        Ok(())
    }

    /// Whether a product's epilogue can run on f32x4 vectors along its columns (one column
    /// axis, the domain's last variable), and what it then splats: as [`Cg::simd_plan`]
    /// asks of a Loop kernel, with the block's result (`E::Acc`) one more vector load, and
    /// accumulating f32 stores (split-K) allowed.
    fn epilogue_plan(&self, mm: &Matmul) -> Option<SimdPlan> {
        let k = self.k;
        let pool = &k.pool;
        if mm.cols.len() != 1 || k.stores.is_empty() {
            return None;
        }
        let inner = (mm.batch.len() + mm.rows.len()) as Var;
        let free = free_vars(pool);
        // Nodes that read the block's result: per element, like the column variable.
        let mut on_acc = vec![false; pool.nodes.len()];
        for (i, e) in pool.nodes.iter().enumerate() {
            on_acc[i] = matches!(e, E::Acc)
                || children(e)
                    .iter()
                    .any(|c| on_acc.get(c.0 as usize).copied().unwrap_or(false));
        }
        let mut stores = Vec::new();
        for s in &k.stores {
            if s.dtype != DType::F32 || pool.ty(s.value) != VTy::F32 {
                return None;
            }
            let a = pool.affine(s.index)?;
            if a.coef(inner) != 1 {
                return None;
            }
            stores.push((self.offsets.get(s.buf)?, a));
        }
        let per_lane = |i: usize| Some(free.get(i)?.contains(&inner) || *on_acc.get(i)?);
        let invariants = self.vector_values(inner, &stores, &per_lane)?;
        Some(SimdPlan { inner, invariants })
    }

    /// Emits the `nodes` (an operand's value and what it reads) that read `v` and whose
    /// variables are all bound now (the packing loops bind the side, then `t`, then `u`; the
    /// k-major ones `t`, `u`, then the side's outer index).
    fn emit_level(&mut self, nodes: &[(ExprId, BTreeSet<Var>)], v: Var, bound: &[Var]) -> Res<()> {
        for (e, fv) in nodes {
            if fv.contains(&v) && fv.iter().all(|w| bound.contains(w)) {
                self.emit(*e)?;
            }
        }
        Ok(())
    }

    /// A's rows `i0..i0 + mr` (clamped to row `m - 1`) over runs `[t0, t1)` to `dst`, row
    /// `r` at `r * ks_max` floats: each run on f32x4 vectors while 4 lanes fit when its
    /// values have a vector form, the rest one by one.
    #[allow(clippy::too_many_arguments)]
    fn pack_a(
        &mut self,
        op: &PackedOperand,
        dst: Value,
        i0: Value,
        [t0, t1]: [Value; 2],
        ks_max: i64,
        run: i64,
        m: i64,
        mr: i64,
    ) -> Res<()> {
        let vector = if run >= LANES {
            self.vector_invariants(op.value, op.u)
        } else {
            None
        };
        let z = self.iconst(0);
        let mrc = self.iconst(mr);
        let rl = self.open_loop(z, mrc);
        let i = self.b.ins().iadd(i0, rl.iv);
        let last = self.iconst(m - 1);
        let row = self.b.ins().smin(i, last);
        self.vars.insert(op.side, row);
        self.emit_level(&op.nodes, op.side, &[op.side])?;
        let roff = self.b.ins().imul_imm_s(rl.iv, ks_max * 4);
        let base = self.b.ins().iadd(dst, roff);
        let tl = self.open_loop(t0, t1);
        self.vars.insert(op.t, tl.iv);
        self.emit_level(&op.nodes, op.t, &[op.side, op.t])?;
        let rel_t = self.b.ins().isub(tl.iv, t0);
        let toff = self.b.ins().imul_imm_s(rel_t, run * 4);
        let rbase = self.b.ins().iadd(base, toff);
        let mut start = self.iconst(0);
        let rend = self.iconst(run);
        if let Some(inv) = &vector {
            start = self.vector_run(op.u, inv, start, rend, &mut |cg, iv| {
                let v = cg.vemit(op.value)?;
                let off = cg.b.ins().imul_imm_s(iv, 4);
                let addr = cg.b.ins().iadd(rbase, off);
                cg.b.ins().store(vflags(), v, addr, 0);
                Ok(())
            })?;
        }
        let ul = self.open_loop(start, rend);
        self.vars.insert(op.u, ul.iv);
        let v = self.emit(op.value)?;
        let off = self.b.ins().imul_imm_s(ul.iv, 4);
        let addr = self.b.ins().iadd(rbase, off);
        self.b.ins().store(flags(), v, addr, 0);
        self.close_loop(ul);
        self.close_loop(tl);
        self.close_loop(rl);
        Ok(())
    }

    /// When `root` has a vector form along `inner` (the forms `vemit` takes, loads at
    /// a coefficient of 0 or 1 in `inner`), the f32 and bool values it reads that do not
    /// depend on `inner` (splat once per run; ascending ids).
    fn vector_invariants(&self, root: ExprId, inner: Var) -> Option<Vec<ExprId>> {
        let pool = &self.k.pool;
        let free = free_vars(pool);
        let reads = |e: ExprId| free.get(e.0 as usize).is_some_and(|f| f.contains(&inner));
        let mut seen = BTreeSet::new();
        let mut invariants = Vec::new();
        let mut stack = vec![root];
        while let Some(e) = stack.pop() {
            if !seen.insert(e) {
                continue;
            }
            let ty = pool.ty(e);
            if !reads(e) {
                if ty != VTy::F32 && ty != VTy::Bool {
                    return None;
                }
                invariants.push(e);
                continue;
            }
            match pool.get(e) {
                E::Load {
                    dtype: DType::F32,
                    index,
                    ..
                } => {
                    if !matches!(coef_of(pool, *index, inner), Some(0 | 1)) {
                        return None;
                    }
                }
                _ => stack.extend(vector_operands(pool, e)?),
            }
        }
        invariants.sort_unstable();
        Some(invariants)
    }

    /// Binds domain variables `first..` to the row-major coordinates of `flat` over `dims`.
    fn bind_flat(&mut self, flat: Value, dims: &[usize], first: usize) {
        let mut rest = flat;
        for (q, &d) in dims.iter().enumerate().rev() {
            let v = (first + q) as Var;
            if q == 0 {
                self.vars.insert(v, rest);
            } else {
                let d = d.max(1) as i64;
                let c = self.rem_const(rest, d);
                self.vars.insert(v, c);
                rest = self.div_const(rest, d);
            }
        }
    }
}

/// Unary f32 ops with a vector form (inline math; the rest call helpers).
fn simd_unary(op: UnaryOp) -> bool {
    use UnaryOp as U;
    matches!(
        op,
        U::Neg
            | U::Abs
            | U::Sqrt
            | U::Rsqrt
            | U::Recip
            | U::Relu
            | U::Exp
            | U::Tanh
            | U::Sigmoid
            | U::Silu
            | U::Gelu
            | U::GeluGrad
    )
}

/// Binary f32 ops with a vector form (comparisons give lane masks).
fn simd_binary(op: BinaryOp) -> bool {
    use BinaryOp as B;
    matches!(
        op,
        B::Add
            | B::Sub
            | B::Mul
            | B::Div
            | B::Rem
            | B::Maximum
            | B::Minimum
            | B::Eq
            | B::Ne
            | B::Lt
            | B::Le
            | B::Gt
            | B::Ge
    )
}
