//! Offset assignment ("dynamic storage allocation"): give every buffer, with a lifetime
//! `[lower, upper)` and a size, an offset so that no two buffers alive at the same time
//! overlap, in as small an arena as possible.
//!
//! Three solvers, best kept:
//! - **greedy by size** and **greedy by lifetime** (XLA / TFLite): sort, then put each buffer
//!   at the lowest offset where it fits among already placed buffers it conflicts with;
//! - **skyline search** (after MiniMalloc, Moffitt ASPLOS'23), for a fixed capacity: a
//!   depth-first search over the order in which buffers are stacked, each resting on the
//!   highest placed buffer it meets ("gravity"), in increasing (offset, rank) order. Every
//!   packing can be normalised into such an order, so the search is complete. Time is cut
//!   into *sections* (between consecutive lifetime endpoints). Pruning:
//!   - *dominance*: no buffer goes at or above the top of an unplaced one (that one could
//!     drop under it);
//!   - *section inference*: in every section, the lowest minimum offset of its unplaced
//!     buffers plus their total size must fit under the capacity; and since offsets only
//!     grow, so must the current offset plus the largest section total. A candidate is
//!     checked against this before it is placed, in the sections it can change only;
//!   - *dynamic decomposition*: once no unplaced buffer crosses a section boundary, the two
//!     sides are solved independently (each ranked afresh from its current congestion).
//!
//!   Depth-first search is heavy-tailed, so it restarts with a doubling node limit and a
//!   round robin of three static orders; restarts run on a few threads.
//!
//! Past [`MAX_PROBLEM`] pairs of buffers live at the same time (a long unrolled loop keeps
//! thousands of activations live through its backward pass), both greedy solvers are
//! quadratic and the search refuses the problem: [`plan`] then places the buffers with
//! one [`sweep`] in time order, as an allocator running the program would (O(n log n)).
//!
//! [`plan`] runs the greedy solvers, then searches capacities between the lower bound
//! (max-live, or the largest buffer) and the best greedy result within a budget: first
//! the lower bound itself (with 60% of the budget), then bisection over multiples of the
//! sizes' granularity. Budgets are counted in search work ([`WORK_PER_MS`]), never on a
//! clock, so the plan is the same on every machine and under any load.
//!
//! A buffer with an empty lifetime (`lower >= upper`) or size 0 is never live: it conflicts
//! with nothing, goes at offset 0, and only has to fit inside the arena.
//!
//! `TCC_ARENA_DEBUG=1` makes every search report its node count and outcome on stderr.

use crate::kernel::gcd;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// One buffer to place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub lower: u64,
    pub upper: u64,
    pub size: u64,
}

impl Interval {
    /// Whether the buffer is ever live (a non-empty lifetime).
    pub fn is_live(&self) -> bool {
        self.lower < self.upper
    }

    /// Whether two buffers are live at the same time.
    pub fn overlaps(&self, o: &Interval) -> bool {
        self.is_live() && o.is_live() && self.lower < o.upper && o.lower < self.upper
    }
}

/// A placement: one offset per buffer, and the arena size it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub offsets: Vec<u64>,
    pub size: u64,
    /// Which solver produced it.
    pub method: &'static str,
}

/// Why a placement is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{0} offsets for {1} buffers")]
    Count(usize, usize),
    #[error("buffers {a} and {b} are live together and overlap in memory")]
    Overlap { a: usize, b: usize },
    #[error("buffer {0} ends past the arena")]
    OutOfArena(usize),
    #[error("buffer {0} is not aligned to {1}")]
    Misaligned(usize, u64),
}

/// Checks that a placement is valid: every buffer inside the arena, aligned, and no two
/// buffers with overlapping lifetimes overlapping in memory. O(n log n + overlaps).
pub fn verify(intervals: &[Interval], p: &Placement, align: u64) -> Result<(), PlacementError> {
    if p.offsets.len() != intervals.len() {
        return Err(PlacementError::Count(p.offsets.len(), intervals.len()));
    }
    for (i, (iv, &o)) in intervals.iter().zip(&p.offsets).enumerate() {
        if o.checked_add(iv.size).is_none_or(|top| top > p.size) {
            return Err(PlacementError::OutOfArena(i));
        }
        if align > 1 && o % align != 0 {
            return Err(PlacementError::Misaligned(i, align));
        }
    }
    // Sweep over time: check each new buffer against those live at its start.
    let mut order: Vec<usize> = (0..intervals.len())
        .filter(|&i| intervals[i].size > 0 && intervals[i].is_live())
        .collect();
    order.sort_by_key(|&i| (intervals[i].lower, i));
    let mut live: Vec<usize> = Vec::new();
    for &i in &order {
        let iv = intervals[i];
        live.retain(|&j| intervals[j].upper > iv.lower);
        for &j in &live {
            let (a0, a1) = (p.offsets[i], p.offsets[i] + iv.size);
            let (b0, b1) = (p.offsets[j], p.offsets[j] + intervals[j].size);
            if a0 < b1 && b0 < a1 {
                return Err(PlacementError::Overlap {
                    a: j.min(i),
                    b: j.max(i),
                });
            }
        }
        live.push(i);
    }
    Ok(())
}

/// The max-live lower bound: the largest total size of buffers live at one instant.
pub fn max_live(intervals: &[Interval]) -> u64 {
    let mut events: Vec<(u64, i8, u64)> = Vec::with_capacity(intervals.len() * 2);
    for iv in intervals.iter().filter(|iv| iv.size > 0 && iv.is_live()) {
        events.push((iv.lower, 1, iv.size));
        events.push((iv.upper, -1, iv.size));
    }
    // Ends before starts at the same instant (half-open lifetimes).
    events.sort_by_key(|&(t, k, _)| (t, k));
    let (mut cur, mut best) = (0u64, 0u64);
    for (_, k, s) in events {
        if k > 0 {
            cur = cur.saturating_add(s);
            best = best.max(cur);
        } else {
            cur = cur.saturating_sub(s);
        }
    }
    best
}

fn round_up(x: u64, a: u64) -> u64 {
    if a <= 1 {
        x
    } else {
        x.div_ceil(a).saturating_mul(a)
    }
}

/// A step every optimal arena size can be rounded to: some optimal packing is normalised
/// (every buffer rests on 0 or, aligned, on a buffer it meets), and the tops of a
/// normalised packing are multiples of the sizes' gcd (`align` 1) or of its gcd with the
/// alignment.
fn granularity(intervals: &[Interval], align: u64) -> u64 {
    let g = intervals.iter().fold(0, |g, iv| gcd(g, iv.size));
    let g = if align > 1 { gcd(g, align) } else { g };
    g.max(1)
}

/// The buffers placed so far by [`greedy`], queried by time: which are live during a given
/// lifetime? A segment tree over the buffers sorted by start, holding the latest end of
/// the placed ones below each node. A query costs O((1 + hits) log n).
struct LiveIndex {
    /// Starts of all buffers, sorted.
    starts: Vec<u64>,
    /// Buffer at each sorted position.
    at: Vec<usize>,
    /// Sorted position of each buffer.
    pos: Vec<usize>,
    /// Segment tree (1-based heap layout, leaves from `leaves`): the latest end among the
    /// placed buffers under each node, 0 if none.
    ends: Vec<u64>,
    leaves: usize,
}

impl LiveIndex {
    fn new(intervals: &[Interval]) -> LiveIndex {
        let n = intervals.len();
        let mut at: Vec<usize> = (0..n).collect();
        at.sort_by_key(|&i| (intervals[i].lower, i));
        let mut pos = vec![0; n];
        for (k, &i) in at.iter().enumerate() {
            pos[i] = k;
        }
        let leaves = n.next_power_of_two();
        LiveIndex {
            starts: at.iter().map(|&i| intervals[i].lower).collect(),
            at,
            pos,
            ends: vec![0; 2 * leaves],
            leaves,
        }
    }

    fn insert(&mut self, i: usize, end: u64) {
        let mut k = self.leaves + self.pos[i];
        while k > 0 {
            self.ends[k] = self.ends[k].max(end);
            k /= 2;
        }
    }

