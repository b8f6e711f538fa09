//! Operand staging: how the matmuls move their A and B tiles from global to shared memory
//! (16-byte `cp.async` chunks, element loads with zero fill, and the SGEMM's register slots).

use super::px::{f32_lit, Px};
use super::runs::Run;
use super::sgemm::{SG_BK, SG_STRIDE};
use super::tile::operand_buffer;
use super::Res;
use crate::kernel::{ExprId, Gather, Var};
use std::collections::HashMap;

/// One 16-byte `cp.async` from element `idx` of the buffer at `buf` to shared byte `dst`,
/// or 16 zero bytes when `p` is false (the source address then stays at `buf`).
pub(super) fn chunk_copy(px: &mut Px, dst: &str, buf: &str, idx: &str, p: &str, eb: usize) {
    let addr = px.fresh("rd");
    px.line(format!("mad.lo.s64 {addr}, {idx}, {eb}, {buf};"));
    px.line(format!("selp.b64 {addr}, {addr}, {buf}, {p};"));
    let size = px.fresh("r");
    px.line(format!("selp.u32 {size}, 16, 0, {p};"));
    px.line(format!(
        "cp.async.cg.shared.global [{dst}], [{addr}], 16, {size};"
    ));
}

/// Where one thread's chunk of an operand tile lives: its shared offset within a stage
/// (u32), its first `k` within the stage (u64) and its element index at `k = 0` (u64),
/// with the operand's stride along `k`.
pub(super) struct ChunkSlot<'a> {
    pub(super) smem: &'a str,
    pub(super) kk: &'a str,
    pub(super) base: &'a str,
    pub(super) k_stride: i64,
}

/// The chunk of `slot` in the stage of `k0` (i64 register) whose buffer starts at shared
/// byte `st` (u32): its shared address, its first `k` and its element index.
pub(super) fn stage_chunk(
    px: &mut Px,
    st: &str,
    k0: &str,
    slot: ChunkSlot,
) -> (String, String, String) {
    let dst = px.fresh("r");
    px.line(format!("add.u32 {dst}, {st}, {};", slot.smem));
    let kg = px.fresh("rd");
    px.line(format!("add.s64 {kg}, {k0}, {};", slot.kk));
    let idx = px.fresh("rd");
    px.line(format!(
        "mad.lo.s64 {idx}, {k0}, {}, {};",
        slot.k_stride, slot.base
    ));
    (dst, kg, idx)
}

/// A chunk of `count` elements of `eb` bytes, `stride` elements apart from element `idx`
/// of the buffer at `buf`, for shared byte `dst`.
pub(super) struct ElementChunk<'a> {
    pub(super) dst: &'a str,
    pub(super) buf: &'a str,
    pub(super) idx: &'a str,
    pub(super) stride: i64,
    pub(super) eb: usize,
    pub(super) count: usize,
}

/// Copies `c` element by element (where a 16-byte `cp.async` does not apply): element `e`
/// is loaded when `from + e < end` and `also` hold, and is 0 otherwise.
pub(super) fn copy_elements(px: &mut Px, c: &ElementChunk, (from, end, also): (&str, usize, &str)) {
    let ld = if c.eb == 2 { "b16" } else { "b32" };
    let cls = if c.eb == 2 { "h" } else { "r" };
    for e in 0..c.count {
        let p = px.fresh("p");
        let at = px.fresh("rd");
        px.line(format!("add.s64 {at}, {from}, {e};"));
        px.line(format!("setp.lt.and.s64 {p}, {at}, {end}, {also};"));
        let ie = px.fresh("rd");
        px.line(format!("mad.lo.s64 {ie}, {e}, {}, {};", c.stride, c.idx));
        let addr = px.fresh("rd");
        px.line(format!("mad.lo.s64 {addr}, {ie}, {}, {};", c.eb, c.buf));
        let v = px.fresh(cls);
        px.line(format!("mov.{ld} {v}, 0;"));
        px.line(format!("@{p} ld.global.{ld} {v}, [{addr}];"));
        px.line(format!("st.shared.{ld} [{}+{}], {v};", c.dst, e * c.eb));
    }
}

