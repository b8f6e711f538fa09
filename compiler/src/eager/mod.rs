//! The eager reference interpreter: runs a graph op by op on the CPU.
//!
//! It is the numerical oracle for every back end (each op's reference semantics are in
//! [`kernels`]) and the "eager execution" baseline for memory ([`memory`]). Each result is
//! computed when its op runs and dropped right after its last use, in the graph's
//! execution order; [`memory::account`] gives the byte accounting of that execution.
//!
//! Float tensors of every float dtype are computed in f64 and rounded to their dtype on
//! store (f16 and bf16 through the `half` crate); [`Precision::F64`] skips the rounding for
//! gradient checks.

pub mod io;
pub mod kernels;
pub mod memory;
pub mod tensor;

use crate::ir::{DType, Graph, Init, NodeId, Op, TensorType};
use std::borrow::Cow;
use std::collections::BTreeMap;
use tcc_runtime::init::{name_hash, uniform};
pub use tensor::{Data, Precision, Tensor};

/// Errors while running a graph eagerly.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EagerError {
    #[error("missing input `{0}`")]
    MissingInput(String),
    #[error("input `{name}` is {found}, but the model declares {expected}")]
    InputType {
        name: String,
        expected: TensorType,
        found: TensorType,
    },
    #[error("param `{0}` has no initialiser and was not loaded (use --param-file)")]
    MissingParam(String),
    #[error("{what} {index} out of range 0..{bound}")]
    IndexOutOfRange {
        what: &'static str,
        index: i64,
        bound: usize,
    },
    #[error("integer division by zero")]
    DivisionByZero,
    #[error("the graph still has a `grad` node; run autodiff first")]
    UnexpandedGrad,
    #[error("internal error in the eager interpreter: {0}")]
    Internal(String),
}

/// Params and optimizer state by name: what persists across steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Persistent {
    pub values: BTreeMap<String, Tensor>,
}

fn persistent_name(op: &Op) -> Option<(&str, &TensorType)> {
    match op {
        Op::Param { name, ty, .. } | Op::State { name, ty } => Some((name, ty)),
        _ => None,
    }
}

/// Initial value of a param: deterministic in (`seed`, param name, element index).
/// `normal` uses Box–Muller on two uniform draws per element.
pub fn init_value(name: &str, ty: &TensorType, init: Init, seed: u64) -> Option<Tensor> {
    let recipe = crate::artifact::recipe(init, seed)?;
    let mut values = vec![0.0; ty.shape.numel()];
    tcc_runtime::init::fill_f64(name, recipe, 0, &mut values);
    Some(Tensor::from_f64(ty.dtype, ty.shape.clone(), values))
}

/// Initial params (from their initialisers) and zeroed optimizer state. Params without an
/// initialiser are left out: the caller loads them.
pub fn init_persistent(g: &Graph, seed: u64) -> Persistent {
    let mut values = BTreeMap::new();
    for (id, name, ty) in g.persistent_tensors() {
        match &g.node(id).op {
            Op::Param { init, .. } => {
                if let Some(t) = init_value(&name, &ty, *init, seed) {
                    values.insert(name, t);
                }
            }
            Op::State { .. } => {
                values.insert(name, Tensor::zeros(ty));
            }
            _ => {}
        }
    }
    Persistent { values }
}

/// The value of a stack's layer `l` in the whole tensor `whole` (of the stack's type).
fn layer_of(whole: &Tensor, l: usize, ty: &TensorType) -> Result<Tensor, EagerError> {
    let n = ty.shape.numel();
    let values = whole.to_f64();
    let part = values
        .get(l * n..(l + 1) * n)
        .ok_or_else(|| EagerError::Internal("stack layer out of range".into()))?;
    Ok(Tensor::from_f64(ty.dtype, ty.shape.clone(), part.to_vec()))
}