    /// Pushes onto `out` every placed buffer live at some time in `[lower, upper)`.
    fn live_during(&self, lower: u64, upper: u64, out: &mut Vec<usize>) {
        // Buffers starting before `upper` and placed, whose end is after `lower`.
        let count = self.starts.partition_point(|&t| t < upper);
        self.collect(1, 0, self.leaves, count, lower, out);
    }

    fn collect(
        &self,
        k: usize,
        from: usize,
        to: usize,
        count: usize,
        lower: u64,
        out: &mut Vec<usize>,
    ) {
        if from >= count || self.ends[k] <= lower {
            return;
        }
        if to - from == 1 {
            out.push(self.at[from]);
            return;
        }
        let mid = (from + to) / 2;
        self.collect(2 * k, from, mid, count, lower, out);
        self.collect(2 * k + 1, mid, to, count, lower, out);
    }
}

/// Greedy placement in the given order: each buffer goes to the lowest aligned offset that
/// does not overlap an already placed buffer live at the same time (best fit among gaps).
/// O(n log n + overlaps · log n).
pub fn greedy(
    intervals: &[Interval],
    order: &[usize],
    align: u64,
    method: &'static str,
) -> Placement {
    let n = intervals.len();
    let mut offsets = vec![0u64; n];
    let mut index = LiveIndex::new(intervals);
    let mut size = 0u64;
    let mut live: Vec<usize> = Vec::new();
    let mut busy: Vec<(u64, u64)> = Vec::new();
    // The placed live buffers by (offset, end, index): where most of them overlap the one
    // being placed (a long unrolled loop keeps thousands of activations live), walking this
    // in order is cheaper than sorting the overlapping ones, and visits the same (offset,
    // end) pairs in the same order.
    let mut by_offset: BTreeSet<(u64, u64, usize)> = BTreeSet::new();
    for &i in order {
        let iv = intervals[i];
        if iv.size == 0 {
            continue;
        }
        live.clear();
        if iv.is_live() {
            index.live_during(iv.lower, iv.upper, &mut live);
        }
        // Smallest gap that fits (best fit); else on top.
        let mut best: Option<(u64, u64)> = None; // (gap size, offset)
        let mut cursor = 0u64;
        let mut visit = |s: u64, e: u64| {
            let start = round_up(cursor, align);
            if s > start && s - start >= iv.size {
                let gap = s - start;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, start));
                }
            }
            cursor = cursor.max(e);
        };
        if live.len() > 64 && live.len() * 4 >= by_offset.len() {
            for &(s, e, j) in &by_offset {
                let o = intervals[j];
                if o.lower < iv.upper && o.upper > iv.lower {
                    visit(s, e);
                }
            }
        } else {
            busy.clear();
            busy.extend(
                live.iter()
                    .map(|&j| (offsets[j], offsets[j].saturating_add(intervals[j].size))),
            );
            busy.sort_unstable();
            for &(s, e) in &busy {
                visit(s, e);
            }
        }
        let off = match best {
            Some((_, o)) => o,
            None => round_up(cursor, align),
        };
        offsets[i] = off;
        size = size.max(off.saturating_add(iv.size));
        if iv.is_live() {
            index.insert(i, iv.upper);
            by_offset.insert((off, off.saturating_add(iv.size), i));
        }
    }
    Placement {
        offsets,
        size,
        method,
    }
}

/// Pairs of buffers live at the same time; the count stops at the first value above `cap`
/// (all a caller comparing with `cap` needs). O(n log n).
pub fn overlapping_pairs(intervals: &[Interval], cap: u64) -> u64 {
    let mut events: Vec<(u64, bool)> = Vec::with_capacity(intervals.len() * 2);
    for iv in intervals.iter().filter(|iv| iv.size > 0 && iv.is_live()) {
        events.push((iv.lower, true));
        events.push((iv.upper, false));
    }
    // Ends before starts at the same instant (half-open lifetimes): `false` sorts first.
    events.sort_unstable();
    let (mut active, mut pairs) = (0u64, 0u64);
    for (_, start) in events {
        if start {
            // The buffer meets every one live when it starts, and each pair is counted
            // once: by the later-starting buffer.
            pairs = pairs.saturating_add(active);
            if pairs > cap {
                return pairs;
            }
            active += 1;
        } else {
            active = active.saturating_sub(1);
        }
    }
    pairs
}

/// Placement in order of start, as an allocator running the program would do it: at each
/// start, the buffers that ended give their bytes back (merged with free neighbours), and
/// the new buffer takes the free range with the smallest usable length once its start is
/// aligned (the lowest aligned offset on ties), else goes on top. O(n log n) in the live
/// buffers with `align` 1; with a larger one, the free ranges within `align` bytes of the
/// best length are compared too. [`greedy`] instead visits every placed buffer a new one
/// overlaps: [`plan`] uses this one for problems too large for that.
pub fn sweep(intervals: &[Interval], align: u64, method: &'static str) -> Placement {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let align = align.max(1);
    let n = intervals.len();
    let mut offsets = vec![0u64; n];
    let mut size = 0u64;
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for (i, iv) in intervals.iter().enumerate() {
        if iv.size > 0 && iv.is_live() {
            order.push(i);
        } else {
            // Never live: offset 0, only has to fit.
            size = size.max(iv.size);
        }
    }
    order.sort_by_key(|&i| (intervals[i].lower, i));
    // Live buffers by end; free ranges `[start, end)` below `top`, by start and by
    // (length, start).
    let mut ends: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut by_start: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut by_len: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut top = 0u64;
    for &i in &order {
        let iv = intervals[i];
        while let Some(&Reverse((end, j))) = ends.peek() {
            if end > iv.lower {
                break;
            }
            ends.pop();
            let (mut a, mut b) = (offsets[j], offsets[j].saturating_add(intervals[j].size));
            // Merge with the free ranges touching it.
            if let Some(&(s, e)) = by_start.range(..(a, u64::MAX)).next_back() {
                if e == a {
                    by_start.remove(&(s, e));
                    by_len.remove(&(e - s, s));
                    a = s;
                }
            }
            if let Some(&(s, e)) = by_start.range((b, 0)..).next() {
                if s == b {
                    by_start.remove(&(s, e));
                    by_len.remove(&(e - s, s));
                    b = e;
                }
            }
            if b >= top {
                top = a;
            } else {
                by_start.insert((a, b));
                by_len.insert((b - a, a));
            }
        }
        // Smallest free range that fits once its start is aligned, the lowest on ties.
        let mut best: Option<(u64, u64, u64)> = None; // (usable length, offset, range start)
        for &(len, s) in by_len.range((iv.size, 0)..) {
            // Aligning the start loses less than `align` bytes: no longer range can do
            // better (unaligned, the first that fits is the best: the shortest, lowest).
            if best.is_some_and(|(l, ..)| align == 1 || len >= l.saturating_add(align)) {
                break;
            }
            let o = round_up(s, align);
            let usable = (s + len).saturating_sub(o);
            if usable >= iv.size && best.is_none_or(|(l, bo, _)| (usable, o) < (l, bo)) {
                best = Some((usable, o, s));
            }
        }
        let off = match best {
            Some((_, o, s)) => {
                let e = by_start.range((s, 0)..).next().map_or(s, |&(_, e)| e);
                by_start.remove(&(s, e));
                by_len.remove(&(e - s, s));
                for (a, b) in [(s, o), (o + iv.size, e)] {
                    if b > a {
                        by_start.insert((a, b));
                        by_len.insert((b - a, a));
                    }
                }
                o
            }
            None => {
                let o = round_up(top, align);
                if o > top {
                    by_start.insert((top, o));
                    by_len.insert((o - top, top));
                }
                top = o.saturating_add(iv.size);
                o
            }
        };
        offsets[i] = off;
        size = size.max(off.saturating_add(iv.size));
        ends.push(Reverse((iv.upper, i)));
    }
    Placement {
        offsets,
        size,
        method,
    }
}

/// Static tie-break orders of the skyline search: among buffers that would go to the same
/// offset, which is tried first. Each (sub)partition ranks its buffers afresh when its
/// search starts, "congestion" being the largest total size of unplaced buffers in a
/// section the buffer lives through, in the current state. Restarts cycle through the
/// orders (see [`search`]); no single one of them solves all the hard benchmarks quickly,
/// the round robin does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Preorder {
    /// Longest lifetime first, then area (size × lifetime), then congestion.
    WidthAreaTotal,
    /// Most congested first, then area, then lifetime.
    TotalAreaWidth,
    /// Most congested first, then lifetime, then area.
    TotalWidthArea,
}

