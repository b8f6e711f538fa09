//! `tcc-runtime`: loads a compiled tcc artifact and runs it inside one static memory arena.
//!
//! The runtime deliberately has no dependency on the compiler, so a program that only runs
//! models links nothing but this crate. An artifact (`tcc build FILE -o model.tcc`, format in
//! `ARTIFACT.md`) holds the arena layout, the initial bytes of the params and the code of
//! every kernel; a [`Session`] allocates the arena once, compiles the code for the host and
//! then runs steps without allocating.
//!
//! ```no_run
//! use tcc_runtime::{Device, Model, Session};
//!
//! # fn main() -> Result<(), tcc_runtime::Error> {
//! let model = Model::load("mlp.tcc")?;
//! let mut session = Session::new(&model, Device::Cpu)?;
//! session.set_threads(4)?; // the default is one thread per available core
//! for _ in 0..100 {
//!     session.set_input("x", &vec![0.5f32; 256 * 784])?;
//!     session.run()?;
//! }
//! let loss: Vec<f32> = session.output("loss")?;
//! println!("loss {}", loss[0]);
//! session.save_params("mlp.safetensors")?;
//! # Ok(())
//! # }
//! ```
//!
//! Running a model executes the machine code compiled from its artifact; load only artifacts
//! you trust, as you would a shared library.
//!
//! # Data parallelism
//!
//! A step built with `tcc build --gpus N` runs on N ranks through [`DataParallel`]: one
//! session (and arena) per rank, each on its own thread and its own slice of the batch, the
//! gradients summed across the ranks before the optimizer (in shared memory for CPU ranks,
//! through NCCL for CUDA ranks). [`Session::new`] refuses such an artifact.
//!
//! ```no_run
//! use tcc_runtime::{DataParallel, Device, Model};
//!
//! # fn main() -> Result<(), tcc_runtime::Error> {
//! let model = Model::load("gpt.tcc")?; // tcc build examples/gpt.tdsl --target cuda --gpus 2
//! let mut dp = DataParallel::new(&model, &[Device::Cuda(0), Device::Cuda(1)])?;
//! let whole_batch: Vec<u8> = vec![0; 2 * model.inputs()[0].bytes as usize];
//! dp.set_input_split(&model.inputs()[0].name, &whole_batch)?; // half to each GPU
//! dp.run()?;
//! # Ok(())
//! # }
//! ```
//!
//! # CUDA
//!
//! With the cargo feature `cuda`, `Session::new(&model, Device::Cuda(i))` runs an artifact
//! built with `--target cuda` on GPU `i`. The CUDA driver is opened at run time, so building
//! needs no CUDA toolkit, and a machine without a driver or a GPU gets an [`Error::Cuda`]
//! (never a panic); [`cuda_device_count`] tells whether there is one. A CUDA session makes
//! exactly one device allocation, the arena (`cuMemAlloc`, 256-byte aligned: an artifact
//! asking for more is refused), loads the kernels once (the artifact's SASS for this GPU
//! when it has some, else its PTX, compiled by the driver) and builds the step into a CUDA graph
//! (a node per kernel, an edge per dependency the artifact lists, so independent kernels
//! may overlap) that every [`Session::run`] replays ([`Session::set_cuda_graph`] turns that
//! off for debugging). The API is the CPU one, with the data moving as a GPU program
//! wants it to:
//!
//! - `set_input*` write a page-locked (pinned) host buffer; `run` copies the inputs set since
//!   the last step to the device, runs the step, copies every output back into its pinned
//!   buffer and waits for the stream, so `output*` read host memory and a failing kernel
//!   is an error of that `run`. Steady-state steps allocate nothing on the host.
//! - `param*`, `set_param*`, `save_params*` and `load_params*` copy the bytes they need
//!   between host and device; [`Session::arena`] is a host copy of the device arena.
//! - [`Session::device_memory`] reports the device's free and total memory, so a caller can
//!   see the arena and the runtime's overhead.

pub mod artifact;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod fsutil;
mod gemm;
pub mod init;
#[cfg(feature = "cuda")]
mod nccl;
pub mod parallel;
pub mod ptx;

use std::alloc::Layout;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

pub use artifact::{DType, Manifest, PersistentKind, PersistentSlot, Target, TensorSlot};
pub use cpu::CPU_HELPERS;
pub use parallel::DataParallel;

/// Where a session's kernels' machine code came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CodeOrigin {
    /// Cranelift compiled the artifact's CLIF for this host at load.
    Cranelift,
    /// The artifact's SASS for this GPU's architecture (`sm_90a` say), loaded as it is.
    Sass { arch: String },
    /// The driver compiled the artifact's PTX at load (its JIT cache serves pieces compiled
    /// before); `why` says why the artifact's SASS was not used, when it had some.
    Ptx { why: Option<String> },
}

impl fmt::Display for CodeOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodeOrigin::Cranelift => f.write_str("CLIF compiled by Cranelift"),
            CodeOrigin::Sass { arch } => write!(f, "SASS for {arch}"),
            CodeOrigin::Ptx { why: None } => f.write_str("PTX compiled by the driver"),
            CodeOrigin::Ptx { why: Some(w) } => {
                write!(f, "PTX compiled by the driver ({w})")
            }
        }
    }
}

