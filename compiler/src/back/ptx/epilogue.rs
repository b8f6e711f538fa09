//! The fused epilogue of every matmul: each output element's coordinates, then the kernel's
//! stores (vectorized where the tile's columns allow, with the epilogue's loads prefetched).

use super::px::Px;
use super::vector::{vector_access, VEC};
use super::Res;
use crate::kernel::{ExprId, Matmul, Var, E};
use std::collections::HashSet;

/// The coordinates (row-major over `dims`) of the flattened index in register `lin`;
/// `lin` itself for one axis. 32-bit division when the product fits. Out-of-range
/// indices give garbage coordinates (callers guard them).
pub(super) fn split_index(px: &mut Px, lin: &str, dims: &[usize]) -> Vec<String> {
    if dims.len() <= 1 {
        return vec![lin.to_string()];
    }
    let total: usize = dims.iter().product();
    let mut out = vec![String::new(); dims.len()];
    if total < 1 << 31 {
        let mut rest = px.fresh("r");
        px.line(format!("cvt.u32.u64 {rest}, {lin};"));
        for d in (0..dims.len()).rev() {
            let v = px.fresh("rd");
            if d == 0 {
                px.line(format!("cvt.u64.u32 {v}, {rest};"));
            } else {
                let (r, q) = (px.fresh("r"), px.fresh("r"));
                px.line(format!("rem.u32 {r}, {rest}, {};", dims[d]));
                px.line(format!("div.u32 {q}, {rest}, {};", dims[d]));
                px.line(format!("cvt.u64.u32 {v}, {r};"));
                rest = q;
            }
            out[d] = v;
        }
    } else {
        px.digits(lin, dims, true, |_, d, v| out[d] = v);
    }
    out
}

/// `count` output coordinates `base + at(i)` with their in-range predicates.
pub(super) fn epilogue_coords(
    px: &mut Px,
    base: &str,
    extent: usize,
    count: usize,
    at: &dyn Fn(usize) -> usize,
) -> Vec<(String, String)> {
    (0..count)
        .map(|i| {
            let (x, ok) = (px.fresh("rd"), px.fresh("p"));
            px.line(format!("add.s64 {x}, {base}, {};", at(i)));
            px.line(format!("setp.lt.s64 {ok}, {x}, {extent};"));
            (x, ok)
        })
        .collect()
}

/// The kernel's stores at one output element, in a cache scope of their own: `at` are the
/// domain coordinates after the batch axes (the row's, then the column's), `acc` the
/// accumulator.
pub(super) fn store_point(
    px: &mut Px,
    mm: &Matmul,
    at: &[String],
    acc: String,
    loaded: &[(ExprId, String)],
) -> Res<()> {
    let nb = mm.batch.len();
    px.journal.push(Vec::new());
    px.bind_point(nb, at);
    for (e, r) in loaded {
        px.remember(*e, r.clone());
    }
    px.acc = Some(acc);
    px.stores()?;
    px.pop_scope();
    Ok(())
}

/// The kernel's stores at `VEC` consecutive output elements of one row (the coordinates
/// `ats`, the accumulators `accs`), as one vector store each: every lane's values are
/// computed in a cache scope of its own, then each store writes them at lane 0's address.
pub(super) fn store_vector(
    px: &mut Px,
    mm: &Matmul,
    ats: &[Vec<String>],
    accs: &[String],
    loaded: &[Vec<(ExprId, String)>],
) -> Res<()> {
    let nb = mm.batch.len();
    let stores = px.k.stores.clone();
    let mut vals: Vec<Vec<String>> = vec![Vec::new(); stores.len()];
    let mut addrs = Vec::new();
    for (lane, (at, acc)) in ats.iter().zip(accs).enumerate() {
        px.journal.push(Vec::new());
        px.bind_point(nb, at);
        for (e, r) in loaded.get(lane).into_iter().flatten() {
            px.remember(*e, r.clone());
        }
        px.acc = Some(acc.clone());
        for (si, s) in stores.iter().enumerate() {
            vals[si].push(px.emit(s.value)?);
            if lane == 0 {
                let i = px.emit(s.index)?;
                addrs.push(px.address(s.buf, s.dtype, &i)?);
            }
        }
        px.pop_scope();
    }
    for ((s, addr), v) in stores.iter().zip(&addrs).zip(&vals) {
        px.vector_store(addr, s.dtype, v);
    }
    Ok(())
}