/// The head of a pipelined `k` loop's copy: stage `kt + ahead` (u32 register), and a jump
/// to `skip` when it lies past the `nk` stages (the predicate is returned).
pub(super) fn next_stage(
    px: &mut Px,
    kt: &str,
    ahead: usize,
    nk: usize,
    skip: &str,
) -> (String, String) {
    let ktn = px.fresh("r");
    px.line(format!("add.u32 {ktn}, {kt}, {ahead};"));
    let none = px.fresh("p");
    px.line(format!("setp.ge.u32 {none}, {ktn}, {nk};"));
    px.line(format!("@{none} bra.uni {skip};"));
    (ktn, none)
}

/// The first `k` (i64 register) of stage `kt` (u32 register) of `bk` elements.
pub(super) fn stage_k0(px: &mut Px, kt: &str, bk: usize) -> String {
    let k0 = px.fresh("rd");
    px.line(format!("mul.wide.u32 {k0}, {kt}, {bk};"));
    k0
}

/// One operand of the SGEMM as [`SgSlot::new`] sets it up.
pub(super) struct SgSide<'a> {
    /// The slot runs along `k` (4 consecutive `k` of one row or column, stored transposed)
    /// rather than along the rows or columns (one `k`, 4 consecutive ones, one vector
    /// store).
    pub(super) k_major: bool,
    /// One 16-byte load per stage (contiguous, aligned, whole groups of 4) rather than 4.
    pub(super) vector: bool,
    /// The tile's first row (A) or column (B), and their count.
    pub(super) first: &'a str,
    pub(super) extent: usize,
    /// Element strides along rows or columns (A's `rs`, B's `cs`) and along `k`.
    pub(super) outer_stride: i64,
    pub(super) k_stride: i64,
    /// The operand's element base for this batch, its buffer's byte address, and the
    /// stage-relative byte offset of its tile in shared memory.
    pub(super) base: &'a str,
    pub(super) buf: &'a str,
    pub(super) shared: usize,
    /// Bytes from one stage to the next where the slot loads vectors and every stage lies
    /// inside `k` (`k` a multiple of the stage depth), so a stage needs no range check along
    /// `k` and no zeros: `None` otherwise, or where the step does not fit a u32.
    pub(super) stage_bytes: Option<u64>,
    /// A gathered operand (an implicit GEMM's): its elements come from the gather's
    /// expression (element by element, or a run at a time: `run`), rather than from
    /// `base` and the strides.
    pub(super) gather: Option<&'a Gather>,
    /// The side is A (the gather's row is the tile's row), not B.
    pub(super) a_side: bool,
    /// The gather reads runs of 4 f32 along the slot's 4 elements ([`super::runs`]), in a
    /// 16-byte aligned buffer: one vector load each.
    pub(super) run: Option<Run>,
}

/// A gathered slot's state: the gather, its side, the nodes that depend only on `k` (its
/// variable and the nodes), and for each row or column the slot reads element by element
/// (k-major or a run across them: one, else 4), that index clamped into range (a run's, to
/// the last run) and the gather's nodes that depend on it alone,
/// computed once before the `k` loop.
struct SgGather {
    g: Gather,
    a_side: bool,
    k_nodes: (Var, Vec<ExprId>),
    outers: Vec<(String, HashMap<ExprId, String>)>,
    /// The run and its buffer's byte address.
    run: Option<(Run, String)>,
}

/// The 4 elements of one operand a thread of the SGEMM moves per stage: rows or columns
/// `t/2`, `k` from `(t%2)*4` when `k_major`; `k` row `t/32`, rows or columns from
/// `(t%32)*4` otherwise.
pub(super) struct SgSlot {
    pub(super) k_major: bool,
    vector: bool,
    extent: usize,
    outer_stride: i64,
    pub(super) k_stride: i64,
    pub(super) buf: String,
    /// First global row or column, its range check (k-major: the slot's only one), the
    /// slot's first `k` in the stage, the element index at `k = 0`, and the shared offset.
    outer: String,
    pub(super) ok: String,
    kq: String,
    pub(super) base: String,
    st: String,
    /// Bytes between stages and the byte address of the slot's elements at stage 0, where
    /// every stage lies inside `k` (see [`SgSide::stage_bytes`]).
    staged: Option<(u64, String)>,
    gather: Option<SgGather>,
}