/// Where a session runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// Everything that can go wrong loading or running an artifact.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bytes are shorter than the header or do not start with `TCCMODEL`.
    #[error("not a tcc artifact (no `TCCMODEL` header)")]
    NotAnArtifact,
    /// A section (or the manifest) ends past the end of the file.
    #[error(
        "the artifact is truncated: `{section}` ends at byte {needed} but the file has {have} \
         bytes"
    )]
    Truncated {
        section: String,
        needed: u64,
        have: u64,
    },
    /// A section's bytes do not match its checksum.
    #[error("the artifact is corrupt: section `{section}` does not match its checksum")]
    Corrupt { section: String },
    /// The artifact was written by a newer format than this runtime reads.
    #[error(
        "the artifact has format version {found}, but this tcc-runtime reads only up to version \
         {supported}; upgrade tcc-runtime"
    )]
    NewerVersion { found: u32, supported: u32 },
    /// The manifest is not valid JSON, misses fields or describes an impossible layout.
    #[error("bad artifact manifest: {0}")]
    BadManifest(String),
    /// Reading or writing a file failed.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// No input/output/persistent tensor has this name.
    #[error("unknown {kind} `{name}`; the model's {kind}s are: {}", list(.known))]
    UnknownTensor {
        /// `input`, `output` or `persistent tensor`.
        kind: &'static str,
        name: String,
        known: Vec<String>,
    },
    /// A params file names tensors the model does not have.
    #[error(
        "the params file holds tensors the model does not have: {}; the model's persistent \
         tensors are: {}",
        list(.unknown),
        list(.known)
    )]
    UnknownParams {
        unknown: Vec<String>,
        known: Vec<String>,
    },
    /// The data's element type differs from the tensor's.
    #[error("`{name}` is {expected}, but the data is {got}")]
    DTypeMismatch {
        name: String,
        expected: DType,
        got: DType,
    },
    /// The data has a different number of elements than the tensor.
    #[error("`{name}` has {expected} elements, but the data has {got}")]
    LenMismatch {
        name: String,
        expected: usize,
        got: usize,
    },
    /// An index input (labels, embedding ids) holds a value outside the range the model
    /// indexes with it.
    #[error(
        "input `{name}`: element {position} is {value}, outside [0, {bound}) (the range the \
         model indexes with it)"
    )]
    IndexOutOfRange {
        name: String,
        position: usize,
        value: i64,
        bound: u64,
    },
    /// An op read index values the step computed outside their range (an artifact's
    /// in-step check, [`artifact::Manifest::checks`]): the kernels clamped them, so the
    /// step's results, and the params and state its updates wrote, are not the program's.
    #[error(
        "{what}: {count} index value(s) computed in the step lie outside [0, {bound}); the \
         step's results are not valid"
    )]
    IndexOutOfRangeInStep {
        what: String,
        count: u64,
        bound: u64,
    },
    /// The step's updates left params that are not finite (an artifact's finite check,
    /// [`artifact::CheckKind::FiniteUpdates`]): a gradient held NaN or infinity, or an
    /// update left f32's range. [`Session::set_allow_nonfinite`] turns this error off.
    #[error(
        "{what} are not finite after the step (the sum of their magnitudes is {sum}): a \
         gradient held NaN or infinity, or an update left f32's range"
    )]
    NonFiniteUpdate { what: String, sum: f32 },
    /// The data has a different number of bytes than the tensor.
    #[error("`{name}` is {expected} bytes, but the data is {got} bytes")]
    ByteLenMismatch {
        name: String,
        expected: usize,
        got: usize,
    },
    /// A tensor in a params file has a different shape than the model's.
    #[error("`{name}` has shape {expected:?}, but the file's tensor has shape {got:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// The buffer given to [`Session::with_arena`] is smaller than the model's arena.
    #[error("the arena buffer is {got} bytes, but the model needs {needed} bytes")]
    ArenaTooSmall { needed: usize, got: usize },
    /// The buffer given to [`Session::with_arena`] does not start at a multiple of the
    /// model's alignment.
    #[error("the arena buffer must start at an address that is a multiple of {align} bytes")]
    ArenaMisaligned { align: usize },
    /// Allocating the arena failed.
    #[error("could not allocate the {bytes}-byte arena")]
    OutOfMemory { bytes: usize },
    /// Allocating host memory for something else than the arena failed.
    #[error("could not allocate {bytes} bytes of host memory for {what}")]
    HostMemory { what: &'static str, bytes: usize },
    /// The code section failed to parse, verify or compile, or misses a kernel.
    #[error("compiling kernel `{kernel}` failed: {message}")]
    Compile { kernel: String, message: String },
    /// The device cannot be used by this build or on this machine.
    #[error("device {device} is not supported: {reason}")]
    UnsupportedDevice {
        device: Device,
        reason: &'static str,
    },
    /// The artifact was compiled for another target than the device.
    #[error("the artifact was compiled for target `{target}` and cannot run on device {device}")]
    TargetMismatch { target: Target, device: Device },
    /// The step was built for another number of data-parallel ranks than it is run with.
    #[error(
        "the artifact was built for {built} data-parallel rank(s) and is run with {given}; \
         build it again with `tcc build --gpus {given}`{}",
        if *.built > 1 { " or run it with `DataParallel` (`tcc run --gpus N`)" } else { "" }
    )]
    Ranks { built: usize, given: usize },
    /// A collective of a data-parallel step failed, timed out, or another rank stopped.
    #[error("data-parallel rank {rank}: {message}")]
    Collective { rank: usize, message: String },
    /// A params file is not valid safetensors or holds an unsupported dtype.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// A kernel's call of the GEMM helper named operands outside the arena or a block
    /// larger than the helper computes: the code is not what tcc compiles.
    #[error(
        "a kernel called the GEMM helper with a {m}×{n}×{k} block that the helper refused \
         (operands outside the arena, or a block larger than it computes): the artifact's \
         code is corrupt; rebuild it"
    )]
    HelperRefused { m: i64, n: i64, k: i64 },
    /// Starting a worker thread failed.
    #[error("could not start a worker thread: {0}")]
    Threads(std::io::Error),
    /// The CUDA driver is missing, has no such device, or a CUDA call failed (`context`
    /// says what the session was doing; `message` is the driver's error).
    #[error("CUDA error while {context}: {message}")]
    Cuda { context: String, message: String },
}

/// Result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

mod sealed {
    pub trait Sealed {}
}

/// An element type a tensor can hold: `f32`, `i32`, `bool`, [`half::f16`], [`half::bf16`].
/// Values are stored little-endian in the arena; a `bool` is one byte, 0 or 1.
pub trait Element: Copy + sealed::Sealed + 'static {
    /// The matching manifest dtype.
    const DTYPE: DType;
    /// Writes `self` into `out` (exactly `DTYPE.size_bytes()` long).
    #[doc(hidden)]
    fn write_le(self, out: &mut [u8]);
    /// Reads a value from `bytes` (exactly `DTYPE.size_bytes()` long).
    #[doc(hidden)]
    fn read_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $dtype:expr, $n:literal, |$v:ident| $to:expr, |$b:ident| $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            fn write_le(self, out: &mut [u8]) {
                let $v = self;
                out.copy_from_slice(&$to);
            }
            fn read_le(bytes: &[u8]) -> Self {
                let mut $b = [0u8; $n];
                $b.copy_from_slice(bytes);
                $from
            }
        }
    };
}

element!(f32, DType::F32, 4, |v| v.to_le_bytes(), |b| {
    f32::from_le_bytes(b)
});
element!(i32, DType::I32, 4, |v| v.to_le_bytes(), |b| {
    i32::from_le_bytes(b)
});
element!(bool, DType::Bool, 1, |v| [u8::from(v)], |b| b[0] != 0);
element!(
    half::f16,
    DType::F16,
    2,
    |v| v.to_bits().to_le_bytes(),
    |b| half::f16::from_bits(u16::from_le_bytes(b))
);
element!(
    half::bf16,
    DType::Bf16,
    2,
    |v| v.to_bits().to_le_bytes(),
    |b| half::bf16::from_bits(u16::from_le_bytes(b))
);

fn encode<T: Element>(data: &[T], out: &mut [u8]) {
    for (x, chunk) in data.iter().zip(out.chunks_exact_mut(T::DTYPE.size_bytes())) {
        x.write_le(chunk);
    }
}

