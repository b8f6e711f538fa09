//! Stacked params held as one param a layer (issue 27, item 3): `w: f32[L, …]` read as
//! `w[l]` gets an update a layer, each as soon as its layer's gradient is ready, while the
//! artifact, saved params and the interpreter see `w` whole.

use std::time::Duration;
use tcc::eager::{self, Precision, Tensor};
use tcc::ir::{Graph, Op};
use tcc_runtime::Device;
use tcc_tests::{compile_bytes, compile_pipeline, compile_to, device_options, options_from_args};

/// A three-layer tanh network whose layers are `w[l]` (stacked) or `w0`, `w1`, `w2`.
fn layers(stacked: bool, opt: &str) -> String {
    let (decl, read) = if stacked {
        (
            "param w: f32[3, 8, 8] = normal(0.0, 0.3)".to_string(),
            "w[l]",
        )
    } else {
        (
            (0..3)
                .map(|l| format!("param w{l}: f32[8, 8] = normal(0.0, 0.3)\n"))
                .collect::<String>(),
            "",
        )
    };
    let body = if stacked {
        format!("for l in 0..3 {{ h = tanh(h @ {read} + b) }}")
    } else {
        "h = tanh(h @ w0 + b)\n h = tanh(h @ w1 + b)\n h = tanh(h @ w2 + b)".to_string()
    };
    format!(
        "model m {{
            input x: f32[4, 8]
            {decl}
            param b: f32[8] = zeros
            let h = x
            {body}
            let loss = mean(h * h)
            output loss
            train {opt} minimize loss
        }}"
    )
}

/// `tcc mem`'s report of `program` (a step after autodiff) for `compile`'s target, the
/// stages from `schedule` to `last` run on it first.
fn mem_report(
    program: &Graph,
    last: &str,
    sources: &tcc::front::Sources,
    compile: tcc::artifact::CompileOptions,
) -> tcc::cli::mem::MemReport {
    let scheduled = tcc_tests::run_stages(program, "schedule", last, compile)
        .unwrap()
        .graph()
        .clone();
    tcc::cli::mem::report(
        program,
        &scheduled,
        sources,
        Duration::from_millis(200),
        &compile,
        None,
    )
    .unwrap()
    .report
}

fn step(src: &str) -> Graph {
    compile_pipeline(src, &Default::default()).unwrap_or_else(|e| panic!("{e}\n{src}"))
}

/// Three interpreted steps of the stacked program equal those of the same program written
/// with a param a layer, started from the same values: params and optimizer state, bit
/// for bit. The compiled CPU step gives the interpreter's values too.
#[test]
fn a_stacked_param_trains_as_a_param_a_layer_would() {
    for opt in [
        "adam(lr: 0.01)",
        "adamw(lr: 0.01, weight_decay: 0.1)",
        "sgd(lr: 0.1, momentum: 0.9, weight_decay: 0.01)",
    ] {
        let stacked = step(&layers(true, opt));
        let apart = step(&layers(false, opt));
        let stack = stacked.stacks.iter().find(|s| s.name == "w");
        let stack = stack.unwrap_or_else(|| panic!("{opt}: `w` is not split"));
        assert_eq!(stack.pieces.len(), 3);
        let inputs = eager::random_inputs(&stacked, 5);
        let mut ps = eager::init_persistent(&stacked, 0);
        let mut pa = eager::init_persistent(&apart, 0);
        // The same starting values: `w`'s layers are `w0`, `w1` and `w2`.
        let w = ps.values["w"].to_f64();
        for l in 0..3 {
            let part = w[l * 64..(l + 1) * 64].to_vec();
            let t = Tensor::from_f64(tcc::ir::DType::F32, vec![8, 8], part);
            pa.values.insert(format!("w{l}"), t);
        }
        for _ in 0..3 {
            let a = eager::run_step(&stacked, &mut ps, &inputs, Precision::Native).unwrap();
            let b = eager::run_step(&apart, &mut pa, &inputs, Precision::Native).unwrap();
            assert_eq!(a, b, "{opt}: losses");
        }
        let whole = |prefix: &str| -> Vec<f64> {
            (0..3)
                .flat_map(|l| pa.values[&format!("w{l}{prefix}")].to_f64())
                .collect()
        };
        let suffixes: Vec<&str> = match opt.split('(').next() {
            Some("sgd") => vec!["", ".momentum"],
            _ => vec!["", ".exp_avg", ".exp_avg_sq"],
        };
        for suffix in suffixes {
            let name = format!("w{suffix}");
            let got = ps
                .values
                .get(&name)
                .unwrap_or_else(|| panic!("{opt}: no `{name}`"));
            assert_eq!(got.dims(), [3, 8, 8], "{opt}: `{name}` is whole");
            assert_eq!(got.to_f64(), whole(suffix), "{opt}: `{name}`");
        }
        assert!(
            !ps.values.keys().any(|k| k.contains('[')),
            "{opt}: the interpreter holds a layer by its own name: {:?}",
            ps.values.keys().collect::<Vec<_>>()
        );
        tcc_tests::assert_cpu_steps_like_eager(&stacked, 5, 3, 1e-5, opt);
    }
}

