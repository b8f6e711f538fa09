//! Flash attention's backward pass in exact f32 FFMA ([`crate::ir::Op::AttentionGrad`] with
//! f32 `q`, `k`, `v` and `dout`): the f32 counterpart of [`super::attention_grad`], laid out
//! as the forward kernel ([`super::attention`]). Two kernels, each owning 64 rows of one
//! side, so no gradient is summed across blocks (no atomics; the result does not depend on
//! the order blocks run in):
//!
//! - **`dq`:** a block owns 64 queries and streams the keys and values 64 at a time:
//!   `s = q kᵀ`, `p = 2^(s·c - lse·log₂e)` (`c = scale·log₂e`), `dp = dout vᵀ`,
//!   `ds = p (dp - delta)`, then `dq += ds k`; at the end `dq · scale`.
//! - **`dk`, `dv`:** a block owns 64 keys and streams the queries and their output
//!   gradients: `sᵀ = k qᵀ`, `pᵀ`, `dpᵀ = v doutᵀ`, `dsᵀ = pᵀ (dpᵀ - delta)`,
//!   `dv += pᵀ dout`, `dk += dsᵀ q`; at the end `dk · scale` and `dv`, side by side in one
//!   row of the result.
//!
//! Both rebuild the probabilities from the forward's row statistics and never store them;
//! a masked entry (keys past `S` in `dq`, queries past `T` in `dk`/`dv`, causal
//! `j - i > S - T`) has `p = 0` and `ds = 0`, as the composite's `where` gives (also where
//! `delta` is NaN, on a fully masked row, whose gradients the composite makes NaN). Rows
//! past the own side's end are computed but not stored.
//!
//! - **Block:** 256 threads as 16×16 (`tx`, `ty`). A thread holds rows `4ty..4ty + 4` of the
//!   own side and columns `tx + 16b` (`b < 4`) of the streamed block's scores, and the own
//!   rows' gradients at columns `tx + 16c` (`c < dim / 16`).
//! - **Shared memory:** the own side transposed (`[dim][68]`: a thread's four rows are one
//!   `ld.shared.v4`), the streamed block as it lies in rows of `dim + 1` words (the scores
//!   read a warp's 16 rows at one column, the gradients 16 consecutive words of one row:
//!   both in distinct banks), and the probabilities or score gradients transposed
//!   (`[64][68]`), which the gradient products read a row of four at a time.

// Register tiles are emitted by (row, column) of the tile, as the comments index them.
#![allow(clippy::needless_range_loop)]

use super::attention::{
    attention_entry, attention_grid, block_ids, copy_tile, element, key_blocks, operand_regs,
    tile_origin, BM, BN, Q_STRIDE, THREADS,
};
use super::attention_grad::{plus, plus_reg, row_stats};
use super::px::{f32_lit, Px};
use super::{LaunchShape, PtxError, Res, DYN_SHARED};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::{Attn, AttnGrad, Kernel, Operand};

// A thread's tile is 4 rows by 4 columns of 16 apart: 64 × 64 over 256 threads.
const _: () = assert!(BM == 64 && BN == 64 && THREADS == 256);

/// Bytes of shared memory a block may use (Hopper: 227 KiB).
const SHARED_MAX: usize = 227 * 1024;

/// Whether the FFMA gradient kernels take this attention: f32 `q`, `k`, `v` and `dout`,
/// f32 row statistics, no gathers, head dimensions the forward kernel takes, a positive
/// finite scale, and shared memory within Hopper's.
pub(super) fn supported(at: &Attn, gr: &AttnGrad) -> bool {
    let f32_plain = |o: &Operand| o.dtype == DType::F32 && o.gather.is_none();
    let ops = [Some(&at.q), Some(&at.k), at.v.as_ref(), Some(&gr.dout)]
        .iter()
        .all(|o| o.is_some_and(f32_plain));
    let stats = f32_plain(&gr.lse) && f32_plain(&gr.delta);
    let out = at.o.as_ref().is_some_and(|o| o.gather.is_none());
    ops && stats
        && out
        && crate::ir::ops::attention_supported(at.d, at.e)
        && at.scale.is_finite()
        && at.scale > 0.0
        && at.t > 0
        && at.s > 0
        && shared_bytes(at.d, at.e, gr.kv) <= SHARED_MAX
}

