//! NCCL for the CUDA ranks of a [`crate::DataParallel`] step: the library is opened at run
//! time (as the CUDA driver is), one communicator per GPU, made on one thread per GPU.
//!
//! Why not cudarc's `nccl` module: its loader looks for `libnccl.so`, `libnccl.so.13`,
//! `.so.12`, … `.so.1` and takes no path, while the PyPI wheel PyTorch installs
//! (`nvidia-nccl-cu13`) ships `libnccl.so.2` only, in `site-packages/nvidia/nccl/lib/`.
//! Here the library is looked for as `$TCC_NCCL` (a path), then `libnccl.so.2` and
//! `libnccl.so` on the library path, then in the Python wheels' folders, so a GPU machine
//! with PyTorch needs nothing installed by hand. Only the eight functions below are used.
//!
//! NVLink SHARP (multicast objects) is turned off (`NCCL_NVLS_ENABLE=0`, unless the caller
//! set it), as the GPU machines this runs on require.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::{Error, Result};

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    internal: [c_char; 128],
}

type Comm = *mut c_void;
type NcclResult = c_int;

const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;
/// `ncclRedOp_t::ncclSum`.
pub(crate) const SUM: c_int = 0;

/// `ncclDataType_t` of a tensor dtype.
pub(crate) fn nccl_dtype(d: crate::artifact::DType) -> c_int {
    use crate::artifact::DType;
    match d {
        DType::Bool => 1, // ncclUint8
        DType::I32 => 2,  // ncclInt32
        DType::F16 => 6,  // ncclFloat16
        DType::F32 => 7,  // ncclFloat32
        DType::Bf16 => 9, // ncclBfloat16
    }
}

/// The functions used, resolved once.
struct Lib {
    _lib: libloading::Library,
    path: String,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        sys::CUstream,
    ) -> NcclResult,
    /// `ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream)`.
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        sys::CUstream,
    ) -> NcclResult,
    /// `ncclAllGather(send, recv, sendcount, dtype, comm, stream)`.
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        Comm,
        sys::CUstream,
    ) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
}

/// Where `libnccl.so.2` may be: the caller's path, the library path, Python wheels.
fn candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("TCC_NCCL") {
        out.push(PathBuf::from(p));
    }
    out.push("libnccl.so.2".into());
    out.push("libnccl.so".into());
    let mut roots: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                for sub in ["nvidia/nccl/lib", "nvidia/cu13/lib"] {
                    out.push(py.join(packages).join(sub).join("libnccl.so.2"));
                }
            }
        }
    }
    out
}

