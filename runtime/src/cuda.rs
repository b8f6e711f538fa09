//! The CUDA executor (feature `cuda`): loads the artifact's PTX with the CUDA driver and runs
//! its kernels on one stream, replaying the step as a CUDA graph whose edges are the
//! manifest's kernel dependencies (`after`), so that independent kernels may overlap.
//!
//! The kernel ABI is in `ARTIFACT.md`: one PTX module (compiled in pieces of whole entries
//! on several threads, see `load_ptx`, unless the artifact's SASS loads: `load_modules`),
//! one `.entry` per kernel, each taking
//! the arena's device address as its only parameter (`.param .u64 arena`) and launched with
//! the manifest's `launch` shape.
//!
//! A session owns, on the device, exactly one allocation (the arena, `cuMemAlloc`, so 256-byte
//! aligned) and, on the host, one page-locked buffer per input and per output:
//!
//! - `set_input*` writes the input's pinned buffer and marks it; `run` copies the marked
//!   inputs to the arena on the stream, launches the step (a CUDA graph of every kernel, or
//!   the kernels one by one in launch order when graphs are off), copies every output into its pinned buffer
//!   and waits for the stream. `output*` then read the pinned buffers.
//! - params, optimizer state and the whole arena are copied on demand; `param_bytes`,
//!   `save_params*` and `arena` keep a host copy until the arena next changes.
//!
//! The driver library is opened at run time (cudarc's `dynamic-loading`), so a build needs no
//! CUDA toolkit; a machine without a driver or a GPU gets [`Error::Cuda`], never a panic.
//!
//! Every public entry point makes the session's context current on the calling thread first,
//! so a session may move between threads (it is `Send`, not `Sync`).

use std::cell::OnceCell;
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use crate::artifact::{CollectiveOp, KernelEntry, Launch, Target};
use crate::{CodeOrigin, Error, Model, Result};

/// Alignment of every `cuMemAlloc` allocation: the largest arena alignment we can honour.
pub(crate) const DEVICE_ALIGN: u64 = 256;
/// A data-parallel rank's collectives go to NCCL in groups of at least this many bytes
/// (PyTorch DDP's default bucket, 25 MiB).
const BUCKET_BYTES: u64 = 25 << 20;

/// Records `ev` on `stream` (both live, of the current context).
fn record_event(ev: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the callers pass a live event and stream of the bound context.
    unsafe { result::event::record(ev, stream) }.map_err(driver_error("recording a stream event"))
}

/// Makes `stream` wait for the work `ev` last recorded (both live, of the current context).
fn wait_event(stream: sys::CUstream, ev: sys::CUevent) -> Result<()> {
    // SAFETY: the callers pass a live stream and event of the bound context.
    unsafe {
        result::stream::wait_event(stream, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
    }
    .map_err(driver_error("making a stream wait for another"))
}

/// The bytes of a bucket of collectives: [`BUCKET_BYTES`], or `TCC_BUCKET_MB` MiB (0: one
/// bucket per collective).
fn bucket_bytes() -> u64 {
    std::env::var("TCC_BUCKET_MB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(BUCKET_BYTES, |mb| mb << 20)
}

/// Streams a data-parallel rank's captured step spreads its kernels over (`launch_dag`).
const DAG_STREAMS: usize = 4;

/// Dynamic shared memory a kernel gets without opting in (`cudaFuncSetAttribute`).
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

fn cuda_error(context: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Cuda {
        context: context.into(),
        message: message.into(),
    }
}

/// `CUDA_ERROR_NAME: the driver's description`.
fn describe(e: DriverError) -> String {
    let name = format!("{:?}", e.0);
    match e.error_string() {
        Ok(s) => format!("{name}: {}", s.to_string_lossy()),
        Err(_) => name,
    }
}

fn driver_error(context: impl Into<String>) -> impl FnOnce(DriverError) -> Error {
    move |e| cuda_error(context, describe(e))
}

/// Runs `f`, turning a panic into [`Error::Cuda`]: cudarc panics when the driver library or
/// one of its symbols cannot be loaded (an old driver, say), and no CUDA failure may take
/// the caller's process down.
fn guard<R>(context: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "the CUDA bindings panicked".to_string());
            Err(cuda_error(context, message))
        }
    }
}

/// Checks that the driver library can be opened, so that the first driver call does not
/// panic inside cudarc.
fn driver_present() -> Result<()> {
    // SAFETY: this only tries to open the driver library under its usual names (and closes
    // it again), which runs the library's initialisers as any use of the driver would.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(cuda_error(
            "loading the CUDA driver",
            "the CUDA driver library (libcuda) was not found; is an NVIDIA driver installed \
             and on the library path?",
        ))
    }
}