/// Whether a plain matmul's epilogue can store `VEC` consecutive columns at once: every
/// store writes a vector-storable dtype, without accumulating, at an index with coefficient
/// 1 on the column whose other part is a multiple of `VEC`, into a buffer aligned to the
/// vector's bytes (so a tile's aligned groups of `VEC` columns are whole vectors, all in
/// range or all out).
pub(super) fn epilogue_vectors(px: &Px, mm: &Matmul) -> bool {
    let k = px.k;
    if mm.cols.len() != 1 || mm.rows.len() != 1 || !mm.n.is_multiple_of(VEC) {
        return false;
    }
    let col = (mm.batch.len() + 1) as Var;
    !k.stores.is_empty()
        && k.stores
            .iter()
            .all(|s| !s.accumulate && vector_access(k, px.offsets, s.buf, s.dtype, s.index, col))
}

/// Registers an epilogue gives to loads issued ahead of their use: rows of the register
/// tile come in batches whose loads (all of them, or a row's where one row takes more) are
/// issued before the batch's first store. Loaded where each value is computed, they waited
/// for one another through the stores between them (ptxas does not move a load above a
/// store that may alias it).
pub(super) const EPILOGUE_PREFETCH_REGS: usize = 64;

/// The loads of the kernel's stored values outside reductions (a select over loads as one),
/// in pool order, each with whether its index reads a column's variable.
pub(super) fn epilogue_loads(px: &Px, mm: &Matmul) -> Vec<(ExprId, bool)> {
    let k = px.k;
    let first_col = mm.batch.len() + mm.rows.len();
    let by_col = first_col..first_col + mm.cols.len();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stack: Vec<ExprId> = k.stores.iter().flat_map(|s| [s.value, s.index]).collect();
    while let Some(e) = stack.pop() {
        if !seen.insert(e) || px.cache.contains_key(&e) {
            continue;
        }
        match k.pool.get(e) {
            E::Reduce { .. } | E::ArgMax { .. } => {}
            E::Load { .. } => out.push(e),
            E::Select(..) if px.load_tree(e).is_some() => out.push(e),
            node => stack.extend(crate::kernel::lower::children(node)),
        }
    }
    if out.is_empty() {
        return Vec::new();
    }
    out.sort();
    let free = crate::kernel::lower::free_vars(&k.pool);
    out.into_iter()
        .map(|e| {
            let cols = free[e.0 as usize]
                .iter()
                .any(|&v| by_col.contains(&(v as usize)));
            (e, cols)
        })
        .collect()
}

/// The loads of [`epilogue_loads`] at every in-range point of `rows` (all columns, in groups
/// of `width` sharing their first column's predicate), issued now: for each row and column
/// the registers holding them, to seed that point's cache when its value is computed. A
/// load that reads no column's variable is made once a row.
#[allow(clippy::type_complexity)]
fn prefetch_epilogue(
    px: &mut Px,
    mm: &Matmul,
    loads: &[(ExprId, bool)],
    rows: &[(&(String, String), &Vec<String>)],
    cols: &[(String, String)],
    col_at: &[Vec<String>],
    width: usize,
) -> Res<Vec<Vec<Vec<(ExprId, String)>>>> {
    let nb = mm.batch.len();
    // The column's variable where groups are vectors (one row and one column variable).
    let col = (nb + 1) as Var;
    let mut out = vec![vec![Vec::new(); cols.len()]; rows.len()];
    if loads.is_empty() {
        return Ok(out);
    }
    for (r, ((_, pi), row_at)) in rows.iter().enumerate() {
        let skip_row = px.label("skip");
        px.line(format!("@!{pi} bra {skip_row};"));
        px.journal.push(Vec::new());
        px.bind_point(nb, row_at.iter());
        let mut row_loads = Vec::new();
        for &(e, by_col) in loads {
            if !by_col {
                row_loads.push((e, px.emit(e)?));
            }
        }
        px.pop_scope();
        for g in (0..cols.len()).step_by(width) {
            let skip = px.label("skip");
            px.line(format!("@!{} bra {skip};", cols[g].1));
            // Lane `l`'s element of each vector load of the group.
            let mut lanes: Vec<(ExprId, Vec<String>)> = Vec::new();
            for c in g..(g + width).min(cols.len()) {
                px.journal.push(Vec::new());
                px.bind_point(nb, row_at.iter().chain(&col_at[c]));
                let mut regs = row_loads.clone();
                for (e, reg) in &row_loads {
                    px.remember(*e, reg.clone());
                }
                if width == VEC && c == g {
                    for &(e, by_col) in loads {
                        match *px.k.pool.get(e) {
                            E::Load { buf, dtype, index }
                                if by_col
                                    && vector_access(px.k, px.offsets, buf, dtype, index, col) =>
                            {
                                let i = px.emit(index)?;
                                let a = px.address(buf, dtype, &i)?;
                                lanes.push((e, px.vector_load(&a, dtype)));
                            }
                            _ => {}
                        }
                    }
                }
                for (e, vals) in &lanes {
                    px.remember(*e, vals[c - g].clone());
                    regs.push((*e, vals[c - g].clone()));
                }
                for &(e, by_col) in loads {
                    if by_col && lanes.iter().all(|(x, _)| *x != e) {
                        regs.push((e, px.emit(e)?));
                    }
                }
                px.pop_scope();
                out[r][c] = regs;
            }
            px.body.push_str(&format!("{skip}:\n"));
        }
        px.body.push_str(&format!("{skip_row}:\n"));
    }
    Ok(out)
}