fn load() -> std::result::Result<Lib, String> {
    let tried = candidates();
    for path in &tried {
        if path.is_absolute() && !path.exists() {
            continue;
        }
        // SAFETY: opening a shared library runs its initialisers; NCCL's only set up its
        // own state.
        let Ok(lib) = (unsafe { libloading::Library::new(path) }) else {
            continue;
        };
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's public C function of this name, whose
                // signature (nccl.h, stable since NCCL 2.0) is the field's type.
                *unsafe { lib.get($name) }.map_err(|e| {
                    format!(
                        "{}: {}: {e}",
                        path.display(),
                        String::from_utf8_lossy($name)
                    )
                })?
            };
        }
        return Ok(Lib {
            get_unique_id: sym!(b"ncclGetUniqueId"),
            comm_init_rank: sym!(b"ncclCommInitRank"),
            all_reduce: sym!(b"ncclAllReduce"),
            reduce_scatter: sym!(b"ncclReduceScatter"),
            all_gather: sym!(b"ncclAllGather"),
            group_start: sym!(b"ncclGroupStart"),
            group_end: sym!(b"ncclGroupEnd"),
            comm_destroy: sym!(b"ncclCommDestroy"),
            comm_abort: sym!(b"ncclCommAbort"),
            comm_get_async_error: sym!(b"ncclCommGetAsyncError"),
            get_error_string: sym!(b"ncclGetErrorString"),
            path: path.display().to_string(),
            _lib: lib,
        });
    }
    Err(format!(
        "the NCCL library (libnccl.so.2) was not found; set TCC_NCCL to its path, or install \
         the `nvidia-nccl-cu13` wheel (tried {} places, e.g. {})",
        tried.len(),
        tried
            .iter()
            .take(3)
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

fn lib() -> std::result::Result<&'static Lib, String> {
    static LIB: OnceLock<std::result::Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn error(rank: usize, message: impl Into<String>) -> Error {
    Error::Collective {
        rank,
        message: message.into(),
    }
}

/// `what: ncclError description`.
fn check(lib: &Lib, rank: usize, what: &str, r: NcclResult) -> Result<()> {
    if r == NCCL_SUCCESS {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { (lib.get_error_string)(r) };
    let text = if text.is_null() {
        format!("NCCL error {r}")
    } else {
        // SAFETY: non-null, NUL-terminated, static (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    };
    Err(error(rank, format!("{what}: {text} (NCCL error {r})")))
}

/// One GPU's NCCL communicator, with the streams its collectives and the kernels that wait
/// for them run on.
pub(crate) struct Rank {
    comm: Comm,
    rank: usize,
    pub(crate) timeout: Duration,
    /// Collectives (and the copies after them) run here.
    pub(crate) comm_stream: Arc<CudaStream>,
    /// Kernels that wait for a collective run here, so the compute stream goes on.
    pub(crate) after_stream: Arc<CudaStream>,
    /// Cross-stream events: one per bucket, then two for the compute and the waiting streams.
    pub(crate) events: Vec<sys::CUevent>,
    ctx: Arc<CudaContext>,
    failed: bool,
    /// The step captured as a CUDA graph (kernels, copies and collectives), launched on
    /// the session's stream from the third step on; `None` before, or when graphs are off
    /// for the `DataParallel`.
    pub(crate) graph: Option<(sys::CUgraph, sys::CUgraphExec)>,
    /// Steps launched kernel by kernel so far (the first two warm NCCL up: connections and
    /// buffers are made on first use, which a capture cannot do).
    pub(crate) eager_steps: u32,
    /// The streams and events a capture spreads the step's kernels over (made on first
    /// use): captured, their waits are the step graph's edges.
    dag_streams: Vec<Arc<CudaStream>>,
    dag_events: Vec<sys::CUevent>,
}

// SAFETY: the communicator, streams and events belong to this rank's context and are used
// by one thread at a time (the rank's, with the context bound), as NCCL and CUDA allow.
unsafe impl Send for Rank {}

impl Rank {
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The library, while the communicator is live (not aborted).
    fn live(&self) -> Result<&'static Lib> {
        if self.failed {
            return Err(error(
                self.rank,
                "the communicator was aborted after an earlier failure; make a new \
                 DataParallel",
            ));
        }
        lib().map_err(|e| error(self.rank, e))
    }

    /// Whether the communicator was aborted.
    pub(crate) fn aborted(&self) -> bool {
        self.failed
    }

    /// The communicators of every session, made together (`ncclCommInitRank` on one thread
    /// per GPU, as each waits for all the others).
    pub(crate) fn init_all(
        sessions: &mut [crate::Session<'static>],
        timeout: Duration,
    ) -> Result<Vec<Rank>> {
        let lib = lib().map_err(|e| error(0, e))?;
        // `tcc` sets this at its start, while it has one thread; a library user should set
        // it before starting threads (setting it here races with threads reading the
        // environment).
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        // No buffer registration while a step is captured: it is a collective among the
        // ranks of this one process, made while each rank's thread is in a capture.
        if std::env::var_os("NCCL_GRAPH_REGISTER").is_none() {
            std::env::set_var("NCCL_GRAPH_REGISTER", "0");
        }
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer to an `ncclUniqueId`.
        check(lib, 0, "ncclGetUniqueId", unsafe {
            (lib.get_unique_id)(&mut id)
        })?;
        let n = sessions.len();
        let ctxs: Vec<Arc<CudaContext>> = sessions
            .iter_mut()
            .enumerate()
            .map(|(r, s)| {
                s.cuda_context()
                    .ok_or_else(|| error(r, "not a CUDA session"))
            })
            .collect::<Result<_>>()?;
        // `TCC_NCCL_FAIL_RANK=R`: rank R fails before joining (fault injection for the
        // tests: the others must not wait for it).
        let fail: Option<usize> = std::env::var("TCC_NCCL_FAIL_RANK")
            .ok()
            .and_then(|v| v.parse().ok());
        // One detached thread per rank: `ncclCommInitRank` waits until every rank joins, so
        // a rank that fails would leave the others waiting. The first error (or the
        // timeout) is returned at once; a rank still waiting then stays blocked on its
        // thread, which holds nothing of the caller's.
        let (send, receive) = std::sync::mpsc::channel::<(usize, Result<Rank>)>();
        for (rank, ctx) in ctxs.into_iter().enumerate() {
            let send = send.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("tcc-nccl-init-{rank}"))
                .spawn(move || {
                    let made = (|| -> Result<Rank> {
                        if fail == Some(rank) {
                            return Err(error(rank, "failed on purpose (TCC_NCCL_FAIL_RANK)"));
                        }
                        ctx.bind_to_thread()
                            .map_err(|e| error(rank, format!("binding the context: {e:?}")))?;
                        let streams = (ctx.new_stream(), ctx.new_stream());
                        let (Ok(comm_stream), Ok(after_stream)) = streams else {
                            return Err(error(rank, "creating the communication streams"));
                        };
                        let mut comm: Comm = std::ptr::null_mut();
                        // SAFETY: `comm` is a valid out-pointer; `id` came from
                        // ncclGetUniqueId; every rank of `0..n` calls this with the same id,
                        // each on its own thread with its GPU's context current.
                        let r = unsafe {
                            (lib.comm_init_rank)(&mut comm, n as c_int, id, rank as c_int)
                        };
                        check(lib, rank, &format!("ncclCommInitRank ({})", lib.path), r)?;
                        Ok(Rank {
                            comm,
                            rank,
                            timeout,
                            comm_stream,
                            after_stream,
                            events: Vec::new(),
                            ctx,
                            failed: false,
                            graph: None,
                            eager_steps: 0,
                            dag_streams: Vec::new(),
                            dag_events: Vec::new(),
                        })
                    })();
                    // The receiver is gone when another rank failed first: the rank made
                    // here is then dropped on this thread.
                    let _ = send.send((rank, made));
                });
            if let Err(e) = spawned {
                return Err(error(rank, format!("starting the NCCL init thread: {e}")));
            }
        }
        drop(send);
        let deadline = std::time::Instant::now() + timeout;
        let mut made: Vec<Option<Rank>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match receive.recv_timeout(left) {
                Ok((rank, Ok(r))) => made[rank] = Some(r),
                Ok((_, Err(e))) => return Err(e),
                Err(_) => {
                    let waiting: Vec<String> = made
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.is_none())
                        .map(|(i, _)| i.to_string())
                        .collect();
                    return Err(error(
                        0,
                        format!(
                            "NCCL init did not finish within {:.0} s (ranks {} still waiting)",
                            timeout.as_secs_f64(),
                            waiting.join(", ")
                        ),
                    ));
                }
            }
        }
        made.into_iter()
            .enumerate()
            .map(|(rank, r)| r.ok_or_else(|| error(rank, "no communicator was made")))
            .collect()
    }

    /// The event number `i`, made on first use.
    pub(crate) fn event(&mut self, i: usize) -> Result<sys::CUevent> {
        while self.events.len() <= i {
            let e =
                cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| error(self.rank, format!("creating an event: {e:?}")))?;
            self.events.push(e);
        }
        Ok(self.events[i])
    }

    /// The `i`-th stream of a captured step (made on first use).
    pub(crate) fn dag_stream(&mut self, i: usize) -> Result<sys::CUstream> {
        while self.dag_streams.len() <= i {
            let s = self
                .ctx
                .new_stream()
                .map_err(|e| error(self.rank, format!("creating a stream: {e:?}")))?;
            self.dag_streams.push(s);
        }
        Ok(self.dag_streams[i].cu_stream())
    }

    /// The `i`-th event of a captured step (made on first use).
    pub(crate) fn dag_event(&mut self, i: usize) -> Result<sys::CUevent> {
        while self.dag_events.len() <= i {
            let e =
                cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| error(self.rank, format!("creating an event: {e:?}")))?;
            self.dag_events.push(e);
        }
        Ok(self.dag_events[i])
    }

    pub(crate) fn group_start(&self) -> Result<()> {
        let lib = self.live()?;
        // SAFETY: no arguments; pairs with `group_end`.
        check(lib, self.rank, "ncclGroupStart", unsafe {
            (lib.group_start)()
        })
    }

    pub(crate) fn group_end(&self) -> Result<()> {
        let lib = self.live()?;
        // SAFETY: closes the group `group_start` opened on this thread.
        check(lib, self.rank, "ncclGroupEnd", unsafe { (lib.group_end)() })
    }

    /// Enqueues the in-place sum of `count` elements at device address `ptr` on the
    /// communication stream.
    ///
    /// # Safety
    /// `ptr .. ptr + count * size(dtype)` must lie in a live device allocation of this
    /// rank's context that nothing else writes until the stream reaches the collective.
    pub(crate) unsafe fn all_reduce_in_place(
        &self,
        ptr: u64,
        count: usize,
        dtype: c_int,
    ) -> Result<()> {
        let lib = self.live()?;
        let p = ptr as *mut c_void;
        // SAFETY: the caller's contract; in-place (send == receive) is allowed by NCCL.
        let r = unsafe {
            (lib.all_reduce)(
                p,
                p,
                count,
                dtype,
                SUM,
                self.comm,
                self.comm_stream.cu_stream(),
            )
        };
        check(lib, self.rank, "ncclAllReduce", r)
    }

    /// Enqueues on the communication stream: rank `r` receives at `recv` block `r` (of
    /// `count` elements) of the sum over the ranks of the `ranks · count` elements at
    /// `send`.
    ///
    /// # Safety
    /// Both ranges lie in live device allocations of this rank's context, do not overlap,
    /// and nothing else touches them until the stream reaches the collective.
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
    ) -> Result<()> {
        let lib = self.live()?;
        // SAFETY: the caller's contract.
        let r = unsafe {
            (lib.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                SUM,
                self.comm,
                self.comm_stream.cu_stream(),
            )
        };
        check(lib, self.rank, "ncclReduceScatter", r)
    }

    /// Enqueues on the communication stream: the `count` elements at `send` of every rank,
    /// in rank order, into the `ranks · count` elements at `recv`.
    ///
    /// # Safety
    /// As [`Rank::reduce_scatter`].
    pub(crate) unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: c_int,
    ) -> Result<()> {
        let lib = self.live()?;
        // SAFETY: the caller's contract.
        let r = unsafe {
            (lib.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                self.comm,
                self.comm_stream.cu_stream(),
            )
        };
        check(lib, self.rank, "ncclAllGather", r)
    }

    /// The communicator's asynchronous error, if any (a peer failed, a network error).
    pub(crate) fn async_error(&self) -> Result<()> {
        let lib = self.live()?;
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: a live communicator and a valid out-pointer.
        check(lib, self.rank, "ncclCommGetAsyncError", unsafe {
            (lib.comm_get_async_error)(self.comm, &mut state)
        })?;
        if state == NCCL_IN_PROGRESS {
            return Ok(());
        }
        check(lib, self.rank, "a collective failed", state)
    }

    /// Aborts the communicator (its pending collectives stop); the rank is unusable after.
    pub(crate) fn abort(&mut self) {
        if self.failed {
            return;
        }
        self.failed = true;
        let _ = self.ctx.bind_to_thread();
        // The captured collectives hold the communicator: the graph goes first (a launch of
        // it still running is freed when it completes, which the abort brings about).
        self.drop_graph();
        if let Ok(lib) = lib() {
            // SAFETY: a live communicator, aborted once (`failed` guards the drop).
            unsafe {
                (lib.comm_abort)(self.comm);
            }
        }
    }
}

