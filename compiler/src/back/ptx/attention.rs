//! Fused attention ([`Attn`]): one block a 64-row tile of queries of one batch index;
//! the keys stream through shared memory 64 at a time with an online softmax, so neither
//! the scores nor the probabilities ever reach memory (flash attention, in exact f32
//! FFMA).
//!
//! - **Block:** 256 threads as 16×16 (`tx`, `ty`). A thread holds the scores of rows
//!   `4ty..4ty + 4` and columns `tx + 16b` (`b < 4`) of the key block, and the output
//!   accumulators of the same rows at columns `tx + 16b` (`b < E/16`). A row's 16
//!   threads are 16 lanes of one warp: its maximum and sum are four `shfl.bfly`s.
//! - **Shared memory:** `q` transposed (`[D][68]`, loaded once), the key block transposed
//!   (`[D][65]`), the value block (`[64][E]`) and the probabilities transposed
//!   (`[64][68]`): a thread's four rows are one `ld.shared.v4`, its columns are 16
//!   consecutive words a warp (no bank conflicts).
//! - **Per key block:** scores `q kᵀ` (D steps of 16 FFMA), scale and mask (causal:
//!   `j - i <= S - T`; keys past `S`), row maxima, `alpha = exp(m_old - m_new)` rescales
//!   the row's sum and output, `p = exp(s - m_new)` goes to shared memory, then `o += p v`
//!   (64 steps of `4 × E/16` FFMA).
//! - **Causal:** a row tile reads only the key blocks up to its last row's diagonal, and
//!   the tiles with the most blocks start first (the last row tile is block 0).
//! - **End:** `o / l` to the output, `m + log(l)` to the row statistics (when stored).
//!
//! A fully masked row (`S < T`, causal) has `l = 0`: its output is NaN and its statistic
//! `-inf`, as the composite's `softmax` gives.

// Register tiles are emitted by (row, column) of the tile, as the comments index them.
#![allow(clippy::needless_range_loop)]

use super::px::Px;
use super::tile::operand_buffer;
use super::vector::VEC;

// Four columns a vector load (`Px::vector_load` loads `VEC`).
const _: () = assert!(VEC == 4);
use super::{LaunchShape, PtxError, Res, DYN_SHARED};
use crate::kernel::offsets::Offsets;
use crate::kernel::{Attn, Kernel, Operand};

/// Query rows of a block.
pub(super) const BM: usize = 64;
/// Keys of a block step.
pub(super) const BN: usize = 64;
/// Threads of a block.
pub(super) const THREADS: usize = 256;
/// Words a row of the transposed `q` and `p` tiles (`BM` + 4: aligned, fewer conflicts).
pub(super) const Q_STRIDE: usize = BM + 4;
/// Words a row of the transposed key tile (`BN` + 1: conflict-free transposing stores).
const K_STRIDE: usize = BN + 1;

/// The element offset of an operand's batch index (registers `bidx`, one per batch axis)
/// plus its base, in a u64 register.
pub(super) fn batch_offset(px: &mut Px, o: &Operand, bidx: &[String]) -> String {
    let mut r = px.imm64(o.base);
    for (v, &s) in bidx.iter().zip(&o.batch_strides) {
        let n = px.fresh("rd");
        px.line(format!("mad.lo.s64 {n}, {v}, {s}, {r};"));
        r = n;
    }
    r
}

/// Byte address of `buf` + size × (`off` + `row` × rs + `col` × cs) for `o`'s element
/// size (4, or 2 for a 16-bit operand read widened); `row`, `col` u32.
pub(super) fn element(
    px: &mut Px,
    buf: &str,
    off: &str,
    o: &Operand,
    row: &str,
    col: Option<&str>,
) -> String {
    let r64 = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {r64}, {row};"));
    let mut e = px.fresh("rd");
    px.line(format!("mad.lo.s64 {e}, {r64}, {}, {off};", o.rs));
    if let Some(col) = col {
        let c64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {c64}, {col};"));
        let n = px.fresh("rd");
        px.line(format!("mad.lo.s64 {n}, {c64}, {}, {e};", o.cs));
        e = n;
    }
    let a = px.fresh("rd");
    let shift = if is_16_bit(o) { 1 } else { 2 };
    px.line(format!("shl.b64 {a}, {e}, {shift};"));
    let out = px.fresh("rd");
    px.line(format!("add.s64 {out}, {buf}, {a};"));
    out
}

