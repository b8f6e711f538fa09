//! Pointwise and reduction kernels, scalar path: the leading axes over threads (or a block
//! or a warp per point), the remaining axes and the reductions as loops inside the thread.

use super::px::Px;
use super::vector::{emit_vector_pointwise, vector_plan};
use super::{LaunchShape, PtxError, Res, BLOCK, WARP};
use crate::kernel::offsets::Offsets;
use crate::kernel::sites::sites;
use crate::kernel::{ExprId, Kernel, VTy, Var, E};

/// How many leading domain axes are spread over threads: all of them, unless a reduction
/// is hoisted to the loop of an axis (then up to that axis, so it is computed once).
pub(super) fn parallel_axes(k: &Kernel, site: &[Option<Var>], live: &[ExprId]) -> usize {
    let rank = k.domain.len();
    let mut p = rank;
    for &e in live {
        if matches!(k.pool.get(e), E::Reduce { .. } | E::ArgMax { .. }) {
            match site[e.0 as usize] {
                Some(v) if (v as usize) < rank => p = p.min(v as usize + 1),
                Some(_) => {}
                None => p = 0,
            }
        }
    }
    p
}

/// True when some load of the reductions in `top` is contiguous along the innermost
/// reduction variable but not along the point's innermost axis `point`: the data a warp
/// per point reads in one access is then one contiguous run.
pub(super) fn rows_along_reduction(k: &Kernel, top: &[ExprId], point: Option<Var>) -> bool {
    let inner: Vec<Var> = top
        .iter()
        .filter_map(|&e| match k.pool.get(e) {
            E::Reduce { vars, .. } => vars.last().map(|v| v.0),
            _ => None,
        })
        .collect();
    k.pool.nodes.iter().any(|n| {
        let E::Load { index, .. } = n else {
            return false;
        };
        k.pool.affine(*index).is_some_and(|af| {
            inner.iter().any(|&v| af.coef(v) == 1) && point.is_none_or(|p| af.coef(p) != 1)
        })
    })
}

