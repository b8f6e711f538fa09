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

/// The longest `.npy` header tcc reads (numpy writes a few hundred bytes).
const MAX_NPY_HEADER: u64 = 1 << 20;

/// A tensor as little-endian bytes of its dtype (the arena's layout): what params and inputs
/// are read into for the compiled program and the runtime, where the interpreter's
/// [`Tensor`] would hold every float as an f64 (twice an f32's bytes).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorBytes {
    pub ty: TensorType,
    pub bytes: Vec<u8>,
}

impl TensorBytes {
    /// The bytes of an interpreter's tensor.
    pub fn from_tensor(t: &Tensor) -> TensorBytes {
        TensorBytes {
            ty: t.ty.clone(),
            bytes: t.to_le_bytes(),
        }
    }

    /// The interpreter's tensor of the same values.
    pub fn to_tensor(&self) -> Option<Tensor> {
        Tensor::from_le_bytes(self.ty.clone(), &self.bytes)
    }
}

/// Appends `v` as `dtype` stores it, as [`Tensor::from_f64`] and [`Tensor::to_le_bytes`]
/// would (floats rounded to the dtype, ints truncated and saturated, bools nonzero).
pub fn push_le(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend((v as f32).to_le_bytes()),
        DType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
        DType::I32 => out.extend((v as i32).to_le_bytes()),
        DType::Bool => out.push(u8::from(v != 0.0)),
    }
}

/// Reads a `.npy` array (f32, f64, i32, i64, bool; C order) as `expected`
/// (values converted to its dtype; the shape must match).
pub fn read_npy(path: &Path, name: &str, expected: &TensorType) -> Result<Tensor, IoError> {
    let t = read_npy_bytes(path, name, expected)?;
    t.to_tensor().ok_or_else(|| IoError::Npy {
        path: path.display().to_string(),
        why: "internal error: the converted bytes do not match the model's type".into(),
    })
}

/// [`read_npy`] into the bytes of `expected`'s dtype, element by element: the header is
/// read and checked (shape, order, dtype) before any data, and only the declared
/// elements are read, so an endless or huge file (`/dev/zero`) is refused or read no
/// further than the model's tensor.
pub fn read_npy_bytes(
    path: &Path,
    name: &str,
    expected: &TensorType,
) -> Result<TensorBytes, IoError> {
    let p = path.display().to_string();
    let mut file = std::fs::File::open(path).map_err(|source| IoError::Read {
        path: p.clone(),
        source,
    })?;
    // The header's length, checked before npyz allocates it: magic (6 bytes), version (2),
    // then a u16 (version 1) or u32 length.
    let mut head = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, 12), &mut head).map_err(
        |source| IoError::Read {
            path: p.clone(),
            source,
        },
    )?;
    let header_len = match head.get(6) {
        Some(1) => head
            .get(8..10)
            .map(|b| u64::from(u16::from_le_bytes([b[0], b[1]]))),
        Some(_) => head
            .get(8..12)
            .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        None => None,
    };
    if header_len.is_some_and(|n| n > MAX_NPY_HEADER) {
        return Err(IoError::Npy {
            path: p,
            why: format!("its header is longer than {MAX_NPY_HEADER} bytes"),
        });
    }
    let reader = std::io::BufReader::new(std::io::Read::chain(std::io::Cursor::new(head), file));
    let npy = npyz::NpyFile::new(reader).map_err(|e| IoError::Npy {
        path: p.clone(),
        why: e.to_string(),
    })?;
    if npy.order() == npyz::Order::Fortran {
        return Err(IoError::Npy {
            path: p,
            why: "Fortran-ordered arrays are not supported; save it C-ordered".into(),
        });
    }
    let shape: Vec<u64> = npy.shape().to_vec();
    if shape.len() != expected.dims().len()
        || shape
            .iter()
            .zip(expected.dims())
            .any(|(&a, &b)| a != b as u64)
    {
        return Err(IoError::Mismatch {
            path: p,
            name: name.to_string(),
            expected: expected.clone(),
            found: format!("shape {shape:?}"),
        });
    }
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
    let dtype = expected.dtype;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(expected.size_bytes())
        .map_err(|_| IoError::Npy {
            path: p.clone(),
            why: format!("cannot allocate {} bytes for it", expected.size_bytes()),
        })?;
    fn each<T: npyz::Deserialize, R: std::io::Read>(
        npy: npyz::NpyFile<R>,
        mut f: impl FnMut(T),
    ) -> std::io::Result<()> {
        let data = npy
            .data::<T>()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        for v in data {
            f(v?);
        }
        Ok(())
    }
    match descr.get(1..).unwrap_or("") {
        "f4" => each(npy, |v: f32| push_le(dtype, f64::from(v), &mut bytes)),
        "f8" => each(npy, |v: f64| push_le(dtype, v, &mut bytes)),
        "i4" => each(npy, |v: i32| push_le(dtype, f64::from(v), &mut bytes)),
        "i8" => each(npy, |v: i64| push_le(dtype, v as f64, &mut bytes)),
        "b1" => each(npy, |v: bool| {
            push_le(dtype, f64::from(u8::from(v)), &mut bytes)
        }),
        other => {
            return Err(IoError::Npy {
                path: p,
                why: format!("unsupported dtype `{other}` (expected f4, f8, i4, i8 or b1)"),
            })
        }
    }
    .map_err(bad)?;
    Ok(TensorBytes {
        ty: expected.clone(),
        bytes,
    })
}

