//! The CPU executor: compiles the artifact's Cranelift IR for the host and launches kernels.
//!
//! The kernel ABI is in `ARTIFACT.md`: every kernel is `(i64 arena, i64 lo, i64 hi, i64
//! helpers)` in the host's default calling convention, and `helpers` points at a table of
//! [`CPU_HELPERS`]`.len()` host function pointers in the order of [`CPU_HELPERS`], then
//! [`GEMM_CONTEXT_SLOT`]. Each thread of a session has its own table, whose context slot
//! addresses that thread's GEMM scratch (`gemm.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use cranelift_codegen::ir::{types, AbiParam, GlobalValueData, Signature, UserFuncName};
use cranelift_codegen::settings::{self, Configurable};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, FuncId, Linkage, Module, ModuleError};

use crate::artifact::KernelEntry;
use crate::{gemm, Error};

/// Names of the helper table's slots, in slot order (the table in `ARTIFACT.md`). The
/// compiler looks a helper's slot up by name here; the kernel loads the function pointer
/// from `helpers + 8 * slot`.
pub const CPU_HELPERS: [&str; 13] = [
    "expf",
    "logf",
    "tanhf",
    "sinf",
    "cosf",
    "erff",
    "powf",
    "f16_to_f32",
    "f32_to_f16",
    "bf16_to_f32",
    "f32_to_bf16",
    "sgemm",
    "sgemm_gathered",
];

/// The most rows and columns of a block `sgemm` computes; the row stride, in floats, of
/// the result whose address it returns (`ARTIFACT.md`).
pub use crate::gemm::{BLOCK_M as SGEMM_BLOCK_M, BLOCK_N as SGEMM_BLOCK_N};

/// The slot after the functions: the address of the calling thread's GEMM context, which
/// `sgemm` and `sgemm_gathered` read from the table the kernel passes them.
pub const GEMM_CONTEXT_SLOT: usize = CPU_HELPERS.len();
/// The slots after it: the addresses of the calling thread's gather buffers, A's
/// ([`GATHER_A_FLOATS`] floats) and B's ([`GATHER_B_FLOATS`]), where a kernel packs the
/// operands of an implicit GEMM (a convolution's windows) for `sgemm_gathered`.
pub const GATHER_A_SLOT: usize = GEMM_CONTEXT_SLOT + 1;
pub const GATHER_B_SLOT: usize = GEMM_CONTEXT_SLOT + 2;
pub use crate::gemm::{GATHER_A_FLOATS, GATHER_B_FLOATS};

/// Slots of one thread's table.
const TABLE_SLOTS: usize = CPU_HELPERS.len() + 3;
type Table = [u64; TABLE_SLOTS];

/// The slot of helper `name` in the table, if there is one.
pub fn helper_slot(name: &str) -> Option<usize> {
    CPU_HELPERS.iter().position(|&h| h == name)
}

extern "C" fn h_expf(x: f32) -> f32 {
    libm::expf(x)
}
extern "C" fn h_logf(x: f32) -> f32 {
    libm::logf(x)
}
extern "C" fn h_tanhf(x: f32) -> f32 {
    libm::tanhf(x)
}
extern "C" fn h_sinf(x: f32) -> f32 {
    libm::sinf(x)
}
extern "C" fn h_cosf(x: f32) -> f32 {
    libm::cosf(x)
}
extern "C" fn h_erff(x: f32) -> f32 {
    libm::erff(x)
}
extern "C" fn h_powf(x: f32, y: f32) -> f32 {
    libm::powf(x, y)
}
extern "C" fn h_f16_to_f32(bits: i32) -> f32 {
    half::f16::from_bits(bits as u16).to_f32()
}
extern "C" fn h_f32_to_f16(x: f32) -> i32 {
    i32::from(half::f16::from_f32(x).to_bits())
}
extern "C" fn h_bf16_to_f32(bits: i32) -> f32 {
    half::bf16::from_bits(bits as u16).to_f32()
}
extern "C" fn h_f32_to_bf16(x: f32) -> i32 {
    i32::from(half::bf16::from_f32(x).to_bits())
}