impl SgSlot {
    pub(super) fn new(px: &mut Px, t: &str, s: SgSide) -> Res<SgSlot> {
        let (x0, x1) = (px.fresh("r"), px.fresh("r"));
        let (outer, kq) = if s.k_major {
            px.line(format!("shr.u32 {x0}, {t}, 1;"));
            px.line(format!("and.b32 {x1}, {t}, 1;"));
            px.line(format!("shl.b32 {x1}, {x1}, 2;"));
            (x0, x1)
        } else {
            px.line(format!("shr.u32 {x0}, {t}, 5;"));
            px.line(format!("and.b32 {x1}, {t}, 31;"));
            px.line(format!("shl.b32 {x1}, {x1}, 2;"));
            (x1, x0)
        };
        let g = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {g}, {outer};"));
        px.line(format!("add.s64 {g}, {g}, {};", s.first));
        let ok = px.fresh("p");
        px.line(format!("setp.lt.s64 {ok}, {g}, {};", s.extent));
        let kq64 = px.fresh("rd");
        px.line(format!("cvt.u64.u32 {kq64}, {kq};"));
        let base = px.fresh("rd");
        px.line(format!(
            "mad.lo.s64 {base}, {g}, {}, {};",
            s.outer_stride, s.base
        ));
        px.line(format!(
            "mad.lo.s64 {base}, {kq64}, {}, {base};",
            s.k_stride
        ));
        let st = px.fresh("r");
        px.line(format!("mul.lo.u32 {st}, {kq}, {};", SG_STRIDE * 4));
        px.line(format!("mad.lo.u32 {st}, {outer}, 4, {st};"));
        if s.shared > 0 {
            px.line(format!("add.u32 {st}, {st}, {};", s.shared));
        }
        // A staged slot reads its row or column clamped into range: every load is then in
        // bounds and unconditional (a predicated load would keep the registers live across
        // the loop, past two blocks an SM), and rows or columns out of range only reach
        // products that are never stored.
        let staged = s.stage_bytes.map(|bytes| {
            let (gc, ptr) = (px.fresh("rd"), px.fresh("rd"));
            // The last row, or (a vector across rows or columns) the last whole vector.
            let width = if s.k_major { 1 } else { 4 };
            px.line(format!(
                "min.s64 {gc}, {g}, {};",
                s.extent.max(width) - width
            ));
            px.line(format!(
                "mad.lo.s64 {ptr}, {gc}, {}, {};",
                s.outer_stride, s.base
            ));
            px.line(format!("mad.lo.s64 {ptr}, {kq64}, {}, {ptr};", s.k_stride));
            px.line(format!("mad.lo.s64 {ptr}, {ptr}, 4, {};", s.buf));
            (bytes, ptr)
        });
        let gather = match s.gather {
            Some(gt) => {
                let (var, nodes) = px.fixed_nodes(Some(gt), s.a_side);
                let mut outers = Vec::new();
                // Element by element, each row or column; a run across them, its first
                // (clamped to the last run).
                let (count, last) = match (s.run.is_some(), s.k_major) {
                    (false, false) => (4, 1),
                    (true, false) => (1, 4),
                    (_, true) => (1, 1),
                };
                for e in 0..count {
                    let at = px.fresh("rd");
                    px.line(format!("add.s64 {at}, {g}, {e};"));
                    px.line(format!(
                        "min.s64 {at}, {at}, {};",
                        s.extent.saturating_sub(last)
                    ));
                    let cache = px.gather_fixed_part(&nodes, var, &at)?;
                    outers.push((at, cache));
                }
                let run = match s.run {
                    Some(r) => Some((r, operand_buffer(px, r.buf)?.0)),
                    None => None,
                };
                Some(SgGather {
                    g: gt.clone(),
                    a_side: s.a_side,
                    k_nodes: px.fixed_nodes(Some(gt), !s.a_side),
                    outers,
                    run,
                })
            }
            None => None,
        };
        Ok(SgSlot {
            k_major: s.k_major,
            vector: s.vector,
            extent: s.extent,
            outer_stride: s.outer_stride,
            k_stride: s.k_stride,
            buf: s.buf.to_string(),
            outer: g,
            ok,
            kq: kq64,
            base,
            st,
            staged,
            gather,
        })
    }

