//! Analyses: results kept in side tables, never in the IR.

pub mod arena;
