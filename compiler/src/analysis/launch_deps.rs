//! Which earlier kernels each kernel of a planned step must wait for.
//!
//! The step's kernels are planned to run one after another, and buffers whose lifetimes do
//! not overlap share arena bytes. Two kernels may still run at the same time when neither
//! writes bytes the other reads or writes: kernel `i` must follow an earlier `j` where
//!
//! - `i` reads bytes `j` writes (read after write),
//! - `i` writes bytes `j` reads (write after read: `j` must read the old value first; this
//!   is how reused arena bytes stay safe), or
//! - both write the same bytes (the later value must win; an accumulating store also
//!   reads).
//!
//! Bytes are whole buffers of the plan: a view's loads fall in its base's buffer, so a
//! kernel's footprint is the union of the buffers of the nodes it loads and stores. The
//! result keeps only the direct dependencies (none implied by another's), so the CUDA
//! runtime can build the step's graph with exactly these edges: independent kernels (a
//! layer's input gradient and its weight gradient, an optimizer update and the backward
//! pass of earlier layers) may then overlap, and wave tails of one fill with another.
//!
//! Cost: O(n² · r) for `n` kernels of at most `r` byte ranges each, plus `n²/64` words of
//! ancestor bitsets.

use crate::ir::NodeId;
use crate::kernel::Kernel;
use crate::plan::Plan;

/// Byte ranges `[start, end)` of the arena, sorted and merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    fn new(mut v: Vec<(u64, u64)>) -> Ranges {
        v.retain(|r| r.0 < r.1);
        v.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (s, e) in v {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        Ranges(out)
    }

    fn overlaps(&self, other: &Ranges) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() && j < other.0.len() {
            let (a, b) = (self.0[i], other.0[j]);
            if a.0 < b.1 && b.0 < a.1 {
                return true;
            }
            if a.1 <= b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        false
    }
}

/// What one kernel reads and writes.
struct Footprint {
    reads: Ranges,
    writes: Ranges,
}

fn footprint(k: &Kernel, plan: &Plan, scratch: Option<(u64, u64)>) -> Footprint {
    let range = |n: NodeId| {
        let b = *plan.liveness.buffer_of.get(&n)?;
        let off = *plan.offsets.get(b)?;
        Some((off, off + plan.liveness.buffers.get(b)?.bytes))
    };
    let mut reads: Vec<(u64, u64)> = k.loads().into_iter().filter_map(range).collect();
    // Scratch bytes are read and written.
    let mut writes: Vec<(u64, u64)> = scratch.into_iter().collect();
    reads.extend(scratch);
    for s in &k.stores {
        if let Some(r) = range(s.buf) {
            writes.push(r);
            if s.accumulate {
                reads.push(r);
            }
        }
    }
    Footprint {
        reads: Ranges::new(reads),
        writes: Ranges::new(writes),
    }
}

fn conflict(later: &Footprint, earlier: &Footprint) -> bool {
    later.reads.overlaps(&earlier.writes)
        || later.writes.overlaps(&earlier.reads)
        || later.writes.overlaps(&earlier.writes)
}

/// For each kernel (in launch order), the earlier kernels it must wait for, ascending:
/// every conflicting earlier kernel is one of them or an ancestor of one of them, and none
/// of them is an ancestor of another. `scratch[i]`: arena bytes kernel `i` uses besides
/// its buffers' (the stream-K matmuls' shared scratch region), if any.
pub fn launch_deps(
    kernels: &[Kernel],
    plan: &Plan,
    scratch: &[Option<(u64, u64)>],
) -> Vec<Vec<u32>> {
    let prints: Vec<Footprint> = kernels
        .iter()
        .enumerate()
        .map(|(i, k)| footprint(k, plan, scratch.get(i).copied().flatten()))
        .collect();
    let words = kernels.len().div_ceil(64);
    // ancestors[i]: bit j set when kernel j must finish before kernel i starts.
    let mut ancestors: Vec<Vec<u64>> = Vec::with_capacity(kernels.len());
    let mut deps = Vec::with_capacity(kernels.len());
    for (i, p) in prints.iter().enumerate() {
        let mut anc = vec![0u64; words];
        let mut direct = Vec::new();
        // Latest first: an earlier conflict that a later dependency already implies is
        // in `anc` by the time it is reached.
        for j in (0..i).rev() {
            if anc[j / 64] >> (j % 64) & 1 == 1 || !conflict(p, &prints[j]) {
                continue;
            }
            direct.push(j as u32);
            anc[j / 64] |= 1 << (j % 64);
            for (w, a) in anc.iter_mut().zip(&ancestors[j]) {
                *w |= a;
            }
        }
        direct.reverse();
        ancestors.push(anc);
        deps.push(direct);
    }
    deps
}

/// The longest chain of dependent kernels (1 for a step of independent kernels, the kernel
/// count for a step that must run in order; 0 without kernels).
pub fn critical_path(deps: &[Vec<u32>]) -> usize {
    let mut depth = vec![0usize; deps.len()];
    for (i, d) in deps.iter().enumerate() {
        depth[i] = 1 + d
            .iter()
            .filter_map(|&j| depth.get(j as usize))
            .max()
            .copied()
            .unwrap_or(0);
    }
    depth.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_overlap() {
        let a = Ranges::new(vec![(10, 20), (0, 5), (18, 30), (40, 40)]);
        assert_eq!(a.0, vec![(0, 5), (10, 30)]);
        assert!(a.overlaps(&Ranges::new(vec![(29, 31)])));
        assert!(!a.overlaps(&Ranges::new(vec![(5, 10), (30, 60)])));
        assert!(!a.overlaps(&Ranges::default()));
    }

    #[test]
    fn critical_path_counts_the_longest_chain() {
        assert_eq!(critical_path(&[]), 0);
        assert_eq!(critical_path(&[vec![], vec![], vec![]]), 1);
        assert_eq!(critical_path(&[vec![], vec![0], vec![], vec![1, 2]]), 3);
    }
}