/// Reads every tensor of a `.safetensors` file whose name is in `wanted`, checking its dtype
/// and shape. Names in the file that the model does not declare are ignored; wanted names
/// missing from the file are simply not returned.
pub fn read_safetensors(
    path: &Path,
    wanted: &[(String, TensorType)],
) -> Result<Vec<(String, Tensor)>, IoError> {
    read_safetensors_bytes(path, wanted)?
        .into_iter()
        .map(|(name, t)| {
            let t = t.to_tensor().ok_or_else(|| IoError::Safetensors {
                path: path.display().to_string(),
                why: format!("`{name}` has the wrong number of bytes"),
            })?;
            Ok((name, t))
        })
        .collect()
}

/// [`read_safetensors`] as bytes of each tensor's dtype (the arena's layout), as the file
/// holds them. The file is read only as far as its header declares.
pub fn read_safetensors_bytes(
    path: &Path,
    wanted: &[(String, TensorType)],
) -> Result<Vec<(String, TensorBytes)>, IoError> {
    let p = path.display().to_string();
    let bytes = tcc_runtime::fsutil::read_declared(path, 8, tcc_runtime::fsutil::safetensors_len)
        .map_err(|source| IoError::Read {
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
        let mut data = Vec::new();
        data.try_reserve_exact(d.len())
            .map_err(|_| IoError::Safetensors {
                path: p.clone(),
                why: format!("cannot allocate {} bytes for `{name}`", d.len()),
            })?;
        if dtype == DType::Bool {
            data.extend(d.iter().map(|&b| u8::from(b != 0)));
        } else {
            data.extend_from_slice(d);
        }
        out.push((
            name.clone(),
            TensorBytes {
                ty: ty.clone(),
                bytes: data,
            },
        ));
    }
    Ok(out)
}

/// Serialises tensors to `.safetensors` bytes (names sorted).
pub fn write_safetensors(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    let mut owned = Vec::new();
    for (name, t) in tensors {
        match (&t.data, t.ty.dtype) {
            (Data::F(_), DType::F32 | DType::F16 | DType::BF16)
            | (Data::I(_), DType::I32)
            | (Data::B(_), DType::Bool) => {}
            _ => return Err(format!("`{name}` has data that does not match its dtype")),
        }
        owned.push((name.clone(), TensorBytes::from_tensor(t)));
    }
    write_safetensors_bytes(&owned)
}

/// Serialises tensors held as the bytes their dtype stores to `.safetensors` bytes (names
/// sorted).
pub fn write_safetensors_bytes(tensors: &[(String, TensorBytes)]) -> Result<Vec<u8>, String> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, t)| {
            let dt = match t.ty.dtype {
                DType::F32 => safetensors::Dtype::F32,
                DType::F16 => safetensors::Dtype::F16,
                DType::BF16 => safetensors::Dtype::BF16,
                DType::I32 => safetensors::Dtype::I32,
                DType::Bool => safetensors::Dtype::BOOL,
            };
            safetensors::tensor::TensorView::new(dt, t.ty.shape.0.clone(), &t.bytes)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn npy<T: npyz::AutoSerialize + Copy>(
        dir: &Path,
        name: &str,
        shape: &[u64],
        v: &[T],
    ) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, npy_bytes(shape, v.iter().copied()).unwrap()).unwrap();
        p
    }

    /// Every file dtype into every model dtype gives the bytes the interpreter's tensor of
    /// the same values would hold: the bytes path converts as the f64 one did.
    #[test]
    fn npy_bytes_convert_as_the_interpreter_does() {
        let dir = std::env::temp_dir().join(format!("tcc-npy-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vals = [0.0, -1.5, 3.25, 1e30, -7.0, 65504.5];
        let files = [
            npy(&dir, "f4.npy", &[2, 3], &vals.map(|v| v as f32)),
            npy(&dir, "f8.npy", &[2, 3], &vals),
            npy(&dir, "i4.npy", &[2, 3], &[0i32, -1, 3, i32::MAX, -7, 9]),
            npy(&dir, "i8.npy", &[2, 3], &[0i64, -1, 3, 1 << 40, -7, 9]),
            npy(
                &dir,
                "b1.npy",
                &[2, 3],
                &[true, false, true, true, false, false],
            ),
        ];
        let as_f64: [Vec<f64>; 5] = [
            vals.iter().map(|&v| v as f32 as f64).collect(),
            vals.to_vec(),
            vec![0.0, -1.0, 3.0, i32::MAX as f64, -7.0, 9.0],
            vec![0.0, -1.0, 3.0, (1u64 << 40) as f64, -7.0, 9.0],
            vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0],
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::Bool] {
            let ty = TensorType::new(dtype, vec![2, 3]);
            for (f, v) in files.iter().zip(&as_f64) {
                let got = read_npy_bytes(f, "x", &ty).unwrap();
                let want = Tensor::from_f64(dtype, vec![2, 3], v.clone()).to_le_bytes();
                assert_eq!(got.bytes, want, "{} as {dtype}", f.display());
                assert_eq!(read_npy(f, "x", &ty).unwrap().to_le_bytes(), want);
            }
        }
        // The shape is checked before the data is read; short data is an error.
        let err = read_npy_bytes(&files[0], "x", &TensorType::new(DType::F32, vec![3, 2]));
        assert!(matches!(err, Err(IoError::Mismatch { .. })));
        let mut short = std::fs::read(&files[0]).unwrap();
        short.truncate(short.len() - 2);
        let cut = dir.join("short.npy");
        std::fs::write(&cut, short).unwrap();
        let err = read_npy_bytes(&cut, "x", &TensorType::new(DType::F32, vec![2, 3]));
        assert!(matches!(err, Err(IoError::Npy { .. })), "{err:?}");
        #[cfg(unix)]
        assert!(matches!(
            read_npy_bytes(
                Path::new("/dev/zero"),
                "x",
                &TensorType::new(DType::F32, vec![2])
            ),
            Err(IoError::Npy { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Random inputs drawn into bytes are the values of the interpreter's draws: floats
    /// the standard normal initialiser's, ints below their bound.
    #[test]
    fn random_input_bytes_are_the_interpreters_values() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let ty = TensorType::new(dtype, vec![5, 7]);
            let key = 3u64.wrapping_add(0x5EED) ^ tcc_runtime::init::name_hash("x");
            let normal = crate::ir::Init::Normal {
                mean: 0.0,
                std: 1.0,
            };
            let want = crate::eager::init_value("x", &ty, normal, key).unwrap();
            let got = crate::eager::random_input_bytes("x", &ty, None, 3);
            assert_eq!(got, want.to_le_bytes(), "{dtype}");
            assert_eq!(crate::eager::random_input("x", &ty, None, 3), want);
        }
        let ty = TensorType::new(DType::I32, vec![1000]);
        let ids = crate::eager::random_input("ids", &ty, Some(10), 1);
        let Data::I(v) = &ids.data else {
            panic!("not ints")
        };
        assert!(v.iter().all(|&i| (0..10).contains(&i)));
        assert!((0..10).all(|k| v.contains(&k)));
    }
}