/// Shared bytes of a kernel: two own tiles transposed, two streamed tiles, and one (`dq`) or
/// two (`dk`, `dv`: `p` and `ds`) transposed score tiles.
fn shared_bytes(d: usize, e: usize, kv: bool) -> usize {
    let own = (d + e) * Q_STRIDE * 4;
    let streamed = BN * (d + 1 + e + 1) * 4;
    let scores = if kv { 2 } else { 1 } * BN * Q_STRIDE * 4;
    own + streamed + scores
}

/// The gradient kernel's PTX and launch shape.
pub(super) fn emit(
    k: &Kernel,
    at: &Attn,
    gr: &AttnGrad,
    offsets: &Offsets,
) -> Res<(String, LaunchShape)> {
    let (Some(v), Some(o)) = (at.v.as_ref(), at.o.as_ref()) else {
        return Err(PtxError::Unsupported {
            kernel: k.name.clone(),
            message: "an attention gradient without values or a result".into(),
        });
    };
    if !supported(at, gr) {
        return Err(PtxError::Unsupported {
            kernel: k.name.clone(),
            message: "attention gradient operands the f32 kernel does not take \
                      (f32, not gathered, head dimensions multiples of 16 up to 128)"
                .into(),
        });
    }
    let mut px = Px::new(k, offsets, Vec::new(), Vec::new());
    let ops = Ops { at, gr, v, o };
    let grid = if gr.kv {
        emit_kv(&mut px, k, &ops)?
    } else {
        emit_q(&mut px, k, &ops)?
    };
    Ok(attention_entry(
        &mut px,
        grid,
        THREADS,
        shared_bytes(at.d, at.e, gr.kv),
    ))
}

/// What both kernels read.
struct Ops<'a> {
    at: &'a Attn,
    gr: &'a AttnGrad,
    v: &'a Operand,
    o: &'a Operand,
}

/// A u32 register `base + a·x` (`a` a register).
fn mad(px: &mut Px, a: &str, x: usize, base: &str) -> String {
    let r = px.fresh("r");
    px.line(format!("mad.lo.u32 {r}, {a}, {x}, {base};"));
    r
}

/// `rows × cols` f32 registers set to 0.
fn zeroed(px: &mut Px, rows: usize, cols: usize) -> Vec<Vec<String>> {
    (0..rows)
        .map(|_| {
            (0..cols)
                .map(|_| {
                    let r = px.fresh("f");
                    px.line(format!("mov.f32 {r}, 0f00000000;"));
                    r
                })
                .collect()
        })
        .collect()
}

/// The scores of a thread's 4 own rows and 4 streamed rows: `Σ_x own[x][4ty + a] ·
/// streamed[tx + 16b][x]` over `dim` steps. `own` addresses the thread's four rows of the
/// transposed own tile, `streamed` row `tx` of the streamed tile (rows of `dim + 1` words).
fn scores(px: &mut Px, own: &str, streamed: &str, dim: usize) -> Vec<Vec<String>> {
    let sc = zeroed(px, 4, 4);
    for x in 0..dim {
        let ov: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
        px.line(format!(
            "ld.shared.v4.f32 {{{}}}, [{own}+{}];",
            ov.join(", "),
            x * Q_STRIDE * 4
        ));
        let sv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
        for (b, r) in sv.iter().enumerate() {
            px.line(format!(
                "ld.shared.f32 {r}, [{streamed}+{}];",
                (16 * b * (dim + 1) + x) * 4
            ));
        }
        for (a, row) in sc.iter().enumerate() {
            for (b, y) in row.iter().enumerate() {
                px.line(format!("fma.rn.f32 {y}, {}, {}, {y};", ov[a], sv[b]));
            }
        }
    }
    sc
}

