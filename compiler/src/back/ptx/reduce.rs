//! Reductions: loops inside the thread, shared among a block's (or a warp's) threads with
//! shuffles and shared memory, and `argmax`.

use super::px::{f32_lit, LoopCtx, Px};
use super::{Res, BLOCK, WARP};
use crate::kernel::lower::reachable;
use crate::kernel::{ExprId, Red, VTy, Var};

impl Px<'_> {
    fn reduction_loops(&mut self, vars: &[(Var, usize)], body: ExprId) -> Res<Vec<LoopCtx>> {
        let mut open = Vec::new();
        for &(v, ext) in vars {
            let l = self.open_loop("0", &ext.to_string());
            self.vars.insert(v, l.iv.clone());
            let sub = reachable(&self.k.pool, &[body]);
            for e in sub {
                if self.site[e.0 as usize] == Some(v) {
                    self.emit(e)?;
                }
            }
            open.push(l);
        }
        Ok(open)
    }

    pub(super) fn reduce(
        &mut self,
        op: Red,
        vars: &[(Var, usize)],
        body: ExprId,
        ty: VTy,
    ) -> Res<String> {
        let acc = self.reg(ty);
        match (op, ty) {
            (Red::Sum, VTy::F32) => self.line(format!("mov.f32 {acc}, {};", f32_lit(0.0))),
            (Red::Max, VTy::F32) => {
                self.line(format!("mov.f32 {acc}, {};", f32_lit(f32::NEG_INFINITY)))
            }
            (Red::Min, VTy::F32) => {
                self.line(format!("mov.f32 {acc}, {};", f32_lit(f32::INFINITY)))
            }
            (Red::Sum, VTy::I32) => self.line(format!("mov.s32 {acc}, 0;")),
            (Red::Max, VTy::I32) => self.line(format!("mov.s32 {acc}, {};", i32::MIN)),
            (Red::Min, VTy::I32) => self.line(format!("mov.s32 {acc}, {};", i32::MAX)),
            (Red::Sum, VTy::I64) => self.line(format!("mov.s64 {acc}, 0;")),
            _ => return Err(self.unsupported(format!("{} over {}", op.name(), ty.name()))),
        }
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let t = match ty {
            VTy::F32 => "f32",
            VTy::I32 => "s32",
            _ => "s64",
        };
        match (op, ty) {
            (Red::Sum, _) => self.line(format!("add.{t} {acc}, {acc}, {x};")),
            (Red::Max, VTy::F32) => self.line(format!("max.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Min, VTy::F32) => self.line(format!("min.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Max, _) => self.line(format!("max.{t} {acc}, {acc}, {x};")),
            (Red::Min, _) => self.line(format!("min.{t} {acc}, {acc}, {x};")),
        }
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(acc)
    }

    /// A reduction computed by all threads of the block: each takes every `BLOCK`-th point
    /// of the flattened range, then the partial results meet through warp shuffles and
    /// shared memory; every thread gets the result.
    pub(super) fn block_reduce(
        &mut self,
        op: Red,
        vars: &[(Var, usize)],
        body: ExprId,
        ty: VTy,
    ) -> Res<String> {
        let (t, init) = match (op, ty) {
            (Red::Sum, VTy::F32) => ("f32", f32_lit(0.0)),
            (Red::Max, VTy::F32) => ("f32", f32_lit(f32::NEG_INFINITY)),
            (Red::Min, VTy::F32) => ("f32", f32_lit(f32::INFINITY)),
            (Red::Sum, VTy::I32) => ("s32", "0".to_string()),
            (Red::Max, VTy::I32) => ("s32", i32::MIN.to_string()),
            (Red::Min, VTy::I32) => ("s32", i32::MAX.to_string()),
            _ => return Err(self.unsupported(format!("block {} over {}", op.name(), ty.name()))),
        };
        let combine = |px: &mut Self, acc: &str, x: &str| match (op, t) {
            (Red::Sum, _) => px.line(format!("add.{t} {acc}, {acc}, {x};")),
            (Red::Max, "f32") => px.line(format!("max.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Min, "f32") => px.line(format!("min.NaN.f32 {acc}, {acc}, {x};")),
            (Red::Max, _) => px.line(format!("max.{t} {acc}, {acc}, {x};")),
            (Red::Min, _) => px.line(format!("min.{t} {acc}, {acc}, {x};")),
        };
        let acc = self.reg(ty);
        self.line(format!(
            "mov.{} {acc}, {init};",
            if t == "f32" { "f32" } else { "s32" }
        ));
        let tid = self.tid.clone();
        let group = self.group;
        let last = vars.last().map_or(1, |v| v.1);
        // The group's threads stride over the innermost variable when it is long enough
        // (the outer ones are serial loops: no division per element); otherwise over the
        // flattened range, split with 32-bit division.
        let split = if last >= group as usize || vars.len() == 1 {
            vars.len().saturating_sub(1)
        } else {
            0
        };
        let (serial, strided) = (&vars[..split], vars[split..].to_vec());
        let mut outer = Vec::new();
        for &(v, ext) in serial {
            let l = self.open_loop("0", &ext.to_string());
            self.vars.insert(v, l.iv.clone());
            outer.push(l);
        }
        let n: usize = strided.iter().map(|v| v.1).product();
        if n > u32::MAX as usize - group as usize {
            return Err(self.unsupported("a block reduction over more than 2^32 points"));
        }
        // for (lin = tid; lin < n; lin += group·unroll): the copies' terms first, then
        // their sum in the order of the points (the same as one copy a trip).
        let lin = self.fresh("r");
        let head = self.label("bhead");
        let exit = self.label("bexit");
        self.line(format!("mov.u32 {lin}, {tid};"));
        self.body.push_str(&format!("{head}:\n"));
        let p = self.fresh("p");
        self.line(format!("setp.ge.u32 {p}, {lin}, {n};"));
        self.line(format!("@{p} bra {exit};"));
        let unroll = Self::unroll(n, group);
        let mut terms = Vec::with_capacity(unroll);
        for u in 0..unroll {
            terms.push(self.loop_copy(&lin, (u, group), &strided, |px| px.emit(body))?);
        }
        for x in &terms {
            combine(self, &acc, x);
        }
        self.line(format!(
            "add.u32 {lin}, {lin}, {};",
            group as usize * unroll
        ));
        self.line(format!("bra.uni {head};"));
        self.body.push_str(&format!("{exit}:\n"));
        while let Some(l) = outer.pop() {
            self.close_loop(l);
        }
        // Warp, then block.
        let other = self.reg(ty);
        if group == WARP {
            // One warp a point: a butterfly leaves the result in every lane.
            for off in [16, 8, 4, 2, 1] {
                self.line(format!("shfl.sync.bfly.b32 {other}, {acc}, {off}, 31, -1;"));
                combine(self, &acc, &other);
            }
            return Ok(acc);
        }
        let warp_reduce = |px: &mut Self, acc: &str, other: &str| {
            for off in [16, 8, 4, 2, 1] {
                px.line(format!("shfl.sync.down.b32 {other}, {acc}, {off}, 31, -1;"));
                combine(px, acc, other);
            }
        };
        warp_reduce(self, &acc, &other);
        let lane = self.fresh("r");
        let warp = self.fresh("r");
        self.line(format!("and.b32 {lane}, {tid}, 31;"));
        self.line(format!("shr.u32 {warp}, {tid}, 5;"));
        let addr = self.fresh("r");
        let pl = self.fresh("p");
        self.line("bar.sync 0;");
        self.line(format!("setp.eq.u32 {pl}, {lane}, 0;"));
        self.line(format!("mov.u32 {addr}, red_smem;"));
        let wa = self.fresh("r");
        self.line(format!("mad.lo.u32 {wa}, {warp}, 4, {addr};"));
        self.line(format!("@{pl} st.shared.b32 [{wa}], {acc};"));
        self.line("bar.sync 0;");
        let la = self.fresh("r");
        self.line(format!("mad.lo.u32 {la}, {lane}, 4, {addr};"));
        let pw = self.fresh("p");
        self.line(format!("setp.lt.u32 {pw}, {lane}, {};", BLOCK / 32));
        self.line(format!("mov.b32 {acc}, {init};"));
        self.line(format!("@{pw} ld.shared.b32 {acc}, [{la}];"));
        warp_reduce(self, &acc, &other);
        let p0 = self.fresh("p");
        self.line(format!("setp.eq.u32 {p0}, {tid}, 0;"));
        self.line(format!("@{p0} st.shared.b32 [{addr}], {acc};"));
        self.line("bar.sync 0;");
        self.line(format!("ld.shared.b32 {acc}, [{addr}];"));
        self.line("bar.sync 0;");
        Ok(acc)
    }

    pub(super) fn argmax(&mut self, vars: &[(Var, usize)], body: ExprId) -> Res<String> {
        let ty = self.k.pool.ty(body);
        let best = self.reg(ty);
        let besti = self.fresh("rd");
        let count = self.fresh("rd");
        match ty {
            VTy::F32 => self.line(format!("mov.f32 {best}, {};", f32_lit(f32::NEG_INFINITY))),
            VTy::I32 => self.line(format!("mov.s32 {best}, {};", i32::MIN)),
            _ => return Err(self.unsupported("argmax over bool")),
        }
        self.line(format!("mov.s64 {besti}, 0;"));
        self.line(format!("mov.s64 {count}, 0;"));
        let open = self.reduction_loops(vars, body)?;
        let x = self.emit(body)?;
        let better = self.fresh("p");
        let first = self.fresh("p");
        self.line(format!("setp.eq.s64 {first}, {count}, 0;"));
        match ty {
            VTy::F32 => {
                let gt = self.fresh("p");
                let xn = self.fresh("p");
                let bn = self.fresh("p");
                self.line(format!("setp.gt.f32 {gt}, {x}, {best};"));
                self.line(format!("setp.nan.f32 {xn}, {x}, {x};"));
                self.line(format!("setp.num.f32 {bn}, {best}, {best};"));
                self.line(format!("and.pred {xn}, {xn}, {bn};"));
                self.line(format!("or.pred {better}, {gt}, {xn};"));
            }
            _ => self.line(format!("setp.gt.s32 {better}, {x}, {best};")),
        }
        self.line(format!("or.pred {better}, {better}, {first};"));
        let sel = if ty == VTy::F32 { "f32" } else { "b32" };
        self.line(format!("selp.{sel} {best}, {x}, {best}, {better};"));
        self.line(format!("selp.b64 {besti}, {count}, {besti}, {better};"));
        self.line(format!("add.s64 {count}, {count}, 1;"));
        for l in open.into_iter().rev() {
            self.close_loop(l);
        }
        Ok(besti)
    }
}
