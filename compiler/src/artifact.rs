//! From a scheduled graph to a compiled program and its artifact file.
//!
//! [`compile`] runs the stages of [`crate::pipeline::PIPELINE`] after `remat`: the lowering
//! rewrites, fusion, the one-arena plan and code generation; [`plan_kernels`] and
//! [`codegen`] are the `plan` and `codegen` stages. [`write_artifact`]
//! packs the result with the params' initial bytes into the format the runtime owns
//! (`runtime/ARTIFACT.md`).

use crate::analysis::liveness::BufferKind;
use crate::back::clif;
use crate::eager;
use crate::ir::{DType, Graph, NodeId, Op};
use crate::kernel::fuse::{FuseError, FuseOptions, Fused};
use crate::kernel::offsets::{NoOffset, Offsets};
use crate::plan::{self, Plan};
use std::time::Duration;
use tcc_runtime::artifact as fmt;

/// What to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    /// `cpu` or `cuda`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

/// Options of [`compile`].
#[derive(Clone, Copy, Debug)]
pub struct CompileOptions {
    pub target: Target,
    pub fuse: FuseOptions,
    /// Budget of the arena offset search (counted in search work: [`crate::analysis::arena::work_of`]).
    pub plan_budget: Duration,
    /// f32 matmuls may use TF32 tensor cores (CUDA only; PyTorch's `allow_tf32`).
    pub allow_tf32: bool,
    /// Mixed precision (`--amp`): the policy of [`crate::passes::amp`] and loss scaling.
    pub amp: crate::passes::amp::Amp,
    /// Data-parallel ranks the step is built for (`--gpus N`; 1: none): see
    /// [`crate::autodiff::expand_data_parallel`].
    pub ranks: usize,
    /// ZeRO-1 (`--zero 1`): with several ranks, each keeps and updates 1/N of the
    /// optimizer state ([`crate::autodiff::optim::lower_sharded`]).
    pub zero: bool,
    /// f32 steps on CUDA: attention's backward pass as the two flash-attention gradient
    /// kernels in FFMA (`back::ptx::attention_ffma_grad`), which rebuild the probabilities
    /// instead of storing `[.., T, S]` tensors (`--flash-backward`). Under `--amp` the
    /// tensor-core gradient kernels are always used.
    pub flash_backward: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            target: Target::Cpu,
            fuse: FuseOptions::default(),
            plan_budget: Duration::from_millis(500),
            allow_tf32: false,
            amp: Default::default(),
            ranks: 1,
            zero: false,
            flash_backward: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("fusion: {0}")]
    Fuse(#[from] FuseError),
    #[error("code generation: {0}")]
    Clif(#[from] clif::ClifError),
    #[error("the memory plan is invalid: {0}")]
    Plan(String),
    #[error("the memory plan is invalid: {0}")]
    NoOffset(#[from] NoOffset),
    #[error("PTX generation: {0}")]
    Ptx(#[from] crate::back::ptx::PtxError),
    #[error("param `{0}` has no initialiser and no value was given")]
    External(String),
    #[error("internal compiler error: {0}")]
    Internal(String),
}

/// A compiled program.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The graph the kernels compute (the input graph, plus a copy node for each output
    /// that is a param or state the step updates: outputs hold the value the step used).
    pub graph: Graph,
    pub fused: Fused,
    pub plan: Plan,
    /// The arena offset of every buffer the kernels access (from `plan`).
    pub offsets: Offsets,
    /// Code of every kernel (CLIF text for the CPU, PTX for CUDA).
    pub code: String,
    /// CUDA launch shapes, one per kernel (empty on the CPU).
    pub launches: Vec<crate::back::ptx::LaunchShape>,
    /// The earlier kernels each kernel must wait for
    /// ([`crate::analysis::launch_deps`]).
    pub deps: Vec<Vec<u32>>,
}

impl Compiled {
    /// Arena offset of a node's buffer.
    pub fn offset_of(&self, n: NodeId) -> Option<u64> {
        self.plan.offset_of(n)
    }
}

/// The stages from `outputs` to `plan` of [`crate::pipeline::PIPELINE`] on a step that went
/// through `remat`: the graph the kernels compute (output copies added, attention fused on
/// CUDA, matmuls read only transposed computed transposed, large reductions split), its
/// fused kernels and their verified plan (on CUDA with the scratch region its stream-K
/// matmuls share). `remat` weighs its choices with it.
pub fn plan_step(g: &Graph, o: &CompileOptions) -> Result<Planned, BuildError> {
    match run_stages(g, "plan", o)? {
        crate::pipeline::Product::Planned(p) => Ok(p),
        other => Err(BuildError::Internal(format!(
            "the pipeline gave {} where planned kernels were due",
            other.form()
        ))),
    }
}

fn run_stages(
    g: &Graph,
    last: &str,
    o: &CompileOptions,
) -> Result<crate::pipeline::Product, BuildError> {
    use crate::pipeline::{self, Product, StageError};
    let opts = pipeline::Options {
        compile: *o,
        ..pipeline::Options::default()
    };
    pipeline::run(
        Product::Graph(g.clone()),
        "outputs",
        last,
        &opts,
        &mut |_, _| {},
    )
    .map(|(p, _)| p)
    .map_err(|e| match e {
        StageError::Build(b) => b,
        other => BuildError::Internal(other.to_string()),
    })
}

/// The `plan` stage: plans the buffers the kernels use into one arena, verifies the plan and
/// gives every access of the kernels its offset ([`Offsets`]).
pub fn plan_kernels(graph: Graph, fused: Fused, o: &CompileOptions) -> Result<Planned, BuildError> {
    let mut plan = plan::plan_kernels(&graph, &fused, o.plan_budget);
    // The buffers' offsets do not depend on the scratch region after them.
    let offsets = Offsets::new(&fused.kernels, &plan)?;
    if o.target == Target::Cuda {
        let scratch = fused
            .kernels
            .iter()
            .map(|k| crate::back::ptx::scratch_bytes(k, &offsets, ptx_options(o, 0)))
            .max()
            .unwrap_or(0);
        plan.add_scratch(scratch);
    }
    plan::verify(&graph, &plan).map_err(|errs| {
        BuildError::Plan(
            errs.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })?;
    Ok(Planned {
        graph,
        fused,
        plan,
        offsets,
    })
}

/// The result of [`plan_step`] (the product of the `plan` stage).
#[derive(Clone, Debug)]
pub struct Planned {
    pub graph: Graph,
    pub fused: Fused,
    pub plan: Plan,
    /// The arena offset of every buffer the kernels access (from `plan`): what the printer
    /// and the back ends read.
    pub offsets: Offsets,
}

/// Compiles a step that went through `remat`: the stages from `outputs` to `codegen` of
/// [`crate::pipeline::PIPELINE`].
pub fn compile(g: &Graph, o: &CompileOptions) -> Result<Compiled, BuildError> {
    match run_stages(g, "codegen", o)? {
        crate::pipeline::Product::Code(c) => Ok(c),
        other => Err(BuildError::Internal(format!(
            "the pipeline gave {} where code was due",
            other.form()
        ))),
    }
}

/// The `codegen` stage: translates every planned kernel for the target and orders their
/// launches.
pub fn codegen(p: Planned, o: &CompileOptions) -> Result<Compiled, BuildError> {
    let Planned {
        graph,
        fused,
        plan,
        offsets,
        ..
    } = p;
    let scratch_offset = plan.scratch_offset();
    let (code, launches) = match o.target {
        Target::Cpu => (clif::emit_module(&fused.kernels, &offsets)?, Vec::new()),
        Target::Cuda => {
            crate::back::ptx::emit_module(&fused.kernels, &offsets, ptx_options(o, scratch_offset))?
        }
    };
    // The kernels that use the scratch region (stream-K matmuls) share it: they run one
    // after another.
    let mut scratch = Vec::with_capacity(launches.len());
    for l in &launches {
        if l.scratch_bytes > plan.scratch_bytes {
            return Err(BuildError::Plan(format!(
                "a kernel needs {} bytes of scratch, the plan has {}",
                l.scratch_bytes, plan.scratch_bytes
            )));
        }
        scratch.push((l.scratch_bytes > 0).then_some((scratch_offset, plan.arena_bytes)));
    }
    let deps = crate::analysis::launch_deps::launch_deps(&fused.kernels, &plan, &scratch);
    Ok(Compiled {
        graph,
        fused,
        plan,
        offsets,
        code,
        launches,
        deps,
    })
}

fn ptx_options(o: &CompileOptions, scratch_offset: u64) -> crate::back::ptx::PtxOptions {
    crate::back::ptx::PtxOptions {
        allow_tf32: o.allow_tf32,
        scratch_offset,
    }
}

/// The runtime's name for a dtype.
pub fn runtime_dtype(d: DType) -> fmt::DType {
    match d {
        DType::F32 => fmt::DType::F32,
        DType::F16 => fmt::DType::F16,
        DType::BF16 => fmt::DType::Bf16,
        DType::I32 => fmt::DType::I32,
        DType::Bool => fmt::DType::Bool,
    }
}

fn slot(g: &Graph, c: &Compiled, name: &str, n: NodeId) -> fmt::TensorSlot {
    let ty = g.ty(n);
    fmt::TensorSlot {
        name: name.to_string(),
        dtype: runtime_dtype(ty.dtype),
        shape: ty.dims().to_vec(),
        offset: c.offset_of(n).unwrap_or(0),
        bytes: ty.size_bytes() as u64,
        index_bound: None,
    }
}

/// The collective of an `all_reduce`'s kernel: the ranks sum its result's buffer (the one
/// store, a copy of `operand`) after the kernel. The operand itself is never written, so
/// its other readers see this rank's values in any order.
///
/// A `reduce_scatter`, `all_gather` or `shard` names its operand's bytes as the input and
/// its result as the bytes the ranks write (its kernel is a placeholder).
fn collective(c: &Compiled, k: &crate::kernel::Kernel, operand: NodeId) -> fmt::Collective {
    let root = k.stores.first().map(|s| s.buf);
    let other = root.and_then(|r| match c.graph.node(r).op {
        Op::ReduceScatter { .. } => Some((r, fmt::CollectiveOp::ReduceScatterSum)),
        Op::AllGather { .. } => Some((r, fmt::CollectiveOp::AllGather)),
        Op::Shard { .. } => Some((r, fmt::CollectiveOp::Shard)),
        _ => None,
    });
    if let Some((result, op)) = other {
        let ty = c.graph.ty(result);
        return fmt::Collective {
            op,
            offset: c.offset_of(result).unwrap_or(0),
            bytes: ty.size_bytes() as u64,
            dtype: runtime_dtype(ty.dtype),
            in_place: false,
            input: Some(fmt::Region {
                offset: c.offset_of(operand).unwrap_or(0),
                bytes: c.graph.ty(operand).size_bytes() as u64,
            }),
        };
    }
    let (result, in_place) = match k.stores.as_slice() {
        [s] => {
            // A plain copy onto itself: the one store reads the operand where it writes,
            // and the result took the operand's bytes.
            let same = c.offset_of(s.buf).is_some() && c.offset_of(s.buf) == c.offset_of(operand);
            let copy = matches!(
                k.pool.get(s.value),
                crate::kernel::E::Load { buf, index, .. } if *buf == operand && *index == s.index
            );
            (s.buf, same && copy)
        }
        _ => (operand, false),
    };
    let ty = c.graph.ty(result);
    fmt::Collective {
        op: fmt::CollectiveOp::AllReduceSum,
        // Stored by this kernel, so planned (the plan verifier checks every store has bytes).
        offset: c.offset_of(result).unwrap_or(0),
        bytes: ty.size_bytes() as u64,
        dtype: runtime_dtype(ty.dtype),
        in_place,
        input: None,
    }
}

/// The manifest of a compiled program whose persistent region starts as `persistent` says
/// (sections are filled in by the writer).
pub fn manifest(c: &Compiled, target: Target, persistent: &PersistentInit) -> fmt::Manifest {
    let g = &c.graph;
    let inputs = g
        .inputs
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            Op::Input { name, .. } => Some(fmt::TensorSlot {
                index_bound: crate::eager::int_input_bound(g, n).map(|b| b as u64),
                ..slot(g, c, name, n)
            }),
            _ => None,
        })
        .collect();
    let outputs = g
        .outputs
        .iter()
        .map(|(name, n)| slot(g, c, name, *n))
        .collect();
    // A stack is one slot: its pieces lie back to back from its first one's offset
    // (`plan::verify` checks it).
    let persistent = g
        .persistent_tensors()
        .into_iter()
        .filter_map(|(n, name, ty)| {
            let slot = fmt::TensorSlot {
                shape: ty.dims().to_vec(),
                bytes: ty.size_bytes() as u64,
                ..slot(g, c, &name, n)
            };
            match &g.node(n).op {
                Op::Param { .. } => Some(fmt::PersistentSlot {
                    kind: fmt::PersistentKind::Param,
                    init: persistent.recipes.get(&name).copied(),
                    shard_of: None,
                    slot,
                }),
                Op::State { .. } => Some(fmt::PersistentSlot {
                    kind: fmt::PersistentKind::State,
                    init: None,
                    shard_of: g.shards.get(&name).cloned(),
                    slot,
                }),
                _ => None,
            }
        })
        .collect();
    let kernels = c
        .fused
        .kernels
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let launch = c.launches.get(i).map(|l| fmt::Launch {
                grid: l.grid,
                block: l.block,
                shared_bytes: l.shared_bytes,
            });
            fmt::KernelEntry {
                name: k.name.clone(),
                extent: match (&launch, &k.matmul) {
                    (Some(l), _) => l.grid[0] as u64 * l.block[0] as u64,
                    (None, Some(mm)) => mm.cpu_extent(),
                    (None, None) => k.outer_extent(),
                },
                parallel: k.parallel,
                launch,
                after: c.deps.get(i).cloned(),
                describe: k.describe.clone(),
                collective: k.collective.map(|x| collective(c, k, x)),
            }
        })
        .collect();
    let lv = &c.plan.liveness;
    let buffers = lv
        .buffers
        .iter()
        .enumerate()
        .map(|(i, b)| fmt::PlanBuffer {
            owner: match &g.node(b.owner).op {
                Op::Param { name, .. } | Op::State { name, .. } | Op::Input { name, .. } => {
                    name.clone()
                }
                _ => format!("%{}", b.owner.index()),
            },
            offset: c.plan.offsets[i],
            bytes: b.bytes,
            start: b.start,
            end: b.end,
            kind: match b.kind {
                BufferKind::Persistent => "persistent",
                BufferKind::Input => "input",
                BufferKind::Transient => "transient",
            }
            .to_string(),
        })
        .collect();
    fmt::Manifest {
        format_version: fmt::FORMAT_VERSION,
        producer: format!("tcc {}", env!("CARGO_PKG_VERSION")),
        model: g.name.clone(),
        target: match target {
            Target::Cpu => fmt::Target::Cpu,
            Target::Cuda => fmt::Target::Cuda,
        },
        arena_bytes: c.plan.arena_bytes,
        alignment: plan::ALIGN,
        inputs,
        outputs,
        persistent,
        kernels,
        ranks: g.ranks.map(|r| r as u32),
        plan: fmt::PlanInfo {
            persistent_bytes: c.plan.persistent_bytes,
            lower_bound: c.plan.lower_bound,
            method: c.plan.method.to_string(),
            buffers,
        },
        sass: None,
        checks: g
            .checks
            .iter()
            .filter(|c| outputs_named(&g.outputs, &c.output))
            .map(|c| fmt::Check {
                output: c.output.clone(),
                what: c.what.clone(),
                bound: c.bound,
                kind: c.kind,
            })
            .collect(),
        sections: Vec::new(),
    }
}