impl Preorder {
    /// The sort key (larger first).
    fn key(self, total: u64, width: u64, area: u64) -> (u64, u64, u64) {
        match self {
            Preorder::WidthAreaTotal => (width, area, total),
            Preorder::TotalAreaWidth => (total, area, width),
            Preorder::TotalWidthArea => (total, width, area),
        }
    }
}

/// The preorders restarts cycle through, in this order.
const PREORDERS: [Preorder; 3] = [
    Preorder::WidthAreaTotal,
    Preorder::TotalAreaWidth,
    Preorder::TotalWidthArea,
];

/// The immutable part of one capacity search, shared by all workers.
struct Problem {
    /// The live buffers (non-zero size and lifetime), in input order.
    iv: Vec<Interval>,
    align: u64,
    cap: u64,
    /// Section range `[first, last)` of each buffer.
    secs: Vec<(usize, usize)>,
    /// Buffers alive in each section.
    members: Vec<Vec<usize>>,
    /// Buffers whose lifetimes overlap each buffer's.
    overlaps: Vec<Vec<usize>>,
    /// Section range covered by each buffer and the buffers it overlaps: the sections
    /// placing it can change.
    reach: Vec<(usize, usize)>,
    /// Per section: total size of the buffers alive there.
    rem: Vec<u64>,
    /// Per section boundary `k` (between sections k and k+1): buffers crossing it.
    cuts: Vec<usize>,
    /// Independent partitions: section ranges no buffer crosses out of, with their
    /// buffers.
    parts: Vec<(Vec<usize>, (usize, usize))>,
}

/// Largest problem [`search`] takes on, in (buffer, section) memberships plus overlapping
/// pairs: beyond it the search would mostly be slow and memory hungry.
const MAX_PROBLEM: usize = 1 << 22;

impl Problem {
    /// Preprocesses the live buffers of `intervals`; `None` if the problem is too large.
    fn new(intervals: &[Interval], cap: u64, align: u64) -> Option<Problem> {
        let iv: Vec<Interval> = intervals
            .iter()
            .copied()
            .filter(|v| v.size > 0 && v.is_live())
            .collect();
        let mut points: Vec<u64> = iv.iter().flat_map(|v| [v.lower, v.upper]).collect();
        points.sort_unstable();
        points.dedup();
        let sec = |t: u64| points.binary_search(&t).unwrap_or_else(|p| p);
        let secs: Vec<(usize, usize)> = iv.iter().map(|v| (sec(v.lower), sec(v.upper))).collect();
        let nsec = points.len().saturating_sub(1);
        if secs.iter().map(|&(s, e)| e - s).sum::<usize>() > MAX_PROBLEM {
            return None;
        }
        let mut rem = vec![0u64; nsec];
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); nsec];
        for (b, (v, &(s, e))) in iv.iter().zip(&secs).enumerate() {
            for k in s..e {
                rem[k] = rem[k].saturating_add(v.size);
                members[k].push(b);
            }
        }
        let mut overlaps: Vec<Vec<usize>> = vec![Vec::new(); iv.len()];
        let mut by_start: Vec<usize> = (0..iv.len()).collect();
        by_start.sort_by_key(|&b| iv[b].lower);
        let mut pairs = 0usize;
        for (k, &a) in by_start.iter().enumerate() {
            for &b in &by_start[k + 1..] {
                if iv[b].lower >= iv[a].upper {
                    break;
                }
                overlaps[a].push(b);
                overlaps[b].push(a);
                pairs += 1;
            }
            if pairs > MAX_PROBLEM {
                return None;
            }
        }
        let reach: Vec<(usize, usize)> = (0..iv.len())
            .map(|b| {
                overlaps[b]
                    .iter()
                    .fold(secs[b], |(s, e), &o| (s.min(secs[o].0), e.max(secs[o].1)))
            })
            .collect();
        let mut cuts = vec![0usize; nsec.saturating_sub(1)];
        for &(s, e) in &secs {
            for c in &mut cuts[s..e.saturating_sub(1)] {
                *c += 1;
            }
        }
        // Initial partitions: split where no buffer crosses a section boundary.
        let mut part_of = vec![0usize; nsec];
        let mut ranges = Vec::new();
        let mut start = 0;
        for end in 1..=nsec {
            if end == nsec || cuts[end - 1] == 0 {
                part_of[start..end].fill(ranges.len());
                ranges.push((start, end));
                start = end;
            }
        }
        let mut part_bufs: Vec<Vec<usize>> = vec![Vec::new(); ranges.len()];
        for (b, &(s, _)) in secs.iter().enumerate() {
            part_bufs[part_of[s]].push(b);
        }
        let parts = part_bufs
            .into_iter()
            .zip(ranges)
            .filter(|(bufs, _)| !bufs.is_empty())
            .collect();
        Some(Problem {
            iv,
            align,
            cap,
            secs,
            members,
            overlaps,
            reach,
            rem,
            cuts,
            parts,
        })
    }
}

/// How a (sub)search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Found,
    NotFound,
    /// The node limit of this restart was reached.
    Aborted,
    /// Another worker finished an earlier restart: this one no longer matters.
    Cancelled,
}

/// Work (buffers scanned, plus 64 a node) between two looks at the other workers.
const POLL_WORK: u64 = 1 << 16;

/// Most candidates a search node sorts at a time.
const BATCH: usize = 32;

/// The minimum offset of a placed buffer: above every capacity, so that a placed buffer
/// never counts as one that could still go low, nor gets raised.
const PLACED: u64 = u64::MAX;

/// The skyline search (see the module doc) for a fixed capacity: the mutable state of one
/// worker. Minimum offsets and section totals are updated incrementally and undone on
/// backtrack.
///
/// Invariant of every search state: in every section, the lowest minimum offset of its
/// unplaced buffers plus their total size fits under the capacity (section inference).
/// [`Search::admissible`] checks that a placement keeps it before the placement is made.
struct Search<'p> {
    p: &'p Problem,
    order: Preorder,
    /// Lowest offset each unplaced buffer can take (the aligned top of the placed buffers
    /// it meets); [`PLACED`] once placed (its offset is then in `offsets`).
    min_off: Vec<u64>,
    /// Per section: total size of the unplaced buffers alive there.
    rem: Vec<u64>,
    /// Per section: an unplaced buffer that recently had a low minimum offset there (a
    /// hint that speeds up [`Search::admissible`] and never changes its answer).
    witness: Vec<usize>,
    offsets: Vec<u64>,
    /// Offsets of solved partitions.
    solution: Vec<u64>,
    /// Per section boundary: unplaced buffers crossing it.
    cuts: Vec<usize>,
    /// Rank of each buffer in its partition's preorder.
    rank: Vec<usize>,
    /// Undo log: (buffer, minimum offset before it was raised).
    log: Vec<(usize, u64)>,
    /// Candidates (offset, rank, buffer) of the search nodes on the current path.
    cands: Vec<(u64, usize, usize)>,
    nodes: u64,
    node_limit: u64,
    /// Work done (buffers scanned) and when to look at the other workers next.
    work: u64,
    next_poll: u64,
    /// Set once the search must stop (cancellation).
    halt: Option<Status>,
    /// The lowest restart index that has finished (found or proved infeasible) in any
    /// worker, and this restart's index: a later restart is cancelled.
    finished: Option<(&'p AtomicUsize, usize)>,
}