/// Copies a `rows × cols` tile of operand `o` (rows from `row0`, valid below `limit`) into
/// shared memory at `dst`: transposed (`[cols][BM]`) or as it lies (`[rows][cols]`).
/// Rows past `limit` read as zeros. Rows as they lie whose `stride` is not a multiple of 4
/// words are stored a word at a time (a vector store needs 16-byte alignment).
#[allow(clippy::too_many_arguments)]
pub(super) fn copy_tile(
    px: &mut Px,
    o: &Operand,
    buf: &str,
    off: &str,
    row0: &str,
    limit: usize,
    cols: usize,
    dst: &str,
    transposed: bool,
    stride: usize,
    t: &str,
) {
    // Four columns a load where they are contiguous and aligned, else one. A 16-bit
    // operand (read widened under mixed precision) loads 16-bit elements and widens them.
    let wide = is_16_bit(o);
    let vec4 = o.cs == 1
        && cols.is_multiple_of(4)
        && o.base % 4 == 0
        && o.rs % 4 == 0
        && o.batch_strides.iter().all(|s| s % 4 == 0)
        && px
            .offsets
            .get(o.buf)
            .is_some_and(|off| off.is_multiple_of(if wide { 8 } else { 16 }));
    let width = if vec4 { 4 } else { 1 };
    let units = cols / width;
    for n in 0..BM * units / THREADS {
        // Unit `t + 256 n` of the tile, row-major over (row, column unit).
        let idx = px.fresh("r");
        px.line(format!("add.u32 {idx}, {t}, {};", n * THREADS));
        let (r, q) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("div.u32 {r}, {idx}, {units};"));
        px.line(format!("rem.u32 {q}, {idx}, {units};"));
        let c = if width == 1 {
            q
        } else {
            let c = px.fresh("r");
            px.line(format!("shl.b32 {c}, {q}, 2;"));
            c
        };
        let row = px.fresh("r");
        px.line(format!("add.u32 {row}, {row0}, {r};"));
        let p = px.fresh("p");
        px.line(format!("setp.lt.u32 {p}, {row}, {limit};"));
        let safe = px.fresh("r");
        px.line(format!("selp.u32 {safe}, {row}, 0, {p};"));
        let a = element(px, buf, off, o, &safe, Some(&c));
        let v: Vec<String> = if wide {
            // The widening loads every kernel uses: the row is clamped into range, so the
            // load is safe; a row past `limit` reads zeros.
            let got = if width == 1 {
                vec![px.load(&a, o.dtype)]
            } else {
                px.vector_load(&a, o.dtype)
            };
            got.iter()
                .map(|x| {
                    let z = px.fresh("f");
                    px.line(format!("selp.f32 {z}, {x}, 0f00000000, {p};"));
                    z
                })
                .collect()
        } else {
            let v: Vec<String> = (0..width).map(|_| px.fresh("f")).collect();
            for x in &v {
                px.line(format!("mov.f32 {x}, 0f00000000;"));
            }
            px.line(format!("@{p} ld.global.nc{} [{a}];", operands(&v)));
            v
        };
        // Shared word: transposed (c + u) * stride + r, else r * stride + c.
        if transposed {
            for (u, x) in v.iter().enumerate() {
                let w = px.fresh("r");
                let cu = if width == 1 {
                    c.clone()
                } else {
                    let cu = px.fresh("r");
                    px.line(format!("add.u32 {cu}, {c}, {u};"));
                    cu
                };
                px.line(format!("mad.lo.u32 {w}, {cu}, {stride}, {r};"));
                let sa = px.fresh("r");
                px.line(format!("mad.lo.u32 {sa}, {w}, 4, {dst};"));
                px.line(format!("st.shared.f32 [{sa}], {x};"));
            }
        } else {
            let w = px.fresh("r");
            px.line(format!("mad.lo.u32 {w}, {r}, {stride}, {c};"));
            let sa = px.fresh("r");
            px.line(format!("mad.lo.u32 {sa}, {w}, 4, {dst};"));
            if stride.is_multiple_of(4) {
                px.line(format!("st.shared{} [{sa}], {};", kind(v.len()), list(&v)));
            } else {
                for (u, x) in v.iter().enumerate() {
                    px.line(format!("st.shared.f32 [{sa}+{}], {x};", 4 * u));
                }
            }
        }
    }
}

