//! A CUDA session's steady state allocates nothing on the host: after a first step (which
//! resolves the driver's entry points), `set_input` + `run` + `output_bytes` make no heap
//! allocation, with the CUDA graph and without it.
//!
//! This binary holds a single test so no other test allocates concurrently. It needs a GPU;
//! without one (or without the `cuda` feature) it prints a notice and passes
//! (`TCC_REQUIRE_CUDA=1` makes that a failure).

mod common;

mod counting;

use counting::allocations_during;
use tcc_runtime::{Device, Model, Session};

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

#[test]
fn cuda_run_allocates_nothing() {
    if !common::cuda_or_skip("cuda_run_allocates_nothing") {
        return;
    }
    let model = Model::from_bytes(common::cuda_tiny_artifact()).unwrap();
    for graph in [true, false] {
        let mut s = Session::new(&model, Device::Cuda(0)).unwrap();
        s.set_cuda_graph(graph);
        let x = [1.0f32, 2.0, 3.0, 4.0];
        s.set_input("x", &x).unwrap();
        s.run().unwrap();
        let mut sum = 0u64;
        let n = allocations_during(|| {
            for _ in 0..10 {
                s.set_input("x", &x).unwrap();
                s.run().unwrap();
                sum += s
                    .output_bytes("z")
                    .unwrap()
                    .iter()
                    .map(|&b| u64::from(b))
                    .sum::<u64>();
            }
        });
        assert!(sum > 0);
        assert_eq!(
            n, 0,
            "graph {graph}: set_input + run + output_bytes allocated {n} times"
        );
    }
}
