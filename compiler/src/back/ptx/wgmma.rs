//! Hopper tensor-core matmul: `wgmma.mma_async` (sm_90a) on f16/bf16 operands, or on f32
//! ones as TF32 under `--allow-tf32`, with f32 accumulation, for matmuls large enough to
//! fill 128×128 or 128×256 block tiles.
//!
//! - **TF32:** a stage is 32 elements of `k` (the same 128-byte rows), one `m64nBNk8` per
//!   8. The tensor cores take the top 19 bits of each f32 (truncation, as cuBLAS's TF32
//!   GEMMs; the `mma.sync` path rounds). wgmma reads TF32 tiles K-major only, so an
//!   operand contiguous along `m`/`n` (a plain `x @ w`'s `w`; both operands of a weight
//!   gradient) lands as it lies in a ring of raw buffers and is transposed into a K-major
//!   buffer by the threads just before its math ([`Transposed`]); its tile then needs
//!   more shared memory, so 128×256 tiles take three stages (one ahead of the math)
//!   where four do not fit. On an H200, 4096³ f32 products: `a @ bᵀ` (both
//!   K-major) 0.384 ms, `a @ b` 0.555 ms (the transposition's shared-memory traffic bounds
//!   it), `aᵀ @ b` 0.662 ms, against cuBLAS's TF32 `a @ b` at 0.346 ms; through
//!   registers instead (one stage ahead) `a @ b` took 0.95 ms.
//!
//! - **Block:** 256 threads, two warpgroups; warpgroup `w` owns rows `64w..64w + 64` of
//!   the block tile and issues one `m64nBNk16` per 16 of `k`, both operands read by the
//!   tensor cores from shared memory through matrix descriptors.
//! - **Shared memory:** `k` is staged 128 bytes deep (64 f16/bf16 elements, 32 TF32), in
//!   4 buffers (5 for 128×128 tiles; fewer with TF32 transposed operands, above) of dynamic shared memory (above the 48 KiB of static shared memory, which the runtime
//!   raises per kernel). Each operand tile is stored in the 128-byte-swizzle layout of the
//!   wgmma canonical layouts: groups of 64 along `m`/`n`, 8192 bytes apart; inside one,
//!   either 64 rows of `m`/`n` with `k` contiguous (K-major) or 64 rows of `k` with
//!   `m`/`n` contiguous (MN-major, `imm-trans` set), 128 bytes a row, the 16-byte chunk
//!   `c` of row `r` stored at chunk `c ^ (r % 8)`. Either major fits an operand whose
//!   memory is contiguous along that axis, so transposed operands (a weight gradient's
//!   `xᵀ`, an `x @ wᵀ`) need no copy.
//! - **Pipeline:** every thread moves its share of a stage with 16-byte `cp.async`
//!   (zero-filled out of range), `stages - 2` ahead of the math (two for 128×256 tiles,
//!   three for 128×128). A stage's wgmma group is
//!   committed and the previous one awaited (`wgmma.wait_group 1`), so the tensor cores
//!   always have the next group queued while a barrier and the copies run; a buffer is
//!   overwritten only after every warpgroup's wait has passed the barrier after its last
//!   reader.
//! - **Epilogue:** the accumulator fragments go to an f32 tile in the (now idle) shared
//!   memory; then the threads walk the tile in row-major order through the kernel's fused
//!   stores, so that consecutive threads store consecutive columns (coalesced). Storing
//!   straight from the fragments (two adjacent columns of eight rows a warp) took a fifth
//!   of a 4096³ GEMM: 0.255 ms against 0.206 ms without the stores, on an H100.

use super::epilogue::{
    epilogue_loads, epilogue_vectors, split_index, store_point, store_vector,
    EPILOGUE_PREFETCH_REGS,
};
use super::mma::MmaKind;
use super::px::Px;
use super::staging::{chunk_copy, next_stage, stage_chunk, stage_k0, ChunkSlot};
use super::tile::{warp_tile, TileOrigin, WarpTile};
use super::vector::{vector_access, VEC};
use super::{LaunchShape, Res};
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{ExprId, Kernel, Matmul, Operand, Var, E};

/// Rows of the block tile of one warpgroup.
const WG_ROWS: usize = 64;
/// Bytes of `k` per stage: one 128-byte swizzle row (64 f16/bf16 elements, 32 TF32 ones).
const ROW: usize = 128;
/// Bytes of a 64-wide group of an operand tile (64 rows of 128 bytes).
const GROUP: usize = 64 * 128;
/// Elements of the epilogue's tile a thread stores per iteration.
const EPI_UNROLL: usize = 4;
/// Dynamic shared memory a block may have on sm_90.
const SHARED_MAX: usize = 227 * 1024;
/// Fewest blocks of 128×256 before the wider tile is used: one per SM.
const WIDE_MIN_BLOCKS: usize = super::SMS;

/// Elements of `k` per stage: one swizzle row.
fn bk(kind: MmaKind) -> usize {
    ROW / kind.elem_bytes()
}

/// How one operand lies in memory, for the copies and the descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Side {
    /// The shared tile is K-major (else MN-major, f16/bf16 only).
    k_major: bool,
    /// A TF32 operand contiguous along `m`/`n`: wgmma reads TF32 tiles K-major only, so
    /// its stages land in raw shared buffers and are transposed there ([`Transposed`]).
    transpose: bool,
    /// Elements per 16-byte chunk.
    ce: usize,
    /// Extent along `m` (A) or `n` (B).
    mn: usize,
    mn_stride: i64,
    k_stride: i64,
    /// Rows of the block tile along `m`/`n`.
    tile: usize,
}

impl Side {
    /// The operand as a K-major or MN-major tile of 16-byte chunks of `kind`'s elements,
    /// or `None` when its memory suits neither (a gap between elements, a misaligned
    /// chunk).
    fn of(
        o: &Operand,
        off: u64,
        (mn, k): (usize, usize),
        a: bool,
        tile: usize,
        kind: MmaKind,
    ) -> Option<Side> {
        let (mn_stride, k_stride) = if a { (o.rs, o.cs) } else { (o.cs, o.rs) };
        let ce = kind.chunk() as i64;
        let aligned = o.base % ce == 0
            && o.batch_strides.iter().all(|s| s % ce == 0)
            && off.is_multiple_of(16);
        if !aligned {
            return None;
        }
        let whole = |x: usize| x.is_multiple_of(ce as usize);
        let k_major = if k_stride == 1 && mn_stride > 0 && mn_stride % ce == 0 && whole(k) {
            true
        } else if mn_stride == 1 && k_stride > 0 && k_stride % ce == 0 && whole(mn) {
            false
        } else {
            return None;
        };
        let transpose = kind == MmaKind::Tf32 && !k_major;
        Some(Side {
            k_major: k_major || transpose,
            transpose,
            ce: ce as usize,
            mn,
            mn_stride,
            k_stride,
            tile,
        })
    }

