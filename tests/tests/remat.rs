//! Rematerialization solvers on the Checkmate graphs (../shared/bench/remat) and on small
//! random chains checked against brute force.

use std::time::Duration;
use tcc::remat::{self, RematGraph};
use tcc_tests::root;

fn load(name: &str) -> RematGraph {
    let p = root().join("../shared/bench/remat").join(name);
    remat::parse_node_link(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

#[test]
fn simulator_reproduces_the_published_no_remat_peaks() {
    // README of ../shared/bench/remat: peak in GiB with the Checkmate liveness model.
    for (f, gib) in [
        ("vgg16_bs256_224x224_train", 14.74),
        ("vgg19_bs256_224x224_train", 15.89),
        ("mobilenet_bs512_224x224_train", 32.32),
        ("resnet50_bs256_224x224_train", 35.45),
        ("fcn8_vgg_bs32_416x608_train", 12.56),
        ("segnet_bs32_416x608_train", 18.57),
        ("vgg_unet_bs32_416x608_train", 19.52),
    ] {
        let g = load(&format!("checkmate_graphs/{f}.json"));
        let peak = remat::none(&g).eval.peak as f64 / (1u64 << 30) as f64;
        assert!((peak - gib).abs() < 0.006, "{f}: {peak:.3} GiB vs {gib}");
    }
}

#[test]
fn solutions_meet_their_budgets_and_beat_sqrt_n() {
    for f in [
        "resnet50_bs256_224x224_train",
        "mobilenet_bs512_224x224_train",
        "vgg_unet_bs32_416x608_train",
    ] {
        let g = load(&format!("checkmate_graphs/{f}.json"));
        let base = remat::none(&g).eval.peak;
        let sq = remat::sqrt_n(&g);
        for frac in [0.9, 0.7] {
            let budget = (base as f64 * frac) as u64;
            let s = remat::branch_and_bound(&g, budget, Duration::from_secs(2))
                .unwrap_or_else(|| panic!("{f} at {frac}"));
            assert!(s.eval.peak <= budget);
            assert_eq!(
                remat::simulate(&g, &s.evict),
                s.eval,
                "the reported score is the simulated one"
            );
            let greedy = remat::greedy(&g, budget).unwrap();
            assert!(s.eval.added_cost <= greedy.eval.added_cost);
            if sq.eval.peak <= budget {
                assert!(
                    s.eval.added_cost <= sq.eval.added_cost,
                    "{f}: {} vs sqrt(n) {}",
                    s.eval.added_cost,
                    sq.eval.added_cost
                );
            }
        }
    }
}

/// A search cut short by its limit gives the same answer every time, on an idle machine
/// or a busy one: limits count search work, not time. Two threads solve the same graph at
/// once while the test repeats the solve; every result is the first one's.
#[test]
fn a_limited_search_is_deterministic() {
    let g = load("checkmate_graphs/resnet50_bs256_224x224_train.json");
    let budget = (remat::none(&g).eval.peak as f64 * 0.7) as u64;
    let limit = Duration::from_millis(40);
    let first = remat::solve(&g, budget, limit);
    assert!(!first.finished, "the limit should cut this search short");
    let key = |o: &remat::Outcome| o.best.as_ref().map(|b| (b.evict.clone(), b.eval));
    let busy: Vec<_> = (0..2)
        .map(|_| {
            let g = g.clone();
            std::thread::spawn(move || remat::solve(&g, budget, limit))
        })
        .collect();
    for _ in 0..2 {
        let again = remat::solve(&g, budget, limit);
        assert_eq!(key(&again), key(&first));
        assert_eq!(again.finished, first.finished);
    }
    for h in busy {
        assert_eq!(key(&h.join().unwrap()), key(&first));
    }
}

/// A training chain: forward 0..L, loss, backward L+1..2L (as Checkmate lays it out).
fn chain(mems: &[u64], costs: &[u64]) -> RematGraph {
    let l = mems.len();
    let n = 2 * l + 1;
    let mut g = RematGraph {
        names: (0..n).map(|i| format!("n{i}")).collect(),
        mem: vec![0; n],
        cost: vec![0; n],
        preds: vec![Vec::new(); n],
        order: (0..n).collect(),
        backward: (0..n).map(|i| i > l).collect(),
        fixed: Vec::new(),
    };
    for i in 0..l {
        g.mem[i] = mems[i];
        g.cost[i] = costs[i];
        if i > 0 {
            g.preds[i].push(i - 1);
        }
        // Gradient node of forward i: reads the next gradient and activation i.
        let b = 2 * l - i;
        g.mem[b] = mems[i];
        g.cost[b] = 2 * costs[i];
        g.preds[b].push(b - 1);
        g.preds[b].push(i);
    }
    g.mem[l] = 1;
    g.cost[l] = 1;
    g.preds[l].push(l - 1);
    g
}

/// The least added cost of any eviction subset of the candidates that meets `budget`.
fn brute_force(g: &RematGraph, budget: u64) -> Option<u64> {
    let cands = g.candidates();
    let mut best: Option<u64> = None;
    for mask in 0u32..(1 << cands.len()) {
        let mut evict = vec![false; g.len()];
        for (k, &c) in cands.iter().enumerate() {
            evict[c] = mask & (1 << k) != 0;
        }
        let e = remat::simulate(g, &evict);
        if e.peak <= budget && best.is_none_or(|b| e.added_cost < b) {
            best = Some(e.added_cost);
        }
    }
    best
}

#[test]
fn branch_and_bound_is_optimal_on_small_chains() {
    let mut seed = 0x1234_5678u64;
    let mut next = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        1 + seed % m
    };
    for _ in 0..30 {
        let l = 3 + next(6) as usize;
        let mems: Vec<u64> = (0..l).map(|_| next(50)).collect();
        let costs: Vec<u64> = (0..l).map(|_| next(20)).collect();
        let g = chain(&mems, &costs);
        let base = remat::none(&g).eval.peak;
        let budget = base * (50 + next(45)) / 100;
        let best = brute_force(&g, budget);
        let bb = remat::branch_and_bound(&g, budget, Duration::from_secs(5));
        assert_eq!(
            bb.as_ref().map(|s| s.eval.added_cost),
            best,
            "mems {mems:?} costs {costs:?} budget {budget}"
        );
        if let Some(s) = bb {
            assert!(s.optimal);
        }
    }
}

#[test]
fn chain_dp_is_optimal_on_small_chains() {
    let mut seed = 0x9e37_79b9u64;
    let mut next = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        1 + seed % m
    };
    let mut feasible = 0;
    for _ in 0..200 {
        let l = 2 + next(11) as usize;
        let mems: Vec<u64> = (0..l).map(|_| next(60)).collect();
        let costs: Vec<u64> = (0..l).map(|_| next(25)).collect();
        let g = chain(&mems, &costs);
        let base = remat::none(&g).eval.peak;
        let budget = base * (30 + next(70)) / 100;
        let best = brute_force(&g, budget);
        let dp = remat::chain_dp(&g, budget);
        assert_eq!(
            dp.as_ref().map(|s| s.eval.added_cost),
            best,
            "mems {mems:?} costs {costs:?} budget {budget}"
        );
        if let Some(s) = &dp {
            feasible += 1;
            assert!(s.eval.peak <= budget);
            assert_eq!(remat::simulate(&g, &s.evict), s.eval);
        }
    }
    // The budgets span feasible and infeasible cases.
    assert!(feasible > 20 && feasible < 200, "{feasible}");
}