fn decode<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(T::DTYPE.size_bytes())
        .map(T::read_le)
        .collect()
}

/// The persistent region's initial bytes with every param that has a recipe drawn in, on
/// all the host's cores (`None` when no param has one: the stored section is the image;
/// an error when the host cannot allocate it).
/// [`artifact::validate`] checked that each such slot is a float param inside the region.
fn draw_params(m: &Manifest, stored: &[u8]) -> Result<Option<Vec<u8>>> {
    let slots: Vec<_> = m
        .persistent
        .iter()
        .filter_map(|p| Some((&p.slot, p.init?)))
        .collect();
    let Some(end) = slots
        .iter()
        .map(|(s, _)| s.range().end)
        .chain([stored.len()])
        .max()
    else {
        return Ok(None);
    };
    if slots.is_empty() {
        return Ok(None);
    }
    let mut img = Vec::new();
    img.try_reserve_exact(end).map_err(|_| Error::HostMemory {
        what: "the params drawn at load",
        bytes: end,
    })?;
    img.resize(end, 0);
    img[..stored.len()].copy_from_slice(stored);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (slot, recipe) in slots {
        // `validate` checked the dtype, so this draws every element.
        init::fill_le(
            &slot.name,
            recipe,
            slot.dtype,
            &mut img[slot.range()],
            threads,
        );
    }
    Ok(Some(img))
}

/// Serialises persistent tensors (slot, the shape to write, bytes) as safetensors, with
/// the model's name in the metadata.
pub(crate) fn serialize_params(
    model: &Model,
    tensors: Vec<(&TensorSlot, &Vec<usize>, &[u8])>,
) -> Result<Vec<u8>> {
    let mut views = Vec::with_capacity(tensors.len());
    for (s, shape, bytes) in tensors {
        let view = safetensors::tensor::TensorView::new(st_dtype(s.dtype), shape.clone(), bytes)
            .map_err(|e| Error::Safetensors(format!("`{}`: {e}", s.name)))?;
        views.push((s.name.as_str(), view));
    }
    let mut meta = std::collections::HashMap::new();
    meta.insert("model".to_string(), model.manifest().model.clone());
    safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::Safetensors(e.to_string()))
}

/// Persistent slots with the bytes a params file holds for them.
pub(crate) type FoundParams<'m, 'b> = Vec<(&'m PersistentSlot, &'b [u8])>;

/// The persistent tensors a safetensors file holds, each checked against its slot's dtype
/// and shape, or with `whole`, a ZeRO-1 shard's against the whole tensor's (its param's);
/// what was found and what was missing. A name the model does not have is an error.
pub(crate) fn params_in_file<'m, 'b>(
    model: &'m Model,
    st: &safetensors::SafeTensors<'b>,
    whole: bool,
) -> Result<(FoundParams<'m, 'b>, ParamsLoaded)> {
    let persistent = model.persistent();
    let mut unknown: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| !persistent.iter().any(|p| p.slot.name == **n))
        .map(str::to_string)
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        return Err(Error::UnknownParams {
            unknown,
            known: persistent.iter().map(|p| p.slot.name.clone()).collect(),
        });
    }
    let mut report = ParamsLoaded::default();
    let mut found = Vec::new();
    for p in persistent {
        let s = &p.slot;
        let view = match st.tensor(&s.name) {
            Ok(v) => v,
            Err(_) => {
                report.missing.push(s.name.clone());
                continue;
            }
        };
        // What the file must hold: the slot, or the whole tensor it is a shard of.
        let want = match p.whole(model.manifest()) {
            Some(w) if whole => w,
            _ => s,
        };
        let got = dtype_from_st(view.dtype()).ok_or_else(|| {
            Error::Safetensors(format!(
                "`{}` has dtype {:?}, which tcc does not support",
                s.name,
                view.dtype()
            ))
        })?;
        if got != want.dtype {
            return Err(Error::DTypeMismatch {
                name: s.name.clone(),
                expected: want.dtype,
                got,
            });
        }
        if view.shape() != want.shape.as_slice() {
            return Err(Error::ShapeMismatch {
                name: s.name.clone(),
                expected: want.shape.clone(),
                got: view.shape().to_vec(),
            });
        }
        check_bytes(want, view.data().len())?;
        found.push((p, view.data()));
        report.loaded.push(s.name.clone());
    }
    Ok((found, report))
}

struct ModelInner {
    manifest: Manifest,
    code: String,
    bytes: Vec<u8>,
    persistent: Range<usize>,
    /// The `sass` section's bytes in `bytes`, checked against `manifest.sass`.
    sass: Option<Range<usize>>,
    /// The persistent region's initial bytes when params are drawn at load (format 2's
    /// recipes); otherwise they are `bytes[persistent]`.
    drawn: Option<Vec<u8>>,
}