    /// Bytes of one stage of this operand's tile.
    fn bytes(self) -> usize {
        self.tile / 64 * GROUP
    }

    /// The descriptor's constant part: 128-byte swizzle, the stride between 8-row groups
    /// (SBO, 1024 bytes) and, for MN-major tiles, the stride between 64-wide groups (LBO).
    fn desc_bits(self) -> u64 {
        let lbo: u64 = if self.k_major { 16 } else { GROUP as u64 };
        (1u64 << 62) | ((1024u64 >> 4) << 32) | ((lbo >> 4) << 16)
    }
}

/// The plan of a wgmma matmul: kind, both sides, the tile's columns and the grid.
pub(super) struct Plan {
    kind: MmaKind,
    a: Side,
    b: Side,
    bn: usize,
    /// Warpgroups of the block (64 rows each).
    wgs: usize,
    /// Shared-memory buffers, at least 3: `stages - 2` in flight ahead of the math.
    stages: usize,
    pub(super) grid: [u32; 3],
}

impl Plan {
    fn threads(&self) -> usize {
        128 * self.wgs
    }

    /// Bytes of one stage of the operands `cp.async` puts straight into wgmma's tiles, and
    /// of those transposed on the way ([`Transposed`]).
    fn split_bytes(&self) -> (usize, usize) {
        let (mut direct, mut transposed) = (0, 0);
        for s in [self.a, self.b] {
            if s.transpose {
                transposed += s.bytes();
            } else {
                direct += s.bytes();
            }
        }
        (direct, transposed)
    }

    /// Dynamic shared memory: `stages` direct stages, `stages - 1` raw and two K-major
    /// buffers of the transposed operands (or the epilogue's f32 tile where larger), and
    /// 1024 bytes of alignment.
    fn shared_bytes(&self) -> usize {
        let (direct, transposed) = self.split_bytes();
        let t = if transposed > 0 {
            transposed * (self.stages + 1)
        } else {
            0
        };
        (direct * self.stages + t).max(self.a.tile * (self.bn + 8) * 4) + 1024
    }
}

/// The wgmma plan of `mm`, or `None` where the `mma.sync` path (or another) is used: only
/// f16/bf16 (TF32 under `opts.allow_tf32`), plain matmuls of at least one 128×128 tile
/// whose operands are contiguous along `k` or along `m`/`n`.
pub(super) fn plan(mm: &Matmul, offsets: &Offsets, opts: super::PtxOptions) -> Option<Plan> {
    let kind = MmaKind::of(mm, opts)?;
    if mm.m < 128 || mm.n < 128 || mm.k < bk(kind) {
        return None;
    }
    let batch: usize = mm.batch.iter().product();
    let wide = mm.n.div_ceil(256) * mm.m.div_ceil(128) * batch >= WIDE_MIN_BLOCKS;
    // 128×256 tiles in four stages (193 KiB), or 128×128 tiles in five (161 KiB); one block
    // per SM either way. Measured on an H100/H200: a 4096³ bf16 GEMM ran 0.258 ms on
    // 128×256 tiles, 0.298 ms on 256×128 (four warpgroups); a 2048×4096 @ 4096×1024 one on
    // 128×128 tiles 0.054, 0.047, 0.045 and 0.045 ms in three to six stages.
    // With TF32 operands transposed on the way, the first of these that fits (three stages
    // of 128×256 always do: at most 193 KiB; five of 128×128 too: at most 193 KiB).
    let configs: &[(usize, usize, usize)] = if wide {
        &[(2, 256, 4), (2, 256, 3)]
    } else {
        &[(2, 128, 5)]
    };
    configs.iter().find_map(|&(wgs, bn, stages)| {
        let bm = WG_ROWS * wgs;
        let gy = mm.m.div_ceil(bm);
        let gx = mm.n.div_ceil(bn);
        if batch == 0 || batch > 65535 || gy > 65535 || gx > i32::MAX as usize {
            return None;
        }
        let a = Side::of(&mm.a, offsets.get(mm.a.buf)?, (mm.m, mm.k), true, bm, kind)?;
        let b = Side::of(&mm.b, offsets.get(mm.b.buf)?, (mm.n, mm.k), false, bn, kind)?;
        let plan = Plan {
            kind,
            a,
            b,
            bn,
            wgs,
            stages,
            grid: [gx as u32, gy as u32, batch as u32],
        };
        (plan.shared_bytes() <= SHARED_MAX).then_some(plan)
    })
}

/// One thread's share of an operand's stage: chunks `t + 256·i`, which lie `i·step`
/// rows of the tile apart (rows along `m`/`n` when K-major, along `k` when MN-major) and
/// share their chunk column, hence their swizzle.
struct Slots {
    /// Shared offset of chunk 0 within a stage.
    smem: String,
    /// Element index of chunk 0 at `k0 = 0`.
    base: String,
    /// `k` of chunk 0 (u64).
    kk: String,
    /// `m`/`n` of chunk 0 (u64).
    mn: String,
    /// Chunks per thread and the rows between them.
    count: usize,
    step: usize,
}