/// `tcc remat` validates the graphs it reads (issue 32, group 8): ids, the order and
/// acyclicity, each with a clear error instead of a panic or a table of nonsense.
#[test]
fn malformed_graphs_are_clear_errors() {
    let graph = |nodes: &str, links: &str, order: &str| {
        format!("{{\"graph\": {{{order}}}, \"nodes\": [{nodes}], \"links\": [{links}]}}")
    };
    let three =
        "{\"id\": 0, \"cost_ram\": 1}, {\"id\": 1, \"cost_ram\": 1}, {\"id\": 2, \"cost_ram\": 1}";
    let chain = "{\"source\": 0, \"target\": 1}, {\"source\": 1, \"target\": 2}";
    let ok = graph(three, chain, "\"order\": [0, 1, 2]");
    assert!(remat::parse_node_link(&ok).is_ok());
    for (text, want) in [
        (
            graph(
                "{\"id\": 0, \"cost_ram\": 1}, {\"id\": 0, \"cost_ram\": 1}",
                "",
                "",
            ),
            "node id 0 appears twice",
        ),
        (
            graph("{\"id\": 18446744073709551615, \"cost_ram\": 1}", "", ""),
            "out of range",
        ),
        (graph(three, chain, "\"order\": [0, 1, 7]"), "`order` entry 7"),
        (graph(three, chain, "\"order\": [0, 1, 1]"), "node 1 appears twice in `order`"),
        (graph(three, chain, "\"order\": [0, 1]"), "lists 2 entries"),
        (graph(three, chain, "\"order\": [1, 0, 2]"), "node 1 runs before its input 0"),
        (
            graph(
                three,
                "{\"source\": 0, \"target\": 1}, {\"source\": 1, \"target\": 2}, {\"source\": 2, \"target\": 0}",
                "\"order\": [0, 1, 2]",
            ),
            "has a cycle or the order is not topological",
        ),
        (
            graph(three, "{\"source\": 1, \"target\": 1}", "\"order\": [0, 1, 2]"),
            "node 1 is its own input",
        ),
    ] {
        match remat::parse_node_link(&text) {
            Err(e) => assert!(e.contains(want), "{text}: {e}"),
            Ok(_) => panic!("{text}: accepted"),
        }
    }
}