/// One thread's GEMM state: the arena of the current step (set before every launch), the
/// host's tile, the scratch the blocks are computed into, and the first call refused.
struct GemmContext {
    arena: *const u8,
    arena_bytes: usize,
    tile: gemm::Tile,
    scratch: gemm::Scratch,
    /// The gather buffers, reached only through the pointers below (kernels write them
    /// through the same addresses, from the table).
    gathered: gemm::Gathered,
    refused: Option<gemm::Refused>,
}

/// The GEMM context of the table a kernel passed to a GEMM helper.
///
/// # Safety
/// `table` must be a table the executor gave the calling thread (`launch`, `Job::work`):
/// its context slot holds the address of that thread's `GemmContext`, which lives (boxed)
/// as long as the table and which no other thread touches during a launch.
unsafe fn context<'a>(table: *const u64) -> &'a mut GemmContext {
    // SAFETY: the caller's contract.
    unsafe { &mut *((*table.add(GEMM_CONTEXT_SLOT)) as *mut GemmContext) }
}

/// One block through `gemm::block` into `ctx`'s scratch, A and B each `[offset,
/// row stride, column stride]` in `sources`; a refused call is kept for
/// `CpuExecutor::refusals`. Returns the block's address.
fn product(
    ctx: &mut GemmContext,
    sources: (gemm::Arena, gemm::Arena),
    dims: (i64, i64, i64),
    [a, b]: [[i64; 3]; 2],
    accumulate: bool,
) -> *mut f32 {
    let operand = |[off, rs, cs]: [i64; 3]| gemm::Operand { off, rs, cs };
    let (a, b) = (operand(a), operand(b));
    if let Err(r) = gemm::block(ctx.tile, &mut ctx.scratch, sources, dims, a, b, accumulate) {
        ctx.refused.get_or_insert(r);
    }
    ctx.scratch.c_ptr()
}

/// `sgemm(table, m, n, k, a_off, a_rs, a_cs, b_off, b_rs, b_cs) -> i64`: the `m × n` block
/// `A · B` (`ARTIFACT.md`), computed into the calling thread's scratch; returns its address
/// (row stride `gemm::BLOCK_N` floats). Offsets are bytes from the arena base, strides are
/// elements.
#[allow(clippy::too_many_arguments)]
extern "C" fn h_sgemm(
    table: *const u64,
    m: i64,
    n: i64,
    k: i64,
    a_off: i64,
    a_rs: i64,
    a_cs: i64,
    b_off: i64,
    b_rs: i64,
    b_cs: i64,
) -> *mut f32 {
    // SAFETY: kernels pass the table they were given (the compiler's contract in
    // ARTIFACT.md), which is `context`'s.
    let ctx = unsafe { context(table) };
    // SAFETY: `arena` and `arena_bytes` are the session's arena, set before this launch
    // (`CpuExecutor::set_arena`); a kernel reads its GEMM operands, which no kernel writes
    // while it runs (the compiler's contract in ARTIFACT.md).
    let arena = unsafe { gemm::Arena::new(ctx.arena, ctx.arena_bytes) };
    let ops = [[a_off, a_rs, a_cs], [b_off, b_rs, b_cs]];
    product(ctx, (arena, arena), (m, n, k), ops, false)
}

