//! A kernel that faults on the GPU is a typed error from `run`, not a panic or an abort.
//!
//! A fault poisons the CUDA context, which every session of the process shares on that
//! device, so this binary holds a single test. It needs a GPU; without one (or without the
//! `cuda` feature) it prints a notice and passes (`TCC_REQUIRE_CUDA=1` makes that a failure).

mod common;

use common::*;
use tcc_runtime::{Device, Error, Model, Session};

#[test]
fn kernel_fault_is_a_typed_error() {
    if !cuda_or_skip("kernel_fault_is_a_typed_error") {
        return;
    }
    let mut m = cuda_tiny_manifest();
    m.kernels.truncate(1);
    let code = format!("{PTX_HEADER}{}", faulting_ptx("k0"));
    let model = Model::from_bytes(build(&m, &code, &[0u8; 64])).unwrap();
    for graph in [true, false] {
        let mut s = match Session::new(&model, Device::Cuda(0)) {
            Ok(s) => s,
            // After the first fault the context may refuse new sessions: also typed.
            Err(e) => {
                assert!(!graph, "{e:?}");
                assert!(matches!(e, Error::Cuda { .. }), "{e:?}");
                continue;
            }
        };
        s.set_cuda_graph(graph);
        let err = s.run().unwrap_err();
        assert!(matches!(err, Error::Cuda { .. }), "{err:?}");
        // Reading after a fault is an error or stale data, never a crash.
        let _ = s.param::<f32>("w");
        let _ = s.output_bytes("y");
        let _ = s.arena();
        assert!(s.run().is_err());
        drop(s);
    }
}