/// A loaded, checked artifact. Cheap to clone (the bytes are shared); sessions keep a clone.
#[derive(Clone)]
pub struct Model {
    inner: Arc<ModelInner>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("model", &self.inner.manifest.model)
            .field("target", &self.inner.manifest.target)
            .field("arena_bytes", &self.inner.manifest.arena_bytes)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Reads and checks the artifact at `path` (see [`Model::from_bytes`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let bytes =
            fsutil::read_declared(path, artifact::HEADER_BYTES as u64, artifact::declared_len)
                .map_err(|source| Error::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
        Model::from_bytes(bytes)
    }

    /// Checks an artifact held in memory: header, version, manifest, checksums, that every
    /// tensor fits the arena, and that the `code` and `persistent` sections are there.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Model> {
        let (manifest, sections) = artifact::read(&bytes)?;
        let find = |name: &str| {
            sections
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, r)| r.clone())
                .ok_or_else(|| Error::BadManifest(format!("the artifact has no `{name}` section")))
        };
        let code = find("code")?;
        let persistent = find("persistent")?;
        // The section holds the region's initial bytes up to the last param; the rest of the
        // region (optimizer state) starts at zero.
        if persistent.len() as u64 > manifest.plan.persistent_bytes {
            return Err(Error::BadManifest(format!(
                "the persistent section is {} bytes but plan.persistent_bytes is only {}",
                persistent.len(),
                manifest.plan.persistent_bytes
            )));
        }
        let sass = match (&manifest.sass, find("sass").ok()) {
            (None, None) => None,
            (Some(s), Some(r)) if manifest.target == Target::Cuda => {
                let code_sum = manifest.section("code").map_or("", |c| c.checksum.as_str());
                let names: Vec<&str> = manifest.kernels.iter().map(|k| k.name.as_str()).collect();
                s.check(r.len() as u64, &names, code_sum)
                    .map_err(Error::BadManifest)?;
                Some(r)
            }
            (Some(_), _) if manifest.target != Target::Cuda => {
                return Err(Error::BadManifest(format!(
                    "a `{}` artifact with SASS (only `cuda` artifacts carry it)",
                    manifest.target
                )))
            }
            (Some(_), _) => {
                return Err(Error::BadManifest(
                    "the manifest describes SASS but the artifact has no `sass` section".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::BadManifest(
                    "the artifact has a `sass` section that the manifest does not describe".into(),
                ))
            }
        };
        let code = std::str::from_utf8(&bytes[code])
            .map_err(|e| Error::BadManifest(format!("the code section is not UTF-8: {e}")))?;
        artifact::check_bounds(&manifest, code)?;
        // The code proper, after its bounds line (which `check_bounds` found there).
        let code = code
            .split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_string());
        let drawn = draw_params(&manifest, &bytes[persistent.clone()])?;
        Ok(Model {
            inner: Arc::new(ModelInner {
                manifest,
                code,
                bytes,
                persistent,
                sass,
                drawn,
            }),
        })
    }

    /// The whole manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.inner.manifest
    }

    /// The tensors the caller writes before a step.
    pub fn inputs(&self) -> &[TensorSlot] {
        &self.inner.manifest.inputs
    }

    /// The tensors the caller reads after a step.
    pub fn outputs(&self) -> &[TensorSlot] {
        &self.inner.manifest.outputs
    }

    /// Params and optimizer state, which live across steps.
    pub fn persistent(&self) -> &[PersistentSlot] {
        &self.inner.manifest.persistent
    }

    /// Size of the arena a session needs, in bytes.
    pub fn arena_bytes(&self) -> usize {
        // `artifact::validate` checked that it fits a usize.
        self.inner.manifest.arena_bytes as usize
    }

    /// Alignment the arena base needs, in bytes.
    pub fn alignment(&self) -> usize {
        self.inner.manifest.alignment as usize
    }

    /// The code section after its bounds line ([`artifact::bounds_line`]): Cranelift IR
    /// text (`cpu`) or PTX (`cuda`), as `tcc build --emit clif|ptx` prints it.
    pub fn code(&self) -> &str {
        &self.inner.code
    }

    /// The machine code a `cuda` artifact carries for one GPU architecture, each piece's
    /// cubin with its description (`None`: PTX only).
    pub fn sass(&self) -> Option<(&artifact::Sass, Vec<&[u8]>)> {
        let s = self.inner.manifest.sass.as_ref()?;
        let section = self.inner.bytes.get(self.inner.sass.clone()?)?;
        // `Sass::check` put every piece inside the section; a piece that is not reads as no
        // SASS at all.
        let cubins = s
            .pieces
            .iter()
            .map(|p| {
                let start = usize::try_from(p.offset).ok()?;
                let end = start.checked_add(usize::try_from(p.len).ok()?)?;
                section.get(start..end)
            })
            .collect::<Option<Vec<_>>>()?;
        Some((s, cubins))
    }

    /// The target the artifact was compiled for.
    pub fn target(&self) -> Target {
        self.inner.manifest.target
    }

    /// Initial bytes of the arena's persistent region `[0, plan.persistent_bytes)`, up to
    /// the end of its last param (the rest starts at zero): the stored values with the
    /// params an artifact records as recipes drawn in.
    pub fn persistent_init(&self) -> &[u8] {
        match &self.inner.drawn {
            Some(d) => d,
            None => &self.inner.bytes[self.inner.persistent.clone()],
        }
    }

    /// Input `name` and its index in [`Model::inputs`].
    pub(crate) fn input_slot(&self, name: &str) -> Result<(usize, &TensorSlot)> {
        find_slot("input", self.inputs().iter(), name)
    }

    /// Output `name` and its index in [`Model::outputs`].
    fn output_slot(&self, name: &str) -> Result<(usize, &TensorSlot)> {
        find_slot("output", self.outputs().iter(), name)
    }

    fn persistent_slot(&self, name: &str) -> Result<&TensorSlot> {
        find_slot(
            "persistent tensor",
            self.persistent().iter().map(|p| &p.slot),
            name,
        )
        .map(|(_, slot)| slot)
    }
}

fn find_slot<'m>(
    kind: &'static str,
    mut slots: impl Iterator<Item = &'m TensorSlot> + Clone,
    name: &str,
) -> Result<(usize, &'m TensorSlot)> {
    slots
        .clone()
        .enumerate()
        .find(|(_, s)| s.name == name)
        .ok_or_else(|| Error::UnknownTensor {
            kind,
            name: name.to_string(),
            known: slots.by_ref().map(|s| s.name.clone()).collect(),
        })
}

/// Number of CUDA devices this build can use: `Ok(0)` when the driver reports none, an
/// [`Error::Cuda`] when the driver library is missing or fails, and
/// [`Error::UnsupportedDevice`] when tcc-runtime was built without the `cuda` feature.
/// Dynamic loss scaling's state after the last step ([`Session::loss_scale`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaleState {
    /// The scale the next step multiplies the loss by.
    pub scale: f32,
    /// Clean steps in a row since the scale last changed.
    pub growth_tracker: f32,
    /// Steps whose updates were skipped because a gradient was not finite.
    pub skipped_steps: f32,
}

pub fn cuda_device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(no_cuda(Device::Cuda(0)))
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn no_cuda(device: Device) -> Error {
    Error::UnsupportedDevice {
        device,
        reason: "built without CUDA support (enable the `cuda` feature of tcc-runtime)",
    }
}

fn check_elements<T: Element>(slot: &TensorSlot, len: usize) -> Result<()> {
    if T::DTYPE != slot.dtype {
        return Err(Error::DTypeMismatch {
            name: slot.name.clone(),
            expected: slot.dtype,
            got: T::DTYPE,
        });
    }
    let expected = slot.bytes as usize / slot.dtype.size_bytes();
    if len != expected {
        return Err(Error::LenMismatch {
            name: slot.name.clone(),
            expected,
            got: len,
        });
    }
    Ok(())
}

/// The first little-endian `i32` of `bytes` outside `[0, bound)` (with `bound`), as an
/// error; the bytes are zeroed then, so no later step reads an index out of range.
fn check_indices(name: &str, bytes: &mut [u8], bound: Option<u64>) -> Result<()> {
    let Some(bound) = bound else {
        return Ok(());
    };
    let bad = bytes.chunks_exact(4).enumerate().find_map(|(i, c)| {
        let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64;
        (v < 0 || v as u64 >= bound).then_some((i, v))
    });
    match bad {
        None => Ok(()),
        Some((position, value)) => {
            bytes.fill(0);
            Err(Error::IndexOutOfRange {
                name: name.to_string(),
                position,
                value,
                bound,
            })
        }
    }
}

fn check_bytes(slot: &TensorSlot, len: usize) -> Result<()> {
    if len as u64 != slot.bytes {
        return Err(Error::ByteLenMismatch {
            name: slot.name.clone(),
            expected: slot.bytes as usize,
            got: len,
        });
    }
    Ok(())
}

