//! Expression nodes to PTX: one register per node, emitted once in the loop of its innermost
//! variable; index arithmetic (64-bit, or 32-bit divisions where [`index_ranges`] bounds the
//! dividend), load trees and implicit-GEMM gathers.

use super::px::Px;
use super::Res;
use crate::ir::{BinaryOp, DType};
use crate::kernel::lower::reachable;
use crate::kernel::{ExprId, Gather, Kernel, VTy, Var, E};
use std::collections::HashMap;

/// Interval bounds of the pool's i64 nodes: variables span their loops (domain,
/// reduction and gather variables), and sums, products, divisions and remainders by
/// constants, clamps and selects follow. `None` where unknown or beyond 2^62.
pub(super) fn index_ranges(k: &Kernel) -> Vec<Option<(i64, i64)>> {
    let mut ext: HashMap<Var, usize> = HashMap::new();
    for (i, &d) in k.domain.iter().enumerate() {
        ext.insert(i as Var, d);
    }
    for e in &k.pool.nodes {
        if let E::Reduce { vars, .. } | E::ArgMax { vars, .. } = e {
            for &(v, n) in vars {
                ext.insert(v, n);
            }
        }
    }
    if let Some(mm) = &k.matmul {
        for (op, rows, cols) in [(&mm.a, mm.m, mm.k), (&mm.b, mm.k, mm.n)] {
            if let Some(g) = &op.gather {
                ext.insert(g.row, rows);
                ext.insert(g.col, cols);
            }
        }
    }
    const LIM: i128 = 1 << 62;
    let fit = |lo: i128, hi: i128| -> Option<(i64, i64)> {
        (lo >= -LIM && hi <= LIM).then_some((lo as i64, hi as i64))
    };
    let mut out: Vec<Option<(i64, i64)>> = Vec::with_capacity(k.pool.nodes.len());
    for (i, e) in k.pool.nodes.iter().enumerate() {
        let get = |x: &ExprId| out.get(x.0 as usize).copied().flatten();
        let r = if k.pool.ty(ExprId(i as u32)) != VTy::I64 {
            None
        } else {
            match e {
                E::Var(v) => ext.get(v).map(|&n| (0, n.saturating_sub(1) as i64)),
                E::Int(c) => Some((*c, *c)),
                E::Bin(op, a, b) => match (get(a), get(b), op) {
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Add) => {
                        fit(al as i128 + bl as i128, ah as i128 + bh as i128)
                    }
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Sub) => {
                        fit(al as i128 - bh as i128, ah as i128 - bl as i128)
                    }
                    (Some((al, ah)), Some((bl, bh)), BinaryOp::Mul) => {
                        let p = [
                            al as i128 * bl as i128,
                            al as i128 * bh as i128,
                            ah as i128 * bl as i128,
                            ah as i128 * bh as i128,
                        ];
                        let lo = p.iter().copied().min().unwrap_or(0);
                        let hi = p.iter().copied().max().unwrap_or(0);
                        fit(lo, hi)
                    }
                    (Some((al, ah)), Some((c, c2)), BinaryOp::Div) if c == c2 && c > 0 => {
                        Some((al / c, ah / c))
                    }
                    (Some((al, ah)), Some((c, c2)), BinaryOp::Rem) if c == c2 && c > 0 => {
                        if al >= 0 {
                            Some((0, ah.min(c - 1)))
                        } else {
                            Some((-(c - 1), c - 1))
                        }
                    }
                    _ => None,
                },
                E::IMin(a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.min(bl), ah.min(bh))),
                    _ => None,
                },
                E::IMax(a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.max(bl), ah.max(bh))),
                    _ => None,
                },
                E::Select(_, a, b) => match (get(a), get(b)) {
                    (Some((al, ah)), Some((bl, bh))) => Some((al.min(bl), ah.max(bh))),
                    _ => None,
                },
                _ => None,
            }
        };
        out.push(r);
    }
    out
}