    /// Whether [`Self::load_stage`] applies (no range checks along `k`, no zeros).
    pub(super) fn staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Loads slice `slice` of stage `stage` (u32 register, a stage inside `k`) into `regs`:
    /// one address from the stage number, one vector load of the clamped row or column.
    pub(super) fn load_stage(&self, px: &mut Px, stage: &str, slice: usize, regs: &[String]) {
        let Some((bytes, ptr)) = &self.staged else {
            return;
        };
        let addr = px.fresh("rd");
        px.line(format!("mad.wide.u32 {addr}, {stage}, {bytes}, {ptr};"));
        let off = slice as i64 * SG_BK as i64 * self.k_stride * 4;
        px.line(format!(
            "ld.global.v4.f32 {{{}}}, [{addr}+{off}];",
            regs.join(", ")
        ));
    }

    /// Loads the stage starting at `k0` (i64 register) into `regs` (left as they are,
    /// zeros, out of range).
    pub(super) fn load(&self, px: &mut Px, k0: &str, kd: usize, regs: &[String]) -> Res<()> {
        if let Some(gs) = &self.gather {
            return self.load_gathered(px, gs, k0, kd, regs);
        }
        let (buf, ok) = (&self.buf, &self.ok);
        let kg = px.fresh("rd");
        px.line(format!("add.s64 {kg}, {k0}, {};", self.kq));
        let k_ok = if self.k_major {
            None
        } else {
            let p = px.fresh("p");
            px.line(format!("setp.lt.s64 {p}, {kg}, {kd};"));
            Some(p)
        };
        let idx = px.fresh("rd");
        px.line(format!(
            "mad.lo.s64 {idx}, {k0}, {}, {};",
            self.k_stride, self.base
        ));
        if self.vector {
            let p = px.fresh("p");
            match &k_ok {
                None => px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {ok};")),
                Some(pk) => px.line(format!("and.pred {p}, {pk}, {ok};")),
            }
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {idx}, 4, {buf};"));
            px.line(format!(
                "@{p} ld.global.v4.f32 {{{}}}, [{addr}];",
                regs.join(", ")
            ));
            return Ok(());
        }
        let step = if self.k_major {
            self.k_stride
        } else {
            self.outer_stride
        };
        for (e, r) in regs.iter().enumerate() {
            let (at, p) = (px.fresh("rd"), px.fresh("p"));
            match &k_ok {
                None => {
                    px.line(format!("add.s64 {at}, {kg}, {e};"));
                    px.line(format!("setp.lt.and.s64 {p}, {at}, {kd}, {ok};"));
                }
                Some(pk) => {
                    px.line(format!("add.s64 {at}, {}, {e};", self.outer));
                    px.line(format!("setp.lt.and.s64 {p}, {at}, {}, {pk};", self.extent));
                }
            }
            let addr = px.fresh("rd");
            px.line(format!("mad.lo.s64 {addr}, {e}, {step}, {idx};"));
            px.line(format!("mad.lo.s64 {addr}, {addr}, 4, {buf};"));
            px.line(format!("@{p} ld.global.f32 {r}, [{addr}];"));
        }
        Ok(())
    }