/// The session's arena: allocated by the session, empty, or lent by the caller.
enum Arena<'a> {
    Owned {
        ptr: NonNull<u8>,
        layout: Layout,
    },
    /// A zero-byte arena; kernels get `base` (aligned, never dereferenced).
    Empty {
        base: NonNull<u8>,
    },
    Borrowed(&'a mut [u8]),
}

impl Arena<'_> {
    fn alloc(bytes: usize, align: usize) -> Result<Arena<'static>> {
        let layout = Layout::from_size_align(bytes, align)
            .map_err(|e| Error::BadManifest(format!("arena layout: {e}")))?;
        if bytes == 0 {
            // A dangling, aligned pointer for a zero-sized arena (nothing is allocated).
            let base = NonNull::new(align as *mut u8).ok_or(Error::OutOfMemory { bytes })?;
            return Ok(Arena::Empty { base });
        }
        // SAFETY: `layout` has a non-zero size (checked above) and a valid, power-of-two
        // alignment (checked by `Layout::from_size_align`).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(Error::OutOfMemory { bytes })?;
        Ok(Arena::Owned { ptr, layout })
    }

    fn base(&mut self) -> *mut u8 {
        match self {
            Arena::Owned { ptr, .. } => ptr.as_ptr(),
            Arena::Empty { base } => base.as_ptr(),
            Arena::Borrowed(buf) => buf.as_mut_ptr(),
        }
    }

    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` (so it is valid, initialised
            // and `layout.size()` long) and stays allocated until `drop`; `&self` keeps it
            // from being written through `&mut self` meanwhile.
            Arena::Owned { ptr, layout } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), layout.size())
            },
            Arena::Empty { .. } => &[],
            Arena::Borrowed(buf) => buf,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in `bytes`, and `&mut self` makes this the only reference.
            Arena::Owned { ptr, layout } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), layout.size())
            },
            Arena::Empty { .. } => &mut [],
            Arena::Borrowed(buf) => buf,
        }
    }
}

impl Drop for Arena<'_> {
    fn drop(&mut self) {
        if let Arena::Owned { ptr, layout } = self {
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this `layout` and is
            // freed only here, once.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

// SAFETY: the arena is plain bytes owned (or exclusively borrowed) by one session; moving
// the session to another thread moves that ownership. Nothing else holds the pointer.
unsafe impl Send for Arena<'_> {}

// One per session, moved only when the session is: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Executor {
    Cpu(cpu::CpuExecutor),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaExecutor),
}

/// What [`Session::load_params`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamsLoaded {
    /// Persistent tensors read from the file, in the model's order.
    pub loaded: Vec<String>,
    /// Persistent tensors the file does not have (left as they were), in the model's order.
    pub missing: Vec<String>,
}

/// A model ready to run: one arena holding every tensor, and the compiled kernels.
///
/// On a CUDA device the arena lives in device memory; the methods that read or write
/// tensors copy the bytes they need (see the crate docs).
///
/// `'a` is the lifetime of a caller-provided arena ([`Session::with_arena`]); sessions that
/// allocate their own arena ([`Session::new`]) are `Session<'static>`.
pub struct Session<'a> {
    // Field order matters for drop: the executor (worker threads, code) goes before the
    // arena the workers point into.
    exec: Executor,
    arena: Arena<'a>,
    model: Model,
    device: Device,
    /// [`Session::set_allow_nonfinite`].
    allow_nonfinite: bool,
}

impl fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("model", &self.model)
            .field("device", &self.device)
            .field("threads", &self.threads())
            .finish_non_exhaustive()
    }
}

fn check_device(model: &Model, device: Device) -> Result<()> {
    let target = match device {
        Device::Cpu => Target::Cpu,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Target::Cuda,
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(no_cuda(device)),
    };
    if model.target() != target {
        return Err(Error::TargetMismatch {
            target: model.target(),
            device,
        });
    }
    Ok(())
}

/// A step built for several data-parallel ranks seeds its gradients with `1/N` and relies
/// on the other ranks' sums: alone it would train on a fraction of the gradient.
fn check_alone(model: &Model) -> Result<()> {
    match model.manifest().ranks {
        Some(n) if n > 1 => Err(Error::Ranks {
            built: n as usize,
            given: 1,
        }),
        _ => Ok(()),
    }
}

impl Session<'static> {
    /// Compiles `model` for `device` and allocates its arena: exactly one allocation of
    /// [`Model::arena_bytes`] bytes, aligned to the manifest's `alignment`, holding the
    /// initial persistent bytes and zeros elsewhere. On the CPU, `parallel` kernels run on
    /// one thread per available core (the workers start here; [`Session::set_threads`]
    /// changes the count).
    ///
    /// On [`Device::Cuda`] (feature `cuda`, a `cuda` artifact) the arena is one device
    /// allocation, the PTX is loaded and the step is built as a CUDA graph here; a missing
    /// driver or device, or any failing CUDA call, is an [`Error::Cuda`].
    pub fn new(model: &Model, device: Device) -> Result<Session<'static>> {
        check_alone(model)?;
        Session::new_rank(model, device)
    }

    /// [`Session::new`] for one rank of a [`DataParallel`] step.
    pub(crate) fn new_rank(model: &Model, device: Device) -> Result<Session<'static>> {
        check_device(model, device)?;
        let exec = match device {
            Device::Cpu => Executor::Cpu(cpu::CpuExecutor::compile(
                model.code(),
                &model.manifest().kernels,
            )?),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let exec = Executor::Cuda(cuda::CudaExecutor::new(model, ordinal)?);
                // The arena lives on the device; the host holds none.
                return Ok(Session {
                    exec,
                    arena: Arena::alloc(0, model.alignment())?,
                    model: model.clone(),
                    device,
                    allow_nonfinite: false,
                });
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => return Err(no_cuda(device)),
        };
        let arena = Arena::alloc(model.arena_bytes(), model.alignment())?;
        let mut s = Session {
            exec,
            arena,
            model: model.clone(),
            device,
            allow_nonfinite: false,
        };
        s.copy_persistent_init();
        s.set_threads(0)?;
        Ok(s)
    }
}

