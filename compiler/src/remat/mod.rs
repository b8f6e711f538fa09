//! Rematerialization: which activations to drop after their forward use and recompute when
//! the backward pass needs them, so a step fits a memory budget with the least added
//! compute.
//!
//! The model ([`simulate`]): nodes run in a fixed order; a node's output lives from its
//! computation until its last consumer has run, and the running node holds its output
//! while its inputs are live (Checkmate's accounting). An *evicted* node is freed as soon
//! as every consumer scheduled before the first backward consumer has run; when a later
//! node needs it, it is recomputed just before (recursively recomputing evicted inputs
//! that are gone), then lives until its last consumer. Added cost is the cost of every
//! recomputation.
//!
//! Solvers: no remat; √n segments (keep every ⌈√n⌉-th forward node); greedy by memory freed
//! per added cost followed by a removal pass; and an exact depth-first branch and bound over
//! evict/keep decisions, warm-started by the greedy, within a limit. Limits are given in
//! milliseconds but counted in search work ([`Work`]), never on a clock, so a solve gives
//! the same answer on every machine and under any load.

pub mod step;

use std::time::Duration;

/// Units of search work that make a millisecond of a limit: about what one core of a
/// current x86-64 server does in one (a simulation of the schedule costs one unit a node,
/// a search node one more).
pub const WORK_PER_MS: u64 = 75_000;

/// A search's work so far and where it must stop (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Work {
    spent: u64,
    stop: u64,
}

impl Work {
    /// The work a limit of `limit` allows.
    pub fn of(limit: Duration) -> Work {
        let stop = u64::try_from(limit.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_mul(WORK_PER_MS);
        Work { spent: 0, stop }
    }

    /// No limit.
    pub fn unlimited() -> Work {
        Work {
            spent: 0,
            stop: u64::MAX,
        }
    }

    /// Spends `units`; false once the work is over its stop.
    fn spend(&mut self, units: u64) -> bool {
        self.spent = self.spent.saturating_add(units);
        self.spent <= self.stop
    }

    /// The same work, stopping at `part` of the way from what is spent to the stop
    /// (`part` in 0..=1), for a phase of a search that leaves the rest to later phases.
    pub(crate) fn until(self, part: f64) -> Work {
        let left = self.stop.saturating_sub(self.spent);
        Work {
            spent: self.spent,
            stop: self.spent.saturating_add((left as f64 * part) as u64),
        }
    }

    /// Carries on from what `phase` (made by [`Work::until`]) spent.
    pub(crate) fn after(self, phase: Work) -> Work {
        Work {
            spent: phase.spent.max(self.spent),
            stop: self.stop,
        }
    }
}

/// A compute graph with a memory and a compute cost per node.
#[derive(Clone, Debug, Default)]
pub struct RematGraph {
    pub names: Vec<String>,
    /// Output bytes of each node.
    pub mem: Vec<u64>,
    /// Cost of computing each node once.
    pub cost: Vec<u64>,
    /// Inputs of each node.
    pub preds: Vec<Vec<usize>>,
    /// Execution order.
    pub order: Vec<usize>,
    /// Backward (gradient) nodes; they are never evicted.
    pub backward: Vec<bool>,
    /// Nodes that may not be evicted besides those (empty: none).
    pub fixed: Vec<bool>,
}

impl RematGraph {
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// Nodes that may be evicted, in order: forward nodes that a backward node reads after
    /// the last forward node that reads them (backward nodes may be interleaved with the
    /// forward pass, as a memory-aware schedule places them); in a graph without backward
    /// nodes, nodes read again after their first consumer. Only these can save memory, and
    /// each is recomputed at least once if evicted.
    pub fn candidates(&self) -> Vec<usize> {
        let pos = self.positions();
        let generic = self.first_backward().is_none();
        let mut first_use = vec![usize::MAX; self.len()];
        let mut last_fwd_use: Vec<Option<usize>> = vec![None; self.len()];
        let mut last_bwd_use: Vec<Option<usize>> = vec![None; self.len()];
        let mut last_use = vec![0usize; self.len()];
        for &v in &self.order {
            for &u in &self.preds[v] {
                last_use[u] = last_use[u].max(pos[v]);
                first_use[u] = first_use[u].min(pos[v]);
                let slot = if self.backward[v] {
                    &mut last_bwd_use[u]
                } else {
                    &mut last_fwd_use[u]
                };
                *slot = Some(slot.map_or(pos[v], |p| p.max(pos[v])));
            }
        }
        self.order
            .iter()
            .copied()
            .filter(|&v| !self.backward[v] && !self.fixed.get(v).copied().unwrap_or(false))
            .filter(|&v| {
                if generic {
                    first_use[v] != usize::MAX && last_use[v] > first_use[v]
                } else {
                    matches!((last_fwd_use[v], last_bwd_use[v]), (Some(f), Some(b)) if b > f)
                }
            })
            .collect()
    }