/// The slots of thread `t` for one operand tile at shared offset `at` (within a stage),
/// whose first `m`/`n` is `mn0` and whose elements start at `opbase`.
fn slots(px: &mut Px, s: Side, block: usize, t: &str, at: usize, mn0: &str, opbase: &str) -> Slots {
    // Chunk `t` at row `r` of group `grp`, chunk column `c`; element (`mn`, `kk`).
    let (r, c, grp, mn, kk) = (
        px.fresh("r"),
        px.fresh("r"),
        px.fresh("r"),
        px.fresh("r"),
        px.fresh("r"),
    );
    let step = if s.k_major {
        // 8 chunks along k per row; rows are m/n.
        px.line(format!("shr.u32 {mn}, {t}, 3;"));
        px.line(format!("and.b32 {c}, {t}, 7;"));
        px.line(format!("and.b32 {r}, {mn}, 63;"));
        px.line(format!("shr.u32 {grp}, {mn}, 6;"));
        px.line(format!("shl.b32 {kk}, {c}, {};", s.ce.trailing_zeros()));
        block / 8
    } else {
        // tile/8 chunks along m/n per k row.
        let cpr = s.tile / 8;
        let cc = px.fresh("r");
        px.line(format!("shr.u32 {kk}, {t}, {};", cpr.trailing_zeros()));
        px.line(format!("and.b32 {cc}, {t}, {};", cpr - 1));
        px.line(format!("and.b32 {c}, {cc}, 7;"));
        px.line(format!("shr.u32 {grp}, {cc}, 3;"));
        px.line(format!("mov.u32 {r}, {kk};"));
        px.line(format!("shl.b32 {mn}, {cc}, {};", s.ce.trailing_zeros()));
        block / cpr
    };
    let smem = px.fresh("r");
    let sw = px.fresh("r");
    px.line(format!("and.b32 {sw}, {r}, 7;"));
    px.line(format!("xor.b32 {sw}, {sw}, {c};"));
    px.line(format!("shl.b32 {sw}, {sw}, 4;"));
    px.line(format!("mad.lo.u32 {smem}, {r}, 128, {sw};"));
    px.line(format!("mad.lo.u32 {smem}, {grp}, {GROUP}, {smem};"));
    px.line(format!("add.u32 {smem}, {smem}, {at};"));
    let g_mn = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {g_mn}, {mn};"));
    px.line(format!("add.s64 {g_mn}, {g_mn}, {mn0};"));
    let base = px.fresh("rd");
    px.line(format!(
        "mad.lo.s64 {base}, {g_mn}, {}, {opbase};",
        s.mn_stride
    ));
    let kk64 = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {kk64}, {kk};"));
    px.line(format!(
        "mad.lo.s64 {base}, {kk64}, {}, {base};",
        s.k_stride
    ));
    Slots {
        smem,
        base,
        kk: kk64,
        mn: g_mn,
        // The tile's rows of 128 bytes, in 16-byte chunks.
        count: s.tile * 8 / block,
        step,
    }
}

/// A TF32 operand contiguous along `m`/`n` ([`Side::transpose`]). Its stages land by
/// `cp.async` in a ring of raw buffers, as they lie (`k` rows of the tile's `m`/`n`, the
/// 16-byte chunk `c` of row `k` stored at `c ^ (k / 4 % 8)`), `stages - 1` of them so that
/// a stage is copied as far ahead as a K-major one; just before its math the threads
/// transpose it into one of two K-major buffers that the descriptor reads. Thread `t`
/// moves blocks of 4 `k` × 4 `m`/`n`: `k` from `4·(t % 8)`, `m`/`n` from `4·(t / 8) +
/// 128·u` for each `u < tile / 128`; four 16-byte loads (one per `k`) and four 16-byte
/// stores (one per `m`/`n`, its four `k` a chunk of the K-major tile). Eight consecutive
/// threads read eight chunk columns and fill one swizzled 128-byte row: no bank conflicts.
struct Transposed {
    /// Shared offset, within the K-major tile, of row `4·(t / 8) + c`'s chunk, `c < 4`.
    ready: [String; 4],
    /// Shared offset, within a raw stage, of the block's row `k = 4·(t % 8)` (its chunk
    /// column swizzled).
    raw: String,
    /// Bytes of a raw row (one `k`).
    row_bytes: usize,
    /// This thread's `cp.async` chunks, `rows` rows of `k` apart: each one's shared offset
    /// within a raw stage; the first one's `k` within the stage (u64) and element index at
    /// `k = 0` (u64); whether their `m`/`n` is in range.
    chunks: Vec<String>,
    rows: usize,
    kk: String,
    base: String,
    in_mn: String,
    k_stride: i64,
    /// Blocks per thread.
    units: usize,
}

