//! Runs of a gathered operand: where `run` consecutive elements along one of its variables
//! (starting at a multiple of `run`) are `run` consecutive elements of one 16-bit or f32
//! buffer, all read or all zero. An implicit GEMM stages such a run as one 16-byte
//! `cp.async` or load (a convolution's window over channels-last activations: one tap,
//! eight bf16 or four f32 channels), computing the gather's index and padding test once
//! per run instead of once per element.
//!
//! The proof is structural, over the gather's expression: every node is either
//! independent of the run's offset `e` (`0 <= e < run`), or `base + step·e` with a
//! known `step`, where `base` is the node's value at `e = 0`. Divisions and remainders by
//! multiples of `run` of a non-negative `base + e` with `base` a multiple of `run` keep
//! the form (`(base + e) / c = base / c`, `(base + e) % c = base % c + e`); clamps keep it
//! only where [`super::expr::index_ranges`] shows them to be the identity.

use crate::ir::{BinaryOp, DType, NodeId};
use crate::kernel::lower::{children, reachable};
use crate::kernel::{ExprId, ExprPool, VTy, Var, E};

/// A gathered operand's run, as [`run_of`] finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) buf: NodeId,
    pub(super) dtype: DType,
    /// The element index of the run's first element (the variable at a multiple of `run`).
    pub(super) index: ExprId,
    /// Where false, every element of the run is 0; `None`: always read.
    pub(super) guard: Option<ExprId>,
}

/// A node's value as `base + step·e`; `aligned`: `base` is a multiple of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Form {
    step: i64,
    aligned: bool,
}

const FREE: Form = Form {
    step: 0,
    aligned: false,
};

/// The run of `run` elements (along `var`, which spans `[0, extent)`) of a gather's
/// `value`, when `extent` is a multiple of `run` (a run is all in range or all out),
/// `value` is a 16-bit or f32 load, or a select between such a load and 0 whose condition does
/// not vary along the run, and the load's index is its run's first index plus `e`, that
/// first index a multiple of `run`.
pub(super) fn run_of(
    pool: &ExprPool,
    ranges: &[Option<(i64, i64)>],
    value: ExprId,
    (var, extent): (Var, usize),
    run: i64,
) -> Option<Run> {
    if run <= 1 || extent == 0 || (extent as i64) % run != 0 {
        return None;
    }
    let (load, guard) = match *pool.get(value) {
        E::Load { .. } => (value, None),
        E::Select(c, a, b) if matches!(pool.get(b), E::F32(0)) => (a, Some(c)),
        _ => return None,
    };
    let E::Load { buf, dtype, index } = *pool.get(load) else {
        return None;
    };
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return None;
    }
    let forms = forms(pool, ranges, value, var, run);
    let form = |e: ExprId| forms.get(e.0 as usize).copied().flatten();
    let whole = Form {
        step: 1,
        aligned: true,
    };
    if form(index) != Some(whole) {
        return None;
    }
    if let Some(c) = guard {
        if form(c)?.step != 0 {
            return None;
        }
    }
    Some(Run {
        buf,
        dtype,
        index,
        guard,
    })
}

