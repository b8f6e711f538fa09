//! The `mma.sync` tensor-core matmul (f16/bf16, or TF32 with `--allow-tf32`) where Hopper's
//! wgmma ([`super::wgmma`]) does not take the product: 128×128 block tiles, `cp.async`
//! double buffering, `ldmatrix` fragments.

use super::epilogue::{epilogue, epilogue_coords};
use super::expr::index_ranges;
use super::px::{f32_lit, Px};
use super::runs::{run_of, Run};
use super::staging::{
    chunk_copy, copy_elements, next_stage, stage_chunk, stage_k0, ChunkSlot, ElementChunk,
};
use super::tile::{operand_buffer, warp_tile, TileOrigin, WarpTile};
use super::{LaunchShape, PtxOptions, Res, BLOCK};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{ExprId, Gather, Kernel, Matmul};
use std::collections::HashMap;

/// Precision of the tensor-core matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MmaKind {
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
    pub(super) fn of(mm: &Matmul, opts: PtxOptions) -> Option<MmaKind> {
        if !mm.is_plain() {
            return None;
        }
        MmaKind::of_dtypes(mm.a.dtype, mm.b.dtype, opts.allow_tf32)
    }

    /// The kind for operands of these dtypes (f32 only with `tf32`).
    fn of_dtypes(a: DType, b: DType, tf32: bool) -> Option<MmaKind> {
        match (a, b) {
            (DType::F16, DType::F16) => Some(MmaKind::F16),
            (DType::BF16, DType::BF16) => Some(MmaKind::Bf16),
            (DType::F32, DType::F32) if tf32 => Some(MmaKind::Tf32),
            _ => None,
        }
    }

    pub(super) fn elem_bytes(self) -> usize {
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
    pub(super) fn chunk(self) -> usize {
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

    pub(super) fn instr(self) -> &'static str {
        match self {
            MmaKind::F16 => "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            MmaKind::Bf16 => "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            MmaKind::Tf32 => "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        }
    }
}

/// The grid of the tensor-core matmul, or `None` where it does not apply.
pub(super) fn mma_grid(mm: &Matmul, opts: PtxOptions) -> Option<(MmaKind, [u32; 3])> {
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

/// How an implicit GEMM whose gathers read 16-bit runs ([`run_of`]) stages its tiles on
/// tensor cores: A's runs go along `k` (its tile is `[row][k]`, as a plain A's); B's go
/// along `k` (a `[column][k]` tile, read by `ldmatrix` without `.trans`) or along the
/// columns (a `[k][column]` tile, as a plain B's).
#[derive(Clone, Copy, Debug)]
pub(super) struct GatherPlan {
    a: Run,
    b: Run,
    /// A's runs go along `k` (its tile `[row][k]`); else along its rows (`[k][row]`, read
    /// by `ldmatrix.trans`: a weight gradient's `dy` in channels-last).
    a_along_k: bool,
    b_along_k: bool,
    /// Blocks along `z` that share an output tile, each summing `depth` stages of `k` and
    /// adding its part into the zeroed output (a split-K weight gradient).
    splits: usize,
    depth: usize,
}

/// Elements of a gathered run: one 16-byte chunk of 16-bit values.
const RUN: usize = 8;

/// The tensor-core plan of an implicit GEMM (both operands gathered), or `None` where a
/// gather does not read whole aligned runs of one f16 or bf16 buffer (then the FFMA tiles
/// run it).
pub(super) fn mma_gather_grid(
    k: &Kernel,
    mm: &Matmul,
    offsets: &Offsets,
) -> Option<(MmaKind, [u32; 3], GatherPlan)> {
    let (Some(ga), Some(gb)) = (&mm.a.gather, &mm.b.gather) else {
        return None;
    };
    if !mm.batch.is_empty() || mm.k == 0 {
        return None;
    }
    if mm.m < 16 || mm.n < 16 || mm.m * mm.n < 4096 {
        return None;
    }
    let ranges = index_ranges(k);
    let run = RUN as i64;
    // Runs along `k` need whole runs of k; along the rows or columns, whole runs of those.
    let along = |g: &Gather, k_var, other_var, other: usize| match run_of(
        &k.pool,
        &ranges,
        g.value,
        (k_var, mm.k),
        run,
    ) {
        Some(r) => Some((r, true)),
        None => run_of(&k.pool, &ranges, g.value, (other_var, other), run).map(|r| (r, false)),
    };
    let (a, a_along_k) = along(ga, ga.col, ga.row, mm.m)?;
    let (b, b_along_k) = along(gb, gb.row, gb.col, mm.n)?;
    let kind = MmaKind::of_dtypes(a.dtype, b.dtype, false)?;
    // 16-byte copies need 16-byte aligned buffers (runs start at multiples of 8 elements).
    if [a.buf, b.buf]
        .iter()
        .any(|&buf| offsets.get(buf).is_none_or(|o| o % 16 != 0))
    {
        return None;
    }
    let (gx, gy) = (mm.n.div_ceil(MMA_BN), mm.m.div_ceil(MMA_BM));
    if gy > 65535 || gx > i32::MAX as usize {
        return None;
    }
    // A split-K kernel (its store accumulates into a zeroed output) takes the lowering's
    // splits (`lower::conv_split_k`, which counts these 128×128 tiles for widened 16-bit
    // operands), as whole stages each.
    let nk = mm.k.div_ceil(kind.bk());
    let splits = mm.split_k.clamp(1, nk.min(65535));
    let depth = nk.div_ceil(splits);
    let splits = nk.div_ceil(depth);
    let plan = GatherPlan {
        a,
        b,
        a_along_k,
        b_along_k,
        splits,
        depth,
    };
    Some((kind, [gx as u32, gy as u32, splits as u32], plan))
}

/// One thread's 16-byte chunk of a gathered tile: its shared offset within a stage, its
/// row (A) or column (B) and whether that is in range, the cache of what depends on that
/// row or column alone (an index into [`GatheredSide::fixed`]), and its `k` offset
/// within the stage.
struct GatheredSlot {
    smem: String,
    ok: String,
    at: String,
    fixed: usize,
    kk: String,
}

/// One gathered operand's staging: its run, gather and buffer, and the thread's chunks.
struct GatheredSide<'a> {
    run: Run,
    g: &'a Gather,
    a_side: bool,
    /// The runs go along `k` (else along B's columns).
    along_k: bool,
    buf: String,
    slots: Vec<GatheredSlot>,
    fixed: Vec<HashMap<ExprId, String>>,
}

impl GatheredSide<'_> {
    /// Copies this side's chunks of the stage of `k0` (i64 register) into the buffer at
    /// shared byte `st`: each chunk's index and padding test are the gather's, at its row
    /// (or column) and first `k`, both clamped into range; out of range it reads zeros.
    fn load(&self, px: &mut Px, st: &str, k0: &str, kd: usize) -> Res<()> {
        let k_var = if self.a_side { self.g.col } else { self.g.row };
        let (_, k_nodes) = px.fixed_nodes(Some(self.g), !self.a_side);
        let last = kd - if self.along_k { RUN } else { 1 };
        // What depends on `k` alone, once for each distinct `k` of the thread's chunks.
        let mut by_k: Vec<(String, String, String, HashMap<ExprId, String>)> = Vec::new();
        for s in &self.slots {
            if by_k.iter().any(|(kk, ..)| *kk == s.kk) {
                continue;
            }
            let kg = px.fresh("rd");
            px.line(format!("add.s64 {kg}, {k0}, {};", s.kk));
            let kc = px.fresh("rd");
            px.line(format!("min.s64 {kc}, {kg}, {last};"));
            let cache = px.gather_fixed_part(&k_nodes, k_var, &kc)?;
            by_k.push((s.kk.clone(), kg, kc, cache));
        }
        let mut roots = vec![self.run.index];
        roots.extend(self.run.guard);
        for s in &self.slots {
            let Some((_, kg, kc, kcache)) = by_k.iter().find(|(kk, ..)| *kk == s.kk) else {
                return Err(px.unsupported("a gathered chunk's k part"));
            };
            let mut cache = self.fixed.get(s.fixed).cloned().unwrap_or_default();
            cache.extend(kcache.iter().map(|(e, r)| (*e, r.clone())));
            let coords = if self.a_side {
                (s.at.as_str(), kc.as_str())
            } else {
                (kc.as_str(), s.at.as_str())
            };
            let vals = px.gather_nodes(self.g, &roots, coords, &cache)?;
            let p = px.fresh("p");
            px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {};", s.ok));
            if let Some(guard) = vals.get(1) {
                px.line(format!("and.pred {p}, {p}, {guard};"));
            }
            let dst = px.fresh("r");
            px.line(format!("add.u32 {dst}, {st}, {};", s.smem));
            chunk_copy(px, &dst, &self.buf, &vals[0], &p, 2);
        }
        Ok(())
    }
}