/// The artifact names every stack whole (`w` and its state as `[3, 8, 8]`, at the first
/// layer's offset), and a param file saved from it loads into it.
#[test]
fn the_artifact_holds_a_stack_whole() {
    let g = step(&layers(true, "adam(lr: 0.01)"));
    let opts = device_options(Device::Cpu, true);
    let c = tcc::artifact::compile(&g, &opts).unwrap();
    let img = tcc::artifact::persistent_image(&c, 0, &Default::default()).unwrap();
    let m = tcc::artifact::manifest(&c, opts.target, &img);
    let names: Vec<&str> = m.persistent.iter().map(|p| p.slot.name.as_str()).collect();
    for name in ["w", "w.exp_avg", "w.exp_avg_sq"] {
        let p = m.persistent.iter().find(|p| p.slot.name == name);
        let p = p.unwrap_or_else(|| panic!("no `{name}` in {names:?}"));
        assert_eq!(p.slot.shape, [3, 8, 8], "{name}");
        assert_eq!(p.slot.bytes, 3 * 8 * 8 * 4, "{name}");
        let stack = g.stacks.iter().find(|s| s.name == name).unwrap();
        assert_eq!(Some(p.slot.offset), c.offset_of(stack.pieces[0]), "{name}");
    }
    assert!(!names.iter().any(|n| n.contains('[')), "{names:?}");
    assert!(m
        .persistent
        .iter()
        .any(|p| p.slot.name == "w" && p.init.is_some()));
    let bytes = tcc::artifact::write_artifact(&c, opts.target, &img);
    let model = tcc_runtime::Model::from_bytes(bytes).unwrap();
    let mut s = tcc_runtime::Session::new(&model, Device::Cpu).unwrap();
    let before = s.save_params_bytes().unwrap();
    s.run().unwrap();
    let after = s.save_params_bytes().unwrap();
    assert_ne!(before, after, "the step updates `w`");
    s.load_params_bytes(&before).unwrap();
    assert_eq!(s.save_params_bytes().unwrap(), before);
}

/// Params left whole: read whole as well as by layer, a layer nothing reads, a layer read
/// only by a value the loss does not depend on (it would get no update), a layer whose
/// bytes are not a multiple of the alignment, a step that does not train, and a
/// data-parallel step.
#[test]
fn params_not_read_only_by_layer_are_left_whole() {
    let base = layers(true, "sgd(lr: 0.1)");
    let cases = [
        (
            "read whole",
            base.replace(
                "let loss = mean(h * h)",
                "let loss = mean(h * h) + sum(w * w)",
            ),
        ),
        ("a layer unread", base.replace("0..3", "0..2")),
        (
            "a layer the loss does not read",
            base.replace("0..3", "0..2").replace(
                "let loss = mean(h * h)",
                "let z = h @ w[2]\n let loss = mean(h * h)",
            ),
        ),
        (
            "unaligned layers",
            base.replace("f32[3, 8, 8]", "f32[3, 3, 3]")
                .replace("input x: f32[4, 8]", "input x: f32[4, 3]")
                .replace("param b: f32[8]", "param b: f32[3]"),
        ),
        (
            "no train",
            base.replace("train sgd(lr: 0.1) minimize loss", ""),
        ),
    ];
    for (what, src) in cases {
        let g = step(&src);
        assert!(g.stacks.is_empty(), "{what}: split\n{src}");
        assert!(
            g.params
                .iter()
                .any(|&p| matches!(&g.node(p).op, Op::Param { name, .. } if name == "w")),
            "{what}"
        );
    }
    let lowered = compile_to(&base, &Default::default(), "lower").unwrap();
    let ranks = tcc::artifact::CompileOptions {
        ranks: 2,
        ..Default::default()
    };
    let g = tcc_tests::run_stages(&lowered, "autodiff", "autodiff", ranks).unwrap();
    assert!(g.graph().stacks.is_empty(), "data-parallel: split");
}