/// The form of every node reachable from `root` (`None`: not known to be affine in `e`).
fn forms(
    pool: &ExprPool,
    ranges: &[Option<(i64, i64)>],
    root: ExprId,
    var: Var,
    run: i64,
) -> Vec<Option<Form>> {
    let mut out: Vec<Option<Form>> = vec![None; pool.nodes.len()];
    let range = |e: ExprId| ranges.get(e.0 as usize).copied().flatten();
    for e in reachable(pool, &[root]) {
        let get = |x: ExprId| out.get(x.0 as usize).copied().flatten();
        let int = |x: ExprId| match pool.get(x) {
            E::Int(c) => Some(*c),
            _ => None,
        };
        let node = pool.get(e);
        let f = match *node {
            E::Var(v) if v == var => Some(Form {
                step: 1,
                aligned: true,
            }),
            E::Int(c) => Some(Form {
                step: 0,
                aligned: c % run == 0,
            }),
            E::Bin(op, a, b) if pool.ty(e) == VTy::I64 => {
                binary(op, (get(a), get(b)), (int(a), int(b)), range(a), run)
            }
            E::IMin(a, b) | E::IMax(a, b) => clamp(
                matches!(node, E::IMin(..)),
                (a, get(a)),
                (b, get(b)),
                &range,
            ),
            _ => {
                // Anything else is known only where nothing below it varies along the run.
                let kids = children(node);
                kids.iter()
                    .all(|&x| get(x).is_some_and(|f| f.step == 0))
                    .then_some(FREE)
            }
        };
        out[e.0 as usize] = f;
    }
    out
}

/// The form of `min(a, b)` (`min`) or `max(a, b)`: free where neither side varies; the
/// varying side's form where the clamp is the identity on it over its whole range.
fn clamp(
    min: bool,
    (a, fa): (ExprId, Option<Form>),
    (b, fb): (ExprId, Option<Form>),
    range: &dyn Fn(ExprId) -> Option<(i64, i64)>,
) -> Option<Form> {
    let (fa, fb) = (fa?, fb?);
    if fa.step == 0 && fb.step == 0 {
        return Some(FREE);
    }
    // (the varying side, the bound) and their forms.
    let ((v, fv), (c, fc)) = if fb.step == 0 {
        ((a, fa), (b, fb))
    } else {
        ((b, fb), (a, fa))
    };
    if fc.step != 0 {
        return None;
    }
    let ((vl, vh), (cl, ch)) = (range(v)?, range(c)?);
    let identity = if min { vh <= cl } else { vl >= ch };
    identity.then_some(fv)
}

