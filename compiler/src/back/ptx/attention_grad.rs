//! Flash attention's backward pass on tensor cores ([`crate::ir::Op::AttentionGrad`]), for
//! 16-bit `q`, `k`, `v` and `dout`: `mma.sync.m16n8k16` with f32 accumulation, as the
//! forward kernel ([`super::attention_mma`]). Two kernels, each owning one side's rows, so
//! no gradient is summed across blocks (no atomics: the result does not depend on the
//! order blocks run in):
//!
//! - **`dq`:** a block owns 64 queries (4 warps of 16) and streams the keys and values 64
//!   at a time: `s = q kᵀ`, `p = 2^(s·c - lse·log₂e)` (`c = scale·log₂e`), `dp = dout vᵀ`,
//!   `ds = p (dp - delta)`, then `dq += ds k`; at the end `dq · scale`.
//! - **`dk`, `dv`:** a block owns 64 keys and streams the queries, their output gradients
//!   and row statistics 64 at a time: `sᵀ = k qᵀ`, `pᵀ`, `dv += pᵀ dout`,
//!   `dpᵀ = v doutᵀ`, `dsᵀ = pᵀ (dpᵀ - delta)`, `dk += dsᵀ q`; at the end `dk · scale`
//!   and `dv`, side by side in one row of the result.
//!
//! Both rebuild the probabilities from the forward's row statistics and never store them;
//! a masked entry (keys past `S`, queries past `T`, causal `j - i > S - T`) is 0. The
//! accumulator layout of two `n8` tiles is the A layout of one `k16` step, so `p` and `ds`
//! go from the score registers straight into the next products (rounded to 16 bits, as
//! the composite rounds the probabilities it stores). Operands are staged with `cp.async`
//! in 16-byte chunks, two stages deep; rows are padded by 16 bytes so `ldmatrix`'s eight
//! rows fall in distinct banks. The own side's fragments are read again from shared
//! memory for each block, which keeps the registers for the accumulators (head
//! dimension 128: 128 of them).

// Fragments are emitted by (tile, register) as the comments index them.
#![allow(clippy::needless_range_loop)]

use super::attention::{
    attention_entry, attention_grid, block_ids, element, key_blocks, operand_regs, tile_origin, BM,
    BN,
};
use super::attention_mma::{ldmatrix, stage_rows, warp_lane, zeroed_tiles, PAD};
use super::mma::MmaKind;
use super::px::{f32_lit, Px};
use super::{LaunchShape, PtxError, Res, DYN_SHARED};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::{Attn, AttnGrad, Kernel, Operand};

/// Threads of a block (4 warps of 16 own rows).
const THREADS: usize = 128;

/// Whether a 16-bit operand's rows are whole aligned 16-byte chunks (what `cp.async` of
/// 16 bytes needs; lowering gives an operand that is not a buffer of its own).
fn aligned(o: &Operand, dtype: DType, offsets: &Offsets) -> bool {
    o.dtype == dtype
        && o.gather.is_none()
        && o.cs == 1
        && o.rs % 8 == 0
        && o.base % 8 == 0
        && o.batch_strides.iter().all(|s| s % 8 == 0)
        && offsets.get(o.buf).is_some_and(|b| b.is_multiple_of(16))
}

/// The lane's byte offsets in a tile of `row_bytes` rows: (A fragments and `.trans` B
/// fragments: row `l % 8 + 8 (l / 8 % 2)`, column `8 (l / 16)`; B fragments of a `[n][k]`
/// tile: row `l % 8 + 8 (l / 16)`, column `8 (l / 8 % 2)`).
struct Lanes {
    l8: String,
    l8m2: String,
    l16: String,
}

impl Lanes {
    fn new(px: &mut Px, lane: &str) -> Lanes {
        let (l8, l8m2, l16) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
        px.line(format!("and.b32 {l8}, {lane}, 7;"));
        px.line(format!("bfe.u32 {l8m2}, {lane}, 3, 1;"));
        px.line(format!("shr.u32 {l16}, {lane}, 4;"));
        Lanes { l8, l8m2, l16 }
    }

    /// Offset of the A / `.trans` pattern, rows from `row0` (a u32 register or 0).
    fn a(&self, px: &mut Px, row_bytes: usize, row0: Option<&str>) -> String {
        let r = px.fresh("r");
        px.line(format!("mad.lo.u32 {r}, {}, 8, {};", self.l8m2, self.l8));
        if let Some(r0) = row0 {
            px.line(format!("add.u32 {r}, {r}, {r0};"));
        }
        px.line(format!("mul.lo.u32 {r}, {r}, {row_bytes};"));
        px.line(format!("mad.lo.u32 {r}, {}, 16, {r};", self.l16));
        r
    }

