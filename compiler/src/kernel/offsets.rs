//! Where the planned kernels' buffers live: the arena offset of every buffer a kernel
//! accesses, what the back ends and the printer read once the `plan` stage has run.
//!
//! [`Offsets::new`] builds the table from the kernels and the memory plan in one place and
//! checks it there: a buffer that a kernel stores to or loads from (directly, through a
//! gathered matmul operand, or as a strided matmul or attention operand) and that has no
//! offset is a [`NoOffset`] error, not a failure deep inside an emitter. Buffers a kernel
//! only names (a gathered operand's source, loads nothing reads) get their offset when the
//! plan has one, so a lookup answers as the plan does.

use super::{Kernel, E};
use crate::ir::NodeId;
use crate::plan::Plan;
use std::collections::BTreeMap;

/// A kernel accesses a buffer that the plan gives no offset.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kernel {kernel} `{name}` accesses %{buf}, which has no arena offset")]
pub struct NoOffset {
    pub kernel: usize,
    pub name: String,
    pub buf: usize,
}

/// The arena offset of each buffer the kernels of a step access.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offsets {
    map: BTreeMap<NodeId, u64>,
}

impl Offsets {
    /// The offsets of the buffers `kernels` access, from `plan`; the first access (in
    /// kernel order) whose buffer has none is an error.
    pub fn new(kernels: &[Kernel], plan: &Plan) -> Result<Offsets, NoOffset> {
        let mut map = BTreeMap::new();
        for (ki, k) in kernels.iter().enumerate() {
            for buf in accessed(k) {
                let off = plan.offset_of(buf).ok_or_else(|| NoOffset {
                    kernel: ki,
                    name: k.name.clone(),
                    buf: buf.index(),
                })?;
                map.insert(buf, off);
            }
            for buf in named(k) {
                if let Some(off) = plan.offset_of(buf) {
                    map.insert(buf, off);
                }
            }
        }
        Ok(Offsets { map })
    }

    /// The arena offset of `buf` (`None` for a buffer no kernel accesses).
    pub fn get(&self, buf: NodeId) -> Option<u64> {
        self.map.get(&buf).copied()
    }

    /// The buffers and their offsets, by node.
    pub fn iter(&self) -> impl Iterator<Item = (NodeId, u64)> + '_ {
        self.map.iter().map(|(&n, &o)| (n, o))
    }
}

/// The buffers `k` reads or writes: stores, live loads (gathers included), strided matmul
/// operands and every attention operand.
fn accessed(k: &Kernel) -> Vec<NodeId> {
    let mut v: Vec<NodeId> = k.stores.iter().map(|s| s.buf).collect();
    v.extend(k.loads());
    if let Some(at) = &k.attention {
        v.extend([&at.o, &at.lse].into_iter().flatten().map(|o| o.buf));
    }
    v
}

/// The buffers `k` names without necessarily accessing them: every load of its pool and
/// the source of a gathered matmul operand.
fn named(k: &Kernel) -> Vec<NodeId> {
    let mut v: Vec<NodeId> = k
        .pool
        .nodes
        .iter()
        .filter_map(|x| match x {
            E::Load { buf, .. } => Some(*buf),
            _ => None,
        })
        .collect();
    v.extend(k.matmul.iter().flat_map(|mm| [mm.a.buf, mm.b.buf]));
    v
}
