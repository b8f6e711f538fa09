//! What every block-tiled matmul starts from: the block prologue, the batch's operand bases,
//! the tile's origin, and the thread layouts of the FFMA and tensor-core tiles.

use super::px::Px;
use super::{PtxError, Res};
use crate::ir::NodeId;
use crate::kernel::{Matmul, MmAxis, Var};

/// What every register-tiled matmul starts from: the operands' element bases for this
/// block's batch, their buffers' byte addresses and arena offsets (none for a gathered
/// operand, whose loads are in its expression), and the first row and column of the
/// `bm`×`bn` block tile (block `(bx, by)`, batch `bz`).
pub(super) struct TileOrigin {
    pub(super) abase: String,
    pub(super) bbase: String,
    pub(super) abuf: String,
    pub(super) aoff: u64,
    pub(super) bbuf: String,
    pub(super) boff: u64,
    pub(super) row0: String,
    pub(super) col0: String,
}

pub(super) fn tile_origin(
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
pub(super) struct WarpTile {
    pub(super) t: String,
    pub(super) lane: String,
    pub(super) warp: String,
    pub(super) g: String,
    pub(super) tg: String,
    pub(super) origin: TileOrigin,
}

pub(super) fn warp_tile(px: &mut Px, mm: &Matmul, bm: usize, bn: usize) -> Res<WarpTile> {
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

/// The start of every block-tiled kernel: the arena base, the block index and the thread
/// index (`px.tid`).
pub(super) fn block_prologue(px: &mut Px) -> (String, String, String, String) {
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
pub(super) struct FfmaTile {
    pub(super) t: String,
    pub(super) tx: String,
    pub(super) ty: String,
    pub(super) origin: TileOrigin,
    /// Split-K: this block's slice of `k` (u64).
    pub(super) split: Option<String>,
}

/// The thread's column and row (`tx`, `ty`) of the 16×16 threads of an FFMA tile.
pub(super) fn thread_xy(px: &mut Px, t: &str) -> (String, String) {
    let (tx, ty) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {tx}, {t}, 15;"));
    px.line(format!("shr.u32 {ty}, {t}, 4;"));
    (tx, ty)
}

/// `k_split`: blocks along `z` that share an output tile, each summing a part of `k`.
/// `balance`: the tiles' `k` ranges come from the matmul's skips, and the blocks take the
/// tiles in [`heavy_first`] order.
pub(super) fn ffma_tile(
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
pub(super) fn operand_buffer(px: &mut Px, buf: NodeId) -> Res<(String, u64)> {
    let off = px.offsets.get(buf).ok_or(PtxError::NoOffset(buf.index()))?;
    let r = px.fresh("rd");
    let arena = px.arena.clone();
    px.line(format!("add.s64 {r}, {arena}, {off};"));
    Ok((r, off))
}