impl<'p> Search<'p> {
    fn new(p: &'p Problem) -> Search<'p> {
        let n = p.iv.len();
        Search {
            p,
            order: PREORDERS[0],
            min_off: vec![0; n],
            rem: p.rem.clone(),
            witness: p
                .members
                .iter()
                .map(|m| m.first().copied().unwrap_or(0))
                .collect(),
            offsets: vec![0; n],
            solution: vec![0; n],
            cuts: p.cuts.clone(),
            rank: vec![0; n],
            log: Vec::new(),
            cands: Vec::new(),
            nodes: 0,
            node_limit: u64::MAX,
            work: 0,
            next_poll: 0,
            halt: None,
            finished: None,
        }
    }

    /// One restart: solves every initial partition with the current preorder and limit.
    fn run(&mut self) -> Status {
        let p = self.p;
        self.nodes = 0;
        self.halt = None;
        for (bufs, range) in &p.parts {
            let status = self.solve_partition(bufs, *range);
            if status != Status::Found {
                return status;
            }
        }
        Status::Found
    }

    /// Checks the other workers.
    fn poll(&mut self) {
        if let Some((done, me)) = self.finished {
            if done.load(Ordering::Relaxed) < me {
                self.halt = Some(Status::Cancelled);
            }
        }
    }

    /// Whether placing `b` at `off` keeps the invariant (see [`Search`]) in the sections
    /// of `range` it can change: those of `b` (their totals drop, and all their other
    /// unplaced buffers meet `b`, so rise to at least its top) and those of the unplaced
    /// buffers `b` meets (which rise). Everywhere else nothing changes. Every unplaced
    /// buffer `b` meets lies in `range`.
    fn admissible(&mut self, b: usize, off: u64, range: (usize, usize)) -> bool {
        let p = self.p;
        let size = p.iv[b].size;
        let top = round_up(off + size, p.align);
        let (s, e) = p.secs[b];
        let (rs, re) = p.reach[b];
        for k in rs.max(range.0)..re.min(range.1) {
            let inside = s <= k && k < e;
            let r = if inside {
                self.rem[k] - size
            } else {
                self.rem[k]
            };
            if r == 0 {
                continue;
            }
            // The lowest unplaced buffer here must end up at or below `limit`.
            let Some(limit) = p.cap.checked_sub(r) else {
                return false;
            };
            if top <= limit {
                if !inside {
                    // The lowest buffer here stays put or rises to `top`: still fits.
                    continue;
                }
            } else if inside {
                // Every other buffer here rises to at least `top`.
                return false;
            }
            // Is there an unplaced buffer here that stays at or below `limit`? (A buffer
            // that meets `b` rises to `top`.)
            let fits = |o: usize| {
                let x = self.min_off[o];
                if x > limit || o == b {
                    return false;
                }
                let (os, oe) = p.secs[o];
                top <= limit || oe <= s || e <= os
            };
            if fits(self.witness[k]) {
                continue;
            }
            match p.members[k].iter().copied().find(|&o| fits(o)) {
                Some(o) => self.witness[k] = o,
                None => return false,
            }
        }
        true
    }

    /// Places `b` at `off` (its minimum offset); returns the undo-log mark.
    fn place(&mut self, b: usize, off: u64) -> usize {
        let p = self.p;
        let mark = self.log.len();
        let size = p.iv[b].size;
        self.min_off[b] = PLACED;
        self.offsets[b] = off;
        let (s, e) = p.secs[b];
        for r in &mut self.rem[s..e] {
            *r -= size;
        }
        let top = round_up(off + size, p.align);
        for &o in &p.overlaps[b] {
            let old = self.min_off[o];
            if old < top {
                self.log.push((o, old));
                self.min_off[o] = top;
            }
        }
        mark
    }

    fn unplace(&mut self, b: usize, mark: usize) {
        for &(o, v) in self.log[mark..].iter().rev() {
            self.min_off[o] = v;
        }
        self.log.truncate(mark);
        let size = self.p.iv[b].size;
        let (s, e) = self.p.secs[b];
        for r in &mut self.rem[s..e] {
            *r += size;
        }
        self.min_off[b] = self.offsets[b];
    }

    /// Solves the (all unplaced) buffers of one partition, a section range no unplaced
    /// buffer outside it crosses, from scratch: its placements are independent of every
    /// other partition's. The partition's buffers are ranked afresh for it.
    fn solve_partition(&mut self, bufs: &[usize], range: (usize, usize)) -> Status {
        let p = self.p;
        let saved: Vec<usize> = bufs.iter().map(|&b| self.rank[b]).collect();
        let mut keyed: Vec<((u64, u64, u64), usize)> = bufs
            .iter()
            .map(|&b| {
                let (s, e) = p.secs[b];
                let total = self.rem[s..e].iter().copied().max().unwrap_or(0);
                let v = p.iv[b];
                let width = v.upper - v.lower;
                (
                    self.order.key(total, width, v.size.saturating_mul(width)),
                    b,
                )
            })
            .collect();
        keyed.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
        for (r, &(_, b)) in keyed.iter().enumerate() {
            self.rank[b] = r;
        }
        let status = self.dfs(bufs, range, bufs.len(), (0, 0));
        for (&b, &r) in bufs.iter().zip(&saved) {
            self.rank[b] = r;
        }
        status
    }

    /// Places the `left` unplaced buffers of `bufs` (a partition over the sections
    /// `range`). `last` is the (offset, rank) of the previous placement: placements are
    /// made in increasing (offset, rank) order, which every normalised packing has.
    fn dfs(
        &mut self,
        bufs: &[usize],
        range: (usize, usize),
        left: usize,
        last: (u64, usize),
    ) -> Status {
        if left == 0 {
            for &b in bufs {
                self.solution[b] = self.offsets[b];
            }
            return Status::Found;
        }
        self.nodes += 1;
        if self.nodes >= self.node_limit {
            return Status::Aborted;
        }
        // Look at the other workers every few hundred nodes, or more often when nodes are
        // big.
        self.work += 64 + bufs.len() as u64;
        if self.work >= self.next_poll {
            self.next_poll = self.work + POLL_WORK;
            self.poll();
        }
        if let Some(status) = self.halt {
            return status;
        }
        let p = self.p;
        // Monotone floor: every later buffer goes at or above the next one's offset, so
        // that offset plus the largest section total must fit.
        let most = self.rem[range.0..range.1]
            .iter()
            .copied()
            .max()
            .unwrap_or(0);
        let Some(max_off) = p.cap.checked_sub(most) else {
            return Status::NotFound;
        };
        let mut min_height = u64::MAX;
        for &b in bufs {
            let off = self.min_off[b];
            if off == PLACED {
                continue;
            }
            let top = off.saturating_add(p.iv[b].size);
            if top > p.cap {
                return Status::NotFound;
            }
            min_height = min_height.min(top);
        }
        // Candidates: in a normalised packing every buffer rests on the highest placed
        // buffer it meets (or on 0), so its offset is exactly its current minimum offset.
        // Dominance: a placement at or above the top of some unplaced buffer would leave a
        // gap that buffer could drop into. They are tried in (offset, rank) order, taken
        // in batches of at most `BATCH` (on the shared `cands` stack) to bound memory.
        let limit = max_off.min(min_height.saturating_sub(1));
        let base = self.cands.len();
        let mut after = last;
        let mut first = true;
        loop {
            for &b in bufs {
                let off = self.min_off[b];
                if off > limit {
                    continue;
                }
                let key = (off, self.rank[b]);
                if key > after || (first && key == after) {
                    self.cands.push((off, self.rank[b], b));
                }
            }
            first = false;
            let more = self.cands.len() - base > BATCH;
            if more {
                self.cands[base..].select_nth_unstable(BATCH - 1);
                self.cands.truncate(base + BATCH);
            }
            self.cands[base..].sort_unstable();
            for i in base..self.cands.len() {
                let (off, rank, b) = self.cands[i];
                after = (off, rank);
                if !self.admissible(b, off, range) {
                    continue;
                }
                let mark = self.place(b, off);
                let status = self.decompose(bufs, range, left - 1, b, (off, rank));
                self.unplace(b, mark);
                if status != Status::NotFound {
                    self.cands.truncate(base);
                    return status;
                }
            }
            self.cands.truncate(base);
            if !more {
                return Status::NotFound;
            }
        }
    }

    /// After placing `b`: if no unplaced buffer crosses some section boundaries any more,
    /// the rest splits into independent partitions, each solved on its own (a failure in
    /// one fails them all; a success is never revisited).
    fn decompose(
        &mut self,
        bufs: &[usize],
        range: (usize, usize),
        left: usize,
        b: usize,
        last: (u64, usize),
    ) -> Status {
        // Recorded now: on success nothing overwrites it (partitions solved below restore
        // the search state, not the recorded solution).
        self.solution[b] = self.offsets[b];
        let (s, e) = self.p.secs[b];
        let mut split = false;
        for k in s..e.saturating_sub(1) {
            self.cuts[k] -= 1;
            split |= self.cuts[k] == 0 && k + 1 > range.0 && k + 1 < range.1;
        }
        let status = if !split || left == 0 {
            self.dfs(bufs, range, left, last)
        } else {
            let mut cutpoints = vec![range.0];
            cutpoints.extend(
                (s..e.saturating_sub(1))
                    .filter(|&k| self.cuts[k] == 0 && k + 1 > range.0 && k + 1 < range.1)
                    .map(|k| k + 1),
            );
            cutpoints.push(range.1);
            // No unplaced buffer crosses a cut point: each lies in one window.
            let last_window = cutpoints.len() - 2;
            let mut windows: Vec<Vec<usize>> = vec![Vec::new(); last_window + 1];
            for &o in bufs {
                if self.min_off[o] != PLACED {
                    let w = cutpoints.partition_point(|&c| c <= self.p.secs[o].0);
                    windows[w.saturating_sub(1).min(last_window)].push(o);
                }
            }
            let mut status = Status::Found;
            for (w, sub_bufs) in windows.iter().enumerate() {
                if sub_bufs.is_empty() {
                    continue;
                }
                status = self.solve_partition(sub_bufs, (cutpoints[w], cutpoints[w + 1]));
                if status != Status::Found {
                    break;
                }
            }
            status
        };
        for k in s..e.saturating_sub(1) {
            self.cuts[k] += 1;
        }
        status
    }
}

/// Result of a capacity search.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SearchOutcome {
    Found(Placement),
    /// Proven impossible at this capacity.
    Infeasible,
    /// The budget ran out first.
    Unknown,
}

