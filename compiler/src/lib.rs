//! `tcc`: a tensor-program compiler that runs a whole inference or training step in one
//! static memory arena.
//!
//! The pipeline is one table, [`pipeline::PIPELINE`]: [`front`] lowers TDSL source to the
//! graph [`ir`]; [`autodiff`], the graph stages of [`passes`] and [`remat`] transform it;
//! [`kernel`] fuses it into kernels, [`plan`] places their buffers in one arena, and
//! [`back`] translates them (Cranelift for the CPU, PTX for CUDA). Layers import only
//! downwards: `kernel`, `plan` and `analysis` never import a back end; facts about the
//! target machine come from [`target`].

pub mod analysis;
pub mod artifact;
pub mod autodiff;
pub mod back;
pub mod cli;
pub mod eager;
pub mod front;
pub mod ir;
pub mod kernel;
pub mod onnx;
pub mod passes;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod remat;
pub mod rng;
pub mod target;

pub use tcc_grammar::diag::Diagnostic;
pub use tcc_grammar::span::{SourceMap, Span};