/// `sgemm_gathered(table, m, n, k, a_off, a_rs, a_cs, b_off, b_rs, b_cs, accumulate) ->
/// i64`: as `sgemm`, but A is read from the calling thread's gather buffer A and B from its
/// gather buffer B (offsets are bytes from each buffer's start), and with `accumulate`
/// nonzero the block is added to the result of the thread's last call instead of replacing
/// it (a `k` longer than the buffers hold, in slices).
#[allow(clippy::too_many_arguments)]
extern "C" fn h_sgemm_gathered(
    table: *const u64,
    m: i64,
    n: i64,
    k: i64,
    a_off: i64,
    a_rs: i64,
    a_cs: i64,
    b_off: i64,
    b_rs: i64,
    b_cs: i64,
    accumulate: i64,
) -> *mut f32 {
    // SAFETY: as in `h_sgemm`.
    let ctx = unsafe { context(table) };
    let sources = ctx.gathered.views();
    let ops = [[a_off, a_rs, a_cs], [b_off, b_rs, b_cs]];
    product(ctx, sources, (m, n, k), ops, accumulate != 0)
}

/// A thread's helper table, built at run time (function addresses cannot be taken in a
/// constant), its context slot addressing `ctx` (a live allocation of `thread_state`).
fn helper_table(ctx: *mut GemmContext) -> Table {
    type F1 = extern "C" fn(f32) -> f32;
    type F2 = extern "C" fn(f32, f32) -> f32;
    type FromBits = extern "C" fn(i32) -> f32;
    type ToBits = extern "C" fn(f32) -> i32;
    type Gemm = extern "C" fn(*const u64, i64, i64, i64, i64, i64, i64, i64, i64, i64) -> *mut f32;
    type Gathered =
        extern "C" fn(*const u64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64) -> *mut f32;
    [
        h_expf as F1 as usize as u64,
        h_logf as F1 as usize as u64,
        h_tanhf as F1 as usize as u64,
        h_sinf as F1 as usize as u64,
        h_cosf as F1 as usize as u64,
        h_erff as F1 as usize as u64,
        h_powf as F2 as usize as u64,
        h_f16_to_f32 as FromBits as usize as u64,
        h_f32_to_f16 as ToBits as usize as u64,
        h_bf16_to_f32 as FromBits as usize as u64,
        h_f32_to_bf16 as ToBits as usize as u64,
        h_sgemm as Gemm as usize as u64,
        h_sgemm_gathered as Gathered as usize as u64,
        ctx as usize as u64,
        // SAFETY: `ctx` is live and nothing else reaches it yet (`thread_state`); the
        // buffers' addresses are read, not borrowed.
        unsafe { (*ctx).gathered.a_ptr() } as usize as u64,
        unsafe { (*ctx).gathered.b_ptr() } as usize as u64,
    ]
}

/// A compiled kernel: `(arena, lo, hi, helpers)`. The JIT compiles it with the host ISA's
/// default calling convention, which is the platform's C convention (`extern "C"`).
type KernelFn = unsafe extern "C" fn(*mut u8, i64, i64, *const u64);

#[derive(Clone)]
struct Launch {
    f: KernelFn,
    extent: u64,
    parallel: bool,
    name: String,
    /// What the ranks of a data-parallel step combine before this kernel.
    collective: Option<crate::artifact::Collective>,
}

/// The compiled code of one session plus its helper tables and (optional) worker pool.
pub(crate) struct CpuExecutor {
    /// Dropped (joined) before the code is freed: see `Drop`.
    pool: Option<Pool>,
    /// One table per thread (the caller's first, then each worker's), boxed so their
    /// addresses are stable while worker threads read them.
    tables: Box<[Table]>,
    /// Each thread's GEMM context, addressed by its table.
    contexts: Contexts,
    launches: Vec<Launch>,
    module: Option<JITModule>,
}

// SAFETY: the contexts' raw pointers address the session's arena and their own
// allocations; the executor is used from one thread at a time (`&mut self` for every
// launch), and its workers touch their context only inside a launch the owning thread
// waits for.
unsafe impl Send for CpuExecutor {}

/// The threads' GEMM contexts, each its own allocation reached only through the raw
/// pointer kept here and copied into its thread's table: no Rust reference to a context
/// outlives the call that makes it, so moving the executor or reaching a context from the
/// executor does not invalidate the tables' copies.
struct Contexts(Vec<*mut GemmContext>);