    /// Offset of the `[n][k]` B pattern.
    fn b(&self, px: &mut Px, row_bytes: usize) -> String {
        let r = px.fresh("r");
        px.line(format!("mad.lo.u32 {r}, {}, 8, {};", self.l16, self.l8));
        px.line(format!("mul.lo.u32 {r}, {r}, {row_bytes};"));
        px.line(format!("mad.lo.u32 {r}, {}, 16, {r};", self.l8m2));
        r
    }
}

/// `acc[2p + h] += A · B` over `ksteps` steps of 16: A's fragments from `a_at + 32 kk`
/// (`ldmatrix.x4`, or given per step by `a_regs`), B's (`n16` groups `p`) at
/// `b_at(kk, p)` bytes from register `b_base`, `.trans` when asked.
#[allow(clippy::too_many_arguments)]
fn product(
    px: &mut Px,
    instr: &str,
    acc: &[Vec<String>],
    ksteps: usize,
    a_at: Option<&str>,
    a_regs: Option<&[Vec<String>]>,
    b_base: &str,
    b_at: impl Fn(usize, usize) -> usize,
    trans: bool,
) {
    for kk in 0..ksteps {
        let a = match (a_regs, a_at) {
            (Some(r), _) => r[kk].clone(),
            (None, Some(at)) => ldmatrix(px, at, kk * 32, false),
            (None, None) => return,
        };
        for p in 0..acc.len() / 2 {
            let b = ldmatrix(px, b_base, b_at(kk, p), trans);
            for h in 0..2 {
                let x = acc[2 * p + h].join(", ");
                px.line(format!(
                    "{instr} {{{x}}}, {{{}}}, {{{}, {}}}, {{{x}}};",
                    a.join(", "),
                    b[2 * h],
                    b[2 * h + 1]
                ));
            }
        }
    }
}

/// The A fragments of `k16` steps made from score tiles (`n8` tiles `2kk`, `2kk + 1`),
/// rounded to 16 bits in pairs (the lower column in the lower half).
fn as_a_fragments(px: &mut Px, kind: MmaKind, tiles: &[Vec<String>]) -> Vec<Vec<String>> {
    let cvt = match kind {
        MmaKind::F16 => "cvt.rn.f16x2.f32",
        _ => "cvt.rn.bf16x2.f32",
    };
    (0..tiles.len() / 2)
        .map(|kk| {
            [(0, 0), (0, 2), (1, 0), (1, 2)]
                .iter()
                .map(|&(u, i)| {
                    let r = px.fresh("r");
                    let tile = &tiles[2 * kk + u];
                    px.line(format!("{cvt} {r}, {}, {};", tile[i + 1], tile[i]));
                    r
                })
                .collect()
        })
        .collect()
}

/// The tensor-core kind of a gradient kernel: `q`, `k`, `v` and `dout` of one 16-bit
/// dtype with aligned rows, head dimensions 16 to 128 (powers of two), a positive scale.
fn plan(at: &Attn, gr: &AttnGrad, offsets: &Offsets) -> Option<MmaKind> {
    let kind = match at.q.dtype {
        DType::BF16 => MmaKind::Bf16,
        DType::F16 => MmaKind::F16,
        _ => return None,
    };
    let dim_ok = |x: usize| (16..=128).contains(&x) && x.is_power_of_two();
    let dt = at.q.dtype;
    let ops_ok = [Some(&at.q), Some(&at.k), at.v.as_ref(), Some(&gr.dout)]
        .iter()
        .all(|o| o.is_some_and(|o| aligned(o, dt, offsets)));
    let stats_ok = [&gr.lse, &gr.delta]
        .iter()
        .all(|o| o.dtype == DType::F32 && o.gather.is_none());
    let out_ok = at.o.as_ref().is_some_and(|o| {
        o.gather.is_none() && matches!(o.dtype, DType::F32 | DType::BF16 | DType::F16)
    });
    (dim_ok(at.d)
        && dim_ok(at.e)
        && ops_ok
        && stats_ok
        && out_ok
        && at.scale.is_finite()
        && at.scale > 0.0
        && at.t > 0
        && at.s > 0)
        .then_some(kind)
}