/// Whether `o` is a 16-bit operand (read widened to f32).
fn is_16_bit(o: &Operand) -> bool {
    matches!(o.dtype, crate::ir::DType::BF16 | crate::ir::DType::F16)
}

/// `.f32` or `.v4.f32` for that many registers.
fn kind(n: usize) -> &'static str {
    if n == 4 {
        ".v4.f32"
    } else {
        ".f32"
    }
}

/// A register, or `{a, b, c, d}`.
fn list(v: &[String]) -> String {
    if v.len() == 1 {
        v[0].clone()
    } else {
        format!("{{{}}}", v.join(", "))
    }
}

/// The type and destination of a load into `v`: `.f32 r,` or `.v4.f32 {..},`.
fn operands(v: &[String]) -> String {
    format!("{} {},", kind(v.len()), list(v))
}

/// Butterfly reduction over the 16 lanes of a row (`max` or `add`).
fn row_reduce(px: &mut Px, op: &str, x: &str) -> String {
    let mut v = x.to_string();
    for sh in [1, 2, 4, 8] {
        let o = px.fresh("f");
        px.line(format!("shfl.sync.bfly.b32 {o}, {v}, {sh}, 31, -1;"));
        let n = px.fresh("f");
        px.line(format!("{op}.f32 {n}, {v}, {o};"));
        v = n;
    }
    v
}

/// Block `(bx, by)`'s first query row (u32; heaviest row tiles first: block x takes row
/// tile `row_tiles - 1 - x` of `BM` = 64 rows) and its batch coordinates (u64 registers,
/// grid y row-major over `batch`).
pub(super) fn tile_origin(
    px: &mut Px,
    at: &Attn,
    bx: &str,
    by: &str,
    row_tiles: usize,
) -> (String, Vec<String>) {
    let tile = px.fresh("r");
    px.line(format!("sub.u32 {tile}, {}, {bx};", row_tiles - 1));
    let row0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {row0}, {tile}, {BM};"));
    let mut bidx = vec![String::new(); at.batch.len()];
    let mut rest = px.fresh("rd");
    px.line(format!("cvt.u64.u32 {rest}, {by};"));
    for i in (0..at.batch.len()).rev() {
        let v = px.fresh("rd");
        if i == 0 {
            px.line(format!("mov.u64 {v}, {rest};"));
        } else {
            px.line(format!("rem.u64 {v}, {rest}, {};", at.batch[i]));
            let q = px.fresh("rd");
            px.line(format!("div.u64 {q}, {rest}, {};", at.batch[i]));
            rest = q;
        }
        bidx[i] = v;
    }
    (row0, bidx)
}

/// How many key blocks of `BN` = 64 the row tile from `row0` reads (u32): all, or (causal)
/// those up to its last row's diagonal `j <= i + S - T`.
pub(super) fn key_blocks(px: &mut Px, at: &Attn, row0: &str) -> String {
    let (t, s) = (at.t, at.s);
    let nblk = px.fresh("r");
    if at.causal {
        // Keys below `min(row0 + 64 + S - T, S)`, at least 0.
        let hi = px.fresh("r");
        let shift = s as i64 - t as i64 + BM as i64;
        px.line(format!("cvt.s32.u32 {hi}, {row0};"));
        let hs = px.fresh("r");
        px.line(format!("add.s32 {hs}, {hi}, {shift};"));
        let c = px.fresh("r");
        px.line(format!("max.s32 {c}, {hs}, 0;"));
        let c2 = px.fresh("r");
        px.line(format!("min.s32 {c2}, {c}, {s};"));
        let c3 = px.fresh("r");
        px.line(format!("add.u32 {c3}, {c2}, {};", BN - 1));
        px.line(format!("div.u32 {nblk}, {c3}, {BN};"));
    } else {
        px.line(format!("mov.u32 {nblk}, {};", s.div_ceil(BN)));
    }
    nblk
}