impl Contexts {
    /// Runs `f` on every context.
    fn each<R>(&mut self, mut f: impl FnMut(&mut GemmContext) -> Option<R>) -> Option<R> {
        let mut first = None;
        for &c in &self.0 {
            // SAFETY: `c` came from `Box::into_raw` (`thread_state`) and is freed only in
            // `drop`; `&mut self` means no launch runs (launches borrow the executor), so
            // no kernel or helper holds the context now.
            let r = f(unsafe { &mut *c });
            first = first.or(r);
        }
        first
    }
}

impl Drop for Contexts {
    fn drop(&mut self) {
        for &c in &self.0 {
            // SAFETY: `c` came from `Box::into_raw` and is freed only here, once; the
            // executor drops its pool (joining the workers) before its contexts, and
            // `set_threads` replaces the contexts only after the old pool is gone.
            drop(unsafe { Box::from_raw(c) });
        }
    }
}

/// `threads` GEMM contexts and the tables that address them.
fn thread_state(threads: usize) -> (Box<[Table]>, Contexts) {
    let tile = gemm::Tile::detect();
    let contexts = Contexts(
        (0..threads.max(1))
            .map(|_| {
                Box::into_raw(Box::new(GemmContext {
                    arena: std::ptr::null(),
                    arena_bytes: 0,
                    tile,
                    scratch: gemm::Scratch::new(),
                    gathered: gemm::Gathered::new(),
                    refused: None,
                }))
            })
            .collect(),
    );
    let tables = contexts.0.iter().map(|&c| helper_table(c)).collect();
    (tables, contexts)
}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        // Stop the workers first: none of them may be inside a kernel when the code goes.
        self.pool = None;
        if let Some(module) = self.module.take() {
            // SAFETY: no kernel of this module runs (the workers are joined, `run` takes
            // `&mut self` and has returned) and `launches`, the only copies of its function
            // pointers, are never called again: they are dropped with `self`.
            unsafe { module.free_memory() };
        }
    }
}

fn compile_error(kernel: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Compile {
        kernel: kernel.into(),
        message: message.into(),
    }
}

