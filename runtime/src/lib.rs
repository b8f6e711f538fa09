//! `tcc-runtime`: loads a compiled tcc artifact and runs it inside one static memory arena.
//!
//! The runtime deliberately has no dependency on the compiler, so a program that only runs
//! models links nothing but this crate. The artifact format, the CPU executor and the CUDA
//! executor arrive with the back ends; today the crate holds only the shared vocabulary.

/// Where a session runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}
