//! Mixed-precision helpers shared by the CPU (`tests/amp.rs`) and GPU (`tests/gpu.rs`)
//! tests.
//!
//! The interpreter runs the mixed-precision step op by op and rounds every 16-bit value;
//! compiled kernels round 16-bit values as well but sum in other orders, so the two agree
//! within a bound per dtype: ‖compiled − eager‖ / ‖eager‖ ≤ [`BF16_TOL`] for bf16 (7-bit
//! mantissa) and [`F16_TOL`] for f16 (10 bits), for outputs and for params and optimizer
//! state after the steps.

use crate::{
    compile_bytes, device_options, eager_steps, options_from_args, params_rel_err, rel_err,
    steps_compiled, StepResult,
};
use std::collections::BTreeMap;
use tcc::artifact::CompileOptions;
use tcc::eager::Tensor;
use tcc::ir::{DType, Graph};
use tcc::passes::amp::Amp;
use tcc_runtime::Device;

pub const BF16_TOL: f64 = 2e-2;
pub const F16_TOL: f64 = 4e-3;

pub fn tol(amp: &Amp) -> f64 {
    match amp.dtype {
        Some(DType::BF16) => BF16_TOL,
        _ => F16_TOL,
    }
}

/// The step (stages `lower` to `schedule`) of a program under `amp` (loss scaling is made
/// by autodiff).
pub fn step(src: &str, args: &str, amp: Amp) -> Graph {
    let (sources, mut lowered) =
        compile_bytes("case.tdsl", src.as_bytes(), &options_from_args(args)).unwrap();
    let opts = tcc::pipeline::Options {
        compile: CompileOptions {
            amp,
            ..Default::default()
        },
        verify: true,
        ..Default::default()
    };
    match tcc::pipeline::lowered(
        lowered.graphs.remove(0),
        Default::default(),
        "schedule",
        &opts,
        &mut |_, _| {},
    ) {
        Ok((tcc::pipeline::Product::Graph(g), _)) => g,
        Ok((p, _)) => panic!("the pipeline gave {}", p.form()),
        Err(e) => panic!(
            "{}",
            tcc_grammar::diag::render_all(&e.diagnostics(), &sources.map)
        ),
    }
}

/// `steps` steps compiled for the CPU with the pipeline's own `amp` stage.
pub fn compiled(
    g: &Graph,
    inputs: &BTreeMap<String, Tensor>,
    device: Device,
    steps: usize,
    amp: Amp,
) -> StepResult {
    let opts = CompileOptions {
        amp,
        ..device_options(device, true)
    };
    steps_compiled(g, inputs, steps, 0, device, &opts).unwrap()
}

/// `steps` interpreted steps of the mixed-precision step.
pub fn interpreted(
    g: &Graph,
    inputs: &BTreeMap<String, Tensor>,
    steps: usize,
    amp: Amp,
) -> StepResult {
    eager_steps(&amp.apply_to(g).unwrap(), inputs, steps, 0).unwrap()
}

pub fn policies() -> [Amp; 2] {
    [Amp::named("bf16").unwrap(), Amp::named("f16").unwrap()]
}

/// Compiled and interpreted steps agree within `factor` times the dtype's bound.
pub fn agree(src: &str, args: &str, steps: usize, factor: f64, what: &str, device: Device) {
    for a in policies() {
        let tol = |a: &Amp| tol(a) * factor;
        let g = step(src, args, a);
        let inputs = tcc::eager::random_inputs(&g, 7);
        let want = interpreted(&g, &inputs, steps, a);
        let got = compiled(&g, &inputs, device, steps, a);
        for (name, t) in &want.outputs {
            let e = rel_err(&got.outputs[name], t);
            assert!(
                e <= tol(&a),
                "{what} --amp {}: output `{name}` differs by {e:e}",
                a.name()
            );
        }
        let e = params_rel_err(&got.persistent, &want.persistent).unwrap();
        if e <= tol(&a) {
            continue;
        }
        // Gradients that are sums cancelling to about zero (a batch norm's, at a small
        // batch) keep only 16-bit rounding noise, which differs between any two orders of
        // rounding: the compiled step must then be no further from the f32 step than the
        // interpreted one is.
        let f32_graph = step(src, args, Amp::default());
        let exact = interpreted(&f32_graph, &inputs, steps, Amp::default());
        let mut exact = exact.persistent;
        for (name, t) in &want.persistent {
            exact.entry(name.clone()).or_insert_with(|| t.clone());
        }
        let ours = params_rel_err(&got.persistent, &exact).unwrap();
        let reference = params_rel_err(&want.persistent, &exact).unwrap();
        assert!(
            ours <= 1.5 * reference,
            "{what} --amp {}: params differ by {e:e}; from f32's: compiled {ours:e}, interpreted {reference:e}",
            a.name()
        );
    }
}
