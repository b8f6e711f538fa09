//! The graph IR: types, ops with their shape rules, the graph, its printer and verifier.

pub mod graph;
pub mod op_table;
pub mod ops;
pub mod printer;
pub mod types;
pub mod verify;

pub use graph::{sink, Graph, Node, NodeId, Optimizer, Stack, StepCheck, TrainSpec};
pub use op_table::{IntFault, OpClass, Takes};
pub use ops::{infer, BinaryOp, Init, Op, PoolKind, ReduceOp, TypeError, UnaryOp};
pub use types::{DType, Scalar, Shape, TensorType};
