//! Back ends: kernel IR to code.
//!
//! - [`clif`]: Cranelift IR text for the CPU (compiled by the runtime at load time).
//! - [`ptx`]: PTX text for NVIDIA GPUs (loaded by the runtime's CUDA executor).

pub mod clif;
pub mod ptx;
