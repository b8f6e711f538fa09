//! Split large reductions over several axes into a chain of reductions.
//!
//! Expects a verified graph after autodiff. `reduce(x, axes: [.., a])` over at least two
//! axes of a tensor of 64 Ki elements or more becomes `reduce(reduce(x, axes: [a],
//! keepdim: true), axes: [.., a])`: the inner reduction keeps one value per remaining
//! element (many rows: a kernel with parallelism), the outer one reduces those (few).
//! Where those rows would be too few to fill a GPU ([`MIN_ROWS`]), axis `a` is first cut
//! into chunks (`reshape` to `[c, a/c]`, a view) and the inner reduction sums one chunk
//! per row: gpt's RMSNorm gain gradients `sum(dy * x̂, axes: [0, 1])` of `[8, 512, 768]`
//! left 6144 rows of 512 strided loads each (55 µs a kernel on an H100); chunks of 16 give
//! 196 608 rows. Sum, max and min are associative; a mean of equal-sized means is the
//! mean. Where the outer reduction would still sum [`MIN_ELEMENTS`] or more values for each
//! of its results (a whole-tensor sum whose last axis is short), the next axis still longer
//! than 1 is reduced first, and so on. The result type and every user are unchanged. The
//! pipeline's last graph stage, so
//! back ends never face one long serial reduction (a whole-tensor loss on a GPU is
//! otherwise one block of threads). Cost: one pass over the nodes; at most four new nodes
//! per split, plus one for each further axis a long outer step reduces first.

use crate::ir::{Graph, NodeId, Op, Shape};

/// Below this many input elements a reduction stays whole.
const MIN_ELEMENTS: usize = 1 << 16;
/// Fewest rows the inner reduction should leave (an H100 runs 270 336 threads at once).
const MIN_ROWS: usize = 1 << 17;
/// Fewest elements a chunk sums.
const MIN_CHUNK: usize = 16;

/// Splits every large multi-axis reduction; returns the rewritten graph (node order kept,
/// each split reduction replaced in place by its chain).
pub fn split_reductions(g: &Graph) -> Graph {
    super::replace_in_order(g, |h, n| {
        let node = h.node(n).clone();
        let Op::Reduce { op, axes, keepdim } = node.op else {
            return None;
        };
        let x = node.inputs[0];
        let dims = h.ty(x).dims().to_vec();
        if axes.len() < 2 || h.ty(x).shape.numel() < MIN_ELEMENTS {
            return None;
        }
        let last = axes.iter().max().copied()?;
        let mut added = Vec::new();
        let mut add = |h: &mut Graph, op: Op, input: NodeId| {
            let y = h.add(op, vec![input], node.span, node.checkpoint).ok()?;
            added.push(y);
            Some(y)
        };
        let mut inner_in = x;
        let chunk = chunks(dims[last], h.ty(x).shape.numel() / dims[last].max(1));
        if chunk > 1 {
            // [.., a, ..] -> [.., c, a/c, ..], summed over the chunks' elements below.
            let mut split = dims[..last].to_vec();
            split.extend([chunk, dims[last] / chunk]);
            split.extend_from_slice(&dims[last + 1..]);
            let viewed = add(
                h,
                Op::Reshape {
                    shape: Shape(split),
                },
                x,
            )?;
            let per_chunk = Op::Reduce {
                op,
                axes: vec![last + 1],
                keepdim: false,
            };
            // [.., c, ..]: the same rank and axes as x, `a` now `c` long.
            inner_in = add(h, per_chunk, viewed)?;
        }
        let inner = Op::Reduce {
            op,
            axes: vec![last],
            keepdim: true,
        };
        let mut inner = add(h, inner, inner_in)?;
        // While the outer reduction still sums a long run for each of its results (a
        // whole-tensor sum of a conv weight's gradient, whose last axis is 3 long, left
        // 786 432 values for one block), reduce the last axis that is still longer than 1
        // first.
        let out_numel = node.ty.shape.numel().max(1);
        loop {
            let dims = h.ty(inner).dims().to_vec();
            let per_result = h.ty(inner).shape.numel() / out_numel;
            let next = axes.iter().copied().filter(|&a| dims[a] > 1).max();
            match next {
                Some(a) if per_result >= MIN_ELEMENTS => {
                    let step = Op::Reduce {
                        op,
                        axes: vec![a],
                        keepdim: true,
                    };
                    inner = add(h, step, inner)?;
                }
                _ => break,
            }
        }
        add(h, Op::Reduce { op, axes, keepdim }, inner)?;
        Some(added)
    })
}

/// Chunks to cut a reduced axis of length `len` into, where the reduction leaves `rows`
/// values per element of that axis: 1 (none) when the rows are enough, else the fewest
/// that give [`MIN_ROWS`] rows with chunks of at least [`MIN_CHUNK`] elements (or the most
/// that keep chunks that long).
fn chunks(len: usize, rows: usize) -> usize {
    if rows >= MIN_ROWS || len < 4 * MIN_CHUNK {
        return 1;
    }
    let fits = |c: &usize| len.is_multiple_of(*c) && len / c >= MIN_CHUNK;
    let mut best = 1;
    for c in (4..=len / MIN_CHUNK).filter(fits) {
        best = c;
        if rows.saturating_mul(c) >= MIN_ROWS {
            break;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole-tensor sum of a conv weight's gradient (last axis 3 long) is split until no
    /// reduction of the chain sums 64 Ki values or more for one of its results; a
    /// per-channel sum whose outer step is already short keeps one split.
    #[test]
    fn whole_tensor_sums_split_until_every_step_is_short() {
        let g = crate::front::test_graph(
            "model t {
                input w: f32[512, 512, 3, 3]
                input x: f32[128, 64, 32, 32]
                output s = sum(abs(w))
                output m = mean(x, axis: [0, 2, 3])
            }",
        );
        let h = split_reductions(&g);
        crate::ir::verify::verify(&h).unwrap_or_else(|e| panic!("{e:?}"));
        let mut steps = Vec::new();
        for n in h.topo_order().unwrap_or_default() {
            if let Op::Reduce { .. } = h.node(n).op {
                let x = h.node(n).inputs[0];
                let per_result = h.ty(x).shape.numel() / h.ty(n).shape.numel().max(1);
                assert!(per_result < MIN_ELEMENTS, "{per_result} values a result");
                steps.push(per_result);
            }
        }
        // sum: axis 3, then 2, then 1 (262 144 values left), then the 512 that remain;
        // mean: axis 3 (32), then the 4096 values of each channel.
        assert_eq!(steps, [3, 3, 512, 512, 32, 4096]);
    }

    #[test]
    fn chunks_only_where_rows_are_few() {
        // gpt's gain gradient: 6144 rows of 512 -> 32 chunks of 16 (196 608 rows).
        assert_eq!(chunks(512, 6144), 32);
        // Enough rows already, or an axis too short to cut.
        assert_eq!(chunks(512, 1 << 17), 1);
        assert_eq!(chunks(63, 8), 1);
        // A prime length has no chunks; a short one gets the most that stay 16 long.
        assert_eq!(chunks(257, 8), 1);
        assert_eq!(chunks(128, 8), 8);
    }
}
