//! The graph walk: ONNX nodes in file order → TDSL `let` lines.
//!
//! Every ONNX value is a [`Val`]: a runtime tensor bound to a TDSL name, or a host constant
//! (initializers, `Constant` nodes, and everything computed from constants and static shapes,
//! which is how the `Shape → Gather → Concat → Reshape` chains exporters emit fold away).
//! A constant that reaches a runtime op becomes a literal (one element), `full(...)` (all
//! elements equal) or a `param` whose value goes to the params file.

use super::proto::{data_type as dt, DimValue, ModelProto, NodeProto};
use super::tensor::{
    host_tensor, runtime_dtype, to_bytes_as, CData, FloatKind, Floats, HostTensor,
};
use super::ImportError;
use crate::eager::io::TensorBytes;
use crate::ir::DType;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;

/// Import options.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Sizes of named (dynamic) input dimensions: `--dim batch=8`.
    pub dims: Vec<(String, usize)>,
    /// The TDSL model's name (default: the graph's name, else `model`).
    pub name: Option<String>,
    /// Compute float64 tensors (inputs, initializers, casts) in f32, which tcc holds, as JAX
    /// does without x64; off, a float64 tensor is an error naming it.
    pub f64_as_f32: bool,
}

/// A graph input or output: its ONNX name, its TDSL name and type.
#[derive(Clone, Debug, PartialEq)]
pub struct IoValue {
    pub onnx: String,
    pub tdsl: String,
    pub dtype: DType,
    pub dims: Vec<usize>,
}

/// An imported model.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The TDSL program: one model, inference only.
    pub tdsl: String,
    /// The model's name in it.
    pub model: String,
    /// The `param`s' values, by TDSL name (sorted).
    pub params: Vec<(String, TensorBytes)>,
    /// ONNX names that are not legal (or free) TDSL names, with the name each got.
    pub renamed: Vec<(String, String)>,
    pub inputs: Vec<IoValue>,
    pub outputs: Vec<IoValue>,
    /// The default-domain opset.
    pub opset: i64,
    /// The float64 values computed in f32 ([`ImportOptions::f64_as_f32`]), by ONNX name.
    pub demoted: Vec<String>,
}

/// Words of TDSL a program may not bind besides its functions
/// ([`crate::front::predefined_functions`]): keywords, dtypes, kinds and optimizers.
const RESERVED_WORDS: &[&str] = &[
    "const",
    "fn",
    "model",
    "input",
    "param",
    "output",
    "train",
    "minimize",
    "let",
    "for",
    "in",
    "return",
    "checkpoint",
    "true",
    "false",
    "if",
    "else",
    "inf",
    "f32",
    "f16",
    "bf16",
    "i32",
    "bool",
    "int",
    "float",
    "sgd",
    "adam",
    "adamw",
];

/// Every name an imported program may not bind.
fn reserved() -> impl Iterator<Item = &'static str> {
    RESERVED_WORDS
        .iter()
        .copied()
        .chain(crate::front::predefined_functions())
}

/// A value of the ONNX graph.
#[derive(Clone, Debug)]
enum Val {
    /// A runtime tensor bound to a TDSL name.
    Rt {
        name: String,
        dtype: DType,
        dims: Vec<usize>,
    },
    /// A compile-time constant (shared: a weight's values are not copied when a node reads
    /// it).
    C(Rc<HostTensor>),
}

impl Val {
    /// A constant.
    fn c(h: HostTensor) -> Val {
        Val::C(Rc::new(h))
    }

    fn dims(&self) -> &[usize] {
        match self {
            Val::Rt { dims, .. } => dims,
            Val::C(h) => &h.dims,
        }
    }
}

/// A sanitized identifier: `[A-Za-z_][A-Za-z0-9_]*`, not reserved.
pub(super) fn sanitize(s: &str) -> String {
    let mut o: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if o.is_empty() || o == "_" || o.starts_with(|c: char| c.is_ascii_digit()) {
        o = format!("v{o}");
    }
    if reserved().any(|r| r == o) {
        o.push('_');
    }
    o
}

fn ty_str(dtype: DType, dims: &[usize]) -> String {
    let d: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("{dtype}[{}]", d.join(", "))
}

fn list(v: &[usize]) -> String {
    let d: Vec<String> = v.iter().map(|d| d.to_string()).collect();
    format!("[{}]", d.join(", "))
}

/// A TDSL literal of `v` for `dtype`; `None` for NaN (no literal spells it).
fn lit(v: f64, dtype: DType) -> Option<String> {
    let s = match dtype {
        DType::Bool => return Some(if v != 0.0 { "true" } else { "false" }.into()),
        DType::I32 => format!("{}", v as i64),
        DType::F32 => {
            if v.is_nan() {
                return None;
            }
            let f = v as f32;
            if f.is_infinite() {
                "inf".into()
            } else {
                format!("{:?}", f.abs())
            }
        }
        _ => {
            if v.is_nan() {
                return None;
            }
            if v.is_infinite() {
                "inf".into()
            } else {
                format!("{:?}", v.abs())
            }
        }
    };
    let s = s.trim_start_matches('-').to_string();
    Some(if v < 0.0 { format!("(-{s})") } else { s })
}

/// NumPy broadcasting of two shapes.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i < n - a.len() {
            1
        } else {
            a[i - (n - a.len())]
        };
        let y = if i < n - b.len() {
            1
        } else {
            b[i - (n - b.len())]
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// For each element of `out` (row-major), the flat index of the element of a tensor of
/// dims `src` that broadcasts to it.
fn bcast_index(out: &[usize], src: &[usize]) -> Vec<usize> {
    let n: usize = out.iter().product();
    let off = out.len() - src.len();
    let ss = strides(src);
    let os = strides(out);
    (0..n)
        .map(|flat| {
            let mut idx = 0;
            for (a, &d) in src.iter().enumerate() {
                let o = (flat / os[a + off]) % out[a + off];
                if d != 1 {
                    idx += o * ss[a];
                }
            }
            idx
        })
        .collect()
}

/// Flat indices of the elements of a `dims` tensor taken by per-axis `ranges`.
fn slice_index(dims: &[usize], ranges: &[(usize, usize)]) -> Vec<usize> {
    let out: Vec<usize> = ranges.iter().map(|(a, b)| b - a).collect();
    let n: usize = out.iter().product();
    let ss = strides(dims);
    let os = strides(&out);
    (0..n)
        .map(|flat| {
            (0..dims.len())
                .map(|a| ((flat / os[a]) % out[a] + ranges[a].0) * ss[a])
                .sum()
        })
        .collect()
}

/// Flat indices of a permutation of a `dims` tensor (`out[i] = in[perm[i]]` as axes).
fn permute_index(dims: &[usize], perm: &[usize]) -> Vec<usize> {
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let n: usize = out.iter().product();
    let ss = strides(dims);
    let os = strides(&out);
    (0..n)
        .map(|flat| {
            (0..perm.len())
                .map(|a| ((flat / os[a]) % out[a]) * ss[perm[a]])
                .sum()
        })
        .collect()
}

/// Normalizes a possibly negative axis for a rank.
fn norm_axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r).contains(&a).then_some(a as usize)
}

struct Importer {
    opset: i64,
    vals: HashMap<String, Val>,
    used: BTreeSet<String>,
    renamed: Vec<(String, String)>,
    decls: Vec<String>,
    body: Vec<String>,
    params: BTreeMap<String, TensorBytes>,
    /// ONNX constant name → the TDSL param holding it.
    param_of: HashMap<String, String>,
    op: String,
    node: String,
    /// The first error found where returning it at once was not convenient (a result's
    /// shape too large or empty).
    deferred: Option<ImportError>,
    /// Initializer names: these always become `param`s, so they stay trainable.
    initializers: BTreeSet<String>,
    /// Sequences (folded at import): their elements.
    seqs: HashMap<String, Vec<Val>>,
    /// [`ImportOptions::f64_as_f32`], and the float64 values it applied to.
    f64_as_f32: bool,
    demoted: BTreeSet<String>,
}

/// The most elements a tensor may have (past tcc's 1 TiB limit for every dtype).
const MAX_ELEMENTS: usize = 1 << 34;
/// The most elements a constant computed at import time may have.
const MAX_FOLD: usize = 1 << 24;
/// The largest kernel, stride, dilation, pad or repeat count accepted.
const MAX_ATTR: i64 = 1 << 20;

/// The element count of `dims`, if it does not pass [`MAX_ELEMENTS`].
fn checked_numel(dims: &[usize]) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
}

type R<T> = Result<T, ImportError>;

impl Importer {
    fn err(&self, msg: impl Into<String>) -> ImportError {
        ImportError::Node {
            op: self.op.clone(),
            node: self.node.clone(),
            msg: msg.into(),
        }
    }

    fn unsupported(&self, why: impl Into<String>) -> ImportError {
        let why: String = why.into();
        ImportError::Unsupported {
            op: self.op.clone(),
            node: self.node.clone(),
            opset: self.opset,
            why: if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            },
        }
    }

    /// A fresh TDSL identifier for `hint`, recorded in the rename list when it differs.
    fn fresh(&mut self, hint: &str, record: bool) -> String {
        let base = sanitize(hint);
        let mut name = base.clone();
        let mut k = 2;
        while self.used.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.used.insert(name.clone());
        if record && name != hint {
            self.renamed.push((hint.to_string(), name.clone()));
        }
        name
    }

    /// Binds `expr` to the ONNX value `out`.
    fn bind(&mut self, out: &str, expr: String, dtype: DType, dims: Vec<usize>) {
        if self.deferred.is_none() && checked_numel(&dims).is_none_or(|n| n == 0) {
            self.deferred = Some(self.err(format!(
                "its result {dims:?} is empty or larger than tcc's 2^34-element limit"
            )));
        }
        let name = self.fresh(out, true);
        self.body.push(format!("    let {name} = {expr}"));
        self.vals
            .insert(out.to_string(), Val::Rt { name, dtype, dims });
    }

    /// Binds `expr` to a temporary and returns its name.
    fn tmp(&mut self, hint: &str, expr: String) -> String {
        let name = self.fresh(hint, false);
        self.body.push(format!("    let {name} = {expr}"));
        name
    }

    fn set(&mut self, out: &str, v: Val) {
        match v {
            Val::Rt { dtype, dims, name } => {
                // An alias (Identity, a no-op reshape): bound again under the output's name.
                self.bind(out, name, dtype, dims)
            }
            c => {
                self.vals.insert(out.to_string(), c);
            }
        }
    }

    /// The tensor expression of a value: a runtime name, or a constant made a tensor.
    fn rt(&mut self, v: &Val, hint: &str) -> R<(String, DType, Vec<usize>)> {
        match v {
            Val::Rt { name, dtype, dims } => Ok((name.clone(), *dtype, dims.clone())),
            Val::C(h) => {
                let dtype = self.dtype_of(hint, h)?;
                let key = format!("{hint}{:?}", h.dims);
                if let Some(p) = self.param_of.get(&key) {
                    return Ok((p.clone(), dtype, h.dims.clone()));
                }
                if h.dims.contains(&0) {
                    return Err(self.unsupported(format!(
                        "`{hint}` is empty ({:?}); tcc tensors have no zero-size dimension",
                        h.dims
                    )));
                }
                let first = h.data.first_f64().unwrap_or(0.0);
                let uniform = !self.initializers.contains(hint)
                    && h.data
                        .iter_f64()
                        .all(|x| x == first || (x.is_nan() && first.is_nan()));
                if uniform && !h.dims.is_empty() {
                    if let Some(l) = lit(first, dtype) {
                        return Ok((
                            format!("full({}, {l}, {dtype})", list(&h.dims)),
                            dtype,
                            h.dims.clone(),
                        ));
                    }
                }
                if uniform && h.dims.is_empty() {
                    if let Some(l) = lit(first, dtype) {
                        return Ok((
                            format!("reshape(full([1], {l}, {dtype}), [])"),
                            dtype,
                            Vec::new(),
                        ));
                    }
                }
                let name = self.fresh(hint, true);
                self.decls
                    .push(format!("    param  {name}: {}", ty_str(dtype, &h.dims)));
                let t = to_bytes_as(hint, h, dtype)?;
                self.params.insert(name.clone(), t);
                self.param_of.insert(key, name.clone());
                Ok((name, dtype, h.dims.clone()))
            }
        }
    }

    /// Whether a view of the constant `name` (a transpose, a reshape) reads it as its param
    /// instead of folding a copy: a large initializer, so that a weight read both directly
    /// and through a view (tied embeddings) is stored once and stays one trainable param.
    fn keeps_param(&self, name: &str, h: &HostTensor) -> bool {
        self.initializers.contains(name) && h.numel() > 1 << 16
    }

    /// The runtime dtype of a constant: f32 for a float64 one under
    /// [`ImportOptions::f64_as_f32`], else [`runtime_dtype`]'s.
    fn dtype_of(&mut self, hint: &str, h: &HostTensor) -> R<DType> {
        if self.f64_as_f32 && matches!(h.data, CData::F(_, FloatKind::F64)) {
            self.demoted.insert(hint.to_string());
            return Ok(DType::F32);
        }
        runtime_dtype(hint, h).map_err(|e| self.at(e))
    }

    /// Adds the node to a dtype error.
    fn at(&self, e: ImportError) -> ImportError {
        match e {
            ImportError::DType { name, dtype, .. } => ImportError::DType {
                name,
                at: format!(" (node `{}`, {})", self.node, self.op),
                dtype,
            },
            other => other,
        }
    }

    /// An operand of a binary op: a literal when the constant has one element and does not
    /// raise the rank, else a tensor.
    fn operand(
        &mut self,
        v: &Val,
        hint: &str,
        other_rank: usize,
    ) -> R<(String, DType, Vec<usize>)> {
        if let Val::C(h) = v {
            if h.numel() == 1 && h.dims.len() <= other_rank {
                let dtype = self.dtype_of(hint, h)?;
                if let Some(l) = h.data.first_f64().and_then(|x| lit(x, dtype)) {
                    return Ok((l, dtype, h.dims.clone()));
                }
            }
        }
        self.rt(v, hint)
    }
}

/// Reads the integer list of a constant input (shapes, axes, pads).
fn const_ints(im: &Importer, v: Option<&Val>, what: &str) -> R<Option<Vec<i64>>> {
    match v {
        None => Ok(None),
        Some(Val::C(h)) => match &h.data {
            CData::I(v) => Ok(Some(v.clone())),
            CData::F(v, _) => Ok(Some(v.iter().map(|x| x as i64).collect())),
            CData::B(_) => Err(im.err(format!("{what} must be integers"))),
        },
        Some(Val::Rt { .. }) => Err(im.unsupported(format!(
            "its {what} is computed at run time; tcc needs it to be a constant (static shapes)"
        ))),
    }
}

struct Attrs<'a>(&'a NodeProto);

impl Attrs<'_> {
    fn get(&self, name: &str) -> Option<&super::proto::AttributeProto> {
        self.0.attribute.iter().find(|a| a.name == name)
    }
    fn i(&self, name: &str, default: i64) -> i64 {
        self.get(name).map_or(default, |a| a.i)
    }
    fn f(&self, name: &str, default: f32) -> f32 {
        self.get(name).map_or(default, |a| a.f)
    }
    fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|a| a.ints.clone())
    }
    fn s(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(|a| String::from_utf8_lossy(&a.s).into_owned())
    }
}