/// Most worker threads one search uses.
const MAX_WORKERS: usize = 4;

/// Units of search work (64 a node, plus the buffers it scans) that make a millisecond of
/// a budget: about what one core of a current x86-64 server does in one. Budgets are
/// counted in work, never on a clock, so a plan is the same on every machine and under any
/// load.
pub const WORK_PER_MS: u64 = 250_000;

/// The work a budget of `budget` allows.
pub fn work_of(budget: Duration) -> u64 {
    u64::try_from(budget.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_mul(WORK_PER_MS)
}

/// Searches for a placement within `capacity` (see the module doc) with the work `budget`
/// allows ([`work_of`]). Heavy-tailed depth-first search is tamed by restarts: restart `j`
/// uses preorder `j mod 3` and a node limit that doubles every round of three (as
/// MiniMalloc's round robin does); the budget decides, before any runs, how many restarts
/// may (their node limits times the most work a node can take; the first always runs, so
/// a large problem is searched at all). Restarts run on up to
/// [`MAX_WORKERS`] threads (as many as the machine has cores); the result is that of the
/// lowest-numbered restart that finished, the same as one thread returns: deterministic.
pub fn search(
    intervals: &[Interval],
    capacity: u64,
    align: u64,
    budget: Duration,
) -> SearchOutcome {
    search_with(intervals, capacity, align, work_of(budget), workers()).0
}

/// Threads for a search: the machine's cores, at most [`MAX_WORKERS`].
fn workers() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_WORKERS)
}

/// One restart's result: its index, how it ended, its work, and the solution if it found
/// one.
type Finish = (usize, Status, u64, Vec<u64>);

/// [`search`] with a work allowance and a given number of worker threads; also returns the
/// work charged: that of every restart up to the one whose result is returned (all of
/// them when none finished), which does not depend on the threads.
fn search_with(
    intervals: &[Interval],
    capacity: u64,
    align: u64,
    allowance: u64,
    workers: usize,
) -> (SearchOutcome, u64) {
    let align = align.max(1);
    // Buffers that are never live go at offset 0 and only need to fit.
    if intervals.iter().any(|v| v.size > capacity) {
        return (SearchOutcome::Infeasible, 0);
    }
    let Some(p) = Problem::new(intervals, capacity, align) else {
        return (SearchOutcome::Unknown, 0);
    };
    if p.rem.iter().any(|&r| r > capacity) {
        return (SearchOutcome::Infeasible, 0);
    }
    let base = (p.iv.len() as u64).max(64);
    let limit = |j: usize| base.saturating_mul(2u64 << (j / PREORDERS.len()).min(60));
    // The restarts the allowance pays for, each at its most work (a node scans its
    // partition, at most the largest initial one); the first always runs.
    let widest = p.parts.iter().map(|(b, _)| b.len()).max().unwrap_or(0) as u64;
    let per_node = 64 + widest;
    let (mut restarts, mut cost) = (0usize, 0u64);
    while restarts < 61 * PREORDERS.len() {
        cost = cost.saturating_add(limit(restarts).saturating_mul(per_node));
        if cost > allowance && restarts > 0 {
            break;
        }
        restarts += 1;
    }
    if allowance == 0 {
        return (SearchOutcome::Unknown, 0);
    }
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(usize::MAX);
    let work = || -> Vec<Finish> {
        let mut s = Search::new(&p);
        let mut done = Vec::new();
        loop {
            let j = next.fetch_add(1, Ordering::Relaxed);
            if j >= restarts || j >= finished.load(Ordering::Relaxed) {
                return done;
            }
            s.order = PREORDERS[j % PREORDERS.len()];
            s.node_limit = limit(j);
            s.finished = Some((&finished, j));
            let before = s.work;
            let status = s.run();
            let spent = s.work - before;
            match status {
                Status::Found | Status::NotFound => {
                    finished.fetch_min(j, Ordering::Relaxed);
                    let sol = if status == Status::Found {
                        std::mem::take(&mut s.solution)
                    } else {
                        Vec::new()
                    };
                    done.push((j, status, spent, sol));
                    return done;
                }
                Status::Aborted => done.push((j, status, spent, Vec::new())),
                Status::Cancelled => {}
            }
        }
    };
    // The search recurses once per placed buffer: give it a stack to match.
    let stack = (8 << 20) + p.iv.len() * 2048;
    let results: Vec<Finish> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers.max(1))
            .filter_map(|_| {
                std::thread::Builder::new()
                    .stack_size(stack)
                    .spawn_scoped(scope, work)
                    .ok()
            })
            .collect();
        if handles.is_empty() {
            // No thread could be started: search on this one.
            return work();
        }
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .flatten()
            .collect()
    });
    // Every restart below the lowest finished one ran to its node limit (only a lower
    // restart's finish cancels one), so this charge is the same on any number of threads.
    let winner = results
        .iter()
        .filter(|r| r.1 != Status::Aborted)
        .map(|r| r.0)
        .min();
    let charged: u64 = results
        .iter()
        .filter(|r| winner.is_none_or(|w| r.0 <= w))
        .map(|r| r.2)
        .sum();
    let best = results.into_iter().find(|r| Some(r.0) == winner);
    if std::env::var_os("TCC_ARENA_DEBUG").is_some() {
        eprintln!(
            "arena search at {capacity}: {restarts} restarts allowed, work {charged} on {workers} threads, {}",
            match &best {
                Some((j, status, ..)) => format!("restart {j}: {status:?}"),
                None => "no result".to_string(),
            }
        );
    }
    let outcome = match best {
        Some((_, Status::Found, _, sol)) => {
            let mut offsets = vec![0u64; intervals.len()];
            let live =
                (0..intervals.len()).filter(|&i| intervals[i].size > 0 && intervals[i].is_live());
            for (i, off) in live.zip(sol) {
                offsets[i] = off;
            }
            let size = intervals
                .iter()
                .zip(&offsets)
                .map(|(v, &o)| o + v.size)
                .max()
                .unwrap_or(0);
            SearchOutcome::Found(Placement {
                offsets,
                size,
                method: "skyline search",
            })
        }
        Some(_) => SearchOutcome::Infeasible,
        None => SearchOutcome::Unknown,
    };
    (outcome, charged)
}