impl Transposed {
    fn new(px: &mut Px, s: Side, (t, mn0, opbase): (&str, &str, &str), block: usize) -> Transposed {
        // The plans' tiles (128 or 256 along m/n) and 256 threads: 32 blocks of 4 rows a
        // unit, and `cp.async` chunks a multiple of 4 rows apart.
        debug_assert!(block == 256 && (s.tile == 128 || s.tile == 256));
        let (j, q) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("and.b32 {j}, {t}, 7;"));
        px.line(format!("shr.u32 {q}, {t}, 3;"));
        let ready = std::array::from_fn(|c| {
            // Row `r = 4q + c` (of its 64-row group `r / 64`), chunk `j ^ (r % 8)`.
            let (r, sw, at) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
            px.line(format!("mad.lo.u32 {r}, {q}, 4, {c};"));
            px.line(format!("and.b32 {sw}, {r}, 7;"));
            px.line(format!("xor.b32 {sw}, {sw}, {j};"));
            px.line(format!("shl.b32 {sw}, {sw}, 4;"));
            px.line(format!("shr.u32 {at}, {r}, 6;"));
            px.line(format!("mul.lo.u32 {at}, {at}, {GROUP};"));
            px.line(format!("and.b32 {r}, {r}, 63;"));
            px.line(format!("mad.lo.u32 {at}, {r}, 128, {at};"));
            px.line(format!("add.u32 {at}, {at}, {sw};"));
            at
        });
        let row_bytes = 4 * s.tile;
        // Row 4j, chunk column q ^ j (k / 4 % 8 = j).
        let raw = px.fresh("r");
        let sw = px.fresh("r");
        px.line(format!("xor.b32 {sw}, {q}, {j};"));
        px.line(format!("shl.b32 {sw}, {sw}, 4;"));
        px.line(format!("mul.lo.u32 {raw}, {j}, {};", 4 * row_bytes));
        px.line(format!("add.u32 {raw}, {raw}, {sw};"));
        // `cp.async` chunks `t + block·i`: row `k = e / cpr`, chunk column `c = e % cpr`;
        // chunk `i` is `rows` rows (a multiple of 4) below chunk 0.
        let cpr = s.tile / 4;
        let rows = block / cpr;
        let (k, c) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("shr.u32 {k}, {t}, {};", cpr.trailing_zeros()));
        px.line(format!("and.b32 {c}, {t}, {};", cpr - 1));
        let chunks = (0..s.tile * 8 / block)
            .map(|i| {
                let (sw, at) = (px.fresh("r"), px.fresh("r"));
                px.line(format!("shr.u32 {sw}, {k}, 2;"));
                px.line(format!("add.u32 {sw}, {sw}, {};", i * rows / 4));
                px.line(format!("and.b32 {sw}, {sw}, 7;"));
                px.line(format!("xor.b32 {sw}, {sw}, {c};"));
                px.line(format!("shl.b32 {sw}, {sw}, 4;"));
                px.line(format!("mad.lo.u32 {at}, {k}, {row_bytes}, {sw};"));
                px.line(format!("add.u32 {at}, {at}, {};", i * rows * row_bytes));
                at
            })
            .collect();
        let (kk, mn, base) = (px.fresh("rd"), px.fresh("rd"), px.fresh("rd"));
        px.line(format!("cvt.u64.u32 {kk}, {k};"));
        px.line(format!("mul.wide.u32 {mn}, {c}, 4;"));
        px.line(format!("add.s64 {mn}, {mn}, {mn0};"));
        let in_mn = px.fresh("p");
        px.line(format!("setp.lt.s64 {in_mn}, {mn}, {};", s.mn));
        px.line(format!("add.s64 {base}, {mn}, {opbase};"));
        px.line(format!("mad.lo.s64 {base}, {kk}, {}, {base};", s.k_stride));
        Transposed {
            ready,
            raw,
            row_bytes,
            chunks,
            rows,
            kk,
            base,
            in_mn,
            k_stride: s.k_stride,
            units: s.tile / 128,
        }
    }

    /// Copies the stage of `k0` (i64) into the raw buffer at shared byte `st` (u32).
    fn copy(&self, px: &mut Px, st: &str, k0: &str, (buf, kd): (&str, usize)) {
        let (kg, idx0) = (px.fresh("rd"), px.fresh("rd"));
        px.line(format!("add.s64 {kg}, {k0}, {};", self.kk));
        px.line(format!(
            "mad.lo.s64 {idx0}, {k0}, {}, {};",
            self.k_stride, self.base
        ));
        for (i, at) in self.chunks.iter().enumerate() {
            let rows = (i * self.rows) as i64;
            let p = px.fresh("p");
            px.line(format!(
                "setp.lt.and.s64 {p}, {kg}, {}, {};",
                kd as i64 - rows,
                self.in_mn
            ));
            let (dst, idx) = (px.fresh("r"), px.fresh("rd"));
            px.line(format!("add.u32 {dst}, {st}, {at};"));
            px.line(format!("add.s64 {idx}, {idx0}, {};", rows * self.k_stride));
            chunk_copy(px, &dst, buf, &idx, &p, 4);
        }
    }

    /// Transposes the raw buffer at shared byte `from` into the K-major one at `to`.
    fn transpose(&self, px: &mut Px, from: &str, to: &str) {
        for u in 0..self.units {
            let regs: Vec<[String; 4]> = (0..4)
                .map(|_| std::array::from_fn(|_| px.fresh("f")))
                .collect();
            let src = px.fresh("r");
            px.line(format!("add.u32 {src}, {from}, {};", self.raw));
            for (i, row) in regs.iter().enumerate() {
                // Block `u` is 32 chunk columns further: the swizzle (low 3 bits) is kept.
                px.line(format!(
                    "ld.shared.v4.f32 {{{}}}, [{src}+{}];",
                    row.join(", "),
                    i * self.row_bytes + 32 * 16 * u
                ));
            }
            for (c, ready) in self.ready.iter().enumerate() {
                let at = px.fresh("r");
                px.line(format!("add.u32 {at}, {to}, {ready};"));
                let chunk: Vec<&str> = regs.iter().map(|row| row[c].as_str()).collect();
                px.line(format!(
                    "st.shared.v4.f32 [{at}+{}], {{{}}};",
                    2 * GROUP * u,
                    chunk.join(", ")
                ));
            }
        }
    }
}

