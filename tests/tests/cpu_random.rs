//! Random well-typed programs (proptest) compiled for the CPU agree with the eager
//! interpreter: outputs, and params after two training steps.

use proptest::prelude::*;
use tcc::front::Options;
use tcc_tests::{compile_pipeline, cpu_steps, eager_steps, params_rel_err, rel_err};

/// A program over values of shape `[r, c]` built from random ops on earlier values.
fn program(r: usize, c: usize, ops: &[(usize, usize, usize)], train: Option<bool>) -> String {
    let mut src = format!(
        "model m {{\n input x: f32[{r}, {c}]\n input row: f32[{c}]\n input col: f32[{r}, 1]\n param w: f32[{c}, {c}] = normal(0.0, 0.3)\n param g: f32[{c}] = ones\n let v0 = tanh(x @ w)\n"
    );
    for (k, &(op, a, b)) in ops.iter().enumerate() {
        let (a, b) = (a % (k + 1), b % (k + 1));
        let smooth = train.is_some();
        let e = match op % 14 {
            0 => format!("v{a} + v{b}"),
            1 => format!("tanh(v{a}) * v{b}"),
            2 => format!("v{a} @ w"),
            3 => format!("softmax(v{a})"),
            4 => format!("v{a} - mean(v{b}, axis: 0, keepdim: true)"),
            5 => format!("transpose(transpose(v{a})) * 0.5 + row"),
            // Over two columns a layer norm's output is ±1 whatever its input (up to its
            // eps): centering it leaves rounding noise, and its gradient is rounding noise
            // that Adam turns into full steps of either sign, so two correct programs differ
            // by 1e-4. It takes three columns or more.
            6 if c >= 3 => format!("layer_norm(v{a} + row, g, row)"),
            7 => format!("v{a} * col - sigmoid(v{b})"),
            8 => format!("concat([v{a}[:, 0:1], v{b}[:, 1:]], axis: 1)"),
            9 => format!("exp(-v{a} * v{a}) + sum(v{b}, axis: 1, keepdim: true) * 0.1"),
            10 if !smooth => format!("maximum(v{a}, v{b}) + relu(v{a})"),
            11 if !smooth => format!("where(v{a} > v{b}, v{a}, col)"),
            12 => format!("reshape(transpose(reshape(v{a}, [{c}, {r}])), [{r}, {c}])"),
            _ => format!("gelu(v{a}) / (1.0 + v{b} * v{b})"),
        };
        src.push_str(&format!(" let v{} = {e}\n", k + 1));
    }
    let last = ops.len();
    src.push_str(&format!(
        " let loss = mean(v{last} * v{last})\n output loss, v{}\n",
        last / 2
    ));
    match train {
        // Adam's first steps move a param by about lr·g/(|g| + eps): with the default eps of
        // 1e-8, a gradient of 1e-7 that f32 gets to 1e-4 relative (the softmax of a nearly
        // constant row cancels terms 1e4 times larger) moves the param 1e-5 away from the
        // interpreter's. eps = 1e-4 bounds that gain by lr/eps and still runs every part of
        // the update (moments, bias correction).
        Some(true) => src.push_str(" train adam(lr: 0.01, eps: 1e-4) minimize loss\n"),
        Some(false) => src.push_str(" train sgd(lr: 0.1, momentum: 0.9) minimize loss\n"),
        None => {}
    }
    src.push_str("}\n");
    src
}

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