/// `acc[a][c] += Σ_y tile[y][4ty + a] · streamed[y][tx + 16c]` over the block's 64 streamed
/// rows: `tile` addresses the thread's four columns of a transposed score tile, `streamed`
/// column `tx` of the streamed tile (rows of `dim + 1` words).
fn accumulate(px: &mut Px, acc: &[Vec<String>], tile: &str, streamed: &str, dim: usize) {
    for y in 0..BN {
        let pv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
        px.line(format!(
            "ld.shared.v4.f32 {{{}}}, [{tile}+{}];",
            pv.join(", "),
            y * Q_STRIDE * 4
        ));
        let sv: Vec<String> = (0..dim / 16).map(|_| px.fresh("f")).collect();
        for (c, r) in sv.iter().enumerate() {
            px.line(format!(
                "ld.shared.f32 {r}, [{streamed}+{}];",
                (y * (dim + 1) + 16 * c) * 4
            ));
        }
        for (a, row) in acc.iter().enumerate() {
            for (c, x) in row.iter().enumerate() {
                px.line(format!("fma.rn.f32 {x}, {}, {}, {x};", pv[a], sv[c]));
            }
        }
    }
}

/// Stores a thread's 4 × 4 tile transposed: `x[a][b]` at row `tx + 16b`, column `4ty + a`
/// of a `[64][68]` tile (`at` addresses row `tx`, column `4ty`).
fn store_transposed(px: &mut Px, x: &[Vec<String>], at: &str) {
    for b in 0..4 {
        px.line(format!(
            "st.shared.v4.f32 [{at}+{}], {{{}, {}, {}, {}}};",
            16 * b * Q_STRIDE * 4,
            x[0][b],
            x[1][b],
            x[2][b],
            x[3][b]
        ));
    }
}

/// Turns the scores into probabilities and `dp` into the score gradients:
/// `p = 2^(s·c + nl)`, `ds = p (dp - delta)`, both 0 where `keep(a, b)` is false.
fn gradients_of_scores(
    px: &mut Px,
    sc: &[Vec<String>],
    dp: &[Vec<String>],
    c: &str,
    stat: &dyn Fn(usize, usize) -> (String, String),
    keep: &dyn Fn(&mut Px, usize, usize) -> String,
) {
    for a in 0..4 {
        for b in 0..4 {
            let (nl, delta) = stat(a, b);
            let (x, y) = (&sc[a][b], &dp[a][b]);
            px.line(format!("fma.rn.f32 {x}, {x}, {c}, {nl};"));
            px.line(format!("ex2.approx.ftz.f32 {x}, {x};"));
            px.line(format!("sub.f32 {y}, {y}, {delta};"));
            px.line(format!("mul.f32 {y}, {y}, {x};"));
            let k = keep(px, a, b);
            px.line(format!("selp.f32 {x}, {x}, 0f00000000, {k};"));
            px.line(format!("selp.f32 {y}, {y}, 0f00000000, {k};"));
        }
    }
}

/// Stores a thread's gradient rows `first + a` below `limit`: `acc[a][c]` (× `mul` when
/// given) at column `col0 + tx + 16c` of the result.
#[allow(clippy::too_many_arguments)]
fn store_rows(
    px: &mut Px,
    ops: &Ops,
    out: (&str, &str),
    acc: &[Vec<String>],
    first: &str,
    limit: usize,
    tx: &str,
    col0: usize,
    mul: Option<f32>,
) -> Res<()> {
    for (a, row) in acc.iter().enumerate() {
        let r = plus(px, first, a);
        let skip = px.label("attf_row");
        let past = px.fresh("p");
        px.line(format!("setp.ge.u32 {past}, {r}, {limit};"));
        px.line(format!("@{past} bra {skip};"));
        for (c, x) in row.iter().enumerate() {
            let col = plus(px, tx, col0 + 16 * c);
            let addr = element(px, out.0, out.1, ops.o, &r, Some(&col));
            let y = match mul {
                Some(m) => {
                    let y = px.fresh("f");
                    px.line(format!("mul.f32 {y}, {x}, {};", f32_lit(m)));
                    y
                }
                None => x.clone(),
            };
            px.store(&addr, ops.o.dtype, &y, false)?;
        }
        px.body.push_str(&format!("{skip}:\n"));
    }
    Ok(())
}

/// The thread's column and row of the 16 × 16 block (u32 registers).
fn thread_xy(px: &mut Px, tid: &str) -> (String, String) {
    let (tx, ty) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {tx}, {tid}, 15;"));
    px.line(format!("shr.u32 {ty}, {tid}, 4;"));
    (tx, ty)
}