/// What [`plan`] found and how.
#[derive(Clone, Debug)]
pub struct PlanReport {
    pub placement: Placement,
    pub lower_bound: u64,
    /// The heuristics that ran before any search, with the arena each gave.
    pub heuristics: Vec<(&'static str, u64)>,
    /// True when the arena equals the lower bound or the search proved nothing smaller fits.
    pub optimal: bool,
}

impl PlanReport {
    /// The smallest arena a heuristic gave (what the search started from).
    pub fn best_heuristic(&self) -> u64 {
        self.heuristics
            .iter()
            .map(|&(_, size)| size)
            .min()
            .unwrap_or(self.placement.size)
    }
}

/// Greedy solvers, then the skyline search within the work `budget` allows ([`work_of`];
/// see the module doc); one [`sweep`] instead past [`MAX_PROBLEM`] overlapping pairs.
pub fn plan(intervals: &[Interval], align: u64, budget: Duration) -> PlanReport {
    let align = align.max(1);
    let n = intervals.len();
    let width = |i: usize| intervals[i].upper.saturating_sub(intervals[i].lower);
    let mut by_size: Vec<usize> = (0..n).collect();
    by_size.sort_by_key(|&i| {
        (
            std::cmp::Reverse(intervals[i].size),
            std::cmp::Reverse(width(i)),
            i,
        )
    });
    let mut by_life: Vec<usize> = (0..n).collect();
    by_life.sort_by_key(|&i| {
        (
            std::cmp::Reverse(width(i)),
            std::cmp::Reverse(intervals[i].size),
            i,
        )
    });
    let lb_live = max_live(intervals);
    if overlapping_pairs(intervals, MAX_PROBLEM as u64) > MAX_PROBLEM as u64 {
        // Too many buffers live together for the greedy solvers (quadratic then) and the
        // search (which would refuse the problem): one sweep in time order.
        let placement = sweep(intervals, align, "sweep in time order");
        let step = granularity(intervals, align);
        let largest = intervals.iter().map(|v| v.size).max().unwrap_or(0);
        let lb = round_up(lb_live.max(largest), step).min(placement.size);
        return PlanReport {
            optimal: placement.size <= lb,
            heuristics: vec![(placement.method, placement.size)],
            placement,
            lower_bound: lb,
        };
    }
    let a = greedy(intervals, &by_size, align, "greedy by size");
    let b = greedy(intervals, &by_life, align, "greedy by lifetime");
    let (gs, gl) = (a.size, b.size);
    let mut best = if b.size < a.size { b } else { a };
    // Only capacities that are multiples of `step` need trying (see `granularity`).
    let step = granularity(intervals, align);
    let largest = intervals.iter().map(|v| v.size).max().unwrap_or(0);
    let lb = round_up(lb_live.max(largest), step).min(best.size);
    // Capacities below `lo` are ruled out (proved infeasible while `proved`); `hi` fits.
    let (mut lo, mut hi) = (lb, best.size);
    let mut proved = true;
    let mut left = work_of(budget);
    let workers = workers();
    while lo < hi {
        if left == 0 {
            break;
        }
        let cap = if lo == lb {
            lo
        } else {
            lo + (hi - lo) / step / 2 * step
        };
        let slice = if cap == lb { left / 5 * 3 } else { left / 2 };
        let (outcome, spent) = search_with(intervals, cap, align, slice, workers);
        left = left.saturating_sub(spent.max(1));
        match outcome {
            SearchOutcome::Found(p) => {
                hi = p.size;
                best = p;
            }
            SearchOutcome::Infeasible => lo = cap.saturating_add(step),
            SearchOutcome::Unknown => {
                // Not proved; look higher, where it is easier.
                lo = cap.saturating_add(step);
                proved = false;
            }
        }
    }
    let optimal = best.size <= lb || (proved && lo >= hi);
    PlanReport {
        placement: best,
        lower_bound: lb,
        heuristics: vec![("greedy by size", gs), ("greedy by lifetime", gl)],
        optimal,
    }
}

/// Parses a MiniMalloc CSV (`id,lower,upper,size`, or `begin,end` with inclusive ends).
pub fn parse_csv(text: &str) -> Result<(Vec<String>, Vec<Interval>), String> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or("empty file")?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |names: &[&str]| cols.iter().position(|c| names.contains(c));
    let id = col(&["id", "buffer"]).ok_or("no `id` column")?;
    let (lo, hi, inclusive) = match (
        col(&["lower"]),
        col(&["upper"]),
        col(&["begin", "start"]),
        col(&["end"]),
    ) {
        (Some(l), Some(u), _, _) => (l, u, false),
        (_, _, Some(b), Some(e)) => (b, e, true),
        _ => return Err("need `lower,upper` (or `begin,end`) columns".into()),
    };
    let size = col(&["size"]).ok_or("no `size` column")?;
    let mut ids = Vec::new();
    let mut out = Vec::new();
    let mut total: u64 = 0;
    for (ln, line) in lines {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |k: usize| -> Result<u64, String> {
            f.get(k)
                .ok_or(format!("line {}: missing column", ln + 1))?
                .parse::<u64>()
                .map_err(|e| format!("line {}: {e}", ln + 1))
        };
        let (l, mut u, s) = (get(lo)?, get(hi)?, get(size)?);
        if inclusive {
            u = u
                .checked_add(1)
                .ok_or(format!("line {}: end {u} is too large", ln + 1))?;
        }
        // Offsets are sums of sizes: all of them together must fit.
        total = total
            .checked_add(s)
            .ok_or(format!("line {}: the sizes add up past 2^64 bytes", ln + 1))?;
        if u < l {
            return Err(format!("line {}: upper {u} before lower {l}", ln + 1));
        }
        ids.push(f.get(id).unwrap_or(&"").to_string());
        out.push(Interval {
            lower: l,
            upper: u,
            size: s,
        });
    }
    Ok((ids, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(lower: u64, upper: u64, size: u64) -> Interval {
        Interval { lower, upper, size }
    }

    const LONG: Duration = Duration::from_secs(20);

    /// Intervals and sizes at the top of `u64` are errors, not wrapped numbers.
    #[test]
    fn csv_numbers_that_would_overflow_are_errors() {
        let max = u64::MAX;
        let e = parse_csv(&format!("id,begin,end,size\n0,0,{max},4\n")).unwrap_err();
        assert!(e.contains("too large"), "{e}");
        let e = parse_csv(&format!("id,lower,upper,size\n0,0,2,{max}\n1,0,2,1\n")).unwrap_err();
        assert!(e.contains("past 2^64"), "{e}");
        assert!(parse_csv("id,lower,upper,size\n0,0,2,4\n").is_ok());
    }

    /// The 5-buffer example of the MiniMalloc README (`input.12.csv`): optimum 12.
    fn example12() -> Vec<Interval> {
        vec![
            iv(0, 3, 4),
            iv(3, 9, 4),
            iv(0, 9, 4),
            iv(9, 21, 4),
            iv(0, 21, 4),
        ]
    }

    /// A small deterministic PRNG (xorshift64*), so that the tests need no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Every third round: the first buffer never live and a random one of size 0.
    fn with_edge_cases(rng: &mut Rng, mut v: Vec<Interval>, round: usize) -> Vec<Interval> {
        if !v.is_empty() && round.is_multiple_of(3) {
            v[0].upper = v[0].lower;
            let k = rng.below(v.len() as u64) as usize;
            v[k].size = 0;
        }
        v
    }

    fn random_instance(rng: &mut Rng, n: usize, horizon: u64, max_size: u64) -> Vec<Interval> {
        (0..n)
            .map(|_| {
                let a = rng.below(horizon);
                let len = 1 + rng.below(horizon / 3 + 1);
                iv(a, (a + len).min(horizon), 1 + rng.below(max_size))
            })
            .collect()
    }

    /// The optimum by brute force: first fit (lowest offset that fits) over every order.
    /// First fit in the offset order of an optimal packing never goes higher than it, so
    /// this is exact.
    fn brute_force(intervals: &[Interval]) -> u64 {
        fn go(intervals: &[Interval], offs: &mut Vec<(usize, u64)>, used: u64, best: &mut u64) {
            if used >= *best {
                return;
            }
            if offs.len() == intervals.len() {
                *best = used;
                return;
            }
            for i in 0..intervals.len() {
                if offs.iter().any(|&(j, _)| j == i) {
                    continue;
                }
                let v = intervals[i];
                let mut busy: Vec<(u64, u64)> = offs
                    .iter()
                    .filter(|&&(j, _)| intervals[j].overlaps(&v))
                    .map(|&(j, o)| (o, o + intervals[j].size))
                    .collect();
                busy.sort_unstable();
                let mut off = 0;
                for (s, e) in busy {
                    if s >= off + v.size {
                        break;
                    }
                    off = off.max(e);
                }
                offs.push((i, off));
                go(intervals, offs, used.max(off + v.size), best);
                offs.pop();
            }
        }
        let mut best = u64::MAX;
        go(intervals, &mut Vec::new(), 0, &mut best);
        best
    }

    fn found(outcome: SearchOutcome) -> Placement {
        match outcome {
            SearchOutcome::Found(p) => p,
            other => panic!("expected a placement, got {other:?}"),
        }
    }

    #[test]
    fn example_12_is_solved_optimally() {
        let v = example12();
        assert_eq!(max_live(&v), 12);
        let r = plan(&v, 1, LONG);
        verify(&v, &r.placement, 1).unwrap();
        assert_eq!(r.placement.size, 12);
        assert!(r.optimal);
        let p = found(search(&v, 12, 1, LONG));
        verify(&v, &p, 1).unwrap();
        assert!(p.size <= 12);
        assert_eq!(search(&v, 11, 1, LONG), SearchOutcome::Infeasible);
    }

    /// Seven buffers with max-live 4 that need 5 (after MiniMalloc's solver tests): the
    /// size-1 buffers must take turns at the edges, which the size-3 ones block.
    fn tricky() -> Vec<Interval> {
        vec![
            iv(0, 1, 3),
            iv(0, 3, 1),
            iv(4, 5, 3),
            iv(2, 5, 1),
            iv(1, 2, 2),
            iv(3, 4, 2),
            iv(1, 4, 1),
        ]
    }

    #[test]
    fn impossible_capacity_is_infeasible() {
        let v = tricky();
        assert_eq!(max_live(&v), 4);
        assert_eq!(brute_force(&v), 5);
        assert_eq!(search(&v, 4, 1, LONG), SearchOutcome::Infeasible);
        verify(&v, &found(search(&v, 5, 1, LONG)), 1).unwrap();
        // Below max-live or below the largest buffer: infeasible at once.
        assert_eq!(search(&v, 3, 1, LONG), SearchOutcome::Infeasible);
        assert_eq!(
            search(&[iv(0, 1, 5)], 4, 1, LONG),
            SearchOutcome::Infeasible
        );
        let r = plan(&v, 1, LONG);
        verify(&v, &r.placement, 1).unwrap();
        assert_eq!((r.lower_bound, r.placement.size), (4, 5));
        assert!(r.optimal);
        // The same next to an easy partition, scaled, and repeated later in time.
        let mut w: Vec<Interval> = v
            .iter()
            .map(|x| iv(x.lower, x.upper, x.size * 1024))
            .collect();
        w.push(iv(5, 9, 4096));
        w.extend(
            v.iter()
                .map(|x| iv(x.lower + 9, x.upper + 9, x.size * 1024)),
        );
        assert_eq!(search(&w, 4 * 1024, 1, LONG), SearchOutcome::Infeasible);
        let r = plan(&w, 1, LONG);
        verify(&w, &r.placement, 1).unwrap();
        assert_eq!(r.placement.size, 5 * 1024);
        assert!(r.optimal);
    }

    #[test]
    fn degenerate_buffers() {
        // Empty lifetimes and zero sizes: never live, offset 0, only have to fit.
        let v = vec![iv(3, 3, 10), iv(0, 4, 0), iv(0, 4, 4), iv(2, 6, 4)];
        let r = plan(&v, 1, LONG);
        verify(&v, &r.placement, 1).unwrap();
        assert_eq!(r.placement.size, 10);
        assert_eq!(r.lower_bound, 10);
        assert!(r.optimal);
        assert_eq!(search(&v, 9, 1, LONG), SearchOutcome::Infeasible);
        verify(&v, &found(search(&v, 10, 1, LONG)), 1).unwrap();
        // Nothing at all.
        let r = plan(&[], 1, LONG);
        assert_eq!(r.placement.size, 0);
        assert!(r.optimal);
        assert_eq!(
            search(&[], 0, 1, LONG),
            SearchOutcome::Found(Placement {
                offsets: vec![],
                size: 0,
                method: "skyline search"
            })
        );
    }

    #[test]
    fn verify_rejects_bad_placements() {
        let v = vec![iv(0, 4, 4), iv(2, 6, 4), iv(6, 8, 4)];
        let p = |offsets: Vec<u64>, size| Placement {
            offsets,
            size,
            method: "test",
        };
        assert_eq!(verify(&v, &p(vec![0, 4, 0], 8), 1), Ok(()));
        assert_eq!(
            verify(&v, &p(vec![0, 2, 0], 8), 1),
            Err(PlacementError::Overlap { a: 0, b: 1 })
        );
        assert_eq!(
            verify(&v, &p(vec![0, 4, 6], 8), 1),
            Err(PlacementError::OutOfArena(2))
        );
        assert_eq!(
            verify(&v, &p(vec![0, 4, 2], 8), 4),
            Err(PlacementError::Misaligned(2, 4))
        );
        assert_eq!(
            verify(&v, &p(vec![0, 4], 8), 1),
            Err(PlacementError::Count(2, 3))
        );
    }

    /// Search against brute force on small random instances: it finds a placement at the
    /// optimum and proves the capacity below it infeasible; `plan` reaches the optimum.
    #[test]
    fn search_matches_brute_force() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for round in 0..300 {
            let n = 1 + (round % 7);
            let v = random_instance(&mut rng, n, 12, 6);
            let opt = brute_force(&v);
            let p = found(search(&v, opt, 1, LONG));
            verify(&v, &p, 1).unwrap();
            assert!(p.size <= opt, "{v:?}");
            assert_eq!(
                search(&v, opt - 1, 1, LONG),
                SearchOutcome::Infeasible,
                "{v:?}"
            );
            let r = plan(&v, 1, LONG);
            verify(&v, &r.placement, 1).unwrap();
            assert_eq!(r.placement.size, opt, "{v:?}");
            assert!(r.optimal, "{v:?}");
        }
    }

    /// `plan` always returns a valid placement between max-live and the greedy results,
    /// with and without alignment, even with a tiny budget.
    #[test]
    fn plan_results_verify() {
        let mut rng = Rng(42);
        for round in 0..200 {
            let n = 1 + rng.below(60) as usize;
            let v = random_instance(&mut rng, n, 40, 64);
            let align = [1, 1, 4, 16][round % 4];
            let budget = Duration::from_millis([0, 1, 20][round % 3]);
            let r = plan(&v, align, budget);
            verify(&v, &r.placement, align).unwrap();
            let size = r.placement.size;
            assert!(
                max_live(&v) <= r.lower_bound && r.lower_bound <= size,
                "{v:?}"
            );
            assert!(size <= r.best_heuristic(), "{v:?}");
            if r.optimal && size > r.lower_bound {
                // Only a proof can claim it: then one byte less must not fit.
                assert_eq!(search(&v, size - 1, align, LONG), SearchOutcome::Infeasible);
            }
        }
    }

    /// Every search result is valid and within the capacity; one thread and several give
    /// the same result and charge the same work, also when the budget runs out (the
    /// smaller allowances stop some searches after a few restarts).
    #[test]
    fn search_is_valid_and_deterministic() {
        let mut rng = Rng(7);
        let mut unknown = 0;
        for _ in 0..60 {
            let n = 5 + rng.below(40) as usize;
            let v = random_instance(&mut rng, n, 30, 32);
            let lb = max_live(&v);
            for cap in [lb, lb + lb / 20, lb + lb / 5] {
                // About one restart's work, a few, and plenty.
                let one_restart = 2 * (n.max(64) * (64 + n)) as u64;
                for allowance in [one_restart, 8 * one_restart, work_of(LONG)] {
                    let one = search_with(&v, cap, 1, allowance, 1);
                    let many = search_with(&v, cap, 1, allowance, 3);
                    assert_eq!(one, many, "{v:?} at {cap}, work {allowance}");
                    assert!(
                        one.1 <= allowance,
                        "{v:?} at {cap}: {} > {allowance}",
                        one.1
                    );
                    unknown += (one.0 == SearchOutcome::Unknown) as usize;
                    if let SearchOutcome::Found(p) = one.0 {
                        verify(&v, &p, 1).unwrap();
                        assert!(p.size <= cap);
                    }
                }
            }
        }
        // Larger instances at their lower bound, where restarts run out of nodes.
        for _ in 0..6 {
            let v = random_instance(&mut rng, 300, 200, 64);
            let cap = max_live(&v);
            let one_restart = 2 * 300 * (64 + 300);
            for allowance in [one_restart, 4 * one_restart, 16 * one_restart] {
                let one = search_with(&v, cap, 1, allowance, 1);
                let many = search_with(&v, cap, 1, allowance, 3);
                assert_eq!(one, many, "at {cap}, work {allowance}");
                unknown += (one.0 == SearchOutcome::Unknown) as usize;
            }
        }
        assert!(unknown > 0, "no allowance ran out");
    }

    /// A problem too large for the budget to pay for one restart at its most work is still
    /// searched (its first restart always runs): 6,000 short-lived buffers, where the
    /// greedy solvers leave 4 % over the lower bound and the search closes it.
    #[test]
    fn a_large_problem_is_searched_on_a_small_budget() {
        let mut rng = Rng(11);
        let v: Vec<Interval> = (0..6000)
            .map(|_| {
                let a = rng.below(2000);
                iv(a, a + 1 + rng.below(60), (1 + rng.below(64)) * 64)
            })
            .collect();
        let r = plan(&v, 1, Duration::from_millis(50));
        verify(&v, &r.placement, 1).unwrap();
        assert_eq!(r.placement.method, "skyline search");
        assert!(r.placement.size < r.best_heuristic());
    }

    /// The greedy with its time index against a plain quadratic scan.
    #[test]
    fn greedy_matches_a_plain_scan() {
        fn plain(intervals: &[Interval], order: &[usize], align: u64) -> Vec<u64> {
            let mut offsets = vec![0u64; intervals.len()];
            let mut placed: Vec<usize> = Vec::new();
            for &i in order {
                let v = intervals[i];
                if v.size == 0 {
                    continue;
                }
                let mut busy: Vec<(u64, u64)> = placed
                    .iter()
                    .filter(|&&j| intervals[j].overlaps(&v))
                    .map(|&j| (offsets[j], offsets[j] + intervals[j].size))
                    .collect();
                busy.sort_unstable();
                let (mut best, mut cursor) = (None::<(u64, u64)>, 0u64);
                for (s, e) in busy {
                    let start = round_up(cursor, align);
                    if s > start && s - start >= v.size && best.is_none_or(|(g, _)| s - start < g) {
                        best = Some((s - start, start));
                    }
                    cursor = cursor.max(e);
                }
                offsets[i] = best.map_or(round_up(cursor, align), |(_, o)| o);
                placed.push(i);
            }
            offsets
        }
        let mut rng = Rng(99);
        for round in 0..200 {
            let n = rng.below(80) as usize;
            let v = random_instance(&mut rng, n, 50, 40);
            let v = with_edge_cases(&mut rng, v, round);
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let align = [1, 8][round % 2];
            let g = greedy(&v, &order, align, "test");
            assert_eq!(g.offsets, plain(&v, &order, align));
            verify(&v, &g, align).unwrap();
        }
        // Hundreds of buffers over a short horizon: most placements overlap more than 64
        // placed buffers, which greedy visits in offset order instead of sorting them.
        for round in 0..12 {
            let n = 200 + rng.below(200) as usize;
            let v = random_instance(&mut rng, n, 12, 40);
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let align = [1, 8][round % 2];
            let g = greedy(&v, &order, align, "test");
            assert_eq!(g.offsets, plain(&v, &order, align));
            verify(&v, &g, align).unwrap();
        }
    }

    /// The sweep against the policy it implements, computed plainly: at each start (in
    /// start order), the free ranges are the holes between the live buffers below the
    /// highest one; the smallest that fits once aligned (the lowest on ties), else on top.
    #[test]
    fn sweep_matches_a_plain_allocator() {
        fn plain(v: &[Interval], align: u64) -> Vec<u64> {
            let mut offsets = vec![0u64; v.len()];
            let mut order: Vec<usize> = (0..v.len())
                .filter(|&i| v[i].size > 0 && v[i].is_live())
                .collect();
            order.sort_by_key(|&i| (v[i].lower, i));
            for (k, &i) in order.iter().enumerate() {
                let mut busy: Vec<(u64, u64)> = order[..k]
                    .iter()
                    .filter(|&&j| v[j].upper > v[i].lower)
                    .map(|&j| (offsets[j], offsets[j] + v[j].size))
                    .collect();
                busy.sort_unstable();
                let (mut best, mut cursor) = (None::<(u64, u64)>, 0u64);
                for (s, e) in busy {
                    if s > cursor {
                        let o = round_up(cursor, align);
                        let usable = s.saturating_sub(o);
                        if usable >= v[i].size && best.is_none_or(|b| (usable, o) < b) {
                            best = Some((usable, o));
                        }
                    }
                    cursor = cursor.max(e);
                }
                offsets[i] = best.map_or(round_up(cursor, align), |(_, o)| o);
            }
            offsets
        }
        let mut rng = Rng(7);
        for round in 0..300 {
            let n = rng.below(120) as usize;
            let v = random_instance(&mut rng, n, 60, 48);
            let v = with_edge_cases(&mut rng, v, round);
            let align = [1, 8, 16][round % 3];
            let p = sweep(&v, align, "test");
            assert_eq!(p.offsets, plain(&v, align), "round {round}");
            verify(&v, &p, align).unwrap();
        }
    }

    #[test]
    fn overlapping_pairs_are_counted_once() {
        let mut rng = Rng(5);
        for _ in 0..50 {
            let n = rng.below(60) as usize;
            let v = random_instance(&mut rng, n, 30, 4);
            let mut want = 0u64;
            for a in 0..n {
                for b in a + 1..n {
                    want += (v[a].size > 0 && v[b].size > 0 && v[a].overlaps(&v[b])) as u64;
                }
            }
            assert_eq!(overlapping_pairs(&v, u64::MAX), want);
            if want > 0 {
                // The count stops once past its cap.
                assert!(overlapping_pairs(&v, want - 1) > want - 1);
            }
        }
    }

    /// Past [`MAX_PROBLEM`] overlapping pairs (a long unrolled loop keeps thousands of
    /// activations live at once) the plan is one sweep, at once; nested lifetimes stack up
    /// to exactly the lower bound.
    #[test]
    fn too_many_overlapping_pairs_are_swept() {
        let n = 3000u64;
        let mut v: Vec<Interval> = (0..n).map(|k| iv(k, 2 * n - k, 256)).collect();
        // Short-lived ones in between, reusing what the nested ones leave.
        v.extend((0..n).map(|k| iv(n + k, n + k + 1, 512)));
        assert!(overlapping_pairs(&v, u64::MAX) > MAX_PROBLEM as u64);
        let r = plan(&v, 256, Duration::from_millis(50));
        verify(&v, &r.placement, 256).unwrap();
        assert_eq!(r.placement.method, "sweep in time order");
        assert_eq!(r.placement.size, max_live(&v));
        assert!(r.optimal);
    }

    #[test]
    fn granularity() {
        let v = vec![iv(0, 2, 1024), iv(0, 2, 3072), iv(1, 3, 2048)];
        assert_eq!(super::granularity(&v, 1), 1024);
        assert_eq!(super::granularity(&v, 256), 256);
        assert_eq!(super::granularity(&v, 4096), 1024);
        assert_eq!(super::granularity(&[iv(0, 2, 3), iv(0, 1, 0)], 2), 1);
        assert_eq!(super::granularity(&[], 1), 1);
    }

    #[test]
    fn parses_both_csv_dialects() {
        let (ids, v) = parse_csv("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\n").unwrap();
        assert_eq!(ids, ["b1", "b2"]);
        assert_eq!(v, [iv(0, 3, 4), iv(3, 9, 4)]);
        let (_, v) = parse_csv("buffer,begin,end,size\nx,0,2,4\n").unwrap();
        assert_eq!(v, [iv(0, 3, 4)]);
        assert!(parse_csv("").is_err());
        assert!(parse_csv("id,lower,upper,size\nb,5,3,4\n").is_err());
    }
}