/// Number of CUDA devices; 0 when the driver reports none.
pub(crate) fn device_count() -> Result<usize> {
    driver_present()?;
    guard("counting CUDA devices", || {
        match result::init() {
            Ok(()) => {}
            Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => return Ok(0),
            Err(e) => return Err(driver_error("initialising the CUDA driver")(e)),
        }
        let n = result::device::get_count().map_err(driver_error("counting CUDA devices"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    })
}

/// Page-locked host memory (`cuMemHostAlloc`), so copies between it and the arena are DMA
/// transfers that run asynchronously on the stream. Zeroed at allocation.
struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; moving it to another thread
// moves that ownership (the context it was allocated in is thread-safe).
unsafe impl Send for Pinned {}

impl Pinned {
    /// Allocates `len` bytes in `ctx`, which must be current on this thread.
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned, DriverError> {
        if len == 0 {
            return Ok(Pinned {
                ptr: NonNull::dangling(),
                len,
                ctx: ctx.clone(),
            });
        }
        // SAFETY: a plain allocation of `len` (> 0) bytes with default flags in the current
        // context; the memory is initialised below before any reference is made to it.
        let raw = unsafe { result::malloc_host(len, 0) }?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        // SAFETY: `ptr` points at `len` writable bytes that nothing else refers to yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Pinned {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes until `drop` (or dangling with
        // `len == 0`). The device writes into the buffer only between a copy enqueued by a
        // `&mut` method of the executor and the stream synchronisation that method does
        // before returning, so no reference handed out can observe a write in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference; no copy
        // reads the buffer while the executor is not inside a `&mut` method.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.len > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `ptr` came from `malloc_host` and is freed only here, once; the
            // executor synchronises its stream before dropping, so no copy uses it.
            let _ = unsafe { result::free_host(self.ptr.as_ptr().cast::<c_void>()) };
        }
    }
}

/// The one device allocation: `bytes` bytes at `ptr` (0 for an empty arena).
struct DeviceArena {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceArena {
    /// Allocates `bytes` bytes in `ctx`, which must be current on this thread.
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceArena> {
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: a plain `cuMemAlloc` of `bytes` (> 0) bytes in the current context; the
            // memory is zeroed before any kernel runs.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| {
                cuda_error(format!("allocating the {bytes}-byte arena"), describe(e))
            })?
        };
        Ok(DeviceArena {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        if self.ptr != 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `ptr` came from `malloc_sync` and is freed only here, once; the
            // executor synchronises its stream (and drops its graph) before dropping the
            // arena, so no kernel or copy uses it any more.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A loaded module (a cubin: a piece of the PTX the driver compiled, or of the SASS).
struct Module {
    raw: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: a module handle may be used from any thread once its context is current there,
// which every entry point of the executor makes sure of.
unsafe impl Send for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `raw` was loaded by `load_module` or `load_cubin` and is unloaded only here, once; the
        // graph and kernels that refer to its functions are dropped or unused by then.
        let _ = unsafe { result::module::unload(self.raw) };
    }
}

/// One kernel of the step, resolved in the module.
struct Kernel {
    name: String,
    func: sys::CUfunction,
    launch: Launch,
    /// The earlier kernels this one waits for in the step's graph (`None`: the previous one).
    after: Option<Vec<u32>>,
}

// SAFETY: a function handle may be used from any thread once its context is current there;
// it stays valid while the module (owned by the same executor) is loaded.
unsafe impl Send for Kernel {}

/// The step as a CUDA graph: a node per kernel, with an edge from each kernel it waits for
/// (the manifest's `after`), so that independent kernels may run at the same time.
struct Graph {
    graph: sys::CUgraph,
    /// Null until the graph is instantiated.
    exec: sys::CUgraphExec,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `CudaExecutor::build_graph` and are destroyed
        // once, here; the executor synchronises its stream before it drops the graph, so no
        // launch of it is still running. Errors cannot be reported from a drop.
        unsafe {
            if !self.exec.is_null() {
                let _ = result::graph::exec_destroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

// SAFETY: graph objects are not internally synchronised, so they must not be used from two
// threads at once; the executor owns this one exclusively and uses it only through `&mut
// self`, so moving it to another thread is fine.
unsafe impl Send for Graph {}

/// A staged input or output: its pinned host buffer and its place in the arena.
struct Staged {
    host: Pinned,
    offset: u64,
    /// Inputs: written since the last step, so `run` copies it to the device first.
    dirty: bool,
}

/// A CUDA event handle owned by one executor.
#[derive(Clone, Copy)]
struct Event(sys::CUevent);

// SAFETY: an event handle is a plain driver handle; the executor that owns it uses it only
// with its own context bound and its stream, from whichever thread holds the session.
unsafe impl Send for Event {}

/// The compiled module, the arena on the device, the staging buffers and the stream of one
/// session.
pub(crate) struct CudaExecutor {
    // Drop order (see `Drop`): the graph and buffers go before the module, the module before
    // the stream, the stream before the context.
    graph: Option<Graph>,
    use_graph: bool,
    /// CUDA events around the step's kernels (created once): device time of the last step.
    events: Option<(Event, Event)>,
    last_device_ms: Option<f32>,
    kernels: Vec<Kernel>,
    inputs: Vec<Staged>,
    outputs: Vec<Staged>,
    /// Host copies of the persistent region and of the whole arena, taken on demand and
    /// dropped whenever the arena changes.
    persistent_copy: OnceCell<Vec<u8>>,
    arena_copy: OnceCell<Vec<u8>>,
    /// An error of a method that cannot return one ([`CudaExecutor::reset`]), reported by
    /// the next `run`.
    pending: Option<Error>,
    arena: DeviceArena,
    /// Keep the kernels' functions loaded (the modules of `load_modules`).
    _modules: Vec<Module>,
    /// Where the loaded kernels' machine code came from.
    origin: CodeOrigin,
    model: Model,
    ordinal: usize,
    /// Free device memory once the context and stream existed, before the module, the
    /// arena and the graph: what the session itself then takes is measured from it.
    free_at_start: usize,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        // Nothing may still run or copy when the buffers, the arena and the module go.
        let _ = guard("dropping the session", || {
            let _ = self.ctx.bind_to_thread();
            let _ = self.stream.synchronize();
            self.graph = None;
            if let Some((a, b)) = self.events.take() {
                // SAFETY: the events were created by this executor and the stream is
                // synchronised, so no pending record refers to them.
                unsafe {
                    let _ = result::event::destroy(a.0);
                    let _ = result::event::destroy(b.0);
                }
            }
            Ok(())
        });
    }
}

/// Checks the parts of the manifest the CUDA executor needs, before touching the driver.
fn check_model(model: &Model) -> Result<()> {
    if model.target() != Target::Cuda {
        return Err(Error::BadManifest(format!(
            "the CUDA executor needs a `cuda` artifact, not `{}`",
            model.target()
        )));
    }
    let align = model.manifest().alignment;
    if align > DEVICE_ALIGN {
        return Err(cuda_error(
            "allocating the arena",
            format!(
                "the artifact asks for a {align}-byte aligned arena, but device allocations \
                 are only guaranteed to be {DEVICE_ALIGN}-byte aligned"
            ),
        ));
    }
    for k in &model.manifest().kernels {
        let launch = k.launch.as_ref().ok_or_else(|| {
            Error::BadManifest(format!(
                "kernel `{}` has no `launch` (grid, block, shared_bytes), which a `cuda` \
                 artifact needs for every kernel",
                k.name
            ))
        })?;
        if launch.grid.contains(&0) || launch.block.contains(&0) {
            return Err(Error::BadManifest(format!(
                "kernel `{}` has an empty launch shape (grid {:?}, block {:?})",
                k.name, launch.grid, launch.block
            )));
        }
        if k.name.contains('\0') {
            return Err(Error::BadManifest(format!(
                "kernel name {:?} contains a NUL byte",
                k.name
            )));
        }
    }
    if model.code().contains('\0') {
        return Err(Error::Compile {
            kernel: "(code section)".into(),
            message: "the PTX text contains a NUL byte".into(),
        });
    }
    Ok(())
}

/// Which module holds each entry (`None`: the first).
type Home = Box<dyn Fn(&str) -> Option<usize>>;

/// The module of each piece that holds each entry (`names` gives a piece's entries).
fn home_of<'a, I: Iterator<Item = &'a str>>(pieces: impl Iterator<Item = I>) -> Home {
    let mut home = std::collections::HashMap::new();
    for (i, names) in pieces.enumerate() {
        for name in names {
            home.insert(name.to_string(), i);
        }
    }
    Box::new(move |name: &str| home.get(name).copied())
}

/// Every kernel of the manifest, looked up in the module that holds it.
fn resolve_all(model: &Model, modules: &[Module], home: &Home) -> Result<Vec<Kernel>> {
    model
        .manifest()
        .kernels
        .iter()
        .map(|k| {
            let m = home(&k.name)
                .and_then(|i| modules.get(i))
                .or(modules.first())
                .ok_or_else(|| Error::Compile {
                    kernel: k.name.clone(),
                    message: "no module was loaded".into(),
                })?;
            resolve_kernel(m, k)
        })
        .collect()
}

/// Loads the model's kernels: from the artifact's SASS when it has some for this GPU
/// ([`load_sass`]), else from its PTX ([`load_ptx`]). SASS that does not load, or lacks a
/// kernel, falls back to the PTX, and the origin says why (as does an error of the PTX).
fn load_modules(
    ctx: &Arc<CudaContext>,
    model: &Model,
) -> Result<(Vec<Module>, Vec<Kernel>, CodeOrigin)> {
    let mut why = None;
    if let Some((sass, cubins)) = model.sass() {
        match ctx.compute_capability() {
            Ok((major, minor)) if sass.runs_on(major as u32, minor as u32) => {
                let loaded = load_sass(ctx, sass, &cubins).and_then(|(modules, home)| {
                    let kernels = resolve_all(model, &modules, &home)?;
                    Ok((modules, kernels))
                });
                match loaded {
                    Ok((modules, kernels)) => {
                        let origin = CodeOrigin::Sass {
                            arch: sass.arch.clone(),
                        };
                        return Ok((modules, kernels, origin));
                    }
                    Err(e) => why = Some(format!("its SASS for {} did not load: {e}", sass.arch)),
                }
            }
            Ok((major, minor)) => {
                why = Some(format!(
                    "its SASS is for {}, this GPU is sm_{major}{minor}",
                    sass.arch
                ))
            }
            Err(e) => why = Some(format!("the GPU's compute capability: {}", describe(e))),
        }
    }
    let ptx = load_ptx(ctx, model.code()).and_then(|(modules, home)| {
        let kernels = resolve_all(model, &modules, &home)?;
        Ok((modules, kernels))
    });
    match (ptx, why) {
        (Ok((modules, kernels)), why) => Ok((modules, kernels, CodeOrigin::Ptx { why })),
        (Err(Error::Compile { kernel, message }), Some(w)) => Err(Error::Compile {
            kernel,
            message: format!("{message} (the artifact's SASS was not used: {w})"),
        }),
        (Err(e), _) => Err(e),
    }
}

/// Loads the cubins of the artifact's `sass` section, one module each (nothing compiles).
fn load_sass(
    ctx: &Arc<CudaContext>,
    sass: &crate::artifact::Sass,
    cubins: &[&[u8]],
) -> Result<(Vec<Module>, Home)> {
    let modules = cubins
        .iter()
        .map(|c| load_cubin(ctx, c))
        .collect::<Result<Vec<_>>>()?;
    let home = home_of(
        sass.pieces
            .iter()
            .map(|p| p.entries.iter().map(String::as_str)),
    );
    Ok((modules, home))
}

/// Loads PTX `code`. Loading a PTX module compiles it on the loading thread, and the
/// driver does not compile two modules of a process at once (a cold load of gpt's 410
/// kernels took 49 s as one module and 66 s as 16 modules loaded from 16 threads), but its
/// linker does: the module is split into pieces of whole entries ([`crate::ptx::split`]),
/// compiled to cubins by up to one thread per host core (at most 16;
/// `TCC_CUDA_LOAD_THREADS=N` sets the count, 1 loads the PTX as one module), then loaded.
/// Where that fails, the PTX is loaded as one module, whose error carries the driver's log.
/// Returns the modules and which one holds each entry.
fn load_ptx(ctx: &Arc<CudaContext>, code: &str) -> Result<(Vec<Module>, Home)> {
    let threads = std::env::var("TCC_CUDA_LOAD_THREADS")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16)
        });
    // More pieces than threads, taken from a shared counter, so that one large kernel
    // does not hold up a thread's whole share.
    let pieces = crate::ptx::split(code, 4 * threads).unwrap_or_default();
    if threads > 1 && pieces.len() > 1 {
        if let Ok(modules) = load_pieces(ctx, &pieces, threads) {
            let home = home_of(pieces.iter().map(|p| crate::ptx::entry_names(p)));
            return Ok((modules, home));
        }
    }
    Ok((vec![load_module(ctx, code)?], Box::new(|_: &str| None)))
}

/// Compiles `pieces` on `threads` threads ([`link_cubin`]) and loads each cubin, in order.
fn load_pieces(ctx: &Arc<CudaContext>, pieces: &[String], threads: usize) -> Result<Vec<Module>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Vec<Vec<(usize, Result<Vec<u8>>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.min(pieces.len()))
            .map(|_| {
                let next = &next;
                s.spawn(move || {
                    let mut out = Vec::new();
                    if let Err(e) = ctx.bind_to_thread() {
                        out.push((0, Err(driver_error("making the CUDA context current")(e))));
                        return out;
                    }
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(p) = pieces.get(i) else { break };
                        out.push((i, link_cubin(p)));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![(
                        0,
                        Err(Error::Compile {
                            kernel: "(code section)".into(),
                            message: "a thread compiling the PTX panicked".into(),
                        }),
                    )]
                })
            })
            .collect()
    });
    let mut cubins: Vec<Option<Vec<u8>>> = vec![None; pieces.len()];
    for (i, r) in done.into_iter().flatten() {
        if let Some(slot) = cubins.get_mut(i) {
            *slot = Some(r?);
        }
    }
    cubins
        .into_iter()
        .map(|c| match c {
            Some(c) => load_cubin(ctx, &c),
            None => Err(Error::Compile {
                kernel: "(code section)".into(),
                message: "a piece of the PTX was not compiled".into(),
            }),
        })
        .collect()
}

