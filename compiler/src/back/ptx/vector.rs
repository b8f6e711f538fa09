//! Pointwise kernels, vector path: 4 elements per access (`ld/st.global.v4`) where the
//! innermost axis is contiguous and aligned for every store and every load along it.

use super::px::Px;
use super::{LaunchShape, Res, BLOCK};
use crate::ir::{BinaryOp, DType, NodeId};
use crate::kernel::offsets::Offsets;
use crate::kernel::{Affine, ExprId, ExprPool, Kernel, Var, E};
use std::collections::{HashMap, HashSet};

/// Elements per vector access of the vectorized pointwise path (16 bytes of f32 or i32,
/// 8 bytes of f16/bf16).
pub(super) const VEC: usize = 4;
/// Vectors per thread of the vectorized pointwise path when there are many: their loads
/// are all issued before any math, so more bytes are in flight per thread.
const VEC_UNITS: usize = 2;

/// The vectorized form of a pointwise kernel: which loads become vector loads, how many
/// vectors each thread handles and how many threads there are.
pub(super) struct VecPlan {
    /// The live loads that vary along the innermost axis, in pool order (less those read only
    /// through a load tree).
    pub(super) loads: Vec<ExprId>,
    /// Roots of select trees over such loads whose conditions do not vary along the innermost
    /// axis (a concat along an outer axis): each is one vector load from the chosen address.
    pub(super) trees: Vec<(ExprId, DType)>,
    pub(super) units: usize,
    pub(super) threads: u32,
}

/// Decides whether a kernel whose axes are all spread over threads can move `VEC`
/// consecutive points of its innermost axis per vector: every store, and every load that
/// varies along that axis, must have an affine index with coefficient 1 on it whose other
/// part is a multiple of `VEC`, a dtype with a vector form (not bool) and a buffer at an
/// arena offset aligned to the vector's bytes; the innermost extent must be a multiple of
/// `VEC`; no reductions, no accumulating stores. Loads that do not vary along the innermost
/// axis (broadcasts) stay scalar and are loaded once per vector.
pub(super) fn vector_plan(
    k: &Kernel,
    site: &[Option<Var>],
    live: &[ExprId],
    offsets: &Offsets,
) -> Option<VecPlan> {
    let rank = k.domain.len();
    let last = rank.checked_sub(1)? as Var;
    let inner = *k.domain.last()?;
    if inner < VEC || inner % VEC != 0 || k.stores.is_empty() || k.matmul.is_some() {
        return None;
    }
    let aligned = |buf: NodeId, dtype: DType, index: ExprId| {
        vector_access(k, offsets, buf, dtype, index, last)
    };
    for s in &k.stores {
        if s.accumulate || !aligned(s.buf, s.dtype, s.index) {
            return None;
        }
    }
    let mut loads = Vec::new();
    // Loads aligned only once their clamps are dropped: a piece of a concat along the
    // innermost axis, admitted as the arm of a load tree whose conditions pick it for
    // whole vectors (then lane 0 is in the piece's range, and so are the other lanes).
    // A concat is what gives a select's arm a clamped index: its conditions pick a piece
    // exactly where that piece's clamps do nothing.
    let mut clamped = Vec::new();
    for &e in live {
        match k.pool.get(e) {
            E::Reduce { .. } | E::ArgMax { .. } | E::Acc => return None,
            E::Load { buf, dtype, index } if site[e.0 as usize] == Some(last) => {
                if !aligned(*buf, *dtype, *index) {
                    let af = unclamped_affine(&k.pool, *index)?;
                    if !vector_affine(k, offsets, *buf, *dtype, &af, last) {
                        return None;
                    }
                    clamped.push(e);
                }
                loads.push(e);
            }
            _ => {}
        }
    }
    let (loads, trees) = vector_load_trees(k, site, live, loads, last);
    if loads.iter().any(|e| clamped.contains(e)) {
        return None;
    }
    let points: u64 = k.domain.iter().map(|&d| d as u64).product();
    let vectors = points / VEC as u64;
    if vectors == 0 || vectors > i32::MAX as u64 {
        return None;
    }
    let units = if vectors.is_multiple_of(VEC_UNITS as u64) && vectors >= 1 << 18 {
        VEC_UNITS
    } else {
        1
    };
    Some(VecPlan {
        loads,
        trees,
        units,
        threads: (vectors / units as u64) as u32,
    })
}