/// Imports a model from its protobuf bytes.
pub fn import(bytes: &[u8], opts: &ImportOptions) -> Result<Imported, ImportError> {
    import_owned(bytes.to_vec(), opts)
}

/// [`import`] from a buffer it takes: the initializers' raw data is read in place, not
/// copied out of it (the file's bytes, then the values as their dtype: about 8 bytes a
/// 4-byte weight while importing, besides the params handed back).
pub fn import_owned(bytes: Vec<u8>, opts: &ImportOptions) -> Result<Imported, ImportError> {
    let m = ModelProto::decode(bytes::Bytes::from(bytes))
        .map_err(|e| ImportError::Decode(e.to_string()))?;
    let graph = m.graph.as_ref().ok_or(ImportError::NoGraph)?;
    let opset = m
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map_or(1, |o| o.version);
    let mut im = Importer {
        opset,
        vals: HashMap::new(),
        used: reserved().map(str::to_string).collect(),
        renamed: Vec::new(),
        decls: Vec::new(),
        body: Vec::new(),
        params: BTreeMap::new(),
        param_of: HashMap::new(),
        op: String::new(),
        node: String::new(),
        deferred: None,
        initializers: graph.initializer.iter().map(|t| t.name.clone()).collect(),
        seqs: HashMap::new(),
        f64_as_f32: opts.f64_as_f32,
        demoted: BTreeSet::new(),
    };
    // Initializers: constants until a runtime op reads them.
    for t in &graph.initializer {
        let h = host_tensor(t)?;
        im.vals.insert(t.name.clone(), Val::c(h));
    }
    // Inputs (older exporters list the initializers among them: those stay constants).
    let dims_given: BTreeMap<&str, usize> =
        opts.dims.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    let mut dim_names = BTreeSet::new();
    let mut inputs = Vec::new();
    for vi in &graph.input {
        if im.vals.contains_key(&vi.name) {
            continue;
        }
        let tt = vi
            .r#type
            .as_ref()
            .and_then(|t| t.tensor_type.as_ref())
            .ok_or_else(|| ImportError::DType {
                name: vi.name.clone(),
                at: " (graph input)".into(),
                dtype: "non-tensor (sequence, map or optional)".into(),
            })?;
        let dtype = match tt.elem_type {
            dt::FLOAT => DType::F32,
            dt::FLOAT16 => DType::F16,
            dt::BFLOAT16 => DType::BF16,
            dt::INT32 | dt::INT64 => DType::I32,
            dt::BOOL => DType::Bool,
            dt::DOUBLE if im.f64_as_f32 => {
                im.demoted.insert(vi.name.clone());
                DType::F32
            }
            other => {
                return Err(ImportError::DType {
                    name: vi.name.clone(),
                    at: " (graph input)".into(),
                    dtype: dt::name(other),
                })
            }
        };
        let mut dims = Vec::new();
        for (axis, d) in tt.shape.iter().flat_map(|s| &s.dim).enumerate() {
            let n = match &d.value {
                Some(DimValue::DimValue(v)) if *v > 0 => *v as usize,
                Some(DimValue::DimParam(p)) if !p.is_empty() => {
                    dim_names.insert(p.clone());
                    match dims_given.get(p.as_str()) {
                        Some(&v) if v > 0 => v,
                        _ => {
                            return Err(ImportError::DynamicDim {
                                input: vi.name.clone(),
                                axis,
                                dim: p.clone(),
                            })
                        }
                    }
                }
                _ => {
                    return Err(ImportError::UnknownDim {
                        input: vi.name.clone(),
                        axis,
                    })
                }
            };
            dims.push(n);
        }
        if checked_numel(&dims).is_none() {
            return Err(ImportError::Other(format!(
                "input `{}`: shape {dims:?} holds more than 2^34 elements",
                vi.name
            )));
        }
        let name = im.fresh(&vi.name, true);
        im.decls
            .push(format!("    input  {name}: {}", ty_str(dtype, &dims)));
        im.vals.insert(
            vi.name.clone(),
            Val::Rt {
                name: name.clone(),
                dtype,
                dims: dims.clone(),
            },
        );
        inputs.push(IoValue {
            onnx: vi.name.clone(),
            tdsl: name,
            dtype,
            dims,
        });
    }
    for (n, _) in &opts.dims {
        if !dim_names.contains(n) {
            let known: Vec<String> = dim_names.iter().cloned().collect();
            return Err(ImportError::UnusedDim(
                n.clone(),
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                },
            ));
        }
    }
    for (i, node) in graph.node.iter().enumerate() {
        im.op = node.op_type.clone();
        im.node = if node.name.is_empty() {
            format!("#{i}")
        } else {
            node.name.clone()
        };
        if node.domain == "ai.onnx.preview.training" && node.op_type == "Gradient" {
            gradient(&mut im, node)?;
            if let Some(e) = im.deferred.take() {
                return Err(e);
            }
            continue;
        }
        if !(node.domain.is_empty() || node.domain == "ai.onnx") {
            return Err(ImportError::Unsupported {
                op: format!("{}.{}", node.domain, node.op_type),
                node: im.node.clone(),
                opset,
                why: ": only the default ONNX domain is supported".into(),
            });
        }
        if SEQUENCE_OPS.contains(&node.op_type.as_str()) {
            sequence_op(&mut im, node)?;
            if let Some(e) = im.deferred.take() {
                return Err(e);
            }
            continue;
        }
        let mut ins = Vec::with_capacity(node.input.len());
        for name in &node.input {
            if name.is_empty() {
                ins.push(None);
                continue;
            }
            match im.vals.get(name) {
                Some(v) => ins.push(Some(v.clone())),
                None if im.seqs.contains_key(name) => {
                    return Err(im.unsupported(format!(
                        "its input `{name}` is a sequence (tcc reads sequences in the Sequence* ops, ConcatFromSequence and SplitToSequence)"
                    )))
                }
                None => {
                    return Err(ImportError::Missing {
                        op: node.op_type.clone(),
                        node: im.node.clone(),
                        value: name.clone(),
                    })
                }
            }
        }
        convert(&mut im, node, &ins)?;
        if let Some(e) = im.deferred.take() {
            return Err(e);
        }
    }
    // Outputs.
    let mut outputs = Vec::new();
    let mut out_names = Vec::new();
    for vi in &graph.output {
        if im.seqs.contains_key(&vi.name) {
            return Err(ImportError::Other(format!(
                "graph output `{}` is a sequence; tcc outputs tensors",
                vi.name
            )));
        }
        let v = im.vals.get(&vi.name).cloned().ok_or_else(|| {
            ImportError::Other(format!(
                "graph output `{}` is not computed by any node",
                vi.name
            ))
        })?;
        im.op = "output".into();
        im.node = vi.name.clone();
        let (name, dtype, dims) = match &v {
            Val::C(_) => {
                let (e, d, dims) = im.rt(&v, &vi.name)?;
                let n = im.fresh(&vi.name, true);
                im.body.push(format!("    let {n} = {e}"));
                (n, d, dims)
            }
            Val::Rt { name, dtype, dims } => (name.clone(), *dtype, dims.clone()),
        };
        if out_names.contains(&name) {
            let n = im.tmp(&vi.name, name.clone());
            out_names.push(n.clone());
            outputs.push(IoValue {
                onnx: vi.name.clone(),
                tdsl: n,
                dtype,
                dims,
            });
            continue;
        }
        out_names.push(name.clone());
        outputs.push(IoValue {
            onnx: vi.name.clone(),
            tdsl: name,
            dtype,
            dims,
        });
    }
    let model = opts.name.clone().unwrap_or_else(|| {
        sanitize(if graph.name.is_empty() {
            "model"
        } else {
            &graph.name
        })
    });
    let mut text = String::new();
    text.push_str(&format!(
        "// Imported from ONNX ({}opset {opset}) by `tcc import`: inference only.\n",
        if m.producer_name.is_empty() {
            String::new()
        } else {
            format!("{} {}, ", m.producer_name, m.producer_version)
        },
    ));
    text.push_str(
        "// Params have no initialiser: their values come with the model (safetensors, by name).\n",
    );
    if inputs.iter().any(|i| i.dtype == DType::I32) {
        text.push_str("// int64 inputs are read as i32.\n");
    }
    text.push_str(&format!("model {model} {{\n"));
    for d in &im.decls {
        text.push_str(d);
        text.push('\n');
    }
    text.push('\n');
    for b in &im.body {
        text.push_str(b);
        text.push('\n');
    }
    text.push_str(&format!("\n    output {}\n}}\n", out_names.join(", ")));
    Ok(Imported {
        tdsl: text,
        model,
        params: im.params.into_iter().collect(),
        renamed: im.renamed,
        inputs,
        outputs,
        opset,
        demoted: im.demoted.into_iter().collect(),
    })
}

/// The float value of a host tensor element for folding.
fn fold_unary(op: &str, h: &HostTensor) -> Option<HostTensor> {
    let f = |g: fn(f64) -> f64| -> Option<HostTensor> {
        match &h.data {
            CData::F(v, k) => Some(HostTensor {
                dims: h.dims.clone(),
                data: CData::F(Floats::of(*k, v.iter().map(g)), *k),
                onnx_type: h.onnx_type,
            }),
            CData::I(v) if op == "Neg" || op == "Abs" || op == "Relu" => Some(HostTensor {
                dims: h.dims.clone(),
                data: CData::I(
                    v.iter()
                        .map(|&x| match op {
                            "Neg" => x.wrapping_neg(),
                            "Abs" => x.wrapping_abs(),
                            _ => x.max(0),
                        })
                        .collect(),
                ),
                onnx_type: h.onnx_type,
            }),
            _ => None,
        }
    };
    match op {
        "Neg" => f(|x| -x),
        "Abs" => f(f64::abs),
        "Relu" => f(|x| x.max(0.0)),
        "Sqrt" => f(f64::sqrt),
        "Exp" => f(f64::exp),
        "Log" => f(f64::ln),
        "Reciprocal" => f(|x| 1.0 / x),
        "Floor" => f(f64::floor),
        "Ceil" => f(f64::ceil),
        "Not" => match &h.data {
            CData::B(v) => Some(HostTensor {
                dims: h.dims.clone(),
                data: CData::B(v.iter().map(|b| !b).collect()),
                onnx_type: h.onnx_type,
            }),
            _ => None,
        },
        _ => None,
    }
}

fn fold_binary(op: &str, a: &HostTensor, b: &HostTensor) -> Option<HostTensor> {
    let out = broadcast(&a.dims, &b.dims)?;
    checked_numel(&out).filter(|&n| n <= MAX_FOLD)?;
    let ia = bcast_index(&out, &a.dims);
    let ib = bcast_index(&out, &b.dims);
    let cmp = matches!(
        op,
        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual"
    );
    let data = match (&a.data, &b.data) {
        (CData::I(x), CData::I(y)) => {
            let pairs = ia.iter().zip(&ib).map(|(&i, &j)| (x[i], y[j]));
            if cmp {
                CData::B(
                    pairs
                        .map(|(p, q)| match op {
                            "Equal" => p == q,
                            "Less" => p < q,
                            "Greater" => p > q,
                            "LessOrEqual" => p <= q,
                            _ => p >= q,
                        })
                        .collect(),
                )
            } else {
                let mut v = Vec::with_capacity(out.iter().product());
                for (p, q) in pairs {
                    v.push(match op {
                        "Add" => p.checked_add(q)?,
                        "Sub" => p.checked_sub(q)?,
                        "Mul" => p.checked_mul(q)?,
                        "Div" => p.checked_div(q)?,
                        "Mod" => p.checked_rem_euclid(q)?,
                        "Max" => p.max(q),
                        "Min" => p.min(q),
                        _ => return None,
                    });
                }
                CData::I(v)
            }
        }
        (CData::F(x, k), CData::F(y, _)) => {
            let pairs = ia.iter().zip(&ib).map(|(&i, &j)| (x.get(i), y.get(j)));
            if cmp {
                CData::B(
                    pairs
                        .map(|(p, q)| match op {
                            "Equal" => p == q,
                            "Less" => p < q,
                            "Greater" => p > q,
                            "LessOrEqual" => p <= q,
                            _ => p >= q,
                        })
                        .collect(),
                )
            } else {
                let g: fn(f64, f64) -> f64 = match op {
                    "Add" => |p, q| p + q,
                    "Sub" => |p, q| p - q,
                    "Mul" => |p, q| p * q,
                    "Div" => |p, q| p / q,
                    "Pow" => f64::powf,
                    "Max" => f64::max,
                    "Min" => f64::min,
                    _ => return None,
                };
                CData::F(Floats::of(*k, pairs.map(|(p, q)| g(p, q))), *k)
            }
        }
        (CData::B(x), CData::B(y)) => {
            let pairs = ia.iter().zip(&ib).map(|(&i, &j)| (x[i], y[j]));
            CData::B(match op {
                "And" => pairs.map(|(p, q)| p && q).collect(),
                "Or" => pairs.map(|(p, q)| p || q).collect(),
                "Xor" => pairs.map(|(p, q)| p != q).collect(),
                "Equal" => pairs.map(|(p, q)| p == q).collect(),
                _ => return None,
            })
        }
        _ => return None,
    };
    Some(HostTensor {
        dims: out,
        data,
        onnx_type: if cmp { dt::BOOL } else { a.onnx_type },
    })
}

/// The TDSL dtype and ONNX type an ONNX `to` type converts to.
fn cast_target(to: i64) -> Option<(DType, i32)> {
    Some(match to as i32 {
        dt::FLOAT => (DType::F32, dt::FLOAT),
        dt::FLOAT16 => (DType::F16, dt::FLOAT16),
        dt::BFLOAT16 => (DType::BF16, dt::BFLOAT16),
        dt::INT32 => (DType::I32, dt::INT32),
        dt::INT64 => (DType::I32, dt::INT64),
        dt::BOOL => (DType::Bool, dt::BOOL),
        _ => return None,
    })
}

fn fold_cast(h: &HostTensor, to: i32) -> HostTensor {
    let float = |k| CData::F(Floats::of(k, h.data.iter_f64()), k);
    let data = match to {
        dt::FLOAT => float(FloatKind::F32),
        dt::FLOAT16 => float(FloatKind::F16),
        dt::BFLOAT16 => float(FloatKind::BF16),
        dt::DOUBLE => float(FloatKind::F64),
        dt::BOOL => CData::B(h.data.iter_f64().map(|x| x != 0.0).collect()),
        _ => CData::I(h.data.iter_f64().map(|x| x as i64).collect()),
    };
    HostTensor {
        dims: h.dims.clone(),
        data,
        onnx_type: to,
    }
}

fn ints_tensor(v: Vec<i64>) -> HostTensor {
    HostTensor {
        dims: vec![v.len()],
        data: CData::I(v),
        onnx_type: dt::INT64,
    }
}

/// Slice expression `x[:, a:b, :]` over `dims` with `ranges`.
fn slice_expr(x: &str, dims: &[usize], ranges: &[(usize, usize)]) -> String {
    let parts: Vec<String> = ranges
        .iter()
        .zip(dims)
        .map(|(&(a, b), &d)| {
            if a == 0 && b == d {
                ":".to_string()
            } else {
                format!("{a}:{b}")
            }
        })
        .collect();
    format!("{x}[{}]", parts.join(", "))
}