/// The grid of an attention kernel: x one block a row tile of `BM` queries, y one a batch
/// index; and the row tiles. Its output is f32, bf16 or f16 (mixed precision), its row
/// statistics f32.
pub(super) fn attention_grid(k: &Kernel, at: &Attn) -> Res<(usize, [u32; 3])> {
    use crate::ir::DType;
    let unsupported = |m: &str| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: m.to_string(),
    };
    let float =
        |o: &Option<Operand>, ok: &[DType]| o.as_ref().is_none_or(|o| ok.contains(&o.dtype));
    if !float(&at.o, &[DType::F32, DType::BF16, DType::F16]) || !float(&at.lse, &[DType::F32]) {
        return Err(unsupported(
            "attention results other than f32 (or a 16-bit output)",
        ));
    }
    let nb: usize = at.batch.iter().product();
    let row_tiles = at.t.div_ceil(BM);
    let grid_y = u32::try_from(nb).map_err(|_| unsupported("too many attention batches"))?;
    if grid_y > 65535 {
        return Err(unsupported("more than 65535 attention batches"));
    }
    let grid_x =
        u32::try_from(row_tiles).map_err(|_| unsupported("too many attention row tiles"))?;
    Ok((row_tiles, [grid_x, grid_y, 1]))
}

/// Operand `o` (when there is one) with its buffer's address and its batch index's offset
/// (registers).
pub(super) fn operand_at<'a>(
    px: &mut Px,
    o: Option<&'a Operand>,
    bidx: &[String],
) -> Res<Option<(&'a Operand, String, String)>> {
    let Some(o) = o else {
        return Ok(None);
    };
    let (buf, off) = operand_regs(px, o, bidx)?;
    Ok(Some((o, buf, off)))
}

/// Operand `o`'s buffer address and its batch index's offset (registers).
pub(super) fn operand_regs(px: &mut Px, o: &Operand, bidx: &[String]) -> Res<(String, String)> {
    let buf = operand_buffer(px, o.buf)?.0;
    let off = batch_offset(px, o, bidx);
    Ok((buf, off))
}

/// The arena's base, then the block's coordinates and the thread's index (u32 registers
/// from `%ctaid.x`, `%ctaid.y` and `%tid.x`).
pub(super) fn block_ids(px: &mut Px) -> (String, String, String) {
    px.load_arena();
    let (bx, by, tid) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {bx}, %ctaid.x;"));
    px.line(format!("mov.u32 {by}, %ctaid.y;"));
    px.line(format!("mov.u32 {tid}, %tid.x;"));
    (bx, by, tid)
}

/// The entry's end (`ret`), its text and its launch: `threads` a block over `grid`, with
/// `shared` bytes of dynamic shared memory.
pub(super) fn attention_entry(
    px: &mut Px,
    grid: [u32; 3],
    threads: usize,
    shared: usize,
) -> (String, LaunchShape) {
    px.line("ret;");
    let launch = LaunchShape {
        grid,
        block: [threads as u32, 1, 1],
        shared_bytes: shared as u32,
        scratch_bytes: 0,
    };
    (px.finish(""), launch)
}

