//! Where each node of a kernel is computed: an analysis of the kernel IR that both back ends
//! use (a node is emitted once, in the loop of its innermost variable).

use super::lower::free_vars;
use super::{ExprId, Kernel, Var, E};
use std::collections::{BTreeSet, HashMap};

/// The loop each node is computed in: the bound variable of greatest depth among its free
/// variables (`None` for constants).
pub fn sites(k: &Kernel) -> Vec<Option<Var>> {
    let pool = &k.pool;
    let free = free_vars(pool);
    // Binder of each reduction variable: (reduction node, position).
    let mut binder: HashMap<Var, (ExprId, usize)> = HashMap::new();
    for (i, e) in pool.nodes.iter().enumerate() {
        if let E::Reduce { vars, .. } | E::ArgMax { vars, .. } = e {
            for (p, (v, _)) in vars.iter().enumerate() {
                binder.insert(*v, (ExprId(i as u32), p));
            }
        }
    }
    let rank = k.domain.len() as Var;
    let mut depth: HashMap<Var, usize> = HashMap::new();
    fn var_depth(
        v: Var,
        rank: Var,
        binder: &HashMap<Var, (ExprId, usize)>,
        free: &[BTreeSet<Var>],
        depth: &mut HashMap<Var, usize>,
        guard: usize,
    ) -> usize {
        if let Some(&d) = depth.get(&v) {
            return d;
        }
        let d = if v < rank || guard > 64 {
            v as usize + 1
        } else if let Some(&(r, p)) = binder.get(&v) {
            let base = free[r.0 as usize]
                .iter()
                .map(|&u| var_depth(u, rank, binder, free, depth, guard + 1))
                .max()
                .unwrap_or(0);
            base + p + 1
        } else {
            0
        };
        depth.insert(v, d);
        d
    }
    (0..pool.nodes.len())
        .map(|i| {
            free[i]
                .iter()
                .map(|&v| (var_depth(v, rank, &binder, &free, &mut depth, 0), v))
                .max()
                .map(|(_, v)| v)
        })
        .collect()
}