    /// Position of the first backward node, if any.
    fn first_backward(&self) -> Option<usize> {
        self.order.iter().position(|&v| self.backward[v])
    }

    fn positions(&self) -> Vec<usize> {
        let mut pos = vec![0usize; self.len()];
        for (i, &v) in self.order.iter().enumerate() {
            pos[v] = i;
        }
        pos
    }

    /// Total cost of one pass with no recomputation.
    pub fn base_cost(&self) -> u64 {
        self.cost.iter().sum()
    }
}

/// Reads a networkx node-link JSON graph: Checkmate's format (`cost_ram`, `cost_cpu`,
/// `backward`, links `source`/`target`, order = ids) or the random layered format
/// (`out_cost`, `duration`, links `"0"`/`"1"`, `graph.order`).
pub fn parse_node_link(text: &str) -> Result<RematGraph, String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let nodes = v
        .get("nodes")
        .and_then(|n| n.as_array())
        .ok_or("no `nodes` array")?;
    let n = nodes.len();
    let mut g = RematGraph {
        names: vec![String::new(); n],
        mem: vec![0; n],
        cost: vec![0; n],
        preds: vec![Vec::new(); n],
        order: Vec::new(),
        backward: vec![false; n],
        fixed: Vec::new(),
    };
    let num = |x: &serde_json::Value, keys: &[&str]| {
        keys.iter().find_map(|k| x.get(*k).and_then(|v| v.as_u64()))
    };
    let mut seen = vec![false; n];
    for (i, node) in nodes.iter().enumerate() {
        let id = num(node, &["id", "name"]).unwrap_or(i as u64);
        let id = match usize::try_from(id) {
            Ok(id) if id < n => id,
            _ => {
                return Err(format!(
                    "node id {id} out of range (the graph has {n} nodes)"
                ))
            }
        };
        if std::mem::replace(&mut seen[id], true) {
            return Err(format!("node id {id} appears twice"));
        }
        g.mem[id] =
            num(node, &["cost_ram", "out_cost"]).ok_or(format!("node {id}: no memory cost"))?;
        g.cost[id] = num(node, &["cost_cpu", "duration"]).unwrap_or(0);
        g.backward[id] = node
            .get("backward")
            .and_then(|b| b.as_bool())
            .unwrap_or(false);
        g.names[id] = node
            .get("name")
            .map(|s| s.to_string().trim_matches('"').to_string())
            .unwrap_or_default();
    }
    let links = v
        .get("links")
        .and_then(|l| l.as_array())
        .ok_or("no `links` array")?;
    for l in links {
        let s = num(l, &["source", "0"]).ok_or("link without source")? as usize;
        let t = num(l, &["target", "1"]).ok_or("link without target")? as usize;
        if s >= n || t >= n {
            return Err(format!("link {s} -> {t} out of range"));
        }
        g.preds[t].push(s);
    }
    g.order = match v
        .get("graph")
        .and_then(|x| x.get("order"))
        .and_then(|o| o.as_array())
    {
        Some(o) => o
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|u| usize::try_from(u).ok())
                    .filter(|&u| u < n)
                    .ok_or_else(|| format!("`order` entry {x} is not a node id below {n}"))
            })
            .collect::<Result<Vec<usize>, String>>()?,
        None => (0..n).collect(),
    };
    if g.order.len() != n {
        return Err(format!(
            "`order` lists {} entries but the graph has {n} nodes",
            g.order.len()
        ));
    }
    // A topological order of every node once (which also rules out cycles).
    let mut pos = vec![usize::MAX; n];
    for (i, &v) in g.order.iter().enumerate() {
        if pos[v] != usize::MAX {
            return Err(format!("node {v} appears twice in `order`"));
        }
        pos[v] = i;
    }
    for v in 0..n {
        if let Some(&u) = g.preds[v].iter().find(|&&u| pos[u] >= pos[v]) {
            return Err(if u == v {
                format!("node {v} is its own input")
            } else {
                format!(
                    "node {v} runs before its input {u} in the order (the graph has a cycle or the order is not topological)"
                )
            });
        }
    }
    // Random layered graphs carry no durations: cost 1 per node (recompute count).
    if g.cost.iter().all(|&c| c == 0) {
        g.cost = vec![1; n];
    }
    Ok(g)
}

