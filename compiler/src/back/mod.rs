//! Back ends: kernel IR to code.
//!
//! - [`clif`]: Cranelift IR text for the CPU (compiled by the runtime at load time).
//! - [`ptx`]: PTX text for NVIDIA GPUs (loaded by the runtime's CUDA executor).
//! - [`sass`]: that PTX assembled by `ptxas` into machine code for one GPU architecture,
//!   which a `cuda` artifact carries beside it when `ptxas` is there at build time.

pub mod clif;
pub mod divconst;
pub mod ptx;
pub mod sass;