const UNARY: &[(&str, &str)] = &[
    ("Sqrt", "sqrt"),
    ("Exp", "exp"),
    ("Log", "log"),
    ("Neg", "neg"),
    ("Abs", "abs"),
    ("Relu", "relu"),
    ("Sigmoid", "sigmoid"),
    ("Tanh", "tanh"),
    ("Erf", "erf"),
    ("Reciprocal", "recip"),
    ("Sin", "sin"),
    ("Cos", "cos"),
    ("Softplus", "softplus"),
];

const BINARY: &[(&str, &str)] = &[
    ("Add", "+"),
    ("Sub", "-"),
    ("Mul", "*"),
    ("Div", "/"),
    ("Equal", "=="),
    ("Less", "<"),
    ("Greater", ">"),
    ("LessOrEqual", "<="),
    ("GreaterOrEqual", ">="),
    ("And", "&&"),
    ("Or", "||"),
];

fn convert(im: &mut Importer, node: &NodeProto, ins: &[Option<Val>]) -> R<()> {
    let op = node.op_type.as_str();
    let at = Attrs(node);
    let missing = im.err("");
    let input = |i: usize| -> R<Val> {
        ins.get(i).cloned().flatten().ok_or_else(|| match &missing {
            ImportError::Node { op, node, .. } => ImportError::Node {
                op: op.clone(),
                node: node.clone(),
                msg: format!("input {i} is missing"),
            },
            other => other.clone(),
        })
    };
    let out0 = node
        .output
        .first()
        .cloned()
        .ok_or_else(|| im.err("the node has no output"))?;
    // Folding of elementwise ops on constants.
    if ins.iter().all(|v| matches!(v, Some(Val::C(_)) | None)) && !ins.is_empty() {
        let cs: Vec<&HostTensor> = ins
            .iter()
            .filter_map(|v| match v {
                Some(Val::C(h)) => Some(&**h),
                _ => None,
            })
            .collect();
        let folded = match (op, cs.as_slice()) {
            (_, [a]) if fold_unary(op, a).is_some() => fold_unary(op, a),
            (_, [a, b]) => fold_binary(op, a, b),
            ("Cast", [a]) => {
                let to = at.i("to", 0) as i32;
                Some(fold_cast(a, to))
            }
            _ => None,
        };
        if let Some(h) = folded {
            im.vals.insert(out0, Val::c(h));
            return Ok(());
        }
    }
    if let Some((_, f)) = UNARY.iter().find(|(o, _)| *o == op) {
        let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
        if !d.is_float() {
            return Err(im.unsupported(format!("on {d} tensors")));
        }
        im.bind(&out0, format!("{f}({x})"), d, dims);
        return Ok(());
    }
    if let Some((_, sym)) = BINARY.iter().find(|(o, _)| *o == op) {
        let (a, b) = (input(0)?, input(1)?);
        let (ea, da, dima) = im.operand(&a, &node.input[0], b.dims().len())?;
        let (eb, _, dimb) = im.operand(&b, &node.input[1], a.dims().len())?;
        let dims = broadcast(&dima, &dimb)
            .ok_or_else(|| im.err(format!("shapes {dima:?} and {dimb:?} do not broadcast")))?;
        let cmp = matches!(
            op,
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual"
        );
        let dtype = if cmp { DType::Bool } else { da };
        im.bind(&out0, format!("{ea} {sym} {eb}"), dtype, dims);
        return Ok(());
    }
    match op {
        "IsNaN" | "IsInf" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            if !d.is_float() {
                return Err(im.unsupported(format!("on {d} tensors")));
            }
            let e = if op == "IsNaN" {
                format!("{x} != {x}")
            } else {
                match (
                    at.i("detect_positive", 1) != 0,
                    at.i("detect_negative", 1) != 0,
                ) {
                    (true, true) => format!("abs({x}) == inf"),
                    (true, false) => format!("{x} == inf"),
                    (false, true) => format!("{x} == (-inf)"),
                    (false, false) => format!("{x} != {x} && {x} == {x}"),
                }
            };
            im.bind(&out0, e, DType::Bool, dims);
        }
        "Identity" | "Dropout" => {
            if op == "Dropout" && node.output.len() > 1 && !node.output[1].is_empty() {
                // The mask: all true in inference.
                let dims = input(0)?.dims().to_vec();
                let n = dims.iter().product();
                im.vals.insert(
                    node.output[1].clone(),
                    Val::c(HostTensor {
                        dims,
                        data: CData::B(vec![true; n]),
                        onnx_type: dt::BOOL,
                    }),
                );
            }
            let v = input(0)?;
            im.set(&out0, v);
        }
        "Constant" => {
            let a = node
                .attribute
                .first()
                .ok_or_else(|| im.err("no value attribute"))?;
            let h = match (a.name.as_str(), a.r#type) {
                ("value", _) => host_tensor(
                    a.t.as_ref()
                        .ok_or_else(|| im.err("`value` holds no tensor"))?,
                )?,
                ("value_float", _) => HostTensor {
                    dims: vec![],
                    data: CData::F(Floats::F32(vec![a.f]), FloatKind::F32),
                    onnx_type: dt::FLOAT,
                },
                ("value_floats", _) => HostTensor {
                    dims: vec![a.floats.len()],
                    data: CData::F(Floats::F32(a.floats.clone()), FloatKind::F32),
                    onnx_type: dt::FLOAT,
                },
                ("value_int", _) => HostTensor {
                    dims: vec![],
                    data: CData::I(vec![a.i]),
                    onnx_type: dt::INT64,
                },
                ("value_ints", _) => ints_tensor(a.ints.clone()),
                (other, _) => return Err(im.unsupported(format!("a `{other}` attribute"))),
            };
            im.vals.insert(out0, Val::c(h));
        }
        "Shape" => {
            let v = input(0)?;
            let r = v.dims().len() as i64;
            let clamp = |a: i64| (if a < 0 { a + r } else { a }).clamp(0, r) as usize;
            let s = clamp(at.i("start", 0));
            let e = clamp(at.i("end", r));
            let dims: Vec<i64> = v.dims()[s..e.max(s)].iter().map(|&d| d as i64).collect();
            im.vals.insert(out0, Val::c(ints_tensor(dims)));
        }
        "Size" => {
            let n: usize = input(0)?.dims().iter().product();
            im.vals.insert(
                out0,
                Val::c(HostTensor {
                    dims: vec![],
                    data: CData::I(vec![n as i64]),
                    onnx_type: dt::INT64,
                }),
            );
        }
        "ConstantOfShape" => {
            let dims = const_ints(im, Some(&input(0)?), "shape")?.unwrap_or_default();
            let dims: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
            let n = checked_numel(&dims)
                .ok_or_else(|| im.err(format!("shape {dims:?} is too large")))?;
            let value = match at.get("value").and_then(|a| a.t.as_ref()) {
                Some(t) => host_tensor(t)?,
                None => HostTensor {
                    dims: vec![1],
                    data: CData::F(Floats::F32(vec![0.0]), FloatKind::F32),
                    onnx_type: dt::FLOAT,
                },
            };
            if value.data.is_empty() {
                return Err(im.err("`value` is empty"));
            }
            if n > MAX_FOLD {
                // Too large to hold at import: filled at run time.
                let dtype = im.dtype_of(&out0, &value)?;
                let v = value.data.first_f64().unwrap_or(0.0);
                let l = lit(v, dtype).ok_or_else(|| im.unsupported("a NaN fill value"))?;
                im.bind(
                    &out0,
                    format!("full({}, {l}, {dtype})", list(&dims)),
                    dtype,
                    dims,
                );
                return Ok(());
            }
            let data = value.data.pick(&vec![0; n]);
            im.vals.insert(
                out0,
                Val::c(HostTensor {
                    dims,
                    data,
                    onnx_type: value.onnx_type,
                }),
            );
        }
        "Range" => {
            let get = |i: usize| -> R<f64> {
                match input(i)? {
                    Val::C(h) => h.data.first_f64().ok_or_else(|| im.err("empty operand")),
                    _ => Err(im.unsupported("operands computed at run time")),
                }
            };
            let (s, l, d) = (get(0)?, get(1)?, get(2)?);
            if d == 0.0 {
                return Err(im.err("delta is 0"));
            }
            let n = ((l - s) / d).ceil().max(0.0);
            if n.is_nan() || n > MAX_FOLD as f64 {
                return Err(im.unsupported("a range too long to fold"));
            }
            let n = n as usize;
            let v: Vec<f64> = (0..n).map(|i| s + d * i as f64).collect();
            // A float range keeps its start's float type; any other is int64.
            let float = match input(0)? {
                Val::C(h) => match h.data {
                    CData::F(_, k) => Some((k, h.onnx_type)),
                    _ => None,
                },
                Val::Rt { .. } => None,
            };
            let h = match float {
                Some((k, onnx_type)) => HostTensor {
                    dims: vec![n],
                    data: CData::F(Floats::of(k, v.into_iter()), k),
                    onnx_type,
                },
                None => ints_tensor(v.iter().map(|&x| x as i64).collect()),
            };
            im.vals.insert(out0, Val::c(h));
        }
        "Cast" => {
            let to = at.i("to", 0);
            let target = if im.f64_as_f32 && to as i32 == dt::DOUBLE {
                im.demoted.insert(out0.clone());
                cast_target(dt::FLOAT as i64)
            } else {
                cast_target(to)
            };
            let (dtype, _) = target.ok_or_else(|| ImportError::DType {
                name: out0.clone(),
                at: format!(" (node `{}`, Cast)", im.node),
                dtype: dt::name(to as i32),
            })?;
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            if d == dtype {
                im.bind(&out0, x, d, dims);
            } else {
                im.bind(&out0, format!("cast({x}, {dtype})"), dtype, dims);
            }
        }
        "Pow" => {
            let (a, b) = (input(0)?, input(1)?);
            let (ea, da, dima) = im.rt(&a, &node.input[0])?;
            let (eb, _, dimb) = im.operand(&b, &node.input[1], dima.len())?;
            let dims = broadcast(&dima, &dimb)
                .ok_or_else(|| im.err(format!("shapes {dima:?} and {dimb:?} do not broadcast")))?;
            let expr = if eb == "2.0" {
                format!("{ea} * {ea}")
            } else {
                format!("pow({ea}, {eb})")
            };
            im.bind(&out0, expr, da, dims);
        }
        "Max" | "Min" | "Sum" | "Mean" => {
            let f = match op {
                "Max" => "maximum",
                "Min" => "minimum",
                _ => "",
            };
            let mut acc: Option<(String, DType, Vec<usize>)> = None;
            for (i, v) in ins.iter().enumerate() {
                let Some(v) = v else { continue };
                let (e, d, dims) = im.rt(v, &node.input[i])?;
                acc = Some(match acc {
                    None => (e, d, dims),
                    Some((ae, ad, adims)) => {
                        let nd = broadcast(&adims, &dims).ok_or_else(|| {
                            im.err(format!("shapes {adims:?} and {dims:?} do not broadcast"))
                        })?;
                        let expr = if f.is_empty() {
                            format!("{ae} + {e}")
                        } else {
                            format!("{f}({ae}, {e})")
                        };
                        (format!("({expr})"), ad, nd)
                    }
                });
            }
            let (mut e, d, dims) = acc.ok_or_else(|| im.err("no inputs"))?;
            if op == "Mean" {
                let n = ins.iter().flatten().count();
                e = format!("{e} / {}", lit(n as f64, d).unwrap_or_default());
            }
            im.bind(&out0, e, d, dims);
        }
        "Where" => {
            let (c, a, b) = (input(0)?, input(1)?, input(2)?);
            let (ec, _, dc) = im.rt(&c, &node.input[0])?;
            let (ea, da, dima) = im.rt(&a, &node.input[1])?;
            let (eb, _, dimb) = im.rt(&b, &node.input[2])?;
            let dims = broadcast(&dc, &dima)
                .and_then(|d| broadcast(&d, &dimb))
                .ok_or_else(|| im.err("shapes do not broadcast"))?;
            im.bind(&out0, format!("where({ec}, {ea}, {eb})"), da, dims);
        }
        "Not" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            im.bind(&out0, format!("!{x}"), d, dims);
        }
        "Sign" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let zero = lit(0.0, d).unwrap_or_default();
            im.bind(
                &out0,
                format!("cast({x} > {zero}, {d}) - cast({x} < {zero}, {d})"),
                d,
                dims,
            );
        }
        "LeakyRelu" | "Elu" | "Selu" | "Celu" | "ThresholdedRelu" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let f = |v: f64| lit(v, d).unwrap_or_default();
            let expr = match op {
                "LeakyRelu" => {
                    let a = at.f("alpha", 0.01) as f64;
                    format!("where({x} >= 0.0, {x}, {x} * {})", f(a))
                }
                "Elu" => {
                    let a = at.f("alpha", 1.0) as f64;
                    format!("where({x} > 0.0, {x}, (exp({x}) - 1.0) * {})", f(a))
                }
                "Celu" => {
                    let a = at.f("alpha", 1.0) as f64;
                    format!(
                        "relu({x}) + minimum(0.0, (exp({x} / {a}) - 1.0) * {a})",
                        a = f(a)
                    )
                }
                "ThresholdedRelu" => {
                    let a = at.f("alpha", 1.0) as f64;
                    format!("where({x} > {}, {x}, 0.0)", f(a))
                }
                _ => {
                    let a = at.f("alpha", 1.673_263_2) as f64;
                    let g = at.f("gamma", 1.050_701) as f64;
                    format!(
                        "where({x} > 0.0, {x} * {}, (exp({x}) - 1.0) * {})",
                        f(g),
                        f((a as f32 * g as f32) as f64)
                    )
                }
            };
            im.bind(&out0, expr, d, dims);
        }
        "PRelu" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let mut s = input(1)?;
            // Before opset 7 a slope of C values is per channel (axis 1): [C, 1, …].
            if let (Val::C(h), Some(&c)) = (&mut s, dims.get(1)) {
                if im.opset < 7 && h.dims == [c] && dims.len() > 2 {
                    Rc::make_mut(h)
                        .dims
                        .extend(std::iter::repeat_n(1, dims.len() - 2));
                }
            }
            let sdims = s.dims().to_vec();
            // Exporters give per-channel slopes as [C]: ONNX broadcasts them NumPy-style,
            // so [C] against [N, C, L] only works when C is the last axis; PyTorch's slope
            // is per channel (axis 1), which exporters reshape to [C, 1, …].
            let (es, _, _) = im.operand(&s, &node.input[1], dims.len())?;
            if broadcast(&dims, &sdims).as_deref() != Some(&dims[..]) {
                return Err(im.err(format!("slope {sdims:?} does not broadcast to {dims:?}")));
            }
            im.bind(
                &out0,
                format!("where({x} >= 0.0, {x}, {x} * {es})"),
                d,
                dims,
            );
        }
        "HardSigmoid" | "HardSwish" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let (a, b) = if op == "HardSwish" {
                (1.0 / 6.0, 0.5)
            } else {
                (at.f("alpha", 0.2) as f64, at.f("beta", 0.5) as f64)
            };
            let hs = format!(
                "maximum(minimum({x} * {} + {}, 1.0), 0.0)",
                lit(a, d).unwrap_or_default(),
                lit(b, d).unwrap_or_default()
            );
            let e = if op == "HardSwish" {
                format!("{x} * {hs}")
            } else {
                hs
            };
            im.bind(&out0, e, d, dims);
        }
        "Softsign" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            im.bind(&out0, format!("{x} / (1.0 + abs({x}))"), d, dims);
        }
        "Gelu" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let e = if at.s("approximate").as_deref() == Some("tanh") {
                format!("gelu({x})")
            } else {
                format!("{x} * 0.5 * (1.0 + erf({x} * 0.70710677))")
            };
            im.bind(&out0, e, d, dims);
        }
        "Clip" => {
            let x = input(0)?;
            let (ex, d, dims) = im.rt(&x, &node.input[0])?;
            let (lo, hi) = if im.opset < 11 {
                (
                    at.get("min").map(|a| a.f as f64),
                    at.get("max").map(|a| a.f as f64),
                )
            } else {
                let get = |i: usize| -> R<Option<f64>> {
                    match ins.get(i).cloned().flatten() {
                        None => Ok(None),
                        Some(Val::C(h)) => Ok(h.data.first_f64()),
                        Some(Val::Rt { .. }) => Err(im.unsupported("bounds computed at run time")),
                    }
                };
                (get(1)?, get(2)?)
            };
            let mut e = ex;
            if let Some(l) = lo.and_then(|v| lit(v, d)) {
                e = format!("maximum({e}, {l})");
            }
            if let Some(h) = hi.and_then(|v| lit(v, d)) {
                e = format!("minimum({e}, {h})");
            }
            im.bind(&out0, e, d, dims);
        }
        "Shrink" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let l = lit(at.f("lambd", 0.5) as f64, d).unwrap_or_default();
            let b = lit(at.f("bias", 0.0) as f64, d).unwrap_or_default();
            im.bind(
                &out0,
                format!("where({x} < -{l}, {x} + {b}, 0.0) + where({x} > {l}, {x} - {b}, 0.0)"),
                d,
                dims,
            );
        }
        "MatMul" => {
            let (a, b) = (input(0)?, input(1)?);
            let (mut ea, da, mut dima) = im.rt(&a, &node.input[0])?;
            let (mut eb, _, mut dimb) = im.rt(&b, &node.input[1])?;
            if dima.is_empty() || dimb.is_empty() {
                return Err(im.err("MatMul of a scalar"));
            }
            let (va, vb) = (dima.len() == 1, dimb.len() == 1);
            if va {
                ea = format!("unsqueeze({ea}, axis: 0)");
                dima.insert(0, 1);
            }
            if vb {
                eb = format!("unsqueeze({eb}, axis: 1)");
                dimb.push(1);
            }
            let (m, k) = (dima[dima.len() - 2], dima[dima.len() - 1]);
            let (k2, n) = (dimb[dimb.len() - 2], dimb[dimb.len() - 1]);
            if k != k2 {
                return Err(im.err(format!("inner dimensions differ: {dima:?} @ {dimb:?}")));
            }
            let mut dims = broadcast(&dima[..dima.len() - 2], &dimb[..dimb.len() - 2])
                .ok_or_else(|| im.err("batch dimensions do not broadcast"))?;
            dims.push(m);
            dims.push(n);
            let mut e = format!("{ea} @ {eb}");
            if vb {
                dims.pop();
                e = format!("squeeze({e}, axis: -1)");
            }
            if va {
                let r = dims.len();
                dims.remove(r - if vb { 1 } else { 2 });
                e = format!("squeeze({e}, axis: {})", if vb { -1 } else { -2 });
            }
            im.bind(&out0, e, da, dims);
        }
        "Gemm" => {
            let (a, b) = (input(0)?, input(1)?);
            let (ea, da, dima) = im.rt(&a, &node.input[0])?;
            let (eb, _, dimb) = im.rt(&b, &node.input[1])?;
            if dima.len() != 2 || dimb.len() != 2 {
                return Err(im.err("Gemm operands must be 2-D"));
            }
            let (ta, tb) = (at.i("transA", 0) != 0, at.i("transB", 0) != 0);
            let alpha = at.f("alpha", 1.0) as f64;
            let beta = at.f("beta", 1.0) as f64;
            let (m, k) = if ta {
                (dima[1], dima[0])
            } else {
                (dima[0], dima[1])
            };
            let (k2, n) = if tb {
                (dimb[1], dimb[0])
            } else {
                (dimb[0], dimb[1])
            };
            if k != k2 {
                return Err(im.err(format!("inner dimensions differ: {dima:?}, {dimb:?}")));
            }
            let fa = if ta { format!("transpose({ea})") } else { ea };
            let fb = if tb { format!("transpose({eb})") } else { eb };
            let mut e = format!("{fa} @ {fb}");
            if alpha != 1.0 {
                e = format!("({e}) * {}", lit(alpha, da).unwrap_or_default());
            }
            if let Some(Some(c)) = ins.get(2) {
                let (ec, _, dimc) = im.operand(c, &node.input[2], 2)?;
                if broadcast(&[m, n], &dimc).as_deref() != Some(&[m, n][..]) {
                    return Err(im.err(format!("C {dimc:?} does not broadcast to [{m}, {n}]")));
                }
                if beta == 1.0 {
                    e = format!("{e} + {ec}");
                } else if beta != 0.0 {
                    e = format!("{e} + {ec} * {}", lit(beta, da).unwrap_or_default());
                }
            }
            im.bind(&out0, e, da, vec![m, n]);
        }
        "Softmax" | "LogSoftmax" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let r = dims.len();
            let f = if op == "Softmax" {
                "softmax"
            } else {
                "log_softmax"
            };
            let default = if im.opset >= 13 { -1 } else { 1 };
            let axis =
                norm_axis(at.i("axis", default), r).ok_or_else(|| im.err("axis out of range"))?;
            let e = if im.opset >= 13 || axis == r - 1 {
                format!("{f}({x}, axis: {axis})")
            } else {
                // Before opset 13: over the input flattened to 2-D at `axis`.
                let (p, q): (usize, usize) =
                    (dims[..axis].iter().product(), dims[axis..].iter().product());
                format!(
                    "reshape({f}(reshape({x}, [{p}, {q}]), axis: 1), {})",
                    list(&dims)
                )
            };
            im.bind(&out0, e, d, dims);
        }
        "Flatten" => {
            let v = input(0)?;
            let dims = v.dims().to_vec();
            let axis = norm_axis(at.i("axis", 1), dims.len() + 1)
                .ok_or_else(|| im.err("axis out of range"))?;
            let nd = vec![
                dims[..axis].iter().product::<usize>(),
                dims[axis..].iter().product(),
            ];
            reshape_to(im, &out0, v, &node.input[0], nd)?;
        }
        "Reshape" => {
            let v = input(0)?;
            let shape = if im.opset < 5 {
                at.ints("shape")
            } else {
                const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "shape")?
            }
            .ok_or_else(|| im.err("no shape"))?;
            let dims = v.dims().to_vec();
            let allowzero = at.i("allowzero", 0) != 0;
            let mut nd: Vec<i64> = shape
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    if s == 0 && !allowzero {
                        dims.get(i).map_or(0, |&d| d as i64)
                    } else {
                        s
                    }
                })
                .collect();
            let total: usize = dims.iter().product();
            let known: i64 = nd
                .iter()
                .filter(|&&s| s != -1)
                .try_fold(1i64, |a, &s| a.checked_mul(s))
                .unwrap_or(-1);
            if nd.iter().filter(|&&s| s == -1).count() > 1 || known <= 0 {
                return Err(im.err(format!("invalid shape {shape:?} for {dims:?}")));
            }
            for s in nd.iter_mut() {
                if *s == -1 {
                    *s = total as i64 / known;
                }
            }
            let nd: Vec<usize> = nd.iter().map(|&s| s.max(0) as usize).collect();
            if nd.iter().product::<usize>() != total {
                return Err(im.err(format!("cannot reshape {dims:?} to {shape:?}")));
            }
            reshape_to(im, &out0, v, &node.input[0], nd)?;
        }
        "Squeeze" | "Unsqueeze" => {
            let v = input(0)?;
            let dims = v.dims().to_vec();
            let axes = if im.opset < 13 {
                at.ints("axes")
            } else {
                const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "axes")?
            };
            let nd = if op == "Squeeze" {
                match axes {
                    None => dims.iter().copied().filter(|&d| d != 1).collect(),
                    Some(a) => {
                        let ax: Vec<usize> = a
                            .iter()
                            .map(|&x| norm_axis(x, dims.len()))
                            .collect::<Option<_>>()
                            .ok_or_else(|| im.err("axis out of range"))?;
                        if ax.iter().any(|&x| dims[x] != 1) {
                            return Err(
                                im.err(format!("squeezes an axis of {dims:?} that is not 1"))
                            );
                        }
                        dims.iter()
                            .enumerate()
                            .filter(|(i, _)| !ax.contains(i))
                            .map(|(_, &d)| d)
                            .collect()
                    }
                }
            } else {
                let a = axes.ok_or_else(|| im.err("no axes"))?;
                let r = dims.len() + a.len();
                let mut ax: Vec<usize> = a
                    .iter()
                    .map(|&x| norm_axis(x, r))
                    .collect::<Option<_>>()
                    .ok_or_else(|| im.err("axis out of range"))?;
                ax.sort_unstable();
                let mut nd = dims.clone();
                for &x in &ax {
                    nd.insert(x.min(nd.len()), 1);
                }
                nd
            };
            reshape_to(im, &out0, v, &node.input[0], nd)?;
        }
        "Expand" => {
            let v = input(0)?;
            let shape = const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "shape")?
                .ok_or_else(|| im.err("no shape"))?;
            let shape: Vec<usize> = shape.iter().map(|&s| s.max(1) as usize).collect();
            let dims = broadcast(v.dims(), &shape)
                .ok_or_else(|| im.err(format!("{:?} does not expand to {shape:?}", v.dims())))?;
            match v {
                Val::C(h) if checked_numel(&dims).is_some_and(|n| n <= MAX_FOLD) => {
                    let idx = bcast_index(&dims, &h.dims);
                    let data = h.data.pick(&idx);
                    im.vals.insert(
                        out0,
                        Val::c(HostTensor {
                            dims,
                            data,
                            onnx_type: h.onnx_type,
                        }),
                    );
                }
                v => {
                    let (x, d, xd) = im.rt(&v, &node.input[0])?;
                    let e = if xd == dims {
                        x
                    } else {
                        format!("broadcast_to({x}, {})", list(&dims))
                    };
                    im.bind(&out0, e, d, dims);
                }
            }
        }
        "Transpose" => {
            let v = input(0)?;
            let r = v.dims().len();
            let perm: Vec<usize> = match at.ints("perm") {
                Some(p) => p
                    .iter()
                    .map(|&a| norm_axis(a, r))
                    .collect::<Option<_>>()
                    .ok_or_else(|| im.err("perm out of range"))?,
                None => (0..r).rev().collect(),
            };
            let mut seen = perm.clone();
            seen.sort_unstable();
            if seen != (0..r).collect::<Vec<_>>() {
                return Err(im.err(format!("perm {perm:?} is not a permutation")));
            }
            let dims: Vec<usize> = perm.iter().map(|&p| v.dims()[p]).collect();
            match v {
                Val::C(h) if !im.keeps_param(&node.input[0], &h) => {
                    let data = h.data.pick(&permute_index(&h.dims, &perm));
                    im.vals.insert(
                        out0,
                        Val::c(HostTensor {
                            dims,
                            data,
                            onnx_type: h.onnx_type,
                        }),
                    );
                }
                v => {
                    let (x, d, _) = im.rt(&v, &node.input[0])?;
                    let e = if perm.iter().enumerate().all(|(i, &p)| i == p) {
                        x
                    } else {
                        format!("permute({x}, {})", list(&perm))
                    };
                    im.bind(&out0, e, d, dims);
                }
            }
        }
        "Concat" => {
            let vs: Vec<(usize, Val)> = ins
                .iter()
                .enumerate()
                .filter_map(|(i, v)| v.clone().map(|v| (i, v)))
                .filter(|(_, v)| v.dims().iter().product::<usize>() > 0 || v.dims().is_empty())
                .collect();
            let first = vs.first().ok_or_else(|| im.err("no inputs"))?.1.clone();
            let r = first.dims().len();
            let axis = norm_axis(at.i("axis", 0), r).ok_or_else(|| im.err("axis out of range"))?;
            let mut dims = first.dims().to_vec();
            dims[axis] = 0;
            for (_, v) in &vs {
                let d = v.dims();
                if d.len() != r
                    || d.iter()
                        .enumerate()
                        .any(|(i, &x)| i != axis && x != first.dims()[i])
                {
                    return Err(im.err(format!(
                        "shapes {:?} and {d:?} do not concatenate",
                        first.dims()
                    )));
                }
                dims[axis] += d[axis];
            }
            if vs.iter().all(|(_, v)| matches!(v, Val::C(_))) {
                // Fold: the output's elements in order, block by block.
                let outer: usize = dims[..axis].iter().product();
                let mut pieces: Vec<CData> = Vec::new();
                let mut hs = Vec::new();
                for (_, v) in &vs {
                    if let Val::C(h) = v {
                        hs.push(h);
                    }
                }
                let mut data_all: Option<CData> = None;
                for o in 0..outer {
                    for h in &hs {
                        let inner: usize = h.dims[axis..].iter().product();
                        let idx: Vec<usize> = (o * inner..(o + 1) * inner).collect();
                        pieces.push(h.data.pick(&idx));
                    }
                }
                for p in pieces {
                    data_all = Some(match (data_all, p) {
                        (None, p) => p,
                        (Some(CData::I(mut a)), CData::I(b)) => {
                            a.extend(b);
                            CData::I(a)
                        }
                        (Some(CData::F(a, k)), CData::F(b, _)) => CData::F(a.extend(b), k),
                        (Some(CData::B(mut a)), CData::B(b)) => {
                            a.extend(b);
                            CData::B(a)
                        }
                        _ => return Err(im.err("inputs of different types")),
                    });
                }
                let onnx_type = hs.first().map_or(dt::INT64, |h| h.onnx_type);
                im.vals.insert(
                    out0,
                    Val::c(HostTensor {
                        dims,
                        data: data_all.unwrap_or(CData::I(vec![])),
                        onnx_type,
                    }),
                );
            } else {
                let mut es = Vec::new();
                let mut dtype = DType::F32;
                for (i, v) in &vs {
                    let (e, d, _) = im.rt(v, &node.input[*i])?;
                    dtype = d;
                    es.push(e);
                }
                let e = if es.len() == 1 {
                    es.remove(0)
                } else {
                    format!("concat([{}], axis: {axis})", es.join(", "))
                };
                im.bind(&out0, e, dtype, dims);
            }
        }
        "Split" => {
            let v = input(0)?;
            let dims = v.dims().to_vec();
            let axis = norm_axis(at.i("axis", 0), dims.len())
                .ok_or_else(|| im.err("axis out of range"))?;
            let n_out = node.output.len();
            let sizes: Vec<usize> = match if im.opset < 13 {
                at.ints("split")
            } else {
                const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "split")?
            } {
                Some(s) => s.iter().map(|&x| x.max(0) as usize).collect(),
                None => {
                    let d = dims[axis];
                    let part = d.div_ceil(n_out.max(1));
                    (0..n_out)
                        .map(|i| part.min(d.saturating_sub(i * part)))
                        .collect()
                }
            };
            if sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s)) != Some(dims[axis])
                || sizes.len() != n_out
            {
                return Err(im.err(format!(
                    "split {sizes:?} does not divide axis {axis} of {dims:?}"
                )));
            }
            let mut start = 0;
            for (o, &s) in node.output.iter().zip(&sizes) {
                let mut ranges: Vec<(usize, usize)> = dims.iter().map(|&d| (0, d)).collect();
                ranges[axis] = (start, start + s);
                start += s;
                if o.is_empty() {
                    continue;
                }
                slice_to(im, o, &v, &node.input[0], &ranges)?;
            }
        }
        "Slice" => {
            let v = input(0)?;
            let dims = v.dims().to_vec();
            let r = dims.len();
            let (starts, ends, axes, steps) = if im.opset < 10 {
                (
                    at.ints("starts").unwrap_or_default(),
                    at.ints("ends").unwrap_or_default(),
                    at.ints("axes"),
                    None,
                )
            } else {
                let g = |i: usize, w: &str| const_ints(im, ins.get(i).and_then(|x| x.as_ref()), w);
                (
                    g(1, "starts")?.unwrap_or_default(),
                    g(2, "ends")?.unwrap_or_default(),
                    g(3, "axes")?,
                    g(4, "steps")?,
                )
            };
            let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
            if starts.len() != ends.len() || axes.len() != starts.len() {
                return Err(im.err("starts, ends and axes differ in length"));
            }
            if steps.as_ref().is_some_and(|s| s.iter().any(|&x| x != 1)) {
                return Err(im.unsupported("steps other than 1"));
            }
            let mut ranges: Vec<(usize, usize)> = dims.iter().map(|&d| (0, d)).collect();
            for ((&s, &e), &a) in starts.iter().zip(&ends).zip(&axes) {
                let a = norm_axis(a, r).ok_or_else(|| im.err("axis out of range"))?;
                let d = dims[a] as i64;
                let clamp = |x: i64| (if x < 0 { x + d } else { x }).clamp(0, d) as usize;
                let (s, e) = (clamp(s), clamp(e));
                if e <= s {
                    return Err(im.unsupported(format!(
                        "an empty slice of axis {a} (tcc tensors have no zero-size dimension)"
                    )));
                }
                ranges[a] = (s, e);
            }
            slice_to(im, &out0, &v, &node.input[0], &ranges)?;
        }
        "Gather" => {
            let (data, idx) = (input(0)?, input(1)?);
            let dims = data.dims().to_vec();
            let axis = norm_axis(at.i("axis", 0), dims.len())
                .ok_or_else(|| im.err("axis out of range"))?;
            let mut out_dims = dims[..axis].to_vec();
            out_dims.extend(idx.dims());
            out_dims.extend(&dims[axis + 1..]);
            match &idx {
                Val::C(hi) => {
                    let d = dims[axis] as i64;
                    let ids: Vec<usize> = hi
                        .data
                        .as_f64()
                        .iter()
                        .map(|&x| {
                            let x = x as i64;
                            let x = if x < 0 { x + d } else { x };
                            (0..d).contains(&x).then_some(x as usize)
                        })
                        .collect::<Option<_>>()
                        .ok_or_else(|| im.err("index out of range"))?;
                    match &data {
                        Val::C(h) if checked_numel(&out_dims).is_some_and(|n| n <= MAX_FOLD) => {
                            let outer: usize = dims[..axis].iter().product();
                            let inner: usize = dims[axis + 1..].iter().product();
                            let mut flat = Vec::new();
                            for o in 0..outer {
                                for &i in &ids {
                                    for k in 0..inner {
                                        flat.push((o * dims[axis] + i) * inner + k);
                                    }
                                }
                            }
                            let data = h.data.pick(&flat);
                            im.vals.insert(
                                out0,
                                Val::c(HostTensor {
                                    dims: out_dims,
                                    data,
                                    onnx_type: h.onnx_type,
                                }),
                            );
                        }
                        v => {
                            let (x, dtype, _) = im.rt(v, &node.input[0])?;
                            let mut parts = Vec::new();
                            for &i in &ids {
                                let mut ranges: Vec<(usize, usize)> =
                                    dims.iter().map(|&d| (0, d)).collect();
                                ranges[axis] = (i, i + 1);
                                parts.push(slice_expr(&x, &dims, &ranges));
                            }
                            let cat = if parts.len() == 1 {
                                parts.remove(0)
                            } else {
                                format!("concat([{}], axis: {axis})", parts.join(", "))
                            };
                            let e = if out_dims.is_empty() {
                                format!("reshape({cat}, [])")
                            } else {
                                format!("reshape({cat}, {})", list(&out_dims))
                            };
                            im.bind(&out0, e, dtype, out_dims);
                        }
                    }
                }
                Val::Rt { .. } => {
                    if axis != 0 {
                        return Err(im.unsupported("run-time indices along an axis other than 0"));
                    }
                    let (t, dtype, _) = im.rt(&data, &node.input[0])?;
                    let (ids, idt, _) = im.rt(&idx, &node.input[1])?;
                    if idt != DType::I32 {
                        return Err(im.err(format!("indices are {idt}")));
                    }
                    let rest: usize = dims[1..].iter().product();
                    let table = if dims.len() == 2 {
                        t
                    } else {
                        format!("reshape({t}, [{}, {rest}])", dims[0])
                    };
                    let mut e = format!("embedding({table}, {ids})");
                    if dims.len() != 2 {
                        e = format!("reshape({e}, {})", list(&out_dims));
                    }
                    im.bind(&out0, e, dtype, out_dims);
                }
            }
        }
        "Tile" => {
            let v = input(0)?;
            let reps = const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "repeats")?
                .ok_or_else(|| im.err("no repeats"))?;
            let (mut x, d, mut dims) = im.rt(&v, &node.input[0])?;
            if reps.len() != dims.len() {
                return Err(im.err("repeats and rank differ"));
            }
            if reps.iter().any(|&n| !(0..=MAX_ATTR).contains(&n)) {
                return Err(im.err(format!("repeats {reps:?}")));
            }
            for (a, &n) in reps.iter().enumerate() {
                if n > 1 {
                    let parts = vec![x.as_str(); n as usize].join(", ");
                    x = im.tmp(
                        &format!("{out0}_tile"),
                        format!("concat([{parts}], axis: {a})"),
                    );
                    dims[a] *= n as usize;
                }
            }
            im.bind(&out0, x, d, dims);
        }
        "Pad" => {
            let v = input(0)?;
            let mode = at.s("mode").unwrap_or_else(|| "constant".into());
            let pads = if im.opset < 11 {
                at.ints("pads").or_else(|| at.ints("paddings"))
            } else {
                const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "pads")?
            }
            .ok_or_else(|| im.err("no pads"))?;
            let value = if im.opset < 11 {
                at.f("value", 0.0) as f64
            } else {
                match ins.get(2).cloned().flatten() {
                    Some(Val::C(h)) => h.data.first_f64().unwrap_or(0.0),
                    Some(_) => return Err(im.unsupported("a run-time pad value")),
                    None => 0.0,
                }
            };
            let (x, d, dims) = im.rt(&v, &node.input[0])?;
            let r = dims.len();
            if pads.len() != 2 * r || pads.iter().any(|&p| !(0..=MAX_ATTR).contains(&p)) {
                return Err(im.unsupported(format!("pads {pads:?} (negative pads crop)")));
            }
            let pads: Vec<usize> = pads.iter().map(|&p| p as usize).collect();
            let (e, nd) = pad_expr(im, &x, d, &dims, &pads[..r], &pads[r..], &mode, value)?;
            im.bind(&out0, e, d, nd);
        }
        "BatchNormalization" => {
            if at.i("training_mode", 0) != 0 || node.output.iter().skip(1).any(|o| !o.is_empty()) {
                return Err(im.unsupported("training mode (tcc imports inference graphs)"));
            }
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let eps = at.f("epsilon", 1e-5) as f64;
            let c = *dims.get(1).ok_or_else(|| im.err("input has rank < 2"))?;
            let mut cs = vec![c];
            cs.extend(std::iter::repeat_n(1, dims.len().saturating_sub(2)));
            let mut per = Vec::new();
            for i in 1..5 {
                let (e, _, pd) = im.rt(&input(i)?, &node.input[i])?;
                if pd != [c] {
                    return Err(im.err(format!("parameter {i} has shape {pd:?}, not [{c}]")));
                }
                per.push(if cs.len() == 1 {
                    e
                } else {
                    format!("reshape({e}, {})", list(&cs))
                });
            }
            let e = format!(
                "({x} - {m}) * rsqrt({v} + {eps}) * {g} + {b}",
                m = per[2],
                v = per[3],
                g = per[0],
                b = per[1],
                eps = lit(eps, d).unwrap_or_default()
            );
            im.bind(&out0, e, d, dims);
        }
        "InstanceNormalization" | "LayerNormalization" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let r = dims.len();
            let eps = lit(at.f("epsilon", 1e-5) as f64, d).unwrap_or_default();
            if node.output.iter().skip(1).any(|o| !o.is_empty()) {
                return Err(im.unsupported("the mean and inverse deviation outputs"));
            }
            let (axes, pshape): (Vec<usize>, Vec<usize>) = if op == "LayerNormalization" {
                let a =
                    norm_axis(at.i("axis", -1), r).ok_or_else(|| im.err("axis out of range"))?;
                ((a..r).collect(), dims[a..].to_vec())
            } else {
                let c = *dims.get(1).ok_or_else(|| im.err("input has rank < 2"))?;
                let mut s = vec![c];
                s.extend(std::iter::repeat_n(1, r - 2));
                ((2..r).collect(), s)
            };
            let (g, _, gd) = im.rt(&input(1)?, &node.input[1])?;
            let b = match ins.get(2).cloned().flatten() {
                Some(v) => Some(im.rt(&v, &node.input[2])?),
                None => None,
            };
            let fit = |e: String, sd: &[usize]| -> String {
                if sd == pshape.as_slice() {
                    e
                } else {
                    format!("reshape({e}, {})", list(&pshape))
                }
            };
            let gd_n: usize = gd.iter().product();
            if gd_n != pshape.iter().product::<usize>() {
                return Err(im.err(format!("scale {gd:?} does not fit {pshape:?}")));
            }
            let g = fit(g, &gd);
            let b = b.map(|(e, _, bd)| fit(e, &bd));
            if op == "LayerNormalization" && axes.len() == 1 {
                if let Some(b) = &b {
                    im.bind(
                        &out0,
                        format!("layer_norm({x}, {g}, {b}, eps: {eps})"),
                        d,
                        dims,
                    );
                    return Ok(());
                }
            }
            let al = list(&axes);
            let c = im.tmp(
                &format!("{out0}_c"),
                format!("{x} - mean({x}, axis: {al}, keepdim: true)"),
            );
            let mut e =
                format!("{c} * rsqrt(mean({c} * {c}, axis: {al}, keepdim: true) + {eps}) * {g}");
            if let Some(b) = b {
                e = format!("{e} + {b}");
            }
            im.bind(&out0, e, d, dims);
        }
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
        | "ReduceSumSquare" | "ReduceLogSumExp" => {
            let v = input(0)?;
            let (x, d, dims) = im.rt(&v, &node.input[0])?;
            let r = dims.len();
            let axes_in = op == "ReduceSum" && im.opset >= 13 || im.opset >= 18;
            let axes = if axes_in {
                const_ints(im, ins.get(1).and_then(|x| x.as_ref()), "axes")?
            } else {
                at.ints("axes")
            };
            let keep = at.i("keepdims", 1) != 0;
            let axes: Vec<usize> = match axes {
                Some(a) if !a.is_empty() => a
                    .iter()
                    .map(|&x| norm_axis(x, r))
                    .collect::<Option<_>>()
                    .ok_or_else(|| im.err("axis out of range"))?,
                _ if at.i("noop_with_empty_axes", 0) != 0 => {
                    im.bind(&out0, x, d, dims);
                    return Ok(());
                }
                _ => (0..r).collect(),
            };
            let mut nd = Vec::new();
            for (i, &n) in dims.iter().enumerate() {
                if !axes.contains(&i) {
                    nd.push(n);
                } else if keep {
                    nd.push(1);
                }
            }
            let args = format!("axis: {}, keepdim: {keep}", list(&axes));
            let e = match op {
                "ReduceMean" => format!("mean({x}, {args})"),
                "ReduceSum" => format!("sum({x}, {args})"),
                "ReduceMax" => format!("max({x}, {args})"),
                "ReduceMin" => format!("min({x}, {args})"),
                "ReduceL1" => format!("sum(abs({x}), {args})"),
                "ReduceL2" => format!("sqrt(sum({x} * {x}, {args}))"),
                "ReduceSumSquare" => format!("sum({x} * {x}, {args})"),
                _ => format!("log(sum(exp({x}), {args}))"),
            };
            im.bind(&out0, e, d, nd);
        }
        "ArgMax" => {
            let (x, _, dims) = im.rt(&input(0)?, &node.input[0])?;
            if at.i("select_last_index", 0) != 0 {
                return Err(im.unsupported("select_last_index"));
            }
            let a = norm_axis(at.i("axis", 0), dims.len())
                .ok_or_else(|| im.err("axis out of range"))?;
            let keep = at.i("keepdims", 1) != 0;
            let mut nd = dims.clone();
            if keep {
                nd[a] = 1;
            } else {
                nd.remove(a);
            }
            im.bind(
                &out0,
                format!("argmax({x}, axis: {a}, keepdim: {keep})"),
                DType::I32,
                nd,
            );
        }
        "LRN" => {
            // x / (bias + alpha / size * (sum of x² over `size` neighbouring channels))^beta
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let size = at.i("size", 1);
            if !(1..=MAX_ATTR).contains(&size) || dims.len() < 3 {
                return Err(im.err(format!("size {size} on {dims:?}")));
            }
            let size = size as usize;
            let (alpha, beta, bias) = (
                at.f("alpha", 1e-4) as f64,
                at.f("beta", 0.75) as f64,
                at.f("bias", 1.0) as f64,
            );
            let sq = im.tmp(&format!("{out0}_sq"), format!("{x} * {x}"));
            let (lo, hi) = ((size - 1) / 2, (size - 1).div_ceil(2));
            let r = dims.len();
            let mut before = vec![0; r];
            let mut after = vec![0; r];
            before[1] = lo;
            after[1] = hi;
            let (padded, pd) = pad_expr(im, &sq, d, &dims, &before, &after, "constant", 0.0)?;
            let p = im.tmp(&format!("{out0}_pad"), padded);
            let terms: Vec<String> = (0..size)
                .map(|i| {
                    let mut ranges: Vec<(usize, usize)> = pd.iter().map(|&n| (0, n)).collect();
                    ranges[1] = (i, i + dims[1]);
                    slice_expr(&p, &pd, &ranges)
                })
                .collect();
            let f = |v: f64| lit(v, d).unwrap_or_default();
            let e = format!(
                "{x} / pow({} + {} * ({}), {})",
                f(bias),
                f(alpha / size as f64),
                terms.join(" + "),
                f(beta)
            );
            im.bind(&out0, e, d, dims);
        }
        "GlobalAveragePool" | "GlobalMaxPool" => {
            let (x, d, dims) = im.rt(&input(0)?, &node.input[0])?;
            let axes: Vec<usize> = (2..dims.len()).collect();
            let mut nd = dims.clone();
            for &a in &axes {
                nd[a] = 1;
            }
            let f = if op == "GlobalAveragePool" {
                "mean"
            } else {
                "max"
            };
            im.bind(
                &out0,
                format!("{f}({x}, axis: {}, keepdim: true)", list(&axes)),
                d,
                nd,
            );
        }
        "Conv" => conv(im, node, ins, &out0)?,
        "ConvTranspose" => conv_transpose(im, node, ins, &out0)?,
        "MaxPool" | "AveragePool" => pool(im, node, ins, &out0)?,
        _ => return Err(im.unsupported("")),
    }
    Ok(())
}