/// Peak memory and added cost of one schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eval {
    pub peak: u64,
    pub added_cost: u64,
}

/// Simulates the order with `evict` (see the module doc).
pub fn simulate(g: &RematGraph, evict: &[bool]) -> Eval {
    simulate_steps(g, evict, None)
}

/// [`simulate`] that also gives, per position of the order, the highest memory reached
/// while that node ran (its recomputations included).
pub fn simulate_profile(g: &RematGraph, evict: &[bool]) -> (Eval, Vec<u64>) {
    let mut profile = vec![0u64; g.len()];
    let e = simulate_steps(g, evict, Some(&mut profile));
    (e, profile)
}

fn simulate_steps(g: &RematGraph, evict: &[bool], mut profile: Option<&mut Vec<u64>>) -> Eval {
    let n = g.len();
    // Without backward nodes, an evicted node is dropped after its first consumer.
    let generic = g.first_backward().is_none();
    // Remaining consumers of each node, in order; forward consumers apart.
    let mut uses_left = vec![0usize; n];
    let mut fwd_uses_left = vec![0usize; n];
    for &v in &g.order {
        for &u in &g.preds[v] {
            uses_left[u] += 1;
            if !g.backward[v] {
                fwd_uses_left[u] += 1;
            }
        }
    }
    // An evicted node is dropped once its last forward consumer has run.
    let has_fwd_use: Vec<bool> = fwd_uses_left.iter().map(|&k| k > 0).collect();
    let mut live = vec![false; n];
    let mut recomputed = vec![false; n];
    let mut cur = 0u64;
    let mut peak = 0u64;
    let mut added = 0u64;
    // Recomputes `u` (and inputs that are gone), keeping it live afterwards. Inputs that
    // were gone are recomputed once per step and freed when the step is over (`temps`).
    #[allow(clippy::too_many_arguments)]
    fn recompute(
        g: &RematGraph,
        u: usize,
        live: &mut [bool],
        recomputed: &mut [bool],
        temps: &mut Vec<usize>,
        cur: &mut u64,
        peak: &mut u64,
        added: &mut u64,
        depth: usize,
    ) {
        if depth > g.len() {
            return;
        }
        for &w in &g.preds[u] {
            if !live[w] {
                recompute(g, w, live, recomputed, temps, cur, peak, added, depth + 1);
                temps.push(w);
            }
        }
        *cur += g.mem[u];
        *peak = (*peak).max(*cur);
        *added += g.cost[u];
        live[u] = true;
        recomputed[u] = true;
    }
    let mut temps: Vec<usize> = Vec::new();
    for (p, &v) in g.order.iter().enumerate() {
        let mut step = cur;
        for i in 0..g.preds[v].len() {
            let u = g.preds[v][i];
            if !live[u] {
                recompute(
                    g,
                    u,
                    &mut live,
                    &mut recomputed,
                    &mut temps,
                    &mut cur,
                    &mut step,
                    &mut added,
                    0,
                );
            }
        }
        cur += g.mem[v];
        step = step.max(cur);
        peak = peak.max(step);
        if let Some(pr) = profile.as_deref_mut() {
            pr[p] = step;
        }
        live[v] = true;
        for i in 0..g.preds[v].len() {
            let u = g.preds[v][i];
            uses_left[u] -= 1;
            if !g.backward[v] {
                fwd_uses_left[u] -= 1;
            }
            let evicted_now = evict[u]
                && !recomputed[u]
                && (generic || (has_fwd_use[u] && fwd_uses_left[u] == 0 && !g.backward[v]));
            if live[u] && (uses_left[u] == 0 || evicted_now) {
                live[u] = false;
                cur -= g.mem[u];
            }
        }
        if uses_left[v] == 0 {
            live[v] = false;
            cur -= g.mem[v];
        }
        for w in temps.drain(..) {
            if uses_left[w] == 0 && live[w] {
                live[w] = false;
                cur -= g.mem[w];
            }
        }
    }
    Eval {
        peak,
        added_cost: added,
    }
}

/// A remat decision and how it scores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Solution {
    pub evict: Vec<bool>,
    pub eval: Eval,
    pub method: &'static str,
    /// True when the branch and bound finished: no cheaper eviction meets the budget.
    pub optimal: bool,
}