/// What an artifact holds of its persistent region: the initial bytes up to the last param
/// stored as values, and the recipe of each param drawn from its initialiser (the runtime
/// draws those at load, with the same function as the interpreter: see
/// `tcc_runtime::init`).
#[derive(Clone, Debug, Default)]
pub struct PersistentInit {
    pub image: Vec<u8>,
    pub recipes: std::collections::BTreeMap<String, tcc_runtime::init::Recipe>,
}

/// A param's initialiser as a runtime recipe (`None` for one the caller must give).
pub fn recipe(init: crate::ir::Init, seed: u64) -> Option<tcc_runtime::init::Recipe> {
    use crate::ir::Init;
    use tcc_runtime::init::Dist;
    let dist = match init {
        Init::Zeros => Dist::Zeros,
        Init::Ones => Dist::Ones,
        Init::Uniform { lo, hi } => Dist::Uniform { lo, hi },
        Init::Normal { mean, std } => Dist::Normal { mean, std },
        Init::External => return None,
    };
    Some(tcc_runtime::init::Recipe { dist, seed })
}

/// The persistent region's initial contents: params from `given` (by name) are stored as
/// values, the others as their initialiser's recipe under `seed`. The image runs to the end
/// of the last stored param; the optimizer state after the params starts at zero.
pub fn persistent_image(
    c: &Compiled,
    seed: u64,
    given: &std::collections::BTreeMap<String, eager::io::TensorBytes>,
) -> Result<PersistentInit, BuildError> {
    let g = &c.graph;
    let mut out = PersistentInit::default();
    let mut stored = Vec::new();
    for (n, name, _) in g.persistent_tensors() {
        let Some(off) = c.offset_of(n) else { continue };
        let Op::Param { init, .. } = &g.node(n).op else {
            continue;
        };
        match (given.get(&name), recipe(*init, seed)) {
            (Some(t), _) => stored.push((off, t.bytes.as_slice())),
            (None, Some(r)) => {
                out.recipes.insert(name, r);
            }
            (None, None) => return Err(BuildError::External(name)),
        }
    }
    let end = stored
        .iter()
        .map(|(off, b)| off + b.len() as u64)
        .max()
        .unwrap_or(0)
        .min(c.plan.persistent_bytes);
    out.image = vec![0u8; end as usize];
    for (off, bytes) in stored {
        let o = off as usize;
        if let Some(dst) = out.image.get_mut(o..o + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
    Ok(out)
}

/// The artifact file's bytes.
pub fn write_artifact(c: &Compiled, target: Target, persistent: &PersistentInit) -> Vec<u8> {
    write_artifact_with_sass(c, target, persistent, None)
}

/// The artifact file's bytes, with the SASS `ptxas` made of a `cuda` artifact's PTX
/// ([`crate::back::sass`]): its description and the `sass` section.
pub fn write_artifact_with_sass(
    c: &Compiled,
    target: Target,
    persistent: &PersistentInit,
    sass: Option<(&fmt::Sass, &[u8])>,
) -> Vec<u8> {
    let mut m = manifest(c, target, persistent);
    // The code section starts with what the code was compiled for, from the same plan
    // (`tcc_runtime::artifact::check_bounds` holds the manifest to it).
    let code = fmt::bounds_line(&m) + &c.code;
    let mut sections = vec![
        ("code", code.as_bytes()),
        ("persistent", persistent.image.as_slice()),
    ];
    if let Some((s, bytes)) = sass {
        // The cubins were made from the PTX without its bounds comment: the same code.
        // (SASS of other PTX keeps its checksum, and the reader refuses it.)
        let mut s = s.clone();
        if s.code_checksum == fmt::checksum_hex(c.code.as_bytes()) {
            s.code_checksum = fmt::checksum_hex(code.as_bytes());
        }
        m.sass = Some(s);
        sections.push(("sass", bytes));
    }
    fmt::write(&m, &sections)
}

/// Whether an output of that name is among `outputs`.
fn outputs_named(outputs: &[(String, NodeId)], name: &str) -> bool {
    outputs.iter().any(|(n, _)| n == name)
}
