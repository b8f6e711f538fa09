//! Data-parallel execution of a step built with `tcc build --gpus N`: one session (its own
//! arena) per rank, all running the same compiled step on their own slices of the batch,
//! each on its own thread. After a kernel that carries a collective (the `all_reduce` of a
//! gradient: the ranks sum its bytes across their arenas; under ZeRO-1 a `reduce_scatter`,
//! a param's `shard` and an `all_gather`, which run in place of their kernels), the ranks
//! combine their arenas:
//!
//! - on the CPU, through [`HostComm`] (shared memory; every rank sums in rank order, so
//!   all ranks get bit-identical results and the run is deterministic);
//! - on CUDA (feature `cuda`), through NCCL, on a communication stream per GPU, in buckets,
//!   while the compute stream goes on with the backward pass (`cuda.rs`, `launch_ranked`).
//!
//! A collective that does not complete within the timeout (a rank that failed or never
//! came) is an [`Error::Collective`], never a hang.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::artifact::{Collective, CollectiveOp, DType};
use crate::{Device, Error, Model, Result, Session};

/// How long a rank waits for the others at a collective before giving up.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

fn collective_error(rank: usize, message: impl Into<String>) -> Error {
    Error::Collective {
        rank,
        message: message.into(),
    }
}

/// Where a round of [`HostComm`] stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Ranks hand in their bytes.
    Deposit,
    /// The sum is ready; ranks copy it out.
    Collect,
}

struct HostState {
    phase: Phase,
    arrived: usize,
    taken: usize,
    slots: Vec<Vec<u8>>,
    sum: Vec<u8>,
    /// Set once a rank failed or timed out: every waiting rank returns this error.
    failed: Option<String>,
}

/// An in-process communicator for ranks that run on threads of one process (the CPU
/// executor's collectives).
pub struct HostComm {
    ranks: usize,
    timeout: Duration,
    state: Mutex<HostState>,
    changed: Condvar,
}