/// Runs one step: every node in execution order, then the end-of-step updates.
/// Returns the outputs in declaration order.
pub fn run_step(
    g: &Graph,
    persistent: &mut Persistent,
    inputs: &BTreeMap<String, Tensor>,
    precision: Precision,
) -> Result<Vec<(String, Tensor)>, EagerError> {
    let order = g
        .topo_order()
        .ok_or_else(|| EagerError::Internal("cyclic graph".into()))?;
    let pos: BTreeMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let end = order.len();
    let mut last_use: Vec<usize> = vec![0; end];
    for (i, &n) in order.iter().enumerate() {
        last_use[i] = last_use[i].max(i);
        for inp in &g.node(n).inputs {
            let p = pos[inp];
            last_use[p] = last_use[p].max(i);
        }
    }
    for (_, o) in &g.outputs {
        last_use[pos[o]] = end;
    }
    for (_, v) in &g.updates {
        last_use[pos[v]] = end;
    }
    let mut vals: Vec<Option<Cow<Tensor>>> = vec![None; end];
    let mut dead: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &l) in last_use.iter().enumerate() {
        dead.entry(l).or_default().push(i);
    }
    {
        let store = &persistent.values;
        for (i, &n) in order.iter().enumerate() {
            let node = g.node(n);
            let value: Cow<Tensor> = match &node.op {
                Op::Input { name, ty } => {
                    let t = inputs
                        .get(name)
                        .ok_or_else(|| EagerError::MissingInput(name.clone()))?;
                    if &t.ty != ty {
                        return Err(EagerError::InputType {
                            name: name.clone(),
                            expected: ty.clone(),
                            found: t.ty.clone(),
                        });
                    }
                    Cow::Borrowed(t)
                }
                op @ (Op::Param { .. } | Op::State { .. }) => {
                    let (name, ty) =
                        persistent_name(op).ok_or_else(|| EagerError::Internal("param".into()))?;
                    match g.stack_of(n) {
                        // A stack's layer, from the whole tensor.
                        Some((s, l)) => Cow::Owned(layer_of(
                            store
                                .get(&s.name)
                                .ok_or_else(|| EagerError::MissingParam(s.name.clone()))?,
                            l,
                            ty,
                        )?),
                        None => Cow::Borrowed(
                            store
                                .get(name)
                                .ok_or_else(|| EagerError::MissingParam(name.to_string()))?,
                        ),
                    }
                }
                Op::Grad => return Err(EagerError::UnexpandedGrad),
                op => {
                    let args: Vec<&Tensor> = node
                        .inputs
                        .iter()
                        .map(|inp| {
                            vals[pos[inp]]
                                .as_deref()
                                .ok_or_else(|| EagerError::Internal("operand freed early".into()))
                        })
                        .collect::<Result<_, _>>()?;
                    Cow::Owned(kernels::eval(op, &node.ty, &args, precision)?)
                }
            };
            vals[i] = Some(value);
            if let Some(d) = dead.get(&i) {
                for &k in d {
                    vals[k] = None;
                }
            }
        }
    }
    let mut outputs = Vec::with_capacity(g.outputs.len());
    for (name, o) in &g.outputs {
        let t = vals[pos[o]]
            .as_deref()
            .ok_or_else(|| EagerError::Internal("output freed".into()))?;
        outputs.push((name.clone(), t.clone()));
    }
    let mut new_values = Vec::with_capacity(g.updates.len());
    for (target, v) in &g.updates {
        let (name, _) = persistent_name(&g.node(*target).op)
            .ok_or_else(|| EagerError::Internal("update target".into()))?;
        let t = vals[pos[v]]
            .as_deref()
            .ok_or_else(|| EagerError::Internal("update freed".into()))?;
        new_values.push((*target, name.to_string(), t.clone()));
    }
    drop(vals);
    // A stack's layers are written into the whole tensor.
    let mut wholes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (target, name, t) in new_values {
        let Some((s, l)) = g.stack_of(target) else {
            persistent.values.insert(name, t);
            continue;
        };
        let whole = match wholes.entry(s.name.clone()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(
                persistent
                    .values
                    .get(&s.name)
                    .ok_or_else(|| EagerError::MissingParam(s.name.clone()))?
                    .to_f64(),
            ),
        };
        let n = t.numel();
        whole
            .get_mut(l * n..(l + 1) * n)
            .ok_or_else(|| EagerError::Internal("stack layer out of range".into()))?
            .copy_from_slice(&t.to_f64());
    }
    for s in &g.stacks {
        if let Some(values) = wholes.remove(&s.name) {
            let t = Tensor::from_f64(s.ty.dtype, s.ty.shape.clone(), values);
            persistent.values.insert(s.name.clone(), t);
        }
    }
    Ok(outputs)
}