/// The attention kernel's PTX and launch shape.
pub(super) fn emit(k: &Kernel, at: &Attn, offsets: &Offsets) -> Res<(String, LaunchShape)> {
    let mut px = Px::new(k, offsets, Vec::new(), Vec::new());
    let unsupported = |m: &str| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: m.to_string(),
    };
    let (t, s, d) = (at.t, at.s, at.d);
    let e = if at.v.is_some() { at.e } else { 0 };
    if !crate::ir::ops::attention_supported(d, e.max(16)) || t == 0 || s == 0 {
        return Err(unsupported(
            "attention head dimensions outside the kernel's",
        ));
    }
    let (row_tiles, grid) = attention_grid(k, at)?;
    // Shared layout (bytes): q [D][68], k [D][65], v [64][E], p [64][68]. The padding
    // spreads the transposing stores over the banks (a row of 64 words puts a warp's 32
    // stores in one bank: the scores ran 2× slower); rows of q and p stay 16-byte aligned
    // for their vector loads.
    let q_bytes = d * Q_STRIDE * 4;
    let k_bytes = d * K_STRIDE * 4;
    let v_bytes = BN * e * 4;
    let p_bytes = BN * Q_STRIDE * 4;
    let shared = q_bytes + k_bytes + v_bytes + p_bytes;

    let (bx, by, tid) = block_ids(&mut px);
    let (tx, ty) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("and.b32 {tx}, {tid}, 15;"));
    px.line(format!("shr.u32 {ty}, {tid}, 4;"));
    let (row0, bidx) = tile_origin(&mut px, at, &bx, &by, row_tiles);
    let (qbuf, qoff) = operand_regs(&mut px, &at.q, &bidx)?;
    let (kbuf, koff) = operand_regs(&mut px, &at.k, &bidx)?;
    let vparts = operand_at(&mut px, at.v.as_ref(), &bidx)?;
    let sq = px.fresh("r");
    px.line(format!("mov.u32 {sq}, {DYN_SHARED};"));
    let (sk, sv, sp) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("add.u32 {sk}, {sq}, {q_bytes};"));
    px.line(format!("add.u32 {sv}, {sk}, {k_bytes};"));
    px.line(format!("add.u32 {sp}, {sv}, {v_bytes};"));

    copy_tile(
        &mut px, &at.q, &qbuf, &qoff, &row0, t, d, &sq, true, Q_STRIDE, &tid,
    );

    // Row state: running maximum, sum and the output accumulators.
    let nbo = e / 16;
    let (mut m, mut l) = (Vec::new(), Vec::new());
    let mut acc = vec![vec![String::new(); nbo]; 4];
    for a in 0..4 {
        let (mr, lr) = (px.fresh("f"), px.fresh("f"));
        px.line(format!("mov.f32 {mr}, 0fFF800000;"));
        px.line(format!("mov.f32 {lr}, 0f00000000;"));
        m.push(mr);
        l.push(lr);
        for b in 0..nbo {
            let r = px.fresh("f");
            px.line(format!("mov.f32 {r}, 0f00000000;"));
            acc[a][b] = r;
        }
    }
    let nblk = key_blocks(&mut px, at, &row0);
    let kb = px.fresh("r");
    px.line(format!("mov.u32 {kb}, 0;"));
    let head = px.label("akeys");
    let exit = px.label("akeys_end");
    px.body.push_str(&format!("{head}:\n"));
    let pdone = px.fresh("p");
    px.line(format!("setp.ge.u32 {pdone}, {kb}, {nblk};"));
    px.line(format!("@{pdone} bra {exit};"));
    let col0 = px.fresh("r");
    px.line(format!("mul.lo.u32 {col0}, {kb}, {BN};"));
    // The previous block's readers are done with k, v and p.
    px.line("bar.sync 0;");
    copy_tile(
        &mut px, &at.k, &kbuf, &koff, &col0, s, d, &sk, true, K_STRIDE, &tid,
    );
    if let Some((v, vb, vo)) = &vparts {
        copy_tile(&mut px, v, vb, vo, &col0, s, e, &sv, false, e, &tid);
    }
    px.line("bar.sync 0;");

    // Scores: rows 4ty + a, columns tx + 16b.
    // Registers updated in place from here on (the loop carries m, l and acc).
    let sc: Vec<Vec<String>> = (0..4)
        .map(|_| (0..4).map(|_| px.fresh("f")).collect())
        .collect();
    for x in sc.iter().flatten() {
        px.line(format!("mov.f32 {x}, 0f00000000;"));
    }
    let qrow = px.fresh("r");
    px.line(format!("mad.lo.u32 {qrow}, {ty}, 16, {sq};"));
    let kcol = px.fresh("r");
    px.line(format!("mad.lo.u32 {kcol}, {tx}, 4, {sk};"));
    for dd in 0..d {
        let qv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
        px.line(format!(
            "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{qrow}+{}];",
            qv[0],
            qv[1],
            qv[2],
            qv[3],
            dd * Q_STRIDE * 4
        ));
        let kv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
        for (b, r) in kv.iter().enumerate() {
            px.line(format!(
                "ld.shared.f32 {r}, [{kcol}+{}];",
                (dd * K_STRIDE + 16 * b) * 4
            ));
        }
        for (a, row) in sc.iter().enumerate() {
            for (b, x) in row.iter().enumerate() {
                px.line(format!("fma.rn.f32 {x}, {}, {}, {x};", qv[a], kv[b]));
            }
        }
    }
    // Scale and mask: keys past S, and (causal) `j > i + S - T`.
    let diag = s as i64 - t as i64;
    let scale = super::px::f32_lit(at.scale);
    for a in 0..4 {
        let i = px.fresh("r");
        px.line(format!("mad.lo.u32 {i}, {ty}, 4, {row0};"));
        let ia = px.fresh("r");
        px.line(format!("add.u32 {ia}, {i}, {a};"));
        let lim = px.fresh("r");
        if at.causal {
            // Keys j < i + S - T + 1 (signed), and j < S.
            let li = px.fresh("r");
            px.line(format!("add.s32 {li}, {ia}, {};", diag + 1));
            px.line(format!("min.s32 {lim}, {li}, {s};"));
        } else {
            px.line(format!("mov.u32 {lim}, {s};"));
        }
        for b in 0..4 {
            let j = px.fresh("r");
            px.line(format!("add.u32 {j}, {col0}, {};", 16 * b));
            let jj = px.fresh("r");
            px.line(format!("add.u32 {jj}, {j}, {tx};"));
            let keep = px.fresh("p");
            px.line(format!("setp.lt.s32 {keep}, {jj}, {lim};"));
            let x = &sc[a][b];
            px.line(format!("mul.f32 {x}, {x}, {scale};"));
            px.line(format!("selp.f32 {x}, {x}, 0fFF800000, {keep};"));
        }
    }
    // Online softmax per row.
    let mut pv = vec![vec![String::new(); 4]; 4];
    for a in 0..4 {
        let x01 = px.fresh("f");
        px.line(format!("max.f32 {x01}, {}, {};", sc[a][0], sc[a][1]));
        let x23 = px.fresh("f");
        px.line(format!("max.f32 {x23}, {}, {};", sc[a][2], sc[a][3]));
        let x = px.fresh("f");
        px.line(format!("max.f32 {x}, {x01}, {x23};"));
        let bm = row_reduce(&mut px, "max", &x);
        let mn = px.fresh("f");
        px.line(format!("max.f32 {mn}, {}, {bm};", m[a]));
        // A row with no key yet keeps exponent base 0 (no -inf - -inf).
        let ninf = px.fresh("p");
        px.line(format!("setp.eq.f32 {ninf}, {mn}, 0fFF800000;"));
        let base = px.fresh("f");
        px.line(format!("selp.f32 {base}, 0f00000000, {mn}, {ninf};"));
        let dm = px.fresh("f");
        px.line(format!("sub.f32 {dm}, {}, {base};", m[a]));
        let alpha = px.exp(&dm);
        let mut sum = String::new();
        for b in 0..4 {
            let ds = px.fresh("f");
            px.line(format!("sub.f32 {ds}, {}, {base};", sc[a][b]));
            let p = px.exp(&ds);
            if b == 0 {
                sum = p.clone();
            } else {
                let n = px.fresh("f");
                px.line(format!("add.f32 {n}, {sum}, {p};"));
                sum = n;
            }
            pv[a][b] = p;
        }
        let rs = row_reduce(&mut px, "add", &sum);
        px.line(format!("fma.rn.f32 {0}, {0}, {alpha}, {rs};", l[a]));
        px.line(format!("mov.f32 {}, {mn};", m[a]));
        for x in &acc[a] {
            px.line(format!("mul.f32 {x}, {x}, {alpha};"));
        }
    }
    if let Some((_, _, _)) = &vparts {
        // p to shared, transposed: p[j][i] at (tx + 16b) * 64 + 4ty + a.
        let pbase = px.fresh("r");
        px.line(format!("mad.lo.u32 {pbase}, {tx}, {}, {sp};", Q_STRIDE * 4));
        let pb2 = px.fresh("r");
        px.line(format!("mad.lo.u32 {pb2}, {ty}, 16, {pbase};"));
        for b in 0..4 {
            px.line(format!(
                "st.shared.v4.f32 [{pb2}+{}], {{{}, {}, {}, {}}};",
                16 * b * Q_STRIDE * 4,
                pv[0][b],
                pv[1][b],
                pv[2][b],
                pv[3][b]
            ));
        }
        px.line("bar.sync 0;");
        let prow = px.fresh("r");
        px.line(format!("mad.lo.u32 {prow}, {ty}, 16, {sp};"));
        let vcol = px.fresh("r");
        px.line(format!("mad.lo.u32 {vcol}, {tx}, 4, {sv};"));
        for j in 0..BN {
            let p4: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
            px.line(format!(
                "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{prow}+{}];",
                p4[0],
                p4[1],
                p4[2],
                p4[3],
                j * Q_STRIDE * 4
            ));
            let vv: Vec<String> = (0..nbo).map(|_| px.fresh("f")).collect();
            for (b, r) in vv.iter().enumerate() {
                px.line(format!(
                    "ld.shared.f32 {r}, [{vcol}+{}];",
                    (j * e + 16 * b) * 4
                ));
            }
            for (a, row) in acc.iter().enumerate() {
                for (b, x) in row.iter().enumerate() {
                    px.line(format!("fma.rn.f32 {x}, {}, {}, {x};", p4[a], vv[b]));
                }
            }
        }
    }
    px.line(format!("add.u32 {kb}, {kb}, 1;"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));
    // Rows 4ty + a: o / l to the output, m + log(l) to the statistics.
    let obuf = operand_at(&mut px, at.o.as_ref(), &bidx)?;
    let lbuf = operand_at(&mut px, at.lse.as_ref(), &bidx)?;
    let first_lane = px.fresh("p");
    px.line(format!("setp.eq.u32 {first_lane}, {tx}, 0;"));
    for a in 0..4 {
        let i = px.fresh("r");
        px.line(format!("mad.lo.u32 {i}, {ty}, 4, {row0};"));
        let ia = px.fresh("r");
        px.line(format!("add.u32 {ia}, {i}, {a};"));
        let skip = px.label("arow");
        let out = px.fresh("p");
        px.line(format!("setp.ge.u32 {out}, {ia}, {t};"));
        px.line(format!("@{out} bra {skip};"));
        if let Some((o, b, off)) = &obuf {
            for (bb, x) in acc[a].iter().enumerate() {
                let c = px.fresh("r");
                px.line(format!("add.u32 {c}, {tx}, {};", 16 * bb));
                let addr = element(&mut px, b, off, o, &ia, Some(&c));
                let y = px.fresh("f");
                px.line(format!("div.rn.f32 {y}, {x}, {};", l[a]));
                px.store(&addr, o.dtype, &y, false)?;
            }
        }
        if let Some((o, b, off)) = &lbuf {
            let addr = element(&mut px, b, off, o, &ia, None);
            let lg = px.fresh("f");
            px.line(format!("lg2.approx.f32 {lg}, {};", l[a]));
            let y = px.fresh("f");
            px.line(format!(
                "fma.rn.f32 {y}, {lg}, {}, {};",
                super::px::f32_lit(std::f32::consts::LN_2),
                m[a]
            ));
            px.line(format!("@{first_lane} st.global.f32 [{addr}], {y};"));
        }
        px.body.push_str(&format!("{skip}:\n"));
    }
    Ok(attention_entry(&mut px, grid, THREADS, shared))
}