/// The form of an i64 binary node from its operands' forms, constants and the left
/// operand's range.
fn binary(
    op: BinaryOp,
    (fa, fb): (Option<Form>, Option<Form>),
    (ca, cb): (Option<i64>, Option<i64>),
    ra: Option<(i64, i64)>,
    run: i64,
) -> Option<Form> {
    let (fa, fb) = (fa?, fb?);
    match op {
        BinaryOp::Add | BinaryOp::Sub => {
            let step = if op == BinaryOp::Add {
                fa.step.checked_add(fb.step)?
            } else {
                fa.step.checked_sub(fb.step)?
            };
            Some(Form {
                step,
                aligned: fa.aligned && fb.aligned,
            })
        }
        BinaryOp::Mul => match (ca, cb) {
            (_, Some(c)) => Some(Form {
                step: fa.step.checked_mul(c)?,
                aligned: fa.aligned || c % run == 0,
            }),
            (Some(c), None) => Some(Form {
                step: fb.step.checked_mul(c)?,
                aligned: fb.aligned || c % run == 0,
            }),
            (None, None) if fa.step == 0 && fb.step == 0 => Some(Form {
                step: 0,
                aligned: fa.aligned || fb.aligned,
            }),
            _ => None,
        },
        BinaryOp::Div | BinaryOp::Rem => {
            let c = cb.filter(|&c| c > 0)?;
            if fa.step == 0 {
                return Some(FREE);
            }
            // (base + e) over c, with base >= 0 a multiple of run and run dividing c.
            let whole = fa.step == 1 && fa.aligned && c % run == 0;
            let nonneg = ra.is_some_and(|(lo, _)| lo >= 0);
            if !(whole && nonneg) {
                return None;
            }
            Some(if op == BinaryOp::Div {
                FREE
            } else {
                Form {
                    step: 1,
                    aligned: true,
                }
            })
        }
        _ => (fa.step == 0 && fb.step == 0).then_some(FREE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Kernel;

    /// A pool with row var 0 over `[0, 64)` and k var 1 over `[0, 576)` (3×3 taps of 64
    /// channels), reading a channels-last `[8, 8, 64]` image with padding 1.
    fn kernel() -> Kernel {
        Kernel {
            name: "k".into(),
            domain: vec![64, 576],
            pool: ExprPool::default(),
            stores: Vec::new(),
            matmul: None,
            attention: None,
            nodes: Vec::new(),
            parallel: true,
            describe: String::new(),
            collective: None,
        }
    }

    /// `select(guard, buf[index], 0)` (a bare load without a guard).
    fn load(p: &mut ExprPool, index: ExprId, guard: Option<ExprId>) -> ExprId {
        let load = p.add(
            E::Load {
                buf: NodeId(petgraph::stable_graph::NodeIndex::new(3)),
                dtype: DType::BF16,
                index,
            },
            VTy::F32,
        );
        match guard {
            Some(g) => {
                let z = p.add(E::F32(0), VTy::F32);
                p.add(E::Select(g, load, z), VTy::F32)
            }
            None => load,
        }
    }

    fn conv_window(channels_last: bool) -> (Kernel, ExprId) {
        let mut k = kernel();
        let p = &mut k.pool;
        let (row, kk) = (p.add(E::Var(0), VTy::I64), p.add(E::Var(1), VTy::I64));
        let int = |p: &mut ExprPool, c: i64| p.add(E::Int(c), VTy::I64);
        let bin = |p: &mut ExprPool, op, a, b| p.add(E::Bin(op, a, b), VTy::I64);
        let (c64, c8, c3, c192) = (int(p, 64), int(p, 8), int(p, 3), int(p, 192));
        let (zero, seven, m1) = (int(p, 0), int(p, 7), int(p, -1));
        let (oh, ow) = (
            bin(p, BinaryOp::Div, row, c8),
            bin(p, BinaryOp::Rem, row, c8),
        );
        let i = bin(p, BinaryOp::Div, kk, c192);
        let j = bin(p, BinaryOp::Div, kk, c64);
        let j = bin(p, BinaryOp::Rem, j, c3);
        let ch = bin(p, BinaryOp::Rem, kk, c64);
        let ih = bin(p, BinaryOp::Add, oh, i);
        let ih = bin(p, BinaryOp::Add, ih, m1);
        let iw = bin(p, BinaryOp::Add, ow, j);
        let iw = bin(p, BinaryOp::Add, iw, m1);
        let mut guard = None;
        for x in [ih, iw] {
            let ge = p.add(E::Bin(BinaryOp::Ge, x, zero), VTy::Bool);
            let lt = p.add(E::Bin(BinaryOp::Lt, x, c8), VTy::Bool);
            let ok = p.add(E::Bin(BinaryOp::And, ge, lt), VTy::Bool);
            guard = Some(match guard {
                None => ok,
                Some(g) => p.add(E::Bin(BinaryOp::And, g, ok), VTy::Bool),
            });
        }
        let clamp = |p: &mut ExprPool, x, hi| {
            let lo = p.add(E::IMax(x, zero), VTy::I64);
            p.add(E::IMin(lo, hi), VTy::I64)
        };
        let (ih, iw) = (clamp(p, ih, seven), clamp(p, iw, seven));
        let c63 = int(p, 63);
        let ch = clamp(p, ch, c63);
        let c512 = int(p, 512);
        let index = if channels_last {
            let a = bin(p, BinaryOp::Mul, ih, c512);
            let b = bin(p, BinaryOp::Mul, iw, c64);
            let a = bin(p, BinaryOp::Add, a, b);
            bin(p, BinaryOp::Add, a, ch)
        } else {
            let a = bin(p, BinaryOp::Mul, ch, c64);
            let b = bin(p, BinaryOp::Mul, ih, c8);
            let a = bin(p, BinaryOp::Add, a, b);
            bin(p, BinaryOp::Add, a, iw)
        };
        let v = load(p, index, guard);
        (k, v)
    }

    #[test]
    fn a_channels_last_window_reads_runs_of_eight_channels() {
        let (k, v) = conv_window(true);
        let ranges = super::super::expr::index_ranges(&k);
        let r = run_of(&k.pool, &ranges, v, (1, 576), 8).expect("a run");
        assert_eq!(r.dtype, DType::BF16);
        assert!(r.guard.is_some());
        // 64 channels: runs of 16 and 64 too, but not 192 (a run would cross taps).
        assert!(run_of(&k.pool, &ranges, v, (1, 576), 64).is_some());
        assert!(run_of(&k.pool, &ranges, v, (1, 576), 192).is_none());
        // Along the rows, consecutive pixels are 64 elements apart.
        assert!(run_of(&k.pool, &ranges, v, (0, 64), 8).is_none());
    }

    /// Indices and guards that are not one aligned run of consecutive elements: a run
    /// backwards (a varying right operand of `-`, a negative factor), a clamp that bites
    /// inside the range, a guard that varies along the run, a start that is not a multiple
    /// of the run, an i32 load; an f32 load is one (the SGEMM's runs of four).
    #[test]
    fn what_is_not_a_run_is_refused() {
        let mut k = kernel();
        let p = &mut k.pool;
        let kk = p.add(E::Var(1), VTy::I64);
        let int = |p: &mut ExprPool, c: i64| p.add(E::Int(c), VTy::I64);
        let (c3, c5, c600, m1, c8) = (int(p, 3), int(p, 5), int(p, 600), int(p, -1), int(p, 8));
        let backwards = p.add(E::Bin(BinaryOp::Sub, c600, kk), VTy::I64);
        let negated = p.add(E::Bin(BinaryOp::Mul, kk, m1), VTy::I64);
        let negated = p.add(E::Bin(BinaryOp::Add, negated, c600), VTy::I64);
        let clamped = p.add(E::IMin(kk, c5), VTy::I64);
        let shifted = p.add(E::Bin(BinaryOp::Add, kk, c3), VTy::I64);
        let early = p.add(E::Bin(BinaryOp::Lt, kk, c5), VTy::Bool);
        let cases = [
            load(p, backwards, None),
            load(p, negated, None),
            load(p, clamped, None),
            load(p, shifted, None),
            load(p, kk, Some(early)),
        ];
        let in_dtype = |p: &mut ExprPool, dtype| {
            p.add(
                E::Load {
                    buf: NodeId(petgraph::stable_graph::NodeIndex::new(3)),
                    dtype,
                    index: kk,
                },
                if dtype == DType::F32 {
                    VTy::F32
                } else {
                    VTy::I32
                },
            )
        };
        let (in_i32, in_f32) = (in_dtype(p, DType::I32), in_dtype(p, DType::F32));
        // The same load of `kk` itself, with a guard that holds along whole runs, is one.
        let per_run = p.add(E::Bin(BinaryOp::Div, kk, c8), VTy::I64);
        let ok_guard = p.add(E::Bin(BinaryOp::Lt, per_run, c5), VTy::Bool);
        let fine = load(p, kk, Some(ok_guard));
        let ranges = super::super::expr::index_ranges(&k);
        for (i, v) in cases.into_iter().chain([in_i32]).enumerate() {
            assert!(
                run_of(&k.pool, &ranges, v, (1, 576), 8).is_none(),
                "case {i}"
            );
        }
        assert!(run_of(&k.pool, &ranges, fine, (1, 576), 8).is_some());
        let f32_run = run_of(&k.pool, &ranges, in_f32, (1, 576), 4);
        assert_eq!(f32_run.map(|r| r.dtype), Some(DType::F32));
    }

    #[test]
    fn a_channels_first_window_has_no_runs() {
        let (k, v) = conv_window(false);
        let ranges = super::super::expr::index_ranges(&k);
        assert!(run_of(&k.pool, &ranges, v, (1, 576), 8).is_none());
    }
}
