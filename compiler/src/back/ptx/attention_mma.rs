//! Fused attention on tensor cores, for 16-bit `q`, `k` and `v` (mixed precision): flash
//! attention with `mma.sync.m16n8k16` and f32 accumulation. [`super::attention`] keeps
//! the exact-f32 kernel for f32 operands and for what this one does not take.
//!
//! - **Block:** 4 warps, a 64-row tile of queries of one batch index; warp `w` owns rows
//!   `16w..16w + 16`. Its `q` fragments stay in registers for the whole kernel.
//! - **Keys** stream through shared memory 64 at a time, two stages deep: `cp.async`
//!   fetches the next block's keys and values (16-byte chunks, zero past `S`) while the
//!   warps work on this one. Rows are padded by 16 bytes, so `ldmatrix`'s eight rows fall
//!   in distinct banks.
//! - **Per key block:** the scores `q kᵀ` (16×64 a warp, f32 in registers), the mask (keys
//!   past `S`; causal `j - i <= S - T`; only on blocks that reach it), the online softmax in
//!   base 2 (`p = 2^(s·c - m·c)`, `c = scale·log₂e`), `p` rounded to 16 bits straight from
//!   the score registers into the next product's A fragments (the accumulator layout of
//!   two `n8` tiles is the A layout of one `k16` step), and `o += p v` with the values
//!   read by `ldmatrix.trans`.
//! - **End:** a row's partial sums meet across its four lanes; `o / l` to the output and
//!   `(m·c + log₂ l)·ln 2` to the row statistics, both f32, as the exact kernel stores them.
//!
//! A fully masked row (`S < T`, causal) has `l = 0`: its output is NaN and its statistic
//! `-inf`, as in the exact kernel and the composite.

// Fragments are emitted by (tile, register) as the comments index them.
#![allow(clippy::needless_range_loop)]

use super::attention::{
    attention_entry, attention_grid, block_ids, element, key_blocks, operand_at, operand_regs,
    tile_origin, BM, BN,
};
use super::mma::MmaKind;
use super::px::{f32_lit, Px};
use super::staging::chunk_copy;
use super::{LaunchShape, Res, DYN_SHARED};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::{Attn, Kernel, Operand};

/// Threads of a block (4 warps of 16 query rows).
const THREADS: usize = 128;
/// Elements of padding at the end of each shared row (16 bytes).
pub(super) const PAD: usize = 8;

/// The tensor-core kind for this attention, or `None` where the exact kernel runs: `q`, `k`
/// and `v` of one 16-bit dtype, head dimensions 16, 32, 64 or 128, a positive
/// scale, and every operand's rows whole aligned 16-byte chunks (contiguous along the head
/// dimension).
pub(super) fn plan(at: &Attn, offsets: &Offsets) -> Option<MmaKind> {
    let kind = match at.q.dtype {
        DType::BF16 => MmaKind::Bf16,
        DType::F16 => MmaKind::F16,
        _ => return None,
    };
    // 16, 32, 64 or 128: a row is 2 to 16 chunks, so the 128 threads copy whole rows a
    // pass ([`stage_rows`]).
    let dim_ok = |x: usize| (16..=128).contains(&x) && x.is_power_of_two();
    let aligned = |o: &Operand| {
        o.dtype == at.q.dtype
            && o.gather.is_none()
            && o.cs == 1
            && o.rs % 8 == 0
            && o.base % 8 == 0
            && o.batch_strides.iter().all(|s| s % 8 == 0)
            && offsets.get(o.buf).is_some_and(|b| b.is_multiple_of(16))
    };
    let v_ok = at.v.as_ref().is_none_or(|v| dim_ok(at.e) && aligned(v));
    let scale_ok = at.scale.is_finite() && at.scale > 0.0;
    (dim_ok(at.d) && aligned(&at.q) && aligned(&at.k) && v_ok && scale_ok && at.t > 0 && at.s > 0)
        .then_some(kind)
}

