//! The interference graph of buffers (petgraph): an edge joins two buffers live at the same
//! time. Greedy coloring assigns buffers to reusable *slots*: buffers of one slot never
//! interfere, and a slot is as large as its largest buffer.

use super::liveness::{BufferKind, Liveness};
use petgraph::graph::{NodeIndex, UnGraph};

/// Interference among the non-persistent buffers of `lv` (node weight = buffer index).
pub fn interference(lv: &Liveness) -> UnGraph<usize, ()> {
    let mut g = UnGraph::new_undirected();
    let ids: Vec<usize> = (0..lv.buffers.len())
        .filter(|&b| lv.buffers[b].kind != BufferKind::Persistent)
        .collect();
    let nodes: Vec<NodeIndex> = ids.iter().map(|&b| g.add_node(b)).collect();
    // Sweep by start time.
    let mut by_start: Vec<usize> = (0..ids.len()).collect();
    by_start.sort_by_key(|&k| (lv.buffers[ids[k]].start, k));
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
    g
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
