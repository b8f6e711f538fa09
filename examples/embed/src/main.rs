//! Embeds the tcc runtime: loads a compiled training step (`mlp.tcc`), feeds it synthetic
//! classification data and prints the loss as it trains. Links only `tcc-runtime`.
//!
//! ```text
//! cargo run --release -p tcc -- build examples/mlp.tdsl --emit artifact -o mlp.tcc
//! cargo run --release -p tcc-embed -- mlp.tcc [STEPS]
//! ```

use std::process::ExitCode;
use std::time::Instant;
use tcc_runtime::{Device, Model, Session};

/// A learnable data set: each example is its class's prototype plus noise.
struct Data {
    x: Vec<f32>,
    labels: Vec<i32>,
}

fn synthetic(batch: usize, dim: usize, classes: usize, seed: u64) -> Data {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let protos: Vec<f32> = (0..classes * dim).map(|_| next()).collect();
    let labels: Vec<i32> = (0..batch).map(|i| (i % classes) as i32).collect();
    let mut x = Vec::with_capacity(batch * dim);
    for &l in &labels {
        for d in 0..dim {
            x.push(protos[l as usize * dim + d] + 0.3 * next());
        }
    }
    Data { x, labels }
}

fn run(path: &str, steps: usize) -> Result<(), tcc_runtime::Error> {
    let model = Model::load(path)?;
    let mut session = Session::new(&model, Device::Cpu)?;
    let x = model
        .inputs()
        .iter()
        .find(|s| s.name == "x")
        .ok_or_else(|| tcc_runtime::Error::UnknownTensor {
            kind: "input",
            name: "x".into(),
            known: model.inputs().iter().map(|s| s.name.clone()).collect(),
        })?;
    let (batch, dim) = (x.shape[0], x.shape[1]);
    let classes = model
        .outputs()
        .iter()
        .find(|s| s.name == "logits")
        .map_or(10, |s| s.shape[1]);
    println!(
        "loaded {path}: model `{}`, {} kernels, arena {} bytes (one allocation), batch {batch}, {dim} features, {classes} classes",
        model.manifest().model,
        model.manifest().kernels.len(),
        session.arena_bytes()
    );
    let data = synthetic(batch, dim, classes, 7);
    let start = Instant::now();
    for step in 1..=steps {
        // Inputs share arena bytes with intermediates once read: set them every step.
        session.set_input("x", &data.x)?;
        session.set_input("labels", &data.labels)?;
        session.run()?;
        let loss: Vec<f32> = session.output("loss")?;
        if step == 1 || step % 10 == 0 || step == steps {
            println!(
                "step {step:>4}  loss {:.6}",
                loss.first().copied().unwrap_or(f32::NAN)
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{steps} steps in {secs:.2} s ({:.1} ms/step)",
        secs * 1e3 / steps.max(1) as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: embed MODEL.tcc [STEPS]   (build it with `tcc build examples/mlp.tdsl --emit artifact -o mlp.tcc`)");
        return ExitCode::from(2);
    };
    let steps = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(50);
    match run(path, steps) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