/// No rematerialization.
pub fn none(g: &RematGraph) -> Solution {
    let evict = vec![false; g.len()];
    Solution {
        eval: simulate(g, &evict),
        evict,
        method: "none",
        optimal: false,
    }
}

/// √n segment checkpointing: keep every ⌈√n⌉-th candidate, evict the others.
pub fn sqrt_n(g: &RematGraph) -> Solution {
    let c = g.candidates();
    let k = (c.len() as f64).sqrt().ceil().max(1.0) as usize;
    let mut evict = vec![false; g.len()];
    for (i, &v) in c.iter().enumerate() {
        if (i + 1) % k != 0 {
            evict[v] = true;
        }
    }
    Solution {
        eval: simulate(g, &evict),
        evict,
        method: "sqrt(n)",
        optimal: false,
    }
}

/// Greedy: evict, one at a time, the candidate that lowers the peak most per added cost,
/// until the budget is met; then un-evict whatever the budget still allows (largest cost
/// first). `None` if even evicting every candidate does not fit.
pub fn greedy(g: &RematGraph, budget: u64) -> Option<Solution> {
    greedy_until(g, budget, &mut Work::unlimited())
}

/// [`greedy`] that gives up (returns `None`) when `work` runs out.
pub fn greedy_until(g: &RematGraph, budget: u64, work: &mut Work) -> Option<Solution> {
    greedy_batched(g, budget, work, 1)
}

/// [`greedy_until`] that evicts the `batch` best-scoring candidates per round instead of
/// one (for graphs with hundreds of candidates, where one simulation per candidate per
/// eviction is too slow).
pub fn greedy_batched(
    g: &RematGraph,
    budget: u64,
    work: &mut Work,
    batch: usize,
) -> Option<Solution> {
    let cands = g.candidates();
    let mut evict = vec![false; g.len()];
    let mut cur = simulate(g, &evict);
    while cur.peak > budget {
        let mut scored: Vec<(f64, usize, Eval)> = Vec::new();
        for &c in &cands {
            if evict[c] {
                continue;
            }
            if !work.spend(g.len() as u64 + 1) {
                return None;
            }
            evict[c] = true;
            let e = simulate(g, &evict);
            evict[c] = false;
            let gain = cur.peak.saturating_sub(e.peak) as f64;
            let extra = e.added_cost.saturating_sub(cur.added_cost) as f64 + 1.0;
            // Prefer peak reductions per cost; among no-gain moves, the largest tensor.
            let score = if gain > 0.0 {
                gain / extra
            } else {
                g.mem[c] as f64 * 1e-12 / extra
            };
            scored.push((score, c, e));
        }
        if scored.is_empty() {
            return None;
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if batch <= 1 {
            let (_, c, e) = scored[0];
            evict[c] = true;
            cur = e;
        } else {
            for &(_, c, _) in scored.iter().take(batch) {
                evict[c] = true;
            }
            cur = simulate(g, &evict);
        }
    }
    // Removal pass: keep again what the budget allows, most expensive recomputation first.
    let mut evicted: Vec<usize> = cands.iter().copied().filter(|&c| evict[c]).collect();
    evicted.sort_by_key(|&c| (std::cmp::Reverse(g.cost[c]), c));
    for c in evicted {
        evict[c] = false;
        let e = simulate(g, &evict);
        if e.peak <= budget && e.added_cost <= cur.added_cost {
            cur = e;
        } else {
            evict[c] = true;
        }
    }
    Some(Solution {
        evict,
        eval: cur,
        method: "greedy",
        optimal: false,
    })
}

/// Depth-first search over evict/keep decisions of the candidates (keep first). `prune_unfit`
/// cuts a branch when evicting every remaining candidate still misses the budget: a strong
/// but heuristic cut (evicting more usually, not always, lowers the peak). Without it the
/// search is exact: its only cut is the lower bound (every evicted candidate is recomputed
/// at least once, so the sum of their costs bounds the added cost).
struct Dfs<'a> {
    g: &'a RematGraph,
    cands: Vec<usize>,
    budget: u64,
    prune_unfit: bool,
    evict: Vec<bool>,
    best: Option<Solution>,
    work: Work,
    timed_out: bool,
}

