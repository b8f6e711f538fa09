//! The 64×64 tiled FFMA matmul: 4×4 per thread, `k` staged 16 deep; implicit GEMMs
//! (gathered operands) and split-K.

use super::epilogue::epilogue;
use super::px::{f32_lit, Px};
use super::tile::{ffma_tile, FfmaTile, TileOrigin};
use super::{LaunchShape, Res, BLOCK};
use crate::ir::DType;
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{ExprId, Kernel, Matmul};
use std::collections::HashMap;

/// Tiled matmul: rows of the block tile.
const TILE_M: usize = 64;
/// Tiled matmul: columns of the block tile.
const TILE_N: usize = 64;
/// Tiled matmul: depth of one `k` step staged through shared memory.
const TILE_K: usize = 16;
/// Row stride (in floats) of the shared tiles `[TILE_K][TILE_STRIDE]`: padded by 4 so
/// that transposing stores spread over the banks while rows stay 16-byte aligned.
const TILE_STRIDE: usize = TILE_M + 4;

/// The grid of the tiled matmul, or `None` where the per-element path is used instead
/// (non-f32 operands, small or thin outputs, or a grid that does not fit).
pub(super) fn tiled_grid(mm: &Matmul) -> Option<[u32; 3]> {
    if mm.a.dtype != DType::F32 || mm.b.dtype != DType::F32 {
        return None;
    }
    // Small outputs take the per-element path, unless k is split (then the tiles are
    // what spreads the work).
    if mm.m < 16 || mm.n < 16 || (mm.m * mm.n < 4096 && mm.split_k <= 1) {
        return None;
    }
    // Split-K: the blocks of one output tile are consecutive along z.
    let batch: usize = mm.batch.iter().product::<usize>() * mm.split_k.max(1);
    let (gx, gy) = (mm.n.div_ceil(TILE_N), mm.m.div_ceil(TILE_M));
    if batch == 0 || batch > 65535 || gy > 65535 || gx > i32::MAX as usize {
        return None;
    }
    Some([gx as u32, gy as u32, batch as u32])
}

/// The `k` each split of a split-K matmul sums: a whole number of `TILE_K` steps.
fn split_depth(mm: &Matmul) -> usize {
    mm.k.div_ceil(mm.split_k.max(1)).div_ceil(TILE_K) * TILE_K
}

