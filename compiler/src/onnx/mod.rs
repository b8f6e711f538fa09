//! The ONNX importer: an ONNX model (`ModelProto`, protobuf) → readable TDSL source text plus
//! the initializers as named tensors (written as `.safetensors` by `tcc import`, handed to the
//! compiled step by `tcc build/run/mem model.onnx`).
//!
//! - [`proto`]: the subset of the ONNX schema read, as `prost` derive structs.
//! - [`tensor`]: `TensorProto` → host data (initializers, constants, test-data files).
//! - [`import`]: the graph walk: every value is either a runtime tensor bound by a `let` or a
//!   compile-time constant; shape arithmetic (`Shape`, `Gather`, `Concat`, `Unsqueeze`, …) is
//!   folded on constants, so `Reshape` gets a static shape. Constants reaching a runtime op
//!   become literals, `full(...)` or `param`s.
//!
//! Nothing here panics on file bytes: every problem is an [`ImportError`] naming the node.

pub mod import;
pub mod proto;
pub mod tensor;
#[cfg(test)]
mod tests;

pub use import::{import, import_owned, ImportOptions, Imported, IoValue};
pub use tensor::{read_tensor_file, read_tensor_file_as};

/// Why a model could not be imported.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ImportError {
    #[error("not a readable ONNX model: {0}")]
    Decode(String),
    #[error("the model has no graph")]
    NoGraph,
    #[error("unsupported op `{op}` (node `{node}`, opset {opset}){why}")]
    Unsupported {
        op: String,
        node: String,
        opset: i64,
        why: String,
    },
    #[error("node `{node}` ({op}): {msg}")]
    Node {
        op: String,
        node: String,
        msg: String,
    },
    #[error(
        "node `{node}` ({op}) reads `{value}`, which no input, initializer or earlier node defines"
    )]
    Missing {
        op: String,
        node: String,
        value: String,
    },
    #[error("`{name}`{at}: {dtype} tensors are not supported (tcc holds f32, f16, bf16, i32 and bool; int64 is read as i32 where its values fit){}", if dtype == "double" { "; `--f64-as-f32` computes float64 in f32" } else { "" })]
    DType {
        name: String,
        at: String,
        dtype: String,
    },
    #[error("input `{input}`, axis {axis}: the dimension `{dim}` is dynamic; bind it with `--dim {dim}=N` (on build/run/mem: `--set {dim}=N`)")]
    DynamicDim {
        input: String,
        axis: usize,
        dim: String,
    },
    #[error("input `{input}`, axis {axis}: the size is unknown (neither a number nor a name); tcc needs static shapes")]
    UnknownDim { input: String, axis: usize },
    #[error("--dim {0}: the model has no dimension of that name (its named dimensions: {1})")]
    UnusedDim(String, String),
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("{0}")]
    Other(String),
}