/// The gradient kernel's PTX and launch shape.
pub(super) fn emit(
    k: &Kernel,
    at: &Attn,
    gr: &AttnGrad,
    offsets: &Offsets,
) -> Res<(String, LaunchShape)> {
    let Some(kind) = plan(at, gr, offsets) else {
        return Err(PtxError::Unsupported {
            kernel: k.name.clone(),
            message: "attention gradient operands the tensor-core kernel does not take \
                      (16-bit, aligned rows, head dimensions 16 to 128)"
                .into(),
        });
    };
    let v = at.v.as_ref();
    let o = at.o.as_ref();
    let (Some(v), Some(o)) = (v, o) else {
        return Err(PtxError::Unsupported {
            kernel: k.name.clone(),
            message: "an attention gradient without values or a result".into(),
        });
    };
    let mut px = Px::new(k, offsets, Vec::new(), Vec::new());
    let ops = Ops { at, gr, v, o, kind };
    let (grid, shared) = if gr.kv {
        emit_kv(&mut px, k, &ops)?
    } else {
        emit_q(&mut px, k, &ops)?
    };
    Ok(attention_entry(&mut px, grid, THREADS, shared))
}

/// A u32 register `x` rows or bytes past `base`.
pub(super) fn plus(px: &mut Px, base: &str, x: usize) -> String {
    let r = px.fresh("r");
    px.line(format!("add.u32 {r}, {base}, {x};"));
    r
}

/// The loop's head over blocks `ix` (u32 register, from its current value) below `end`:
/// every warp is done with the stage the next block goes to, the next block is fetched
/// (`fetch`), and this block's stage is ready. Returns the loop's exit label and the
/// stage's base (u32).
fn loop_head(
    px: &mut Px,
    ix: &str,
    end: &str,
    stage: usize,
    s0: &str,
    name: &str,
    fetch: &dyn Fn(&mut Px, &str),
) -> (String, String, String) {
    let head = px.label(&format!("{name}_blocks"));
    let exit = px.label(&format!("{name}_blocks_end"));
    px.body.push_str(&format!("{head}:\n"));
    let done = px.fresh("p");
    px.line(format!("setp.ge.u32 {done}, {ix}, {end};"));
    px.line(format!("@{done} bra {exit};"));
    px.line("bar.sync 0;");
    let next = plus(px, ix, 1);
    let last = px.fresh("p");
    px.line(format!("setp.ge.u32 {last}, {next}, {end};"));
    let nofetch = px.label(&format!("{name}_nonext"));
    px.line(format!("@{last} bra {nofetch};"));
    fetch(px, &next);
    px.body.push_str(&format!("{nofetch}:\n"));
    px.line("cp.async.commit_group;");
    px.line("cp.async.wait_group 1;");
    px.line("bar.sync 0;");
    let st = px.fresh("r");
    px.line(format!("and.b32 {st}, {ix}, 1;"));
    px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {s0};"));
    (head, exit, st)
}

/// The loop's end: the next block, back to `head`; after the loop, the last copies.
fn loop_tail(px: &mut Px, ix: &str, head: &str, exit: &str) {
    px.line(format!("add.u32 {ix}, {ix}, 1;"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));
    px.line("cp.async.wait_group 0;");
}

/// Runs `f(h, row)` for this thread's own rows `first + 8h` below `limit`.
fn own_rows(
    px: &mut Px,
    first: &str,
    limit: usize,
    label: &str,
    mut f: impl FnMut(&mut Px, usize, &str) -> Res<()>,
) -> Res<()> {
    for h in 0..2 {
        let row = plus(px, first, 8 * h);
        let skip = px.label(label);
        let out = px.fresh("p");
        px.line(format!("setp.ge.u32 {out}, {row}, {limit};"));
        px.line(format!("@{out} bra {skip};"));
        f(px, h, &row)?;
        px.body.push_str(&format!("{skip}:\n"));
    }
    Ok(())
}

/// Fetches the first block (when there is one) in the group of the own tiles, and commits.
fn first_fetch(px: &mut Px, first: &str, end: &str, fetch: &dyn Fn(&mut Px, &str)) {
    let none = px.fresh("p");
    px.line(format!("setp.ge.u32 {none}, {first}, {end};"));
    let skip = px.label("attg_nofetch");
    px.line(format!("@{none} bra {skip};"));
    fetch(px, first);
    px.body.push_str(&format!("{skip}:\n"));
    px.line("cp.async.commit_group;");
}

