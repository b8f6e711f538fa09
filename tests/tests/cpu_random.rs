//! Random well-typed programs (proptest) compiled for the CPU agree with the eager
//! interpreter: outputs, and params after two training steps.

use proptest::prelude::*;
use tcc::front::Options;
use tcc_tests::{
    compile_pipeline, cpu_steps, eager_steps, params_rel_err, random_program as program, rel_err,
};

proptest! {
    #![proptest_config(tcc_tests::proptest_config(64))]

    #[test]
    fn random_programs_agree_with_eager(
        r in 1usize..6,
        c in 2usize..9,
        ops in prop::collection::vec((0usize..14, 0usize..8, 0usize..8), 1..10),
        train in prop::option::of(any::<bool>()),
    ) {
        let src = program(r, c, &ops, train);
        let g = compile_pipeline(&src, &Options::default()).map_err(|e| TestCaseError::fail(format!("{src}\n{e}")))?;
        let inputs = tcc::eager::random_inputs(&g, 11);
        let steps = if train.is_some() { 2 } else { 1 };
        let want = eager_steps(&g, &inputs, steps, 0).map_err(TestCaseError::fail)?;
        let got = cpu_steps(&g, &inputs, steps, 0, true).map_err(|e| TestCaseError::fail(format!("{src}\n{e}")))?;
        for (name, t) in &want.outputs {
            let e = rel_err(&got.outputs[name], t);
            prop_assert!(e <= 1e-5, "output `{}` differs by {:e}\n{}", name, e, src);
        }
        // Params and optimizer state as one vector (see `params_rel_err`).
        let e = params_rel_err(&got.persistent, &want.persistent).unwrap_or(f64::INFINITY);
        prop_assert!(e <= 1e-5, "params differ by {:e}\n{}", e, src);
    }
}