/// Emits the wgmma matmul with its fused epilogue (see the module's documentation).
pub(super) fn emit(
    k: &Kernel,
    mm: &Matmul,
    plan: &Plan,
    offsets: &Offsets,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offsets, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let (a, b, bn) = (plan.a, plan.b, plan.bn);
    let (eb, bk) = (plan.kind.elem_bytes(), bk(plan.kind));
    // A stage of the operands `cp.async` puts in wgmma's tiles (`stages` of them), and of
    // the transposed ones (`stages - 1` raw buffers and two K-major ones), in that order.
    let (stage, tstage) = plan.split_bytes();
    let raws = plan.stages - 1;
    let (raw0, ready0) = (plan.stages * stage, plan.stages * stage + raws * tstage);
    // Each operand's offset within its stage.
    let (a_off, b_off) = (
        0,
        if a.transpose == b.transpose {
            a.bytes()
        } else {
            0
        },
    );

    let WarpTile {
        t,
        warp,
        g,
        tg,
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
        ..
    } = warp_tile(&mut px, mm, a.tile, bn)?;
    // Warpgroup `wg`, its warp `w`.
    let (wg, w) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("shr.u32 {wg}, {warp}, 2;"));
    px.line(format!("and.b32 {w}, {warp}, 3;"));
    // The dynamic shared memory, rounded up to 1024 bytes (the swizzle pattern repeats
    // every 1024 bytes and is taken from the address).
    let sbase = px.fresh("r");
    px.line(format!("mov.u32 {sbase}, {};", super::DYN_SHARED));
    px.line(format!("add.u32 {sbase}, {sbase}, 1023;"));
    px.line(format!("and.b32 {sbase}, {sbase}, -1024;"));

    let threads = plan.threads();
    let a_slots = (!a.transpose).then(|| slots(&mut px, a, threads, &t, a_off, &row0, &abase));
    let b_slots = (!b.transpose).then(|| slots(&mut px, b, threads, &t, b_off, &col0, &bbase));
    let transposed: Vec<(Transposed, usize, &str)> = [
        (a, (&row0, &abase, &abuf), a_off),
        (b, (&col0, &bbase, &bbuf), b_off),
    ]
    .into_iter()
    .filter(|(side, ..)| side.transpose)
    .map(|(side, (mn0, base, buf), at)| {
        let tr = Transposed::new(&mut px, side, (&t, mn0, base), threads);
        (tr, at, buf.as_str())
    })
    .collect();

    // Moves the stage of `k0` (i64) into the buffer at shared byte `st` (u32) and, for the
    // transposed operands, the raw buffer at `raw` (u32), and commits the copies.
    let load_stage = |px: &mut Px, st: &str, raw: Option<&str>, k0: &str| {
        for (side, sl, buf) in [(a, &a_slots, &abuf), (b, &b_slots, &bbuf)] {
            let Some(sl) = sl else { continue };
            let slot = ChunkSlot {
                smem: &sl.smem,
                kk: &sl.kk,
                base: &sl.base,
                k_stride: side.k_stride,
            };
            let (dst0, kg, idx0) = stage_chunk(px, st, k0, slot);
            for i in 0..sl.count {
                // Chunk i: `i·step` rows further along m/n (K-major) or k (MN-major).
                let rows = (i * sl.step) as i64;
                let (mn_end, k_end, shift) = if side.k_major {
                    (side.mn as i64 - rows, kd as i64, rows * side.mn_stride)
                } else {
                    (side.mn as i64, kd as i64 - rows, rows * side.k_stride)
                };
                let p = px.fresh("p");
                px.line(format!("setp.lt.s64 {p}, {kg}, {k_end};"));
                px.line(format!("setp.lt.and.s64 {p}, {}, {mn_end}, {p};", sl.mn));
                let idx = px.fresh("rd");
                px.line(format!("add.s64 {idx}, {idx0}, {shift};"));
                let dst = px.fresh("r");
                px.line(format!("add.u32 {dst}, {dst0}, {};", i * sl.step * 128));
                chunk_copy(px, &dst, buf, &idx, &p, eb);
            }
        }
        // `raw` is set exactly when there are transposed operands.
        if let Some(raw) = raw {
            for (tr, at, buf) in &transposed {
                let to = px.fresh("r");
                px.line(format!("add.u32 {to}, {raw}, {at};"));
                tr.copy(px, &to, k0, (buf, kd));
            }
        }
        px.line("cp.async.commit_group;");
    };

    // Descriptors of stage 0 for this warpgroup: A starts at its 64 rows (one group), B at
    // the tile's first column.
    let desc = |px: &mut Px, side: Side, at: &str| {
        let lo = px.fresh("r");
        px.line(format!("and.b32 {lo}, {at}, 262143;"));
        px.line(format!("shr.u32 {lo}, {lo}, 4;"));
        let d = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {d}, {lo};"));
        px.line(format!("or.b64 {d}, {d}, {};", side.desc_bits()));
        d
    };
    // A transposed operand's tile is read from the first K-major buffer.
    let first = |side: Side, off: usize| off + if side.transpose { ready0 } else { 0 };
    let a_at = px.fresh("r");
    px.line(format!("mad.lo.u32 {a_at}, {wg}, {GROUP}, {sbase};"));
    if a.transpose {
        px.line(format!("add.u32 {a_at}, {a_at}, {};", first(a, a_off)));
    }
    let a_desc = desc(&mut px, a, &a_at);
    let b_at = px.fresh("r");
    px.line(format!("add.u32 {b_at}, {sbase}, {};", first(b, b_off)));
    let b_desc = desc(&mut px, b, &b_at);

    let accs: Vec<String> = (0..bn / 2).map(|_| px.fresh("f")).collect();
    for x in &accs {
        px.line(format!("mov.f32 {x}, {};", super::px::f32_lit(0.0)));
    }
    let (one, scale_d) = (px.fresh("r"), px.fresh("p"));
    px.line(format!("mov.u32 {one}, 1;"));
    px.line(format!("setp.ne.u32 {scale_d}, {one}, 0;"));

    let nk = kd.div_ceil(bk);
    let stages = plan.stages;
    let ahead = stages - 2;
    for s in 0..ahead {
        let k0 = px.imm64((s * bk) as i64);
        let st = px.fresh("r");
        px.line(format!("add.u32 {st}, {sbase}, {};", s * stage));
        let raw = (!transposed.is_empty()).then(|| {
            let raw = px.fresh("r");
            px.line(format!("add.u32 {raw}, {sbase}, {};", raw0 + s * tstage));
            raw
        });
        load_stage(&mut px, &st, raw.as_deref(), &k0);
    }
    // `kt`, and the buffers of stages `kt` and `kt + ahead`, counted round (no division:
    // a `rem.u32` by the constant 4 here made the 4096³ GEMM 15% slower, 0.295 against
    // 0.258 ms on an H100); the same in the raw ring.
    let (kt, cur_buf, next_buf) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {kt}, 0;"));
    px.line(format!("mov.u32 {cur_buf}, 0;"));
    px.line(format!("mov.u32 {next_buf}, {};", ahead % stages));
    let raw_ring = (!transposed.is_empty()).then(|| {
        let (cur_raw, next_raw) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("mov.u32 {cur_raw}, 0;"));
        px.line(format!("mov.u32 {next_raw}, {};", ahead % raws));
        (cur_raw, next_raw)
    });
    let head = px.label("wg_k");
    let skip = px.label("wg_noload");
    px.body.push_str(&format!("{head}:\n"));
    // Stage `kt` has landed (one later group may still be in flight) and every warpgroup
    // has finished the wgmma group of stage `kt - 2`.
    px.line(format!("cp.async.wait_group {};", ahead - 1));
    px.line("fence.proxy.async.shared::cta;");
    px.line("bar.sync 0;");
    {
        // Stage `kt + ahead` into buffer `(kt + ahead) % stages`, that of stage `kt - 2`.
        let (ktn, none) = next_stage(&mut px, &kt, ahead, nk, &skip);
        let st = px.fresh("r");
        px.line(format!("mad.lo.u32 {st}, {next_buf}, {stage}, {sbase};"));
        let raw = raw_ring.as_ref().map(|(_, next_raw)| {
            let raw = px.fresh("r");
            px.line(format!("mad.lo.u32 {raw}, {next_raw}, {tstage}, {sbase};"));
            px.line(format!("add.u32 {raw}, {raw}, {raw0};"));
            raw
        });
        let k0 = stage_k0(&mut px, &ktn, bk);
        load_stage(&mut px, &st, raw.as_deref(), &k0);
        px.body.push_str(&format!("{skip}:\n"));
        // Keeps the group count the same on every iteration (an empty group past the end).
        px.line(format!("@{none} cp.async.commit_group;"));
    }
    // This stage's descriptors: the buffer's offset, in 16-byte units; a transposed
    // operand's K-major buffer `kt % 2`.
    let cur = px.fresh("r");
    px.line(format!("mul.lo.u32 {cur}, {cur_buf}, {};", stage >> 4));
    let cur64 = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {cur64}, {cur};"));
    let ready64 = raw_ring.as_ref().map(|(cur_raw, _)| {
        // Stage `kt`'s raw buffer into K-major buffer `kt % 2`, last read by stage
        // `kt - 2`'s wgmma group (finished, as the barrier says), then a barrier before
        // the tensor cores read it.
        let (from, par, to) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
        px.line(format!("mad.lo.u32 {from}, {cur_raw}, {tstage}, {sbase};"));
        px.line(format!("add.u32 {from}, {from}, {raw0};"));
        px.line(format!("and.b32 {par}, {kt}, 1;"));
        px.line(format!("mad.lo.u32 {to}, {par}, {tstage}, {sbase};"));
        px.line(format!("add.u32 {to}, {to}, {ready0};"));
        for (tr, at, _) in &transposed {
            let (f, t) = (px.fresh("r"), px.fresh("r"));
            px.line(format!("add.u32 {f}, {from}, {at};"));
            px.line(format!("add.u32 {t}, {to}, {at};"));
            tr.transpose(&mut px, &f, &t);
        }
        px.line("fence.proxy.async.shared::cta;");
        px.line("bar.sync 0;");
        let r = px.fresh("r");
        px.line(format!("mul.lo.u32 {r}, {par}, {};", tstage >> 4));
        let r64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {r64}, {r};"));
        r64
    });
    let (ad, bd) = (px.fresh("rd"), px.fresh("rd"));
    for (d, side, base) in [(&ad, a, &a_desc), (&bd, b, &b_desc)] {
        let off = match &ready64 {
            Some(r) if side.transpose => r,
            _ => &cur64,
        };
        px.line(format!("add.s64 {d}, {base}, {off};"));
    }
    px.line("wgmma.fence.sync.aligned;");
    // One instruction takes 32 bytes of `k`: 16 f16/bf16 or 8 TF32 elements.
    let (ty, ki) = match plan.kind {
        MmaKind::F16 => ("f16", 16),
        MmaKind::Bf16 => ("bf16", 16),
        MmaKind::Tf32 => ("tf32", 8),
    };
    let instr = format!("wgmma.mma_async.sync.aligned.m64n{bn}k{ki}.f32.{ty}.{ty}");
    let acc_list = accs.join(", ");
    for ks in 0..bk / ki {
        // 32 bytes along a K-major row, 16 rows of 128 bytes of an MN-major tile.
        let step = |s: Side| if s.k_major { 32 } else { 16 * 128 };
        let (da, db) = (px.fresh("rd"), px.fresh("rd"));
        px.line(format!("add.s64 {da}, {ad}, {};", (ks * step(a)) >> 4));
        px.line(format!("add.s64 {db}, {bd}, {};", (ks * step(b)) >> 4));
        // TF32 takes no transpose flags (its tiles are K-major).
        let trans = if plan.kind == MmaKind::Tf32 {
            String::new()
        } else {
            format!(", {}, {}", u8::from(!a.k_major), u8::from(!b.k_major))
        };
        px.line(format!(
            "{instr} {{{acc_list}}}, {da}, {db}, {scale_d}, 1, 1{trans};"
        ));
    }
    px.line("wgmma.commit_group.sync.aligned;");
    px.line("wgmma.wait_group.sync.aligned 1;");
    px.line(format!("add.u32 {kt}, {kt}, 1;"));
    let mut rings = vec![(&cur_buf, stages), (&next_buf, stages)];
    if let Some((cur_raw, next_raw)) = &raw_ring {
        rings.extend([(cur_raw, raws), (next_raw, raws)]);
    }
    for (b, len) in rings {
        let wrap = px.fresh("p");
        px.line(format!("add.u32 {b}, {b}, 1;"));
        px.line(format!("setp.eq.u32 {wrap}, {b}, {len};"));
        px.line(format!("selp.u32 {b}, 0, {b}, {wrap};"));
    }
    let more = px.fresh("p");
    px.line(format!("setp.lt.u32 {more}, {kt}, {nk};"));
    px.line(format!("@{more} bra.uni {head};"));
    px.line("wgmma.wait_group.sync.aligned 0;");

    // Epilogue, through shared memory so that the stores are coalesced: the accumulators
    // go to an f32 tile of `bm` rows of `bn + 8` floats (the padding puts the fragment's
    // eight rows in distinct banks), then each thread takes elements `t + threads·i` in
    // row-major order through the kernel's fused stores. acc[4j + 2h + c] is row
    // 64·wg + 16·w + g + 8h, column 8j + 2·tg + c of the block tile.
    px.line("cp.async.wait_group 0;");
    px.line("bar.sync 0;");
    let rs = bn + 8;
    let shape = LaunchShape {
        grid: plan.grid,
        block: [plan.threads() as u32, 1, 1],
        // The stages, or the epilogue's f32 tile where larger; 1024 bytes of alignment.
        shared_bytes: plan.shared_bytes() as u32,
        scratch_bytes: 0,
    };
    let frag = px.fresh("r");
    px.line(format!("mad.lo.u32 {frag}, {wg}, 64, {g};"));
    px.line(format!("mad.lo.u32 {frag}, {w}, 16, {frag};"));
    px.line(format!("mul.lo.u32 {frag}, {frag}, {rs};"));
    px.line(format!("mad.lo.u32 {frag}, {tg}, 2, {frag};"));
    px.line(format!("mad.lo.u32 {frag}, {frag}, 4, {sbase};"));
    for j in 0..bn / 8 {
        for h in 0..2 {
            px.line(format!(
                "st.shared.v2.f32 [{frag}+{}], {{{}, {}}};",
                (h * 8 * rs + 8 * j) * 4,
                accs[4 * j + 2 * h],
                accs[4 * j + 2 * h + 1]
            ));
        }
    }
    px.line("bar.sync 0;");
    let threads = plan.threads();
    // An epilogue that loads (a gradient's `gelu'` from the stored pre-activation, the
    // score gradient's probabilities) takes more elements an iteration and issues all
    // their loads before the first store: ptxas does not move a load above a store that
    // may alias it, so loaded where each value is computed they waited for one another
    // (gpt's `dgelu` epilogue under `--amp bf16` took 0.30 ms for 19 GFLOP).
    let loads = epilogue_loads(&px, mm);
    let at = (t.as_str(), row0.as_str(), col0.as_str(), sbase.as_str());
    if let Some(unroll) = vector_unroll(&px, mm, plan, rs, &loads) {
        return vector_epilogue(px, mm, plan, at, rs, (&loads, unroll), shape);
    }
    if !loads.is_empty() {
        return prefetching_epilogue(px, mm, plan, at, rs, &loads, shape);
    }
    let (e, top) = open_epilogue(&mut px, &t);
    // Four elements an iteration, for independent loads and stores in flight.
    for u in 0..EPI_UNROLL {
        let eu = px.fresh("r");
        px.line(format!("add.u32 {eu}, {e}, {};", u * threads));
        let skip = px.label("wg_epi_skip");
        let TilePoint { r, c, gr, gc, ok } = tile_point(&mut px, &eu, bn, (&row0, &col0), (m, n));
        px.line(format!("@!{ok} bra {skip};"));
        let at = tile_address(&mut px, (&r, &c), rs, &sbase);
        let v = px.fresh("f");
        px.line(format!("ld.shared.f32 {v}, [{at}];"));
        let mut coords = split_index(&mut px, &gr, &mm.rows);
        coords.extend(split_index(&mut px, &gc, &mm.cols));
        store_point(&mut px, mm, &coords, v, &[])?;
        px.body.push_str(&format!("{skip}:\n"));
    }
    close_epilogue(px, (&e, &top), EPI_UNROLL * threads, a.tile * bn, shape)
}