/// Select trees over loads (`select(c, load, select(c2, load, load))`, as a concat reads its
/// pieces): each select whose arms are both `leaf_ok` loads or such selects, with one element
/// type, and whose condition is `cond_ok`, with that type.
pub(super) fn select_trees(
    k: &Kernel,
    live: &[ExprId],
    leaf_ok: &dyn Fn(ExprId) -> bool,
    cond_ok: &dyn Fn(ExprId) -> bool,
) -> HashMap<ExprId, DType> {
    let mut order = live.to_vec();
    order.sort();
    let mut tree: HashMap<ExprId, DType> = HashMap::new();
    for &e in &order {
        let E::Select(c, a, b) = *k.pool.get(e) else {
            continue;
        };
        let leaf = |x: ExprId| match *k.pool.get(x) {
            E::Load { dtype, .. } if leaf_ok(x) => Some(dtype),
            _ => tree.get(&x).copied(),
        };
        if let (Some(da), Some(db)) = (leaf(a), leaf(b)) {
            if da == db && cond_ok(c) {
                tree.insert(e, da);
            }
        }
    }
    tree
}

/// For the load trees `tree`: the nodes read other than as a tree select's arm (a store
/// reads its value and index), and each node's tree selects that read it as an arm.
pub(super) fn tree_readers(
    k: &Kernel,
    live: &[ExprId],
    tree: &HashMap<ExprId, DType>,
) -> (HashSet<ExprId>, HashMap<ExprId, Vec<ExprId>>) {
    let mut outside = HashSet::new();
    let mut readers: HashMap<ExprId, Vec<ExprId>> = HashMap::new();
    for &e in live {
        let node = k.pool.get(e);
        for x in crate::kernel::lower::children(node) {
            match node {
                E::Select(c, ..) if tree.contains_key(&e) && *c != x => {
                    readers.entry(x).or_default().push(e)
                }
                _ => {
                    outside.insert(x);
                }
            }
        }
    }
    for s in &k.stores {
        outside.insert(s.value);
        outside.insert(s.index);
    }
    (outside, readers)
}

/// Whether an access of `buf[index]` can move `VEC` consecutive elements along variable
/// `along` at once: a dtype with a vector form, a buffer at an arena offset aligned to the
/// vector's bytes, and an affine index with coefficient 1 on `along` whose other part (over
/// domain variables) is a multiple of `VEC`.
pub(super) fn vector_access(
    k: &Kernel,
    offsets: &Offsets,
    buf: NodeId,
    dtype: DType,
    index: ExprId,
    along: Var,
) -> bool {
    k.pool
        .affine(index)
        .is_some_and(|af| vector_affine(k, offsets, buf, dtype, &af, along))
}

/// [`vector_access`] for the affine index `af`.
fn vector_affine(
    k: &Kernel,
    offsets: &Offsets,
    buf: NodeId,
    dtype: DType,
    af: &Affine,
    along: Var,
) -> bool {
    matches!(dtype, DType::F32 | DType::I32 | DType::F16 | DType::BF16)
        && offsets
            .get(buf)
            .is_some_and(|off| off % (VEC * dtype.size_bytes()) as u64 == 0)
        && whole_vectors(k, af, along)
}

/// Whether `af` moves by 1 along `along` and is a multiple of `VEC` where `along` is: a
/// vector of `VEC` consecutive points from a multiple of `VEC` has consecutive values from
/// a multiple of `VEC`.
fn whole_vectors(k: &Kernel, af: &Affine, along: Var) -> bool {
    let v = VEC as i64;
    af.coef(along) == 1
        && af.c0 % v == 0
        && af
            .terms
            .iter()
            .all(|&(x, c)| x == along || ((x as usize) < k.domain.len() && c % v == 0))
}

/// The affine form of an index with its clamps dropped, where each clamp's bounds are
/// whole vectors (`max(x, lo)` with `lo` a multiple of `VEC`, `min(x, hi)` with `hi + 1`
/// one): a vector of consecutive `x` from a multiple of `VEC` lies wholly inside them or
/// wholly outside.
fn unclamped_affine(pool: &ExprPool, e: ExprId) -> Option<Affine> {
    let v = VEC as i64;
    let int = |x: ExprId| match *pool.get(x) {
        E::Int(c) => Some(c),
        _ => None,
    };
    pool.affine_by(e, &|x| match *pool.get(x) {
        E::IMax(y, lo) if int(lo)? % v == 0 => unclamped_affine(pool, y),
        E::IMin(y, hi) if (int(hi)? + 1) % v == 0 => unclamped_affine(pool, y),
        _ => None,
    })
}