/// `out = reshape(v, nd)`; folded on constants.
fn reshape_to(im: &mut Importer, out: &str, v: Val, hint: &str, nd: Vec<usize>) -> R<()> {
    match v {
        Val::C(h) if !im.keeps_param(hint, &h) => {
            let h = Rc::unwrap_or_clone(h);
            im.vals.insert(
                out.to_string(),
                Val::c(HostTensor {
                    dims: nd,
                    data: h.data,
                    onnx_type: h.onnx_type,
                }),
            );
        }
        v => {
            let (x, d, dims) = im.rt(&v, hint)?;
            let e = if dims == nd {
                x
            } else {
                format!("reshape({x}, {})", list(&nd))
            };
            im.bind(out, e, d, nd);
        }
    }
    Ok(())
}

/// `out = v[ranges]`; folded on constants.
fn slice_to(im: &mut Importer, out: &str, v: &Val, hint: &str, ranges: &[(usize, usize)]) -> R<()> {
    let nd: Vec<usize> = ranges.iter().map(|(a, b)| b - a).collect();
    match v {
        Val::C(h) => {
            let data = h.data.pick(&slice_index(&h.dims, ranges));
            im.vals.insert(
                out.to_string(),
                Val::c(HostTensor {
                    dims: nd,
                    data,
                    onnx_type: h.onnx_type,
                }),
            );
        }
        v => {
            let (x, d, dims) = im.rt(v, hint)?;
            let e = if dims == nd {
                x
            } else {
                slice_expr(&x, &dims, ranges)
            };
            im.bind(out, e, d, nd);
        }
    }
    Ok(())
}