/// Groups of [`VEC`] columns a thread takes an iteration of the vector epilogue, where it
/// applies ([`epilogue_vectors`]: every store can write `VEC` consecutive columns at once;
/// the tile's rows of `rs` floats keep its 16-byte `ld.shared.v4` aligned; the iterations
/// cover the tile exactly): as many as [`EPILOGUE_PREFETCH_REGS`] registers take the loads
/// of, up to [`EPI_UNROLL`].
fn vector_unroll(
    px: &Px,
    mm: &Matmul,
    plan: &Plan,
    rs: usize,
    loads: &[(ExprId, bool)],
) -> Option<usize> {
    let per_group: usize = loads
        .iter()
        .map(|&(_, cols)| if cols { VEC } else { 1 })
        .sum();
    let unroll = prev_power_of_two(EPILOGUE_PREFETCH_REGS / per_group.max(1)).clamp(1, EPI_UNROLL);
    let groups = plan.a.tile * plan.bn / VEC;
    let fits = plan.bn.is_multiple_of(VEC)
        && rs.is_multiple_of(VEC)
        && groups.is_multiple_of(unroll * plan.threads());
    (fits && epilogue_vectors(px, mm)).then_some(unroll)
}

/// The epilogue's walk over the f32 tile at `sbase` (rows of `rs` floats) in groups of
/// [`VEC`] consecutive columns: one `ld.shared.v4` of the tile and one vector store a
/// group and store, `unroll` groups an iteration, every load of all of them issued (in
/// range only) before the first store. A load whose index reads no column's variable is
/// made once a group.
fn vector_epilogue(
    mut px: Px,
    mm: &Matmul,
    plan: &Plan,
    (t, row0, col0, sbase): (&str, &str, &str, &str),
    rs: usize,
    (loads, unroll): (&[(ExprId, bool)], usize),
    shape: LaunchShape,
) -> Res<(String, LaunchShape)> {
    let (m, n, bn) = (mm.m, mm.n, plan.bn);
    let threads = plan.threads();
    let nb = mm.batch.len();
    // The column's variable (one row and one column variable, as the vector stores ask).
    let col = (nb + 1) as Var;
    let (e, top) = open_epilogue(&mut px, t);
    let mut points = Vec::new();
    for u in 0..unroll {
        // Group `e + u·threads`: its first element `4·group` of the row-major tile.
        let first = px.fresh("r");
        px.line(format!("add.u32 {first}, {e}, {};", u * threads));
        px.line(format!(
            "shl.b32 {first}, {first}, {};",
            VEC.trailing_zeros()
        ));
        let TilePoint { r, c, gr, gc, ok } = tile_point(&mut px, &first, bn, (row0, col0), (m, n));
        let row_at = split_index(&mut px, &gr, &mm.rows);
        let ats: Vec<Vec<String>> = (0..VEC)
            .map(|lane| {
                let col = if lane == 0 {
                    gc.clone()
                } else {
                    let x = px.fresh("rd");
                    px.line(format!("add.s64 {x}, {gc}, {lane};"));
                    x
                };
                let mut at = row_at.clone();
                at.extend(split_index(&mut px, &col, &mm.cols));
                at
            })
            .collect();
        let skip = px.label("wg_pre_skip");
        px.line(format!("@!{ok} bra {skip};"));
        // Each load's registers by lane: a vector load at lane 0's point where the load
        // moves along the columns in whole aligned vectors, lane 0's register where it
        // does not move with them, else a load at each lane's point.
        let mut by_lane: Vec<Vec<Option<String>>> = vec![vec![None; loads.len()]; VEC];
        for (lane, at) in ats.iter().enumerate() {
            px.journal.push(Vec::new());
            px.bind_point(nb, at);
            for (i, &(l, cols)) in loads.iter().enumerate() {
                if by_lane[lane][i].is_some() {
                    continue;
                }
                if lane > 0 && !cols {
                    by_lane[lane][i] = by_lane[0][i].clone();
                    continue;
                }
                match px.k.pool.get(l) {
                    &E::Load { buf, dtype, index }
                        if lane == 0 && vector_access(px.k, px.offsets, buf, dtype, index, col) =>
                    {
                        let idx = px.emit(index)?;
                        let addr = px.address(buf, dtype, &idx)?;
                        for (x, r) in px.vector_load(&addr, dtype).into_iter().enumerate() {
                            by_lane[x][i] = Some(r);
                        }
                    }
                    _ => by_lane[lane][i] = Some(px.emit(l)?),
                }
            }
            px.pop_scope();
        }
        let mut loaded: Vec<Vec<(ExprId, String)>> = vec![Vec::new(); VEC];
        for (lane, regs) in by_lane.into_iter().enumerate() {
            for (&(l, _), r) in loads.iter().zip(regs) {
                let r = r.ok_or_else(|| px.unsupported("an epilogue load left unissued"))?;
                loaded[lane].push((l, r));
            }
        }
        px.body.push_str(&format!("{skip}:\n"));
        points.push((r, c, ok, ats, loaded));
    }
    for (r, c, ok, ats, loaded) in &points {
        let skip = px.label("wg_epi_skip");
        px.line(format!("@!{ok} bra {skip};"));
        let at = tile_address(&mut px, (r, c), rs, sbase);
        let v: Vec<String> = (0..VEC).map(|_| px.fresh("f")).collect();
        px.line(format!("ld.shared.v4.f32 {{{}}}, [{at}];", v.join(", ")));
        store_vector(&mut px, mm, ats, &v, loaded)?;
        px.body.push_str(&format!("{skip}:\n"));
    }
    let groups = plan.a.tile * bn / VEC;
    close_epilogue(px, (&e, &top), unroll * threads, groups, shape)
}