/// `dq`: a block owns 64 queries and streams the keys and values.
fn emit_q(px: &mut Px, k: &Kernel, ops: &Ops) -> Res<[u32; 3]> {
    let (at, gr, v) = (ops.at, ops.gr, ops.v);
    let (t, s, d, e) = (at.t, at.s, at.d, at.e);
    let (row_tiles, grid) = attention_grid(k, at)?;
    // Shared (bytes): q and dout transposed ([d][68], [e][68]); the block's k [64][d + 1]
    // and v [64][e + 1]; ds transposed [64][68].
    let (qt_bytes, dot_bytes) = (d * Q_STRIDE * 4, e * Q_STRIDE * 4);
    let (k_bytes, v_bytes) = (BN * (d + 1) * 4, BN * (e + 1) * 4);

    let (bx, by, tid) = block_ids(px);
    let (tx, ty) = thread_xy(px, &tid);
    let (row0, bidx) = tile_origin(px, at, &bx, &by, row_tiles);
    let (qbuf, qoff) = operand_regs(px, &at.q, &bidx)?;
    let (kbuf, koff) = operand_regs(px, &at.k, &bidx)?;
    let (vbuf, voff) = operand_regs(px, v, &bidx)?;
    let (dbuf, doff) = operand_regs(px, &gr.dout, &bidx)?;
    let (lbuf, loff) = operand_regs(px, &gr.lse, &bidx)?;
    let (cbuf, coff) = operand_regs(px, &gr.delta, &bidx)?;
    let (obuf, ooff) = operand_regs(px, ops.o, &bidx)?;
    let sqt = px.fresh("r");
    px.line(format!("mov.u32 {sqt}, {DYN_SHARED};"));
    let sdot = plus(px, &sqt, qt_bytes);
    let sk = plus(px, &sdot, dot_bytes);
    let sv = plus(px, &sk, k_bytes);
    let sds = plus(px, &sv, v_bytes);
    copy_tile(
        px, &at.q, &qbuf, &qoff, &row0, t, d, &sqt, true, Q_STRIDE, &tid,
    );
    copy_tile(
        px, &gr.dout, &dbuf, &doff, &row0, t, e, &sdot, true, Q_STRIDE, &tid,
    );

    // The own rows `i = row0 + 4ty + a`: statistics, and the keys they see
    // (`j < min(i + S - T + 1, S)` causal, else `j < S`).
    let i0 = mad(px, &ty, 4, &row0);
    let mut stats = Vec::new();
    let mut lims = Vec::new();
    for a in 0..4 {
        let i = plus(px, &i0, a);
        stats.push(row_stats(px, gr, [(&lbuf, &loff), (&cbuf, &coff)], &i, t));
        let lim = px.fresh("r");
        if at.causal {
            px.line(format!("add.s32 {lim}, {i}, {};", s as i64 - t as i64 + 1));
            px.line(format!("min.s32 {lim}, {lim}, {s};"));
        } else {
            px.line(format!("mov.u32 {lim}, {s};"));
        }
        lims.push(lim);
    }
    let own_q = mad(px, &ty, 16, &sqt);
    let own_do = mad(px, &ty, 16, &sdot);
    let row_k = mad(px, &tx, (d + 1) * 4, &sk);
    let row_v = mad(px, &tx, (e + 1) * 4, &sv);
    let col_k = mad(px, &tx, 4, &sk);
    let ds_write = mad(px, &tx, Q_STRIDE * 4, &sds);
    let ds_write = mad(px, &ty, 16, &ds_write);
    let ds_read = mad(px, &ty, 16, &sds);
    let c = f32_lit(at.scale * std::f32::consts::LOG2_E);
    let acc = zeroed(px, 4, d / 16);

    let nblk = key_blocks(px, at, &row0);
    let kb = px.fresh("r");
    px.line(format!("mov.u32 {kb}, 0;"));
    let head = px.label("attfq_blocks");
    let exit = px.label("attfq_blocks_end");
    px.body.push_str(&format!("{head}:\n"));
    let done = px.fresh("p");
    px.line(format!("setp.ge.u32 {done}, {kb}, {nblk};"));
    px.line(format!("@{done} bra {exit};"));
    let col0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
    // The previous block's readers are done with k, v and ds.
    px.line("bar.sync 0;");
    copy_tile(
        px,
        &at.k,
        &kbuf,
        &koff,
        &col0,
        s,
        d,
        &sk,
        false,
        d + 1,
        &tid,
    );
    copy_tile(px, v, &vbuf, &voff, &col0, s, e, &sv, false, e + 1, &tid);
    px.line("bar.sync 0;");
    let sc = scores(px, &own_q, &row_k, d);
    let dp = scores(px, &own_do, &row_v, e);
    let j0 = plus_reg(px, &col0, &tx);
    gradients_of_scores(px, &sc, &dp, &c, &|a, _| stats[a].clone(), &|px, a, b| {
        let j = plus(px, &j0, 16 * b);
        let keep = px.fresh("p");
        px.line(format!("setp.lt.s32 {keep}, {j}, {};", lims[a]));
        keep
    });
    store_transposed(px, &dp, &ds_write);
    px.line("bar.sync 0;");
    accumulate(px, &acc, &ds_read, &col_k, d);
    px.line(format!("add.u32 {kb}, {kb}, 1;"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));
    store_rows(
        px,
        ops,
        (&obuf, &ooff),
        &acc,
        &i0,
        t,
        &tx,
        0,
        Some(at.scale),
    )?;
    Ok(grid)
}