/// Pads `x` on every axis by concatenation: a constant, the edge values or a reflection.
#[allow(clippy::too_many_arguments)]
fn pad_expr(
    im: &mut Importer,
    x: &str,
    d: DType,
    dims: &[usize],
    before: &[usize],
    after: &[usize],
    mode: &str,
    value: f64,
) -> R<(String, Vec<usize>)> {
    let mut cur = x.to_string();
    let mut cd = dims.to_vec();
    for a in 0..dims.len() {
        let (p, q) = (before[a], after[a]);
        if p == 0 && q == 0 {
            continue;
        }
        let mut parts = Vec::new();
        let piece = |i: usize, cd: &[usize]| {
            let mut ranges: Vec<(usize, usize)> = cd.iter().map(|&d| (0, d)).collect();
            ranges[a] = (i, i + 1);
            slice_expr(&cur, cd, &ranges)
        };
        let n = cd[a];
        let fill = |k: usize, cd: &[usize]| -> R<String> {
            let mut s = cd.to_vec();
            s[a] = k;
            let l = lit(value, d).ok_or_else(|| im.unsupported("a NaN pad value"))?;
            Ok(format!("full({}, {l}, {d})", list(&s)))
        };
        match mode {
            "constant" => {
                if p > 0 {
                    parts.push(fill(p, &cd)?);
                }
                parts.push(cur.clone());
                if q > 0 {
                    parts.push(fill(q, &cd)?);
                }
            }
            "edge" => {
                for _ in 0..p {
                    parts.push(piece(0, &cd));
                }
                parts.push(cur.clone());
                for _ in 0..q {
                    parts.push(piece(n - 1, &cd));
                }
            }
            "reflect" => {
                if p >= n || q >= n {
                    return Err(
                        im.unsupported(format!("reflect pads of {p}, {q} on an axis of {n}"))
                    );
                }
                for i in (1..=p).rev() {
                    parts.push(piece(i, &cd));
                }
                parts.push(cur.clone());
                for i in 1..=q {
                    parts.push(piece(n - 1 - i, &cd));
                }
            }
            other => return Err(im.unsupported(format!("mode `{other}`"))),
        }
        cd[a] += p + q;
        cur = im.tmp("pad", format!("concat([{}], axis: {a})", parts.join(", ")));
    }
    Ok((cur, cd))
}