/// The fused epilogue of a register-tiled matmul: the kernel's stores at every in-range
/// (row, column) pair, with the accumulator `acc(r, c)`. `vectors`: the columns come in
/// groups of `VEC` consecutive ones, the first of each a multiple of `VEC` (the FFMA SGEMM's
/// layout), and [`epilogue_vectors`] holds: each group is stored as vectors. The values'
/// loads are issued ahead, a batch of rows at a time ([`EPILOGUE_PREFETCH_REGS`]).
pub(super) fn epilogue(
    px: &mut Px,
    mm: &Matmul,
    rows: &[(String, String)],
    cols: &[(String, String)],
    acc: &dyn Fn(usize, usize) -> String,
    vectors: bool,
    prefetch_regs: usize,
) -> Res<()> {
    // The domain coordinates of each row and column (an implicit GEMM's rows span
    // several axes).
    let row_at: Vec<Vec<String>> = rows
        .iter()
        .map(|(i, _)| split_index(px, i, &mm.rows))
        .collect();
    let col_at: Vec<Vec<String>> = cols
        .iter()
        .map(|(j, _)| split_index(px, j, &mm.cols))
        .collect();
    let width = if vectors && cols.len().is_multiple_of(VEC) {
        VEC
    } else {
        1
    };
    let loads = if prefetch_regs > 0 {
        epilogue_loads(px, mm)
    } else {
        Vec::new()
    };
    let per_row: usize = loads
        .iter()
        .map(|&(_, by_col)| if by_col { cols.len() } else { 1 })
        .sum();
    let batch = (1..=rows.len())
        .rev()
        .find(|&d| rows.len().is_multiple_of(d) && d * per_row <= prefetch_regs)
        .unwrap_or(1);
    for r0 in (0..rows.len()).step_by(batch.max(1)) {
        let these: Vec<_> = rows[r0..r0 + batch].iter().zip(&row_at[r0..]).collect();
        let loaded = prefetch_epilogue(px, mm, &loads, &these, cols, &col_at, width)?;
        for (r, ((_, pi), loaded)) in these.iter().map(|x| x.0).zip(&loaded).enumerate() {
            let r = r0 + r;
            for g in (0..cols.len()).step_by(width) {
                let skip = px.label("skip");
                let p = px.fresh("p");
                px.line(format!("and.pred {p}, {pi}, {};", cols[g].1));
                px.line(format!("@!{p} bra {skip};"));
                let ats: Vec<Vec<String>> = (g..g + width)
                    .map(|c| row_at[r].iter().chain(&col_at[c]).cloned().collect())
                    .collect();
                if width == VEC {
                    let accs: Vec<String> = (g..g + width).map(|c| acc(r, c)).collect();
                    store_vector(px, mm, &ats, &accs, &loaded[g..g + width])?;
                } else {
                    store_point(px, mm, &ats[0], acc(r, g), &loaded[g])?;
                }
                px.body.push_str(&format!("{skip}:\n"));
            }
        }
    }
    Ok(())
}