/// Whether condition `c` has one value for the `VEC` lanes of a vector along `last`: it does
/// not vary along `last`, or it compares `x` (affine, coefficient 1 on `last`, the rest
/// whole vectors) with a constant that starts a vector (`x < C`, `x >= C`, `C` a multiple of
/// `VEC`), as a concat along the innermost axis picks its pieces.
fn uniform_condition(k: &Kernel, site: &[Option<Var>], c: ExprId, last: Var) -> bool {
    if site[c.0 as usize] != Some(last) {
        return true;
    }
    let v = VEC as i64;
    let E::Bin(op, x, y) = *k.pool.get(c) else {
        return false;
    };
    let bound = match (op, k.pool.get(y)) {
        (BinaryOp::Lt | BinaryOp::Ge, E::Int(b)) => *b,
        (BinaryOp::Le | BinaryOp::Gt, E::Int(b)) => b.saturating_add(1),
        _ => return false,
    };
    bound % v == 0
        && k.pool
            .affine(x)
            .is_some_and(|af| whole_vectors(k, &af, last))
}

/// Splits the vector loads of [`vector_plan`] into plain ones and the roots of load trees
/// whose conditions are the same for the `VEC` lanes (they do not vary along the innermost
/// axis). A load read only by tree selects is not made on its own (a concat of 12 pieces
/// read 12 vectors for each one it wrote).
fn vector_load_trees(
    k: &Kernel,
    site: &[Option<Var>],
    live: &[ExprId],
    loads: Vec<ExprId>,
    last: Var,
) -> (Vec<ExprId>, Vec<(ExprId, DType)>) {
    let tree = select_trees(k, live, &|x| loads.contains(&x), &|c| {
        uniform_condition(k, site, c, last)
    });
    if tree.is_empty() {
        return (loads, Vec::new());
    }
    let (outside, _) = tree_readers(k, live, &tree);
    let plain = loads.into_iter().filter(|x| outside.contains(x)).collect();
    let mut roots: Vec<(ExprId, DType)> = tree
        .into_iter()
        .filter(|(e, _)| outside.contains(e))
        .collect();
    roots.sort();
    (plain, roots)
}

/// One vector of the vectorized pointwise path, between its loads and its math.
struct VecUnit {
    /// Registers of the domain variables (the innermost one at lane 0).
    pub(super) vars: Vec<String>,
    /// Nodes computed for this vector that do not vary along the innermost axis.
    hoisted: Vec<(ExprId, String)>,
    /// Each vector load's lane registers (f32 or i32 compute registers).
    loads: Vec<(ExprId, Vec<String>)>,
    /// Byte address of each store at lane 0.
    pub(super) stores: Vec<String>,
}

impl Px<'_> {
    /// Pops the innermost cache scope: its nodes leave the cache and are returned.
    pub(super) fn pop_scope(&mut self) -> Vec<(ExprId, String)> {
        let keys = self.journal.pop().unwrap_or_default();
        keys.into_iter()
            .filter_map(|key| self.cache.remove(&key).map(|r| (key, r)))
            .collect()
    }

    /// `VEC` consecutive elements at `addr`, converted to their compute type.
    pub(super) fn vector_load(&mut self, addr: &str, dtype: DType) -> Vec<String> {
        match dtype {
            DType::F16 | DType::BF16 => {
                let hs: Vec<String> = (0..VEC).map(|_| self.fresh("h")).collect();
                self.line(format!("ld.global.v4.b16 {{{}}}, [{addr}];", hs.join(", ")));
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                hs.iter()
                    .map(|h| {
                        let r = self.fresh("f");
                        self.line(format!("cvt.f32.{t} {r}, {h};"));
                        r
                    })
                    .collect()
            }
            _ => {
                let (p, t) = if dtype == DType::I32 {
                    ("r", "b32")
                } else {
                    ("f", "f32")
                };
                let rs: Vec<String> = (0..VEC).map(|_| self.fresh(p)).collect();
                self.line(format!("ld.global.v4.{t} {{{}}}, [{addr}];", rs.join(", ")));
                rs
            }
        }
    }

    /// Stores `VEC` compute values to consecutive elements at `addr`.
    pub(super) fn vector_store(&mut self, addr: &str, dtype: DType, vals: &[String]) {
        match dtype {
            DType::F16 | DType::BF16 => {
                let t = if dtype == DType::F16 { "f16" } else { "bf16" };
                let hs: Vec<String> = vals
                    .iter()
                    .map(|v| {
                        let h = self.fresh("h");
                        self.line(format!("cvt.rn.{t}.f32 {h}, {v};"));
                        h
                    })
                    .collect();
                self.line(format!("st.global.v4.b16 [{addr}], {{{}}};", hs.join(", ")));
            }
            _ => {
                let t = if dtype == DType::I32 { "b32" } else { "f32" };
                self.line(format!(
                    "st.global.v4.{t} [{addr}], {{{}}};",
                    vals.join(", ")
                ));
            }
        }
    }
}