/// What both kernels read.
struct Ops<'a> {
    at: &'a Attn,
    gr: &'a AttnGrad,
    v: &'a Operand,
    o: &'a Operand,
    kind: MmaKind,
}

/// Row `i`'s statistics for the probabilities: `-lse·log₂e` and `delta` (f32 registers;
/// 0 for a row past `t`).
pub(super) fn row_stats(
    px: &mut Px,
    gr: &AttnGrad,
    stat_regs: [(&str, &str); 2],
    i: &str,
    t: usize,
) -> (String, String) {
    let valid = px.fresh("p");
    px.line(format!("setp.lt.u32 {valid}, {i}, {t};"));
    let row = px.fresh("r");
    px.line(format!("selp.u32 {row}, {i}, 0, {valid};"));
    let mut out = Vec::new();
    for ((buf, off), o) in stat_regs.iter().zip([&gr.lse, &gr.delta]) {
        let addr = element(px, buf, off, o, &row, None);
        let x = px.fresh("f");
        px.line(format!("ld.global.f32 {x}, [{addr}];"));
        px.line(format!("selp.f32 {x}, {x}, 0f00000000, {valid};"));
        out.push(x);
    }
    let nl = px.fresh("f");
    px.line(format!(
        "mul.f32 {nl}, {}, {};",
        out[0],
        f32_lit(-std::f32::consts::LOG2_E)
    ));
    (nl, out[1].clone())
}

/// `x = 2^(x·c + nl)` for every element of the score tiles, `nl` per row (`h`) or column
/// (`j`, `c`) as `nl_of` gives it.
fn probabilities(
    px: &mut Px,
    tiles: &[Vec<String>],
    c: &str,
    nl_of: &dyn Fn(usize, usize) -> String,
) {
    for (j, tile) in tiles.iter().enumerate() {
        for (i, x) in tile.iter().enumerate() {
            px.line(format!("fma.rn.f32 {x}, {x}, {c}, {};", nl_of(j, i)));
            px.line(format!("ex2.approx.ftz.f32 {x}, {x};"));
        }
    }
}

/// `ds = p (dp - delta)` into `dp`'s tiles, `delta` per element as `delta_of` gives it.
fn score_gradients(
    px: &mut Px,
    p: &[Vec<String>],
    dp: &[Vec<String>],
    delta_of: &dyn Fn(usize, usize) -> String,
) {
    for (j, (pt, dt)) in p.iter().zip(dp).enumerate() {
        for (i, (x, y)) in pt.iter().zip(dt).enumerate() {
            px.line(format!("sub.f32 {y}, {y}, {};", delta_of(j, i)));
            px.line(format!("mul.f32 {y}, {y}, {x};"));
        }
    }
}

/// Stores accumulator tiles `acc` (× `mul` when given) of row `row` at columns
/// `col0 + 8j + 2 q4 + c` of the result.
#[allow(clippy::too_many_arguments)]
fn store_tiles(
    px: &mut Px,
    ops: &Ops,
    out: (&str, &str),
    acc: &[Vec<String>],
    h: usize,
    row: &str,
    q4: &str,
    col0: usize,
    mul: Option<f32>,
) -> Res<()> {
    for (j, tile) in acc.iter().enumerate() {
        for cc in 0..2 {
            let col = px.fresh("r");
            px.line(format!("mad.lo.u32 {col}, {q4}, 2, {};", col0 + 8 * j + cc));
            let addr = element(px, out.0, out.1, ops.o, row, Some(&col));
            let y = match mul {
                Some(m) => {
                    let y = px.fresh("f");
                    px.line(format!(
                        "mul.f32 {y}, {}, {};",
                        tile[2 * h + cc],
                        f32_lit(m)
                    ));
                    y
                }
                None => tile[2 * h + cc].clone(),
            };
            px.store(&addr, ops.o.dtype, &y, false)?;
        }
    }
    Ok(())
}