/// Compiles PTX `code` to a cubin with the driver's linker (`cuLink*`), which, unlike
/// loading a PTX module, runs on several threads at once; nothing is loaded. The driver's
/// JIT cache serves a piece compiled before.
fn link_cubin(code: &str) -> Result<Vec<u8>> {
    let fail = |what: &str, e: DriverError| Error::Compile {
        kernel: "(code section)".into(),
        message: format!("{what} failed: {}", describe(e)),
    };
    let image = CString::new(code).map_err(|_| Error::Compile {
        kernel: "(code section)".into(),
        message: "the PTX text contains a NUL byte".into(),
    })?;
    let bytes = image.as_bytes_with_nul();
    let mut state: sys::CUlinkState = std::ptr::null_mut();
    // SAFETY: no options (null arrays of length 0); `state` is a valid place for the
    // handle. The context is current on this thread (the caller bound it).
    unsafe { sys::cuLinkCreate_v2(0, std::ptr::null_mut(), std::ptr::null_mut(), &mut state) }
        .result()
        .map_err(|e| fail("creating a PTX linker", e))?;
    struct Link(sys::CUlinkState);
    impl Drop for Link {
        fn drop(&mut self) {
            // SAFETY: the state was created above and is destroyed once, here; the cubin
            // it owns was copied out before.
            let _ = unsafe { sys::cuLinkDestroy(self.0) };
        }
    }
    let link = Link(state);
    // SAFETY: `bytes` is the NUL-terminated PTX (its length counts the NUL), alive for the
    // call; the name is a static C string; no options.
    unsafe {
        sys::cuLinkAddData_v2(
            link.0,
            sys::CUjitInputType::CU_JIT_INPUT_PTX,
            bytes.as_ptr().cast_mut().cast::<c_void>(),
            bytes.len(),
            c"tcc".as_ptr(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| fail("compiling a piece of the PTX", e))?;
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: `out` and `size` are valid places; the cubin stays owned by `link`.
    unsafe { sys::cuLinkComplete(link.0, &mut out, &mut size) }
        .result()
        .map_err(|e| fail("linking a piece of the PTX", e))?;
    if out.is_null() {
        return Err(Error::Compile {
            kernel: "(code section)".into(),
            message: "the PTX linker returned no cubin".into(),
        });
    }
    // SAFETY: the linker returned a non-null cubin of `size` bytes, valid until `link` is
    // destroyed (after this copy).
    Ok(unsafe { std::slice::from_raw_parts(out.cast::<u8>(), size) }.to_vec())
}

/// Loads a cubin (from [`link_cubin`], or an artifact's `sass` section) into the current
/// context (no compilation).
fn load_cubin(ctx: &Arc<CudaContext>, cubin: &[u8]) -> Result<Module> {
    // The driver follows the offsets in an ELF image's headers from the pointer alone.
    crate::ptx::check_elf(cubin).map_err(|e| Error::Compile {
        kernel: "(code section)".into(),
        message: format!("a cubin is malformed: {e}"),
    })?;
    let mut raw: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `check_elf` checked that `cubin` is an ELF64 image whose headers, segments and
    // sections all lie inside the slice, which stays alive for the call (what the code does
    // is the artifact's trust model, ARTIFACT.md); `raw` is a valid place for the handle;
    // the context is current.
    unsafe { sys::cuModuleLoadData(&mut raw, cubin.as_ptr().cast::<c_void>()) }
        .result()
        .map_err(|e| Error::Compile {
            kernel: "(code section)".into(),
            message: format!("loading a cubin failed: {}", describe(e)),
        })?;
    if raw.is_null() {
        return Err(Error::Compile {
            kernel: "(code section)".into(),
            message: "the driver returned no module".into(),
        });
    }
    Ok(Module {
        raw,
        ctx: ctx.clone(),
    })
}

/// Loads PTX `code` into the current context; a JIT failure carries the driver's log.
fn load_module(ctx: &Arc<CudaContext>, code: &str) -> Result<Module> {
    let compile_error = |message: String| Error::Compile {
        kernel: "(code section)".into(),
        message,
    };
    let image =
        CString::new(code).map_err(|_| compile_error("the PTX text contains a NUL byte".into()))?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The driver reads the buffer size from the pointer-sized value itself.
    let mut values = [
        log.as_mut_ptr().cast::<c_void>(),
        std::ptr::without_provenance_mut(log.len()),
    ];
    let mut raw: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated string that outlives the call; `options` and
    // `values` are two matching entries: the log buffer (writable, `log.len()` bytes, alive
    // for the call) and its size; `raw` is a valid place for the module handle. The context
    // is current (the caller bound it).
    let status = unsafe {
        sys::cuModuleLoadDataEx(
            &mut raw,
            image.as_ptr().cast::<c_void>(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    match status.result() {
        Ok(()) if !raw.is_null() => Ok(Module {
            raw,
            ctx: ctx.clone(),
        }),
        Ok(()) => Err(compile_error("the driver returned no module".into())),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
            let mut message = format!("loading the PTX module failed: {}", describe(e));
            if !text.is_empty() {
                message.push('\n');
                message.push_str(&text);
            }
            Err(compile_error(message))
        }
    }
}

/// Resolves `entry` in `module` and prepares it for its launch shape.
fn resolve_kernel(module: &Module, entry: &KernelEntry) -> Result<Kernel> {
    let launch = entry
        .launch
        .clone()
        .ok_or_else(|| Error::BadManifest(format!("kernel `{}` has no `launch`", entry.name)))?;
    let kernel_error = |message: String| Error::Compile {
        kernel: entry.name.clone(),
        message,
    };
    let name = CString::new(entry.name.as_str())
        .map_err(|_| kernel_error("the name contains a NUL byte".into()))?;
    // SAFETY: `module.raw` is a loaded module (it lives as long as `module`) and the context
    // is current.
    let func = unsafe { result::module::get_function(module.raw, name) }.map_err(|e| {
        kernel_error(match e.0 {
            sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                format!("the loaded code has no kernel `{}`", entry.name)
            }
            _ => format!("looking the kernel up failed: {}", describe(e)),
        })
    })?;
    if launch.shared_bytes > DEFAULT_DYNAMIC_SHARED {
        let bytes = i32::try_from(launch.shared_bytes).unwrap_or(i32::MAX);
        // SAFETY: `func` is a function of the loaded module; this only raises its limit of
        // dynamic shared memory.
        unsafe {
            result::function::set_function_attribute(
                func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
        }
        .map_err(|e| {
            kernel_error(format!(
                "the launch asks for {} bytes of dynamic shared memory, which the device \
                 refuses: {}",
                launch.shared_bytes,
                describe(e)
            ))
        })?;
    }
    Ok(Kernel {
        name: entry.name.clone(),
        func,
        launch,
        after: entry.after.clone(),
    })
}

impl CudaExecutor {
    /// Creates a context on device `ordinal`, allocates and initialises the arena, loads
    /// the module, resolves every kernel and builds the step as a CUDA graph.
    pub(crate) fn new(model: &Model, ordinal: usize) -> Result<CudaExecutor> {
        check_model(model)?;
        driver_present()?;
        guard("creating a CUDA session", || Self::create(model, ordinal))
    }

    fn create(model: &Model, ordinal: usize) -> Result<CudaExecutor> {
        if i32::try_from(ordinal).is_err() {
            return Err(cuda_error(
                format!("opening device cuda:{ordinal}"),
                "no such device",
            ));
        }
        let count = device_count()?;
        if ordinal >= count {
            return Err(cuda_error(
                format!("opening device cuda:{ordinal}"),
                if count == 0 {
                    "the driver reports no CUDA device".to_string()
                } else {
                    format!(
                        "no such device; this machine has {count} (cuda:0 to cuda:{})",
                        count - 1
                    )
                },
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error(format!(
            "creating a context on cuda:{ordinal}"
        )))?;
        // SAFETY: event tracking only concerns cudarc's `CudaSlice`s, which this executor
        // does not use (it orders everything on its one stream). Turning it off also keeps
        // `new_stream` from synchronising the whole (primary, shared) context, which could
        // disturb another session capturing its graph on another thread.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(driver_error("creating a stream"))?;
        ctx.bind_to_thread()
            .map_err(driver_error("making the CUDA context current"))?;
        let (free_at_start, _) = result::mem_get_info().map_err(driver_error(format!(
            "querying the memory of cuda:{ordinal}"
        )))?;

        let (modules, kernels, origin) = load_modules(&ctx, model)?;

        let arena = DeviceArena::new(&ctx, model.arena_bytes())?;
        let staged = |slots: &[crate::TensorSlot], what: &str| {
            slots
                .iter()
                .map(|s| {
                    let host = Pinned::new(&ctx, s.bytes as usize).map_err(|e| {
                        cuda_error(
                            format!("allocating the pinned host buffer of {what} `{}`", s.name),
                            describe(e),
                        )
                    })?;
                    Ok(Staged {
                        host,
                        offset: s.offset,
                        dirty: false,
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        let inputs = staged(model.inputs(), "input")?;
        let outputs = staged(model.outputs(), "output")?;

        let events = (|| {
            let a = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?;
            let b = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?;
            Ok::<_, DriverError>((Event(a), Event(b)))
        })()
        .map_err(driver_error("creating the timing events"))?;
        let mut exec = CudaExecutor {
            graph: None,
            use_graph: true,
            events: Some(events),
            last_device_ms: None,
            kernels,
            inputs,
            outputs,
            persistent_copy: OnceCell::new(),
            arena_copy: OnceCell::new(),
            pending: None,
            arena,
            _modules: modules,
            origin,
            model: model.clone(),
            ordinal,
            free_at_start,
            stream,
            ctx,
        };
        exec.init_arena()?;
        exec.build_graph()?;
        Ok(exec)
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("making the CUDA context current"))
    }

    fn sync(&self, context: &str) -> Result<()> {
        self.stream.synchronize().map_err(driver_error(context))
    }

    fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    fn invalidate_copies(&mut self) {
        self.persistent_copy.take();
        self.arena_copy.take();
    }

    /// Zeroes the arena and copies the initial persistent bytes to its start; zeroes the
    /// outputs' host buffers and forgets inputs set since the last step.
    fn init_arena(&mut self) -> Result<()> {
        self.bind()?;
        self.invalidate_copies();
        let enqueued = (|| {
            if self.arena.bytes > 0 {
                // SAFETY: the arena is a live allocation of `arena.bytes` bytes; the memset
                // runs on the session's stream, ordered with every other use of the arena.
                unsafe {
                    result::memset_d8_async(self.arena.ptr, 0, self.arena.bytes, self.cu_stream())
                }
                .map_err(driver_error("zeroing the arena"))?;
            }
            let init = self.model.persistent_init();
            if !init.is_empty() {
                // SAFETY: `init` (the model's bytes, alive for the whole call: the stream is
                // synchronised below before returning) is `plan.persistent_bytes` long, which
                // `Model::from_bytes` checked fits the arena; the copy runs on the stream.
                unsafe { result::memcpy_htod_async(self.arena.ptr, init, self.cu_stream()) }
                    .map_err(driver_error("copying the initial params to the arena"))?;
            }
            Ok(())
        })();
        let synced = self.sync("initialising the arena");
        enqueued.and(synced)?;
        for s in &mut self.inputs {
            s.dirty = false;
        }
        for s in &mut self.outputs {
            s.host.as_mut_slice().fill(0);
        }
        Ok(())
    }

    /// Enqueues every kernel of the step on the stream, in launch order (graphs off).
    fn launch_all(&self) -> Result<()> {
        for k in &self.kernels {
            self.launch_one(k)?;
        }
        Ok(())
    }

    /// Device time of each kernel of one step, launched one by one between events (a
    /// profiling aid: it runs the step, so params of a training step are updated).
    pub(crate) fn profile(&mut self) -> Result<Vec<(String, f32)>> {
        let Some((a, b)) = self.events else {
            return Ok(Vec::new());
        };
        self.invalidate_copies();
        guard("profiling the kernels", || {
            self.bind()?;
            let mut out = Vec::with_capacity(self.kernels.len());
            for k in &self.kernels {
                // SAFETY: the events live as long as the executor; recording on the
                // session's stream orders them around the one launch.
                unsafe { result::event::record(a.0, self.cu_stream()) }
                    .map_err(driver_error("recording a timing event"))?;
                self.launch_one(k)?;
                // SAFETY: as above.
                unsafe { result::event::record(b.0, self.cu_stream()) }
                    .map_err(driver_error("recording a timing event"))?;
                self.sync("profiling a kernel")?;
                // SAFETY: both events were recorded and have completed (stream synchronised).
                let ms = unsafe { result::event::elapsed(a.0, b.0) }
                    .map_err(driver_error("reading a timing event"))?;
                out.push((k.name.clone(), ms));
            }
            Ok(out)
        })
    }

    /// Device time of the last step's kernels (CUDA events), in milliseconds.
    pub(crate) fn code_origin(&self) -> &CodeOrigin {
        &self.origin
    }

    pub(crate) fn last_device_ms(&self) -> Option<f32> {
        self.last_device_ms
    }

    fn launch_one(&self, k: &Kernel) -> Result<()> {
        self.launch_on(k, self.cu_stream())
    }

    /// The context the session runs in (a data-parallel rank's NCCL communicator is made
    /// in it).
    pub(crate) fn context(&self) -> Arc<CudaContext> {
        Arc::clone(&self.ctx)
    }

    /// Runs one step as rank `rank` of a data-parallel step (see `launch_rank_step`: a
    /// captured CUDA graph from the third step on), waiting at most the rank's timeout for
    /// it.
    pub(crate) fn run_nccl(
        &mut self,
        rank: &mut crate::nccl::Rank,
        stop: &std::sync::atomic::AtomicBool,
        graph: bool,
    ) -> Result<()> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        if rank.aborted() {
            return Err(Error::Collective {
                rank: rank.rank(),
                message: "the communicator was aborted after an earlier failure; make a new \
                          DataParallel"
                    .into(),
            });
        }
        self.invalidate_copies();
        guard("running a data-parallel step", || {
            self.bind()?;
            let enqueued = (|| {
                self.copy_inputs()?;
                if let Some((a, _)) = self.events {
                    // SAFETY: the event lives as long as the executor; recorded on the
                    // session's stream before the step's kernels.
                    unsafe { result::event::record(a.0, self.cu_stream()) }
                        .map_err(driver_error("recording a timing event"))?;
                }
                self.launch_rank_step(rank, graph)?;
                if let Some((_, b)) = self.events {
                    // SAFETY: as above, after the step (the other streams joined).
                    unsafe { result::event::record(b.0, self.cu_stream()) }
                        .map_err(driver_error("recording a timing event"))?;
                }
                self.copy_outputs()
            })();
            let synced = match &enqueued {
                Ok(()) => self.sync_within(rank, stop),
                Err(_) => Ok(()),
            };
            if enqueued.is_err() || synced.is_err() {
                // Stop this rank's collectives (a peer would wait for them), then let every
                // stream drain: nothing may still write the arena or the pinned buffers.
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                rank.abort();
                let _ = self.sync("stopping a failed data-parallel step");
                let _ = rank.comm_stream.synchronize();
                let _ = rank.after_stream.synchronize();
            }
            enqueued.and(synced)?;
            if let Some((a, b)) = self.events {
                // SAFETY: both events were recorded in this step and the stream is
                // synchronised, so they have completed.
                self.last_device_ms = unsafe { result::event::elapsed(a.0, b.0) }.ok();
            }
            Ok(())
        })
    }

    /// Waits for the session's stream, at most the rank's timeout, watching the
    /// communicator for errors; on either, aborts the communicator.
    /// Polls at most every 0.1 ms (a cap of 2 ms left up to 2 ms between the step's end and
    /// the host seeing it).
    fn sync_within(
        &self,
        rank: &mut crate::nccl::Rank,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<()> {
        let deadline = std::time::Instant::now() + rank.timeout;
        let mut nap = std::time::Duration::from_micros(20);
        loop {
            // SAFETY: the session's live stream.
            match unsafe { sys::cuStreamQuery(self.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    rank.abort();
                    return Err(cuda_error(
                        "running a data-parallel step (a kernel, copy or collective failed)",
                        describe(DriverError(e)),
                    ));
                }
            }
            if let Err(e) = rank.async_error() {
                rank.abort();
                return Err(e);
            }
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                rank.abort();
                return Err(Error::Collective {
                    rank: rank.rank(),
                    message: "stopped: another rank failed".into(),
                });
            }
            if std::time::Instant::now() >= deadline {
                rank.abort();
                return Err(Error::Collective {
                    rank: rank.rank(),
                    message: format!(
                        "the step did not finish within {:.0} s (a rank stopped, or a \
                         collective waits for one that never came); the communicator was \
                         aborted",
                        rank.timeout.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_micros(100));
        }
    }

    /// Launches one data-parallel step on the session's stream: kernel by kernel for the
    /// first two steps (NCCL makes its connections and buffers on first use), then, with
    /// `graph` (decided for all ranks together by `DataParallel::run`), captured once as a
    /// CUDA graph (`launch_dag`) which every later step replays. A capture that fails is an
    /// error of the step: the ranks must issue the same collectives in the same groups, so
    /// one rank cannot fall back alone (`TCC_RANK_GRAPH=0` turns capture off for all).
    fn launch_rank_step(&self, rank: &mut crate::nccl::Rank, graph: bool) -> Result<()> {
        let stream = self.cu_stream();
        if !graph {
            return self.launch_ranked(rank);
        }
        if let Some((_, exec)) = rank.graph {
            // SAFETY: `exec` was instantiated from a capture of this session's step on
            // this stream and is destroyed only with the rank (after synchronising) or on
            // abort; the arena and the events it uses live as long as the session and the
            // rank.
            return unsafe { result::graph::launch(exec, stream) }
                .map_err(driver_error("launching the rank's step graph"));
        }
        if rank.eager_steps < 2 {
            rank.eager_steps = rank.eager_steps.saturating_add(1);
            return self.launch_ranked(rank);
        }
        // SAFETY: this session's live stream, captured from this thread only (thread-local
        // mode: other ranks' threads capture their own streams at the same time).
        unsafe {
            result::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(driver_error("capturing the rank's step"))?;
        let launched = self.launch_dag(rank);
        // SAFETY: ends the capture begun above on the same stream, whatever happened in
        // between (a failed launch leaves the capture invalidated, not open).
        let ended = unsafe { result::stream::end_capture(stream) };
        let captured = match (launched, ended) {
            (Ok(()), Ok(g)) if !g.is_null() => {
                // SAFETY: a graph just captured from this context.
                match unsafe { result::graph::instantiate(g, sys::CUgraphInstantiate_flags(0)) } {
                    Ok(exec) => Ok((g, exec)),
                    Err(e) => {
                        // SAFETY: the graph above, destroyed once.
                        let _ = unsafe { result::graph::destroy(g) };
                        Err(describe(e))
                    }
                }
            }
            (Ok(()), Ok(_)) => Err("the capture gave no graph".to_string()),
            (Err(e), ended) => {
                if let Ok(g) = ended {
                    if !g.is_null() {
                        // SAFETY: as above.
                        let _ = unsafe { result::graph::destroy(g) };
                    }
                }
                Err(e.to_string())
            }
            (Ok(()), Err(e)) => Err(describe(e)),
        };
        let (g, exec) = captured.map_err(|why| Error::Collective {
            rank: rank.rank(),
            message: format!(
                "capturing the step as a CUDA graph: {why} (TCC_RANK_GRAPH=0 launches it \
                 kernel by kernel instead)"
            ),
        })?;
        rank.graph = Some((g, exec));
        // SAFETY: as for a replay above.
        unsafe { result::graph::launch(exec, stream) }
            .map_err(driver_error("launching the rank's step graph"))
    }

    /// The kernels kernel `i` waits for: its manifest `after`, or the one before it.
    fn waits_for(&self, i: usize) -> Vec<usize> {
        match &self.kernels[i].after {
            Some(a) => a.iter().map(|&d| d as usize).collect(),
            None => i.checked_sub(1).into_iter().collect(),
        }
    }

    /// The step as a graph for a capture on the session's stream: each kernel goes on one
    /// of [`DAG_STREAMS`] streams after waiting for the events of the kernels its `after`
    /// names (on another stream), so the captured graph has the manifest's edges and
    /// independent kernels overlap as in a single session's graph; the collectives go in
    /// buckets on the communication stream, each after the kernels its
    /// collectives wait for, and a kernel that waits for a collective waits for its bucket.
    /// One stream order of the collectives, the same on every rank (launch order); buckets
    /// of `bucket_bytes()` as `launch_ranked`'s.
    fn launch_dag(&self, rank: &mut crate::nccl::Rank) -> Result<()> {
        let entries = &self.model.manifest().kernels;
        let n = self.kernels.len();
        let compute = self.cu_stream();
        let comm = rank.comm_stream.cu_stream();
        let streams: Vec<sys::CUstream> = (0..DAG_STREAMS)
            .map(|i| rank.dag_stream(i))
            .collect::<Result<_>>()?;
        let deps = |i: usize| self.waits_for(i);
        let (record, wait) = (record_event, wait_event);
        // Events: kernel i's is i; bucket b's is n + b (at most n buckets); the fork 2n;
        // the joins 2n + 1 + s.
        let fork = rank.dag_event(2 * n)?;
        record(fork, compute)?;
        for &s in streams.iter().chain([&comm]) {
            wait(s, fork)?;
        }
        let mut stream_of: Vec<Option<usize>> = vec![None; n];
        let mut last_on: Vec<Option<usize>> = vec![None; DAG_STREAMS];
        let mut bucket_of: Vec<Option<usize>> = vec![None; n];
        let mut pending: Vec<usize> = Vec::new();
        let mut pending_bytes = 0u64;
        let mut buckets = 0usize;
        let mut next = 0usize;
        let bucket_bytes = bucket_bytes();
        let flush = |rank: &mut crate::nccl::Rank,
                     pending: &mut Vec<usize>,
                     pending_bytes: &mut u64,
                     buckets: &mut usize,
                     bucket_of: &mut Vec<Option<usize>>,
                     stream_of: &[Option<usize>]|
         -> Result<()> {
            if pending.is_empty() {
                return Ok(());
            }
            // The kernels each collective waits for (and an all-reduce's own copy kernel);
            // earlier buckets are before it on this stream.
            let mut waited: Vec<usize> = Vec::new();
            for &i in pending.iter() {
                for d in deps(i).into_iter().chain([i]) {
                    if stream_of[d].is_some() && !waited.contains(&d) {
                        waited.push(d);
                        wait(comm, rank.dag_event(d)?)?;
                    }
                }
            }
            self.enqueue_bucket(rank, pending, comm, false)?;
            record(rank.dag_event(n + *buckets)?, comm)?;
            for &i in pending.iter() {
                bucket_of[i] = Some(*buckets);
            }
            *buckets += 1;
            pending.clear();
            *pending_bytes = 0;
            Ok(())
        };
        for i in 0..n {
            let ds = deps(i);
            if ds.iter().any(|d| pending.contains(d)) {
                flush(
                    rank,
                    &mut pending,
                    &mut pending_bytes,
                    &mut buckets,
                    &mut bucket_of,
                    &stream_of,
                )?;
            }
            let collective = entries[i].collective.as_ref();
            // A kernel node: every kernel but the collectives', except an all-reduce's copy.
            let launched = match collective {
                None => true,
                Some(c) => c.op == CollectiveOp::AllReduceSum && !c.in_place,
            };
            if launched {
                // Continue the stream of a kernel waited for, where it is that stream's last.
                let s = ds
                    .iter()
                    .find_map(|&d| stream_of[d].filter(|&s| last_on[s] == Some(d)))
                    .unwrap_or_else(|| {
                        next = (next + 1) % DAG_STREAMS;
                        next
                    });
                for &d in &ds {
                    if let Some(b) = bucket_of[d] {
                        wait(streams[s], rank.dag_event(n + b)?)?;
                    } else if stream_of[d].is_some_and(|t| t != s) {
                        wait(streams[s], rank.dag_event(d)?)?;
                    }
                }
                self.launch_on(&self.kernels[i], streams[s])?;
                record(rank.dag_event(i)?, streams[s])?;
                stream_of[i] = Some(s);
                last_on[s] = Some(i);
            }
            if let Some(c) = collective {
                pending.push(i);
                pending_bytes += c.bytes.max(c.input.map_or(0, |i| i.bytes));
                if pending_bytes >= bucket_bytes {
                    flush(
                        rank,
                        &mut pending,
                        &mut pending_bytes,
                        &mut buckets,
                        &mut bucket_of,
                        &stream_of,
                    )?;
                }
            }
        }
        flush(
            rank,
            &mut pending,
            &mut pending_bytes,
            &mut buckets,
            &mut bucket_of,
            &stream_of,
        )?;
        for (k, &s) in streams.iter().chain([&comm]).enumerate() {
            let join = rank.dag_event(2 * n + 1 + k)?;
            record(join, s)?;
            wait(compute, join)?;
        }
        Ok(())
    }

    /// Enqueues one bucket's collectives (kernel indices `pending`) on `comm`, the rank's
    /// communication stream, after whatever `comm` already waits for: the shards' copies,
    /// then one NCCL group. With `copies`, each all-reduce's kernel (copying its gradient
    /// into the bytes the ranks reduce) goes first on `comm`; without, the caller launched
    /// it already.
    fn enqueue_bucket(
        &self,
        rank: &mut crate::nccl::Rank,
        pending: &[usize],
        comm: sys::CUstream,
        copies: bool,
    ) -> Result<()> {
        let entries = &self.model.manifest().kernels;
        // Each all-reduce's kernel copies its gradient into the bytes the ranks reduce
        // (skipped where they are the gradient's own); a shard is a copy within the
        // rank. The other collectives' kernels are placeholders, never launched.
        for &i in pending.iter() {
            let Some(c) = &entries[i].collective else {
                continue;
            };
            match (c.op, c.input) {
                (CollectiveOp::AllReduceSum, _) if copies && !c.in_place => {
                    self.launch_on(&self.kernels[i], comm)?;
                }
                (CollectiveOp::Shard, Some(input)) => {
                    // Block `rank` of the input, zero past its end.
                    let from = (rank.rank() as u64)
                        .saturating_mul(c.bytes)
                        .min(input.bytes);
                    let copied = c.bytes.min(input.bytes - from);
                    let dst = self.arena.ptr + c.offset;
                    // SAFETY: both ranges lie in the arena (validated manifest: the
                    // result and the input are inside it and do not overlap, and
                    // `from + copied <= input.bytes`); this stream waits for the kernels
                    // that wrote the input (the caller's waits), and every later reader
                    // or writer of either range waits for this bucket.
                    unsafe {
                        if copied > 0 {
                            result::memcpy_dtod_async(
                                dst,
                                self.arena.ptr + input.offset + from,
                                copied as usize,
                                comm,
                            )
                            .map_err(driver_error("copying a param's shard"))?;
                        }
                        if copied < c.bytes {
                            result::memset_d8_async(
                                dst + copied,
                                0,
                                (c.bytes - copied) as usize,
                                comm,
                            )
                            .map_err(driver_error("zeroing a param shard's padding"))?;
                        }
                    }
                }
                _ => {}
            }
        }
        rank.group_start()?;
        let mut reduced = Ok(());
        for &i in pending.iter() {
            let Some(c) = &entries[i].collective else {
                continue;
            };
            let count = (c.bytes / c.dtype.size_bytes() as u64) as usize;
            let dtype = crate::nccl::nccl_dtype(c.dtype);
            let result = self.arena.ptr + c.offset;
            // SAFETY: `[offset, offset + bytes)` and the input's bytes lie in the arena
            // (validated manifest), a live allocation of this context, and do not
            // overlap. An all-reduce's bytes are its kernel's result: written by that
            // kernel just before on this stream (or, in place, by the compute kernels
            // this stream now waits for); the other ops' inputs were written by the
            // compute kernels this stream waits for. Every later kernel that reads or
            // writes the result lists the collective's kernel in its `after` (it writes
            // them), and every later writer of the input too (it reads them), so they
            // wait for this bucket's event.
            reduced = match (c.op, c.input) {
                (CollectiveOp::AllReduceSum, _) => unsafe {
                    rank.all_reduce_in_place(result, count, dtype)
                },
                (CollectiveOp::ReduceScatterSum, Some(input)) => unsafe {
                    rank.reduce_scatter(self.arena.ptr + input.offset, result, count, dtype)
                },
                (CollectiveOp::AllGather, Some(input)) => unsafe {
                    let sent = (input.bytes / c.dtype.size_bytes() as u64) as usize;
                    rank.all_gather(self.arena.ptr + input.offset, result, sent, dtype)
                },
                _ => Ok(()),
            };
            if reduced.is_err() {
                break;
            }
        }
        let ended = rank.group_end();
        reduced.and(ended)
    }

    /// Launches the step's kernels for a data-parallel rank on three streams:
    ///
    /// - the session's (compute) stream runs, in launch order, every kernel that does not
    ///   wait (through the manifest's `after`, transitively) for a collective;
    /// - the communication stream runs the collectives, in buckets of at least
    ///   [`BUCKET_BYTES`] in one NCCL group (PyTorch DDP's size), each after the compute
    ///   stream's work so far, then the copies of the collectives not reduced in place;
    /// - the waiting stream runs the kernels that wait for a collective (the optimizer's
    ///   updates and what follows them), in launch order, each after the bucket it needs.
    ///
    /// So the gradients are reduced while the compute stream goes on with the backward pass.
    /// A collective that itself waits for another's dependents joins the three streams
    /// first. At the end the compute stream waits for the other two.
    fn launch_ranked(&self, rank: &mut crate::nccl::Rank) -> Result<()> {
        let entries = &self.model.manifest().kernels;
        let n = self.kernels.len();
        let compute = self.cu_stream();
        let comm = rank.comm_stream.cu_stream();
        let later = rank.after_stream.cu_stream();
        let deps = |i: usize| self.waits_for(i);
        let (record, wait) = (record_event, wait_event);
        // Events: 0 marks the compute stream, 1 the waiting stream, 2 + b bucket b's end.
        let bucket_bytes = bucket_bytes();
        let ev_compute = rank.event(0)?;
        let ev_later = rank.event(1)?;
        // Both side streams start after the compute stream's work so far (the input
        // copies); in a capture this also brings them into it, so that every later wait
        // between the three streams is on captured work.
        record(ev_compute, compute)?;
        wait(comm, ev_compute)?;
        wait(later, ev_compute)?;
        let mut tainted = vec![false; n];
        let mut bucket_of: Vec<Option<usize>> = vec![None; n];
        let mut pending: Vec<usize> = Vec::new();
        let mut pending_bytes = 0u64;
        let mut buckets = 0usize;
        let mut queued: std::collections::VecDeque<usize> = Default::default();
        // Kernels before this index finished before everything launched since (joined).
        let mut joined = 0usize;
        let mut later_waited: Option<usize> = None;

        let flush = |rank: &mut crate::nccl::Rank,
                     pending: &mut Vec<usize>,
                     pending_bytes: &mut u64,
                     buckets: &mut usize,
                     bucket_of: &mut Vec<Option<usize>>|
         -> Result<()> {
            if pending.is_empty() {
                return Ok(());
            }
            record(ev_compute, compute)?;
            wait(comm, ev_compute)?;
            self.enqueue_bucket(rank, pending, comm, true)?;
            for &i in pending.iter() {
                bucket_of[i] = Some(*buckets);
            }
            let ev = rank.event(2 + *buckets)?;
            record(ev, comm)?;
            *buckets += 1;
            pending.clear();
            *pending_bytes = 0;
            Ok(())
        };
        // Launches the queued kernels whose collectives have all been enqueued, in order.
        let drain = |rank: &mut crate::nccl::Rank,
                     queued: &mut std::collections::VecDeque<usize>,
                     bucket_of: &[Option<usize>],
                     later_waited: &mut Option<usize>|
         -> Result<()> {
            let mut marked = false;
            while let Some(&q) = queued.front() {
                let mut need: Option<usize> = None;
                let mut ready = true;
                for d in deps(q) {
                    if entries[d].collective.is_some() {
                        match bucket_of[d] {
                            Some(b) => need = need.max(Some(b)),
                            None => ready = false,
                        }
                    }
                }
                if !ready {
                    break;
                }
                if !marked {
                    record(ev_compute, compute)?;
                    wait(later, ev_compute)?;
                    marked = true;
                }
                if let Some(b) = need {
                    if *later_waited < Some(b) {
                        wait(later, rank.event(2 + b)?)?;
                        *later_waited = Some(b);
                    }
                }
                self.launch_on(&self.kernels[q], later)?;
                queued.pop_front();
            }
            Ok(())
        };
        for i in 0..n {
            let waits = deps(i)
                .into_iter()
                .any(|d| d >= joined && (tainted[d] || entries[d].collective.is_some()));
            if let Some(c) = &entries[i].collective {
                if waits {
                    // Everything so far first: the three streams join.
                    flush(
                        rank,
                        &mut pending,
                        &mut pending_bytes,
                        &mut buckets,
                        &mut bucket_of,
                    )?;
                    drain(rank, &mut queued, &bucket_of, &mut later_waited)?;
                    record(ev_later, later)?;
                    wait(compute, ev_later)?;
                    if buckets > 0 {
                        wait(compute, rank.event(1 + buckets)?)?;
                    }
                    joined = i;
                }
                pending.push(i);
                pending_bytes += c.bytes.max(c.input.map_or(0, |i| i.bytes));
                tainted[i] = true;
                if pending_bytes >= bucket_bytes {
                    flush(
                        rank,
                        &mut pending,
                        &mut pending_bytes,
                        &mut buckets,
                        &mut bucket_of,
                    )?;
                    drain(rank, &mut queued, &bucket_of, &mut later_waited)?;
                }
            } else if waits {
                tainted[i] = true;
                queued.push_back(i);
            } else {
                self.launch_on(&self.kernels[i], compute)?;
            }
        }
        flush(
            rank,
            &mut pending,
            &mut pending_bytes,
            &mut buckets,
            &mut bucket_of,
        )?;
        drain(rank, &mut queued, &bucket_of, &mut later_waited)?;
        if !queued.is_empty() {
            return Err(cuda_error(
                "launching a data-parallel step",
                "a kernel waits for a collective that was never enqueued",
            ));
        }
        record(ev_later, later)?;
        wait(compute, ev_later)?;
        if buckets > 0 {
            wait(compute, rank.event(1 + buckets)?)?;
        }
        Ok(())
    }

    fn launch_on(&self, k: &Kernel, stream: sys::CUstream) -> Result<()> {
        let mut arena: u64 = self.arena.ptr;
        {
            let mut params = [std::ptr::addr_of_mut!(arena).cast::<c_void>()];
            let Launch {
                grid,
                block,
                shared_bytes,
            } = k.launch;
            // SAFETY: `k.func` is an entry of `self.module`, which stays loaded while the
            // executor lives. A tcc kernel takes exactly one parameter, `.param .u64 arena`
            // (ARTIFACT.md), and `params` holds one pointer to a u64 that the driver reads
            // during this call. The arena it receives is a live device allocation of
            // `arena_bytes` bytes, which the compiler planned every access of the kernel to
            // stay inside; the kernel runs on the session's stream, ordered after the input
            // copies and before the output copies. Dynamic shared memory above 48 KiB was
            // opted into in `resolve_kernel`.
            unsafe {
                result::launch_kernel(
                    k.func,
                    (grid[0], grid[1], grid[2]),
                    (block[0], block[1], block[2]),
                    shared_bytes,
                    stream,
                    &mut params,
                )
            }
            .map_err(|e| {
                cuda_error(
                    format!(
                        "launching kernel `{}` (grid {grid:?}, block {block:?}, {shared_bytes} \
                         bytes of dynamic shared memory)",
                        k.name
                    ),
                    describe(e),
                )
            })?;
        }
        Ok(())
    }

    /// Builds the step's CUDA graph, unless graphs are off, one is already there or the step
    /// has no kernel: a kernel node each, depending on the nodes of the kernels it waits for
    /// (`after`, checked to name earlier kernels when the artifact was read; the previous
    /// kernel where the artifact gives none), then instantiated and uploaded.
    fn build_graph(&mut self) -> Result<()> {
        if !self.use_graph || self.graph.is_some() || self.kernels.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let building = "building the step's CUDA graph";
        let mut raw: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; flags must be 0.
        unsafe { sys::cuGraphCreate(&mut raw, 0) }
            .result()
            .map_err(driver_error(building))?;
        // Owned from here: dropped (destroyed) on any error below.
        let mut graph = Graph {
            graph: raw,
            exec: std::ptr::null_mut(),
        };
        let mut nodes: Vec<sys::CUgraphNode> = Vec::with_capacity(self.kernels.len());
        let mut arena: u64 = self.arena.ptr;
        for (i, k) in self.kernels.iter().enumerate() {
            let deps: Vec<sys::CUgraphNode> = match &k.after {
                Some(after) => after
                    .iter()
                    .map(|&d| nodes.get(d as usize).copied())
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        cuda_error(
                            building,
                            format!("kernel `{}` waits for a kernel after it", k.name),
                        )
                    })?,
                None => i.checked_sub(1).map(|p| nodes[p]).into_iter().collect(),
            };
            let Launch {
                grid,
                block,
                shared_bytes,
            } = k.launch;
            let mut params = [std::ptr::addr_of_mut!(arena).cast::<c_void>()];
            let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
                func: k.func,
                gridDimX: grid[0],
                gridDimY: grid[1],
                gridDimZ: grid[2],
                blockDimX: block[0],
                blockDimY: block[1],
                blockDimZ: block[2],
                sharedMemBytes: shared_bytes,
                kernelParams: params.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            let mut node: sys::CUgraphNode = std::ptr::null_mut();
            // SAFETY: `graph.graph` is a live graph of this context and `deps` are nodes of
            // it. The driver copies the parameters during the call: `params` holds one
            // pointer to the u64 `arena`, the one parameter of every tcc kernel (as in
            // `launch_one`), which is the live device arena of `arena_bytes` bytes that
            // the kernel's accesses were planned to stay inside. `k.func` is an entry of
            // the loaded module, which outlives the graph (see the executor's drop order).
            unsafe {
                sys::cuGraphAddKernelNode_v2(
                    &mut node,
                    graph.graph,
                    deps.as_ptr(),
                    deps.len(),
                    &node_params,
                )
            }
            .result()
            .map_err(|e| {
                cuda_error(
                    format!("{building}: adding kernel `{}`", k.name),
                    describe(e),
                )
            })?;
            nodes.push(node);
        }
        // SAFETY: the graph is complete and valid (every node added above).
        graph.exec =
            unsafe { result::graph::instantiate(graph.graph, sys::CUgraphInstantiate_flags(0)) }
                .map_err(driver_error("instantiating the step's CUDA graph"))?;
        // SAFETY: the instantiated graph and the session's stream are live.
        unsafe { result::graph::upload(graph.exec, self.cu_stream()) }
            .map_err(driver_error("uploading the CUDA graph"))?;
        self.sync("uploading the CUDA graph")?;
        self.graph = Some(graph);
        Ok(())
    }

    /// Whether `run` replays a CUDA graph.
    pub(crate) fn graph_enabled(&self) -> bool {
        self.use_graph
    }

    /// Turns graph replay on or off; the graph is built again on the next `run` after it
    /// is turned back on.
    pub(crate) fn set_graph(&mut self, enabled: bool) {
        self.use_graph = enabled;
        if !enabled {
            let _ = guard("dropping the CUDA graph", || {
                let _ = self.ctx.bind_to_thread();
                self.graph = None;
                Ok(())
            });
        }
    }

    /// The pinned staging buffer of input `index`, marked to be copied at the next step.
    pub(crate) fn input_buffer(&mut self, index: usize) -> Option<&mut [u8]> {
        let s = self.inputs.get_mut(index)?;
        s.dirty = true;
        Some(s.host.as_mut_slice())
    }

    /// Output `index` as of the end of the last step.
    pub(crate) fn output(&self, index: usize) -> Option<&[u8]> {
        self.outputs.get(index).map(|s| s.host.as_slice())
    }

    /// Runs one step: copies the inputs set since the last step to the device, launches the
    /// kernels (replaying the graph), copies every output to its pinned buffer and waits.
    pub(crate) fn run(&mut self) -> Result<()> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        self.invalidate_copies();
        guard("running a step", || {
            self.bind()?;
            let enqueued = self.enqueue_step();
            // Wait even after a failed enqueue: nothing may still read or write the pinned
            // buffers once `run` returns.
            let synced = self.sync("running the step (a kernel or a copy failed)");
            enqueued.and(synced)?;
            if let Some((a, b)) = self.events {
                // SAFETY: both events were recorded in this step and the stream is
                // synchronised, so they have completed.
                self.last_device_ms = unsafe { result::event::elapsed(a.0, b.0) }.ok();
            }
            Ok(())
        })
    }

    fn enqueue_step(&mut self) -> Result<()> {
        let stream = self.cu_stream();
        self.copy_inputs()?;
        if self.use_graph {
            self.build_graph()?;
        }
        if let Some((a, _)) = self.events {
            // SAFETY: the event lives as long as the executor; it is recorded on the
            // session's stream, before the step's kernels.
            unsafe { result::event::record(a.0, stream) }
                .map_err(driver_error("recording a timing event"))?;
        }
        match &self.graph {
            // SAFETY: the graph was instantiated for this context; its kernels use only the
            // arena, which lives as long as the graph.
            Some(g) if self.use_graph => unsafe { result::graph::launch(g.exec, stream) }
                .map_err(driver_error("launching the step's CUDA graph"))?,
            _ => self.launch_all()?,
        }
        if let Some((_, b)) = self.events {
            // SAFETY: as above, after the step's kernels.
            unsafe { result::event::record(b.0, stream) }
                .map_err(driver_error("recording a timing event"))?;
        }
        self.copy_outputs()
    }

    /// Enqueues the copies of the inputs set since the last step to the arena.
    fn copy_inputs(&mut self) -> Result<()> {
        let stream = self.cu_stream();
        let base = self.arena.ptr;
        for (s, slot) in self.inputs.iter_mut().zip(self.model.inputs()) {
            if !s.dirty || s.host.len == 0 {
                continue;
            }
            s.dirty = false;
            // SAFETY: the source is the input's pinned buffer (alive while the executor is,
            // and not written before the stream is synchronised at the end of `run`); the
            // destination `[offset, offset + len)` lies inside the arena (validated manifest).
            unsafe { result::memcpy_htod_async(base + s.offset, s.host.as_slice(), stream) }
                .map_err(|e| {
                    cuda_error(
                        format!("copying input `{}` to the device", slot.name),
                        describe(e),
                    )
                })?;
        }
        Ok(())
    }

    /// Enqueues the copies of every output to its pinned host buffer.
    fn copy_outputs(&mut self) -> Result<()> {
        let stream = self.cu_stream();
        let base = self.arena.ptr;
        for (s, slot) in self.outputs.iter_mut().zip(self.model.outputs()) {
            if s.host.len == 0 {
                continue;
            }
            // SAFETY: the destination is the output's pinned buffer, which no reference
            // points into while `run` holds `&mut self`, until the stream is synchronised;
            // the source lies inside the arena (validated manifest).
            unsafe { result::memcpy_dtoh_async(s.host.as_mut_slice(), base + s.offset, stream) }
                .map_err(|e| {
                    cuda_error(
                        format!("copying output `{}` to the host", slot.name),
                        describe(e),
                    )
                })?;
        }
        Ok(())
    }

    /// Copies arena bytes `[offset, offset + out.len())` into `out` and waits.
    fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        guard("copying from the arena", || {
            self.bind()?;
            // SAFETY: callers pass a range inside the arena (validated manifest slots or the
            // whole arena); `out` is a live, exclusively borrowed host buffer, and the stream
            // is synchronised below before it is released.
            let copied = unsafe {
                result::memcpy_dtoh_async(out, self.arena.ptr + offset as u64, self.cu_stream())
            }
            .map_err(driver_error("copying from the arena to the host"));
            let synced = self.sync("copying from the arena to the host");
            copied.and(synced)
        })
    }

    /// Arena bytes `[offset, offset + len)`, copied to the host.
    pub(crate) fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.read_into(offset, &mut out)?;
        Ok(out)
    }

    /// The persistent region `[0, plan.persistent_bytes)`, copied on the first call after
    /// the arena last changed.
    pub(crate) fn persistent(&self) -> Result<&[u8]> {
        cached(&self.persistent_copy, || {
            self.read(0, self.model.manifest().plan.persistent_bytes as usize)
        })
    }

    /// The whole arena, copied on the first call after it last changed.
    pub(crate) fn arena(&self) -> Result<&[u8]> {
        cached(&self.arena_copy, || self.read(0, self.arena.bytes))
    }

    /// Copies each `(offset, bytes)` to the arena and waits.
    pub(crate) fn write(&mut self, copies: &[(usize, &[u8])]) -> Result<()> {
        self.invalidate_copies();
        guard("copying to the arena", || {
            self.bind()?;
            let enqueued = copies.iter().try_for_each(|&(offset, bytes)| {
                if bytes.is_empty() {
                    return Ok(());
                }
                // SAFETY: callers pass validated persistent slots, which lie inside the
                // arena; `bytes` stays borrowed until the stream is synchronised below.
                unsafe {
                    result::memcpy_htod_async(
                        self.arena.ptr + offset as u64,
                        bytes,
                        self.cu_stream(),
                    )
                }
                .map_err(driver_error("copying from the host to the arena"))
            });
            let synced = self.sync("copying from the host to the arena");
            enqueued.and(synced)
        })
    }

    /// Restores the arena to its state after creation; an error is reported by the next
    /// `run`.
    pub(crate) fn reset(&mut self) {
        if let Err(e) = guard("resetting the arena", || self.init_arena()) {
            self.pending = Some(e);
        }
    }

    /// Free device memory when the session's context was ready, before its own allocations.
    pub(crate) fn free_at_start(&self) -> usize {
        self.free_at_start
    }

    /// `(free, total)` bytes of device memory, from `cuMemGetInfo`.
    pub(crate) fn memory_info(&self) -> Result<(usize, usize)> {
        guard("querying device memory", || {
            self.bind()?;
            result::mem_get_info().map_err(driver_error(format!(
                "querying the memory of cuda:{}",
                self.ordinal
            )))
        })
    }
}

/// The value in `cell`, filled by `fill` if it is empty.
fn cached(cell: &OnceCell<Vec<u8>>, fill: impl FnOnce() -> Result<Vec<u8>>) -> Result<&[u8]> {
    if let Some(v) = cell.get() {
        return Ok(v);
    }
    let v = fill()?;
    Ok(cell.get_or_init(|| v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_turns_panics_into_errors() {
        let e = guard("testing", || -> Result<()> {
            panic!("Missing symbol cuFoo")
        })
        .unwrap_err();
        match e {
            Error::Cuda { context, message } => {
                assert_eq!(context, "testing");
                assert!(message.contains("cuFoo"), "{message}");
            }
            other => panic!("expected a CUDA error, got {other:?}"),
        }
        let e = guard("testing", || -> Result<()> {
            std::panic::panic_any(7u8);
        })
        .unwrap_err();
        assert!(e.to_string().contains("panicked"), "{e}");
    }

    #[test]
    fn cached_fills_once() {
        let cell = OnceCell::new();
        assert!(cached(&cell, || Err(cuda_error("a", "b"))).is_err());
        assert_eq!(cached(&cell, || Ok(vec![1, 2])).unwrap(), &[1, 2]);
        assert_eq!(cached(&cell, || Ok(vec![3])).unwrap(), &[1, 2]);
    }
}