/// The vectorized pointwise kernel (see [`vector_plan`]): thread `t` handles vectors
/// `t + u * threads` for `u < units`, so that a warp's accesses stay contiguous. Each vector
/// is decoded into the domain variables, its vector loads are issued (all units' loads before
/// any math), then every lane computes the stored values exactly as the scalar path does, one
/// point at a time, and each store writes one vector.
pub(super) fn emit_vector_pointwise(
    k: &Kernel,
    offsets: &Offsets,
    site: Vec<Option<Var>>,
    live: Vec<ExprId>,
    plan: &VecPlan,
) -> Res<(String, LaunchShape)> {
    let rank = k.domain.len();
    let last = rank - 1;
    let mut px = Px::new(k, offsets, site, live);
    px.load_arena();
    let (a, b, c) = (px.fresh("r"), px.fresh("r"), px.fresh("r"));
    px.line(format!("mov.u32 {a}, %ctaid.x;"));
    px.line(format!("mov.u32 {b}, %ntid.x;"));
    px.line(format!("mov.u32 {c}, %tid.x;"));
    px.tid = c.clone();
    let tid = px.fresh("r");
    px.line(format!("mad.lo.u32 {tid}, {a}, {b}, {c};"));
    let done = px.label("done");
    let pd = px.fresh("p");
    px.line(format!("setp.ge.u32 {pd}, {tid}, {};", plan.threads));
    px.line(format!("@{pd} bra {done};"));
    px.emit_site(None)?;
    let mut units = Vec::new();
    for u in 0..plan.units {
        let q = px.fresh("r");
        px.line(format!(
            "add.u32 {q}, {tid}, {};",
            u as u64 * plan.threads as u64
        ));
        px.journal.push(Vec::new());
        // Vector index → domain variables (the innermost counts vectors).
        let exts: Vec<usize> = (0..rank)
            .map(|d| {
                if d == last {
                    k.domain[d] / VEC
                } else {
                    k.domain[d]
                }
            })
            .collect();
        let mut vars = vec![String::new(); rank];
        px.digits(&q, &exts, false, |px, d, v32| {
            let v = px.fresh("rd");
            if d == last {
                px.line(format!("mul.wide.u32 {v}, {v32}, {VEC};"));
            } else {
                px.line(format!("cvt.u64.u32 {v}, {v32};"));
            }
            px.vars.insert(d as Var, v.clone());
            vars[d] = v;
        });
        for d in 0..last {
            px.emit_site(Some(d as Var))?;
        }
        // Addresses at lane 0 and the vector loads.
        px.journal.push(Vec::new());
        let mut loads = Vec::new();
        for &e in &plan.loads {
            if let E::Load { buf, dtype, index } = *k.pool.get(e) {
                let i = px.emit(index)?;
                let addr = px.address(buf, dtype, &i)?;
                loads.push((e, px.vector_load(&addr, dtype)));
            }
        }
        for &(e, dtype) in &plan.trees {
            let addr = px.tree_address(e)?;
            loads.push((e, px.vector_load(&addr, dtype)));
        }
        let mut stores = Vec::new();
        for s in &k.stores {
            let i = px.emit(s.index)?;
            stores.push(px.address(s.buf, s.dtype, &i)?);
        }
        px.pop_scope();
        let hoisted = px.pop_scope();
        units.push(VecUnit {
            vars,
            hoisted,
            loads,
            stores,
        });
    }
    for unit in units {
        for (e, r) in &unit.hoisted {
            px.cache.insert(*e, r.clone());
        }
        for (d, v) in unit.vars.iter().enumerate() {
            px.vars.insert(d as Var, v.clone());
        }
        let mut vals: Vec<Vec<String>> = vec![Vec::new(); k.stores.len()];
        for l in 0..VEC {
            let lane = if l == 0 {
                unit.vars[last].clone()
            } else {
                let r = px.fresh("rd");
                px.line(format!("add.s64 {r}, {}, {l};", unit.vars[last]));
                r
            };
            px.vars.insert(last as Var, lane);
            px.journal.push(Vec::new());
            for (e, regs) in &unit.loads {
                px.remember(*e, regs[l].clone());
            }
            for (si, s) in k.stores.iter().enumerate() {
                let v = px.emit(s.value)?;
                vals[si].push(v);
            }
            px.pop_scope();
        }
        for ((s, addr), v) in k.stores.iter().zip(&unit.stores).zip(&vals) {
            px.vector_store(addr, s.dtype, v);
        }
        for (e, _) in &unit.hoisted {
            px.cache.remove(e);
        }
    }
    px.body.push_str(&format!("{done}:\n\tret;\n"));
    let text = px.finish("");
    let grid = plan.threads.div_ceil(BLOCK);
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