impl HostComm {
    pub fn new(ranks: usize, timeout: Duration) -> HostComm {
        HostComm {
            ranks,
            timeout,
            state: Mutex::new(HostState {
                phase: Phase::Deposit,
                arrived: 0,
                taken: 0,
                slots: vec![Vec::new(); ranks],
                sum: Vec::new(),
                failed: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Marks the communicator failed (a rank stopped): every rank waiting at a collective,
    /// and every later one, gets an error instead of waiting for it.
    pub fn abort(&self, why: &str) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(why.to_string());
        }
        self.changed.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, HostState> {
        // A rank that panicked while holding the lock left the state as it was between two
        // assignments; the `failed` flag it could not set is set by `DataParallel::run`.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready` holds, the communicator fails or the deadline passes.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, HostState>,
        rank: usize,
        deadline: Instant,
        what: &str,
        ready: impl Fn(&HostState) -> bool,
    ) -> Result<MutexGuard<'a, HostState>> {
        loop {
            if let Some(why) = &st.failed {
                return Err(collective_error(rank, format!("{what}: {why}")));
            }
            if ready(&st) {
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                let msg = format!(
                    "{what}: the other ranks did not arrive within {:.0} s",
                    self.timeout.as_secs_f64()
                );
                st.failed = Some(format!("rank {rank} timed out"));
                self.changed.notify_all();
                return Err(collective_error(rank, msg));
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Sums `bytes` (elements of `dtype`) over the ranks, in place on every rank.
    pub fn all_reduce_sum(&self, rank: usize, c: &Collective, bytes: &mut [u8]) -> Result<()> {
        let what = format!("all-reduce of {} bytes at offset {}", c.bytes, c.offset);
        let sum = self.exchange(rank, &what, bytes, |slots| {
            sum_in_rank_order(slots, c.dtype)
        })?;
        bytes.copy_from_slice(&sum);
        Ok(())
    }

    /// Runs collective `c` as rank `rank`, on that rank's arena.
    pub fn run(&self, rank: usize, c: &Collective, arena: &mut [u8]) -> Result<()> {
        let region = |offset: u64, bytes: u64| {
            let start = usize::try_from(offset).ok()?;
            start
                .checked_add(usize::try_from(bytes).ok()?)
                .map(|end| start..end)
        };
        let outside = || {
            collective_error(
                rank,
                format!("{:?} at offset {}: bytes outside the arena", c.op, c.offset),
            )
        };
        let out = region(c.offset, c.bytes)
            .filter(|r| r.end <= arena.len())
            .ok_or_else(outside)?;
        let input = match c.input {
            Some(i) => Some(
                region(i.offset, i.bytes)
                    .filter(|r| r.end <= arena.len())
                    .ok_or_else(outside)?,
            ),
            None => None,
        };
        let block = out.len();
        match (c.op, input) {
            (CollectiveOp::AllReduceSum, _) => self.all_reduce_sum(rank, c, &mut arena[out]),
            (CollectiveOp::ReduceScatterSum, Some(input)) => {
                let what = format!(
                    "reduce-scatter of {} bytes at offset {}",
                    input.len(),
                    input.start
                );
                let sent = arena[input].to_vec();
                let sum = self.exchange(rank, &what, &sent, |slots| {
                    sum_in_rank_order(slots, c.dtype)
                })?;
                let mine = sum.get(rank * block..(rank + 1) * block).ok_or_else(|| {
                    collective_error(rank, format!("{what}: no block for this rank"))
                })?;
                arena[out].copy_from_slice(mine);
                Ok(())
            }
            (CollectiveOp::AllGather, Some(input)) => {
                let what = format!(
                    "all-gather of {} bytes at offset {}",
                    input.len(),
                    input.start
                );
                let sent = arena[input].to_vec();
                let all = self.exchange(rank, &what, &sent, |slots| slots.concat())?;
                if all.len() != block {
                    return Err(collective_error(
                        rank,
                        format!("{what}: {} bytes gathered into {block}", all.len()),
                    ));
                }
                arena[out].copy_from_slice(&all);
                Ok(())
            }
            (CollectiveOp::Shard, Some(input)) => {
                // Block `rank` of the input, zero past its end.
                let from = input
                    .start
                    .saturating_add(rank.saturating_mul(block))
                    .min(input.end);
                let to = from.saturating_add(block).min(input.end);
                let mine = arena[from..to].to_vec();
                let dst = &mut arena[out];
                let (head, tail) = dst.split_at_mut(mine.len());
                head.copy_from_slice(&mine);
                tail.fill(0);
                Ok(())
            }
            (op, None) => Err(collective_error(rank, format!("{op:?} without an input"))),
        }
    }

    /// One round: every rank hands in `sent`; once all have, `combine` makes one buffer of
    /// the ranks' bytes (in rank order), which every rank gets.
    fn exchange(
        &self,
        rank: usize,
        what: &str,
        sent: &[u8],
        combine: impl FnOnce(&[Vec<u8>]) -> Vec<u8>,
    ) -> Result<Vec<u8>> {
        if rank >= self.ranks {
            return Err(collective_error(rank, format!("{what}: no such rank")));
        }
        let deadline = Instant::now() + self.timeout;
        let st = self.lock();
        let mut st = self.wait(st, rank, deadline, what, |s| s.phase == Phase::Deposit)?;
        st.slots[rank].clear();
        st.slots[rank].extend_from_slice(sent);
        st.arrived += 1;
        if st.arrived == self.ranks {
            if st.slots.iter().any(|s| s.len() != sent.len()) {
                st.failed = Some("the ranks handed in buffers of different sizes".into());
                self.changed.notify_all();
                return Err(collective_error(
                    rank,
                    format!("{what}: the ranks handed in buffers of different sizes"),
                ));
            }
            let sum = combine(&st.slots);
            st.sum = sum;
            st.phase = Phase::Collect;
            st.taken = 0;
            self.changed.notify_all();
        }
        let mut st = self.wait(st, rank, deadline, what, |s| s.phase == Phase::Collect)?;
        let out = st.sum.clone();
        st.taken += 1;
        if st.taken == self.ranks {
            st.phase = Phase::Deposit;
            st.arrived = 0;
            self.changed.notify_all();
        }
        Ok(out)
    }
}

/// The element-wise sum of the ranks' bytes, added in rank order (so every rank gets the
/// same bits): f16 and bf16 are summed in f32 and rounded once, i32 wraps.
fn sum_in_rank_order(slots: &[Vec<u8>], dtype: DType) -> Vec<u8> {
    let len = slots.first().map_or(0, Vec::len);
    let mut out = vec![0u8; len];
    let size = dtype.size_bytes();
    for (i, o) in out.chunks_exact_mut(size).enumerate() {
        let at = i * size..(i + 1) * size;
        let elems = slots.iter().map(|s| &s[at.clone()]);
        match dtype {
            DType::F32 => {
                let v: f32 = elems
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .sum();
                o.copy_from_slice(&v.to_le_bytes());
            }
            DType::F16 => {
                let v: f32 = elems
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .sum();
                o.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
            DType::Bf16 => {
                let v: f32 = elems
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .sum();
                o.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
            DType::I32 => {
                let v = elems
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .fold(0i32, i32::wrapping_add);
                o.copy_from_slice(&v.to_le_bytes());
            }
            DType::Bool => {
                let v = elems.into_iter().any(|b| b[0] != 0);
                o[0] = u8::from(v);
            }
        }
    }
    out
}

/// How the ranks of a [`DataParallel`] talk.
enum Comm {
    Host(Arc<HostComm>),
    #[cfg(feature = "cuda")]
    Nccl(Vec<crate::nccl::Rank>),
}

/// One step run by several ranks, each in its own session and arena on its own thread,
/// with the gradients summed across them (see the module docs).
///
/// Inputs are per rank: set each rank's slice of the batch with
/// [`DataParallel::session_mut`] (or [`DataParallel::set_input_split`] for the whole
/// batch, split along its first axis). Params and optimizer state start equal on every
/// rank and stay equal, since every rank applies the same summed gradients (under ZeRO-1
/// each rank holds its own shard of the optimizer state, and the params stay equal).
pub struct DataParallel {
    // Drop order: the communicators before the sessions whose streams they use.
    comm: Comm,
    sessions: Vec<Session<'static>>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("ranks", &self.sessions.len())
            .field("sessions", &self.sessions)
            .finish_non_exhaustive()
    }
}

impl DataParallel {
    /// A session of `model` on each of `devices` (rank `i` on `devices[i]`). The model must
    /// have been built for exactly `devices.len()` ranks (`tcc build --gpus N`); CPU ranks
    /// share the host (`[Device::Cpu; N]`); CUDA ranks need distinct GPUs and NCCL (found as
    /// `nccl.rs` says).
    pub fn new(model: &Model, devices: &[Device]) -> Result<DataParallel> {
        DataParallel::with_timeout(model, devices, DEFAULT_TIMEOUT)
    }

    /// [`DataParallel::new`] with the time a collective may wait for the other ranks.
    pub fn with_timeout(
        model: &Model,
        devices: &[Device],
        timeout: Duration,
    ) -> Result<DataParallel> {
        let built = model.manifest().ranks.unwrap_or(1) as usize;
        if devices.len() != built {
            return Err(Error::Ranks {
                built,
                given: devices.len(),
            });
        }
        let cpu = devices.iter().all(|&d| d == Device::Cpu);
        let cuda = devices.iter().all(|d| matches!(d, Device::Cuda(_)));
        if !cpu && !cuda {
            return Err(collective_error(
                0,
                "the ranks must all be CPU ranks or all be CUDA devices",
            ));
        }
        for (i, d) in devices.iter().enumerate() {
            if matches!(d, Device::Cuda(_)) && devices[..i].contains(d) {
                return Err(collective_error(
                    i,
                    format!("{d} is given twice (NCCL runs one rank per GPU)"),
                ));
            }
        }
        let mut sessions = Vec::with_capacity(devices.len());
        for &d in devices {
            sessions.push(Session::new_rank(model, d)?);
        }
        let comm = if cpu {
            Comm::Host(Arc::new(HostComm::new(devices.len(), timeout)))
        } else {
            #[cfg(feature = "cuda")]
            {
                Comm::Nccl(crate::nccl::Rank::init_all(&mut sessions, timeout)?)
            }
            #[cfg(not(feature = "cuda"))]
            {
                return Err(crate::no_cuda(devices[0]));
            }
        };
        Ok(DataParallel { comm, sessions })
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.sessions.len()
    }

    /// Rank `rank`'s session (its inputs, outputs and params).
    pub fn session(&self, rank: usize) -> Option<&Session<'static>> {
        self.sessions.get(rank)
    }

    /// [`Session::set_allow_nonfinite`] on every rank: whether [`DataParallel::run`] returns
    /// after a step that left params non-finite instead of failing.
    pub fn set_allow_nonfinite(&mut self, allow: bool) {
        for s in &mut self.sessions {
            s.set_allow_nonfinite(allow);
        }
    }

    /// Rank `rank`'s session, to set its inputs. Running it alone is an error
    /// ([`Error::Ranks`]): a data-parallel step runs only through [`DataParallel::run`].
    pub fn session_mut(&mut self, rank: usize) -> Option<&mut Session<'static>> {
        self.sessions.get_mut(rank)
    }

    /// Rank 0's session (`new` made one per device, and at least one).
    fn first(&self) -> Result<&Session<'static>> {
        self.sessions
            .first()
            .ok_or(Error::Ranks { built: 1, given: 0 })
    }

    /// Every persistent tensor as safetensors bytes, as [`Session::save_params_bytes`] does
    /// for one session: rank 0's params and state, except that a ZeRO-1 state is put back
    /// together from every rank's shard, in its param's shape. So the file is the one a step
    /// without ZeRO-1 would save, and loads into either.
    pub fn save_params_bytes(&self) -> Result<Vec<u8>> {
        let first = self.first()?;
        let model = first.model().clone();
        let m = model.manifest();
        let mut whole: Vec<(usize, Vec<u8>)> = Vec::new();
        for (i, p) in model.persistent().iter().enumerate() {
            let Some(w) = p.whole(m) else { continue };
            let mut bytes = Vec::with_capacity(p.slot.bytes as usize * self.sessions.len());
            for s in &self.sessions {
                bytes.extend_from_slice(s.param_bytes(&p.slot.name)?);
            }
            bytes.truncate(w.bytes as usize);
            whole.push((i, bytes));
        }
        let mut tensors = Vec::with_capacity(model.persistent().len());
        for (i, p) in model.persistent().iter().enumerate() {
            match (whole.iter().find(|(j, _)| *j == i), p.whole(m)) {
                (Some((_, bytes)), Some(w)) => tensors.push((&p.slot, &w.shape, bytes.as_slice())),
                _ => tensors.push((&p.slot, &p.slot.shape, first.param_bytes(&p.slot.name)?)),
            }
        }
        crate::serialize_params(&model, tensors)
    }

    /// Writes [`DataParallel::save_params_bytes`] to `path`, atomically.
    pub fn save_params(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        crate::write_params_file(path.as_ref(), &self.save_params_bytes()?)
    }

    /// Loads persistent tensors by name into every rank, as [`Session::load_params_bytes`]
    /// does for one session; a ZeRO-1 state is read whole (in its param's shape, as
    /// [`DataParallel::save_params_bytes`] and a step without ZeRO-1 save it) and each rank
    /// takes its shard. On an error nothing is written.
    pub fn load_params_bytes(&mut self, bytes: &[u8]) -> Result<crate::ParamsLoaded> {
        let model = self.first()?.model().clone();
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Safetensors(e.to_string()))?;
        let (found, report) = crate::params_in_file(&model, &st, true)?;
        for (r, s) in self.sessions.iter_mut().enumerate() {
            for (p, data) in &found {
                if p.shard_of.is_none() {
                    s.set_param_bytes(&p.slot.name, data)?;
                    continue;
                }
                // Block `r` of the whole state's bytes, zero past their end.
                let len = p.slot.bytes as usize;
                let mut shard = vec![0u8; len];
                let from = (r * len).min(data.len());
                let to = ((r + 1) * len).min(data.len());
                shard[..to - from].copy_from_slice(&data[from..to]);
                s.set_param_bytes(&p.slot.name, &shard)?;
            }
        }
        Ok(report)
    }

    /// Reads `path` and loads it with [`DataParallel::load_params_bytes`].
    pub fn load_params(
        &mut self,
        path: impl AsRef<std::path::Path>,
    ) -> Result<crate::ParamsLoaded> {
        self.load_params_bytes(&crate::read_params_file(path.as_ref())?)
    }

    /// Sets input `name` on every rank from the whole batch's bytes: split into equal
    /// parts along the first axis when it holds `ranks` times the input's bytes, or given
    /// to every rank whole when it holds exactly the input's bytes.
    pub fn set_input_split(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let n = self.sessions.len();
        let Some(first) = self.sessions.first() else {
            return Ok(());
        };
        let (_, slot) = first.model().input_slot(name)?;
        let one = slot.bytes as usize;
        if bytes.len() == one {
            for s in &mut self.sessions {
                s.set_input_bytes(name, bytes)?;
            }
            return Ok(());
        }
        if bytes.len() != one * n {
            return Err(Error::ByteLenMismatch {
                name: name.to_string(),
                expected: one * n,
                got: bytes.len(),
            });
        }
        for (s, part) in self.sessions.iter_mut().zip(bytes.chunks_exact(one)) {
            s.set_input_bytes(name, part)?;
        }
        Ok(())
    }

    /// Runs one step on every rank, each on its own thread, combining the gradients across
    /// them. The first error of any rank is returned; the others stop instead of waiting
    /// for it. After an error of a rank the communicator is aborted, and every later `run`
    /// fails: make a new `DataParallel`. A failed in-step check
    /// ([`crate::Error::IndexOutOfRangeInStep`], [`crate::Error::NonFiniteUpdate`]) comes
    /// after every rank's step has run and aborts nothing.
    pub fn run(&mut self) -> Result<()> {
        self.run_ranks()?;
        // Every rank's in-step checks (the first that fails).
        for s in &self.sessions {
            s.in_step_checks()?;
        }
        Ok(())
    }

    /// One step on every rank, the collectives between them.
    fn run_ranks(&mut self) -> Result<()> {
        match &mut self.comm {
            Comm::Host(comm) => std::thread::scope(|scope| {
                let handles: Vec<_> = self
                    .sessions
                    .iter_mut()
                    .enumerate()
                    .map(|(rank, s)| {
                        let comm = Arc::clone(comm);
                        scope.spawn(move || {
                            let r = s.run_rank(&mut |c, arena| comm.run(rank, c, arena));
                            if let Err(e) = &r {
                                comm.abort(&format!("rank {rank} failed: {e}"));
                            }
                            r
                        })
                    })
                    .collect();
                join_ranks(handles, |rank| comm.abort(&format!("rank {rank} panicked")))
            }),
            #[cfg(feature = "cuda")]
            Comm::Nccl(ranks) => {
                // Set by a rank that fails: the others abort their communicators instead
                // of waiting out the timeout for it.
                let stop = std::sync::atomic::AtomicBool::new(false);
                let stop = &stop;
                // Captured CUDA graphs for every rank or for none (`TCC_RANK_GRAPH=0`, or
                // graphs turned off on any session): the ranks must issue the same groups.
                let graph = std::env::var("TCC_RANK_GRAPH").map_or(true, |v| v != "0")
                    && self.sessions.iter().all(|s| s.cuda_graph());
                std::thread::scope(|scope| {
                    let handles: Vec<_> = self
                        .sessions
                        .iter_mut()
                        .zip(ranks.iter_mut())
                        .map(|(s, r)| scope.spawn(move || s.run_nccl(r, stop, graph)))
                        .collect();
                    join_ranks(handles, |_| {
                        stop.store(true, std::sync::atomic::Ordering::SeqCst)
                    })
                })
            }
        }
    }
}

/// Waits for every rank's thread: the first error ([`first_error`]); a thread that
/// panicked is an error too, after `on_panic(rank)` tells the others to stop.
fn join_ranks(
    handles: Vec<std::thread::ScopedJoinHandle<'_, Result<()>>>,
    on_panic: impl Fn(usize),
) -> Result<()> {
    let results = handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            h.join().unwrap_or_else(|_| {
                on_panic(rank);
                Err(collective_error(rank, "the rank's thread panicked"))
            })
        })
        .collect();
    first_error(results)
}