/// A pointwise or reduction kernel on the scalar path (or the vector path where
/// [`vector_plan`] allows), or a matmul on the per-element path.
pub(super) fn emit(k: &Kernel, offsets: &Offsets) -> Res<(String, LaunchShape)> {
    let live = k.live_nodes();
    let site = sites(k);
    let rank = k.domain.len();
    // Axes outside every reduction: the points a thread (or a block) computes.
    let p0 = if k.matmul.is_some() {
        rank
    } else {
        parallel_axes(k, &site, &live)
    };
    // Trailing axes of extent 1 need no loop: they are parallel too.
    let par = if k.domain[p0..].iter().all(|&d| d == 1) {
        rank
    } else {
        p0
    };
    // Block mode: one block per point of the first `p0` axes. The reductions computed
    // once per point (sited at the last of those axes) are shared among the block's
    // threads; then the threads stride over the point's remaining elements (a row of a
    // softmax, a layer norm or a loss), so that their loads and stores are coalesced.
    let boundary = p0.checked_sub(1).map(|d| d as Var);
    let top: Vec<ExprId> = if k.matmul.is_none() {
        live.iter()
            .copied()
            .filter(|&e| {
                matches!(k.pool.get(e), E::Reduce { .. })
                    && site[e.0 as usize] == boundary
                    && matches!(k.pool.ty(e), VTy::F32 | VTy::I32)
            })
            .collect()
    } else {
        Vec::new()
    };
    let longest = top
        .iter()
        .map(|&e| match k.pool.get(e) {
            E::Reduce { vars, .. } => vars.iter().map(|v| v.1).product::<usize>(),
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    let argmax_at_top = live
        .iter()
        .any(|&e| matches!(k.pool.get(e), E::ArgMax { .. }) && site[e.0 as usize] == boundary);
    let block_points: u64 = k.domain[..p0]
        .iter()
        .map(|&d| d as u64)
        .product::<u64>()
        .max(1);
    let inner: u64 = k.domain[p0..].iter().map(|&d| d as u64).product();
    // With one element per point, a block per point pays off when there are too few
    // points to fill the GPU with one thread each; with many points (a convolution's
    // outputs) one thread per point wins. With whole rows per point, a thread per row
    // would read its row alone (uncoalesced): a block per row wins once rows are long.
    // Many points whose rows lie along the reduction (gpt's 49152 softmax rows of 512)
    // take a warp each: a thread per row read 0.7 TB/s on an H100, and a block of 256 per
    // row of a few thousand elements spent its time in barriers. Accumulating stores (a
    // scatter's `+=`) stay atomic: each element is still stored by one thread (gpt's
    // embedding gradient, fused with a row reduction, ran 4096 threads for 1.3 ms).
    // A row statistic alone (one element per point) takes a warp per row also when there
    // are a few thousand rows of at most 2048 (gpt's RMS norm statistics, 4096 rows of 768:
    // 14.2 → 10.4 µs on an H100). With the row's elements stored as well (the norm's
    // backward), a block per row stays faster (23.2 µs against 25.9).
    let many = block_points > 16384;
    let along_rows = !top.is_empty() && rows_along_reduction(k, &top, boundary);
    let along = many && along_rows;
    let warp_rows = along || (along_rows && inner <= 1 && block_points >= 2048 && longest <= 2048);
    let block_mode = !top.is_empty()
        && !argmax_at_top
        && inner <= u32::MAX as u64 - BLOCK as u64
        && block_points < 1 << 31
        && if inner <= 1 {
            longest >= 64 && (!many || along)
        } else {
            longest >= 64 || inner >= 64
        };
    let group = if block_mode && warp_rows && inner <= 4096 {
        WARP
    } else {
        BLOCK
    };
    let par = if block_mode { p0 } else { par };
    let points: u64 = k.domain[..par]
        .iter()
        .map(|&d| d as u64)
        .product::<u64>()
        .max(1);
    let threads: u64 = if block_mode {
        points * group as u64
    } else {
        points
    };
    if !block_mode && k.matmul.is_none() && par == rank {
        if let Some(plan) = vector_plan(k, &site, &live, offsets) {
            return emit_vector_pointwise(k, offsets, site, live, &plan);
        }
    }
    let mut px = Px::new(k, offsets, site, live);
    if block_mode {
        px.block_reductions = top;
        px.group = group;
    }
    px.load_arena();
    let (a, b, c) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {a}, %ctaid.x;"));
    px.line(format!("mov.u32 {b}, %ntid.x;"));
    px.line(format!("mov.u32 {c}, %tid.x;"));
    px.tid = c.clone();
    let tid = px.fresh("rd");
    let done = px.label("done");
    if block_mode && group == WARP {
        // One warp per point: the point is the block index times the warps of a block
        // plus the warp's; the thread's index in its group is its lane.
        let (w, lane) = (px.fresh("r"), px.fresh("r"));
        px.line(format!("shr.u32 {w}, {c}, 5;"));
        px.line(format!("and.b32 {lane}, {c}, 31;"));
        px.line(format!("mul.wide.u32 {tid}, {a}, {};", BLOCK / WARP));
        let w64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {w64}, {w};"));
        px.line(format!("add.u64 {tid}, {tid}, {w64};"));
        let pd = px.fresh("p");
        px.line(format!("setp.ge.u64 {pd}, {tid}, {points};"));
        px.line(format!("@{pd} bra {done};"));
        px.tid = lane;
    } else if block_mode {
        // One block per point: the point is the block index.
        px.line(format!("cvt.u64.u32 {tid}, {a};"));
    } else {
        px.line(format!("mul.wide.u32 {tid}, {a}, {b};"));
        let c64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {c64}, {c};"));
        px.line(format!("add.u64 {tid}, {tid}, {c64};"));
        let pd = px.fresh("p");
        px.line(format!("setp.ge.u64 {pd}, {tid}, {threads};"));
        px.line(format!("@{pd} bra {done};"));
    }
    // Thread index → the parallel axes (row-major), in 32-bit arithmetic when the index
    // fits (64-bit division is a long subroutine on the GPU).
    if points < u32::MAX as u64 {
        let r = px.fresh("r");
        px.line(format!("cvt.u32.u64 {r}, {tid};"));
        let dims: Vec<(Var, usize)> = (0..par).map(|d| (d as Var, k.domain[d])).collect();
        px.bind_linear(&r, &dims);
    } else {
        px.digits(&tid, &k.domain[..par], true, |px, d, v| {
            px.vars.insert(d as Var, v);
        });
    }
    if let Some(mm) = &k.matmul {
        px.matmul_per_element(mm)?;
    } else {
        px.emit_site(None)?;
        for d in 0..par {
            px.emit_site(Some(d as Var))?;
        }
        if block_mode {
            // for (lin = tid; lin < inner; lin += group): the point's remaining elements.
            let lin = px.fresh("r");
            let head = px.label("ihead");
            let tidr = px.tid.clone();
            px.line(format!("mov.u32 {lin}, {tidr};"));
            px.body.push_str(&format!("{head}:\n"));
            let pe = px.fresh("p");
            px.line(format!("setp.ge.u32 {pe}, {lin}, {inner};"));
            px.line(format!("@{pe} bra {done};"));
            // Unrolled as the reductions are: every copy's values, then their stores
            // (a load after a store could not be moved above it).
            let dims: Vec<(Var, usize)> = (par..rank).map(|d| (d as Var, k.domain[d])).collect();
            let unroll = Px::unroll(inner as usize, group);
            let mut stores = Vec::new();
            for u in 0..unroll {
                let copy = px.loop_copy(&lin, (u, group), &dims, |px| {
                    for d in par..rank {
                        px.emit_site(Some(d as Var))?;
                    }
                    px.store_values()
                })?;
                stores.extend(copy);
            }
            for (addr, s, val) in stores {
                px.store(&addr, s.dtype, &val, s.accumulate)?;
            }
            px.line(format!(
                "add.u32 {lin}, {lin}, {};",
                group as usize * unroll
            ));
            px.line(format!("bra.uni {head};"));
        } else {
            let mut open = Vec::new();
            for d in par..rank {
                let l = px.open_loop("0", &k.domain[d].to_string());
                px.vars.insert(d as Var, l.iv.clone());
                px.emit_site(Some(d as Var))?;
                open.push(l);
            }
            px.stores()?;
            while let Some(l) = open.pop() {
                px.close_loop(l);
            }
        }
    }
    px.body.push_str(&format!("{done}:\n\tret;\n"));
    let shared = if block_mode && group == BLOCK {
        format!("\t.shared .align 4 .b8 red_smem[{}];\n", BLOCK / 32 * 4)
    } else {
        String::new()
    };
    let text = px.finish(&shared);
    let grid = threads.div_ceil(BLOCK as u64);
    let grid = u32::try_from(grid).map_err(|_| PtxError::Unsupported {
        kernel: k.name.clone(),
        message: format!("{threads} threads do not fit one grid"),
    })?;
    Ok((
        text,
        LaunchShape {
            grid: [grid.max(1), 1, 1],
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            scratch_bytes: 0,
        },
    ))
}
