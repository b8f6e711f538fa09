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
//! - f16/bf16 matmuls (f32 under [`PtxOptions::allow_tf32`]) of at least one 128×128 tile
//!   whose operands are contiguous along `k` or along `m`/`n` run on `wgmma` (sm_90a):
//!   128×128 or 128×256 tiles, three to five stages of swizzled dynamic shared memory
//!   ([`wgmma`]; a TF32 operand contiguous along `m`/`n` is transposed in shared memory);
//! - other f16/bf16 operands, and other f32 operands under TF32, run on
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
//!   whose rows and columns span several domain axes) whose gathers read f16/bf16 runs of
//!   8 elements ([`runs`]: a tap's channels in channels-last activations) run on the
//!   `mma.sync` tiles, each run one 16-byte `cp.async` whose index and padding test the
//!   gather gives at the run's first element; the others (f32, and 16-bit ones without
//!   such runs, widened by their gathers) take the FFMA SGEMM where it has 132 blocks or
//!   runs stream-K (its slots load runs of 4 f32 as one float4 where the gather reads
//!   such runs, [`runs`], else element by element), else the 64×64 FFMA tiles or the
//!   per-element loop: each tile slot evaluates its gather at a clamped row and `k` (what
//!   depends on the row alone is computed once, before the `k` loop; across rows, what
//!   depends on the slot's `k` alone once for its elements) and stores 0 out of range.
//!   With `split_k`, blocks along `z` each sum one slice of `k` (the SGEMM: a run of whole
//!   stages) and add it into the zeroed output with `red.global.add` (the sum's order,
//!   hence its last bits, may change from run to run, as with the scatter kernels).
//!
//! Math: `exp` is `ex2.approx` of `x·log2 e`; `log` is `lg2.approx`; `tanh` is computed
//! from `exp` (a polynomial near 0) because `tanh.approx` is only good to about 1e-3;
//! `erf` uses Abramowitz–Stegun 7.1.26 (absolute error below 1.5e-7); min/max propagate
//! NaN (`.NaN`); integer division floors and gives 0 for a zero divisor, as on the CPU.
//!
//! | file | what it holds |
//! | --- | --- |
//! | `mod.rs` | this overview, the options and launch shapes, the module and the dispatch of each kernel to its emitter |
//! | `px.rs` | the emitter's state [`Px`](px::Px): registers, labels, loads and stores, loops |
//! | `expr.rs` | expression nodes and index arithmetic, load trees, gathers |
//! | `math.rs` | scalar operations (`exp`, `tanh`, `erf`, the RNG's draw, casts, ...) |
//! | `reduce.rs` | reductions: in the thread, or shared by a warp or a block; `argmax` |
//! | `pointwise.rs` | pointwise and reduction kernels, scalar path |
//! | `vector.rs` | pointwise kernels, vector path (`ld/st.global.v4`) |
//! | `per_element.rs` | the per-element matmul (one output element per thread) |
//! | `tiled.rs` | the 64×64 FFMA matmul (small implicit GEMMs, split-K) |
//! | `sgemm.rs` | the 128×128 FFMA SGEMM |
//! | `stream_k.rs` | stream-K for the SGEMM: segments, flags and partial tiles |
//! | `mma.rs` | the `mma.sync` tensor-core matmul, plain or implicit (gathered runs) |
//! | `runs.rs` | which gathers read whole 16-byte runs of one buffer |
//! | `wgmma.rs` | the `wgmma` tensor-core matmul (sm_90a) |
//! | `tile.rs` | what every block-tiled matmul starts from: block prologue, tile origin, thread layouts |
//! | `staging.rs` | operand staging: A and B tiles from global to shared memory |
//! | `epilogue.rs` | the fused epilogue of every matmul |
//! | `attention.rs` | fused attention, exact f32 (FFMA) |
//! | `attention_mma.rs` | fused attention on tensor cores, for 16-bit `q`, `k`, `v` |
//! | `attention_grad.rs` | attention's backward pass on tensor cores, for 16-bit operands |
//! | `attention_ffma_grad.rs` | attention's backward pass, exact f32 (FFMA) |

mod attention;
mod attention_ffma_grad;
mod attention_grad;
mod attention_mma;
mod epilogue;
mod expr;
mod math;
mod mma;
mod per_element;
mod pointwise;
mod px;
mod reduce;
mod runs;
mod sgemm;
mod staging;
mod stream_k;
mod tile;
mod tiled;
mod vector;
mod wgmma;

use crate::kernel::offsets::Offsets;
use crate::kernel::Kernel;
use crate::target::TARGET;
use mma::{emit_mma_matmul, mma_gather_grid, mma_grid, GatherPlan, MmaKind};
use sgemm::{emit_sgemm, sgemm_grid, SgGrid};
use std::fmt::Write;
use tiled::{emit_tiled_matmul, tiled_grid};