impl CpuExecutor {
    /// Parses `code` (CLIF text), compiles every function in it for the host and resolves
    /// the kernels of `kernels` (in launch order).
    pub(crate) fn compile(code: &str, kernels: &[KernelEntry]) -> Result<Self, Error> {
        if usize::BITS != 64 {
            return Err(compile_error(
                "(host)",
                "the CPU kernel ABI needs a 64-bit host",
            ));
        }
        let mut flags = settings::builder();
        for (name, value) in [
            // Not `speed`: Cranelift's e-graph pass places pure values at their uses and
            // sank the index arithmetic of a convolution's gather (divisions included)
            // from the loops over rows and taps into the innermost vector loop, which
            // made the cnn step 1.6× slower (issue 28). The CLIF generator already shares
            // values, keeps invariants outside loops and turns constant divisions into
            // multiplies (`tcc::back::divconst`), so the pass has little left to gain.
            ("opt_level", "none"),
            // As `JITBuilder::with_flags` does: the JIT needs absolute, long-range
            // relocations.
            ("use_colocated_libcalls", "false"),
            ("is_pic", "false"),
        ] {
            flags
                .set(name, value)
                .map_err(|e| compile_error("(host)", format!("setting {name}={value}: {e}")))?;
        }
        let isa_builder = cranelift_native::builder()
            .map_err(|m| compile_error("(host)", format!("this host is not supported: {m}")))?;
        let isa = isa_builder
            .finish(settings::Flags::new(flags))
            .map_err(|e| compile_error("(host)", format!("building the host ISA: {e}")))?;
        let mut module = JITModule::new(JITBuilder::with_isa(isa, default_libcall_names()));
        let call_conv = module.isa().default_call_conv();

        let funcs = cranelift_reader::parse_functions(code)
            .map_err(|e| compile_error("(code section)", format!("CLIF parse error: {e}")))?;

        let mut kernel_sig = Signature::new(call_conv);
        kernel_sig.params = vec![AbiParam::new(types::I64); 4];
        let mut ids: HashMap<String, FuncId> = HashMap::new();
        let mut sizes: Vec<(String, FuncId, u32)> = Vec::new();
        for mut func in funcs {
            let name = match &func.name {
                UserFuncName::Testcase(t) => String::from_utf8_lossy(t.raw()).into_owned(),
                UserFuncName::User(u) => {
                    return Err(compile_error(
                        format!("{u}"),
                        "kernels must be named `%name`, not with a user name",
                    ))
                }
            };
            check_kernel_ir(&name, &func)?;
            // The text says `system_v`; the helpers and our callers use the host's default.
            func.signature.call_conv = call_conv;
            for sig in func.dfg.signatures.values_mut() {
                sig.call_conv = call_conv;
            }
            if func.signature != kernel_sig {
                return Err(compile_error(
                    &name,
                    format!(
                        "signature is {}, but a kernel takes (i64, i64, i64, i64) and returns \
                         nothing",
                        func.signature
                    ),
                ));
            }
            let id = module
                .declare_function(&name, Linkage::Export, &kernel_sig)
                .map_err(|e| compile_error(&name, e.to_string()))?;
            let mut ctx = module.make_context();
            ctx.func = func;
            if let Err(e) = module.define_function(id, &mut ctx) {
                let message = match e {
                    ModuleError::Compilation(err) => {
                        cranelift_codegen::print_errors::pretty_error(&ctx.func, err)
                    }
                    other => other.to_string(),
                };
                return Err(compile_error(&name, message));
            }
            let size = ctx.compiled_code().map_or(0, |c| c.code_info().total_size);
            sizes.push((name.clone(), id, size));
            ids.insert(name, id);
        }
        module
            .finalize_definitions()
            .map_err(|e| compile_error("(code section)", e.to_string()))?;
        if std::env::var_os("TCC_PERF_MAP").is_some() {
            write_perf_map(&module, &sizes);
        }

        let mut launches = Vec::with_capacity(kernels.len());
        for k in kernels {
            let id = *ids.get(&k.name).ok_or_else(|| {
                let mut have: Vec<&str> = ids.keys().map(String::as_str).collect();
                have.sort_unstable();
                compile_error(
                    &k.name,
                    format!(
                        "the manifest launches `{}` but the code section has no function \
                         `%{}` (it has: {})",
                        k.name,
                        k.name,
                        if have.is_empty() {
                            "none".to_string()
                        } else {
                            have.join(", ")
                        }
                    ),
                )
            })?;
            let ptr = module.get_finalized_function(id);
            // SAFETY: `ptr` is the entry of a finalized function whose signature we checked
            // to be `(i64, i64, i64, i64)` with no results, compiled with the host's default
            // calling convention, which is the platform C convention; on a 64-bit host
            // (checked above) pointers are passed exactly like i64.
            let f = unsafe { std::mem::transmute::<*const u8, KernelFn>(ptr) };
            launches.push(Launch {
                f,
                extent: k.extent,
                parallel: k.parallel,
                name: k.name.clone(),
                collective: k.collective.clone(),
            });
        }
        let (tables, contexts) = thread_state(1);
        Ok(CpuExecutor {
            pool: None,
            tables,
            contexts,
            launches,
            module: Some(module),
        })
    }

    /// Points every thread's GEMM context at the arena of the next launches, and clears
    /// their refusals. Called by every entry that launches kernels.
    fn set_arena(&mut self, arena: *mut u8, arena_bytes: usize) {
        self.contexts.each(|c| {
            c.arena = arena.cast_const();
            c.arena_bytes = arena_bytes;
            c.refused = None;
            None::<()>
        });
    }

