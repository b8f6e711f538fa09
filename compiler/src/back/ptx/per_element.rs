//! The per-element matmul: one output element per thread with an FMA loop over `k` (small
//! or thin matmuls, and batches beyond the grid's `z` limit).

use super::px::{f32_lit, Px};
use super::Res;
use crate::kernel::{Matmul, Var};

impl Px<'_> {
    /// The per-element matmul (fallback for small or huge-batch matmuls): one output
    /// element per thread (its domain variables already bound), an FMA loop over `k`,
    /// then the fused epilogue.
    pub(super) fn matmul_per_element(&mut self, mm: &Matmul) -> Res<()> {
        let nb = mm.batch.len();
        let acc = self.fresh("f");
        self.line(format!("mov.f32 {acc}, {};", f32_lit(0.0)));
        let mut abase = self.imm64(mm.a.base);
        let mut bbase = self.imm64(mm.b.base);
        for d in 0..nb {
            let v = self.vars.get(&(d as Var)).cloned().unwrap_or_default();
            let (sa, sb) = (mm.a.batch_strides[d], mm.b.batch_strides[d]);
            let na = self.fresh("rd");
            self.line(format!("mad.lo.s64 {na}, {v}, {sa}, {abase};"));
            abase = na;
            let nb2 = self.fresh("rd");
            self.line(format!("mad.lo.s64 {nb2}, {v}, {sb}, {bbase};"));
            bbase = nb2;
        }
        // The flattened row and column of this element.
        let flat = |px: &mut Self, first: usize, dims: &[usize]| -> String {
            let mut lin = px.vars.get(&(first as Var)).cloned().unwrap_or_default();
            for (q, &d) in dims.iter().enumerate().skip(1) {
                let v = px
                    .vars
                    .get(&((first + q) as Var))
                    .cloned()
                    .unwrap_or_default();
                let t = px.fresh("rd");
                px.line(format!("mad.lo.s64 {t}, {lin}, {d}, {v};"));
                lin = t;
            }
            lin
        };
        let i = flat(self, nb, &mm.rows);
        let j = flat(self, nb + mm.rows.len(), &mm.cols);
        let arow = self.fresh("rd");
        self.line(format!("mad.lo.s64 {arow}, {i}, {}, {abase};", mm.a.rs));
        let bcol = self.fresh("rd");
        self.line(format!("mad.lo.s64 {bcol}, {j}, {}, {bbase};", mm.b.cs));
        let (av_fixed, a_nodes) = self.fixed_nodes(mm.a.gather.as_ref(), true);
        let a_fixed = self.gather_fixed_part(&a_nodes, av_fixed, &i)?;
        let (bv_fixed, b_nodes) = self.fixed_nodes(mm.b.gather.as_ref(), false);
        let b_fixed = self.gather_fixed_part(&b_nodes, bv_fixed, &j)?;
        let l = self.open_loop("0", &mm.k.to_string());
        let av = match &mm.a.gather {
            Some(g) => self.gather(g, &i, &l.iv, &a_fixed)?,
            None => {
                let ai = self.fresh("rd");
                self.line(format!("mad.lo.s64 {ai}, {}, {}, {arow};", l.iv, mm.a.cs));
                let aa = self.address(mm.a.buf, mm.a.dtype, &ai)?;
                self.load(&aa, mm.a.dtype)
            }
        };
        let bv = match &mm.b.gather {
            Some(g) => self.gather(g, &l.iv, &j, &b_fixed)?,
            None => {
                let bi = self.fresh("rd");
                self.line(format!("mad.lo.s64 {bi}, {}, {}, {bcol};", l.iv, mm.b.rs));
                let ba = self.address(mm.b.buf, mm.b.dtype, &bi)?;
                self.load(&ba, mm.b.dtype)
            }
        };
        self.line(format!("fma.rn.f32 {acc}, {av}, {bv}, {acc};"));
        self.close_loop(l);
        self.acc = Some(acc);
        self.stores()?;
        Ok(())
    }
}
