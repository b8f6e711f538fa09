//! The large-tile FFMA SGEMM: 128×128 tiles (or 128×64, 64×128) with 8×8 per thread, `k`
//! staged 8 deep through two buffers, stream-K where whole tiles would fill their waves badly.
//! Plain matmuls, and f32 implicit GEMMs (convolutions: gathered operands, [`SgSlot`]'s
//! gathered slots; weight gradients split along `k`, [`split_stages`]).

use super::epilogue::{epilogue, epilogue_coords, epilogue_vectors, EPILOGUE_PREFETCH_REGS};
use super::expr::index_ranges;
use super::px::{f32_lit, Px};
use super::runs::run_of;
use super::staging::{SgSide, SgSlot};
use super::stream_k;
use super::tile::{block_prologue, ffma_tile, thread_xy, tile_origin, FfmaTile, TileOrigin};
use super::{LaunchShape, Res, BLOCK, SMS};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{Gather, Kernel, Matmul, MmAxis};

/// Large-tile FFMA SGEMM: rows and columns of the block tile (one of them is 64 where the
/// matmul's `m` or `n` is at most 64, as in attention's `[T, T] @ [T, 64]`).
pub(super) const SG_BM: usize = 128;
pub(super) const SG_BN: usize = 128;
/// Depth of one `k` stage.
pub(super) const SG_BK: usize = 8;
/// Floats per shared row (`[k][m]` for A, `[k][n]` for B), padded by 4.
pub(super) const SG_STRIDE: usize = 132;
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
pub(super) struct SgGrid {
    pub(super) grid: [u32; 3],
    pub(super) tile: (usize, usize),
    /// Stream-K: the blocks (the grid's `x`) that share the tiles' stages ([`stream_k`]).
    pub(super) stream_k: Option<usize>,
}

/// The grid of the large-tile SGEMM (exact f32), or `None` where the 64×64 one is used.
pub(super) fn sgemm_grid(mm: &Matmul) -> Option<SgGrid> {
    // Plain matmuls, and implicit GEMMs (gathered operands: convolutions), also split
    // along `k` (weight gradients: [`split_stages`]) where they skip no terms.
    let implicit =
        (mm.a.gather.is_some() || mm.b.gather.is_some()) && (mm.split_k <= 1 || mm.skip.is_empty());
    if mm.a.dtype != DType::F32 || mm.b.dtype != DType::F32 || !(mm.is_plain() || implicit) {
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
    if (bm, bn) == (SG_BM, SG_BN) && mm.skip.is_empty() && mm.split_k <= 1 {
        let tiles = gx.saturating_mul(gy).saturating_mul(batch);
        if let Some(ctas) = stream_k::choose(tiles, mm.k.div_ceil(SG_BK)) {
            return Some(SgGrid {
                grid: [ctas as u32, 1, 1],
                tile: (bm, bn),
                stream_k: Some(ctas),
            });
        }
    }
    // Split-K: the blocks of one output tile are consecutive along z.
    let gz = batch.saturating_mul(mm.split_k.max(1));
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
pub(super) fn emit_sgemm(
    k: &Kernel,
    mm: &Matmul,
    SgGrid {
        grid,
        tile: (bm, bn),
        stream_k,
    }: SgGrid,
    offsets: &Offsets,
    scratch: u64,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offsets, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let row_bytes = SG_STRIDE * 4;
    // A stage is `sub` slices of 8 `k`, each thread moving 4 elements of each operand per
    // slice; `tile` is one operand's bytes of a stage.
    let sub = sgemm_slices(bm, bn);
    let bk = SG_BK * sub;
    let tile = SG_TILE * sub;

    let nk = kd.div_ceil(bk);
    let (tile_of, seg) = match stream_k {
        None => (ffma_tile(&mut px, mm, (bm, bn), mm.split_k, true)?, None),
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
        split,
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
    // A gathered operand moves the way its memory is contiguous, one element at a time.
    let a_k = match &mm.a.gather {
        Some(g) => g.k_fast,
        None => !(mm.a.cs != 1 && mm.a.rs == 1),
    };
    let a_vec = mm.a.gather.is_none()
        && if a_k {
            mm.a.cs == 1 && kd % 4 == 0 && mm.a.rs % 4 == 0
        } else {
            m % 4 == 0 && mm.a.cs % 4 == 0
        }
        && aligned4(&mm.a, aoff);
    let b_k = match &mm.b.gather {
        Some(g) => g.k_fast,
        None => mm.b.cs != 1 && mm.b.rs == 1,
    };
    let b_vec = mm.b.gather.is_none()
        && if b_k {
            kd % 4 == 0 && mm.b.cs % 4 == 0
        } else {
            mm.b.cs == 1 && n % 4 == 0 && mm.b.rs % 4 == 0
        }
        && aligned4(&mm.b, boff);
    // A gathered side whose slot's 4 elements are one run of f32 (a channels-last window's
    // 4 channels of one tap) loads them as one vector.
    let ranges = index_ranges(k);
    let run = |g: Option<&Gather>, k_major: bool, a_side: bool, extent: usize| {
        let g = g?;
        let var = if k_major == a_side { g.col } else { g.row };
        let along = if k_major { kd } else { extent };
        run_of(&k.pool, &ranges, g.value, (var, along), 4)
            .filter(|r| r.dtype == DType::F32 && offsets.get(r.buf).is_some_and(|o| o % 16 == 0))
    };
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
            gather: mm.a.gather.as_ref(),
            a_side: true,
            run: run(mm.a.gather.as_ref(), a_k, true, m),
        },
    )?;
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
            gather: mm.b.gather.as_ref(),
            a_side: false,
            run: run(mm.b.gather.as_ref(), b_k, false, n),
        },
    )?;
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
                    slot.load(px, &ks, kd, regs)?;
                }
            }
        }
        Ok::<(), super::PtxError>(())
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
    let range = match (&seg, &split) {
        (Some(s), _) => Some((s.kb.clone(), s.ke.clone())),
        (None, Some(s)) => Some(split_stages(&mut px, s, nk, mm.split_k)),
        (None, None) => stage_range(&mut px, mm, &row0, &col0, (bm, bn), bk),
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
                load_regs(&mut px, &k0, kb, None)?;
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
                load_regs(&mut px, &zero, &first, None)?;
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
        load_regs(&mut px, &k0, &ktn, Some(&last))?;
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

/// Split-K's stages `[kb, ke)` (u32 registers) for split `s` (u64 register) of `splits`
/// over `nk` stages: consecutive runs of `ceil(nk / splits)` stages, the last ones shorter
/// or empty. Each block adds its partial sum into the zeroed output (the kernel's store
/// accumulates: `red.global.add`).
fn split_stages(px: &mut Px, s: &str, nk: usize, splits: usize) -> (String, String) {
    let per = nk.div_ceil(splits.max(1));
    let (kb, ke) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("cvt.u32.u64 {kb}, {s};"));
    px.line(format!("mul.lo.u32 {kb}, {kb}, {per};"));
    px.line(format!("add.u32 {ke}, {kb}, {per};"));
    px.line(format!("min.u32 {ke}, {ke}, {nk};"));
    px.line(format!("min.u32 {kb}, {kb}, {ke};"));
    (kb, ke)
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
