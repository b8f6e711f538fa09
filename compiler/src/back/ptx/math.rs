//! Scalar operations: the RNG's uniform draw, `exp`, `tanh`, `erf`, the other unary and
//! binary operators, floor division and casts.

use super::px::{f32_lit, Px};
use super::Res;
use crate::ir::{BinaryOp, UnaryOp};
use crate::kernel::VTy;

impl Px<'_> {
    pub(super) fn uniform(&mut self, seed: u64, i: &str) -> String {
        let s0 = crate::rng::splitmix64(seed ^ 0xD1B5_4A32_D192_ED03);
        let z = self.fresh("rd");
        self.line(format!("add.u64 {z}, {i}, 0x{s0:016X};"));
        self.line(format!(
            "add.u64 {z}, {z}, 0x{:016X};",
            0x9E37_79B9_7F4A_7C15u64
        ));
        let t = self.fresh("rd");
        for (sh, mul) in [
            (30, Some(0xBF58_476D_1CE4_E5B9u64)),
            (27, Some(0x94D0_49BB_1331_11EBu64)),
            (31, None),
        ] {
            self.line(format!("shr.u64 {t}, {z}, {sh};"));
            self.line(format!("xor.b64 {z}, {z}, {t};"));
            if let Some(m) = mul {
                self.line(format!("mul.lo.u64 {z}, {z}, 0x{m:016X};"));
            }
        }
        self.line(format!("shr.u64 {z}, {z}, 40;"));
        let f = self.fresh("f");
        self.line(format!("cvt.rn.f32.u64 {f}, {z};"));
        self.line(format!(
            "mul.f32 {f}, {f}, {};",
            f32_lit(1.0 / (1u64 << 24) as f32)
        ));
        f
    }

    pub(super) fn exp(&mut self, x: &str) -> String {
        let t = self.fresh("f");
        self.line(format!(
            "mul.f32 {t}, {x}, {};",
            f32_lit(std::f32::consts::LOG2_E)
        ));
        let r = self.fresh("f");
        self.line(format!("ex2.approx.f32 {r}, {t};"));
        r
    }

    fn tanh(&mut self, x: &str) -> String {
        let a = self.fresh("f");
        self.line(format!("abs.f32 {a}, {x};"));
        let x2 = self.fresh("f");
        self.line(format!("mul.f32 {x2}, {x}, {x};"));
        let p = self.fresh("f");
        self.line(format!(
            "mov.f32 {p}, {};",
            f32_lit((62.0f64 / 2835.0) as f32)
        ));
        for c in [-17.0f64 / 315.0, 2.0 / 15.0, -1.0 / 3.0] {
            self.line(format!("fma.rn.f32 {p}, {p}, {x2}, {};", f32_lit(c as f32)));
        }
        let small = self.fresh("f");
        self.line(format!("mul.f32 {small}, {x2}, {p};"));
        self.line(format!("fma.rn.f32 {small}, {small}, {x}, {x};"));
        let ac = self.fresh("f");
        self.line(format!("min.f32 {ac}, {a}, {};", f32_lit(9.0)));
        self.line(format!("add.f32 {ac}, {ac}, {ac};"));
        let e = self.exp(&ac);
        let big = self.fresh("f");
        self.line(format!("add.f32 {big}, {e}, {};", f32_lit(1.0)));
        // Branch-free reciprocals here and in the activations below (`rcp.approx`, about
        // 1 ulp): `div.rn` carries a slow path per element, which keeps ptxas from
        // interleaving elements in a product's epilogue (gpt's gelu backward ran at a
        // third of its matmul's speed).
        self.line(format!("rcp.approx.ftz.f32 {big}, {big};"));
        self.line(format!("add.f32 {big}, {big}, {big};"));
        self.line(format!("sub.f32 {big}, {}, {big};", f32_lit(1.0)));
        self.line(format!("copysign.f32 {big}, {x}, {big};"));
        let p2 = self.fresh("p");
        self.line(format!("setp.lt.f32 {p2}, {a}, {};", f32_lit(0.3)));
        let r = self.fresh("f");
        self.line(format!("selp.f32 {r}, {small}, {big}, {p2};"));
        r
    }

    fn erf(&mut self, x: &str) -> String {
        // Abramowitz & Stegun 7.1.26.
        let a = self.fresh("f");
        self.line(format!("abs.f32 {a}, {x};"));
        let t = self.fresh("f");
        self.line(format!(
            "fma.rn.f32 {t}, {a}, {}, {};",
            f32_lit(0.327_591_1),
            f32_lit(1.0)
        ));
        self.line(format!("rcp.rn.f32 {t}, {t};"));
        let p = self.fresh("f");
        self.line(format!("mov.f32 {p}, {};", f32_lit(1.061_405_4)));
        for c in [-1.453_152_1f32, 1.421_413_7, -0.284_496_72, 0.254_829_6] {
            self.line(format!("fma.rn.f32 {p}, {p}, {t}, {};", f32_lit(c)));
        }
        self.line(format!("mul.f32 {p}, {p}, {t};"));
        let na2 = self.fresh("f");
        self.line(format!("mul.f32 {na2}, {a}, {a};"));
        self.line(format!("neg.f32 {na2}, {na2};"));
        let e = self.exp(&na2);
        let r = self.fresh("f");
        self.line(format!("mul.f32 {r}, {p}, {e};"));
        self.line(format!("sub.f32 {r}, {}, {r};", f32_lit(1.0)));
        self.line(format!("copysign.f32 {r}, {x}, {r};"));
        r
    }

    pub(super) fn unary(&mut self, op: UnaryOp, ty: VTy, x: &str) -> Res<String> {
        match ty {
            VTy::F32 => {
                let r = self.fresh("f");
                match op {
                    UnaryOp::Neg => self.line(format!("neg.f32 {r}, {x};")),
                    UnaryOp::Abs => self.line(format!("abs.f32 {r}, {x};")),
                    UnaryOp::Exp => return Ok(self.exp(x)),
                    UnaryOp::Log => {
                        self.line(format!("lg2.approx.f32 {r}, {x};"));
                        self.line(format!(
                            "mul.f32 {r}, {r}, {};",
                            f32_lit(std::f32::consts::LN_2)
                        ));
                    }
                    UnaryOp::Sqrt => self.line(format!("sqrt.rn.f32 {r}, {x};")),
                    UnaryOp::Rsqrt => {
                        self.line(format!("sqrt.rn.f32 {r}, {x};"));
                        self.line(format!("rcp.rn.f32 {r}, {r};"));
                    }
                    UnaryOp::Recip => self.line(format!("rcp.rn.f32 {r}, {x};")),
                    UnaryOp::Tanh => return Ok(self.tanh(x)),
                    UnaryOp::Sigmoid | UnaryOp::Silu => {
                        let n = self.fresh("f");
                        self.line(format!("neg.f32 {n}, {x};"));
                        let e = self.exp(&n);
                        self.line(format!("add.f32 {r}, {e}, {};", f32_lit(1.0)));
                        let num = if op == UnaryOp::Silu {
                            x.to_string()
                        } else {
                            f32_lit(1.0)
                        };
                        self.line(format!("rcp.approx.ftz.f32 {r}, {r};"));
                        self.line(format!("mul.f32 {r}, {r}, {num};"));
                    }
                    UnaryOp::Relu => {
                        let p = self.fresh("p");
                        self.line(format!("setp.gt.f32 {p}, {x}, {};", f32_lit(0.0)));
                        self.line(format!("selp.f32 {r}, {x}, {}, {p};", f32_lit(0.0)));
                    }
                    UnaryOp::Gelu => {
                        let c = (2.0f64 / std::f64::consts::PI).sqrt() as f32;
                        let t = self.fresh("f");
                        self.line(format!("mul.f32 {t}, {x}, {x};"));
                        self.line(format!("mul.f32 {t}, {t}, {x};"));
                        self.line(format!("fma.rn.f32 {t}, {t}, {}, {x};", f32_lit(0.044715)));
                        self.line(format!("mul.f32 {t}, {t}, {};", f32_lit(c)));
                        let th = self.tanh(&t);
                        self.line(format!("add.f32 {r}, {th}, {};", f32_lit(1.0)));
                        self.line(format!("mul.f32 {r}, {r}, {x};"));
                        self.line(format!("mul.f32 {r}, {r}, {};", f32_lit(0.5)));
                    }
                    UnaryOp::GeluGrad => {
                        // s (1 + 2 x (e s) u'), e = e^{-2u}, s = 1 / (1 + e),
                        // u' = c (1 + 3 a x^2) (the CPU's formula), at x clamped to [-9, 9]
                        // (NaN stays NaN): gelu' is 1 in f32 above 9 and below 1e-26 in size
                        // under -9, where `x u'` would otherwise outgrow `s`.
                        let c = (2.0f64 / std::f64::consts::PI).sqrt();
                        let xc = self.fresh("f");
                        self.line(format!("max.NaN.f32 {xc}, {x}, {};", f32_lit(-9.0)));
                        self.line(format!("min.NaN.f32 {xc}, {xc}, {};", f32_lit(9.0)));
                        let x = xc.as_str();
                        let x2 = self.fresh("f");
                        self.line(format!("mul.f32 {x2}, {x}, {x};"));
                        let v = self.fresh("f");
                        self.line(format!(
                            "fma.rn.f32 {v}, {x2}, {}, {};",
                            f32_lit((-2.0 * c * 0.044715) as f32),
                            f32_lit((-2.0 * c) as f32)
                        ));
                        self.line(format!("mul.f32 {v}, {v}, {x};"));
                        let e = self.exp(&v);
                        let s = self.fresh("f");
                        self.line(format!("add.f32 {s}, {e}, {};", f32_lit(1.0)));
                        self.line(format!("rcp.approx.ftz.f32 {s}, {s};"));
                        let du = self.fresh("f");
                        self.line(format!(
                            "fma.rn.f32 {du}, {x2}, {}, {};",
                            f32_lit((3.0 * c * 0.044715) as f32),
                            f32_lit(c as f32)
                        ));
                        self.line(format!("mul.f32 {r}, {e}, {s};"));
                        self.line(format!("mul.f32 {r}, {r}, {x};"));
                        self.line(format!("mul.f32 {r}, {r}, {du};"));
                        self.line(format!(
                            "fma.rn.f32 {r}, {r}, {}, {};",
                            f32_lit(2.0),
                            f32_lit(1.0)
                        ));
                        self.line(format!("mul.f32 {r}, {r}, {s};"));
                    }
                    UnaryOp::Sin => self.line(format!("sin.approx.f32 {r}, {x};")),
                    UnaryOp::Cos => self.line(format!("cos.approx.f32 {r}, {x};")),
                    UnaryOp::Erf => return Ok(self.erf(x)),
                    UnaryOp::Not => return Err(self.unsupported("`not` of a float")),
                }
                Ok(r)
            }
            VTy::I32 | VTy::I64 => {
                let t = if ty == VTy::I32 { "s32" } else { "s64" };
                let r = self.reg(ty);
                match op {
                    UnaryOp::Neg => self.line(format!("neg.{t} {r}, {x};")),
                    UnaryOp::Abs => self.line(format!("abs.{t} {r}, {x};")),
                    UnaryOp::Relu => self.line(format!("max.{t} {r}, {x}, 0;")),
                    _ => return Err(self.unsupported(format!("{} of an integer", op.name()))),
                }
                Ok(r)
            }
            VTy::Bool => match op {
                UnaryOp::Not => {
                    let r = self.fresh("p");
                    self.line(format!("not.pred {r}, {x};"));
                    Ok(r)
                }
                _ => Err(self.unsupported(format!("{} of a bool", op.name()))),
            },
        }
    }

    pub(super) fn binary(&mut self, op: BinaryOp, ty: VTy, x: &str, y: &str) -> Res<String> {
        use BinaryOp as B;
        let cmp = |op: BinaryOp, float: bool| -> &'static str {
            match (op, float) {
                (B::Eq, _) => "eq",
                (B::Ne, true) => "neu",
                (B::Ne, false) => "ne",
                (B::Lt, _) => "lt",
                (B::Le, _) => "le",
                (B::Gt, _) => "gt",
                _ => "ge",
            }
        };
        if op.is_comparison() && ty != VTy::Bool {
            let p = self.fresh("p");
            let t = match ty {
                VTy::F32 => "f32",
                VTy::I32 => "s32",
                _ => "s64",
            };
            self.line(format!(
                "setp.{}.{t} {p}, {x}, {y};",
                cmp(op, ty == VTy::F32)
            ));
            return Ok(p);
        }
        match ty {
            VTy::F32 => {
                let r = self.fresh("f");
                match op {
                    B::Add => self.line(format!("add.f32 {r}, {x}, {y};")),
                    B::Sub => self.line(format!("sub.f32 {r}, {x}, {y};")),
                    B::Mul => self.line(format!("mul.f32 {r}, {x}, {y};")),
                    B::Div => self.line(format!("div.rn.f32 {r}, {x}, {y};")),
                    B::Rem => {
                        let q = self.fresh("f");
                        self.line(format!("div.rn.f32 {q}, {x}, {y};"));
                        self.line(format!("cvt.rmi.f32.f32 {q}, {q};"));
                        self.line(format!("mul.f32 {q}, {q}, {y};"));
                        self.line(format!("sub.f32 {r}, {x}, {q};"));
                    }
                    B::Pow => {
                        // C's powf: |x|^y as 2^(y·log2|x|), negated for a negative x and an
                        // odd integer y, NaN for a negative x and a non-integer y, 1 where y
                        // is 0 or x is 1.
                        let (ax, l, t, h, nr) = (
                            self.fresh("f"),
                            self.fresh("f"),
                            self.fresh("f"),
                            self.fresh("f"),
                            self.fresh("f"),
                        );
                        let (int, odd, neg, flip, nan, one) = (
                            self.fresh("p"),
                            self.fresh("p"),
                            self.fresh("p"),
                            self.fresh("p"),
                            self.fresh("p"),
                            self.fresh("p"),
                        );
                        let zero = f32_lit(0.0);
                        self.line(format!("abs.f32 {ax}, {x};"));
                        self.line(format!("lg2.approx.f32 {l}, {ax};"));
                        self.line(format!("mul.f32 {l}, {l}, {y};"));
                        self.line(format!("ex2.approx.f32 {r}, {l};"));
                        self.line(format!("cvt.rzi.f32.f32 {t}, {y};"));
                        self.line(format!("setp.eq.f32 {int}, {t}, {y};"));
                        self.line(format!("mul.f32 {h}, {y}, {};", f32_lit(0.5)));
                        self.line(format!("cvt.rzi.f32.f32 {t}, {h};"));
                        self.line(format!("setp.neu.f32 {odd}, {t}, {h};"));
                        self.line(format!("setp.lt.f32 {neg}, {x}, {zero};"));
                        self.line(format!("and.pred {flip}, {neg}, {odd};"));
                        self.line(format!("and.pred {flip}, {flip}, {int};"));
                        self.line(format!("neg.f32 {nr}, {r};"));
                        self.line(format!("selp.f32 {r}, {nr}, {r}, {flip};"));
                        self.line(format!("not.pred {nan}, {int};"));
                        self.line(format!("and.pred {nan}, {nan}, {neg};"));
                        self.line(format!("selp.f32 {r}, 0f7FC00000, {r}, {nan};"));
                        self.line(format!("setp.eq.f32 {one}, {y}, {zero};"));
                        self.line(format!(
                            "setp.eq.or.f32 {one}, {x}, {}, {one};",
                            f32_lit(1.0)
                        ));
                        self.line(format!("selp.f32 {r}, {}, {r}, {one};", f32_lit(1.0)));
                    }
                    B::Maximum => self.line(format!("max.NaN.f32 {r}, {x}, {y};")),
                    B::Minimum => self.line(format!("min.NaN.f32 {r}, {x}, {y};")),
                    _ => return Err(self.unsupported("logical op on floats")),
                }
                Ok(r)
            }
            VTy::I32 => {
                let r = self.fresh("r");
                match op {
                    B::Add => self.line(format!("add.s32 {r}, {x}, {y};")),
                    B::Sub => self.line(format!("sub.s32 {r}, {x}, {y};")),
                    B::Mul => self.line(format!("mul.lo.s32 {r}, {x}, {y};")),
                    B::Div | B::Rem => return Ok(self.floor_divmod(op, x, y)),
                    B::Pow => {
                        let (fx, fy) = (self.fresh("f"), self.fresh("f"));
                        self.line(format!("cvt.rn.f32.s32 {fx}, {x};"));
                        self.line(format!("cvt.rn.f32.s32 {fy}, {y};"));
                        let p = self.binary(B::Pow, VTy::F32, &fx, &fy)?;
                        self.line(format!("cvt.rni.s32.f32 {r}, {p};"));
                    }
                    B::Maximum => self.line(format!("max.s32 {r}, {x}, {y};")),
                    B::Minimum => self.line(format!("min.s32 {r}, {x}, {y};")),
                    _ => return Err(self.unsupported("logical op on i32")),
                }
                Ok(r)
            }
            VTy::I64 => {
                let r = self.fresh("rd");
                let ins = match op {
                    B::Add => "add.s64",
                    B::Sub => "sub.s64",
                    B::Mul => "mul.lo.s64",
                    B::Div => "div.s64",
                    B::Rem => "rem.s64",
                    B::Maximum => "max.s64",
                    B::Minimum => "min.s64",
                    _ => return Err(self.unsupported("op on indices")),
                };
                self.line(format!("{ins} {r}, {x}, {y};"));
                Ok(r)
            }
            VTy::Bool => {
                let r = self.fresh("p");
                match op {
                    B::And => self.line(format!("and.pred {r}, {x}, {y};")),
                    B::Or => self.line(format!("or.pred {r}, {x}, {y};")),
                    B::Ne => self.line(format!("xor.pred {r}, {x}, {y};")),
                    B::Eq => {
                        self.line(format!("xor.pred {r}, {x}, {y};"));
                        self.line(format!("not.pred {r}, {r};"));
                    }
                    _ => return Err(self.unsupported(format!("{} of bools", op.name()))),
                }
                Ok(r)
            }
        }
    }

    fn floor_divmod(&mut self, op: BinaryOp, x: &str, y: &str) -> String {
        let pz = self.fresh("p");
        let d = self.fresh("r");
        self.line(format!("setp.eq.s32 {pz}, {y}, 0;"));
        self.line(format!("selp.s32 {d}, 1, {y}, {pz};"));
        let q = self.fresh("r");
        let rm = self.fresh("r");
        self.line(format!("div.s32 {q}, {x}, {d};"));
        self.line(format!("rem.s32 {rm}, {x}, {d};"));
        let (p1, p2, p3) = (self.fresh("p"), self.fresh("p"), self.fresh("p"));
        self.line(format!("setp.ne.s32 {p1}, {rm}, 0;"));
        self.line(format!("setp.lt.s32 {p2}, {rm}, 0;"));
        self.line(format!("setp.lt.s32 {p3}, {d}, 0;"));
        self.line(format!("xor.pred {p2}, {p2}, {p3};"));
        self.line(format!("and.pred {p1}, {p1}, {p2};"));
        let r = self.fresh("r");
        if op == BinaryOp::Div {
            self.line(format!("sub.s32 {r}, {q}, 1;"));
            self.line(format!("selp.s32 {r}, {r}, {q}, {p1};"));
        } else {
            self.line(format!("add.s32 {r}, {rm}, {d};"));
            self.line(format!("selp.s32 {r}, {r}, {rm}, {p1};"));
        }
        self.line(format!("selp.s32 {r}, 0, {r}, {pz};"));
        r
    }

    pub(super) fn cast(&mut self, from: VTy, to: VTy, x: &str) -> String {
        if from == to {
            return x.to_string();
        }
        let r = self.reg(to);
        match (from, to) {
            (VTy::F32, VTy::Bool) => self.line(format!("setp.neu.f32 {r}, {x}, {};", f32_lit(0.0))),
            (VTy::F32, VTy::I32) => self.line(format!("cvt.rzi.s32.f32 {r}, {x};")),
            (VTy::F32, _) => self.line(format!("cvt.rzi.s64.f32 {r}, {x};")),
            (VTy::I32, VTy::I64) => self.line(format!("cvt.s64.s32 {r}, {x};")),
            (VTy::I64, VTy::I32) => self.line(format!("cvt.u32.u64 {r}, {x};")),
            (VTy::I32, VTy::F32) => self.line(format!("cvt.rn.f32.s32 {r}, {x};")),
            (VTy::I64, VTy::F32) => self.line(format!("cvt.rn.f32.s64 {r}, {x};")),
            (VTy::I32, _) => self.line(format!("setp.ne.s32 {r}, {x}, 0;")),
            (VTy::I64, _) => self.line(format!("setp.ne.s64 {r}, {x}, 0;")),
            (VTy::Bool, VTy::F32) => self.line(format!(
                "selp.f32 {r}, {}, {}, {x};",
                f32_lit(1.0),
                f32_lit(0.0)
            )),
            (VTy::Bool, VTy::I32) => self.line(format!("selp.s32 {r}, 1, 0, {x};")),
            (VTy::Bool, _) => self.line(format!("selp.s64 {r}, 1, 0, {x};")),
        }
        r
    }
}
