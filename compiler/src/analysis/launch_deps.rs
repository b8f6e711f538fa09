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
//! Cost: near-linear in the kernels' byte ranges to find the conflicts (see [`deps_of`]),
//! plus the ancestor bitsets that keep only the direct ones.

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

    #[cfg(test)]
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

/// Whether a later kernel must follow an earlier one (the pairwise definition, which the
/// tests check [`deps_of`] against).
#[cfg(test)]
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
    deps_of(&prints)
}

/// The direct dependencies of each footprint (see [`launch_deps`]).
///
/// Only some conflicting kernels are candidates: the last writer of each byte a kernel
/// reads or writes, and the readers of a byte it writes since that byte's last write.
/// Every other conflicting kernel is an ancestor of a later candidate (an earlier writer
/// of a byte conflicts with its last writer, an earlier reader with the write after it),
/// so the candidates that are no other's ancestor are exactly the conflicting kernels that
/// are none's. Cost: O(n log n) in the arena's byte segments, plus n²/64 words of
/// ancestor bitsets to build, stored without their leading run of ancestors (a step is
/// mostly a chain, so what is kept stays small).
fn deps_of(prints: &[Footprint]) -> Vec<Vec<u32>> {
    let n = prints.len();
    let mut bytes = Segments::new();
    let mut ancestors: Vec<Ancestors> = Vec::with_capacity(n);
    let mut deps = Vec::with_capacity(n);
    let mut candidates: Vec<u32> = Vec::new();
    let mut cur: Vec<u64> = Vec::new();
    for (i, p) in prints.iter().enumerate() {
        candidates.clear();
        bytes.conflicts(p, &mut candidates);
        candidates.sort_unstable();
        candidates.dedup();
        // `cur`: this kernel's ancestors so far, words `[0, i/64]`; words below `full`
        // are all ones.
        cur.clear();
        cur.resize(i / 64 + 1, 0);
        let mut full = 0usize;
        let mut direct = Vec::new();
        // Latest first: an earlier candidate that a later dependency already implies is
        // in `cur` by the time it is reached.
        for &j in candidates.iter().rev() {
            let ju = j as usize;
            if cur[ju / 64] >> (ju % 64) & 1 == 1 {
                continue;
            }
            direct.push(j);
            cur[ju / 64] |= 1 << (ju % 64);
            let a = &ancestors[ju];
            if a.full > full {
                cur[full..a.full].fill(u64::MAX);
                full = a.full;
            }
            for (w, b) in cur[a.full..].iter_mut().zip(&a.tail) {
                *w |= b;
            }
        }
        direct.reverse();
        ancestors.push(Ancestors::compact(&cur));
        deps.push(direct);
        bytes.record(i as u32, p);
    }
    deps
}

/// A kernel's ancestors: every kernel below `64 * full`, and the bits of `tail` from
/// there.
struct Ancestors {
    full: usize,
    tail: Vec<u64>,
}

impl Ancestors {
    fn compact(words: &[u64]) -> Ancestors {
        let full = words.iter().take_while(|&&w| w == u64::MAX).count();
        let mut tail = words[full..].to_vec();
        while tail.last() == Some(&0) {
            tail.pop();
        }
        Ancestors { full, tail }
    }
}

/// The arena cut into byte segments `[start, end)`, each with its last writer and the
/// kernels that read it since. The segments cover every byte (the first starts at 0, the
/// last ends at `u64::MAX`).
struct Segments(std::collections::BTreeMap<u64, Segment>);

#[derive(Clone)]
struct Segment {
    end: u64,
    writer: Option<u32>,
    readers: Vec<u32>,
}

impl Segments {
    fn new() -> Segments {
        let all = Segment {
            end: u64::MAX,
            writer: None,
            readers: Vec::new(),
        };
        Segments(std::iter::once((0, all)).collect())
    }

    /// Makes `at` the start of a segment.
    fn split(&mut self, at: u64) {
        let Some((&start, seg)) = self.0.range_mut(..=at).next_back() else {
            return;
        };
        if start == at || seg.end <= at {
            return;
        }
        let upper = seg.clone();
        seg.end = at;
        self.0.insert(at, upper);
    }

    /// The segments of `[s, e)`, split at its ends.
    fn cover(&mut self, (s, e): (u64, u64)) -> impl Iterator<Item = &mut Segment> {
        self.split(s);
        self.split(e);
        self.0.range_mut(s..e).map(|(_, seg)| seg)
    }

    /// Pushes the candidates of a kernel with footprint `p` (see [`deps_of`]).
    fn conflicts(&mut self, p: &Footprint, out: &mut Vec<u32>) {
        for &r in &p.reads.0 {
            out.extend(self.cover(r).filter_map(|seg| seg.writer));
        }
        for &w in &p.writes.0 {
            for seg in self.cover(w) {
                out.extend(seg.writer);
                out.extend_from_slice(&seg.readers);
            }
        }
    }

    /// Records kernel `i`'s reads, then its writes (which start each segment afresh).
    fn record(&mut self, i: u32, p: &Footprint) {
        for &r in &p.reads.0 {
            for seg in self.cover(r) {
                seg.readers.push(i);
            }
        }
        for &w in &p.writes.0 {
            for seg in self.cover(w) {
                seg.writer = Some(i);
                seg.readers.clear();
            }
        }
    }
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

    /// The definition, checked pair by pair: O(n²).
    fn deps_by_pairs(prints: &[Footprint]) -> Vec<Vec<u32>> {
        let words = prints.len().div_ceil(64);
        let mut ancestors: Vec<Vec<u64>> = Vec::new();
        let mut deps = Vec::new();
        for (i, p) in prints.iter().enumerate() {
            let mut anc = vec![0u64; words];
            let mut direct = Vec::new();
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

    #[test]
    fn candidates_give_the_pairwise_dependencies() {
        // Random footprints over a small arena (many overlaps, partial ones included),
        // more than 64 kernels so the bitsets span several words.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        for round in 0..40 {
            let n = 20 + next(180) as usize;
            let span = 8 + round * 16;
            let ranges = |count: u64, next: &mut dyn FnMut(u64) -> u64| {
                (0..count)
                    .map(|_| {
                        let s = next(span);
                        (s, s + 1 + next(12))
                    })
                    .collect::<Vec<_>>()
            };
            let prints: Vec<Footprint> = (0..n)
                .map(|_| {
                    let (r, w) = (next(4), next(3));
                    Footprint {
                        reads: Ranges::new(ranges(r, &mut next)),
                        writes: Ranges::new(ranges(w, &mut next)),
                    }
                })
                .collect();
            assert_eq!(deps_of(&prints), deps_by_pairs(&prints), "round {round}");
        }
    }

    #[test]
    fn critical_path_counts_the_longest_chain() {
        assert_eq!(critical_path(&[]), 0);
        assert_eq!(critical_path(&[vec![], vec![], vec![]]), 1);
        assert_eq!(critical_path(&[vec![], vec![0], vec![], vec![1, 2]]), 3);
    }
}