/// Classic shared-memory SGEMM: a 64×64 output tile per block of 256 threads, each thread
/// holding a 4×4 micro-tile (rows `ty*4 + r`, columns `tx + 16*c`) in registers; A and B
/// are staged 16 deep through shared memory (`mm_as[k][row]`, `mm_bs[k][col]`). Every
/// thread runs every `bar.sync`: out-of-range loads read 0 and out-of-range elements skip
/// only their epilogue.
pub(super) fn emit_tiled_matmul(
    k: &Kernel,
    mm: &Matmul,
    grid: [u32; 3],
    offsets: &Offsets,
) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let mut px = Px::new(k, offsets, sites(k), live);
    let (m, n, kd) = (mm.m, mm.n, mm.k);
    let row_bytes = TILE_STRIDE * 4;

    let FfmaTile {
        t,
        tx,
        ty,
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
        split,
    } = ffma_tile(&mut px, mm, (TILE_M, TILE_N), mm.split_k, false)?;
    let (sa, sb) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {sa}, mm_as;"));
    px.line(format!("mov.u32 {sb}, mm_bs;"));

    // Load slots: each thread moves 4 elements of A and 4 of B per step. The fast
    // thread index runs along the operand's unit stride so that a warp reads contiguous
    // memory: along k for A when A.cs == 1, else along rows; along columns for B unless
    // only B.rs is 1.
    struct Slot {
        /// Shared byte address of the element.
        smem: String,
        /// Element index of the operand at k = 0 (base + batch + row/col part).
        base: String,
        /// In-range row (A) or column (B).
        ok: String,
        /// k offset inside the step.
        kk: String,
        /// The row (A) or column (B), clamped into range (gathers).
        at: String,
    }
    let slots = |px: &mut Px,
                 k_fast: bool,
                 extent: usize,
                 stride: i64,
                 first: &str,
                 opbase: &str,
                 smem0: &str,
                 gathered: bool|
     -> Vec<Slot> {
        let mut out = Vec::new();
        for r in 0..4u32 {
            // (kk, x): x is the row of A or the column of B inside the tile.
            let (kk, x) = (px.fresh("r"), px.fresh("r"));
            if k_fast {
                px.line(format!("and.b32 {kk}, {t}, {};", TILE_K - 1));
                px.line(format!("shr.u32 {x}, {t}, 4;"));
                px.line(format!("add.u32 {x}, {x}, {};", 16 * r));
            } else {
                px.line(format!("and.b32 {x}, {t}, {};", TILE_M - 1));
                px.line(format!("shr.u32 {kk}, {t}, 6;"));
                px.line(format!("add.u32 {kk}, {kk}, {};", 4 * r));
            }
            let smem = px.fresh("r");
            px.line(format!("mad.lo.u32 {smem}, {kk}, {TILE_STRIDE}, {x};"));
            px.line(format!("mad.lo.u32 {smem}, {smem}, 4, {smem0};"));
            let g = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {g}, {x};"));
            px.line(format!("add.s64 {g}, {g}, {first};"));
            let ok = px.fresh("p");
            px.line(format!("setp.lt.s64 {ok}, {g}, {extent};"));
            let base = px.fresh("rd");
            px.line(format!("mad.lo.s64 {base}, {g}, {stride}, {opbase};"));
            let kk64 = px.fresh("rd");
            px.line(format!("cvt.u64.u32 {kk64}, {kk};"));
            let at = if gathered {
                let at = px.fresh("rd");
                px.line(format!("min.s64 {at}, {g}, {};", extent.saturating_sub(1)));
                at
            } else {
                String::new()
            };
            out.push(Slot {
                smem,
                base,
                ok,
                kk: kk64,
                at,
            });
        }
        out
    };
    let a_fast = mm.a.gather.as_ref().map_or(mm.a.cs == 1, |g| g.k_fast);
    let a_slots = slots(
        &mut px,
        a_fast,
        m,
        mm.a.rs,
        &row0,
        &abase,
        &sa,
        mm.a.gather.is_some(),
    );
    let b_k_fast =
        mm.b.gather
            .as_ref()
            .map_or(mm.b.rs == 1 && mm.b.cs != 1, |g| g.k_fast);
    let b_slots = slots(
        &mut px,
        b_k_fast,
        n,
        mm.b.cs,
        &col0,
        &bbase,
        &sb,
        mm.b.gather.is_some(),
    );
    // Gathers: what depends on a slot's row (A) or column (B) alone, once per slot;
    // `fixed[side][slot]`.
    let mut fixed: [Vec<HashMap<ExprId, String>>; 2] = [Vec::new(), Vec::new()];
    for (side, (slots, g)) in [(&a_slots, &mm.a.gather), (&b_slots, &mm.b.gather)]
        .into_iter()
        .enumerate()
    {
        let (var, nodes) = px.fixed_nodes(g.as_ref(), side == 0);
        for s in slots.iter() {
            fixed[side].push(px.gather_fixed_part(&nodes, var, &s.at)?);
        }
    }

    // Shared addresses this thread's compute reads at kk = 0.
    let (ra, rb) = (px.fresh("r"), px.fresh("r"));
    px.line(format!("mad.lo.u32 {ra}, {ty}, 16, {sa};"));
    px.line(format!("mad.lo.u32 {rb}, {tx}, 4, {sb};"));

    let accs: Vec<String> = (0..16).map(|_| px.fresh("f")).collect();
    for a in &accs {
        px.line(format!("mov.f32 {a}, {};", f32_lit(0.0)));
    }
    let av: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();
    let bv: Vec<String> = (0..4).map(|_| px.fresh("f")).collect();

    // for (k0 = 0; k0 < K; k0 += TILE_K): the condition is uniform over the block. A
    // split-K block runs its slice [s * depth, (s + 1) * depth) only.
    let k0 = px.fresh("rd");
    let head = px.label("kstep");
    let exit = px.label("kdone");
    let kend = match &split {
        Some(s) => {
            let depth = split_depth(mm);
            px.line(format!("mul.lo.s64 {k0}, {s}, {depth};"));
            let e = px.fresh("rd");
            px.line(format!("add.s64 {e}, {k0}, {depth};"));
            px.line(format!("min.s64 {e}, {e}, {kd};"));
            e
        }
        None => {
            px.line(format!("mov.s64 {k0}, 0;"));
            kd.to_string()
        }
    };
    px.body.push_str(&format!("{head}:\n"));
    let pk = px.fresh("p");
    px.line(format!("setp.ge.s64 {pk}, {k0}, {kend};"));
    px.line(format!("@{pk} bra.uni {exit};"));
    let sides = [
        (&a_slots, &abuf, mm.a.cs, &mm.a.gather, true),
        (&b_slots, &bbuf, mm.b.rs, &mm.b.gather, false),
    ];
    for (side, (slots, buf, kstride, gather, a_side)) in sides.into_iter().enumerate() {
        for (si, s) in slots.iter().enumerate() {
            let kg = px.fresh("rd");
            px.line(format!("add.s64 {kg}, {k0}, {};", s.kk));
            let p = px.fresh("p");
            px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {};", s.ok));
            if let Some(g) = gather {
                // Clamped coordinates keep every load in bounds; out-of-range slots
                // store 0.
                let kc = px.fresh("rd");
                px.line(format!("min.s64 {kc}, {kg}, {};", kd.saturating_sub(1)));
                let cache = &fixed[side][si];
                let v = if a_side {
                    px.gather(g, &s.at, &kc, cache)?
                } else {
                    px.gather(g, &kc, &s.at, cache)?
                };
                let z = px.fresh("f");
                px.line(format!("selp.f32 {z}, {v}, {}, {p};", f32_lit(0.0)));
                px.line(format!("st.shared.f32 [{}], {z};", s.smem));
                continue;
            }
            let idx = px.fresh("rd");
            px.line(format!("mad.lo.s64 {idx}, {kg}, {kstride}, {};", s.base));
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {idx}, 4, {buf};"));
            let v = px.fresh("f");
            px.line(format!("mov.f32 {v}, {};", f32_lit(0.0)));
            px.line(format!("@{p} ld.global.f32 {v}, [{addr}];"));
            px.line(format!("st.shared.f32 [{}], {v};", s.smem));
        }
    }
    px.line("bar.sync 0;");
    for kk in 0..TILE_K {
        let off = kk * row_bytes;
        px.line(format!(
            "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{ra}+{off}];",
            av[0], av[1], av[2], av[3]
        ));
        for (c, b) in bv.iter().enumerate() {
            px.line(format!("ld.shared.f32 {b}, [{rb}+{}];", off + c * 64));
        }
        for r in 0..4 {
            for c in 0..4 {
                let a = &accs[r * 4 + c];
                px.line(format!("fma.rn.f32 {a}, {}, {}, {a};", av[r], bv[c]));
            }
        }
    }
    px.line("bar.sync 0;");
    px.line(format!("add.s64 {k0}, {k0}, {TILE_K};"));
    px.line(format!("bra.uni {head};"));
    px.body.push_str(&format!("{exit}:\n"));

    // Epilogue, element by element: rows ty*4 + r, columns tx + 16*c.
    let mut rows = Vec::new();
    for r in 0..4u32 {
        let (i, ok) = (px.fresh("rd"), px.fresh("p"));
        px.line(format!("mad.wide.u32 {i}, {ty}, 4, {row0};"));
        px.line(format!("add.s64 {i}, {i}, {r};"));
        px.line(format!("setp.lt.s64 {ok}, {i}, {m};"));
        rows.push((i, ok));
    }
    let mut cols = Vec::new();
    for c in 0..4u32 {
        let (j, ok) = (px.fresh("rd"), px.fresh("p"));
        px.line(format!("cvt.u64.u32 {j}, {tx};"));
        px.line(format!("add.s64 {j}, {j}, {col0};"));
        px.line(format!("add.s64 {j}, {j}, {};", 16 * c));
        px.line(format!("setp.lt.s64 {ok}, {j}, {n};"));
        cols.push((j, ok));
    }
    epilogue(
        &mut px,
        mm,
        &rows,
        &cols,
        &|r, c| accs[r * 4 + c].clone(),
        false,
        0,
    )?;
    px.line("ret;");
    let tile = TILE_K * TILE_STRIDE;
    let shared = format!(
        "\t.shared .align 16 .f32 mm_as[{tile}];\n\t.shared .align 16 .f32 mm_bs[{tile}];\n"
    );
    Ok((
        px.finish(&shared),
        LaunchShape {
            grid,
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}