impl Px<'_> {
    pub(super) fn emit(&mut self, e: ExprId) -> Res<String> {
        if let Some(r) = self.cache.get(&e) {
            return Ok(r.clone());
        }
        let node = self.k.pool.get(e).clone();
        let ty = self.k.pool.ty(e);
        let r = match node {
            E::Var(v) => self
                .vars
                .get(&v)
                .cloned()
                .ok_or_else(|| self.unsupported(format!("variable v{v} is not bound here")))?,
            E::Int(v) => self.imm64(v),
            E::F32(bits) => {
                let r = self.fresh("f");
                self.line(format!("mov.f32 {r}, 0f{bits:08X};"));
                r
            }
            E::I32(v) => {
                let r = self.fresh("r");
                self.line(format!("mov.s32 {r}, {v};"));
                r
            }
            E::Bool(v) => {
                let t = self.fresh("r");
                self.line(format!("mov.u32 {t}, {};", u32::from(v)));
                let p = self.fresh("p");
                self.line(format!("setp.ne.u32 {p}, {t}, 0;"));
                p
            }
            E::Acc => self
                .acc
                .clone()
                .ok_or_else(|| self.unsupported("accumulator outside a matmul"))?,
            E::Load { buf, dtype, index } => {
                let i = self.emit(index)?;
                let a = self.address(buf, dtype, &i)?;
                self.load(&a, dtype)
            }
            E::Un(op, a) => {
                let x = self.emit(a)?;
                self.unary(op, self.k.pool.ty(a), &x)?
            }
            E::Bin(op @ (BinaryOp::Div | BinaryOp::Rem), a, b)
                if self.narrow_divisor(a, b).is_some() =>
            {
                // A non-negative index below 2^31 over a positive constant: 32-bit
                // division (a 64-bit one is a long subroutine).
                let c = self.narrow_divisor(a, b).unwrap_or(1);
                let x = self.emit(a)?;
                let (x32, q) = (self.fresh("r"), self.fresh("r"));
                self.line(format!("cvt.u32.u64 {x32}, {x};"));
                let ins = if op == BinaryOp::Div { "div" } else { "rem" };
                self.line(format!("{ins}.u32 {q}, {x32}, {c};"));
                let r = self.fresh("rd");
                self.line(format!("cvt.u64.u32 {r}, {q};"));
                r
            }
            E::Bin(op, a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                self.binary(op, self.k.pool.ty(a), &x, &y)?
            }
            E::IMin(a, b) | E::IMax(a, b) => {
                let x = self.emit(a)?;
                let y = self.emit(b)?;
                let r = self.fresh("rd");
                let op = if matches!(node, E::IMin(..)) {
                    "min"
                } else {
                    "max"
                };
                self.line(format!("{op}.s64 {r}, {x}, {y};"));
                r
            }
            E::Select(c, a, b) => match self.load_tree(e) {
                // One load from the chosen address, not a load of every arm.
                Some(dtype) => {
                    let addr = self.tree_address(e)?;
                    self.load(&addr, dtype)
                }
                None => {
                    let cv = self.emit(c)?;
                    let x = self.emit(a)?;
                    let y = self.emit(b)?;
                    self.select(ty, &cv, &x, &y)
                }
            },
            E::Cast(to, a) => {
                let x = self.emit(a)?;
                self.cast(self.k.pool.ty(a), to, &x)
            }
            E::Round(d, a) => {
                let x = self.emit(a)?;
                let t = if d == DType::F16 { "f16" } else { "bf16" };
                let h = self.fresh("h");
                self.line(format!("cvt.rn.{t}.f32 {h}, {x};"));
                let r = self.fresh("f");
                self.line(format!("cvt.f32.{t} {r}, {h};"));
                r
            }
            E::Uniform { seed, index } => {
                let i = self.emit(index)?;
                self.uniform(seed, &i)
            }
            E::Reduce { op, vars, body } if self.block_reductions.contains(&e) => {
                self.block_reduce(op, &vars, body, ty)?
            }
            E::Reduce { op, vars, body } => self.reduce(op, &vars, body, ty)?,
            E::ArgMax { vars, body } => self.argmax(&vars, body)?,
        };
        self.remember(e, r.clone());
        Ok(r)
    }

    /// The element type of a select tree over loads not yet made (`select(c, load, select(c2,
    /// load, load))`: a concat reading its pieces), whose leaves all have that type.
    pub(super) fn load_tree(&self, e: ExprId) -> Option<DType> {
        if self.cache.contains_key(&e) {
            return None;
        }
        match *self.k.pool.get(e) {
            E::Load { dtype, .. } => Some(dtype),
            E::Select(_, a, b) => {
                let d = self.load_tree(a)?;
                (self.load_tree(b)? == d).then_some(d)
            }
            _ => None,
        }
    }

    /// The byte address a load tree ([`Self::load_tree`]) reads: each select picks between
    /// its arms' addresses (every leaf's index is in range wherever the kernel runs, as when
    /// every arm was loaded).
    pub(super) fn tree_address(&mut self, e: ExprId) -> Res<String> {
        match *self.k.pool.get(e) {
            E::Load { buf, dtype, index } => {
                let i = self.emit(index)?;
                self.address(buf, dtype, &i)
            }
            E::Select(c, a, b) => {
                let cv = self.emit(c)?;
                let x = self.tree_address(a)?;
                let y = self.tree_address(b)?;
                Ok(self.select(VTy::I64, &cv, &x, &y))
            }
            _ => Err(self.unsupported("a select over something other than loads")),
        }
    }

    /// The constant divisor of `a / b` (or `a % b`) when both fit 32-bit unsigned
    /// arithmetic: `b` a positive constant, `a` known to lie in `[0, 2^31)`.
    fn narrow_divisor(&self, a: ExprId, b: ExprId) -> Option<i64> {
        if self.k.pool.ty(a) != VTy::I64 {
            return None;
        }
        let c = match self.k.pool.get(b) {
            E::Int(c) if *c > 0 && *c < 1 << 31 => *c,
            _ => return None,
        };
        match self.ranges.get(a.0 as usize).copied().flatten() {
            Some((lo, hi)) if lo >= 0 && hi < 1 << 31 => Some(c),
            _ => None,
        }
    }

    /// An operand element of an implicit GEMM: the gather's value with its row and column
    /// bound (`cache`: nodes already computed for this row, kept by the caller).
    pub(super) fn gather(
        &mut self,
        g: &Gather,
        row: &str,
        col: &str,
        cache: &HashMap<ExprId, String>,
    ) -> Res<String> {
        let mut v = self.gather_nodes(g, &[g.value], (row, col), cache)?;
        v.pop()
            .ok_or_else(|| self.unsupported("a gather without a value"))
    }

    /// Nodes `roots` of a gather's expression (a run's index and padding test) with its
    /// row and column bound, as [`Self::gather`] computes its value.
    pub(super) fn gather_nodes(
        &mut self,
        g: &Gather,
        roots: &[ExprId],
        (row, col): (&str, &str),
        cache: &HashMap<ExprId, String>,
    ) -> Res<Vec<String>> {
        let saved = std::mem::replace(&mut self.cache, cache.clone());
        self.vars.insert(g.row, row.to_string());
        self.vars.insert(g.col, col.to_string());
        let out = roots.iter().map(|&e| self.emit(e)).collect();
        self.cache = saved;
        out
    }

    /// `nodes` (a gather's nodes that depend only on its variable `fixed`, from
    /// [`fixed_nodes`]) computed for `fixed = at`: the cache [`Self::gather`] starts from
    /// while `fixed` keeps that value (a tile row's coordinates, hoisted out of the `k`
    /// loop).
    pub(super) fn gather_fixed_part(
        &mut self,
        nodes: &[ExprId],
        fixed: Var,
        at: &str,
    ) -> Res<HashMap<ExprId, String>> {
        let saved = self.cache.clone();
        if nodes.is_empty() {
            return Ok(saved);
        }
        self.vars.insert(fixed, at.to_string());
        for &e in nodes {
            self.emit(e)?;
        }
        Ok(std::mem::replace(&mut self.cache, saved))
    }

    /// A gathered operand's nodes that depend only on `fixed` (its row for A, its column
    /// for B), for [`Self::gather_fixed_part`]; empty for a strided operand.
    pub(super) fn fixed_nodes(&self, g: Option<&Gather>, a_side: bool) -> (Var, Vec<ExprId>) {
        let Some(g) = g else {
            return (0, Vec::new());
        };
        let fixed = if a_side { g.row } else { g.col };
        let free = crate::kernel::lower::free_vars(&self.k.pool);
        let nodes = reachable(&self.k.pool, &[g.value])
            .into_iter()
            .filter(|e| {
                let f = &free[e.0 as usize];
                !f.is_empty() && f.iter().all(|&v| v == fixed)
            })
            .collect();
        (fixed, nodes)
    }

    fn select(&mut self, ty: VTy, c: &str, a: &str, b: &str) -> String {
        let r = self.reg(ty);
        match ty {
            VTy::Bool => {
                let t1 = self.fresh("p");
                let nc = self.fresh("p");
                let t2 = self.fresh("p");
                self.line(format!("and.pred {t1}, {c}, {a};"));
                self.line(format!("not.pred {nc}, {c};"));
                self.line(format!("and.pred {t2}, {nc}, {b};"));
                self.line(format!("or.pred {r}, {t1}, {t2};"));
            }
            VTy::F32 => self.line(format!("selp.f32 {r}, {a}, {b}, {c};")),
            VTy::I32 => self.line(format!("selp.b32 {r}, {a}, {b}, {c};")),
            VTy::I64 => self.line(format!("selp.b64 {r}, {a}, {b}, {c};")),
        }
        r
    }
}
