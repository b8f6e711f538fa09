//! `Session::run` allocates nothing: a counting global allocator sees zero allocations
//! during `run()`, on one thread and with a worker pool.
//!
//! This binary holds a single test so no other test allocates concurrently.

mod common;

mod counting;

use counting::{allocations_during, MATCHING, MATCH_ALIGN, MATCH_SIZE};
use std::sync::atomic::Ordering;
use tcc_runtime::{Device, Model, Session};

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

#[test]
fn run_allocates_nothing() {
    // The tiny model: one serial kernel and one kernel calling a helper, on the default
    // threads (one per available core: the workers started in `Session::new`), with no
    // warm-up run.
    let model = Model::from_bytes(common::tiny_artifact()).unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_input("x", &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let n = allocations_during(|| {
        for _ in 0..10 {
            s.run().unwrap();
        }
    });
    assert_eq!(n, 0, "run() allocated {n} times");
    assert_eq!(s.output::<f32>("y").unwrap(), vec![2.0, 5.0, 10.0, 17.0]);

    // Parallel kernels on a worker pool. `Session::new` allocates the arena exactly once,
    // with the manifest's size and alignment.
    let model = Model::from_bytes(common::big_artifact(10_000)).unwrap();
    MATCH_ALIGN.store(model.alignment(), Ordering::SeqCst);
    MATCH_SIZE.store(model.arena_bytes(), Ordering::SeqCst);
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    MATCH_SIZE.store(usize::MAX, Ordering::SeqCst);
    assert_eq!(MATCHING.load(Ordering::SeqCst), 1);
    assert_eq!(s.arena_bytes(), model.arena_bytes());
    s.set_threads(4).unwrap();
    s.set_input("x", &vec![0.5f32; 10_000]).unwrap();
    s.run().unwrap(); // warm up: threads are started and parked
    let n = allocations_during(|| {
        for _ in 0..20 {
            s.run().unwrap();
        }
    });
    assert_eq!(n, 0, "run() on 4 threads allocated {n} times");

    // Kernels calling the GEMM helper: its packing buffers and result blocks were
    // allocated with the session, one set per thread.
    let (m, n, k) = (300, 70, 600);
    let model = Model::from_bytes(common::gemm_artifact(m, n, k, None)).unwrap();
    let mut s = Session::new(&model, Device::Cpu).unwrap();
    s.set_threads(3).unwrap();
    s.set_input("x", &vec![0.25f32; m * k]).unwrap();
    s.run().unwrap(); // warm up
    let n_alloc = allocations_during(|| {
        for _ in 0..5 {
            s.run().unwrap();
        }
    });
    assert_eq!(
        n_alloc, 0,
        "run() calling the GEMM helper allocated {n_alloc} times"
    );
    let want = common::gemm_expected(m, n, k, &vec![0.25f32; m * k]);
    let y = s.output::<f32>("y").unwrap();
    assert!(y
        .iter()
        .zip(&want)
        .all(|(g, w)| (g - w).abs() <= 1e-3 * w.abs().max(1.0)));

    // With a caller-provided arena.
    let model = Model::from_bytes(common::tiny_artifact()).unwrap();
    let mut buf = vec![0u8; 256 + 64];
    let off = buf.as_ptr().align_offset(64);
    let mut s = Session::with_arena(&model, &mut buf[off..]).unwrap();
    s.set_input("x", &[1.0f32; 4]).unwrap();
    let n = allocations_during(|| s.run().unwrap());
    assert_eq!(n, 0);
}