/// Spatial attributes shared by Conv and the pools: kernel, strides, pads (before, after),
/// dilations, from `auto_pad` too.
struct Window {
    strides: Vec<usize>,
    before: Vec<usize>,
    after: Vec<usize>,
    dilations: Vec<usize>,
}

fn window(im: &Importer, at: &Attrs, spatial: &[usize], kernel: Vec<usize>) -> R<Window> {
    let n = spatial.len();
    let pos = |v: Option<Vec<i64>>, what: &str| -> R<Vec<usize>> {
        match v {
            None => Ok(vec![1; n]),
            Some(v) if v.len() == n && v.iter().all(|&x| (1..=MAX_ATTR).contains(&x)) => {
                Ok(v.iter().map(|&x| x as usize).collect())
            }
            Some(v) => Err(im.err(format!("{what} {v:?} for {n} spatial axes"))),
        }
    };
    let strides = pos(at.ints("strides"), "strides")?;
    let dilations = pos(at.ints("dilations"), "dilations")?;
    let auto = at.s("auto_pad").unwrap_or_else(|| "NOTSET".into());
    let (mut before, mut after) = (vec![0; n], vec![0; n]);
    match auto.as_str() {
        "NOTSET" | "" => {
            if let Some(p) = at.ints("pads") {
                if p.len() != 2 * n || p.iter().any(|&x| !(0..=MAX_ATTR).contains(&x)) {
                    return Err(im.err(format!("pads {p:?} for {n} spatial axes")));
                }
                for i in 0..n {
                    before[i] = p[i] as usize;
                    after[i] = p[i + n] as usize;
                }
            }
        }
        "VALID" => {}
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..n {
                let out = spatial[i].div_ceil(strides[i]);
                let eff = (kernel[i] - 1) * dilations[i] + 1;
                let total = ((out - 1) * strides[i] + eff).saturating_sub(spatial[i]);
                let small = total / 2;
                if auto == "SAME_UPPER" {
                    before[i] = small;
                    after[i] = total - small;
                } else {
                    after[i] = small;
                    before[i] = total - small;
                }
            }
        }
        other => return Err(im.err(format!("auto_pad `{other}`"))),
    }
    Ok(Window {
        strides,
        before,
        after,
        dilations,
    })
}

/// `x` (a name) taken along `axis` at `start, start + step, …`, `count` elements: a slice
/// when `step` is 1; else a slice of `step * count` (padded at the end where it runs past),
/// split into `[count, step]`, of which the first phase is kept.
#[allow(clippy::too_many_arguments)]
fn strided_expr(
    im: &mut Importer,
    x: &str,
    d: DType,
    dims: &[usize],
    axis: usize,
    start: usize,
    step: usize,
    count: usize,
) -> R<(String, Vec<usize>)> {
    let mut out = dims.to_vec();
    out[axis] = count;
    let full = |cd: &[usize]| -> Vec<(usize, usize)> { cd.iter().map(|&n| (0, n)).collect() };
    if step == 1 {
        let mut r = full(dims);
        r[axis] = (start, start + count);
        return Ok((slice_expr(x, dims, &r), out));
    }
    let need = start + step * count;
    let (mut cur, mut cd) = (x.to_string(), dims.to_vec());
    if need > cd[axis] {
        let mut after = vec![0; dims.len()];
        after[axis] = need - cd[axis];
        (cur, cd) = pad_expr(
            im,
            &cur,
            d,
            &cd,
            &vec![0; dims.len()],
            &after,
            "constant",
            0.0,
        )?;
    }
    let mut r = full(&cd);
    r[axis] = (start, need);
    let mut split = out.clone();
    split.insert(axis + 1, step);
    let s = im.tmp(
        "strided",
        format!("reshape({}, {})", slice_expr(&cur, &cd, &r), list(&split)),
    );
    let mut r2 = full(&split);
    r2[axis + 1] = (0, 1);
    Ok((
        format!("reshape({}, {})", slice_expr(&s, &split, &r2), list(&out)),
        out,
    ))
}

/// `x` (a name, `dims`) with `step - 1` zeros after each element along `axis`, up to the
/// last element: length `(n - 1) * step + 1`.
fn spread_expr(
    im: &mut Importer,
    x: &str,
    d: DType,
    dims: &[usize],
    axis: usize,
    step: usize,
) -> (String, Vec<usize>) {
    let n = dims[axis];
    let mut out = dims.to_vec();
    out[axis] = (n - 1) * step + 1;
    if step == 1 {
        return (x.to_string(), out);
    }
    let (mut one, mut zs, mut merged) = (dims.to_vec(), dims.to_vec(), dims.to_vec());
    one.insert(axis + 1, 1);
    zs.insert(axis + 1, step - 1);
    merged[axis] = n * step;
    let t = im.tmp(
        "spread",
        format!(
            "reshape(concat([reshape({x}, {}), zeros({}, {d})], axis: {}), {})",
            list(&one),
            list(&zs),
            axis + 1,
            list(&merged)
        ),
    );
    let mut r: Vec<(usize, usize)> = merged.iter().map(|&m| (0, m)).collect();
    r[axis] = (0, out[axis]);
    (slice_expr(&t, &merged, &r), out)
}

/// `x` (a name) reversed along `axis`: its slices concatenated in the other order.
fn flip_expr(x: &str, dims: &[usize], axis: usize) -> String {
    if dims[axis] == 1 {
        return x.to_string();
    }
    let parts: Vec<String> = (0..dims[axis])
        .rev()
        .map(|i| {
            let mut r: Vec<(usize, usize)> = dims.iter().map(|&m| (0, m)).collect();
            r[axis] = (i, i + 1);
            slice_expr(x, dims, &r)
        })
        .collect();
    format!("concat([{}], axis: {axis})", parts.join(", "))
}

/// The spatial attributes of a 2-D convolution: strides, pads (before, after), dilations.
#[derive(Clone, Copy)]
struct Conv2d {
    strides: [usize; 2],
    before: [usize; 2],
    after: [usize; 2],
    dil: [usize; 2],
    groups: usize,
}

/// A 2-D convolution of `xe` (`[n, c, h, w]`) by `we` (`[o, c / groups, kh, kw]`), with no
/// bias: its expression and `[n, o, oh, ow]`.
fn conv2d_expr(
    im: &mut Importer,
    out: &str,
    (xe, xdims): (String, [usize; 4]),
    (we, wdims): (String, [usize; 4]),
    d: DType,
    p: Conv2d,
) -> R<(String, [usize; 4])> {
    let [n, c, h, w] = xdims;
    let (mut xe, mut we) = (xe, we);
    let mut xs = [h, w];
    let mut kd = wdims;
    // Dilation: the kernel with zeros between its taps (exact).
    for a in 0..2 {
        if p.dil[a] > 1 {
            let wn = im.tmp(&format!("{out}_w"), we);
            let (e, nd) = spread_expr(im, &wn, d, &kd, a + 2, p.dil[a]);
            we = e;
            kd[a + 2] = nd[a + 2];
        }
    }
    // Asymmetric pads: explicit zeros, then no padding in the convolution.
    let mut pad = [0usize; 2];
    if p.before != p.after {
        let x4 = im.tmp(&format!("{out}_x"), xe);
        let (e, nd) = pad_expr(
            im,
            &x4,
            d,
            &[n, c, xs[0], xs[1]],
            &[0, 0, p.before[0], p.before[1]],
            &[0, 0, p.after[0], p.after[1]],
            "constant",
            0.0,
        )?;
        xe = e;
        xs = [nd[2], nd[3]];
    } else {
        pad = p.before;
    }
    let mut od = [0; 2];
    for a in 0..2 {
        od[a] = (xs[a] + 2 * pad[a])
            .checked_sub(kd[a + 2])
            .ok_or_else(|| im.err("the kernel is larger than the padded input"))?
            / p.strides[a]
            + 1;
    }
    Ok((
        format!(
            "conv2d({xe}, {we}, stride: {}, padding: {}, groups: {})",
            list(&p.strides),
            list(&pad),
            p.groups
        ),
        [n, kd[0], od[0], od[1]],
    ))
}

fn conv(im: &mut Importer, node: &NodeProto, ins: &[Option<Val>], out: &str) -> R<()> {
    let at = Attrs(node);
    let xv = ins
        .first()
        .cloned()
        .flatten()
        .ok_or_else(|| im.err("no input"))?;
    let wv = ins
        .get(1)
        .cloned()
        .flatten()
        .ok_or_else(|| im.err("no weight"))?;
    let (x, d, xdims) = im.rt(&xv, &node.input[0])?;
    let (w, _, wdims) = im.rt(&wv, &node.input[1])?;
    let sp = xdims.len().saturating_sub(2);
    if !(1..=3).contains(&sp) || wdims.len() != xdims.len() {
        return Err(im.unsupported(format!(
            "{sp} spatial dimensions (tcc has 1-D, 2-D and 3-D convolutions)"
        )));
    }
    let g = at.i("group", 1).max(1) as usize;
    let (o, cg) = (wdims[0], wdims[1]);
    if xdims[1] != cg * g || o % g != 0 {
        return Err(im.err(format!(
            "weight {wdims:?} does not fit input {xdims:?} with group {g}"
        )));
    }
    let win = window(im, &at, &xdims[2..], wdims[2..].to_vec())?;
    let (n, c) = (xdims[0], xdims[1]);
    let bias = match ins.get(2) {
        Some(Some(b)) => {
            let (be, _, bd) = im.rt(b, &node.input[2])?;
            if bd != [o] {
                return Err(im.err(format!("bias {bd:?} is not [{o}]")));
            }
            Some(be)
        }
        _ => None,
    };
    let two = |v: &[usize], one: usize| -> [usize; 2] {
        match v {
            [a, b] => [*a, *b],
            [a] => [one, *a],
            _ => [one, one],
        }
    };
    if sp < 3 {
        // 1-D: a 2-D convolution over [N, C, 1, L].
        let lift = |e: String| {
            if sp == 1 {
                format!("unsqueeze({e}, axis: 2)")
            } else {
                e
            }
        };
        let xs = two(&xdims[2..], 1);
        let ks = two(&wdims[2..], 1);
        let p = Conv2d {
            strides: two(&win.strides, 1),
            before: two(&win.before, 0),
            after: two(&win.after, 0),
            dil: two(&win.dilations, 1),
            groups: g,
        };
        let (mut e, od) = conv2d_expr(
            im,
            out,
            (lift(x), [n, c, xs[0], xs[1]]),
            (lift(w), [o, cg, ks[0], ks[1]]),
            d,
            p,
        )?;
        if let Some(be) = bias {
            e = format!("{e} + reshape({be}, [{o}, 1, 1])");
        }
        let mut dims = od.to_vec();
        if sp == 1 {
            e = format!("squeeze({e}, axis: 2)");
            dims.remove(2);
        }
        im.bind(out, e, d, dims);
        return Ok(());
    }
    // 3-D: for each depth tap, a 2-D convolution of the depths it reads (batched with N),
    // summed over the taps.
    let (kdep, kh, kw) = (wdims[2], wdims[3], wdims[4]);
    let (mut xp, mut pd) = (x, xdims.clone());
    if win.before[0] > 0 || win.after[0] > 0 {
        (xp, pd) = pad_expr(
            im,
            &xp,
            d,
            &pd,
            &[0, 0, win.before[0], 0, 0],
            &[0, 0, win.after[0], 0, 0],
            "constant",
            0.0,
        )?;
    }
    let eff = (kdep - 1) * win.dilations[0] + 1;
    let dout = pd[2]
        .checked_sub(eff)
        .ok_or_else(|| im.err("the kernel is larger than the padded input"))?
        / win.strides[0]
        + 1;
    let (h, w_) = (xdims[3], xdims[4]);
    let xt = im.tmp(
        &format!("{out}_x"),
        format!("permute({xp}, [0, 2, 1, 3, 4])"),
    );
    let tdims = [n, pd[2], c, h, w_];
    let p = Conv2d {
        strides: [win.strides[1], win.strides[2]],
        before: [win.before[1], win.before[2]],
        after: [win.after[1], win.after[2]],
        dil: [win.dilations[1], win.dilations[2]],
        groups: g,
    };
    let mut terms = Vec::new();
    let mut od = [0; 4];
    for k in 0..kdep {
        let (sel, _) = strided_expr(
            im,
            &xt,
            d,
            &tdims,
            1,
            k * win.dilations[0],
            win.strides[0],
            dout,
        )?;
        let xk = im.tmp(
            &format!("{out}_x{k}"),
            format!("reshape({sel}, {})", list(&[n * dout, c, h, w_])),
        );
        let mut r: Vec<(usize, usize)> = wdims.iter().map(|&m| (0, m)).collect();
        r[2] = (k, k + 1);
        let wk = format!(
            "reshape({}, {})",
            slice_expr(&w, &wdims, &r),
            list(&[o, cg, kh, kw])
        );
        let (e, dims) = conv2d_expr(
            im,
            out,
            (xk, [n * dout, c, h, w_]),
            (wk, [o, cg, kh, kw]),
            d,
            p,
        )?;
        od = dims;
        terms.push(im.tmp(&format!("{out}_t{k}"), e));
    }
    let mut e = format!(
        "permute(reshape({}, {}), [0, 2, 1, 3, 4])",
        terms.join(" + "),
        list(&[n, dout, o, od[2], od[3]])
    );
    if let Some(be) = bias {
        e = format!("{e} + reshape({be}, [{o}, 1, 1, 1])");
    }
    im.bind(out, e, d, vec![n, o, dout, od[2], od[3]]);
    Ok(())
}

