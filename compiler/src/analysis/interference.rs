//! The interference graph of buffers (petgraph): an edge joins two buffers live at the same
//! time. Greedy coloring assigns buffers to reusable *slots*: buffers of one slot never
//! interfere, and a slot is as large as its largest buffer.

use super::liveness::{BufferKind, Liveness};
use petgraph::graph::{NodeIndex, UnGraph};

/// Most edges [`interference`] builds: past this the graph (and its coloring, only a
/// comparison for the offset plan) is skipped. A loop unrolled 10,000 times keeps 20,000
/// activations live at once: 2·10⁸ edges, 17 GB and 216 s of planning.
pub const MAX_EDGES: u64 = 4_000_000;

/// Interference among the non-persistent buffers of `lv` (node weight = buffer index), or
/// `None` when it would have more than [`MAX_EDGES`] edges (counted first, in
/// `n log n`).
pub fn interference(lv: &Liveness) -> Option<UnGraph<usize, ()>> {
    let ids: Vec<usize> = (0..lv.buffers.len())
        .filter(|&b| lv.buffers[b].kind != BufferKind::Persistent)
        .collect();
    // Sweep by start time.
    let mut by_start: Vec<usize> = (0..ids.len()).collect();
    by_start.sort_by_key(|&k| (lv.buffers[ids[k]].start, k));
    let starts: Vec<usize> = by_start.iter().map(|&k| lv.buffers[ids[k]].start).collect();
    let edges: u64 = by_start
        .iter()
        .enumerate()
        .map(|(a_pos, &a)| {
            let end = lv.buffers[ids[a]].end;
            let last = starts.partition_point(|&s| s < end);
            last.saturating_sub(a_pos + 1) as u64
        })
        .sum();
    if edges > MAX_EDGES {
        return None;
    }
    let mut g = UnGraph::new_undirected();
    let nodes: Vec<NodeIndex> = ids.iter().map(|&b| g.add_node(b)).collect();
    for (a_pos, &a) in by_start.iter().enumerate() {
        let ba = &lv.buffers[ids[a]];
        for &c in &by_start[a_pos + 1..] {
            let bc = &lv.buffers[ids[c]];
            if bc.start >= ba.end {
                break;
            }
            g.add_edge(nodes[a], nodes[c], ());
        }
    }
    Some(g)
}

/// Greedy coloring, largest buffer first: each buffer takes the lowest slot none of its
/// neighbours holds. Returns `(slot of each buffer index, slot sizes)`; persistent buffers
/// get no slot.
pub fn color(lv: &Liveness, g: &UnGraph<usize, ()>) -> (Vec<Option<usize>>, Vec<u64>) {
    let mut slot_of: Vec<Option<usize>> = vec![None; lv.buffers.len()];
    let mut sizes: Vec<u64> = Vec::new();
    let mut order: Vec<NodeIndex> = g.node_indices().collect();
    order.sort_by_key(|&v| {
        (
            std::cmp::Reverse(lv.buffers[g[v]].bytes),
            lv.buffers[g[v]].start,
            g[v],
        )
    });
    let mut taken: Vec<bool> = Vec::new();
    for v in order {
        taken.clear();
        taken.resize(sizes.len(), false);
        for w in g.neighbors(v) {
            if let Some(s) = slot_of[g[w]] {
                taken[s] = true;
            }
        }
        let b = g[v];
        let s = match taken.iter().position(|&t| !t) {
            Some(s) => s,
            None => {
                sizes.push(0);
                sizes.len() - 1
            }
        };
        sizes[s] = sizes[s].max(lv.buffers[b].bytes);
        slot_of[b] = Some(s);
    }
    (slot_of, sizes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::liveness::Buffer;
    use crate::ir::NodeId;

    fn buffers(n: usize, overlapping: bool) -> Liveness {
        let buffers = (0..n)
            .map(|i| Buffer {
                owner: NodeId(petgraph::graph::NodeIndex::new(i)),
                bytes: 256,
                kind: BufferKind::Transient,
                start: if overlapping { 0 } else { i },
                end: if overlapping { n } else { i + 1 },
                nodes: Vec::new(),
                output: false,
            })
            .collect();
        Liveness {
            order: Vec::new(),
            buffers,
            ..Liveness::default()
        }
    }

    #[test]
    fn too_many_edges_skip_the_graph_and_the_plan_still_places_every_buffer() {
        // 3,000 buffers all live at once: 4.5 million pairs.
        let lv = buffers(3000, true);
        assert!(interference(&lv).is_none());
        let p = crate::plan::plan_liveness(lv, std::time::Duration::from_millis(50));
        assert_eq!(p.slots, 0);
        assert_eq!(p.arena_bytes, 3000 * 256);
        // Disjoint lifetimes: no edge, one slot.
        let lv = buffers(3000, false);
        let g = interference(&lv).unwrap();
        assert_eq!(g.edge_count(), 0);
        assert_eq!(color(&lv, &g).1.len(), 1);
    }
}
