//! Eager memory accounting on small graphs, against byte counts worked out by hand.

use tcc::eager::memory::account;
use tcc::front::Options;
use tcc_tests::compile_pipeline;

#[test]
fn forward_chain_frees_after_last_use() {
    // x: 16 B input. exp → 16 live; literal 2 → 20; mul → 36 (peak, while exp and the
    // literal are still live); then both die → 16; sum → 20; mul dies → 4 (the output).
    let g = compile_pipeline(
        "model m {\n input x: f32[4]\n let a = exp(x)\n let b = a * 2\n let c = sum(b)\n output c\n}\n",
        &Options::default(),
    )
    .unwrap();
    let m = account(&g);
    assert_eq!(m.input_bytes, 16);
    assert_eq!(m.param_bytes + m.state_bytes, 0);
    assert_eq!(m.peak_transient_bytes, 36);
    assert_eq!(m.timeline, vec![0, 16, 20, 36, 20]);
    assert_eq!(m.total_transient_bytes, 40);
    assert_eq!(m.peak_bytes(), 52);
    let mut live: Vec<u64> = m.live_at_peak.iter().map(|l| l.1).collect();
    live.sort();
    assert_eq!(live, vec![4, 16, 16]);
}

#[test]
fn views_allocate_nothing_and_keep_their_base_alive() {
    // exp allocates 16 B; reshape and transpose are views of it.
    let g = compile_pipeline(
        "model m {\n input x: f32[4]\n let t = transpose(reshape(exp(x), [2, 2]))\n output t\n}\n",
        &Options::default(),
    )
    .unwrap();
    let m = account(&g);
    assert_eq!(m.peak_transient_bytes, 16);
    assert_eq!(m.total_transient_bytes, 16);
    assert_eq!(
        *m.timeline.last().unwrap(),
        16,
        "the output's base stays live"
    );
}

#[test]
fn training_step_keeps_activations_for_backward_and_updates_in_place() {
    // Forward: x*w (8) → sum (4): peak 12, both die (nothing reads the loss later).
    // Backward: seed 1.0 (4) broadcast (view) → dw = g*x (8): 12; the seed dies → 8.
    // SGD: literal 0.5 (4) → 12; lr*dw (8) → 20 (the peak); w - step writes w in place.
    // The finite check: |w| (8) → its sum (4), after the peak.
    let g = compile_pipeline(
        "model m {\n input x: f32[2]\n param w: f32[2] = ones\n let loss = sum(x * w)\n train sgd(lr: 0.5) minimize loss\n}\n",
        &Options::default(),
    )
    .unwrap();
    let m = account(&g);
    assert_eq!((m.input_bytes, m.param_bytes, m.state_bytes), (8, 8, 0));
    assert_eq!(m.peak_transient_bytes, 20);
    assert_eq!(m.total_transient_bytes, 8 + 4 + 4 + 8 + 4 + 8 + 8 + 4);
}

#[test]
fn optimizer_state_is_persistent() {
    let g = compile_pipeline(
        "model m {\n input x: f32[2]\n param w: f32[2] = ones\n let loss = sum(x * w)\n train adam(lr: 0.1) minimize loss\n}\n",
        &Options::default(),
    )
    .unwrap();
    let m = account(&g);
    // exp_avg and exp_avg_sq of w (8 B each) and the f32 step counter.
    assert_eq!(m.state_bytes, 8 + 8 + 4);
    assert_eq!(m.param_bytes, 8);
}

#[test]
fn checkpointed_activations_are_recomputed_not_kept() {
    let plain = "model m {\n input x: f32[64]\n param w: f32[64] = ones\n let h = tanh(tanh(tanh(x * w)))\n let loss = sum(h * h)\n train sgd(lr: 0.1) minimize loss\n}\n";
    let ckpt = plain.replace(
        "let h = tanh(tanh(tanh(x * w)))",
        "let h = checkpoint { tanh(tanh(tanh(x * w))) }",
    );
    let a = account(&compile_pipeline(plain, &Options::default()).unwrap());
    let b = account(&compile_pipeline(&ckpt, &Options::default()).unwrap());
    assert!(
        b.peak_transient_bytes < a.peak_transient_bytes,
        "checkpoint {} vs plain {}",
        b.peak_transient_bytes,
        a.peak_transient_bytes
    );
    assert!(
        b.total_transient_bytes > a.total_transient_bytes,
        "recomputation allocates more in total"
    );
}
