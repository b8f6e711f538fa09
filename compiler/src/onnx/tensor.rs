//! `TensorProto` → host data: the element type and values of an initializer, a `Constant`
//! node's value or a test-data `.pb` file, checked against its dims.

use super::proto::{data_type as dt, TensorProto};
use super::ImportError;
use crate::eager::io::TensorBytes;
use crate::eager::Tensor;
use crate::ir::DType;
use prost::Message;

/// The most elements a tensor read from a model may have (2^34: past tcc's 1 TiB tensor
/// limit for every dtype), so a corrupt dims list cannot ask for absurd allocations.
const MAX_ELEMENTS: usize = 1 << 34;

/// Values of a host tensor, as the folding code holds them.
#[derive(Clone, Debug, PartialEq)]
pub enum CData {
    /// Floats with the dtype they are stored in (f32, f16 or bf16; f64 values of a `double`
    /// tensor are kept only for folding shape arithmetic and are an error at run time).
    F(Floats, FloatKind),
    /// Integers of any ONNX integer type.
    I(Vec<i64>),
    B(Vec<bool>),
}

/// Which float type a float constant came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatKind {
    F32,
    F16,
    BF16,
    F64,
}

impl FloatKind {
    pub fn dtype(self) -> Option<DType> {
        match self {
            FloatKind::F32 => Some(DType::F32),
            FloatKind::F16 => Some(DType::F16),
            FloatKind::BF16 => Some(DType::BF16),
            FloatKind::F64 => None,
        }
    }
}