fn conv_transpose(im: &mut Importer, node: &NodeProto, ins: &[Option<Val>], out: &str) -> R<()> {
    let at = Attrs(node);
    let xv = ins
        .first()
        .cloned()
        .flatten()
        .ok_or_else(|| im.err("no input"))?;
    let wv = ins
        .get(1)
        .cloned()
        .flatten()
        .ok_or_else(|| im.err("no weight"))?;
    let (x, d, xdims) = im.rt(&xv, &node.input[0])?;
    let (w, _, wdims) = im.rt(&wv, &node.input[1])?;
    let sp = xdims.len().saturating_sub(2);
    if !(1..=2).contains(&sp) || wdims.len() != xdims.len() {
        return Err(im.unsupported(format!(
            "{sp} spatial dimensions (tcc has 1-D and 2-D transposed convolutions)"
        )));
    }
    let g = at.i("group", 1).max(1) as usize;
    let (c, og) = (wdims[0], wdims[1]);
    if xdims[1] != c || c % g != 0 {
        return Err(im.err(format!(
            "weight {wdims:?} does not fit input {xdims:?} with group {g}"
        )));
    }
    let kernel: Vec<usize> = wdims[2..].to_vec();
    if let Some(ks) = at.ints("kernel_shape") {
        if ks.iter().map(|&k| k as usize).ne(kernel.iter().copied()) {
            return Err(im.err(format!(
                "kernel_shape {ks:?} differs from the weight's {kernel:?}"
            )));
        }
    }
    let list_attr = |name: &str, default: usize, min: i64| -> R<Vec<usize>> {
        match at.ints(name) {
            None => Ok(vec![default; sp]),
            Some(v) if v.len() == sp && v.iter().all(|&x| (min..=MAX_ATTR).contains(&x)) => {
                Ok(v.iter().map(|&x| x as usize).collect())
            }
            Some(v) => Err(im.err(format!("{name} {v:?} for {sp} spatial axes"))),
        }
    };
    let strides = list_attr("strides", 1, 1)?;
    let dil = list_attr("dilations", 1, 1)?;
    let opad = list_attr("output_padding", 0, 0)?;
    let auto = at.s("auto_pad").unwrap_or_else(|| "NOTSET".into());
    let (mut pb, mut pa) = (vec![0usize; sp], vec![0usize; sp]);
    let spatial = &xdims[2..];
    let eff: Vec<usize> = (0..sp).map(|i| (kernel[i] - 1) * dil[i] + 1).collect();
    let full: Vec<usize> = (0..sp)
        .map(|i| (spatial[i] - 1) * strides[i] + eff[i] + opad[i])
        .collect();
    let target: Option<Vec<usize>> = match at.ints("output_shape") {
        Some(v) => {
            let v = if v.len() == sp + 2 {
                v[2..].to_vec()
            } else {
                v
            };
            if v.len() != sp || v.iter().any(|&x| !(1..=MAX_ATTR).contains(&x)) {
                return Err(im.err(format!("output_shape {v:?} for {sp} spatial axes")));
            }
            Some(v.iter().map(|&x| x as usize).collect())
        }
        None if auto == "SAME_UPPER" || auto == "SAME_LOWER" => {
            Some((0..sp).map(|i| spatial[i] * strides[i]).collect())
        }
        None => None,
    };
    match (&target, auto.as_str()) {
        (Some(t), _) => {
            for i in 0..sp {
                let total = full[i].checked_sub(t[i]).ok_or_else(|| {
                    im.err(format!(
                        "output size {} is larger than the {} the input gives",
                        t[i], full[i]
                    ))
                })?;
                if auto == "SAME_UPPER" {
                    pb[i] = total / 2;
                    pa[i] = total - total / 2;
                } else {
                    pb[i] = total - total / 2;
                    pa[i] = total / 2;
                }
            }
        }
        (None, "NOTSET" | "" | "VALID") => {
            if auto != "VALID" {
                if let Some(p) = at.ints("pads") {
                    if p.len() != 2 * sp || p.iter().any(|&x| !(0..=MAX_ATTR).contains(&x)) {
                        return Err(im.err(format!("pads {p:?} for {sp} spatial axes")));
                    }
                    for i in 0..sp {
                        pb[i] = p[i] as usize;
                        pa[i] = p[i + sp] as usize;
                    }
                }
            }
        }
        (None, other) => return Err(im.err(format!("auto_pad `{other}`"))),
    }
    // As a convolution (stride 1) of the input spread by the strides, padded by
    // `eff - 1 - pads` (cropped where that is negative), with the kernel flipped.
    let lift = |v: &[usize], one: usize| -> Vec<usize> {
        let mut r = v.to_vec();
        if sp == 1 {
            r.insert(0, one);
        }
        r
    };
    let (s2, k2, e2, f2, pb2, pa2, dl2) = (
        lift(&strides, 1),
        lift(&kernel, 1),
        lift(&eff, 1),
        lift(&full, 1),
        lift(&pb, 0),
        lift(&pa, 0),
        lift(&dil, 1),
    );
    let (n, o) = (xdims[0], og * g);
    let mut cd = lift(spatial, 1);
    cd.insert(0, c);
    cd.insert(0, n);
    let mut cur = if sp == 1 {
        im.tmp(&format!("{out}_x"), format!("unsqueeze({x}, axis: 2)"))
    } else {
        x
    };
    let mut before = [0usize; 2];
    let mut after = [0usize; 2];
    for a in 0..2 {
        if f2[a] <= pb2[a] + pa2[a] {
            return Err(im.err("the pads remove the whole output"));
        }
        let (e, nd) = spread_expr(im, &cur, d, &cd, a + 2, s2[a]);
        cur = im.tmp(&format!("{out}_x"), e);
        cd = nd;
        let lo = (e2[a] - 1) as i64 - pb2[a] as i64;
        let hi = (f2[a] - cd[a + 2]) as i64 - pa2[a] as i64;
        if lo < 0 || hi < 0 {
            let mut r: Vec<(usize, usize)> = cd.iter().map(|&m| (0, m)).collect();
            let start = (-lo).max(0) as usize;
            let end = cd[a + 2] - (-hi).max(0) as usize;
            if start >= end {
                return Err(im.err("the pads remove the whole output"));
            }
            r[a + 2] = (start, end);
            cur = im.tmp(&format!("{out}_x"), slice_expr(&cur, &cd, &r));
            cd[a + 2] = end - start;
        }
        before[a] = lo.max(0) as usize;
        after[a] = hi.max(0) as usize;
    }
    // The kernel as a convolution's: [C, O/g, ..] → [O, C/g, ..], flipped.
    let cg = c / g;
    let kdims = [o, cg, k2[0], k2[1]];
    let mut we = im.tmp(
        &format!("{out}_w"),
        format!(
            "reshape(permute(reshape({}, {}), [0, 2, 1, 3, 4]), {})",
            if sp == 1 {
                format!("unsqueeze({w}, axis: 2)")
            } else {
                w
            },
            list(&[g, cg, og, k2[0], k2[1]]),
            list(&kdims)
        ),
    );
    for a in 2..4 {
        let f = flip_expr(&we, &kdims, a);
        if f != we {
            we = im.tmp(&format!("{out}_w"), f);
        }
    }
    let (mut e, od) = conv2d_expr(
        im,
        out,
        (cur, [cd[0], cd[1], cd[2], cd[3]]),
        (we, kdims),
        d,
        Conv2d {
            strides: [1, 1],
            before,
            after,
            dil: [dl2[0], dl2[1]],
            groups: g,
        },
    )?;
    if let Some(Some(b)) = ins.get(2) {
        let (be, _, bd) = im.rt(b, &node.input[2])?;
        if bd != [o] {
            return Err(im.err(format!("bias {bd:?} is not [{o}]")));
        }
        e = format!("{e} + reshape({be}, [{o}, 1, 1])");
    }
    let mut dims = od.to_vec();
    if sp == 1 {
        e = format!("squeeze({e}, axis: 2)");
        dims.remove(2);
    }
    im.bind(out, e, d, dims);
    Ok(())
}

/// The attributes of a 2-D pooling.
#[derive(Clone, Copy)]
struct Pool2d {
    kernel: [usize; 2],
    strides: [usize; 2],
    before: [usize; 2],
    after: [usize; 2],
    ceil: bool,
    max: bool,
    include_pad: bool,
}

/// A 2-D max or average pooling of `xe` (`[n, c, h, w]`): its expression and dims.
fn pool2d_expr(
    im: &mut Importer,
    out: &str,
    xe: String,
    d: DType,
    [n, c, h, w]: [usize; 4],
    p: Pool2d,
) -> R<(String, [usize; 4])> {
    let Pool2d {
        kernel: k,
        strides: s,
        before,
        after,
        ceil,
        max,
        include_pad,
    } = p;
    let xs = [h, w];
    let out_size = |i: usize| -> Option<usize> {
        let span = (xs[i] + before[i] + after[i]).checked_sub(k[i])?;
        Some(
            if ceil {
                span.div_ceil(s[i])
            } else {
                span / s[i]
            } + 1,
        )
    };
    let (oh, ow) = (
        out_size(0).ok_or_else(|| im.err("the window is larger than the padded input"))?,
        out_size(1).ok_or_else(|| im.err("the window is larger than the padded input"))?,
    );
    // tcc pools pad symmetrically and floor the output size: other cases pad explicitly.
    let sym =
        before == after && (0..2).all(|i| (xs[i] + 2 * before[i] - k[i]) / s[i] + 1 == [oh, ow][i]);
    let mut xe = xe;
    let mut pad = before;
    let mut denom = None;
    if !sym {
        // Pad by hand: the window's extra rows/cols on the right for ceil mode.
        let extra: Vec<usize> = (0..2)
            .map(|i| {
                ((([oh, ow][i] - 1) * s[i] + k[i]).saturating_sub(xs[i] + before[i])).max(after[i])
            })
            .collect();
        let x4 = im.tmp(&format!("{out}_x"), xe);
        let fill = if max { f64::NEG_INFINITY } else { 0.0 };
        let (e, _) = pad_expr(
            im,
            &x4,
            d,
            &[n, c, xs[0], xs[1]],
            &[0, 0, before[0], before[1]],
            &[0, 0, extra[0], extra[1]],
            "constant",
            fill,
        )?;
        xe = e;
        pad = [0, 0];
        if !max && (!include_pad || extra[0] != after[0] || extra[1] != after[1]) {
            // Counts of the real (or explicitly padded) elements in each window.
            let ones = format!("ones([1, 1, {}, {}], {d})", xs[0], xs[1]);
            let o4 = im.tmp(&format!("{out}_ones"), ones);
            let (oe, _) = if include_pad {
                pad_expr(
                    im,
                    &o4,
                    d,
                    &[1, 1, xs[0], xs[1]],
                    &[0, 0, before[0], before[1]],
                    &[0, 0, after[0], after[1]],
                    "constant",
                    1.0,
                )
                .and_then(|(e, dd)| {
                    let e2 = im.tmp("pad", e);
                    pad_expr(
                        im,
                        &e2,
                        d,
                        &dd,
                        &[0, 0, 0, 0],
                        &[0, 0, extra[0] - after[0], extra[1] - after[1]],
                        "constant",
                        0.0,
                    )
                })?
            } else {
                pad_expr(
                    im,
                    &o4,
                    d,
                    &[1, 1, xs[0], xs[1]],
                    &[0, 0, before[0], before[1]],
                    &[0, 0, extra[0], extra[1]],
                    "constant",
                    0.0,
                )?
            };
            denom = Some(oe);
        }
    } else if !max && !include_pad && (pad[0] > 0 || pad[1] > 0) {
        denom = Some(format!("ones([1, 1, {}, {}], {d})", xs[0], xs[1]));
    }
    let f = if max { "max_pool2d" } else { "avg_pool2d" };
    let args = format!(
        "{}, stride: {}, padding: {}",
        list(&k),
        list(&s),
        list(&pad)
    );
    let mut e = format!("{f}({xe}, {args})");
    if let Some(dn) = denom {
        e = format!("{e} / {f}({dn}, {args})");
    }
    Ok((e, [n, c, oh, ow]))
}