/// The gathered sides of an implicit GEMM on tensor cores: each thread's two chunks of
/// each tile (`t` and `t + 256`), and what depends on their rows and columns alone.
fn gathered_sides<'a>(
    px: &mut Px,
    mm: &'a Matmul,
    plan: &GatherPlan,
    (t, row0, col0): (&str, &str, &str),
    (b_row, a_bytes): (usize, usize),
) -> Res<[GatheredSide<'a>; 2]> {
    let (Some(ga), Some(gb)) = (&mm.a.gather, &mm.b.gather) else {
        return Err(px.unsupported("a tensor-core implicit GEMM without two gathers"));
    };
    let (m, n) = (mm.m, mm.n);
    let mut sides = Vec::new();
    for (a_side, run, g) in [(true, plan.a, ga), (false, plan.b, gb)] {
        let along_k = if a_side {
            plan.a_along_k
        } else {
            plan.b_along_k
        };
        // Where this side's tile starts in a stage.
        let tile = if a_side { 0 } else { a_bytes };
        let (buf, _) = operand_buffer(px, run.buf)?;
        // `[row or column][k]` tiles: 4 chunks of 8 `k` a row, the thread's `k` offset
        // `(t % 4) * 8` for both chunks. `[k][column]`: 16 chunks a `k` row, the thread's
        // columns `(t % 16) * 8` for both chunks, its `k` rows `t / 16` and 16 more.
        let kk_run = if along_k {
            let (kc, kk) = (px.fresh("r"), px.fresh("rd"));
            px.line(format!("and.b32 {kc}, {t}, 3;"));
            px.line(format!("mul.wide.u32 {kk}, {kc}, {RUN};"));
            Some((kc, kk))
        } else {
            None
        };
        let (first, extent) = if a_side { (row0, m) } else { (col0, n) };
        let (fixed_var, nodes) = px.fixed_nodes(Some(g), a_side);
        let mut slots = Vec::new();
        let mut fixed: Vec<HashMap<ExprId, String>> = Vec::new();
        for i in 0..2u32 {
            let cidx = px.fresh("r");
            px.line(format!("add.u32 {cidx}, {t}, {};", 256 * i));
            let (x, smem, kk) = match &kk_run {
                Some((kc, kk)) => {
                    let (x, so) = (px.fresh("r"), px.fresh("r"));
                    px.line(format!("shr.u32 {x}, {cidx}, 2;"));
                    px.line(format!("mul.lo.u32 {so}, {x}, {MMA_A_ROW};"));
                    px.line(format!("mad.lo.u32 {so}, {kc}, 16, {so};"));
                    if tile > 0 {
                        px.line(format!("add.u32 {so}, {so}, {tile};"));
                    }
                    (x, so, kk.clone())
                }
                None => {
                    let (krow, nc, x, so) =
                        (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
                    let cpr = (MMA_BN / RUN) as u32;
                    px.line(format!("div.u32 {krow}, {cidx}, {cpr};"));
                    px.line(format!("rem.u32 {nc}, {cidx}, {cpr};"));
                    px.line(format!("mul.lo.u32 {x}, {nc}, {RUN};"));
                    px.line(format!("mul.lo.u32 {so}, {krow}, {b_row};"));
                    px.line(format!("mad.lo.u32 {so}, {nc}, 16, {so};"));
                    if tile > 0 {
                        px.line(format!("add.u32 {so}, {so}, {tile};"));
                    }
                    let kk = px.fresh("rd");
                    px.line(format!("cvt.u64.u32 {kk}, {krow};"));
                    (x, so, kk)
                }
            };
            let gx = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {gx}, {x};"));
            px.line(format!("add.s64 {gx}, {gx}, {first};"));
            let ok = px.fresh("p");
            px.line(format!("setp.lt.s64 {ok}, {gx}, {extent};"));
            // Runs along the columns start at multiples of 8: clamp to the last one.
            let last = extent - if along_k { 1 } else { RUN };
            let at = px.fresh("rd");
            px.line(format!("min.s64 {at}, {gx}, {last};"));
            fixed.push(px.gather_fixed_part(&nodes, fixed_var, &at)?);
            slots.push(GatheredSlot {
                smem,
                ok,
                at,
                fixed: fixed.len() - 1,
                kk,
            });
        }
        sides.push(GatheredSide {
            run,
            g,
            a_side,
            along_k,
            buf,
            slots,
            fixed,
        });
    }
    let [a, b]: [GatheredSide; 2] = sides
        .try_into()
        .map_err(|_| px.unsupported("implicit GEMM sides"))?;
    Ok([a, b])
}

/// One thread's 16-bit chunk of a tile staged `[k][row or column]`, 16 chunks a `k`: its
/// `k` row and chunk within the row, its first row (or column) and whether it is in range,
/// and its element index at `k = 0`.
struct MnChunk {
    krow: String,
    nc: String,
    g: String,
    ok: String,
    base: String,
}

/// The [`MnChunk`] of chunk `cidx` for rows (or columns) from `origin` below `extent`, of an
/// operand with stride `stride` along them from element `opbase`.
fn mn_chunk(
    px: &mut Px,
    cidx: &str,
    ch: usize,
    (origin, extent): (&str, usize),
    (stride, opbase): (i64, &str),
) -> MnChunk {
    let cpr = (MMA_BN / ch) as u32;
    let (krow, nc) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("div.u32 {krow}, {cidx}, {cpr};"));
    px.line(format!("rem.u32 {nc}, {cidx}, {cpr};"));
    let g = px.fresh("rd");
    px.line(format!("mul.wide.u32 {g}, {nc}, {ch};"));
    px.line(format!("add.s64 {g}, {g}, {origin};"));
    let ok = px.fresh("p");
    px.line(format!("setp.lt.s64 {ok}, {g}, {extent};"));
    let base = px.fresh("rd");
    px.line(format!("mad.lo.s64 {base}, {g}, {stride}, {opbase};"));
    MnChunk {
        krow,
        nc,
        g,
        ok,
        base,
    }
}