/// Copies rows `row0..row0 + 64` of `o` (`cols` elements each, rows from `limit` on as
/// zeros) to shared memory from byte `dst`, `row_bytes` a row, in 16-byte `cp.async`
/// chunks: thread `tid` copies chunk `tid % (cols / 8)` of every `128 / (cols / 8)`-th row
/// (`cols / 8` divides 128: [`plan`] takes only powers of two).
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_rows(
    px: &mut Px,
    o: &Operand,
    buf: &str,
    off: &str,
    row0: &str,
    limit: usize,
    cols: usize,
    dst: &str,
    row_bytes: usize,
    tid: &str,
) {
    let per_row = cols / 8;
    let rows_a_pass = THREADS / per_row;
    let (r, c) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("div.u32 {r}, {tid}, {per_row};"));
    px.line(format!("rem.u32 {c}, {tid}, {per_row};"));
    let sa = px.fresh("r");
    px.line(format!("mad.lo.u32 {sa}, {r}, {row_bytes}, {dst};"));
    px.line(format!("mad.lo.u32 {sa}, {c}, 16, {sa};"));
    let row = px.fresh("r");
    px.line(format!("add.u32 {row}, {row0}, {r};"));
    let c8 = px.fresh("rd");
    px.line(format!("mul.wide.u32 {c8}, {c}, 8;"));
    let first = px.fresh("rd");
    px.line(format!("add.s64 {first}, {off}, {c8};"));
    for n in 0..BM / rows_a_pass {
        let rn = px.fresh("r");
        px.line(format!("add.u32 {rn}, {row}, {};", n * rows_a_pass));
        let p = px.fresh("p");
        px.line(format!("setp.lt.u32 {p}, {rn}, {limit};"));
        let r64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {r64}, {rn};"));
        let idx = px.fresh("rd");
        px.line(format!("mad.lo.s64 {idx}, {r64}, {}, {first};", o.rs));
        let d = px.fresh("r");
        px.line(format!(
            "add.u32 {d}, {sa}, {};",
            n * rows_a_pass * row_bytes
        ));
        chunk_copy(px, &d, buf, &idx, &p, 2);
    }
}

/// Warp, lane, group (`lane / 4`) and quad index (`lane % 4`) of thread `tid`: the
/// `mma.sync` fragment coordinates.
pub(super) fn warp_lane(px: &mut Px, tid: &str) -> (String, String, String, String) {
    let (warp, lane, g, q4) = (px.fresh("r"), px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("shr.u32 {warp}, {tid}, 5;"));
    px.line(format!("and.b32 {lane}, {tid}, 31;"));
    px.line(format!("shr.u32 {g}, {lane}, 2;"));
    px.line(format!("and.b32 {q4}, {lane}, 3;"));
    (warp, lane, g, q4)
}

/// `ldmatrix.x4` (`.trans` when asked) into four fresh b32 registers.
pub(super) fn ldmatrix(px: &mut Px, addr: &str, offset: usize, trans: bool) -> Vec<String> {
    let r: Vec<String> = (0..4).map(|_| px.fresh("r")).collect();
    let t = if trans { ".trans" } else { "" };
    px.line(format!(
        "ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{{}}}, [{addr}+{offset}];",
        r.join(", ")
    ));
    r
}