    /// The first GEMM call the last launches refused, as an error.
    fn refusals(&mut self) -> Result<(), Error> {
        match self.contexts.each(|c| c.refused.take()) {
            Some(r) => Err(Error::HelperRefused {
                m: r.m,
                n: r.n,
                k: r.k,
            }),
            None => Ok(()),
        }
    }

    /// Number of threads a parallel kernel runs on (the caller's included).
    pub(crate) fn threads(&self) -> usize {
        self.pool.as_ref().map_or(1, |p| p.workers.len() + 1)
    }

    /// Runs parallel kernels on `threads` threads (the caller's included) from now on.
    pub(crate) fn set_threads(&mut self, threads: usize) -> Result<(), Error> {
        if threads == self.threads() {
            return Ok(());
        }
        self.pool = None;
        if threads > 1 {
            self.pool = Some(Pool::new(threads - 1)?);
        }
        (self.tables, self.contexts) = thread_state(threads);
        Ok(())
    }

    /// Launches every kernel in order on the arena of `arena_bytes` bytes at `arena`.
    /// Allocates nothing.
    pub(crate) fn run(&mut self, arena: *mut u8, arena_bytes: usize) -> Result<(), Error> {
        self.set_arena(arena, arena_bytes);
        for l in &self.launches {
            self.launch(l, arena);
        }
        self.refusals()
    }

    /// Launches every kernel in order as one rank of a data-parallel step: after a kernel
    /// that carries a collective, `combine` runs it on the arena with the other ranks
    /// (an all-reduce's kernel is skipped where it would only copy its bytes onto
    /// themselves; the other collectives' kernels are always: the collective writes their
    /// result).
    pub(crate) fn run_rank(
        &mut self,
        arena: &mut [u8],
        combine: &mut dyn FnMut(&crate::artifact::Collective, &mut [u8]) -> crate::Result<()>,
    ) -> crate::Result<()> {
        self.set_arena(arena.as_mut_ptr(), arena.len());
        for l in &self.launches {
            match &l.collective {
                None => self.launch(l, arena.as_mut_ptr()),
                Some(c) => {
                    // An all-reduce's kernel copies the gradient into the bytes reduced in
                    // place; the other collectives write their result instead of their
                    // (placeholder) kernel.
                    if c.op == crate::artifact::CollectiveOp::AllReduceSum && !c.in_place {
                        self.launch(l, arena.as_mut_ptr());
                    }
                    combine(c, arena)?;
                }
            }
        }
        self.refusals()
    }

    /// Wall time of each kernel of one step, launched in order (a profiling aid: it runs
    /// the step, so params of a training step are updated).
    pub(crate) fn profile(
        &mut self,
        arena: *mut u8,
        arena_bytes: usize,
    ) -> Result<Vec<(String, f32)>, Error> {
        self.set_arena(arena, arena_bytes);
        let mut out = Vec::with_capacity(self.launches.len());
        for l in &self.launches {
            let t = std::time::Instant::now();
            self.launch(l, arena);
            out.push((l.name.clone(), t.elapsed().as_secs_f32() * 1e3));
        }
        self.refusals()?;
        Ok(out)
    }

    fn launch(&self, l: &Launch, arena: *mut u8) {
        match &self.pool {
            Some(pool) if l.parallel && l.extent > 1 => pool.launch(Job {
                f: l.f,
                arena: SendPtr(arena),
                tables: SendPtr(self.tables.as_ptr().cast_mut().cast::<u8>()),
                extent: l.extent,
                chunk: l.extent.div_ceil(pool.workers.len() as u64 + 1),
            }),
            _ => {
                // SAFETY: `f` is a finalized kernel with the ABI of `KernelFn` (see
                // `compile`), still alive (the module is freed only on drop); `arena` is
                // the session's arena base, aligned and `arena_bytes` long, and the kernel
                // only touches that arena (the compiler's contract in ARTIFACT.md);
                // the table is the calling thread's (the first), live; the extent fits an
                // i64 (checked by `artifact::validate`).
                unsafe { (l.f)(arena, 0, l.extent as i64, self.tables[0].as_ptr()) }
            }
        }
    }
}

