//! The `tcc` command line.

mod arena_cmd;
mod build;
pub mod fit;
pub mod mem;
mod onnx_cmd;
pub mod plan_svg;
pub mod remat_cmd;
pub mod run;

use crate::front::{self, ModelSelection, Options, Sources};
use clap::{Parser, Subcommand, ValueEnum};
use codespan_reporting::term::termcolor::{ColorChoice, StandardStream};
pub use remat_cmd::{RematArgs, RematMode};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;
use tcc_grammar::diag::Diagnostic;

/// The most bytes tcc reads of a TDSL source.
pub const MAX_SOURCE_BYTES: u64 = 256 << 20;
/// The most bytes tcc reads of an `.onnx` model (protobuf's own limit is 2 GiB).
pub const MAX_ONNX_BYTES: u64 = 2 << 30;
/// The most bytes tcc reads of a graph (`tcc remat`) or interval (`tcc arena`) file.
pub const MAX_DATA_BYTES: u64 = 1 << 30;

/// Reads a file of at most `limit` bytes ([`tcc_runtime::fsutil::read_capped`]): a longer or
/// endless one is an error, not a read that never ends.
pub fn read_file(path: &std::path::Path, limit: u64) -> Result<Vec<u8>, String> {
    tcc_runtime::fsutil::read_capped(path, limit)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// [`read_file`] as UTF-8 text.
pub fn read_text(path: &std::path::Path, limit: u64) -> Result<String, String> {
    String::from_utf8(read_file(path, limit)?)
        .map_err(|_| format!("cannot read {}: it is not UTF-8 text", path.display()))
}

static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `-q`: informational lines (compile summaries, timings, `wrote ...`) and progress are off.
pub(crate) fn quiet() -> bool {
    QUIET.load(std::sync::atomic::Ordering::Relaxed)
}

/// `eprintln!` for informational lines, which `-q` silences.
macro_rules! info {
    ($($t:tt)*) => {
        if !$crate::cli::quiet() {
            eprintln!($($t)*);
        }
    };
}
pub(crate) use info;

/// `tcc --version`: the crate version, the commit and what the binary can run.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TCC_BUILD_INFO"), ")");

/// How a step is split: data parallelism (`--gpus N`, `--zero 1`) and micro-batching
/// (`--micro-batches K`).
#[derive(Clone, Copy, Debug)]
pub struct Parallel {
    pub ranks: usize,
    pub zero: bool,
    pub micro_batches: usize,
    /// `--loss-chunks K` (`None`: chosen; see [`loss_chunks`]).
    pub loss_chunks: Option<u32>,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            ranks: 1,
            zero: false,
            micro_batches: 1,
            loss_chunks: None,
        }
    }
}

/// `--zero 1` shards the optimizer state over the ranks `--gpus N` makes: without `--gpus`
/// it is an error, not a silent no-op (with `--gpus 1` there is one shard: the plain step).
pub fn zero_with_gpus(zero: u8, gpus: Option<u32>, stderr: &mut dyn Write) -> bool {
    if zero != 0 && gpus.is_none() {
        let _ = writeln!(
            stderr,
            "error: `--zero {zero}` shards the optimizer state over data-parallel ranks: give \
             `--gpus N` too"
        );
        return false;
    }
    true
}

/// tcc — compile TDSL tensor programs into one static memory arena.
#[derive(Parser, Debug)]
#[command(name = "tcc", version = VERSION, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// When to colour diagnostics.
    #[arg(long, value_enum, default_value_t = Color::Auto, global = true)]
    pub color: Color,
    /// Print only results, warnings and errors: no progress, no compile and timing lines.
    #[arg(short, long, global = true)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Color {
    Auto,
    Always,
    Never,
}