/// The exclusive upper bound of values an i32 input should take when fed random data:
/// the vocabulary of an `embedding` it indexes, or the class count of a comparison against
/// `arange(C)` (one-hot labels); `None` when nothing constrains it.
pub fn int_input_bound(g: &Graph, input: NodeId) -> Option<usize> {
    let mut stack = vec![input];
    let mut seen = std::collections::BTreeSet::new();
    let mut bound: Option<usize> = None;
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        for u in g.users(n) {
            let node = g.node(u);
            match &node.op {
                Op::Embedding if node.inputs.get(1) == Some(&n) => {
                    let v = g.ty(node.inputs[0]).dims()[0];
                    bound = Some(bound.map_or(v, |b| b.min(v)));
                }
                Op::Binary(crate::ir::BinaryOp::Eq) => {
                    for &other in &node.inputs {
                        if let Op::Arange { n: c } = g.node(other).op {
                            bound = Some(bound.map_or(c, |b| b.min(c)));
                        }
                    }
                }
                op if op.is_view_candidate() => stack.push(u),
                _ => {}
            }
        }
    }
    bound
}

/// Index inputs (labels, embedding ids: [`int_input_bound`]) hold values in `[0, bound)`,
/// as the runtime checks at `set_input`; the error is the runtime's, so every path says the
/// same.
pub fn check_index_inputs(
    g: &Graph,
    inputs: &BTreeMap<String, Tensor>,
) -> Result<(), tcc_runtime::Error> {
    for &id in &g.inputs {
        let Op::Input { name, .. } = &g.node(id).op else {
            continue;
        };
        let (
            Some(bound),
            Some(Tensor {
                data: Data::I(v), ..
            }),
        ) = (int_input_bound(g, id), inputs.get(name))
        else {
            continue;
        };
        if let Some((position, &value)) = v
            .iter()
            .enumerate()
            .find(|(_, &x)| x < 0 || x as usize >= bound)
        {
            return Err(tcc_runtime::Error::IndexOutOfRange {
                name: name.clone(),
                position,
                value: value as i64,
                bound: bound as u64,
            });
        }
    }
    Ok(())
}

/// Seeded random inputs: floats standard normal, i32 uniform below [`int_input_bound`]
/// (16 when unconstrained), bools fair coins.
pub fn random_inputs(g: &Graph, seed: u64) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for &id in &g.inputs {
        let Op::Input { name, ty } = &g.node(id).op else {
            continue;
        };
        let bound = int_input_bound(g, id);
        out.insert(name.clone(), random_input(name, ty, bound, seed));
    }
    out
}

/// Input `name`'s [`random_inputs`] value as bytes ([`random_input_bytes`]); `None` for a
/// name that is no input of `g`.
pub fn random_graph_input_bytes(g: &Graph, name: &str, seed: u64) -> Option<Vec<u8>> {
    g.inputs.iter().find_map(|&id| match &g.node(id).op {
        Op::Input { name: n, ty } if n == name => {
            Some(random_input_bytes(name, ty, int_input_bound(g, id), seed))
        }
        _ => None,
    })
}

/// One input of [`random_inputs`], from its name, type and index bound alone (what an
/// artifact's manifest records), so that `tcc run model.tcc` feeds what `tcc run
/// model.tdsl` does.
pub fn random_input(name: &str, ty: &TensorType, bound: Option<usize>, seed: u64) -> Tensor {
    let bytes = random_input_bytes(name, ty, bound, seed);
    Tensor::from_le_bytes(ty.clone(), &bytes).unwrap_or_else(|| Tensor::zeros(ty.clone()))
}

/// [`random_input`] as little-endian bytes of its dtype (the arena's layout), drawn
/// straight into them: what `tcc run` feeds a compiled program, with no f64 staging.
pub fn random_input_bytes(name: &str, ty: &TensorType, bound: Option<usize>, seed: u64) -> Vec<u8> {
    let key = seed.wrapping_add(0x5EED) ^ name_hash(name);
    let n = ty.shape.numel() as u64;
    match ty.dtype {
        DType::I32 => {
            let b = bound.unwrap_or(16) as f64;
            (0..n)
                .flat_map(|i| ((uniform(key, i) * b) as i32).to_le_bytes())
                .collect()
        }
        DType::Bool => (0..n).map(|i| u8::from(uniform(key, i) < 0.5)).collect(),
        d => {
            let recipe = tcc_runtime::init::Recipe {
                dist: tcc_runtime::init::Dist::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
                seed: key,
            };
            let mut out = vec![0u8; ty.size_bytes()];
            tcc_runtime::init::fill_le(
                name,
                recipe,
                crate::artifact::runtime_dtype(d),
                &mut out,
                1,
            );
            out
        }
    }
}