/// The shared address of the epilogue's f32 tile at row `r`, column `c` (rows of `rs`
/// floats from `sbase`).
fn tile_address(px: &mut Px, (r, c): (&str, &str), rs: usize, sbase: &str) -> String {
    let at = px.fresh("r");
    px.line(format!("mad.lo.u32 {at}, {r}, {rs}, {c};"));
    px.line(format!("mad.lo.u32 {at}, {at}, 4, {sbase};"));
    at
}

/// The start of an epilogue's walk: counter `e` from thread index `t`, and the loop's label.
fn open_epilogue(px: &mut Px, t: &str) -> (String, String) {
    let e = px.fresh("r");
    px.line(format!("mov.u32 {e}, {t};"));
    let top = px.label("wg_epi");
    px.body.push_str(&format!("{top}:\n"));
    (e, top)
}

/// The end of an epilogue's walk: counter `e` moves on by `step` and the walk goes back to
/// `top` while below `end`; then the entry returns.
fn close_epilogue(
    mut px: Px,
    (e, top): (&str, &str),
    step: usize,
    end: usize,
    shape: LaunchShape,
) -> Res<(String, LaunchShape)> {
    px.line(format!("add.u32 {e}, {e}, {step};"));
    let more = px.fresh("p");
    px.line(format!("setp.lt.u32 {more}, {e}, {end};"));
    px.line(format!("@{more} bra.uni {top};"));
    px.line("ret;");
    Ok((px.finish(""), shape))
}