/// The first error, preferring one that is not another rank's consequence of it.
fn first_error(results: Vec<Result<()>>) -> Result<()> {
    let mut errors: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
    if errors.is_empty() {
        return Ok(());
    }
    let own = errors
        .iter()
        .position(|e| !matches!(e, Error::Collective { .. }))
        .unwrap_or(0);
    Err(errors.swap_remove(own))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn host_all_reduce_sums_in_rank_order_on_every_rank() {
        let comm = Arc::new(HostComm::new(3, Duration::from_secs(10)));
        let c = Collective {
            op: CollectiveOp::AllReduceSum,
            offset: 0,
            bytes: 8,
            dtype: DType::F32,
            in_place: true,
            input: None,
        };
        let outs: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let comm = Arc::clone(&comm);
                    let c = c.clone();
                    s.spawn(move || {
                        let mut last = Vec::new();
                        // Several rounds back to back: a fast rank must not overtake.
                        for round in 0..20 {
                            let mut b = f32s(&[r as f32 + round as f32, 1e8 * (r as f32 - 1.0)]);
                            comm.all_reduce_sum(r, &c, &mut b)
                                .map_err(|e| e.to_string())?;
                            last = b;
                        }
                        Ok::<_, String>(last)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("no panic").expect("no error"))
                .collect()
        });
        // 19+20+21, and (-1e8 + 0) + 1e8 in rank order.
        let want = f32s(&[60.0, (-1e8f32 + 0.0) + 1e8]);
        for o in outs {
            assert_eq!(o, want);
        }
    }

    #[test]
    fn a_missing_rank_is_an_error_after_the_timeout_not_a_hang() {
        let comm = HostComm::new(2, Duration::from_millis(50));
        let c = Collective {
            op: CollectiveOp::AllReduceSum,
            offset: 0,
            bytes: 4,
            dtype: DType::F32,
            in_place: true,
            input: None,
        };
        let mut b = f32s(&[1.0]);
        let e = comm.all_reduce_sum(0, &c, &mut b).unwrap_err();
        assert!(e.to_string().contains("did not arrive"), "{e}");
        // Later collectives fail at once.
        let e = comm.all_reduce_sum(1, &c, &mut b).unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
    }

    /// ZeRO-1's collectives on 2 ranks' arenas of 6 floats: the input at 0 (4 floats to
    /// reduce-scatter, or a param of 3 floats padded to 2 shards of 2), the result at 16
    /// bytes (gathered: 2 floats at 16 into 4 at 0).
    #[test]
    fn host_reduce_scatter_all_gather_and_shard_give_each_rank_its_block() {
        use crate::artifact::Region;
        let comm = Arc::new(HostComm::new(2, Duration::from_secs(10)));
        let run = |op, input: Region, offset, bytes, arenas: [Vec<f32>; 2]| {
            let c = Collective {
                op,
                offset,
                bytes,
                dtype: DType::F32,
                in_place: false,
                input: Some(input),
            };
            std::thread::scope(|s| {
                let hs: Vec<_> = arenas
                    .iter()
                    .enumerate()
                    .map(|(r, a)| {
                        let (comm, c) = (Arc::clone(&comm), c.clone());
                        let mut a = f32s(a);
                        s.spawn(move || comm.run(r, &c, &mut a).map(|()| a))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        let a = h.join().expect("no panic").expect("no error");
                        a.chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect::<Vec<f32>>()
                    })
                    .collect::<Vec<_>>()
            })
        };
        let at = |offset, bytes| Region { offset, bytes };
        // Reduce-scatter of 4 floats: rank r gets the sum's floats 2r, 2r + 1.
        let out = run(
            CollectiveOp::ReduceScatterSum,
            at(0, 16),
            16,
            8,
            [
                vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.0],
                vec![10.0, 20.0, 30.0, 40.0, 0.0, 0.0],
            ],
        );
        assert_eq!(out[0][4..], [11.0, 22.0]);
        assert_eq!(out[1][4..], [33.0, 44.0]);
        // Shard of a 3-float param: rank 1's block is its third float and a zero.
        let out = run(
            CollectiveOp::Shard,
            at(0, 12),
            16,
            8,
            [
                vec![1.0, 2.0, 3.0, 9.0, 9.0, 9.0],
                vec![1.0, 2.0, 3.0, 9.0, 9.0, 9.0],
            ],
        );
        assert_eq!(out[0][4..], [1.0, 2.0]);
        assert_eq!(out[1][4..], [3.0, 0.0]);
        // All-gather of 2 floats each into 4.
        let out = run(
            CollectiveOp::AllGather,
            at(16, 8),
            0,
            16,
            [
                vec![0.0, 0.0, 0.0, 0.0, 1.0, 2.0],
                vec![0.0, 0.0, 0.0, 0.0, 3.0, 4.0],
            ],
        );
        for o in out {
            assert_eq!(o[..4], [1.0, 2.0, 3.0, 4.0]);
        }
    }
}
