//! Dynamic loss scaling inside the compiled step (f16 mixed precision), as PyTorch's
//! `GradScaler` does it, with no host round trip.
//!
//! Three persistent scalars live in the arena as optimizer state:
//! - `amp.loss_scale`: the scale, `0` meaning "not set yet" (state starts at zero), read as
//!   [`LossScale::init`];
//! - `amp.growth_tracker`: clean steps since the scale last changed;
//! - `amp.skipped_steps`: steps whose updates were skipped.
//!
//! The backward pass starts from the scale instead of 1 (the loss is multiplied by it), so
//! small gradients survive 16-bit storage; each gradient is multiplied by `1/scale` before
//! the optimizer reads it. One finite-check over all gradients (the sum of their absolute
//! values is finite) decides on the device whether the step's updates apply: every update
//! becomes `where(finite, new, old)`, so on overflow params and optimizer state keep their
//! bits. The scale then grows by `growth` after `interval` clean steps in a row and is
//! multiplied by `backoff` on overflow.

use super::builder::Builder;
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, Scalar, TensorType, TypeError, UnaryOp};
use std::collections::BTreeMap;
use tcc_grammar::span::Span;

/// Adds the sum of the magnitudes of the tensor `x` (a gradient, a new param value),
/// summed in f32 (an f16 tensor's sum would pass f16's range), to the f32 scalar `total`:
/// a finite-check at the cost of one read (a sum over NaN or infinity is not finite).
pub(super) fn add_magnitude(
    b: &mut Builder,
    total: &mut Option<NodeId>,
    x: NodeId,
) -> Result<(), TypeError> {
    let a = b.un(UnaryOp::Abs, x)?;
    let a = b.cast(a, DType::F32)?;
    let rank = b.ty(a).rank();
    let s = b.sum(a, (0..rank).collect(), false)?;
    *total = Some(match *total {
        Some(t) => b.add2(t, s)?,
        None => s,
    });
    Ok(())
}

/// A sum of magnitudes over every rank's shard (`sharded`: ZeRO-1), so every rank takes
/// the same decision; `total` itself otherwise.
pub(super) fn over_ranks(
    b: &mut Builder,
    total: NodeId,
    sharded: bool,
) -> Result<NodeId, TypeError> {
    if sharded {
        b.add(Op::AllReduce, vec![total])
    } else {
        Ok(total)
    }
}

/// `GradScaler`'s settings; the defaults are PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale {
    pub init: f64,
    pub growth: f64,
    pub backoff: f64,
    pub interval: u32,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale {
            init: 65536.0,
            growth: 2.0,
            backoff: 0.5,
            interval: 2000,
        }
    }
}

/// Names of the scaler's state.
pub const SCALE: &str = "amp.loss_scale";
pub const TRACKER: &str = "amp.growth_tracker";
pub const SKIPPED: &str = "amp.skipped_steps";

/// The scaler's nodes while the step is built.
pub struct Scaler {
    settings: LossScale,
    state: NodeId,
    tracker: NodeId,
    skipped: NodeId,
    /// The scale this step uses.
    current: NodeId,
}

fn scalar_state(b: &mut Builder, name: &str) -> Result<NodeId, TypeError> {
    b.add(
        Op::State {
            name: name.into(),
            ty: TensorType::scalar(DType::F32),
        },
        vec![],
    )
}

/// Adds the scaler's state and this step's scale.
pub fn begin(g: &mut Graph, settings: LossScale, span: Span) -> Result<Scaler, TypeError> {
    let mut b = Builder::new(g, span);
    let state = scalar_state(&mut b, SCALE)?;
    let tracker = scalar_state(&mut b, TRACKER)?;
    let skipped = scalar_state(&mut b, SKIPPED)?;
    let zero = b.lit(0.0, DType::F32)?;
    let unset = b.bin(BinaryOp::Eq, state, zero)?;
    let init = b.lit(settings.init, DType::F32)?;
    let current = b.where_(unset, init, state)?;
    Ok(Scaler {
        settings,
        state,
        tracker,
        skipped,
        current,
    })
}

impl Scaler {
    /// The backward pass's seed for a loss of type `ty`: the scale.
    pub fn seed(&self, g: &mut Graph, ty: &TensorType, span: Span) -> Result<NodeId, TypeError> {
        let mut b = Builder::new(g, span);
        let s = b.cast(self.current, ty.dtype)?;
        b.broadcast_to(s, ty.shape.clone())
    }

    /// Unscales every gradient and returns the unscaled ones with the step's verdict: a
    /// bool scalar, true when every gradient is finite.
    /// With `sharded` (ZeRO-1: each rank holds a shard of every gradient), the sum of the
    /// magnitudes is summed over the ranks before the test, so every rank takes the same
    /// decision.
    pub fn unscale(
        &self,
        g: &mut Graph,
        grads: &BTreeMap<NodeId, NodeId>,
        span: Span,
        sharded: bool,
    ) -> Result<(BTreeMap<NodeId, NodeId>, NodeId), TypeError> {
        let mut b = Builder::new(g, span);
        let inv = b.un(UnaryOp::Recip, self.current)?;
        let mut out = BTreeMap::new();
        let mut total: Option<NodeId> = None;
        for (&p, &d) in grads {
            let dt = b.ty(d).dtype;
            let inv_d = b.cast(inv, dt)?;
            let u = b.mul(d, inv_d)?;
            out.insert(p, u);
            add_magnitude(&mut b, &mut total, u)?;
        }
        let finite = match total {
            Some(t) => {
                let t = over_ranks(&mut b, t, sharded)?;
                let inf = b.add(
                    Op::Literal {
                        value: Scalar::Float(f64::INFINITY),
                        dtype: DType::F32,
                    },
                    vec![],
                )?;
                b.bin(BinaryOp::Lt, t, inf)?
            }
            None => b.add(
                Op::Literal {
                    value: Scalar::Bool(true),
                    dtype: DType::Bool,
                },
                vec![],
            )?,
        };
        Ok((out, finite))
    }

    /// Makes every update conditional on `finite` and appends the scaler's own updates.
    pub fn finish(&self, g: &mut Graph, finite: NodeId, span: Span) -> Result<(), TypeError> {
        let updates = std::mem::take(&mut g.updates);
        let mut b = Builder::new(g, span);
        let mut kept = Vec::with_capacity(updates.len() + 3);
        for (t, v) in updates {
            kept.push((t, b.where_(finite, v, t)?));
        }
        let s = self.settings;
        let one = b.lit(1.0, DType::F32)?;
        let zero = b.lit(0.0, DType::F32)?;
        let t1 = b.add2(self.tracker, one)?;
        let interval = b.lit(f64::from(s.interval), DType::F32)?;
        let grow = b.bin(BinaryOp::Ge, t1, interval)?;
        let grown = b.scale(self.current, s.growth)?;
        let clean = b.where_(grow, grown, self.current)?;
        let backed = b.scale(self.current, s.backoff)?;
        let scale = b.where_(finite, clean, backed)?;
        let tracked = b.where_(grow, zero, t1)?;
        let tracker = b.where_(finite, tracked, zero)?;
        let missed = b.where_(finite, zero, one)?;
        let skipped = b.add2(self.skipped, missed)?;
        kept.push((self.state, scale));
        kept.push((self.tracker, tracker));
        kept.push((self.skipped, skipped));
        b.g.updates = kept;
        Ok(())
    }
}