/// A raw pointer handed to worker threads for the duration of one launch.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the pointer is only dereferenced (by kernels) while the launching thread waits in
// `Pool::launch`, during which the arena and the helper tables outlive every use, and the
// kernels of a `parallel` launch touch disjoint bytes for disjoint `[lo, hi)` ranges (the
// compiler's contract in ARTIFACT.md).
unsafe impl Send for SendPtr {}

#[derive(Clone, Copy)]
struct Job {
    f: KernelFn,
    arena: SendPtr,
    /// The threads' tables (`CpuExecutor::tables`): thread `t` passes the `t`-th.
    tables: SendPtr,
    extent: u64,
    chunk: u64,
}

impl Job {
    /// Takes chunks of `[0, extent)` from `next` until none are left, as thread `t` (0:
    /// the launching thread, `w + 1`: worker `w`).
    fn work(&self, next: &AtomicU64, t: usize) {
        // The pool has `tables.len() - 1` workers (`set_threads` builds both), so `t` is in
        // range: this is the `t`-th table's address.
        let table = self
            .tables
            .0
            .cast_const()
            .cast::<u64>()
            .wrapping_add(t * TABLE_SLOTS);
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(lo) = i.checked_mul(self.chunk).filter(|&lo| lo < self.extent) else {
                return;
            };
            let hi = lo.saturating_add(self.chunk).min(self.extent);
            // SAFETY: as for the serial launch in `CpuExecutor::run`; in addition the
            // kernel is `parallel`, so this thread's `[lo, hi)` touches bytes no other
            // thread's chunk touches, `lo < hi <= extent <= i64::MAX`, and `table` is this
            // thread's own (no other thread uses its GEMM context).
            unsafe { (self.f)(self.arena.0, lo as i64, hi as i64, table) }
        }
    }
}

struct PoolState {
    job: Option<Job>,
    shutdown: bool,
}

struct Shared {
    /// The job of the current launch; also the lock the condition variables sleep on.
    state: Mutex<PoolState>,
    /// Bumped (under `state`) for every launch; a worker works once per generation.
    generation: AtomicU64,
    /// Workers that have not yet finished the current generation.
    active: AtomicUsize,
    /// Workers that have started (and so done their own start-up allocations).
    ready: AtomicUsize,
    /// Index of the next chunk of the current launch.
    next: AtomicU64,
    start: Condvar,
    done: Condvar,
}

/// How many times a thread polls before it sleeps on a condition variable: kernels come
/// back to back, so a short spin saves a futex wake-up per launch.
const SPIN: u32 = 1 << 12;

impl Shared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // No code panics while holding the lock, but a poisoned lock still holds valid
        // state, so carry on rather than panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Worker threads that help the launching thread with `parallel` kernels. Created outside