impl<'a> Session<'a> {
    /// Like [`Session::new`] on the CPU, but uses `arena` instead of allocating: it must be
    /// at least [`Model::arena_bytes`] long and start at a multiple of [`Model::alignment`].
    /// Only its first `arena_bytes` bytes are used; they are overwritten with the initial
    /// persistent bytes and zeros. As with [`Session::new`], `parallel` kernels run on one
    /// thread per available core (workers started here).
    pub fn with_arena(model: &Model, arena: &'a mut [u8]) -> Result<Session<'a>> {
        check_alone(model)?;
        check_device(model, Device::Cpu)?;
        let needed = model.arena_bytes();
        let got = arena.len();
        let arena = match arena.get_mut(..needed) {
            Some(a) => a,
            None => return Err(Error::ArenaTooSmall { needed, got }),
        };
        let align = model.alignment();
        if needed > 0 && !(arena.as_ptr() as usize).is_multiple_of(align) {
            return Err(Error::ArenaMisaligned { align });
        }
        let exec = Executor::Cpu(cpu::CpuExecutor::compile(
            model.code(),
            &model.manifest().kernels,
        )?);
        let arena = if needed == 0 {
            Arena::alloc(0, align)?
        } else {
            Arena::Borrowed(arena)
        };
        let mut s = Session {
            exec,
            arena,
            model: model.clone(),
            device: Device::Cpu,
            allow_nonfinite: false,
        };
        s.reset();
        s.set_threads(0)?;
        Ok(s)
    }

    fn copy_persistent_init(&mut self) {
        let init = self.model.persistent_init();
        // `Model::from_bytes` checked init.len() <= plan.persistent_bytes <= arena_bytes.
        self.arena.bytes_mut()[..init.len()].copy_from_slice(init);
    }

    /// Restores the arena to its state after creation: the initial params and optimizer
    /// state from the artifact, zeros everywhere else (outputs read as zeros until the next
    /// step). On a CUDA device a failing copy is reported by the next [`Session::run`].
    pub fn reset(&mut self) {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &mut self.exec {
            c.reset();
            return;
        }
        let n = self.model.persistent_init().len();
        self.arena.bytes_mut()[n..].fill(0);
        self.copy_persistent_init();
    }

    /// The model this session runs.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The device this session runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Size of the arena in use, in bytes (the manifest's `arena_bytes`; on a CUDA device,
    /// the size of the one device allocation).
    pub fn arena_bytes(&self) -> usize {
        self.model.arena_bytes()
    }

    /// The whole arena, for tools and debugging. On a CUDA device this is a host copy of the
    /// device arena, taken on the first call after the arena last changed (a step,
    /// `set_param*`, `load_params*`, `reset`; inputs reach the device only with the next
    /// step), and empty if the copy fails.
    pub fn arena(&self) -> &[u8] {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &self.exec {
            return c.arena().unwrap_or(&[]);
        }
        self.arena.bytes()
    }

    /// Number of threads `parallel` kernels run on: one per available core unless
    /// [`Session::set_threads`] says otherwise; always 1 on a CUDA device.
    pub fn threads(&self) -> usize {
        match &self.exec {
            Executor::Cpu(c) => c.threads(),
            #[cfg(feature = "cuda")]
            Executor::Cuda(_) => 1,
        }
    }

    /// Where the kernels' machine code came from: the artifact's SASS, the driver's
    /// compile of its PTX, or Cranelift on the CPU.
    pub fn code_origin(&self) -> CodeOrigin {
        match &self.exec {
            Executor::Cpu(_) => CodeOrigin::Cranelift,
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.code_origin().clone(),
        }
    }

    /// Whether [`Session::run`] replays the step as a CUDA graph (CUDA sessions; on by
    /// default). Always `false` on the CPU.
    pub fn cuda_graph(&self) -> bool {
        match &self.exec {
            Executor::Cpu(_) => false,
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.graph_enabled(),
        }
    }

    /// Turns CUDA graph replay on or off (for debugging: with it off, every kernel is
    /// launched on its own, in launch order, so a failing launch names its kernel). A CUDA
    /// session builds the step's graph when it is created (or at the next step after graphs
    /// are turned back on) and replays it at every step. No effect on the CPU.
    pub fn set_cuda_graph(&mut self, enabled: bool) {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &mut self.exec {
            c.set_graph(enabled);
        }
        let _ = enabled;
    }

    /// Device time of the last step's kernels in milliseconds, from CUDA events around the
    /// launches (input and output copies excluded); `None` on the CPU or before a step.
    pub fn last_step_device_ms(&self) -> Option<f32> {
        match &self.exec {
            Executor::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.last_device_ms(),
        }
    }

    /// Time of every kernel of one step in milliseconds, in launch order (a profiling aid;
    /// it runs a step, so a training step updates the params): device time between CUDA
    /// events, one launch at a time, on a GPU; wall time of each launch (on the session's
    /// threads) on the CPU. Inputs are as for [`Session::run`].
    pub fn profile_kernels(&mut self) -> Result<Vec<(String, f32)>> {
        let base = self.arena.base();
        match &mut self.exec {
            Executor::Cpu(c) => c.profile(base, self.arena.len()),
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.profile(),
        }
    }

    /// `(free, total)` bytes of memory on the session's CUDA device (`cuMemGetInfo`), the
    /// arena and the runtime's own use included. On the CPU this is an
    /// [`Error::UnsupportedDevice`].
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        match &self.exec {
            Executor::Cpu(_) => Err(Error::UnsupportedDevice {
                device: self.device,
                reason: "device memory is reported for CUDA sessions only",
            }),
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.memory_info(),
        }
    }

    /// Device bytes this CUDA session allocated itself: the drop in free device memory
    /// (`cuMemGetInfo`) since its context was ready, i.e. the arena plus the runtime's
    /// overhead (loaded module, CUDA graph, events), without the CUDA context that every
    /// CUDA program pays (PyTorch's `max_memory_allocated` leaves it out too). Other
    /// processes allocating meanwhile would count as well. On the CPU this is an
    /// [`Error::UnsupportedDevice`].
    pub fn session_device_bytes(&self) -> Result<usize> {
        match &self.exec {
            Executor::Cpu(_) => Err(Error::UnsupportedDevice {
                device: self.device,
                reason: "device memory is reported for CUDA sessions only",
            }),
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => {
                let (free, _) = c.memory_info()?;
                Ok(c.free_at_start().saturating_sub(free))
            }
        }
    }