/// Options shared by every command that reads a program.
#[derive(clap::Args, Debug, Clone)]
pub struct ProgramArgs {
    /// The `.tdsl` file (or an `.onnx` model, imported in memory; `--set NAME=N` then sizes
    /// its named dimensions).
    pub file: PathBuf,
    /// Override a constant: `--set B=64` (repeatable; the value may be an expression).
    #[arg(long = "set", value_name = "NAME=VALUE", value_parser = parse_set)]
    pub sets: Vec<(String, String)>,
    /// The model to compile, when the file has several.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// For an `.onnx` model: compute its float64 tensors in f32 (tcc has no f64), as JAX does
    /// without x64. Without it a float64 tensor is an error.
    #[arg(long = "f64-as-f32")]
    pub f64_as_f32: bool,
    /// Micro-batching: run a `train` step's batch (the constant sizing the inputs' first
    /// axis) as K slices, one after another, adding up their gradients before the one
    /// optimizer update: activation memory drops about K-fold, the result is the same (but
    /// for dropout, whose masks are drawn per micro-batch).
    /// `tcc fit`: the most micro-batches it may use; it reports the fewest that fit.
    #[arg(long = "micro-batches", value_name = "K", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub micro_batches: u32,
    /// Compute a `train` step's loss head (its last product of a weight, say a
    /// vocabulary's logits, with the softmax and loss over them) in K slices of the batch,
    /// each one's gradient made right after its loss terms, so only a slice of the logits
    /// is live at a time. By default tcc chooses in f32 steps: up to 4 slices of at least
    /// 256 rows, where the head is at least 4 times its other operand and 1 MiB, and has no
    /// dropout; under `--amp` the head stays whole. 1 keeps the head whole.
    #[arg(long = "loss-chunks", value_name = "K",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub loss_chunks: Option<u32>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Parse and type-check a program; report every error.
    Check {
        #[command(flatten)]
        program: ProgramArgs,
    },
    /// Compile a program.
    Build {
        #[command(flatten)]
        program: ProgramArgs,
        /// What to produce: the artifact (the default, for `tcc run` and the runtime crate)
        /// or one of the text forms.
        #[arg(long, value_enum, default_value_t = Emit::Artifact)]
        emit: Emit,
        /// Where to write it (default: the artifact to `STEM.tcc` in the current directory,
        /// as rustc names its output; text to standard output; `-` is standard output).
        #[arg(short = 'o', long, value_name = "OUT")]
        output: Option<PathBuf>,
        /// The device to compile for.
        #[arg(long, value_enum, default_value_t = Target::Cpu)]
        target: Target,
        /// Give every op its own kernel (no fusion): the baseline fusion is measured against.
        #[arg(long)]
        no_fuse: bool,
        /// Layout of convolution-chain intermediates (`auto`: NHWC on both targets, where
        /// convolutions run as implicit GEMMs: cnn step 43 ms against 133 in NCHW on an
        /// H100; on the CPU a window's channels are then contiguous runs to pack).
        #[arg(long, value_enum, default_value_t = Layout::Auto)]
        layout: Layout,
        /// Let f32 matmuls use TF32 tensor cores on CUDA (10-bit mantissa products, f32
        /// accumulation), as PyTorch's `allow_tf32`; off by default.
        #[arg(long)]
        allow_tf32: bool,
        /// Seed of the params' initial values stored in the artifact.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Data parallelism: build the training step for N GPUs (N ranks on the CPU), each
        /// running it on its own slice of the batch (the program's batch is one rank's), with
        /// the gradients summed across them before the optimizer (NCCL on CUDA).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus: Option<u32>,
        /// ZeRO-1 (`--zero 1`, with `--gpus N`): each rank keeps and updates 1/N of the
        /// optimizer state (Adam's moments, SGD's momentum), after a reduce-scatter of the
        /// gradients, then all-gathers the updated params. 0: every rank keeps all of it.
        #[arg(long, value_name = "STAGE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
        zero: u8,
        /// Machine code for the GPU in a `cuda` artifact, assembled from its PTX by NVIDIA's
        /// `ptxas` (one process per piece, on every core), so that loading it compiles
        /// nothing; the PTX stays as the fallback for other GPUs.
        #[arg(long, value_enum, default_value_t = SassMode::Auto)]
        sass: SassMode,
        /// Print each node's source line and column.
        #[arg(long)]
        locations: bool,
        #[command(flatten)]
        pipeline: PipelineArgs,
        #[command(flatten)]
        remat: RematArgs,
        #[command(flatten)]
        amp: AmpArgs,
    },
    /// Show the memory plan: eager peak, lower bound, arena, fragmentation, what is live at
    /// the peak.
    Mem {
        #[command(flatten)]
        program: ProgramArgs,
        /// Also draw the plan as an SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Budget of the offset search, in milliseconds of search work on a typical core
        /// (counted in search steps, not on a clock, so every machine gives the same plan).
        #[arg(long, default_value_t = 2000, value_name = "MS")]
        budget_ms: u64,
        /// The device whose plan to show (the plans differ: CUDA fuses attention and runs
        /// convolutions as implicit GEMMs).
        #[arg(long, value_enum, default_value_t = Target::Cpu)]
        target: Target,
        /// Data parallelism: plan the training step for N GPUs (N ranks on the CPU), each
        /// running it on its own slice of the batch (the program's batch is one rank's), with
        /// the gradients summed across them before the optimizer (NCCL on CUDA).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus: Option<u32>,
        /// ZeRO-1 (`--zero 1`, with `--gpus N`): each rank keeps and updates 1/N of the
        /// optimizer state (Adam's moments, SGD's momentum), after a reduce-scatter of the
        /// gradients, then all-gathers the updated params. 0: every rank keeps all of it.
        #[arg(long, value_name = "STAGE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
        zero: u8,
        #[command(flatten)]
        remat: RematArgs,
        #[command(flatten)]
        amp: AmpArgs,
    },
    /// Rematerialization at memory budgets: on TDSL programs (no remat, per-block, √n and
    /// the automatic choice, as real plans) and on external graphs (Checkmate / Moccasin
    /// node-link JSON: added cost against √n checkpointing).
    Remat {
        /// `.tdsl` programs or `.json` graphs.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Override a constant of the programs: `--set B=64` (repeatable).
        #[arg(long = "set", value_name = "NAME=VALUE", value_parser = parse_set)]
        sets: Vec<(String, String)>,
        /// The model to compile, when a file has several.
        #[arg(long, value_name = "NAME")]
        model: Option<String>,
        /// Budgets as fractions of the no-remat peak (of the transient arena, for programs),
        /// comma-separated: `--budgets 0.8,0.6`.
        #[arg(
            long,
            value_delimiter = ',',
            value_name = "F,F,...",
            default_value = "0.9,0.7,0.5"
        )]
        budgets: Vec<f64>,
        /// Limit of the exact search per graph and budget, in milliseconds of search work
        /// on a typical core (counted in steps, not on a clock: every machine gives the same
        /// result).
        #[arg(long, default_value_t = 2000, value_name = "MS")]
        time_ms: u64,
        #[command(flatten)]
        amp: AmpArgs,
    },
    /// The largest value of a constant (e.g. the batch `B`) whose planned arena fits a
    /// memory budget, with or without rematerialization.
    Fit {
        #[command(flatten)]
        program: ProgramArgs,
        /// The memory budget: `16GiB`, `512MiB`, `1.5GB`, bytes.
        #[arg(long, value_name = "SIZE", value_parser = fit::parse_bytes)]
        mem_budget: u64,
        /// The constant to grow.
        #[arg(long, value_name = "NAME")]
        grow: String,
        /// Largest value to try.
        #[arg(long, default_value_t = 1 << 20)]
        max: u64,
        /// `auto`: a value fits when recomputation can bring its arena within the budget;
        /// `none`: only as it is; `manual`: with its `checkpoint { }` blocks.
        #[arg(long, value_enum, default_value_t = RematMode::None)]
        remat: RematMode,
        /// Limit of each round of the remat search, in milliseconds of search work on a
        /// typical core (counted in steps, not on a clock).
        #[arg(long, default_value_t = 1000, value_name = "MS")]
        remat_time_ms: u64,
        /// Data parallelism: the budget is each GPU's and the constant is one GPU's share
        /// (the step built for N ranks, its gradients reduced); also prints the global value.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus: Option<u32>,
        /// ZeRO-1 (`--zero 1`, with `--gpus N`): each rank keeps and updates 1/N of the
        /// optimizer state (Adam's moments, SGD's momentum), after a reduce-scatter of the
        /// gradients, then all-gathers the updated params. 0: every rank keeps all of it.
        #[arg(long, value_name = "STAGE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
        zero: u8,
        #[command(flatten)]
        amp: AmpArgs,
    },
    /// Plan a stand-alone interval set (MiniMalloc CSV) into one arena.
    Arena(ArenaArgs),
    /// Import an ONNX model: write its program as TDSL (`STEM.tdsl`, inference only, one
    /// `param` per initializer it reads) and the initializers (`STEM.safetensors`).
    Import {
        /// The `.onnx` file.
        file: PathBuf,
        /// The folder to write `STEM.tdsl` and `STEM.safetensors` into (default: here).
        #[arg(short = 'o', long = "out-dir", value_name = "DIR")]
        out_dir: Option<PathBuf>,
        /// Write the program to this file instead (the params beside it, `.safetensors`).
        #[arg(long, value_name = "FILE")]
        out_tdsl: Option<PathBuf>,
        /// Size a named (dynamic) dimension of the inputs: `--dim batch=8` (repeatable).
        #[arg(long = "dim", value_name = "NAME=N", value_parser = parse_set)]
        dims: Vec<(String, String)>,
        /// Compute float64 tensors in f32 (tcc has no f64), as JAX does without x64; without
        /// it a float64 tensor is an error.
        #[arg(long = "f64-as-f32")]
        f64_as_f32: bool,
    },
    /// Run a program (a .tdsl file, compiled first, or a compiled .tcc artifact).
    Run {
        #[command(flatten)]
        program: ProgramArgs,
        /// Run with the eager reference interpreter (op by op, allocate and free) instead
        /// of compiled kernels.
        #[arg(long)]
        eager: bool,
        /// The device to run on [default: cpu for a program; an artifact runs on the
        /// target it was built for].
        #[arg(long, value_enum)]
        target: Option<Target>,
        /// Threads for the CPU kernels, the calling one included [default: one per
        /// available core].
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        /// Let f32 matmuls use TF32 tensor cores on CUDA (10-bit mantissa products, f32
        /// accumulation), as PyTorch's `allow_tf32`; off by default.
        #[arg(long)]
        allow_tf32: bool,
        /// How many steps to run (0: only print the memory accounting).
        #[arg(long, default_value_t = 1, value_name = "N")]
        steps: u32,
        /// Print outputs every K steps (the last step is always printed).
        #[arg(long, default_value_t = 1, value_name = "K")]
        every: u32,
        /// Seed of parameter initialisation and of random inputs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Feed an input from a .npy file (repeatable); other inputs are random (seeded).
        #[arg(long = "input", value_name = "NAME=FILE.npy", value_parser = parse_set)]
        inputs: Vec<(String, String)>,
        /// Load params by name from a .safetensors file.
        #[arg(long, value_name = "FILE")]
        param_file: Option<PathBuf>,
        /// Save params (and optimizer state) after the last step to a .safetensors file.
        #[arg(long, value_name = "FILE")]
        save_params: Option<PathBuf>,
        /// Write every output of the last step to DIR/NAME.npy (f16/bf16 as f32).
        #[arg(long, value_name = "DIR")]
        save_outputs: Option<PathBuf>,
        /// Go on after a step whose loss (or any scalar output, or any output on a printed
        /// step) is NaN or infinite, and save non-finite params; by default the run stops
        /// there with exit code 1 and `--save-params` refuses.
        #[arg(long)]
        allow_nonfinite: bool,
        /// Data parallelism: run the training step for N GPUs (N ranks on the CPU), each
        /// running it on its own slice of the batch (the program's batch is one rank's), with
        /// the gradients summed across them before the optimizer (NCCL on CUDA). An
        /// artifact runs with the ranks it was built for; `--input` files then hold the
        /// whole batch (N times one rank's first axis), split in order.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
        gpus: Option<u32>,
        /// ZeRO-1 (`--zero 1`, with `--gpus N`): each rank keeps and updates 1/N of the
        /// optimizer state (Adam's moments, SGD's momentum), after a reduce-scatter of the
        /// gradients, then all-gathers the updated params. 0: every rank keeps all of it.
        #[arg(long, value_name = "STAGE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
        zero: u8,
        #[command(flatten)]
        remat: RematArgs,
        #[command(flatten)]
        amp: AmpArgs,
    },
}

