//! Analyses: results kept in side tables, never in the IR.

pub mod arena;
pub mod interference;
pub mod launch_deps;
pub mod liveness;
pub mod zeros;