impl Dfs<'_> {
    /// Spends `units` of work (a node is 1, a simulation the graph's length); false, and
    /// the search marked timed out, once the work is over.
    fn spend(&mut self, units: u64) -> bool {
        if !self.timed_out && !self.work.spend(units) {
            self.timed_out = true;
        }
        !self.timed_out
    }

    fn run(&mut self, k: usize, lower: u64) {
        if !self.spend(1) {
            return;
        }
        if self
            .best
            .as_ref()
            .is_some_and(|b| lower >= b.eval.added_cost)
        {
            return;
        }
        if self.prune_unfit {
            let mut all = self.evict.clone();
            for &c in &self.cands[k..] {
                all[c] = true;
            }
            if !self.spend(self.g.len() as u64) || simulate(self.g, &all).peak > self.budget {
                return;
            }
        }
        if k == self.cands.len() {
            if !self.spend(self.g.len() as u64) {
                return;
            }
            let e = simulate(self.g, &self.evict);
            if e.peak <= self.budget
                && self
                    .best
                    .as_ref()
                    .is_none_or(|b| e.added_cost < b.eval.added_cost)
            {
                self.best = Some(Solution {
                    evict: self.evict.clone(),
                    eval: e,
                    method: "branch and bound",
                    optimal: false,
                });
            }
            return;
        }
        let c = self.cands[k];
        self.run(k + 1, lower);
        self.evict[c] = true;
        self.run(k + 1, lower + self.g.cost[c]);
        self.evict[c] = false;
    }
}

/// What [`branch_and_bound`] found.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub best: Option<Solution>,
    /// The exact search ran to the end: `best` is optimal, or `None` proves the budget
    /// cannot be met (in this remat model).
    pub finished: bool,
}

/// The best eviction within `limit`: greedy and the chain DP, then the pruned (heuristic)
/// search, then the exact branch and bound warm-started by them. `optimal` is set when the exact search
/// finished: no eviction set meets the budget with less added cost (in this remat model).
pub fn branch_and_bound(g: &RematGraph, budget: u64, limit: Duration) -> Option<Solution> {
    solve(g, budget, limit).best
}

/// [`branch_and_bound`] with the search status.
pub fn solve(g: &RematGraph, budget: u64, limit: Duration) -> Outcome {
    let work = Work::of(limit);
    let mut phase = work.until(1.0 / 3.0);
    let greedy = greedy_until(g, budget, &mut phase);
    // The chain DP simulates every pair of candidates: only for modest counts.
    let dp = if g.candidates().len() <= 160 {
        let mut dp_phase = work.after(phase).until(0.25);
        let dp = chain_dp_until(g, budget, &mut dp_phase);
        phase = dp_phase;
        dp
    } else {
        None
    };
    let warm = match (greedy, dp) {
        (Some(a), Some(b)) => Some(if b.eval.added_cost < a.eval.added_cost {
            b
        } else {
            a
        }),
        (a, b) => a.or(b),
    };
    solve_from(g, budget, work.after(phase), warm)
}

/// The pruned search, then the exact branch and bound, warm-started by `warm`, within
/// `work` in all (half of what is left for the pruned search).
pub fn solve_from(g: &RematGraph, budget: u64, work: Work, warm: Option<Solution>) -> Outcome {
    let mut dfs = Dfs {
        g,
        cands: g.candidates(),
        budget,
        prune_unfit: true,
        evict: vec![false; g.len()],
        best: warm,
        work: work.until(0.5),
        timed_out: false,
    };
    dfs.run(0, 0);
    dfs.prune_unfit = false;
    dfs.timed_out = false;
    dfs.work = work.after(dfs.work);
    dfs.run(0, 0);
    let finished = !dfs.timed_out;
    Outcome {
        best: dfs.best.map(|mut b| {
            b.optimal = finished;
            b
        }),
        finished,
    }
}

/// Optimal checkpoints for chains, by dynamic programming over segments (the single
/// recomputation form of revolve: a segment between two kept candidates is recomputed once,
/// when the backward pass reaches it).
///
/// The candidates, in forward order, are the possible checkpoints `c_1..c_k`; a solution
/// keeps some and evicts the others. The memory in use at any step is then `K(a)`, the
/// bytes of the kept candidates before the step's segment `(c_a, c_b]`, plus what the
/// segment itself holds, `Q(a, b)`, which depends only on `a` and `b`: forward steps of the
/// segment hold what was made since `c_a`; backward steps hold the segment's recomputed
/// values and gradients. `Q` comes from the simulator: evict the inside of `(c_a, c_b)`,
/// keep everything else, and take the highest memory over the segment's steps minus
/// the candidates up to `c_a`. The search then runs over kept sets with Pareto fronts of
/// `(K, added cost)` per last kept candidate, so it is exact when the decomposition holds,
/// as it does on chains (checked against brute force in the tests). On other graphs it is a
/// heuristic; either way the returned score is the simulator's and meets `budget`.
pub fn chain_dp(g: &RematGraph, budget: u64) -> Option<Solution> {
    chain_dp_until(g, budget, &mut Work::unlimited())
}