/// Options of `tcc arena`.
#[derive(clap::Args, Debug, Clone)]
pub struct ArenaArgs {
    /// A MiniMalloc-format CSV: `id,lower,upper,size` (one buffer per line).
    pub file: PathBuf,
    /// Budget of the search, in milliseconds of search work on a typical core (counted in
    /// search steps, not on a clock, so every machine gives the same result).
    #[arg(long, default_value_t = 4000, value_name = "MS")]
    pub budget_ms: u64,
    /// Offset alignment in bytes.
    #[arg(long, default_value_t = 1)]
    pub align: u64,
    /// Write the solution (the input columns plus `offset`) to this CSV.
    #[arg(short = 'o', long, value_name = "OUT.csv")]
    pub output: Option<PathBuf>,
    /// Solve the decision problem: find a placement within this capacity (no minimisation).
    #[arg(long, value_name = "BYTES")]
    pub capacity: Option<u64>,
}

/// Mixed precision.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AmpArgs {
    /// Mixed precision: matmuls and convolutions on 16-bit tensor-core operands with f32
    /// accumulation, reductions, exp/log, norms and losses in f32, 16-bit values stored
    /// between kernels, f32 params, gradients and optimizer state (the policy table:
    /// `tcc::passes::amp`). `f16` adds dynamic loss scaling.
    #[arg(long, value_enum, default_value_t = AmpMode::Off)]
    pub amp: AmpMode,
    /// Loss scaling of `train`: `none`, `dynamic` (PyTorch's GradScaler defaults: init
    /// 65536, growth 2 after 2000 clean steps, backoff 0.5), or settings such as
    /// `init=1024,growth=2,backoff=0.5,interval=100`. Default: dynamic with `--amp f16`,
    /// none otherwise.
    #[arg(long, value_name = "SPEC")]
    pub loss_scale: Option<String>,
    /// Build the training step without its finite check: by default a step without loss
    /// scaling sums the magnitudes of the params its updates write (one more read of each,
    /// on the device), and the run stops at the first step where the sum is not finite (a
    /// NaN or infinite gradient, which every optimizer carries into its param, or an
    /// update past f32's range).
    #[arg(long)]
    pub no_finite_check: bool,
}