/// The tensor-core attention kernel's PTX and launch shape (`kind` from [`plan`]).
pub(super) fn emit(
    k: &Kernel,
    at: &Attn,
    kind: MmaKind,
    offsets: &Offsets,
) -> Res<(String, LaunchShape)> {
    let mut px = Px::new(k, offsets, Vec::new(), Vec::new());
    let (t, s, d) = (at.t, at.s, at.d);
    let e = if at.v.is_some() { at.e } else { 0 };
    let (row_tiles, grid) = attention_grid(k, at)?;
    // Shared layout (bytes): q [64][d + 8]; then two stages of k [64][d + 8], v [64][e + 8].
    let (q_row, k_row, v_row) = ((d + PAD) * 2, (d + PAD) * 2, (e + PAD) * 2);
    let q_bytes = BM * q_row;
    let k_bytes = BN * k_row;
    let v_bytes = if e > 0 { BN * v_row } else { 0 };
    let stage = k_bytes + v_bytes;
    let shared = q_bytes + 2 * stage;

    let (bx, by, tid) = block_ids(&mut px);
    let (warp, lane, g, q4) = warp_lane(&mut px, &tid);
    let (row0, bidx) = tile_origin(&mut px, at, &bx, &by, row_tiles);
    let (qbuf, qoff) = operand_regs(&mut px, &at.q, &bidx)?;
    let (kbuf, koff) = operand_regs(&mut px, &at.k, &bidx)?;
    let vparts = operand_at(&mut px, at.v.as_ref(), &bidx)?;
    let sq = px.fresh("r");
    px.line(format!("mov.u32 {sq}, {DYN_SHARED};"));
    let s0 = px.fresh("r");
    px.line(format!("add.u32 {s0}, {sq}, {q_bytes};"));
    let nblk = key_blocks(&mut px, at, &row0);

    // Stage the key and value block `kb` (u32) into stage `kb % 2`; one commit group.
    let fetch = |px: &mut Px, kb: &str| {
        let st = px.fresh("r");
        px.line(format!("and.b32 {st}, {kb}, 1;"));
        px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {s0};"));
        let col0 = px.fresh("r");
        px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
        stage_rows(px, &at.k, &kbuf, &koff, &col0, s, d, &st, k_row, &tid);
        if let Some((v, vb, vo)) = &vparts {
            let sv = px.fresh("r");
            px.line(format!("add.u32 {sv}, {st}, {k_bytes};"));
            stage_rows(px, v, vb, vo, &col0, s, e, &sv, v_row, &tid);
        }
    };
    // Group 0: q and the first key block (a tile with no key block copies none).
    stage_rows(&mut px, &at.q, &qbuf, &qoff, &row0, t, d, &sq, q_row, &tid);
    let none = px.fresh("p");
    px.line(format!("setp.eq.u32 {none}, {nblk}, 0;"));
    let skip0 = px.label("att_nofetch");
    px.line(format!("@{none} bra {skip0};"));
    let zero = px.fresh("r");
    px.line(format!("mov.u32 {zero}, 0;"));
    fetch(&mut px, &zero);
    px.body.push_str(&format!("{skip0}:\n"));
    px.line("cp.async.commit_group;");

    // Lane addresses of the fragments (relative to their tile):
    // - q (A, `ldmatrix.x4`): row `16w + l % 8 + 8 (l / 8 % 2)`, column `8 (l / 16)`;
    // - k (B as `[key][d]`, `ldmatrix.x4`): key `l % 8 + 8 (l / 16)`, column `8 (l / 8 % 2)`;
    // - v (B as `[key][e]`, `ldmatrix.x4.trans`): key `l % 8 + 8 (l / 8 % 2)`, column
    //   `8 (l / 16)`.
    let (l8, l8m2, l16) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {l8}, {lane}, 7;"));
    px.line(format!("bfe.u32 {l8m2}, {lane}, 3, 1;"));
    px.line(format!("shr.u32 {l16}, {lane}, 4;"));
    let qa = px.fresh("r");
    px.line(format!("mad.lo.u32 {qa}, {l8m2}, 8, {l8};"));
    px.line(format!("mad.lo.u32 {qa}, {warp}, 16, {qa};"));
    px.line(format!("mad.lo.u32 {qa}, {qa}, {q_row}, {sq};"));
    px.line(format!("mad.lo.u32 {qa}, {l16}, 16, {qa};"));
    let ka = px.fresh("r");
    px.line(format!("mad.lo.u32 {ka}, {l16}, 8, {l8};"));
    px.line(format!("mul.lo.u32 {ka}, {ka}, {k_row};"));
    px.line(format!("mad.lo.u32 {ka}, {l8m2}, 16, {ka};"));
    let va = px.fresh("r");
    px.line(format!("mad.lo.u32 {va}, {l8m2}, 8, {l8};"));
    px.line(format!("mul.lo.u32 {va}, {va}, {v_row};"));
    px.line(format!("mad.lo.u32 {va}, {l16}, 16, {va};"));
    px.line(format!("add.u32 {va}, {va}, {k_bytes};"));

    // This thread's rows `i0 = row0 + 16w + g` and `i0 + 8`; a row keeps keys below its
    // limit: `S`, or (causal) `min(i + S - T + 1, S)`.
    let i0 = px.fresh("r");
    px.line(format!("mad.lo.u32 {i0}, {warp}, 16, {g};"));
    px.line(format!("add.u32 {i0}, {i0}, {row0};"));
    let diag = s as i64 - t as i64 + 1;
    let lims: Vec<String> = (0..2)
        .map(|h| {
            let lim = px.fresh("r");
            if at.causal {
                px.line(format!("add.s32 {lim}, {i0}, {};", diag + 8 * h as i64));
                px.line(format!("min.s32 {lim}, {lim}, {s};"));
            } else {
                px.line(format!("mov.u32 {lim}, {s};"));
            }
            lim
        })
        .collect();
    // The block's first row's limit: key blocks below it need no mask.
    let tile_lim = px.fresh("r");
    if at.causal {
        px.line(format!("add.s32 {tile_lim}, {row0}, {diag};"));
        px.line(format!("min.s32 {tile_lim}, {tile_lim}, {s};"));
    } else {
        px.line(format!("mov.u32 {tile_lim}, {s};"));
    }

    // Row state (rows h = 0, 1): running maximum of the raw scores, this lane's partial
    // sum, the output accumulators acc[n-tile][2h + c].
    let mut m = Vec::new();
    let mut l = Vec::new();
    for _ in 0..2 {
        let (mr, lr) = (px.fresh("f"), px.fresh("f"));
        px.line(format!("mov.f32 {mr}, 0fFF800000;"));
        px.line(format!("mov.f32 {lr}, 0f00000000;"));
        m.push(mr);
        l.push(lr);
    }
    let acc = zeroed_tiles(&mut px, e / 8);
    let qf: Vec<Vec<String>> = (0..d / 16)
        .map(|_| (0..4).map(|_| px.fresh("r")).collect())
        .collect();
    let c = f32_lit(at.scale * std::f32::consts::LOG2_E);
    let instr = kind.instr();

    let kb = px.fresh("r");
    px.line(format!("mov.u32 {kb}, 0;"));
    let head = px.label("att_keys");
    let exit = px.label("att_keys_end");
    px.body.push_str(&format!("{head}:\n"));
    let pdone = px.fresh("p");
    px.line(format!("setp.ge.u32 {pdone}, {kb}, {nblk};"));
    px.line(format!("@{pdone} bra {exit};"));
    // Every warp is done with the stage the next block goes to (block kb - 1's).
    px.line("bar.sync 0;");
    let next = px.fresh("r");
    px.line(format!("add.u32 {next}, {kb}, 1;"));
    let last = px.fresh("p");
    px.line(format!("setp.ge.u32 {last}, {next}, {nblk};"));
    let nofetch = px.label("att_nonext");
    px.line(format!("@{last} bra {nofetch};"));
    fetch(&mut px, &next);
    px.body.push_str(&format!("{nofetch}:\n"));
    px.line("cp.async.commit_group;");
    px.line("cp.async.wait_group 1;");
    px.line("bar.sync 0;");
    // q's fragments, once (its copy was in the first group).
    let loaded = px.label("att_q");
    let later = px.fresh("p");
    px.line(format!("setp.ne.u32 {later}, {kb}, 0;"));
    px.line(format!("@{later} bra {loaded};"));
    for (kd, f) in qf.iter().enumerate() {
        px.line(format!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{}}}, [{qa}+{}];",
            f.join(", "),
            kd * 32
        ));
    }
    px.body.push_str(&format!("{loaded}:\n"));
    let st = px.fresh("r");
    px.line(format!("and.b32 {st}, {kb}, 1;"));
    px.line(format!("mad.lo.u32 {st}, {st}, {stage}, {s0};"));
    let (kst, vst) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("add.u32 {kst}, {st}, {ka};"));
    px.line(format!("add.u32 {vst}, {st}, {va};"));

    // Scores: sc[n-tile j][2h + c] is row i0 + 8h, key col0 + 8j + 2 q4 + c.
    let sc = zeroed_tiles(&mut px, BN / 8);
    for kd in 0..d / 16 {
        for p in 0..BN / 16 {
            let b = ldmatrix(&mut px, &kst, p * 16 * k_row + kd * 32, false);
            for h in 0..2 {
                let x = sc[2 * p + h].join(", ");
                px.line(format!(
                    "{instr} {{{x}}}, {{{}}}, {{{}, {}}}, {{{x}}};",
                    qf[kd].join(", "),
                    b[2 * h],
                    b[2 * h + 1]
                ));
            }
        }
    }
    // Mask: only a block that reaches a row's limit (`col0 + 64 > ` the first row's).
    let col0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
    let end = px.fresh("r");
    px.line(format!("add.u32 {end}, {col0}, {BN};"));
    let whole = px.fresh("p");
    px.line(format!("setp.le.s32 {whole}, {end}, {tile_lim};"));
    let masked = px.label("att_masked");
    px.line(format!("@{whole} bra {masked};"));
    let j0 = px.fresh("r");
    px.line(format!("mad.lo.u32 {j0}, {q4}, 2, {col0};"));
    for (j, tile) in sc.iter().enumerate() {
        for (i, x) in tile.iter().enumerate() {
            let jj = px.fresh("r");
            px.line(format!("add.u32 {jj}, {j0}, {};", 8 * j + i % 2));
            let keep = px.fresh("p");
            px.line(format!("setp.lt.s32 {keep}, {jj}, {};", lims[i / 2]));
            px.line(format!("selp.f32 {x}, {x}, 0fFF800000, {keep};"));
        }
    }
    px.body.push_str(&format!("{masked}:\n"));

    // Online softmax, rows h = 0, 1.
    for h in 0..2 {
        let mut mx = String::new();
        for tile in &sc {
            for x in &tile[2 * h..2 * h + 2] {
                if mx.is_empty() {
                    mx = x.clone();
                } else {
                    let n = px.fresh("f");
                    px.line(format!("max.f32 {n}, {mx}, {x};"));
                    mx = n;
                }
            }
        }
        for sh in [1, 2] {
            let o = px.fresh("f");
            px.line(format!("shfl.sync.bfly.b32 {o}, {mx}, {sh}, 31, -1;"));
            let n = px.fresh("f");
            px.line(format!("max.f32 {n}, {mx}, {o};"));
            mx = n;
        }
        let mn = px.fresh("f");
        px.line(format!("max.f32 {mn}, {}, {mx};", m[h]));
        // `-m·c`, or 0 for a row with no key yet (no `-inf - -inf`).
        let nmc = px.fresh("f");
        px.line(format!(
            "mul.f32 {nmc}, {mn}, {};",
            f32_lit(-(at.scale * std::f32::consts::LOG2_E))
        ));
        let ninf = px.fresh("p");
        px.line(format!("setp.eq.f32 {ninf}, {mn}, 0fFF800000;"));
        px.line(format!("selp.f32 {nmc}, 0f00000000, {nmc}, {ninf};"));
        let alpha = px.fresh("f");
        px.line(format!("fma.rn.f32 {alpha}, {}, {c}, {nmc};", m[h]));
        px.line(format!("ex2.approx.ftz.f32 {alpha}, {alpha};"));
        px.line(format!("mov.f32 {}, {mn};", m[h]));
        let mut sum = String::new();
        for tile in &sc {
            for x in &tile[2 * h..2 * h + 2] {
                px.line(format!("fma.rn.f32 {x}, {x}, {c}, {nmc};"));
                px.line(format!("ex2.approx.ftz.f32 {x}, {x};"));
                if sum.is_empty() {
                    sum = x.clone();
                } else {
                    let n = px.fresh("f");
                    px.line(format!("add.f32 {n}, {sum}, {x};"));
                    sum = n;
                }
            }
        }
        px.line(format!("fma.rn.f32 {0}, {0}, {alpha}, {sum};", l[h]));
        for tile in &acc {
            for x in &tile[2 * h..2 * h + 2] {
                px.line(format!("mul.f32 {x}, {x}, {alpha};"));
            }
        }
    }
    // o += p v: p's A fragment for keys 16kk.. is n-tiles 2kk and 2kk + 1 of the scores,
    // rounded to 16 bits in pairs (the lower key in the lower half).
    if vparts.is_some() {
        let cvt = match kind {
            MmaKind::F16 => "cvt.rn.f16x2.f32",
            _ => "cvt.rn.bf16x2.f32",
        };
        for kk in 0..BN / 16 {
            let pa: Vec<String> = [(0, 0), (0, 2), (1, 0), (1, 2)]
                .iter()
                .map(|&(u, i)| {
                    let r = px.fresh("r");
                    let tile = &sc[2 * kk + u];
                    px.line(format!("{cvt} {r}, {}, {};", tile[i + 1], tile[i]));
                    r
                })
                .collect();
            for p in 0..e / 16 {
                let b = ldmatrix(&mut px, &vst, kk * 16 * v_row + p * 32, true);
                for h in 0..2 {
                    let x = acc[2 * p + h].join(", ");
                    px.line(format!(
                        "{instr} {{{x}}}, {{{}}}, {{{}, {}}}, {{{x}}};",
                        pa.join(", "),
                        b[2 * h],
                        b[2 * h + 1]
                    ));
                }
            }
        }
    }
    px.line(format!("add.u32 {kb}, {kb}, 1;"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));
    px.line("cp.async.wait_group 0;");

    // A row's sum over its four lanes; then o / l and (m·c + log₂ l)·ln 2.
    for h in 0..2 {
        for sh in [1, 2] {
            let o = px.fresh("f");
            px.line(format!("shfl.sync.bfly.b32 {o}, {}, {sh}, 31, -1;", l[h]));
            px.line(format!("add.f32 {0}, {0}, {o};", l[h]));
        }
    }
    let obuf = operand_at(&mut px, at.o.as_ref(), &bidx)?;
    let lbuf = operand_at(&mut px, at.lse.as_ref(), &bidx)?;
    let first_lane = px.fresh("p");
    px.line(format!("setp.eq.u32 {first_lane}, {q4}, 0;"));
    for h in 0..2 {
        let i = px.fresh("r");
        px.line(format!("add.u32 {i}, {i0}, {};", 8 * h));
        let skip = px.label("att_row");
        let out = px.fresh("p");
        px.line(format!("setp.ge.u32 {out}, {i}, {t};"));
        px.line(format!("@{out} bra {skip};"));
        if let Some((o, b, off)) = &obuf {
            let inv = px.fresh("f");
            px.line(format!("rcp.rn.f32 {inv}, {};", l[h]));
            for (j, tile) in acc.iter().enumerate() {
                for cc in 0..2 {
                    let col = px.fresh("r");
                    px.line(format!("mad.lo.u32 {col}, {q4}, 2, {};", 8 * j + cc));
                    let addr = element(&mut px, b, off, o, &i, Some(&col));
                    let y = px.fresh("f");
                    px.line(format!("mul.f32 {y}, {}, {inv};", tile[2 * h + cc]));
                    px.store(&addr, o.dtype, &y, false)?;
                }
            }
        }
        if let Some((o, b, off)) = &lbuf {
            let addr = element(&mut px, b, off, o, &i, None);
            let lg = px.fresh("f");
            px.line(format!("lg2.approx.f32 {lg}, {};", l[h]));
            let y = px.fresh("f");
            px.line(format!("fma.rn.f32 {y}, {}, {c}, {lg};", m[h]));
            px.line(format!(
                "mul.f32 {y}, {y}, {};",
                f32_lit(std::f32::consts::LN_2)
            ));
            px.line(format!("@{first_lane} st.global.f32 [{addr}], {y};"));
        }
        px.body.push_str(&format!("{skip}:\n"));
    }
    Ok(attention_entry(&mut px, grid, THREADS, shared))
}

/// `tiles` accumulators of an `m16n8` tile (4 f32 registers each), set to 0.
pub(super) fn zeroed_tiles(px: &mut Px, tiles: usize) -> Vec<Vec<String>> {
    (0..tiles)
        .map(|_| {
            (0..4)
                .map(|_| {
                    let r = px.fresh("f");
                    px.line(format!("mov.f32 {r}, 0f00000000;"));
                    r
                })
                .collect()
        })
        .collect()
}