/// `run`; a launch only stores, spins, locks, notifies and waits, which allocates nothing.
struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(workers: usize) -> Result<Pool, Error> {
        let shared = Arc::new(Shared {
            state: Mutex::new(PoolState {
                job: None,
                shutdown: false,
            }),
            generation: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            ready: AtomicUsize::new(0),
            next: AtomicU64::new(0),
            start: Condvar::new(),
            done: Condvar::new(),
        });
        let mut pool = Pool {
            shared,
            workers: Vec::with_capacity(workers),
        };
        for i in 0..workers {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("tcc-worker-{i}"))
                .spawn(move || worker(&shared, i + 1))
                .map_err(Error::Threads)?; // `pool` drops here and joins those started
            pool.workers.push(handle);
        }
        // A thread allocates as it starts (its handle, thread-local state): wait for every
        // worker so that none of that happens later, inside `run`.
        while pool.shared.ready.load(Ordering::Acquire) < workers {
            std::thread::yield_now();
        }
        Ok(pool)
    }

    /// Runs `job` on every worker and the calling thread; returns when all chunks are done.
    fn launch(&self, job: Job) {
        let sh = &*self.shared;
        {
            let mut st = sh.lock();
            st.job = Some(job);
            sh.next.store(0, Ordering::Relaxed);
            sh.active.store(self.workers.len(), Ordering::Relaxed);
            // Under the lock, so a worker that checked the generation under the lock is
            // already waiting when `notify_all` runs.
            sh.generation.fetch_add(1, Ordering::Release);
        }
        sh.start.notify_all();
        job.work(&sh.next, 0);
        // Wait for every worker to finish its chunks (their arena writes happen-before the
        // Acquire load that sees `active == 0`).
        for _ in 0..SPIN {
            if sh.active.load(Ordering::Acquire) == 0 {
                return;
            }
            std::hint::spin_loop();
        }
        let mut st = sh.lock();
        while sh.active.load(Ordering::Acquire) > 0 {
            st = sh.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.start.notify_all();
        for w in self.workers.drain(..) {
            // A worker never panics (kernels are foreign code and do not unwind); if one
            // did, there is nothing left to clean up.
            let _ = w.join();
        }
    }
}

fn worker(sh: &Shared, t: usize) {
    // Start-up allocations of this thread are done by now; `std::thread::current()`
    // initialises the handle other code might ask for first inside a launch.
    let _ = std::thread::current();
    sh.ready.fetch_add(1, Ordering::Release);
    let mut seen = 0u64;
    loop {
        let mut spins = 0;
        while sh.generation.load(Ordering::Acquire) == seen && spins < SPIN {
            std::hint::spin_loop();
            spins += 1;
        }
        let job = {
            let mut st = sh.lock();
            while sh.generation.load(Ordering::Acquire) == seen && !st.shutdown {
                st = sh.start.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.shutdown {
                return;
            }
            seen = sh.generation.load(Ordering::Acquire);
            st.job
        };
        if let Some(job) = job {
            job.work(&sh.next, t);
        }
        if sh.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Take the lock so the launcher is either before its check (and sees 0) or
            // already waiting (and gets the notification).
            drop(sh.lock());
            sh.done.notify_one();
        }
    }
}

/// With `TCC_PERF_MAP` set: names each compiled kernel for `perf report` in
/// `/tmp/perf-<pid>.map` (the file `perf` reads for code it cannot see otherwise), so a
/// profile of a step attributes its samples to kernels. A failure to write is ignored:
/// the map only helps a profiler.
fn write_perf_map(module: &JITModule, kernels: &[(String, FuncId, u32)]) {
    use std::io::Write;
    // `perf` looks in `/tmp` whatever `TMPDIR` says.
    let path = format!("/tmp/perf-{}.map", std::process::id());
    let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    else {
        return;
    };
    for (name, id, size) in kernels {
        let at = module.get_finalized_function(*id) as usize;
        let _ = writeln!(f, "{at:x} {size:x} tcc_kernel_{name}");
    }
}

/// Rejects IR the JIT cannot link: kernels reach the host only through the helper table.
fn check_kernel_ir(name: &str, func: &cranelift_codegen::ir::Function) -> Result<(), Error> {
    if !func.dfg.ext_funcs.is_empty() {
        return Err(compile_error(
            name,
            "declares external functions; kernels call host code only through the helper \
             table (`call_indirect` on a pointer loaded from `helpers`)",
        ));
    }
    if func
        .global_values
        .values()
        .any(|gv| matches!(gv, GlobalValueData::Symbol { .. }))
    {
        return Err(compile_error(
            name,
            "references a symbol; kernels address memory only through the arena pointer",
        ));
    }
    Ok(())
}
