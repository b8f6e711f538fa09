//! Reading tensors from `.npy` files and params from `.safetensors` files.

use super::tensor::{Data, Tensor};
use crate::ir::{DType, TensorType};
use std::path::Path;

/// Errors reading tensor files.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a valid .npy file: {why}")]
    Npy { path: String, why: String },
    #[error("{path}: not a valid .safetensors file: {why}")]
    Safetensors { path: String, why: String },
    #[error("{path}: `{name}` is {found}, but the model declares {expected}")]
    Mismatch {
        path: String,
        name: String,
        expected: TensorType,
        found: String,
    },
}

/// Reads a `.npy` array (f32, f64, i32, i64, bool; C order) as `expected`
/// (values converted to its dtype; the shape must match).
pub fn read_npy(path: &Path, name: &str, expected: &TensorType) -> Result<Tensor, IoError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| IoError::Read {
        path: p.clone(),
        source,
    })?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| IoError::Npy {
        path: p.clone(),
        why: e.to_string(),
    })?;
    if npy.order() == npyz::Order::Fortran {
        return Err(IoError::Npy {
            path: p,
            why: "Fortran-ordered arrays are not supported; save it C-ordered".into(),
        });
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let descr = match npy.dtype() {
        npyz::DType::Plain(ts) => ts.to_string(),
        other => {
            return Err(IoError::Npy {
                path: p,
                why: format!("unsupported dtype {other:?}"),
            })
        }
    };
    let bad = |e: std::io::Error| IoError::Npy {
        path: p.clone(),
        why: e.to_string(),
    };
    let values: Vec<f64> = match &descr[1..] {
        "f4" => npy
            .into_vec::<f32>()
            .map_err(bad)?
            .into_iter()
            .map(f64::from)
            .collect(),
        "f8" => npy.into_vec::<f64>().map_err(bad)?,
        "i4" => npy
            .into_vec::<i32>()
            .map_err(bad)?
            .into_iter()
            .map(f64::from)
            .collect(),
        "i8" => npy
            .into_vec::<i64>()
            .map_err(bad)?
            .into_iter()
            .map(|v| v as f64)
            .collect(),
        "b1" => npy
            .into_vec::<bool>()
            .map_err(bad)?
            .into_iter()
            .map(|b| if b { 1.0 } else { 0.0 })
            .collect(),
        other => {
            return Err(IoError::Npy {
                path: p,
                why: format!("unsupported dtype `{other}` (expected f4, f8, i4, i8 or b1)"),
            })
        }
    };
    if shape != expected.dims() {
        return Err(IoError::Mismatch {
            path: p,
            name: name.to_string(),
            expected: expected.clone(),
            found: format!("shape {shape:?}"),
        });
    }
    Ok(Tensor::from_f64(
        expected.dtype,
        expected.shape.clone(),
        values,
    ))
}

/// Reads every tensor of a `.safetensors` file whose name is in `wanted`, checking its dtype
/// and shape. Names in the file that the model does not declare are ignored; wanted names
/// missing from the file are simply not returned.
pub fn read_safetensors(
    path: &Path,
    wanted: &[(String, TensorType)],
) -> Result<Vec<(String, Tensor)>, IoError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| IoError::Read {
        path: p.clone(),
        source,
    })?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| IoError::Safetensors {
        path: p.clone(),
        why: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (name, ty) in wanted {
        let Ok(view) = st.tensor(name) else { continue };
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::I32 => DType::I32,
            safetensors::Dtype::BOOL => DType::Bool,
            other => {
                return Err(IoError::Mismatch {
                    path: p,
                    name: name.clone(),
                    expected: ty.clone(),
                    found: format!("{other:?}"),
                })
            }
        };
        if dtype != ty.dtype || view.shape() != ty.dims() {
            return Err(IoError::Mismatch {
                path: p,
                name: name.clone(),
                expected: ty.clone(),
                found: format!("{}{:?}", dtype, view.shape()),
            });
        }
        let d = view.data();
        let data = match dtype {
            DType::F32 => Data::F(
                d.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                    .collect(),
            ),
            DType::F16 => Data::F(
                d.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
                    .collect(),
            ),
            DType::BF16 => Data::F(
                d.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
                    .collect(),
            ),
            DType::I32 => Data::I(
                d.chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::Bool => Data::B(d.iter().map(|&b| b != 0).collect()),
        };
        out.push((
            name.clone(),
            Tensor {
                ty: ty.clone(),
                data,
            },
        ));
    }
    Ok(out)
}

/// Serialises tensors to `.safetensors` bytes (names sorted).
pub fn write_safetensors(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let dt = match (&t.data, t.ty.dtype) {
            (Data::F(_), DType::F32) => safetensors::Dtype::F32,
            (Data::F(_), DType::F16) => safetensors::Dtype::F16,
            (Data::F(_), DType::BF16) => safetensors::Dtype::BF16,
            (Data::I(_), _) => safetensors::Dtype::I32,
            (Data::B(_), _) => safetensors::Dtype::BOOL,
            _ => return Err(format!("`{name}` has data that does not match its dtype")),
        };
        let bytes = t.to_le_bytes();
        owned.push((name.clone(), dt, t.dims().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, dt, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// Serialises a tensor as a `.npy` file (C order): f32, f16 and bf16 as `<f4`, i32 as `<i4`,
/// bool as `|b1`.
pub fn write_npy(t: &Tensor) -> Result<Vec<u8>, String> {
    let shape: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
    match &t.data {
        Data::F(v) => npy_bytes(&shape, v.iter().map(|&x| x as f32)),
        Data::I(v) => npy_bytes(&shape, v.iter().copied()),
        Data::B(v) => npy_bytes(&shape, v.iter().copied()),
    }
}

/// The `.npy` bytes of `values` in C order, with the element type's default dtype.
fn npy_bytes<T: npyz::AutoSerialize>(
    shape: &[u64],
    values: impl Iterator<Item = T>,
) -> Result<Vec<u8>, String> {
    use npyz::WriterBuilder;
    let e = |e: std::io::Error| e.to_string();
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .map_err(e)?;
    w.extend(values).map_err(e)?;
    w.finish().map_err(e)?;
    Ok(buf)
}