/// `dk`, `dv`: a block owns 64 keys and streams the queries and their output gradients.
fn emit_kv(px: &mut Px, k: &Kernel, ops: &Ops) -> Res<[u32; 3]> {
    let (at, gr, v) = (ops.at, ops.gr, ops.v);
    let (t, s, d, e) = (at.t, at.s, at.d, at.e);
    let (row_tiles, mut grid) = attention_grid(k, at)?;
    grid[0] = u32::try_from(s.div_ceil(BN)).map_err(|_| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: "too many attention key tiles".into(),
    })?;
    // Shared (bytes): k and v transposed ([d][68], [e][68]); the block's q [64][d + 1] and
    // dout [64][e + 1]; p and ds transposed ([64][68] each).
    let (kt_bytes, vt_bytes) = (d * Q_STRIDE * 4, e * Q_STRIDE * 4);
    let (q_bytes, do_bytes) = (BM * (d + 1) * 4, BM * (e + 1) * 4);
    let p_bytes = BM * Q_STRIDE * 4;

    let (bx, by, tid) = block_ids(px);
    let (tx, ty) = thread_xy(px, &tid);
    let (_, bidx) = tile_origin(px, at, &bx, &by, row_tiles);
    let key0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {key0}, {bx}, {BN};"));
    let (qbuf, qoff) = operand_regs(px, &at.q, &bidx)?;
    let (kbuf, koff) = operand_regs(px, &at.k, &bidx)?;
    let (vbuf, voff) = operand_regs(px, v, &bidx)?;
    let (dbuf, doff) = operand_regs(px, &gr.dout, &bidx)?;
    let (lbuf, loff) = operand_regs(px, &gr.lse, &bidx)?;
    let (cbuf, coff) = operand_regs(px, &gr.delta, &bidx)?;
    let (obuf, ooff) = operand_regs(px, ops.o, &bidx)?;
    let skt = px.fresh("r");
    px.line(format!("mov.u32 {skt}, {DYN_SHARED};"));
    let svt = plus(px, &skt, kt_bytes);
    let sq = plus(px, &svt, vt_bytes);
    let sdo = plus(px, &sq, q_bytes);
    let sp = plus(px, &sdo, do_bytes);
    let sds = plus(px, &sp, p_bytes);
    copy_tile(
        px, &at.k, &kbuf, &koff, &key0, s, d, &skt, true, Q_STRIDE, &tid,
    );
    copy_tile(px, v, &vbuf, &voff, &key0, s, e, &svt, true, Q_STRIDE, &tid);

    // Query blocks: from the first a key of this tile sees (causal: `i >= j + T - S`).
    let qb = px.fresh("r");
    if at.causal {
        let lo = px.fresh("r");
        px.line(format!("add.s32 {lo}, {key0}, {};", t as i64 - s as i64));
        px.line(format!("max.s32 {lo}, {lo}, 0;"));
        px.line(format!("div.u32 {qb}, {lo}, {BM};"));
    } else {
        px.line(format!("mov.u32 {qb}, 0;"));
    }
    // The own keys `j = key0 + 4ty + a` see queries `i >= j + T - S` (causal).
    let j0 = mad(px, &ty, 4, &key0);
    let los: Vec<String> = (0..4)
        .map(|a| plus_signed(px, &j0, a as i64 + t as i64 - s as i64))
        .collect();
    let own_k = mad(px, &ty, 16, &skt);
    let own_v = mad(px, &ty, 16, &svt);
    let row_q = mad(px, &tx, (d + 1) * 4, &sq);
    let row_do = mad(px, &tx, (e + 1) * 4, &sdo);
    let col_q = mad(px, &tx, 4, &sq);
    let col_do = mad(px, &tx, 4, &sdo);
    let p_write = mad(px, &tx, Q_STRIDE * 4, &sp);
    let p_write = mad(px, &ty, 16, &p_write);
    let ds_write = mad(px, &tx, Q_STRIDE * 4, &sds);
    let ds_write = mad(px, &ty, 16, &ds_write);
    let p_read = mad(px, &ty, 16, &sp);
    let ds_read = mad(px, &ty, 16, &sds);
    let c = f32_lit(at.scale * std::f32::consts::LOG2_E);
    let acc_dk = zeroed(px, 4, d / 16);
    let acc_dv = zeroed(px, 4, e / 16);

    let nq = px.fresh("r");
    px.line(format!("mov.u32 {nq}, {};", t.div_ceil(BM)));
    let head = px.label("attfkv_blocks");
    let exit = px.label("attfkv_blocks_end");
    px.body.push_str(&format!("{head}:\n"));
    let done = px.fresh("p");
    px.line(format!("setp.ge.u32 {done}, {qb}, {nq};"));
    px.line(format!("@{done} bra {exit};"));
    let r0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {r0}, {qb}, {BM};"));
    // The previous block's readers are done with q, dout, p and ds.
    px.line("bar.sync 0;");
    copy_tile(px, &at.q, &qbuf, &qoff, &r0, t, d, &sq, false, d + 1, &tid);
    copy_tile(
        px,
        &gr.dout,
        &dbuf,
        &doff,
        &r0,
        t,
        e,
        &sdo,
        false,
        e + 1,
        &tid,
    );
    // The streamed queries `i = r0 + tx + 16b`: statistics.
    let i0 = plus_reg(px, &r0, &tx);
    let cols: Vec<String> = (0..4).map(|b| plus(px, &i0, 16 * b)).collect();
    let stats: Vec<(String, String)> = cols
        .iter()
        .map(|i| row_stats(px, gr, [(&lbuf, &loff), (&cbuf, &coff)], i, t))
        .collect();
    px.line("bar.sync 0;");
    let sc = scores(px, &own_k, &row_q, d);
    let dp = scores(px, &own_v, &row_do, e);
    gradients_of_scores(px, &sc, &dp, &c, &|_, b| stats[b].clone(), &|px, a, b| {
        let keep = px.fresh("p");
        px.line(format!("setp.lt.u32 {keep}, {}, {t};", cols[b]));
        if at.causal {
            let seen = px.fresh("p");
            px.line(format!("setp.ge.s32 {seen}, {}, {};", cols[b], los[a]));
            px.line(format!("and.pred {keep}, {keep}, {seen};"));
        }
        keep
    });
    store_transposed(px, &sc, &p_write);
    store_transposed(px, &dp, &ds_write);
    px.line("bar.sync 0;");
    accumulate(px, &acc_dv, &p_read, &col_do, e);
    accumulate(px, &acc_dk, &ds_read, &col_q, d);
    px.line(format!("add.u32 {qb}, {qb}, 1;"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));
    let out = (obuf.as_str(), ooff.as_str());
    store_rows(px, ops, out, &acc_dk, &j0, s, &tx, 0, Some(at.scale))?;
    store_rows(px, ops, out, &acc_dv, &j0, s, &tx, d, None)?;
    Ok(grid)
}

/// An s32 register `base + x` (`x` may be negative).
fn plus_signed(px: &mut Px, base: &str, x: i64) -> String {
    let r = px.fresh("r");
    px.line(format!("add.s32 {r}, {base}, {x};"));
    r
}