/// The module's dynamic shared memory (declared when a kernel launches with some).
const DYN_SHARED: &str = "tcc_dyn_s";

/// Threads per block of every kernel.
pub const BLOCK: u32 = 256;
/// Streaming multiprocessors of the GPU whose waves the tile choices count
/// ([`TargetInfo::sms`](crate::target::TargetInfo::sms)).
const SMS: usize = TARGET.sms;
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
    offsets: &Offsets,
    opts: PtxOptions,
) -> Res<(String, Vec<LaunchShape>)> {
    let mut body = String::new();
    let mut launches = Vec::new();
    for k in kernels {
        let (text, launch) = emit_kernel(k, offsets, opts)?;
        body.push_str(&text);
        body.push('\n');
        launches.push(launch);
    }
    // `wgmma` needs the architecture-specific target (sm_90a: Hopper only).
    let target = if body.contains("wgmma.") {
        format!("{}a", TARGET.arch)
    } else {
        TARGET.arch.to_string()
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
/// partial tiles ([`stream_k`]), or 0. It takes the buffers' offsets because the path a
/// product runs on does ([`matmul_path`]: a gathered 16-bit operand runs on tensor cores
/// only from a 16-byte aligned buffer); the scratch region lies after every buffer, so
/// sizing it once they are placed moves none of them.
pub fn scratch_bytes(k: &Kernel, offsets: &Offsets, opts: PtxOptions) -> u64 {
    match matmul_path(k, offsets, opts) {
        Some(MatmulPath::Sgemm(sg)) => sg.stream_k.map_or(0, stream_k::scratch_bytes),
        _ => 0,
    }
}

/// The kernel a product runs on, first that applies: Hopper's wgmma, the tensor-core
/// `mma.sync` tiles (plain, then gathered), the FFMA SGEMM, the small FFMA tile.
enum MatmulPath {
    Wgmma(wgmma::Plan),
    Mma(MmaKind, [u32; 3]),
    MmaGathered(MmaKind, [u32; 3], GatherPlan),
    Sgemm(SgGrid),
    Tiled([u32; 3]),
}

/// The path of `k`'s product ([`MatmulPath`]), or `None` for a kernel that is no product
/// (attention included) or that no product kernel takes (then it runs as pointwise code).
fn matmul_path(k: &Kernel, offsets: &Offsets, opts: PtxOptions) -> Option<MatmulPath> {
    let mm = k.matmul.as_ref().filter(|_| k.attention.is_none())?;
    if let Some(plan) = wgmma::plan(mm, offsets, opts) {
        return Some(MatmulPath::Wgmma(plan));
    }
    if let Some((kind, grid)) = mma_grid(mm, opts) {
        return Some(MatmulPath::Mma(kind, grid));
    }
    if let Some((kind, grid, plan)) = mma_gather_grid(k, mm, offsets) {
        return Some(MatmulPath::MmaGathered(kind, grid, plan));
    }
    if let Some(sg) = sgemm_grid(mm) {
        return Some(MatmulPath::Sgemm(sg));
    }
    tiled_grid(mm).map(MatmulPath::Tiled)
}

fn emit_kernel(k: &Kernel, offsets: &Offsets, opts: PtxOptions) -> Res<(String, LaunchShape)> {
    if let Some(at) = &k.attention {
        if let Some(gr) = &at.grad {
            if at.q.dtype == crate::ir::DType::F32 {
                return attention_ffma_grad::emit(k, at, gr, offsets);
            }
            return attention_grad::emit(k, at, gr, offsets);
        }
        if let Some(kind) = attention_mma::plan(at, offsets) {
            return attention_mma::emit(k, at, kind, offsets);
        }
        return attention::emit(k, at, offsets);
    }
    if let (Some(mm), Some(path)) = (&k.matmul, matmul_path(k, offsets, opts)) {
        return match path {
            MatmulPath::Wgmma(plan) => wgmma::emit(k, mm, &plan, offsets),
            MatmulPath::Mma(kind, grid) => emit_mma_matmul(k, mm, kind, grid, offsets, None),
            MatmulPath::MmaGathered(kind, grid, plan) => {
                emit_mma_matmul(k, mm, kind, grid, offsets, Some(&plan))
            }
            MatmulPath::Sgemm(sg) => emit_sgemm(k, mm, sg, offsets, opts.scratch_offset),
            MatmulPath::Tiled(grid) => emit_tiled_matmul(k, mm, grid, offsets),
        };
    }
    pointwise::emit(k, offsets)
}