/// A [`MnChunk`]'s shared offset in a stage (its tile at byte `tile`, rows of `row` bytes),
/// its `k` offset and its element index there (`k_stride` apart along `k`).
fn mn_chunk_at(
    px: &mut Px,
    c: &MnChunk,
    row: usize,
    tile: usize,
    k_stride: i64,
) -> (String, String, String) {
    let so = px.fresh("r");
    px.line(format!("mul.lo.u32 {so}, {}, {row};", c.krow));
    px.line(format!("mad.lo.u32 {so}, {}, 16, {so};", c.nc));
    if tile > 0 {
        px.line(format!("add.u32 {so}, {so}, {tile};"));
    }
    let kk = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {kk}, {};", c.krow));
    let b2 = px.fresh("rd");
    px.line(format!("mad.lo.s64 {b2}, {kk}, {k_stride}, {};", c.base));
    (so, kk, b2)
}

/// Tensor-core matmul (`mma.sync`, f32 accumulation) with the fused epilogue: 128×128 block
/// tiles of 256 threads (8 warps of 64×32, each 4×4 `mma` tiles of 16×8), `k` staged 64
/// bytes deep through two shared-memory buffers, the next stage's copies
/// (`cp.async` 16-byte chunks where the operand is contiguous and aligned, else element
/// loads) overlapping the current stage's math. A fragments come from `ldmatrix`
/// (`ldmatrix.trans` for an A contiguous along its rows, staged `[k][row]`); B
/// fragments from `ldmatrix.trans` (f16/bf16) or 32-bit shared loads (TF32, rounded with
/// `cvt.rna.tf32.f32`, as are the A fragments). Out-of-range chunks read zeros; every
/// thread runs every barrier and only out-of-range elements skip their epilogue.
pub(super) fn emit_mma_matmul(
    k: &Kernel,
    mm: &Matmul,
    kind: MmaKind,
    grid: [u32; 3],
    offsets: &Offsets,
    plan: Option<&GatherPlan>,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offsets, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let eb = kind.elem_bytes();
    let (bk, ch, b_row) = (kind.bk(), kind.chunk(), kind.b_row());
    // A B tile gathered along `k` is `[column][k]`, rows as long as A's; an A tile
    // gathered along its rows is `[k][row]`, rows as long as B's.
    let b_kmajor = plan.is_some_and(|p| p.b_along_k);
    // A plain A contiguous along its rows (a transposed operand: attention's `pᵀ` and
    // `dsᵀ`) is staged as `[k][row]` in whole chunks, read by `ldmatrix.trans` as a
    // gathered A along its rows is.
    let c = ch as i64;
    let aligned = |o: &crate::kernel::Operand, off: u64| {
        o.base % c == 0 && o.batch_strides.iter().all(|s| s % c == 0) && off.is_multiple_of(16)
    };
    let a_rows = plan.is_none()
        && kind != MmaKind::Tf32
        && mm.a.gather.is_none()
        && mm.a.rs == 1
        && mm.a.cs != 1
        && m % ch == 0
        && mm.a.cs % c == 0
        && offsets.get(mm.a.buf).is_some_and(|off| aligned(&mm.a, off));
    let a_kmajor = plan.map_or(!a_rows, |p| p.a_along_k);
    let a_bytes = if a_kmajor { MMA_A_BYTES } else { bk * b_row };
    let stage = match (a_kmajor, b_kmajor) {
        (true, false) => kind.stage_bytes(),
        (_, b) => a_bytes + if b { MMA_BN * MMA_A_ROW } else { bk * b_row },
    };
    // A split-K block sums the stages from `kbase` (its split's first `k`).
    let splits = plan.map_or(1, |p| p.splits);
    let nk = plan.map_or(kd.div_ceil(bk), |p| p.depth);
    let kbase = (splits > 1).then(|| {
        let (z, kb) = (px.fresh("r"), px.fresh("rd"));
        px.line(format!("mov.u32 {z}, %ctaid.z;"));
        px.line(format!("mul.wide.u32 {kb}, {z}, {};", nk * bk));
        kb
    });

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
    let a_fast = mm.a.cs == 1 && kd % ch == 0 && mm.a.rs % c == 0 && aligned(&mm.a, aoff);
    let b_fast = mm.b.cs == 1 && n % ch == 0 && mm.b.rs % c == 0 && aligned(&mm.b, boff);

    // Each thread moves chunks `t` and `t + 256` of each tile. A: 4 chunks a row of 128
    // rows; B: `bk` rows of `MMA_BN / ch` chunks.
    let mut a_slots = Vec::new();
    let mut a_rows_slots = Vec::new();
    let mut b_slots = Vec::new();
    let gathered = match plan {
        Some(plan) => Some(gathered_sides(
            &mut px,
            mm,
            plan,
            (&t, &row0, &col0),
            (b_row, a_bytes),
        )?),
        None => None,
    };
    for i in 0..if gathered.is_some() { 0 } else { 2u32 } {
        let cidx = px.fresh("r");
        px.line(format!("add.u32 {cidx}, {t}, {};", 256 * i));
        // A: 4 chunks along `k` a row; or, staged `[k][row]`, `MMA_BM / ch` chunks along
        // the rows a `k`.
        if !a_kmajor {
            a_rows_slots.push(mn_chunk(&mut px, &cidx, ch, (&row0, m), (mm.a.rs, &abase)));
        } else {
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
        }
        // B.
        b_slots.push(mn_chunk(&mut px, &cidx, ch, (&col0, n), (mm.b.cs, &bbase)));
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
    // `[k][row]` A chunks (whole chunks: `m % ch == 0`), then B's `[k][column]` ones.
    for slot in &a_rows_slots {
        let (so, kk, b2) = mn_chunk_at(&mut px, slot, b_row, 0, mm.a.cs);
        a_sm.push((so, kk, b2, slot.ok.clone()));
    }
    let mut b_sm = Vec::new();
    for slot in &b_slots {
        let (so, kk, b2) = mn_chunk_at(&mut px, slot, b_row, a_bytes, mm.b.rs);
        b_sm.push((so, kk, b2, slot.ok.clone(), slot.g.clone()));
    }

    // Moves the stage of `k0` (i64 register) into the buffer at shared byte `st` (u32).
    let load_stage = |px: &mut Px, st: &str, k0: &str| {
        // A: chunk at row, k = k0 + kk .. + ch.
        for (so, kk, base, ok) in &a_sm {
            let slot = ChunkSlot {
                smem: so,
                kk,
                base,
                k_stride: mm.a.cs,
            };
            let (dst, kg, idx) = stage_chunk(px, st, k0, slot);
            if a_fast || !a_kmajor {
                let p = px.fresh("p");
                px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {ok};"));
                chunk_copy(px, &dst, &abuf, &idx, &p, eb);
            } else {
                let c = ElementChunk {
                    dst: &dst,
                    buf: &abuf,
                    idx: &idx,
                    stride: mm.a.cs,
                    eb,
                    count: ch,
                };
                copy_elements(px, &c, (&kg, kd, ok));
            }
        }
        // B: chunk at k = k0 + kk, columns col .. + ch.
        for (so, kk, base, ok, g_col) in &b_sm {
            let slot = ChunkSlot {
                smem: so,
                kk,
                base,
                k_stride: mm.b.rs,
            };
            let (dst, kg, idx) = stage_chunk(px, st, k0, slot);
            let pk = px.fresh("p");
            px.line(format!("setp.lt.s64 {pk}, {kg}, {kd};"));
            if b_fast {
                let p = px.fresh("p");
                px.line(format!("and.pred {p}, {pk}, {ok};"));
                chunk_copy(px, &dst, &bbuf, &idx, &p, eb);
            } else {
                let c = ElementChunk {
                    dst: &dst,
                    buf: &bbuf,
                    idx: &idx,
                    stride: mm.b.cs,
                    eb,
                    count: ch,
                };
                copy_elements(px, &c, (g_col, n, &pk));
            }
        }
        px.line("cp.async.commit_group;");
    };

    // Fragment addresses (relative to the stage). A (`ldmatrix.x4`): lane l reads row
    // `l % 16` of the warp's 16-row tile at k offset `(l / 16) * 16` bytes.
    let a_ld = px.fresh("r");
    let tmp = px.fresh("r");
    let hi = if a_kmajor {
        px.line(format!("and.b32 {tmp}, {lane}, 15;"));
        px.line(format!("mad.lo.u32 {tmp}, {wm}, 64, {tmp};"));
        px.line(format!("mul.lo.u32 {a_ld}, {tmp}, {MMA_A_ROW};"));
        let hi = px.fresh("r");
        px.line(format!("shr.u32 {hi}, {lane}, 4;"));
        px.line(format!("mad.lo.u32 {a_ld}, {hi}, 16, {a_ld};"));
        hi
    } else {
        // A as `[k][row]` (`ldmatrix.x4.trans`): lane l reads k row
        // `l % 8 + (l / 16) * 8` at row `wm*64 + ((l / 8) % 2) * 8`, so that the four
        // matrices are a0..a3 of the 16×16 fragment.
        let (hi, r8) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("shr.u32 {hi}, {lane}, 4;"));
        px.line(format!("and.b32 {tmp}, {lane}, 7;"));
        px.line(format!("mad.lo.u32 {tmp}, {hi}, 8, {tmp};"));
        px.line(format!("mul.lo.u32 {a_ld}, {tmp}, {b_row};"));
        px.line(format!("shr.u32 {r8}, {lane}, 3;"));
        px.line(format!("and.b32 {r8}, {r8}, 1;"));
        px.line(format!("mad.lo.u32 {r8}, {wm}, 8, {r8};"));
        px.line(format!("mad.lo.u32 {a_ld}, {r8}, 16, {a_ld};"));
        hi
    };
    px.line(format!("add.u32 {a_ld}, {a_ld}, {sbase};"));
    let b_ld = px.fresh("r");
    if kind == MmaKind::Tf32 {
        // B (32-bit loads): b0 at (k = tg, n = g), b1 at k + 4.
        let col = px.fresh("r");
        px.line(format!("mad.lo.u32 {col}, {wn}, 32, {g};"));
        px.line(format!("mul.lo.u32 {b_ld}, {tg}, {b_row};"));
        px.line(format!("mad.lo.u32 {b_ld}, {col}, 4, {b_ld};"));
    } else if b_kmajor {
        // B as `[column][k]` (`ldmatrix.x4`): lane l reads column
        // `wn*32 + l % 8 + (l / 16) * 8` at k byte offset `((l / 8) % 2) * 16`, so that the
        // four matrices are b0 and b1 of two 8-column tiles, as `.trans` gives them.
        let (col, kb) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("and.b32 {col}, {lane}, 7;"));
        px.line(format!("mad.lo.u32 {col}, {hi}, 8, {col};"));
        px.line(format!("mad.lo.u32 {col}, {wn}, 32, {col};"));
        px.line(format!("shr.u32 {kb}, {lane}, 3;"));
        px.line(format!("and.b32 {kb}, {kb}, 1;"));
        px.line(format!("mul.lo.u32 {b_ld}, {col}, {MMA_A_ROW};"));
        px.line(format!("mad.lo.u32 {b_ld}, {kb}, 16, {b_ld};"));
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
    px.line(format!("add.u32 {b_ld}, {b_ld}, {a_bytes};"));
    px.line(format!("add.u32 {b_ld}, {b_ld}, {sbase};"));

    // Accumulators acc[mi][nj][r].
    let accs: Vec<String> = (0..64).map(|_| px.fresh("f")).collect();
    for a in &accs {
        px.line(format!("mov.f32 {a}, {};", f32_lit(0.0)));
    }
    let af: Vec<String> = (0..16).map(|_| px.fresh("r")).collect();
    let bf: Vec<String> = (0..8).map(|_| px.fresh("r")).collect();

    let zero = match &kbase {
        Some(kb) => kb.clone(),
        None => {
            let zero = px.fresh("rd");
            px.line(format!("mov.s64 {zero}, 0;"));
            zero
        }
    };
    // One stage's copies: the gathered sides' runs, or the plain operands' chunks.
    let copy_stage = |px: &mut Px, st: &str, k0: &str| -> Res<()> {
        match &gathered {
            Some(sides) => {
                for side in sides {
                    side.load(px, st, k0, kd)?;
                }
                px.line("cp.async.commit_group;");
            }
            None => load_stage(px, st, k0),
        }
        Ok(())
    };
    copy_stage(&mut px, &sbase, &zero)?;
    let kt = px.fresh("r");
    px.line(format!("mov.u32 {kt}, 0;"));
    let head = px.label("mma_k");
    let wait0 = px.label("mma_wait0");
    let synced = px.label("mma_sync");
    px.body.push_str(&format!("{head}:\n"));
    let (ktn, _) = next_stage(&mut px, &kt, 1, nk, &wait0);
    {
        let st = px.fresh("r");
        px.line(format!("and.b32 {st}, {ktn}, 1;"));
        px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {sbase};"));
        let k0 = stage_k0(&mut px, &ktn, bk);
        if let Some(kb) = &kbase {
            px.line(format!("add.s64 {k0}, {k0}, {kb};"));
        }
        copy_stage(&mut px, &st, &k0)?;
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
            if !a_kmajor {
                px.line(format!(
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{}}}, [{ac}+{}];",
                    r.join(", "),
                    ks * 16 * b_row + mi * 16 * 2
                ));
                continue;
            }
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
        } else if b_kmajor {
            for p in 0..2 {
                px.line(format!(
                    "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{}}}, [{bc}+{}];",
                    bf[p * 4..p * 4 + 4].join(", "),
                    p * 16 * MMA_A_ROW + kbytes
                ));
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
    // An implicit GEMM's gathers keep their rows' and columns' coordinates in registers:
    // ptxas took 132 a thread for a conv's input gradient, which leaves one block of 256
    // threads an SM. At most 128 lets two run, one's copies and index arithmetic beside
    // the other's tensor-core math.
    let bounds = plan.map(|_| (BLOCK, 2));
    Ok((
        px.finish_bounded(&shared, bounds),
        LaunchShape {
            grid,
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}