    /// Runs `parallel` kernels on `threads` threads from now on, the calling thread
    /// included (0 means one per available core). Worker threads are started here, not in
    /// [`Session::run`], and stopped when the session is dropped or the count changes. A
    /// CUDA session ignores it.
    pub fn set_threads(&mut self, threads: usize) -> Result<()> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        match &mut self.exec {
            Executor::Cpu(c) => c.set_threads(threads),
            #[cfg(feature = "cuda")]
            Executor::Cuda(_) => Ok(()),
        }
    }

    /// Where the bytes of input `index` (arena `range`) are written: the arena on the CPU,
    /// the input's pinned staging buffer on a CUDA device (copied at the next step).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn input_target(&mut self, index: usize, range: Range<usize>) -> Result<&mut [u8]> {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &mut self.exec {
            return c
                .input_buffer(index)
                .ok_or_else(|| Error::BadManifest(format!("no input number {index}")));
        }
        Ok(&mut self.arena.bytes_mut()[range])
    }

    /// The bytes of output `index` (arena `range`) as of the last step.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn output_source(&self, index: usize, range: Range<usize>) -> Result<&[u8]> {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &self.exec {
            return c
                .output(index)
                .ok_or_else(|| Error::BadManifest(format!("no output number {index}")));
        }
        Ok(&self.arena.bytes()[range])
    }

    /// The persistent region `[0, plan.persistent_bytes)` (on a CUDA device a host copy,
    /// kept until the arena next changes).
    fn persistent_region(&self) -> Result<&[u8]> {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &self.exec {
            return c.persistent();
        }
        Ok(&self.arena.bytes()[..self.model.manifest().plan.persistent_bytes as usize])
    }

    /// Copies each `(range, bytes)` into the arena.
    fn write_arena(&mut self, copies: &[(Range<usize>, &[u8])]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &mut self.exec {
            let copies: Vec<(usize, &[u8])> = copies.iter().map(|(r, b)| (r.start, *b)).collect();
            return c.write(&copies);
        }
        let arena = self.arena.bytes_mut();
        for (range, bytes) in copies {
            arena[range.clone()].copy_from_slice(bytes);
        }
        Ok(())
    }

    /// Writes input `name` from `data`, which must have the input's dtype and element count.
    ///
    /// On a CUDA device the data goes to a pinned host buffer and reaches the device at the
    /// start of the next [`Session::run`].
    ///
    /// An input the model uses as indices (class labels, embedding ids; the manifest's
    /// `index_bound`) must hold values in `[0, bound)`: otherwise the input is zeroed and
    /// the error names the first value outside.
    pub fn set_input<T: Element>(&mut self, name: &str, data: &[T]) -> Result<()> {
        let (index, range, bound) = {
            let (index, slot) = self.model.input_slot(name)?;
            check_elements::<T>(slot, data.len())?;
            (index, slot.range(), slot.index_bound)
        };
        let target = self.input_target(index, range)?;
        encode(data, target);
        check_indices(name, target, bound)
    }

    /// Writes input `name` from raw little-endian bytes; the length is checked, and index
    /// inputs' values as in [`Session::set_input`].
    pub fn set_input_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let (index, range, bound) = {
            let (index, slot) = self.model.input_slot(name)?;
            check_bytes(slot, bytes.len())?;
            (index, slot.range(), slot.index_bound)
        };
        let target = self.input_target(index, range)?;
        target.copy_from_slice(bytes);
        check_indices(name, target, bound)
    }

    /// Runs one step: every kernel in launch order. Allocates nothing.
    ///
    /// A training step updates params and optimizer state in place, so running again
    /// continues training. Inputs may share arena bytes with intermediates, so set every
    /// input again before the next `run`.
    ///
    /// On a CUDA device: copies the inputs set since the last step to the device, replays
    /// the step's CUDA graph (or launches the kernels one by one, see
    /// [`Session::set_cuda_graph`]), copies every output to its pinned host buffer and waits
    /// for all of it; a failing launch, kernel or copy is an [`Error::Cuda`].
    ///
    /// After the step, the artifact's in-step checks: ids the step computed out of range
    /// are [`Error::IndexOutOfRangeInStep`], and params its updates left NaN or infinite
    /// are [`Error::NonFiniteUpdate`] (unless [`Session::set_allow_nonfinite`]). Either way
    /// the step has run and its updates are written.
    pub fn run(&mut self) -> Result<()> {
        // A rank of a data-parallel step runs only through `DataParallel::run`.
        check_alone(&self.model)?;
        let base = self.arena.base();
        match &mut self.exec {
            Executor::Cpu(c) => c.run(base, self.arena.len())?,
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.run()?,
        }
        self.in_step_checks()
    }

    /// Fails with the first in-step check ([`artifact::Manifest::checks`]) the step did not
    /// pass: an index count above zero, or (unless [`Session::set_allow_nonfinite`]) a sum
    /// of the updated params that is not finite. Allocates nothing.
    pub(crate) fn in_step_checks(&self) -> Result<()> {
        let m = self.model.manifest();
        for c in &m.checks {
            let value = self.check_value(&c.output)?;
            match c.kind {
                artifact::CheckKind::IndexRange if value != 0.0 => {
                    return Err(Error::IndexOutOfRangeInStep {
                        what: c.what.clone(),
                        count: value as u64,
                        bound: c.bound,
                    });
                }
                artifact::CheckKind::FiniteUpdates
                    if !value.is_finite() && !self.allow_nonfinite =>
                {
                    return Err(Error::NonFiniteUpdate {
                        what: c.what.clone(),
                        sum: value,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The value of the check output `name` after the last step (0 where there is none).
    fn check_value(&self, name: &str) -> Result<f32> {
        let m = self.model.manifest();
        let Some(index) = m.outputs.iter().position(|o| o.name == name) else {
            return Ok(0.0);
        };
        let bytes = self.output_source(index, m.outputs[index].range())?;
        Ok(match bytes {
            [a, b, c, d] => f32::from_le_bytes([*a, *b, *c, *d]),
            _ => 0.0,
        })
    }

    /// Whether [`Session::run`] returns after a step that left params non-finite
    /// ([`artifact::CheckKind::FiniteUpdates`]) instead of failing with
    /// [`Error::NonFiniteUpdate`]; off by default. With it on, read
    /// [`Session::updated_params_l1`] to see such a step.
    pub fn set_allow_nonfinite(&mut self, allow: bool) {
        self.allow_nonfinite = allow;
    }

    /// The sum of the magnitudes of the params after the last step's updates (their L1
    /// norm, summed on the device in f32), or `None` when the artifact has no finite check
    /// (an inference program, a step built with `--no-finite-check`, or one with loss
    /// scaling, which skips non-finite steps itself). NaN or infinity: a gradient held NaN
    /// or infinity (every optimizer carries it into its param), or an update left f32's
    /// range.
    pub fn updated_params_l1(&self) -> Result<Option<f32>> {
        let m = self.model.manifest();
        match m
            .checks
            .iter()
            .find(|c| c.kind == artifact::CheckKind::FiniteUpdates)
        {
            Some(c) => self.check_value(&c.output).map(Some),
            None => Ok(None),
        }
    }

    /// Runs one step as a rank of a CPU [`DataParallel`]: `combine` runs each collective on
    /// the rank's arena with the other ranks.
    pub(crate) fn run_rank(
        &mut self,
        combine: &mut dyn FnMut(&artifact::Collective, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        match &mut self.exec {
            Executor::Cpu(c) => c.run_rank(self.arena.bytes_mut(), combine),
            #[cfg(feature = "cuda")]
            Executor::Cuda(_) => Err(Error::Collective {
                rank: 0,
                message: "a CUDA session's collectives go through NCCL".into(),
            }),
        }
    }

    /// Runs one step as a rank of a CUDA [`DataParallel`], its collectives through NCCL.
    #[cfg(feature = "cuda")]
    pub(crate) fn run_nccl(
        &mut self,
        rank: &mut nccl::Rank,
        stop: &std::sync::atomic::AtomicBool,
        graph: bool,
    ) -> Result<()> {
        match &mut self.exec {
            Executor::Cuda(c) => c.run_nccl(rank, stop, graph),
            Executor::Cpu(_) => Err(Error::Collective {
                rank: rank.rank(),
                message: "a CPU session has no NCCL communicator".into(),
            }),
        }
    }

    /// The CUDA context of a session on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_context(&mut self) -> Option<Arc<cudarc::driver::CudaContext>> {
        match &mut self.exec {
            Executor::Cuda(c) => Some(c.context()),
            Executor::Cpu(_) => None,
        }
    }

    /// Reads output `name` (valid after [`Session::run`] until inputs are set again).
    pub fn output<T: Element>(&self, name: &str) -> Result<Vec<T>> {
        let (index, slot) = self.model.output_slot(name)?;
        check_elements::<T>(slot, slot.bytes as usize / slot.dtype.size_bytes())?;
        Ok(decode(self.output_source(index, slot.range())?))
    }

    /// The raw little-endian bytes of output `name` (on a CUDA device: its pinned host
    /// buffer, filled at the end of every step).
    pub fn output_bytes(&self, name: &str) -> Result<&[u8]> {
        let (index, slot) = self.model.output_slot(name)?;
        self.output_source(index, slot.range())
    }

    /// Dynamic loss scaling's state, for a step compiled with it (`--amp f16`; the
    /// `amp.*` optimizer state), or `None`. The scale reads 0 until the first step, which
    /// uses the compiled initial scale.
    pub fn loss_scale(&self) -> Result<Option<LossScaleState>> {
        let names = ["amp.loss_scale", "amp.growth_tracker", "amp.skipped_steps"];
        if !names.iter().all(|n| self.model.persistent_slot(n).is_ok()) {
            return Ok(None);
        }
        let one = |name: &str| -> Result<f32> {
            Ok(self.param::<f32>(name)?.first().copied().unwrap_or(0.0))
        };
        Ok(Some(LossScaleState {
            scale: one(names[0])?,
            growth_tracker: one(names[1])?,
            skipped_steps: one(names[2])?,
        }))
    }

    /// Reads persistent tensor `name` (a param or optimizer state).
    pub fn param<T: Element>(&self, name: &str) -> Result<Vec<T>> {
        let slot = self.model.persistent_slot(name)?;
        check_elements::<T>(slot, slot.bytes as usize / slot.dtype.size_bytes())?;
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(c) = &self.exec {
            return Ok(decode(&c.read(slot.offset as usize, slot.bytes as usize)?));
        }
        Ok(decode(&self.arena.bytes()[slot.range()]))
    }

    /// The raw little-endian bytes of persistent tensor `name` (on a CUDA device, from a
    /// host copy of the persistent region taken on the first call after it last changed).
    pub fn param_bytes(&self, name: &str) -> Result<&[u8]> {
        let slot = self.model.persistent_slot(name)?;
        Ok(&self.persistent_region()?[slot.range()])
    }

    /// Overwrites persistent tensor `name` (a param or optimizer state).
    pub fn set_param<T: Element>(&mut self, name: &str, data: &[T]) -> Result<()> {
        let range = {
            let slot = self.model.persistent_slot(name)?;
            check_elements::<T>(slot, data.len())?;
            slot.range()
        };
        #[cfg(feature = "cuda")]
        if let Executor::Cuda(_) = &self.exec {
            let mut bytes = vec![0u8; range.len()];
            encode(data, &mut bytes);
            return self.write_arena(&[(range, &bytes)]);
        }
        encode(data, &mut self.arena.bytes_mut()[range]);
        Ok(())
    }

    /// Overwrites persistent tensor `name` from raw little-endian bytes.
    pub fn set_param_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let range = {
            let slot = self.model.persistent_slot(name)?;
            check_bytes(slot, bytes.len())?;
            slot.range()
        };
        self.write_arena(&[(range, bytes)])
    }

    /// Every persistent tensor (params and optimizer state) as safetensors bytes, by name.
    pub fn save_params_bytes(&self) -> Result<Vec<u8>> {
        let arena = self.persistent_region()?;
        let tensors = self
            .model
            .persistent()
            .iter()
            .map(|p| (&p.slot, &p.slot.shape, &arena[p.slot.range()]))
            .collect();
        serialize_params(&self.model, tensors)
    }

    /// Writes [`Session::save_params_bytes`] to `path`, atomically
    /// ([`fsutil::write_atomic`]: a failed write leaves the previous file as it was).
    pub fn save_params(&self, path: impl AsRef<Path>) -> Result<()> {
        write_params_file(path.as_ref(), &self.save_params_bytes()?)
    }

    /// Loads persistent tensors by name from safetensors bytes. The file may hold a subset
    /// of the model's persistent tensors (the others keep their values); a name the model
    /// does not have, a dtype or a shape that differs is an error, and then nothing is
    /// written.
    pub fn load_params_bytes(&mut self, bytes: &[u8]) -> Result<ParamsLoaded> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Safetensors(e.to_string()))?;
        let (found, report) = params_in_file(&self.model, &st, false)?;
        let copies: Vec<_> = found
            .iter()
            .map(|(p, data)| (p.slot.range(), *data))
            .collect();
        self.write_arena(&copies)?;
        Ok(report)
    }

    /// Reads `path` and loads it with [`Session::load_params_bytes`].
    pub fn load_params(&mut self, path: impl AsRef<Path>) -> Result<ParamsLoaded> {
        self.load_params_bytes(&read_params_file(path.as_ref())?)
    }
}

/// A params file's bytes, for [`Session::load_params`] and `DataParallel::load_params`.
pub(crate) fn read_params_file(path: &Path) -> Result<Vec<u8>> {
    fsutil::read_declared(path, 8, fsutil::safetensors_len).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes a params file atomically ([`fsutil::write_atomic`]: a failed write leaves the
/// previous file as it was).
pub(crate) fn write_params_file(path: &Path, bytes: &[u8]) -> Result<()> {
    fsutil::write_atomic(path, bytes).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F16 => safetensors::Dtype::F16,
        DType::Bf16 => safetensors::Dtype::BF16,
        DType::I32 => safetensors::Dtype::I32,
        DType::Bool => safetensors::Dtype::BOOL,
    }
}

fn dtype_from_st(d: safetensors::Dtype) -> Option<DType> {
    match d {
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::F16 => Some(DType::F16),
        safetensors::Dtype::BF16 => Some(DType::Bf16),
        safetensors::Dtype::I32 => Some(DType::I32),
        safetensors::Dtype::BOOL => Some(DType::Bool),
        _ => None,
    }
}