/// Float values, held in the narrowest type that keeps them exactly: f32 for f32, f16 and
/// bf16 tensors (4 bytes a weight while importing, not 8), f64 only for float64 ones.
#[derive(Clone, Debug, PartialEq)]
pub enum Floats {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Floats {
    /// `values` rounded to `kind` (to f16 or bf16, then held as f32).
    pub fn of(kind: FloatKind, values: impl Iterator<Item = f64>) -> Floats {
        match kind {
            FloatKind::F64 => Floats::F64(values.collect()),
            FloatKind::F32 => Floats::F32(values.map(|x| x as f32).collect()),
            FloatKind::F16 => {
                Floats::F32(values.map(|x| half::f16::from_f64(x).to_f32()).collect())
            }
            FloatKind::BF16 => {
                Floats::F32(values.map(|x| half::bf16::from_f64(x).to_f32()).collect())
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Floats::F32(v) => v.len(),
            Floats::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value at `i` (below `len()`).
    pub fn get(&self, i: usize) -> f64 {
        match self {
            Floats::F32(v) => f64::from(v[i]),
            Floats::F64(v) => v[i],
        }
    }

    /// The values at positions `idx` (each below `len()`), held as they are.
    pub fn pick(&self, idx: &[usize]) -> Floats {
        match self {
            Floats::F32(v) => Floats::F32(idx.iter().map(|&i| v[i]).collect()),
            Floats::F64(v) => Floats::F64(idx.iter().map(|&i| v[i]).collect()),
        }
    }

    pub fn first(&self) -> Option<f64> {
        (!self.is_empty()).then(|| self.get(0))
    }

    pub fn iter(&self) -> Box<dyn Iterator<Item = f64> + '_> {
        match self {
            Floats::F32(v) => Box::new(v.iter().map(|&x| f64::from(x))),
            Floats::F64(v) => Box::new(v.iter().copied()),
        }
    }

    /// `self` followed by `other` (held as f64 if either is).
    pub fn extend(self, other: Floats) -> Floats {
        match (self, other) {
            (Floats::F32(mut a), Floats::F32(b)) => {
                a.extend(b);
                Floats::F32(a)
            }
            (a, b) => Floats::F64(a.iter().chain(b.iter()).collect()),
        }
    }
}

impl CData {
    pub fn len(&self) -> usize {
        match self {
            CData::F(v, _) => v.len(),
            CData::I(v) => v.len(),
            CData::B(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements at flat positions `idx` (each below `len()`; callers compute them from
    /// the tensor's own dims).
    pub fn pick(&self, idx: &[usize]) -> CData {
        match self {
            CData::F(v, k) => CData::F(v.pick(idx), *k),
            CData::I(v) => CData::I(idx.iter().map(|&i| v[i]).collect()),
            CData::B(v) => CData::B(idx.iter().map(|&i| v[i]).collect()),
        }
    }

    /// Every value as f64 (a copy: for shape arithmetic and small constants; large ones
    /// are read with [`CData::iter_f64`]).
    pub fn as_f64(&self) -> Vec<f64> {
        self.iter_f64().collect()
    }

    pub fn iter_f64(&self) -> Box<dyn Iterator<Item = f64> + '_> {
        match self {
            CData::F(v, _) => v.iter(),
            CData::I(v) => Box::new(v.iter().map(|&x| x as f64)),
            CData::B(v) => Box::new(v.iter().map(|&b| f64::from(u8::from(b)))),
        }
    }

    /// The first value as f64.
    pub fn first_f64(&self) -> Option<f64> {
        self.iter_f64().next()
    }
}

/// A host tensor: dims and values.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dims: Vec<usize>,
    pub data: CData,
    /// The ONNX data type it was read from.
    pub onnx_type: i32,
}

impl HostTensor {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

fn err(name: &str, msg: impl Into<String>) -> ImportError {
    ImportError::Tensor {
        name: name.to_string(),
        msg: msg.into(),
    }
}

fn chunks<const N: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    raw.chunks_exact(N).map(|c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        a
    })
}

/// Reads a `TensorProto`'s dims and values.
pub fn host_tensor(t: &TensorProto) -> Result<HostTensor, ImportError> {
    let name = if t.name.is_empty() {
        "<unnamed>"
    } else {
        t.name.as_str()
    };
    if t.data_location == 1 || !t.external_data.is_empty() {
        return Err(err(
            name,
            "its data is stored in an external file, which tcc does not read (save the model with its weights inside)",
        ));
    }
    let mut dims = Vec::with_capacity(t.dims.len());
    let mut n: usize = 1;
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| err(name, format!("negative dimension {d}")))?;
        n = n
            .checked_mul(d)
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(|| err(name, format!("dims {:?} hold too many elements", t.dims)))?;
        dims.push(d);
    }
    let raw = &t.raw_data;
    let size = |bytes: usize| -> Result<(), ImportError> {
        if raw.len() != n * bytes {
            return Err(err(
                name,
                format!(
                    "raw data holds {} bytes, dims {:?} of {} need {}",
                    raw.len(),
                    dims,
                    dt::name(t.data_type),
                    n * bytes
                ),
            ));
        }
        Ok(())
    };
    let use_raw = !raw.is_empty() || n == 0;
    let data = match t.data_type {
        dt::FLOAT => {
            if use_raw {
                size(4)?;
                CData::F(
                    Floats::F32(chunks::<4>(raw).map(f32::from_le_bytes).collect()),
                    FloatKind::F32,
                )
            } else {
                CData::F(Floats::F32(t.float_data.clone()), FloatKind::F32)
            }
        }
        dt::DOUBLE => {
            if use_raw {
                size(8)?;
                CData::F(
                    Floats::F64(chunks::<8>(raw).map(f64::from_le_bytes).collect()),
                    FloatKind::F64,
                )
            } else {
                CData::F(Floats::F64(t.double_data.clone()), FloatKind::F64)
            }
        }
        dt::FLOAT16 | dt::BFLOAT16 => {
            let kind = if t.data_type == dt::FLOAT16 {
                FloatKind::F16
            } else {
                FloatKind::BF16
            };
            let conv = |b: [u8; 2]| {
                if kind == FloatKind::F16 {
                    half::f16::from_le_bytes(b).to_f32()
                } else {
                    half::bf16::from_le_bytes(b).to_f32()
                }
            };
            if use_raw {
                size(2)?;
                CData::F(Floats::F32(chunks::<2>(raw).map(conv).collect()), kind)
            } else {
                // Stored as their 16 bits in `int32_data`.
                CData::F(
                    Floats::F32(
                        t.int32_data
                            .iter()
                            .map(|&x| conv((x as u16).to_le_bytes()))
                            .collect(),
                    ),
                    kind,
                )
            }
        }
        dt::INT64 => {
            if use_raw {
                size(8)?;
                CData::I(chunks::<8>(raw).map(i64::from_le_bytes).collect())
            } else {
                CData::I(t.int64_data.clone())
            }
        }
        dt::INT32 | dt::INT16 | dt::INT8 | dt::UINT8 | dt::UINT16 => {
            if use_raw {
                let w = match t.data_type {
                    dt::INT32 => 4,
                    dt::INT16 | dt::UINT16 => 2,
                    _ => 1,
                };
                size(w)?;
                CData::I(match t.data_type {
                    dt::INT32 => chunks::<4>(raw)
                        .map(|c| i64::from(i32::from_le_bytes(c)))
                        .collect(),
                    dt::INT16 => chunks::<2>(raw)
                        .map(|c| i64::from(i16::from_le_bytes(c)))
                        .collect(),
                    dt::UINT16 => chunks::<2>(raw)
                        .map(|c| i64::from(u16::from_le_bytes(c)))
                        .collect(),
                    dt::INT8 => raw.iter().map(|&b| i64::from(b as i8)).collect(),
                    _ => raw.iter().map(|&b| i64::from(b)).collect(),
                })
            } else {
                CData::I(t.int32_data.iter().map(|&x| i64::from(x)).collect())
            }
        }
        dt::UINT32 | dt::UINT64 => {
            if use_raw {
                if t.data_type == dt::UINT32 {
                    size(4)?;
                    CData::I(
                        chunks::<4>(raw)
                            .map(|c| i64::from(u32::from_le_bytes(c)))
                            .collect(),
                    )
                } else {
                    size(8)?;
                    CData::I(
                        chunks::<8>(raw)
                            .map(|c| i64::try_from(u64::from_le_bytes(c)).unwrap_or(i64::MAX))
                            .collect(),
                    )
                }
            } else {
                CData::I(
                    t.uint64_data
                        .iter()
                        .map(|&x| i64::try_from(x).unwrap_or(i64::MAX))
                        .collect(),
                )
            }
        }
        dt::BOOL => {
            if use_raw {
                size(1)?;
                CData::B(raw.iter().map(|&b| b != 0).collect())
            } else {
                CData::B(t.int32_data.iter().map(|&b| b != 0).collect())
            }
        }
        other => {
            return Err(ImportError::DType {
                name: name.to_string(),
                at: String::new(),
                dtype: dt::name(other),
            })
        }
    };
    if data.len() != n {
        return Err(err(
            name,
            format!("holds {} values, dims {:?} need {n}", data.len(), dims),
        ));
    }
    Ok(HostTensor {
        dims,
        data,
        onnx_type: t.data_type,
    })
}

/// The tcc dtype a host tensor is held in at run time (int64 and the small integer types
/// become i32, which must hold every value), or the error.
pub fn runtime_dtype(name: &str, t: &HostTensor) -> Result<DType, ImportError> {
    let bad = || ImportError::DType {
        name: name.to_string(),
        at: String::new(),
        dtype: dt::name(t.onnx_type),
    };
    match &t.data {
        CData::F(_, k) => k.dtype().ok_or_else(bad),
        CData::I(v) => {
            if v.iter().all(|&x| i32::try_from(x).is_ok()) {
                Ok(DType::I32)
            } else {
                Err(err(
                    name,
                    format!(
                        "{} values outside the i32 range, which tcc cannot hold",
                        dt::name(t.onnx_type)
                    ),
                ))
            }
        }
        CData::B(_) => Ok(DType::Bool),
    }
}

/// A host tensor as an interpreter tensor of its runtime dtype.
pub fn to_tensor(name: &str, t: &HostTensor) -> Result<Tensor, ImportError> {
    Ok(to_tensor_as(t, runtime_dtype(name, t)?))
}

/// A host tensor as an interpreter tensor of `dtype` (its values converted).
pub fn to_tensor_as(t: &HostTensor, dtype: DType) -> Tensor {
    let shape = crate::ir::Shape(t.dims.clone());
    match &t.data {
        CData::F(v, _) => Tensor::from_f64(dtype, shape, v.iter().collect()),
        CData::I(v) => Tensor::from_i32(shape, v.iter().map(|&x| x as i32).collect()),
        CData::B(v) => Tensor {
            ty: crate::ir::TensorType::new(DType::Bool, shape),
            data: crate::eager::tensor::Data::B(v.clone()),
        },
    }
}

/// A host tensor's values as `dtype` stores them (little-endian, floats rounded to it): a
/// param's bytes, made without an f64 copy of the weights.
pub fn to_bytes_as(name: &str, t: &HostTensor, dtype: DType) -> Result<TensorBytes, ImportError> {
    let n = t.data.len();
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(n.saturating_mul(dtype.size_bytes()))
        .map_err(|_| err(name, format!("{n} values do not fit in memory")))?;
    match &t.data {
        CData::F(Floats::F32(v), _) if dtype == DType::F32 => {
            bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()))
        }
        data => data
            .iter_f64()
            .for_each(|x| crate::eager::io::push_le(dtype, x, &mut bytes)),
    }
    Ok(TensorBytes {
        ty: crate::ir::TensorType::new(dtype, crate::ir::Shape(t.dims.clone())),
        bytes,
    })
}

/// Reads a serialized `TensorProto` (the backend test cases' `input_*.pb`/`output_*.pb`):
/// its name and its value as a tcc tensor.
pub fn read_tensor_file(bytes: &[u8]) -> Result<(String, Tensor), ImportError> {
    read_tensor_file_as(bytes, false)
}

/// [`read_tensor_file`], reading a float64 tensor as f32 where `f64_as_f32` (the data of a
/// model imported with [`super::ImportOptions::f64_as_f32`]).
pub fn read_tensor_file_as(
    bytes: &[u8],
    f64_as_f32: bool,
) -> Result<(String, Tensor), ImportError> {
    let t = TensorProto::decode(bytes).map_err(|e| ImportError::Decode(e.to_string()))?;
    let h = host_tensor(&t)?;
    let name = if t.name.is_empty() {
        "<unnamed>".to_string()
    } else {
        t.name.clone()
    };
    if f64_as_f32 && matches!(h.data, CData::F(_, FloatKind::F64)) {
        return Ok((t.name.clone(), to_tensor_as(&h, DType::F32)));
    }
    Ok((t.name.clone(), to_tensor(&name, &h)?))
}