/// [`chain_dp`] that gives up (returns `None`) when `work` runs out.
pub fn chain_dp_until(g: &RematGraph, budget: u64, work: &mut Work) -> Option<Solution> {
    let cands = g.candidates();
    let k = cands.len();
    g.first_backward()?;
    let pos = g.positions();
    // The forward phase ends at the last forward node (backward nodes may be interleaved).
    let fwd_end = g.order.iter().rposition(|&v| !g.backward[v])?;
    let n = g.len();
    // 1-based candidate index of each node.
    let mut cidx = vec![0usize; n];
    for (i, &c) in cands.iter().enumerate() {
        cidx[c] = i + 1;
    }
    // Boundary positions: P(i) for i in 1..=k, P(k+1) = the last forward step.
    let bpos = |i: usize| -> usize {
        if i <= k {
            pos[cands[i - 1]]
        } else {
            fwd_end
        }
    };
    // Segment key of every step: a step belongs to segment (a, b] when a < key <= b.
    let mut key = vec![k + 1; g.order.len()];
    let mut j = 1usize;
    let mut lowest = k + 1;
    for (p, &v) in g.order.iter().enumerate() {
        if p <= fwd_end {
            while j <= k && bpos(j) < p {
                j += 1;
            }
            key[p] = j;
        } else {
            for &u in &g.preds[v] {
                if cidx[u] != 0 {
                    lowest = lowest.min(cidx[u]);
                }
            }
            key[p] = lowest;
        }
    }
    let mut prefix_mem = vec![0u64; k + 1];
    let mut prefix_cost = vec![0u64; k + 1];
    for i in 1..=k {
        prefix_mem[i] = prefix_mem[i - 1] + g.mem[cands[i - 1]];
        prefix_cost[i] = prefix_cost[i - 1] + g.cost[cands[i - 1]];
    }
    let q = |a: usize, b: usize| -> u64 {
        let mut evict = vec![false; n];
        for &c in &cands[a..b.saturating_sub(1).max(a)] {
            evict[c] = true;
        }
        let (_, profile) = simulate_profile(g, &evict);
        let top = (0..g.order.len())
            .filter(|&p| a < key[p] && key[p] <= b)
            .map(|p| profile[p])
            .max()
            .unwrap_or(0);
        top.saturating_sub(prefix_mem[a])
    };
    // front[b]: Pareto-optimal (kept bytes, added cost, previous boundary, index there).
    type State = (u64, u64, usize, usize);
    let mut front: Vec<Vec<State>> = vec![Vec::new(); k + 2];
    front[0].push((0, 0, usize::MAX, 0));
    for b in 1..=k + 1 {
        let mut next: Vec<State> = Vec::new();
        for a in 0..b {
            if front[a].is_empty() {
                continue;
            }
            // A pair's simulation and its front.
            if !work.spend(n as u64 + front[a].len() as u64) {
                return None;
            }
            let qab = q(a, b);
            let inside = prefix_cost[b - 1] - prefix_cost[a];
            let add = if b <= k { g.mem[cands[b - 1]] } else { 0 };
            for (i, &(kept, cost, _, _)) in front[a].iter().enumerate() {
                if kept + qab <= budget {
                    next.push((kept + add, cost + inside, a, i));
                }
            }
        }
        next.sort_by_key(|s| (s.0, s.1));
        let mut pruned: Vec<State> = Vec::new();
        for s in next {
            if pruned.last().is_none_or(|l| s.1 < l.1) {
                pruned.push(s);
            }
        }
        front[b] = pruned;
    }
    let (mut i, _) = front[k + 1]
        .iter()
        .enumerate()
        .min_by_key(|(_, s)| (s.1, s.0))?;
    let mut evict = vec![false; n];
    for &c in &cands {
        evict[c] = true;
    }
    let mut b = k + 1;
    while b != 0 {
        if b <= k {
            evict[cands[b - 1]] = false;
        }
        let (_, _, a, ai) = front[b][i];
        b = a;
        i = ai;
    }
    let eval = simulate(g, &evict);
    (eval.peak <= budget).then_some(Solution {
        evict,
        eval,
        method: "chain DP",
        optimal: false,
    })
}