/// `dq`: a block owns 64 queries and streams the keys and values.
fn emit_q(px: &mut Px, k: &Kernel, ops: &Ops) -> Res<([u32; 3], usize)> {
    let (at, gr, v) = (ops.at, ops.gr, ops.v);
    let (t, s, d, e) = (at.t, at.s, at.d, at.e);
    let (row_tiles, grid) = attention_grid(k, at)?;
    // Shared (bytes): q [64][d + 8], dout [64][e + 8]; two stages of k [64][d + 8] and
    // v [64][e + 8].
    let (rbd, rbe) = ((d + PAD) * 2, (e + PAD) * 2);
    let (q_bytes, do_bytes) = (BM * rbd, BM * rbe);
    let k_bytes = BN * rbd;
    let stage = k_bytes + BN * rbe;
    let shared = q_bytes + do_bytes + 2 * stage;

    let (bx, by, tid) = block_ids(px);
    let (warp, lane, g, q4) = warp_lane(px, &tid);
    let (row0, bidx) = tile_origin(px, at, &bx, &by, row_tiles);
    let (qbuf, qoff) = operand_regs(px, &at.q, &bidx)?;
    let (kbuf, koff) = operand_regs(px, &at.k, &bidx)?;
    let (vbuf, voff) = operand_regs(px, v, &bidx)?;
    let (dbuf, doff) = operand_regs(px, &gr.dout, &bidx)?;
    let (lbuf, loff) = operand_regs(px, &gr.lse, &bidx)?;
    let (cbuf, coff) = operand_regs(px, &gr.delta, &bidx)?;
    let (obuf, ooff) = operand_regs(px, ops.o, &bidx)?;
    let sq = px.fresh("r");
    px.line(format!("mov.u32 {sq}, {DYN_SHARED};"));
    let sdo = plus(px, &sq, q_bytes);
    let s0 = plus(px, &sq, q_bytes + do_bytes);
    let nblk = key_blocks(px, at, &row0);

    let fetch = |px: &mut Px, kb: &str| {
        let st = px.fresh("r");
        px.line(format!("and.b32 {st}, {kb}, 1;"));
        px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {s0};"));
        let col0 = px.fresh("r");
        px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
        stage_rows(px, &at.k, &kbuf, &koff, &col0, s, d, &st, rbd, &tid);
        let sv = plus(px, &st, k_bytes);
        stage_rows(px, v, &vbuf, &voff, &col0, s, e, &sv, rbe, &tid);
    };
    stage_rows(px, &at.q, &qbuf, &qoff, &row0, t, d, &sq, rbd, &tid);
    stage_rows(px, &gr.dout, &dbuf, &doff, &row0, t, e, &sdo, rbe, &tid);
    let kb = px.fresh("r");
    px.line(format!("mov.u32 {kb}, 0;"));
    first_fetch(px, &kb, &nblk, &fetch);

    let lanes = Lanes::new(px, &lane);
    let w16 = px.fresh("r");
    px.line(format!("mul.lo.u32 {w16}, {warp}, 16;"));
    let qa = lanes.a(px, rbd, Some(&w16));
    px.line(format!("add.u32 {qa}, {qa}, {sq};"));
    let da = lanes.a(px, rbe, Some(&w16));
    px.line(format!("add.u32 {da}, {da}, {sdo};"));
    let kb_off = lanes.b(px, rbd);
    let vb_off = lanes.b(px, rbe);
    px.line(format!("add.u32 {vb_off}, {vb_off}, {k_bytes};"));
    let kt_off = lanes.a(px, rbd, None);

    // This thread's rows `i0 + 8h`: statistics and key limits (`S`, or causal
    // `min(i + S - T + 1, S)`).
    let i0 = px.fresh("r");
    px.line(format!("add.u32 {i0}, {w16}, {g};"));
    px.line(format!("add.u32 {i0}, {i0}, {row0};"));
    let diag = s as i64 - t as i64 + 1;
    let mut nl = Vec::new();
    let mut delta = Vec::new();
    let mut lims = Vec::new();
    for h in 0..2 {
        let i = plus(px, &i0, 8 * h);
        let (a, b) = row_stats(px, gr, [(&lbuf, &loff), (&cbuf, &coff)], &i, t);
        nl.push(a);
        delta.push(b);
        let lim = px.fresh("r");
        if at.causal {
            px.line(format!("add.s32 {lim}, {i}, {diag};"));
            px.line(format!("min.s32 {lim}, {lim}, {s};"));
        } else {
            px.line(format!("mov.u32 {lim}, {s};"));
        }
        lims.push(lim);
    }
    let tile_lim = px.fresh("r");
    if at.causal {
        px.line(format!("add.s32 {tile_lim}, {row0}, {diag};"));
        px.line(format!("min.s32 {tile_lim}, {tile_lim}, {s};"));
    } else {
        px.line(format!("mov.u32 {tile_lim}, {s};"));
    }
    let acc = zeroed_tiles(px, d / 8);
    let c = f32_lit(at.scale * std::f32::consts::LOG2_E);
    let instr = ops.kind.instr();

    let (head, exit, st) = loop_head(px, &kb, &nblk, stage, &s0, "attq", &fetch);
    let kst = plus_reg(px, &st, &kb_off);
    let vst = plus_reg(px, &st, &vb_off);
    let kta = plus_reg(px, &st, &kt_off);
    // s = q kᵀ and dp = dout vᵀ: 16 rows × 64 keys a warp.
    let sc = zeroed_tiles(px, BN / 8);
    product(
        px,
        instr,
        &sc,
        d / 16,
        Some(&qa),
        None,
        &kst,
        |kk, p| p * 16 * rbd + kk * 32,
        false,
    );
    let dp = zeroed_tiles(px, BN / 8);
    product(
        px,
        instr,
        &dp,
        e / 16,
        Some(&da),
        None,
        &vst,
        |kk, p| p * 16 * rbe + kk * 32,
        false,
    );
    probabilities(px, &sc, &c, &|_, i| nl[i / 2].clone());
    // Masked keys: only a block that reaches the first row's limit.
    let col0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
    let end = plus(px, &col0, BN);
    let whole = px.fresh("p");
    px.line(format!("setp.le.s32 {whole}, {end}, {tile_lim};"));
    let masked = px.label("attq_masked");
    px.line(format!("@{whole} bra {masked};"));
    let j0 = px.fresh("r");
    px.line(format!("mad.lo.u32 {j0}, {q4}, 2, {col0};"));
    for (j, tile) in sc.iter().enumerate() {
        for (i, x) in tile.iter().enumerate() {
            let jj = plus(px, &j0, 8 * j + i % 2);
            let keep = px.fresh("p");
            px.line(format!("setp.lt.s32 {keep}, {jj}, {};", lims[i / 2]));
            px.line(format!("selp.f32 {x}, {x}, 0f00000000, {keep};"));
        }
    }
    px.body.push_str(&format!("{masked}:\n"));
    score_gradients(px, &sc, &dp, &|_, i| delta[i / 2].clone());
    // dq += ds k (k read as `[key][d]`, `.trans`).
    let dsa = as_a_fragments(px, ops.kind, &dp);
    product(
        px,
        instr,
        &acc,
        BN / 16,
        None,
        Some(&dsa),
        &kta,
        |kk, p| kk * 16 * rbd + p * 32,
        true,
    );
    loop_tail(px, &kb, &head, &exit);
    own_rows(px, &i0, t, "attq_row", |px, h, i| {
        store_tiles(px, ops, (&obuf, &ooff), &acc, h, i, &q4, 0, Some(at.scale))
    })?;
    Ok((grid, shared))
}