fn pool(im: &mut Importer, node: &NodeProto, ins: &[Option<Val>], out: &str) -> R<()> {
    let at = Attrs(node);
    let op = node.op_type.as_str();
    if node.output.iter().skip(1).any(|o| !o.is_empty()) {
        return Err(im.unsupported("the indices output"));
    }
    let xv = ins
        .first()
        .cloned()
        .flatten()
        .ok_or_else(|| im.err("no input"))?;
    let (x, d, xdims) = im.rt(&xv, &node.input[0])?;
    let sp = xdims.len().saturating_sub(2);
    if !(1..=3).contains(&sp) {
        return Err(im.unsupported(format!(
            "{sp} spatial dimensions (tcc has 1-D, 2-D and 3-D pooling)"
        )));
    }
    let mut kernel: Vec<usize> = at
        .ints("kernel_shape")
        .ok_or_else(|| im.err("no kernel_shape"))?
        .iter()
        .map(|&k| k.clamp(1, MAX_ATTR) as usize)
        .collect();
    if kernel.len() != sp {
        return Err(im.err("kernel_shape does not match the input's rank"));
    }
    let win = window(im, &at, &xdims[2..], kernel.clone())?;
    let max = op == "MaxPool";
    let ceil = at.i("ceil_mode", 0) != 0;
    let include_pad = at.i("count_include_pad", 0) != 0;
    let (mut x, mut xdims) = (x, xdims);
    let (mut strides, mut before, mut after) = (win.strides, win.before, win.after);
    // Dilated max pooling, one axis at a time: padded by hand, sampled at the gcd of stride
    // and dilation (after which a dilation of 1 is a plain window), else a max of taps.
    for a in 0..sp {
        let dl = win.dilations[a];
        if dl == 1 {
            continue;
        }
        if !max {
            return Err(im.unsupported("dilations other than 1"));
        }
        if ceil {
            return Err(im.unsupported("dilations with ceil_mode"));
        }
        let ax = a + 2;
        if before[a] > 0 || after[a] > 0 {
            let (mut b, mut f) = (vec![0; xdims.len()], vec![0; xdims.len()]);
            (b[ax], f[ax]) = (before[a], after[a]);
            let xn = im.tmp(&format!("{out}_x"), x);
            (x, xdims) = pad_expr(im, &xn, d, &xdims, &b, &f, "constant", f64::NEG_INFINITY)?;
            (before[a], after[a]) = (0, 0);
        }
        let lp = xdims[ax];
        let outn = lp
            .checked_sub((kernel[a] - 1) * dl + 1)
            .ok_or_else(|| im.err("the window is larger than the padded input"))?
            / strides[a]
            + 1;
        let gg = crate::kernel::gcd(strides[a] as u64, dl as u64) as usize;
        let (s2, d2) = (strides[a] / gg, dl / gg);
        if gg > 1 {
            let xn = im.tmp(&format!("{out}_x"), x);
            let (e, nd) = strided_expr(im, &xn, d, &xdims, ax, 0, gg, lp.div_ceil(gg))?;
            (x, xdims) = (e, nd);
        }
        if d2 == 1 {
            strides[a] = s2;
            continue;
        }
        if kernel[a] > 64 {
            return Err(im.unsupported(format!(
                "a dilation of {dl} with a stride of {} and a window of {} (more than 64 taps)",
                strides[a], kernel[a]
            )));
        }
        let xn = im.tmp(&format!("{out}_x"), x);
        let mut acc = String::new();
        for k in 0..kernel[a] {
            let (e, _) = strided_expr(im, &xn, d, &xdims, ax, k * d2, s2, outn)?;
            let t = im.tmp(&format!("{out}_tap"), e);
            acc = if k == 0 {
                t
            } else {
                im.tmp(&format!("{out}_max"), format!("maximum({acc}, {t})"))
            };
        }
        x = acc;
        xdims[ax] = outn;
        (kernel[a], strides[a]) = (1, 1);
    }
    let (n, c) = (xdims[0], xdims[1]);
    if sp == 1 {
        // 1-D: a 2-D pooling over [N, C, 1, L].
        kernel.insert(0, 1);
        strides.insert(0, 1);
        before.insert(0, 0);
        after.insert(0, 0);
    }
    let p = |i: usize, j: usize| Pool2d {
        kernel: [kernel[i], kernel[j]],
        strides: [strides[i], strides[j]],
        before: [before[i], before[j]],
        after: [after[i], after[j]],
        ceil,
        max,
        include_pad,
    };
    let (e, dims) = match sp {
        1 => {
            let (e, od) = pool2d_expr(
                im,
                out,
                format!("unsqueeze({x}, axis: 2)"),
                d,
                [n, c, 1, xdims[2]],
                p(0, 1),
            )?;
            (format!("squeeze({e}, axis: 2)"), vec![n, c, od[3]])
        }
        2 => {
            let (e, od) = pool2d_expr(im, out, x, d, [n, c, xdims[2], xdims[3]], p(0, 1))?;
            (e, od.to_vec())
        }
        _ => {
            // Separable: over (H, W) for each depth, then over the depths.
            let dep = xdims[2];
            let (e, od) = pool2d_expr(
                im,
                out,
                format!("reshape({x}, {})", list(&[n, c * dep, xdims[3], xdims[4]])),
                d,
                [n, c * dep, xdims[3], xdims[4]],
                p(1, 2),
            )?;
            let t = im.tmp(
                &format!("{out}_hw"),
                format!("reshape({e}, {})", list(&[n, c, dep, od[2] * od[3]])),
            );
            let depth = Pool2d {
                kernel: [kernel[0], 1],
                strides: [strides[0], 1],
                before: [before[0], 0],
                after: [after[0], 0],
                ceil,
                max,
                include_pad,
            };
            let (e2, od2) = pool2d_expr(im, out, t, d, [n, c, dep, od[2] * od[3]], depth)?;
            (
                format!("reshape({e2}, {})", list(&[n, c, od2[2], od[2], od[3]])),
                vec![n, c, od2[2], od[2], od[3]],
            )
        }
    };
    im.bind(out, e, d, dims);
    Ok(())
}

/// The sequence ops tcc folds at import: a sequence is a list of values whose length and
/// positions are known when the model is imported.
const SEQUENCE_OPS: &[&str] = &[
    "SequenceEmpty",
    "SequenceConstruct",
    "SequenceInsert",
    "SequenceErase",
    "SequenceAt",
    "SequenceLength",
    "ConcatFromSequence",
    "SplitToSequence",
];

fn sequence_op(im: &mut Importer, node: &NodeProto) -> R<()> {
    let at = Attrs(node);
    let out = node
        .output
        .first()
        .filter(|o| !o.is_empty())
        .cloned()
        .ok_or_else(|| im.err("the node has no output"))?;
    let name_of =
        |i: usize| -> Option<String> { node.input.get(i).filter(|n| !n.is_empty()).cloned() };
    let seq_in = |im: &Importer, i: usize| -> R<Vec<Val>> {
        let name = name_of(i).ok_or_else(|| im.err(format!("input {i} is missing")))?;
        im.seqs
            .get(&name)
            .cloned()
            .ok_or_else(|| im.err(format!("input `{name}` is not a sequence")))
    };
    let val_in = |im: &Importer, i: usize| -> R<Option<Val>> {
        match name_of(i) {
            None => Ok(None),
            Some(name) => {
                im.vals
                    .get(&name)
                    .cloned()
                    .map(Some)
                    .ok_or_else(|| ImportError::Missing {
                        op: node.op_type.clone(),
                        node: im.node.clone(),
                        value: name,
                    })
            }
        }
    };
    // A position: one constant integer in [-len, len) (or [-len, len] to insert).
    let pos = |im: &Importer, v: Option<Val>, len: usize, insert: bool| -> R<Option<usize>> {
        let Some(p) = const_ints(im, v.as_ref(), "position")? else {
            return Ok(None);
        };
        let [p] = p.as_slice() else {
            return Err(im.err("a position must be one integer"));
        };
        let n = len as i64;
        let hi = if insert { n } else { n - 1 };
        if *p < -n || *p > hi {
            return Err(im.err(format!(
                "position {p} is outside a sequence of {len} element(s)"
            )));
        }
        Ok(Some(if *p < 0 { p + n } else { *p } as usize))
    };
    match node.op_type.as_str() {
        "SequenceEmpty" => {
            im.seqs.insert(out, Vec::new());
        }
        "SequenceConstruct" => {
            let mut s = Vec::new();
            for i in 0..node.input.len() {
                s.push(val_in(im, i)?.ok_or_else(|| im.err(format!("input {i} is missing")))?);
            }
            im.seqs.insert(out, s);
        }
        "SequenceInsert" => {
            let mut s = seq_in(im, 0)?;
            let t = val_in(im, 1)?.ok_or_else(|| im.err("no tensor to insert"))?;
            let p = pos(im, val_in(im, 2)?, s.len(), true)?.unwrap_or(s.len());
            s.insert(p, t);
            im.seqs.insert(out, s);
        }
        "SequenceErase" => {
            let mut s = seq_in(im, 0)?;
            if s.is_empty() {
                return Err(im.err("erasing from an empty sequence"));
            }
            let p = pos(im, val_in(im, 1)?, s.len(), false)?.unwrap_or(s.len() - 1);
            s.remove(p);
            im.seqs.insert(out, s);
        }
        "SequenceAt" => {
            let s = seq_in(im, 0)?;
            let p =
                pos(im, val_in(im, 1)?, s.len(), false)?.ok_or_else(|| im.err("no position"))?;
            im.set(&out, s[p].clone());
        }
        "SequenceLength" => {
            let n = seq_in(im, 0)?.len() as i64;
            im.vals.insert(
                out,
                Val::c(HostTensor {
                    dims: Vec::new(),
                    data: CData::I(vec![n]),
                    onnx_type: dt::INT64,
                }),
            );
        }
        "ConcatFromSequence" => {
            let s = seq_in(im, 0)?;
            let Some(first) = s.first() else {
                return Err(im.err("concatenating an empty sequence"));
            };
            let new_axis = at.i("new_axis", 0) != 0;
            let rank = first.dims().len() + usize::from(new_axis);
            let axis = at
                .get("axis")
                .map(|a| a.i)
                .ok_or_else(|| im.err("no axis"))?;
            let axis = norm_axis(axis, rank)
                .ok_or_else(|| im.err(format!("axis {axis} for rank {rank}")))?;
            let mut parts = Vec::new();
            let mut dims: Option<Vec<usize>> = None;
            let mut dtype = None;
            for (i, v) in s.iter().enumerate() {
                let (e, d, mut vd) = im.rt(v, &format!("{out}_{i}"))?;
                let e = if new_axis {
                    vd.insert(axis, 1);
                    format!("unsqueeze({e}, axis: {axis})")
                } else {
                    e
                };
                match (&mut dims, dtype) {
                    (None, _) => {
                        dims = Some(vd);
                        dtype = Some(d);
                    }
                    (Some(acc), Some(d0)) => {
                        let fits = d == d0
                            && acc.len() == vd.len()
                            && (0..vd.len()).all(|a| a == axis || acc[a] == vd[a]);
                        if !fits {
                            return Err(im.err(format!(
                                "element {i} ({d}{vd:?}) does not concatenate with {d0}{acc:?} on axis {axis}"
                            )));
                        }
                        acc[axis] += vd[axis];
                    }
                    _ => {}
                }
                parts.push(e);
            }
            let (Some(dims), Some(d)) = (dims, dtype) else {
                return Err(im.err("concatenating an empty sequence"));
            };
            let e = if parts.len() == 1 {
                parts.remove(0)
            } else {
                format!("concat([{}], axis: {axis})", parts.join(", "))
            };
            im.bind(&out, e, d, dims);
        }
        "SplitToSequence" => {
            let x = val_in(im, 0)?.ok_or_else(|| im.err("no input"))?;
            let dims = x.dims().to_vec();
            let axis = at.i("axis", 0);
            let axis = norm_axis(axis, dims.len())
                .ok_or_else(|| im.err(format!("axis {axis} for rank {}", dims.len())))?;
            let len = dims[axis];
            let split = val_in(im, 1)?;
            let keep = at.i("keepdims", 1) != 0 || split.is_some();
            let sizes: Vec<usize> = match const_ints(im, split.as_ref(), "split")? {
                None => vec![1; len],
                Some(v) if split.as_ref().is_some_and(|s| s.dims().is_empty()) => {
                    let k = v.first().copied().unwrap_or(0);
                    if k <= 0 {
                        return Err(im.err(format!("a split of {k}")));
                    }
                    let k = k as usize;
                    (0..len.div_ceil(k)).map(|i| k.min(len - i * k)).collect()
                }
                Some(v) => {
                    if v.iter().any(|&k| k < 0) || v.iter().sum::<i64>() != len as i64 {
                        return Err(im.err(format!(
                            "split sizes {v:?} do not add up to the axis' {len}"
                        )));
                    }
                    v.iter().map(|&k| k as usize).collect()
                }
            };
            let mut s = Vec::new();
            let mut start = 0;
            for (i, &k) in sizes.iter().enumerate() {
                let mut ranges: Vec<(usize, usize)> = dims.iter().map(|&d| (0, d)).collect();
                ranges[axis] = (start, start + k);
                start += k;
                let key = format!("{out}\u{1}{i}");
                slice_to(im, &key, &x, &node.input[0], &ranges)?;
                if !keep {
                    let v = im
                        .vals
                        .get(&key)
                        .cloned()
                        .ok_or_else(|| im.err("lost a piece"))?;
                    let mut nd = v.dims().to_vec();
                    nd.remove(axis);
                    reshape_to(im, &key, v, &format!("{out}_{i}"), nd)?;
                }
                s.push(im.vals.remove(&key).ok_or_else(|| im.err("lost a piece"))?);
            }
            im.seqs.insert(out, s);
        }
        other => return Err(im.unsupported(format!("`{other}` on sequences"))),
    }
    Ok(())
}

/// `ai.onnx.preview.training.Gradient`: the gradients of a scalar `y` with respect to the
/// runtime tensors `xs`, as TDSL `grad(y, x)` (one backward pass for all of them).
fn gradient(im: &mut Importer, node: &NodeProto) -> R<()> {
    let at = Attrs(node);
    if at.get("zs").is_some_and(|a| !a.strings.is_empty()) {
        return Err(im.unsupported("the `zs` attribute"));
    }
    let y = at.s("y").ok_or_else(|| im.err("no `y` attribute"))?;
    let xs: Vec<String> = at
        .get("xs")
        .map(|a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default();
    if xs.len() != node.output.len() {
        return Err(im.err(format!(
            "{} names in `xs` for {} outputs",
            xs.len(),
            node.output.len()
        )));
    }
    let yv = im
        .vals
        .get(&y)
        .cloned()
        .ok_or_else(|| ImportError::Missing {
            op: node.op_type.clone(),
            node: im.node.clone(),
            value: y.clone(),
        })?;
    let Val::Rt {
        name: yn, dims: yd, ..
    } = yv
    else {
        return Err(im.unsupported(format!("`{y}` is a constant: its gradient is zero")));
    };
    if !yd.is_empty() {
        return Err(im.unsupported(format!("`y` is {yd:?}; tcc takes gradients of scalars")));
    }
    for (x, out) in xs.iter().zip(&node.output) {
        let xv = im
            .vals
            .get(x)
            .cloned()
            .ok_or_else(|| ImportError::Missing {
                op: node.op_type.clone(),
                node: im.node.clone(),
                value: x.clone(),
            })?;
        let Val::Rt { name, dtype, dims } = xv else {
            return Err(im.unsupported(format!("a gradient with respect to the constant `{x}`")));
        };
        if !dtype.is_float() {
            return Err(im.unsupported(format!("a gradient with respect to {dtype} `{x}`")));
        }
        if !out.is_empty() {
            im.bind(out, format!("grad({yn}, {name})"), dtype, dims);
        }
    }
    Ok(())
}
