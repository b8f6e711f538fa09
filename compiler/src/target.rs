//! Facts about the machine the code is compiled for, in one value: the GPU's streaming
//! multiprocessors (whose waves the matmul tile choices count), its shared memory per
//! block, and the arena's alignment. The kernel lowering, the plan and the PTX back end
//! read them from here rather than each hard-coding its own copy.

/// Facts about a target machine (not [`crate::artifact::Target`], which names the back end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetInfo {
    /// PTX architecture (`.target`); kernels with Hopper-only instructions add `a`.
    pub arch: &'static str,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Bytes of static shared memory a block may declare.
    pub shared_static_bytes: u32,
    /// Bytes of shared memory a block may use in all (static and dynamic, the dynamic part
    /// raised per kernel).
    pub shared_max_bytes: u32,
    /// Alignment in bytes of every buffer of the arena.
    pub align: u64,
}

impl TargetInfo {
    /// An NVIDIA H100 or H200 (sm_90): 132 SMs, 48 KiB of static and 227 KiB of shared
    /// memory in all per block, 256-byte arena alignment.
    pub const fn h100() -> TargetInfo {
        TargetInfo {
            arch: "sm_90",
            sms: 132,
            shared_static_bytes: 48 * 1024,
            shared_max_bytes: 227 * 1024,
            align: 256,
        }
    }
}

/// The machine every build targets today.
pub const TARGET: TargetInfo = TargetInfo::h100();