/// `dk` and `dv`: a block owns 64 keys and streams the queries, their output gradients
/// and statistics.
fn emit_kv(px: &mut Px, k: &Kernel, ops: &Ops) -> Res<([u32; 3], usize)> {
    let (at, gr, v) = (ops.at, ops.gr, ops.v);
    let (t, s, d, e) = (at.t, at.s, at.d, at.e);
    let (row_tiles, mut grid) = attention_grid(k, at)?;
    grid[0] = u32::try_from(s.div_ceil(BN)).map_err(|_| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: "too many attention key tiles".into(),
    })?;
    // Shared (bytes): k [64][d + 8], v [64][e + 8]; two stages of q [64][d + 8],
    // dout [64][e + 8], lse [64] and delta [64] (f32).
    let (rbd, rbe) = ((d + PAD) * 2, (e + PAD) * 2);
    let (k_bytes, v_bytes) = (BN * rbd, BN * rbe);
    let (q_bytes, do_bytes) = (BM * rbd, BM * rbe);
    let stats = q_bytes + do_bytes;
    let stage = stats + 2 * BM * 4;
    let shared = k_bytes + v_bytes + 2 * stage;

    let (bx, by, tid) = block_ids(px);
    let (warp, lane, g, q4) = warp_lane(px, &tid);
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
    let sk = px.fresh("r");
    px.line(format!("mov.u32 {sk}, {DYN_SHARED};"));
    let sv = plus(px, &sk, k_bytes);
    let s0 = plus(px, &sk, k_bytes + v_bytes);
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
    let nq = px.fresh("r");
    px.line(format!("mov.u32 {nq}, {};", t.div_ceil(BM)));

    // Stats: thread `tid` copies lse (tid < 64) or delta of query `r0 + tid % 64`.
    let which = px.fresh("p");
    px.line(format!("setp.lt.u32 {which}, {tid}, {BM};"));
    let srow = px.fresh("r");
    px.line(format!("rem.u32 {srow}, {tid}, {BM};"));
    let fetch = |px: &mut Px, ix: &str| {
        let st = px.fresh("r");
        px.line(format!("and.b32 {st}, {ix}, 1;"));
        px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {s0};"));
        let r0 = px.fresh("r");
        px.line(format!("mul.lo.u32 {r0}, {ix}, {BM};"));
        stage_rows(px, &at.q, &qbuf, &qoff, &r0, t, d, &st, rbd, &tid);
        let sd = plus(px, &st, q_bytes);
        stage_rows(px, &gr.dout, &dbuf, &doff, &r0, t, e, &sd, rbe, &tid);
        let row = plus_reg(px, &r0, &srow);
        let valid = px.fresh("p");
        px.line(format!("setp.lt.u32 {valid}, {row}, {t};"));
        px.line(format!("selp.u32 {row}, {row}, 0, {valid};"));
        let al = element(px, &lbuf, &loff, &gr.lse, &row, None);
        let ad = element(px, &cbuf, &coff, &gr.delta, &row, None);
        let addr = px.fresh("rd");
        px.line(format!("selp.b64 {addr}, {al}, {ad}, {which};"));
        let dst = px.fresh("r");
        px.line(format!("mad.lo.u32 {dst}, {tid}, 4, {st};"));
        px.line(format!("add.u32 {dst}, {dst}, {stats};"));
        let size = px.fresh("r");
        px.line(format!("selp.u32 {size}, 4, 0, {valid};"));
        px.line(format!(
            "cp.async.ca.shared.global [{dst}], [{addr}], 4, {size};"
        ));
    };
    stage_rows(px, &at.k, &kbuf, &koff, &key0, s, d, &sk, rbd, &tid);
    stage_rows(px, v, &vbuf, &voff, &key0, s, e, &sv, rbe, &tid);
    first_fetch(px, &qb, &nq, &fetch);

    let lanes = Lanes::new(px, &lane);
    let w16 = px.fresh("r");
    px.line(format!("mul.lo.u32 {w16}, {warp}, 16;"));
    let ka = lanes.a(px, rbd, Some(&w16));
    px.line(format!("add.u32 {ka}, {ka}, {sk};"));
    let va = lanes.a(px, rbe, Some(&w16));
    px.line(format!("add.u32 {va}, {va}, {sv};"));
    let qb_off = lanes.b(px, rbd);
    let dob_off = lanes.b(px, rbe);
    px.line(format!("add.u32 {dob_off}, {dob_off}, {q_bytes};"));
    let doa_off = lanes.a(px, rbe, None);
    px.line(format!("add.u32 {doa_off}, {doa_off}, {q_bytes};"));
    let qa_off = lanes.a(px, rbd, None);

    // This thread's keys `j0 + 8h` see queries `i >= j + T - S` (causal).
    let j0 = px.fresh("r");
    px.line(format!("add.u32 {j0}, {w16}, {g};"));
    px.line(format!("add.u32 {j0}, {j0}, {key0};"));
    let los: Vec<String> = (0..2)
        .map(|h| {
            let lo = px.fresh("r");
            px.line(format!(
                "add.s32 {lo}, {j0}, {};",
                8 * h as i64 + t as i64 - s as i64
            ));
            lo
        })
        .collect();
    // The tile's last key's first query: blocks from it on (and whole below `T`) need no
    // mask.
    let tile_lo = px.fresh("r");
    px.line(format!(
        "add.s32 {tile_lo}, {key0}, {};",
        BN as i64 - 1 + t as i64 - s as i64
    ));
    let acc_dk = zeroed_tiles(px, d / 8);
    let acc_dv = zeroed_tiles(px, e / 8);
    let c = f32_lit(at.scale * std::f32::consts::LOG2_E);
    let instr = ops.kind.instr();

    let (head, exit, st) = loop_head(px, &qb, &nq, stage, &s0, "attkv", &fetch);
    let qst = plus_reg(px, &st, &qb_off);
    let dst_b = plus_reg(px, &st, &dob_off);
    let dst_a = plus_reg(px, &st, &doa_off);
    let qta = plus_reg(px, &st, &qa_off);
    // sᵀ = k qᵀ and dpᵀ = v doutᵀ: 16 keys × 64 queries a warp.
    let sc = zeroed_tiles(px, BM / 8);
    product(
        px,
        instr,
        &sc,
        d / 16,
        Some(&ka),
        None,
        &qst,
        |kk, p| p * 16 * rbd + kk * 32,
        false,
    );
    let dp = zeroed_tiles(px, BM / 8);
    product(
        px,
        instr,
        &dp,
        e / 16,
        Some(&va),
        None,
        &dst_b,
        |kk, p| p * 16 * rbe + kk * 32,
        false,
    );
    // The statistics of columns `8j + 2 q4 + c`.
    let sbase = px.fresh("r");
    px.line(format!("mad.lo.u32 {sbase}, {q4}, 8, {st};"));
    px.line(format!("add.u32 {sbase}, {sbase}, {stats};"));
    let mut nl = Vec::new();
    let mut delta = Vec::new();
    for j in 0..BM / 8 {
        let (l0, l1, d0, d1) = (px.fresh("f"), px.fresh("f"), px.fresh("f"), px.fresh("f"));
        px.line(format!(
            "ld.shared.v2.f32 {{{l0}, {l1}}}, [{sbase}+{}];",
            32 * j
        ));
        px.line(format!(
            "ld.shared.v2.f32 {{{d0}, {d1}}}, [{sbase}+{}];",
            32 * j + 4 * BM
        ));
        for l in [&l0, &l1] {
            px.line(format!(
                "mul.f32 {l}, {l}, {};",
                f32_lit(-std::f32::consts::LOG2_E)
            ));
        }
        nl.push([l0, l1]);
        delta.push([d0, d1]);
    }
    probabilities(px, &sc, &c, &|j, i| nl[j][i % 2].clone());
    // Masked entries: queries past `T`, and (causal) `i < j + T - S`.
    let r0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {r0}, {qb}, {BM};"));
    let whole = px.fresh("p");
    let r_end = plus(px, &r0, BM);
    px.line(format!("setp.le.u32 {whole}, {r_end}, {t};"));
    if at.causal {
        let after = px.fresh("p");
        px.line(format!("setp.ge.s32 {after}, {r0}, {tile_lo};"));
        px.line(format!("and.pred {whole}, {whole}, {after};"));
    }
    let masked = px.label("attkv_masked");
    px.line(format!("@{whole} bra {masked};"));
    let i0 = px.fresh("r");
    px.line(format!("mad.lo.u32 {i0}, {q4}, 2, {r0};"));
    for (j, tile) in sc.iter().enumerate() {
        for (i, x) in tile.iter().enumerate() {
            let ii = plus(px, &i0, 8 * j + i % 2);
            let keep = px.fresh("p");
            px.line(format!("setp.lt.s32 {keep}, {ii}, {t};"));
            if at.causal {
                let seen = px.fresh("p");
                px.line(format!("setp.ge.s32 {seen}, {ii}, {};", los[i / 2]));
                px.line(format!("and.pred {keep}, {keep}, {seen};"));
            }
            px.line(format!("selp.f32 {x}, {x}, 0f00000000, {keep};"));
        }
    }
    px.body.push_str(&format!("{masked}:\n"));
    // dv += pᵀ dout (dout read as `[query][e]`, `.trans`).
    let pa = as_a_fragments(px, ops.kind, &sc);
    product(
        px,
        instr,
        &acc_dv,
        BM / 16,
        None,
        Some(&pa),
        &dst_a,
        |kk, p| kk * 16 * rbe + p * 32,
        true,
    );
    score_gradients(px, &sc, &dp, &|j, i| delta[j][i % 2].clone());
    // dk += dsᵀ q (q read as `[query][d]`, `.trans`).
    let dsa = as_a_fragments(px, ops.kind, &dp);
    product(
        px,
        instr,
        &acc_dk,
        BM / 16,
        None,
        Some(&dsa),
        &qta,
        |kk, p| kk * 16 * rbd + p * 32,
        true,
    );
    loop_tail(px, &qb, &head, &exit);
    own_rows(px, &j0, s, "attkv_row", |px, h, j| {
        store_tiles(
            px,
            ops,
            (&obuf, &ooff),
            &acc_dk,
            h,
            j,
            &q4,
            0,
            Some(at.scale),
        )?;
        store_tiles(px, ops, (&obuf, &ooff), &acc_dv, h, j, &q4, d, None)
    })?;
    Ok((grid, shared))
}

/// A u32 register `base + x` (both registers).
pub(super) fn plus_reg(px: &mut Px, base: &str, x: &str) -> String {
    let r = px.fresh("r");
    px.line(format!("add.u32 {r}, {base}, {x};"));
    r
}