impl Rank {
    /// Destroys the captured step graph, if any (before the communicator its collectives
    /// use). A launch of it still in flight is freed by CUDA when it completes.
    fn drop_graph(&mut self) {
        if let Some((graph, exec)) = self.graph.take() {
            // SAFETY: made by the executor's capture, taken out of `self.graph` so destroyed
            // once; an executable graph destroyed while in flight is freed on completion
            // (cuGraphExecDestroy), and the graph itself is not launched.
            unsafe {
                let _ = cudarc::driver::result::graph::exec_destroy(exec);
                let _ = cudarc::driver::result::graph::destroy(graph);
            }
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if self.graph.is_some() {
            let _ = self.ctx.synchronize();
            self.drop_graph();
        }
        let _ = self.comm_stream.synchronize();
        let _ = self.after_stream.synchronize();
        for s in &self.dag_streams {
            let _ = s.synchronize();
        }
        for e in self.events.drain(..).chain(self.dag_events.drain(..)) {
            // SAFETY: made by `event`; both streams are synchronised, so nothing waits on it.
            unsafe {
                let _ = cudarc::driver::result::event::destroy(e);
            }
        }
        if self.failed {
            return;
        }
        if let Ok(lib) = lib() {
            // SAFETY: a live communicator whose collectives have completed (streams
            // synchronised); destroyed once.
            unsafe {
                (lib.comm_destroy)(self.comm);
            }
        }
    }
}
