//! Host tensors of the eager interpreter.
//!
//! Float data of every float dtype is held as `f64` and rounded to the dtype on every store
//! (f32, f16 and bf16 through the `half` crate), so results equal computing in at least f32
//! and rounding on store; [`Precision::F64`] turns rounding off for gradient checks.

use crate::ir::{DType, Shape, TensorType};

/// How float results are rounded on store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Round to each tensor's dtype (f32, f16, bf16).
    #[default]
    Native,
    /// Keep f64 for every float tensor (finite-difference checks).
    F64,
}

/// Element storage.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F(Vec<f64>),
    I(Vec<i32>),
    B(Vec<bool>),
}

/// A dense row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub ty: TensorType,
    pub data: Data,
}

/// Rounds a float to what `dtype` can hold.
pub fn round(dtype: DType, x: f64, precision: Precision) -> f64 {
    if precision == Precision::F64 {
        return x;
    }
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

impl Tensor {
    /// The elements as little-endian bytes of the tensor's dtype (the arena layout).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match (&self.data, self.ty.dtype) {
            (Data::F(v), DType::F16) => v
                .iter()
                .flat_map(|&x| half::f16::from_f64(x).to_le_bytes())
                .collect(),
            (Data::F(v), DType::BF16) => v
                .iter()
                .flat_map(|&x| half::bf16::from_f64(x).to_le_bytes())
                .collect(),
            (Data::F(v), _) => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            (Data::I(v), _) => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
            (Data::B(v), _) => v.iter().map(|&b| u8::from(b)).collect(),
        }
    }

    /// A tensor of `ty` from little-endian bytes of its dtype; `None` when the length is
    /// wrong.
    pub fn from_le_bytes(ty: TensorType, bytes: &[u8]) -> Option<Tensor> {
        let n = ty.shape.numel();
        if bytes.len() != n * ty.dtype.size_bytes() {
            return None;
        }
        let data = match ty.dtype {
            DType::F32 => Data::F(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                    .collect(),
            ),
            DType::F16 => Data::F(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
                    .collect(),
            ),
            DType::BF16 => Data::F(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
                    .collect(),
            ),
            DType::I32 => Data::I(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::Bool => Data::B(bytes.iter().map(|&b| b != 0).collect()),
        };
        Some(Tensor { ty, data })
    }

    /// A tensor of `ty` filled with zeros (false).
    pub fn zeros(ty: TensorType) -> Tensor {
        let n = ty.shape.numel();
        let data = match ty.dtype {
            DType::I32 => Data::I(vec![0; n]),
            DType::Bool => Data::B(vec![false; n]),
            _ => Data::F(vec![0.0; n]),
        };
        Tensor { ty, data }
    }

    /// A float tensor from values (rounded to `dtype` natively).
    pub fn from_f64(dtype: DType, shape: impl Into<Shape>, values: Vec<f64>) -> Tensor {
        let ty = TensorType::new(dtype, shape);
        let data = match dtype {
            DType::I32 => Data::I(values.iter().map(|&v| v as i32).collect()),
            DType::Bool => Data::B(values.iter().map(|&v| v != 0.0).collect()),
            d => Data::F(
                values
                    .iter()
                    .map(|&v| round(d, v, Precision::Native))
                    .collect(),
            ),
        };
        Tensor { ty, data }
    }

    pub fn from_i32(shape: impl Into<Shape>, values: Vec<i32>) -> Tensor {
        Tensor {
            ty: TensorType::new(DType::I32, shape),
            data: Data::I(values),
        }
    }

    pub fn numel(&self) -> usize {
        self.ty.shape.numel()
    }

    pub fn dims(&self) -> &[usize] {
        self.ty.dims()
    }

    /// Every element as f64 (ints and bools converted).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            Data::F(v) => v.clone(),
            Data::I(v) => v.iter().map(|&x| x as f64).collect(),
            Data::B(v) => v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect(),
        }
    }

    /// Row-major strides of the tensor.
    pub fn strides(&self) -> Vec<usize> {
        contiguous_strides(self.dims())
    }
}

/// Row-major strides of a shape.
pub fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Strides for reading a tensor of shape `src` as if broadcast to `dst` (0 on stretched or
/// missing dims).
pub fn broadcast_strides(src: &[usize], dst: &[usize]) -> Vec<usize> {
    let cs = contiguous_strides(src);
    let lead = dst.len() - src.len();
    (0..dst.len())
        .map(|i| {
            if i < lead || src[i - lead] == 1 {
                0
            } else {
                cs[i - lead]
            }
        })
        .collect()
}

/// Calls `f(k, offsets)` for every element `k` of `shape` in row-major order, where
/// `offsets[j]` is `base[j] + Σ index·strides[j]`.
pub fn for_each_offset(
    shape: &[usize],
    strides: &[&[usize]],
    base: &[usize],
    mut f: impl FnMut(usize, &[usize]),
) {
    let n: usize = shape.iter().product();
    if n == 0 {
        return;
    }
    let r = shape.len();
    let mut idx = vec![0usize; r];
    let mut off: Vec<usize> = base.to_vec();
    for k in 0..n {
        f(k, &off);
        // Increment the multi-index, updating offsets.
        let mut ax = r;
        while ax > 0 {
            ax -= 1;
            idx[ax] += 1;
            for (j, s) in strides.iter().enumerate() {
                off[j] += s[ax];
            }
            if idx[ax] < shape[ax] {
                break;
            }
            for (j, s) in strides.iter().enumerate() {
                off[j] -= s[ax] * shape[ax];
            }
            idx[ax] = 0;
        }
    }
}
