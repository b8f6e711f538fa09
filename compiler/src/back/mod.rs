//! Back ends: kernel IR to code.
//!
//! - [`clif`]: Cranelift IR text for the CPU (compiled by the runtime at load time).

pub mod clif;