/// `--amp` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum AmpMode {
    /// The program's own dtypes.
    #[default]
    Off,
    /// bfloat16 (f32's range; no loss scaling needed).
    Bf16,
    /// IEEE half (with dynamic loss scaling).
    F16,
}

impl AmpArgs {
    /// The settings, or what is wrong with `--loss-scale`.
    pub fn options(&self) -> Result<crate::passes::amp::Amp, String> {
        use crate::autodiff::scale::LossScale;
        let name = match self.amp {
            AmpMode::Off => "off",
            AmpMode::Bf16 => "bf16",
            AmpMode::F16 => "f16",
        };
        let mut amp =
            crate::passes::amp::Amp::named(name).ok_or_else(|| format!("--amp {name}: unknown"))?;
        amp.no_finite_check = self.no_finite_check;
        let Some(spec) = &self.loss_scale else {
            return Ok(amp);
        };
        amp.loss_scale = match spec.trim() {
            "none" => None,
            "dynamic" => Some(LossScale::default()),
            settings => {
                let mut s = LossScale::default();
                for part in settings.split(',') {
                    let (k, v) = part.split_once('=').ok_or_else(|| {
                        format!("--loss-scale: expected `none`, `dynamic` or KEY=VALUE,..., found `{part}`")
                    })?;
                    let num: f64 = v.trim().parse().map_err(|_| {
                        format!("--loss-scale {}: `{}` is not a number", k.trim(), v.trim())
                    })?;
                    let positive = num.is_finite() && num > 0.0;
                    match k.trim() {
                        "init" if positive => s.init = num,
                        "growth" if positive && num >= 1.0 => s.growth = num,
                        "backoff" if positive && num <= 1.0 => s.backoff = num,
                        "interval" if positive && num.fract() == 0.0 && num <= f64::from(u32::MAX) => {
                            s.interval = num as u32
                        }
                        k @ ("init" | "growth" | "backoff" | "interval") => {
                            return Err(format!(
                                "--loss-scale {k}={num}: out of range (init > 0, growth >= 1, 0 < backoff <= 1, interval a positive integer)"
                            ))
                        }
                        other => {
                            return Err(format!(
                                "--loss-scale: unknown setting `{other}` (init, growth, backoff, interval)"
                            ))
                        }
                    }
                }
                Some(s)
            }
        };
        Ok(amp)
    }
}

/// Pipeline debugging options: the stages are the rows of `tcc::pipeline::PIPELINE`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PipelineArgs {
    /// Print the product after a stage (the graph IR, the kernel IR after `fuse`, the
    /// kernels with their arena offsets after `plan`, the code after `codegen`), or after
    /// `all`, to stderr (repeatable).
    #[arg(long, value_name = "STAGE", value_parser = stage_or_all())]
    pub print_after: Vec<String>,
    /// Stop after this stage and write its product (as `--print-after` shows it) instead
    /// of what `--emit` asks for.
    #[arg(long, value_name = "STAGE", value_parser = stages())]
    pub stop_after: Option<String>,
}

fn stages() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(crate::pipeline::stage_names())
}

fn stage_or_all() -> clap::builder::PossibleValuesParser {
    let mut names = crate::pipeline::stage_names();
    names.push("all");
    clap::builder::PossibleValuesParser::new(names)
}

/// Compilation targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// The host CPU (Cranelift).
    Cpu,
    /// An NVIDIA GPU (PTX).
    Cuda,
}

impl Target {
    /// As the flag spells it.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

/// Layout of convolution-chain intermediates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Layout {
    /// What the target's kernels prefer.
    Auto,
    /// Logical order (channels first).
    Nchw,
    /// Channels last.
    Nhwc,
}

/// Build outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// The graph IR, as text.
    Ir,
    /// The fused kernels (kernel IR) with arena offsets.
    Kernels,
    /// The Cranelift IR of every kernel (`--target cpu`).
    Clif,
    /// The PTX module (`--target cuda`).
    Ptx,
    /// The compiled artifact (`-o model.tcc`), for `tcc run` and the runtime crate.
    Artifact,
}

/// Whether a `cuda` artifact carries SASS besides its PTX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SassMode {
    /// When `ptxas` is found (`$TCC_PTXAS`, else `PATH`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`,
    /// `/usr/local/cuda/bin`); PTX only otherwise. The artifact's bytes then depend on
    /// whether and which `ptxas` is there.
    Auto,
    /// Always: no `ptxas`, or one that fails, is an error.
    On,
    /// PTX only (the driver compiles it at load; its JIT cache keeps the result).
    Off,
}

fn parse_set(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.trim().is_empty() && !v.trim().is_empty() => {
            Ok((n.trim().to_string(), v.trim().to_string()))
        }
        _ => Err(format!("expected NAME=VALUE, found `{s}`")),
    }
}

