//! `tcc`: a tensor-program compiler that runs a whole inference or training step in one
//! static memory arena.
//!
//! The pipeline (see DESIGN.md): [`front`] lowers TDSL source to the graph [`ir`]; later
//! stages (autodiff, passes, planner, back ends) transform that graph.

pub mod analysis;
pub mod artifact;
pub mod autodiff;
pub mod back;
pub mod cli;
pub mod eager;
pub mod front;
pub mod ir;
pub mod kernel;
pub mod passes;
pub mod pipeline;
pub mod plan;
pub mod remat;
pub mod rng;
pub mod target;

pub use tcc_grammar::diag::Diagnostic;
pub use tcc_grammar::span::{SourceMap, Span};