/// The largest power of two at most `x` (1 for 0).
fn prev_power_of_two(x: usize) -> usize {
    if x == 0 {
        1
    } else {
        1 << (usize::BITS - 1 - x.leading_zeros())
    }
}

/// Element `eu` of the epilogue's tile (row-major, rows of `bn`): its row and column in the
/// tile, in the output, and whether it is in range.
struct TilePoint {
    r: String,
    c: String,
    gr: String,
    gc: String,
    ok: String,
}

fn tile_point(
    px: &mut Px,
    eu: &str,
    bn: usize,
    (row0, col0): (&str, &str),
    (m, n): (usize, usize),
) -> TilePoint {
    let (r, c) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("shr.u32 {r}, {eu}, {};", bn.trailing_zeros()));
    px.line(format!("and.b32 {c}, {eu}, {};", bn - 1));
    let (gr, gc) = (px.fresh("rd"), px.fresh("rd"));
    px.line(format!("cvt.u64.u32 {gr}, {r};"));
    px.line(format!("add.s64 {gr}, {gr}, {row0};"));
    px.line(format!("cvt.u64.u32 {gc}, {c};"));
    px.line(format!("add.s64 {gc}, {gc}, {col0};"));
    let ok = px.fresh("p");
    px.line(format!("setp.lt.s64 {ok}, {gr}, {m};"));
    px.line(format!("setp.lt.and.s64 {ok}, {gc}, {n}, {ok};"));
    TilePoint { r, c, gr, gc, ok }
}

/// Most elements a thread takes an iteration of an epilogue whose stores read loaded
/// values (fewer where it loads several, as [`EPILOGUE_PREFETCH_REGS`] registers allow).
const EPI_UNROLL_LOADS: usize = 16;

/// The epilogue's walk over the f32 tile at `sbase` (rows of `rs` floats) when the stored
/// values read `loads`: up to [`EPI_UNROLL_LOADS`] elements an iteration (a power of two,
/// their loads within [`EPILOGUE_PREFETCH_REGS`] registers), every load of all of them
/// issued (in range only) before the first store.
#[allow(clippy::too_many_arguments)]
fn prefetching_epilogue(
    mut px: Px,
    mm: &Matmul,
    plan: &Plan,
    (t, row0, col0, sbase): (&str, &str, &str, &str),
    rs: usize,
    loads: &[(ExprId, bool)],
    shape: LaunchShape,
) -> Res<(String, LaunchShape)> {
    let (m, n, bn) = (mm.m, mm.n, plan.bn);
    let threads = plan.threads();
    let nb = mm.batch.len();
    let unroll = prev_power_of_two(EPILOGUE_PREFETCH_REGS / loads.len().max(1))
        .clamp(EPI_UNROLL, EPI_UNROLL_LOADS);
    let (e, top) = open_epilogue(&mut px, t);
    let mut points = Vec::new();
    for u in 0..unroll {
        let eu = px.fresh("r");
        px.line(format!("add.u32 {eu}, {e}, {};", u * threads));
        let TilePoint { r, c, gr, gc, ok } = tile_point(&mut px, &eu, bn, (row0, col0), (m, n));
        let mut coords = split_index(&mut px, &gr, &mm.rows);
        coords.extend(split_index(&mut px, &gc, &mm.cols));
        // This element's loads, each in the cache scope of its point.
        let skip = px.label("wg_pre_skip");
        px.line(format!("@!{ok} bra {skip};"));
        px.journal.push(Vec::new());
        px.bind_point(nb, &coords);
        let mut regs = Vec::with_capacity(loads.len());
        for &(l, _) in loads {
            regs.push((l, px.emit(l)?));
        }
        px.pop_scope();
        px.body.push_str(&format!("{skip}:\n"));
        points.push((r, c, ok, coords, regs));
    }
    for (r, c, ok, coords, regs) in &points {
        let skip = px.label("wg_epi_skip");
        px.line(format!("@!{ok} bra {skip};"));
        let at = tile_address(&mut px, (r, c), rs, sbase);
        let v = px.fresh("f");
        px.line(format!("ld.shared.f32 {v}, [{at}];"));
        store_point(&mut px, mm, coords, v, regs)?;
        px.body.push_str(&format!("{skip}:\n"));
    }
    close_epilogue(px, (&e, &top), unroll * threads, plan.a.tile * bn, shape)
}