/// Runs the CLI; returns the process exit code (0 ok, 1 user error).
pub fn run(cli: Cli) -> ExitCode {
    let color = match cli.color {
        Color::Always => ColorChoice::Always,
        Color::Never => ColorChoice::Never,
        Color::Auto if std::io::stderr().is_terminal() => ColorChoice::Auto,
        Color::Auto => ColorChoice::Never,
    };
    let mut stderr = StandardStream::stderr(color);
    QUIET.store(cli.quiet, std::sync::atomic::Ordering::Relaxed);
    match cli.command {
        Command::Check { program } => {
            let Some((sources, lowered, ms)) = load(
                &program,
                ModelSelection::All,
                &mut stderr,
                program.model.is_some(),
                program.loss_chunks.map(|k| k as usize),
            ) else {
                return ExitCode::from(1);
            };
            for g in &lowered.graphs {
                let _ = writeln!(
                    stderr,
                    "ok: model `{}`: {} nodes, {} inputs, {} params, {} outputs{}",
                    g.name,
                    g.node_count(),
                    g.inputs.len(),
                    g.params.len(),
                    g.outputs.len(),
                    if g.train.is_some() { ", trains" } else { "" }
                );
            }
            info!("checked {} in {ms:.1} ms", display(&program.file));
            drop(sources);
            ExitCode::SUCCESS
        }
        Command::Build {
            program,
            emit,
            output,
            locations,
            pipeline,
            target,
            no_fuse,
            layout,
            allow_tf32,
            seed,
            gpus,
            zero,
            sass,
            remat,
            amp,
        } => {
            if !zero_with_gpus(zero, gpus, &mut stderr) {
                return ExitCode::from(1);
            }
            let Some(amp) = amp_options(&amp, &mut stderr) else {
                return ExitCode::from(1);
            };
            if sass == SassMode::On
                && (emit != Emit::Artifact
                    || target != Target::Cuda
                    || pipeline.stop_after.is_some())
            {
                let _ = writeln!(
                    stderr,
                    "error: `--sass on` needs a `cuda` artifact (`--target cuda`, `--emit artifact`, \
                     no `--stop-after`)"
                );
                return ExitCode::from(1);
            }
            // An artifact goes to a file, `STEM.tcc` in the current directory unless `-o`
            // says otherwise; `--stop-after` prints the stage's product as text instead.
            let output = match (emit, output) {
                (Emit::Artifact, None) if pipeline.stop_after.is_none() => Some(
                    PathBuf::from(program.file.file_stem().unwrap_or_default())
                        .with_extension("tcc"),
                ),
                // `-o -`: standard output, as most tools read it.
                (_, Some(o)) if o.as_os_str() == "-" => None,
                (_, o) => o,
            };
            if pipeline.stop_after.is_none() && !build::check_emit(emit, target, &mut stderr) {
                return ExitCode::from(1);
            }
            let Ok(remat) = remat.options().map_err(|e| {
                let _ = writeln!(stderr, "error: {e}");
            }) else {
                return ExitCode::from(1);
            };
            let opts = crate::pipeline::Options {
                compile: crate::artifact::CompileOptions {
                    allow_tf32,
                    amp,
                    ranks: gpus.unwrap_or(1) as usize,
                    zero: zero == 1,
                    ..build::compile_options(target, no_fuse, layout)
                },
                remat,
                ..Default::default()
            };
            let last = pipeline
                .stop_after
                .clone()
                .unwrap_or_else(|| build::last_stage(emit, amp.dtype.is_some()).to_string());
            let Some((sources, product, report)) =
                load_one(&program, &pipeline, opts, &last, locations, &mut stderr)
            else {
                return ExitCode::from(1);
            };
            if let Some(line) = build::compile_line(&product, &report) {
                info!("{line}");
            }
            let map = locations.then_some(&sources.map);
            let bytes = if pipeline.stop_after.is_some() {
                product.render(map).into_bytes()
            } else {
                let given = match onnx_cmd::given_params(&program) {
                    Ok(g) => g,
                    Err(e) => {
                        let _ = writeln!(stderr, "error: {e}");
                        return ExitCode::from(1);
                    }
                };
                let out = build::Request {
                    emit,
                    target,
                    seed,
                    sass,
                };
                match build::emit_bytes(&product, out, map, &given, &mut stderr) {
                    Some(b) => b,
                    None => return ExitCode::from(1),
                }
            };
            match output {
                Some(path) => {
                    if let Err(e) = tcc_runtime::fsutil::write_atomic(&path, &bytes) {
                        let _ = writeln!(stderr, "error: cannot write {}: {e}", display(&path));
                        return ExitCode::from(1);
                    }
                    info!(
                        "wrote {} ({} nodes, {:.1} ms)",
                        display(&path),
                        product.graph().node_count(),
                        report.total_ms()
                    );
                }
                None => {
                    let mut out = std::io::stdout().lock();
                    if out.write_all(&bytes).is_err() {
                        return ExitCode::from(1);
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Command::Mem {
            program,
            svg,
            json,
            budget_ms,
            target,
            gpus,
            zero,
            remat,
            amp,
        } => {
            if !zero_with_gpus(zero, gpus, &mut stderr) {
                return ExitCode::from(1);
            }
            let Some(amp) = amp_options(&amp, &mut stderr) else {
                return ExitCode::from(1);
            };
            let Ok(remat_opts) = remat.options().map_err(|e| {
                let _ = writeln!(stderr, "error: {e}");
            }) else {
                return ExitCode::from(1);
            };
            // The target's own options, as `tcc build --target` compiles (so `--mem-budget`
            // weighs the target's plans too).
            let compile = crate::artifact::CompileOptions {
                amp,
                ranks: gpus.unwrap_or(1) as usize,
                zero: zero == 1,
                flash_backward: remat_opts.flash_backward,
                ..build::compile_options(target, false, Layout::Auto)
            };
            let opts = crate::pipeline::Options {
                remat: remat_opts,
                compile,
                ..Default::default()
            };
            // The program in program order (what eager runs), then the scheduled step
            // after `remat`; `mem::report` plans it with the stages after `remat`.
            let Some((sources, product, _)) = load_one(
                &program,
                &PipelineArgs::default(),
                opts.clone(),
                "autodiff",
                false,
                &mut stderr,
            ) else {
                return ExitCode::from(1);
            };
            let program_graph = product.graph().clone();
            let (scheduled, decision, free) =
                match crate::pipeline::run(product, "schedule", "remat", &opts, &mut |_, _| {}) {
                    Ok((p, report)) => (p.graph().clone(), report.remat, report.free),
                    Err(e) => {
                        stage_error(&e, &sources, &mut stderr);
                        return ExitCode::from(1);
                    }
                };
            // The text report ends with the decision; JSON gets it on stderr.
            if let (true, Some((d, _)), Some(b)) = (json, &decision, remat.mem_budget) {
                info!("{}", remat_cmd::summary(d, b));
            }
            match mem::report(
                &program_graph,
                &scheduled,
                &sources,
                std::time::Duration::from_millis(budget_ms),
                &compile,
                free.as_ref(),
            ) {
                Ok(mem::MemFindings {
                    report: r,
                    graph,
                    plan,
                    eager,
                }) => {
                    if json {
                        match serde_json::to_string_pretty(&r) {
                            Ok(t) => println!("{t}"),
                            Err(e) => {
                                let _ = writeln!(stderr, "error: {e}");
                                return ExitCode::from(1);
                            }
                        }
                    } else {
                        print!("{}", mem::text(&r, true));
                        if let (Some((d, before)), Some(b)) = (&decision, remat.mem_budget) {
                            print!("{}", remat_cmd::report(before, d, b, &sources));
                        }
                    }
                    if let Some(path) = svg {
                        let doc = plan_svg::render(&graph, &plan, &eager, &sources.map);
                        if let Err(e) = tcc_runtime::fsutil::write_atomic(&path, doc.as_bytes()) {
                            let _ = writeln!(stderr, "error: cannot write {}: {e}", display(&path));
                            return ExitCode::from(1);
                        }
                        info!("wrote {}", display(&path));
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Remat {
            files,
            sets,
            model,
            budgets,
            time_ms,
            amp,
        } => {
            let Some(amp) = amp_options(&amp, &mut stderr) else {
                return ExitCode::from(1);
            };
            match remat_cmd::run(&files, &sets, &model, &budgets, time_ms, amp) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Fit {
            program,
            mem_budget,
            grow,
            max,
            remat,
            remat_time_ms,
            gpus,
            zero,
            amp,
        } => {
            if !zero_with_gpus(zero, gpus, &mut stderr) {
                return ExitCode::from(1);
            }
            let Some(amp) = amp_options(&amp, &mut stderr) else {
                return ExitCode::from(1);
            };
            match fit::run(
                &program.file,
                &program.sets,
                &program.model,
                mem_budget,
                &grow,
                max.max(1),
                remat,
                remat_time_ms,
                amp,
                Parallel {
                    ranks: gpus.unwrap_or(1) as usize,
                    zero: zero == 1,
                    micro_batches: program.micro_batches as usize,
                    loss_chunks: program.loss_chunks,
                },
            ) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Import {
            file,
            out_dir,
            out_tdsl,
            dims,
            f64_as_f32,
        } => match onnx_cmd::run_import(
            &file,
            out_dir.as_deref(),
            out_tdsl.as_deref(),
            &dims,
            f64_as_f32,
        ) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                let _ = writeln!(stderr, "error: {e}");
                ExitCode::from(1)
            }
        },
        Command::Arena(args) => match arena_cmd::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                let _ = writeln!(stderr, "error: {e}");
                ExitCode::from(1)
            }
        },
        Command::Run {
            program,
            eager,
            target,
            threads,
            allow_tf32,
            steps,
            every,
            seed,
            inputs,
            param_file,
            save_params,
            save_outputs,
            allow_nonfinite,
            gpus,
            zero,
            remat,
            amp,
        } => {
            if !zero_with_gpus(zero, gpus, &mut stderr) {
                return ExitCode::from(1);
            }
            let Some(amp) = amp_options(&amp, &mut stderr) else {
                return ExitCode::from(1);
            };
            let Ok(remat_opts) = remat.options().map_err(|e| {
                let _ = writeln!(stderr, "error: {e}");
            }) else {
                return ExitCode::from(1);
            };
            let opts = run::RunOptions {
                steps,
                every: every.max(1),
                seed,
                inputs,
                param_file,
                save_params,
                allow_nonfinite,
                threads: threads.unwrap_or(0),
                allow_tf32,
                amp,
                params: Default::default(),
                save_outputs,
                gpus,
                zero: zero == 1,
            };
            let mut opts = opts;
            if eager {
                match onnx_cmd::given_params_tensors(&program) {
                    Ok(g) => opts.params = g,
                    Err(e) => {
                        let _ = writeln!(stderr, "error: {e}");
                        return ExitCode::from(1);
                    }
                }
            }
            if eager && gpus.is_some_and(|n| n > 1) {
                let _ = writeln!(
                    stderr,
                    "error: `--eager` runs one interpreter, not data-parallel ranks: drop `--gpus` or `--eager`"
                );
                return ExitCode::from(1);
            }
            if program.file.extension().is_some_and(|e| e == "tcc") {
                if eager {
                    let _ = writeln!(
                        stderr,
                        "error: {}: `--eager` interprets a program's source, and an artifact holds compiled code: run the `.tdsl` with `--eager`",
                        display(&program.file)
                    );
                    return ExitCode::from(1);
                }
                let mut ignored = Vec::new();
                if !program.sets.is_empty() {
                    ignored.push("--set");
                }
                if program.model.is_some() {
                    ignored.push("--model");
                }
                if program.f64_as_f32 {
                    ignored.push("--f64-as-f32");
                }
                if remat.mem_budget.is_some() {
                    ignored.push("--mem-budget");
                }
                if remat.remat.is_some() {
                    ignored.push("--remat");
                }
                if remat.no_product_remat {
                    ignored.push("--no-product-remat");
                }
                if remat.flash_backward {
                    ignored.push("--flash-backward");
                }
                if allow_tf32 {
                    ignored.push("--allow-tf32");
                }
                if zero != 0 {
                    ignored.push("--zero");
                }
                if !ignored.is_empty() {
                    let _ = writeln!(
                        stderr,
                        "error: {}: {} apply when a program is compiled; an artifact keeps what it was built with (pass them to `tcc build`, or run the `.tdsl`)",
                        display(&program.file),
                        ignored
                            .iter()
                            .map(|o| format!("`{o}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    return ExitCode::from(1);
                }
            }
            if !eager {
                return run_compiled(&program, target, &opts, remat_opts, &mut stderr);
            }
            // The interpreter runs the step in program order (eager semantics), under
            // `--amp` with the mixed-precision policy applied to it.
            let popts = crate::pipeline::Options {
                remat: remat_opts,
                compile: crate::artifact::CompileOptions {
                    amp,
                    ..Default::default()
                },
                ..Default::default()
            };
            let Some((sources, product, report)) = load_one(
                &program,
                &PipelineArgs::default(),
                popts,
                "autodiff",
                false,
                &mut stderr,
            ) else {
                return ExitCode::from(1);
            };
            let graph = match amp.apply_to(product.graph()) {
                Ok(g) => g,
                Err(e) => {
                    let _ = writeln!(
                        stderr,
                        "error: internal compiler error: mixed precision: {}",
                        e.message
                    );
                    return ExitCode::from(1);
                }
            };
            match run::run_eager(&graph, &sources, &opts, report.total_ms()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

/// `tcc run` on compiled code: loads a `.tcc` artifact, or compiles a `.tdsl` first.
fn run_compiled(
    program: &ProgramArgs,
    explicit_target: Option<Target>,
    opts: &run::RunOptions,
    remat: crate::pipeline::RematOptions,
    stderr: &mut StandardStream,
) -> ExitCode {
    let is_artifact = program.file.extension().is_some_and(|e| e == "tcc");
    if is_artifact && opts.amp != crate::passes::amp::Amp::default() {
        let _ = writeln!(
            stderr,
            "error: {}: `--amp`, `--loss-scale` and `--no-finite-check` apply when a program is compiled; an artifact keeps the numerics it was built with (`tcc build --amp ...`)",
            display(&program.file)
        );
        return ExitCode::from(1);
    }
    if is_artifact && program.loss_chunks.is_some() {
        let _ = writeln!(
            stderr,
            "error: {}: `--loss-chunks` applies when a program is compiled; an artifact runs the step it was built as (`tcc build --loss-chunks K`)",
            display(&program.file)
        );
        return ExitCode::from(1);
    }
    if is_artifact && program.micro_batches > 1 {
        let _ = writeln!(
            stderr,
            "error: {}: `--micro-batches` applies when a program is compiled; an artifact runs the step it was built as (`tcc build --micro-batches K`)",
            display(&program.file)
        );
        return ExitCode::from(1);
    }
    let target = explicit_target.unwrap_or(Target::Cpu);
    let t0 = Instant::now();
    let (model, graph, ms) = if is_artifact {
        match tcc_runtime::Model::load(&program.file) {
            Ok(m) => {
                let built = match m.target() {
                    tcc_runtime::Target::Cpu => Target::Cpu,
                    tcc_runtime::Target::Cuda => Target::Cuda,
                };
                if explicit_target.is_some_and(|t| t != built) {
                    let _ = writeln!(
                        stderr,
                        "error: {}: the artifact was built for `{}`, so `--target {}` does not apply (build it again with `tcc build --target ...`)",
                        display(&program.file),
                        built.name(),
                        target.name()
                    );
                    return ExitCode::from(1);
                }
                (m, None, t0.elapsed().as_secs_f64() * 1e3)
            }
            Err(e) => {
                let _ = writeln!(stderr, "error: {}: {e}", display(&program.file));
                return ExitCode::from(1);
            }
        }
    } else {
        let popts = crate::pipeline::Options {
            compile: crate::artifact::CompileOptions {
                allow_tf32: opts.allow_tf32,
                amp: opts.amp,
                ranks: opts.gpus.unwrap_or(1) as usize,
                zero: opts.zero,
                ..build::compile_options(target, false, Layout::Auto)
            },
            remat,
            ..Default::default()
        };
        let Some((_sources, product, report)) = load_one(
            program,
            &PipelineArgs::default(),
            popts,
            "codegen",
            false,
            stderr,
        ) else {
            return ExitCode::from(1);
        };
        if let Some(line) = build::compile_line(&product, &report) {
            info!("{line}");
        }
        // Params without an initialiser: an imported model's, or `--param-file`'s.
        let given = match (onnx_cmd::given_params(program), &opts.param_file) {
            (Ok(g), _) if !g.is_empty() => g,
            (Ok(g), None) => g,
            (Ok(_), Some(path)) => match onnx_cmd::params_from_file(product.graph(), path) {
                Ok(g) => g,
                Err(e) => {
                    let _ = writeln!(stderr, "error: {e}");
                    return ExitCode::from(1);
                }
            },
            (Err(e), _) => {
                let _ = writeln!(stderr, "error: {e}");
                return ExitCode::from(1);
            }
        };
        // The driver compiles the PTX of a program run from source (its JIT cache keeps it).
        let out = build::Request {
            emit: Emit::Artifact,
            target,
            seed: opts.seed,
            sass: SassMode::Off,
        };
        let Some(bytes) = build::emit_bytes(&product, out, None, &given, stderr) else {
            return ExitCode::from(1);
        };
        let ms = report.total_ms();
        match tcc_runtime::Model::from_bytes(bytes) {
            Ok(m) => (m, Some(product.graph().clone()), ms),
            Err(e) => {
                let _ = writeln!(stderr, "error: {e}");
                return ExitCode::from(1);
            }
        }
    };
    match run::run_compiled(&model, graph.as_ref(), opts, ms) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(stderr, "error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Loads one model and runs the pipeline on it up to `last` (or `--stop-after`), printing
/// what `--print-after` asks for and, under `--mem-budget` with `auto`, remat's summary.
/// Errors are printed.
fn load_one(
    program: &ProgramArgs,
    pipeline: &PipelineArgs,
    mut opts: crate::pipeline::Options,
    last: &str,
    locations: bool,
    stderr: &mut StandardStream,
) -> Option<(Sources, crate::pipeline::Product, crate::pipeline::Report)> {
    let start = Instant::now();
    let chunks = loss_chunks(program.loss_chunks, opts.compile.amp);
    let (sources, mut lowered, _) = load(
        program,
        ModelSelection::One(program.model.clone()),
        stderr,
        true,
        chunks,
    )?;
    if lowered.graphs.is_empty() {
        return None;
    }
    let graph = lowered.graphs.remove(0);
    opts.print_after = pipeline.print_after.clone();
    opts.stop_after = pipeline.stop_after.clone();
    let map = &sources.map;
    // No spinner while stages print their products.
    let _spinner = crate::progress::Spinner::start(
        &format!("compiling `{}`", graph.name),
        quiet() || !opts.print_after.is_empty(),
    );
    let result = crate::pipeline::lowered(graph, start.elapsed(), last, &opts, &mut |stage, p| {
        let what = match p.form() {
            crate::pipeline::Form::Graph | crate::pipeline::Form::Source => "IR",
            crate::pipeline::Form::Kernels => "kernel IR",
            crate::pipeline::Form::Planned => "planned kernel IR",
            crate::pipeline::Form::Code => "code",
        };
        eprintln!("// ----- {what} after {stage} -----");
        eprint!("{}", p.render(locations.then_some(map)));
    });
    match result {
        Ok((p, report)) => {
            if let (Some((d, _)), Some(b)) = (&report.remat, opts.remat.budget) {
                info!("{}", remat_cmd::summary(d, b));
            }
            Some((sources, p, report))
        }
        Err(e) => {
            stage_error(&e, &sources, stderr);
            None
        }
    }
}

/// `--amp` and `--loss-scale`, or the error printed.
fn amp_options(args: &AmpArgs, stderr: &mut StandardStream) -> Option<crate::passes::amp::Amp> {
    args.options()
        .map_err(|e| {
            let _ = writeln!(stderr, "error: {e}");
        })
        .ok()
}

fn display(p: &Path) -> String {
    p.display().to_string()
}

/// The loss-head chunks of a build (`--loss-chunks`): as asked, else chosen by the front
/// end (`None`) in f32 steps, else whole. Under `--amp` each chunk's logit gradient is
/// cast twice (as `[B, T, V]` and as `[B·T, V]`), so its f32 value and both casts live at
/// once: gpt's arena does not drop (1.95 GiB either way at V = 8192, 2.70 -> 2.69 GiB at
/// V = 50304).
pub fn loss_chunks(asked: Option<u32>, amp: crate::passes::amp::Amp) -> Option<usize> {
    asked
        .map(|k| k as usize)
        .or((amp != crate::passes::amp::Amp::default()).then_some(1))
}

/// Reads and lowers a program, printing diagnostics. Returns the sources, the graphs and
/// the front-end time in milliseconds.
fn load(
    program: &ProgramArgs,
    mut selection: ModelSelection,
    stderr: &mut StandardStream,
    single: bool,
    loss_chunks: Option<usize>,
) -> Option<(Sources, front::Lowered, f64)> {
    if single {
        selection = ModelSelection::One(program.model.clone());
    }
    let onnx = onnx_cmd::is_onnx(&program.file);
    if program.f64_as_f32 && !onnx {
        let _ = writeln!(
            stderr,
            "error: --f64-as-f32 applies to .onnx models; {} is a TDSL program",
            program.file.display()
        );
        return None;
    }
    let bytes = if onnx {
        match onnx_cmd::program_source(program) {
            Ok(imp) => imp.tdsl.into_bytes(),
            Err(e) => {
                let _ = writeln!(stderr, "error: {e}");
                return None;
            }
        }
    } else {
        match read_file(&program.file, MAX_SOURCE_BYTES) {
            Ok(b) => b,
            Err(e) => {
                let _ = writeln!(stderr, "error: {e}");
                return None;
            }
        }
    };
    let start = Instant::now();
    let name = display(&program.file);
    let mut sources = Sources::new(&name, &bytes);
    let opts = Options {
        // On an imported model `--set` sized its named dimensions.
        sets: if onnx {
            Vec::new()
        } else {
            program.sets.clone()
        },
        models: selection,
    };
    let result = front::micro_batch::compile_step(
        &mut sources,
        &opts,
        program.micro_batches as usize,
        loss_chunks,
    );
    let ms = start.elapsed().as_secs_f64() * 1e3;
    match result {
        Ok(lowered) => {
            emit_all(&lowered.warnings, &sources, stderr);
            Some((sources, lowered, ms))
        }
        Err(diags) => {
            emit_all(&diags, &sources, stderr);
            let n = diags.iter().filter(|d| d.is_error()).count();
            let _ = writeln!(
                stderr,
                "error: could not compile {} due to {n} error{}",
                name,
                if n == 1 { "" } else { "s" }
            );
            None
        }
    }
}

/// A stage's error: the program's diagnostics with their spans, or one `error:` line.
fn stage_error(e: &crate::pipeline::StageError, sources: &Sources, stderr: &mut StandardStream) {
    match e {
        crate::pipeline::StageError::Program(diags) => emit_all(diags, sources, stderr),
        other => {
            let _ = writeln!(stderr, "error: {other}");
        }
    }
}

/// Diagnostics shown at most; the rest are counted (rustc shows them all, but one per
/// stray byte of a binary file is noise, and each renders its whole source line).
const MAX_SHOWN: usize = 50;

fn emit_all(diags: &[Diagnostic], sources: &Sources, stderr: &mut StandardStream) {
    for d in diags.iter().take(MAX_SHOWN) {
        let _ = d.emit(&sources.map, stderr);
    }
    if diags.len() > MAX_SHOWN {
        let _ = writeln!(
            stderr,
            "note: {} more diagnostics not shown (the first {MAX_SHOWN} are above)",
            diags.len() - MAX_SHOWN
        );
    }
}