/// At most about a layer's gradients are live at the peak of a small-batch gpt, on both
/// targets: each layer's update runs as soon as its gradient is ready (with one update a
/// stack, 7 MiB here, more than two layers' worth, waited for the first layer's).
#[test]
fn a_layer_of_gradients_at_most_is_live_at_the_peak() {
    let file = "examples/gpt.tdsl";
    let sets = "--set B=1 --set T=64 --set L=4 --set D=256 --set H=4 --set V=2048";
    let src = std::fs::read_to_string(tcc_tests::root().join(file)).unwrap();
    let layer = 12 * 256 * 256 * 4;
    for device in [Device::Cpu, Device::Cuda(0)] {
        let opts = options_from_args(sets);
        let (sources, _) = compile_bytes(file, src.as_bytes(), &opts).unwrap();
        let program = compile_to(&src, &opts, "autodiff").unwrap();
        let r = &mem_report(&program, "schedule", &sources, device_options(device, true));
        assert!(
            r.gradient_peak_bytes <= layer,
            "{device:?}: {} gradient bytes live at the peak in {} buffers",
            r.gradient_peak_bytes,
            r.gradient_peak_buffers
        );
    }
}

/// Where splitting every stack leaves the peak where it is, a stack of which several
/// layers' gradients wait at the peak that free recomputation leaves (in the backward
/// pass, not at the turn to it) is split alone, where the plans say that lowers the arena.
/// The cnn at B=64, C=32, S=32 splits `s4_w` and no other stack: its fused arena is below
/// the whole step's on both targets, and at most one layer of `s4_w`'s gradient is live at
/// the fused peak, where the whole step holds its three layers. At B=16, C=16, S=16 the
/// graph's peak names `s3_w`, but split it raises the fused arena: the step stays whole.
#[test]
fn a_stack_whose_layers_wait_at_the_peak_is_split_alone() {
    use tcc::autodiff::stacks::{held_at_peak, Which};
    let file = "examples/cnn.tdsl";
    let src = std::fs::read_to_string(tcc_tests::root().join(file)).unwrap();
    let param_stacks = |g: &Graph| -> Vec<String> {
        g.stacks
            .iter()
            .filter(|s| matches!(g.node(s.pieces[0]).op, Op::Param { .. }))
            .map(|s| s.name.clone())
            .collect()
    };
    let expanded = |lowered: &Graph, which| {
        let mut g = lowered.clone();
        tcc::autodiff::expand_with_stacks(&mut g, which).unwrap();
        g
    };

    let small = options_from_args("--set B=16 --set C=16 --set S=16");
    let lowered = compile_to(&src, &small, "lower").unwrap();
    let held = held_at_peak(&expanded(&lowered, Which::None), true).unwrap();
    assert_eq!(held.into_iter().collect::<Vec<_>>(), ["s3_w"]);
    let chosen = compile_to(&src, &small, "autodiff").unwrap();
    assert!(
        param_stacks(&chosen).is_empty(),
        "{:?}",
        param_stacks(&chosen)
    );

    let opts = options_from_args("--set B=64 --set C=32 --set S=32");
    let (sources, _) = compile_bytes(file, src.as_bytes(), &opts).unwrap();
    let chosen = compile_to(&src, &opts, "autodiff").unwrap();
    assert_eq!(param_stacks(&chosen), ["s4_w"]);
    let lowered = compile_to(&src, &opts, "lower").unwrap();
    let whole = expanded(&lowered, Which::None);
    assert!(whole.stacks.is_empty());
    assert!(param_stacks(&expanded(&lowered, Which::All)).len() > 4);
    // A layer of s4_w: f32[8C, 8C, 3, 3].
    let layer = 256 * 256 * 9 * 4;
    for device in [Device::Cpu, Device::Cuda(0)] {
        let compile = device_options(device, true);
        let report = |program: &Graph| mem_report(program, "remat", &sources, compile);
        let (c, w) = (report(&chosen), report(&whole));
        assert!(
            c.fused_arena_bytes < w.fused_arena_bytes,
            "{device:?}: {} against {} whole",
            c.fused_arena_bytes,
            w.fused_arena_bytes
        );
        assert!(
            w.gradient_peak_bytes >= 3 * layer && c.gradient_peak_bytes < 2 * layer,
            "{device:?}: {} gradient bytes live at the peak, {} whole",
            c.gradient_peak_bytes,
            w.gradient_peak_bytes
        );
    }
}