    /// [`Self::load`] of a gathered slot: each element is the gather's value at its row
    /// and column, both clamped into range (every load in bounds), and 0 out of range.
    /// Across rows or columns, what depends on the slot's one `k` alone (a window's tap
    /// and channel) is computed once for the 4 elements.
    fn load_gathered(
        &self,
        px: &mut Px,
        gs: &SgGather,
        k0: &str,
        kd: usize,
        regs: &[String],
    ) -> Res<()> {
        let kg = px.fresh("rd");
        px.line(format!("add.s64 {kg}, {k0}, {};", self.kq));
        if let Some((run, buf)) = &gs.run {
            return self.load_run(px, gs, (run, buf), &kg, kd, regs);
        }
        let last_k = kd.saturating_sub(1);
        // Across rows or columns: the slot's one `k`, clamped, its range test and the
        // gather's nodes that depend on it alone.
        let across = if self.k_major {
            None
        } else {
            let (kc, pk) = (px.fresh("rd"), px.fresh("p"));
            px.line(format!("setp.lt.s64 {pk}, {kg}, {kd};"));
            px.line(format!("min.s64 {kc}, {kg}, {last_k};"));
            let (var, nodes) = &gs.k_nodes;
            let c = px.gather_fixed_part(nodes, *var, &kc)?;
            Some((kc, pk, c))
        };
        for (e, r) in regs.iter().enumerate() {
            let p = px.fresh("p");
            let (outer, kv, cache) = match &across {
                None => {
                    let ke = px.fresh("rd");
                    px.line(format!("add.s64 {ke}, {kg}, {e};"));
                    px.line(format!("setp.lt.and.s64 {p}, {ke}, {kd}, {};", self.ok));
                    px.line(format!("min.s64 {ke}, {ke}, {last_k};"));
                    let (at, cache) = &gs.outers[0];
                    (at, ke, cache.clone())
                }
                Some((kc, pk, kcache)) => {
                    let at = px.fresh("rd");
                    px.line(format!("add.s64 {at}, {}, {e};", self.outer));
                    px.line(format!("setp.lt.and.s64 {p}, {at}, {}, {pk};", self.extent));
                    let (at, cache) = &gs.outers[e];
                    let mut cache = cache.clone();
                    for (id, reg) in kcache {
                        cache.entry(*id).or_insert_with(|| reg.clone());
                    }
                    (at, kc.clone(), cache)
                }
            };
            let v = if gs.a_side {
                px.gather(&gs.g, outer, &kv, &cache)?
            } else {
                px.gather(&gs.g, &kv, outer, &cache)?
            };
            px.line(format!("selp.f32 {r}, {v}, {}, {p};", f32_lit(0.0)));
        }
        Ok(())
    }

    /// [`Self::load_gathered`] of a slot whose 4 elements are one run: its index and
    /// padding test once, one vector load (`regs` hold zeros where it is skipped). Along
    /// `k` the slot's first `k` (from `kg`, a multiple of 4; `k` is whole runs) is clamped
    /// to the last run; across rows or columns, the slot's first one was ([`Self::new`]).
    fn load_run(
        &self,
        px: &mut Px,
        gs: &SgGather,
        (run, buf): (&Run, &str),
        kg: &str,
        kd: usize,
        regs: &[String],
    ) -> Res<()> {
        let (kc, p) = (px.fresh("rd"), px.fresh("p"));
        px.line(format!("setp.lt.and.s64 {p}, {kg}, {kd}, {};", self.ok));
        let last = if self.k_major { 4 } else { 1 };
        px.line(format!("min.s64 {kc}, {kg}, {};", kd.saturating_sub(last)));
        let (at, cache) = &gs.outers[0];
        let mut cache = cache.clone();
        if !self.k_major {
            let (var, nodes) = &gs.k_nodes;
            for (id, reg) in px.gather_fixed_part(nodes, *var, &kc)? {
                cache.entry(id).or_insert(reg);
            }
        }
        let coords = if gs.a_side {
            (at.as_str(), kc.as_str())
        } else {
            (kc.as_str(), at.as_str())
        };
        let mut roots = vec![run.index];
        roots.extend(run.guard);
        let vals = px.gather_nodes(&gs.g, &roots, coords, &cache)?;
        if let Some(guard) = vals.get(1) {
            px.line(format!("and.pred {p}, {p}, {guard};"));
        }
        let addr = px.fresh("rd");
        px.line(format!("mad.lo.s64 {addr}, {}, 4, {buf};", vals[0]));
        px.line(format!(
            "@{p} ld.global.v4.f32 {{{}}}, [{addr}];",
            regs.join(", ")
        ));
        Ok(())
    }

    /// Stores `regs` to the stage at shared address `stage`, `at` bytes in (the slice).
    pub(super) fn store(&self, px: &mut Px, stage: &str, at: usize, regs: &[String]) {
        let d = px.fresh("r");
        px.line(format!("add.u32 {d}, {stage}, {};", self.st));
        if self.k_major {
            for (e, r) in regs.iter().enumerate() {
                px.line(format!(
                    "st.shared.f32 [{d}+{}], {r};",
                    at + e * SG_STRIDE * 4
                ));
            }
        } else {
            let addr = if at > 0 { format!("{d}+{at}") } else { d };
            px.line(format!(
                "st.shared.v4.f32 [{addr}], {{{}}};",
                regs.join(", ")
            ));
        }
    }
}
