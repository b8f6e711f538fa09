//! The artifact format: a JSON manifest plus aligned binary sections (see `ARTIFACT.md`).
//!
//! The compiler builds a [`Manifest`] and the section bytes and calls [`write()`]; the runtime
//! calls [`read`]. Both sides use these types, so the format has one definition.

use serde::{Deserialize, Serialize};

/// First 8 bytes of every artifact.
pub const MAGIC: [u8; 8] = *b"TCCMODEL";
/// The format version this crate writes and the newest it reads. Version 4 added
/// [`CheckKind::FiniteUpdates`], which a version-3 reader would take for an index check;
/// version 5 checksums with XXH3-64 instead of FNV-1a 64 ([`checksum`]); version 6 CPU
/// code calls the GEMM helper (`sgemm`, slot 11 of the helper table), which a version-5
/// reader's table does not have.
pub const FORMAT_VERSION: u32 = 6;
/// The oldest format version this crate reads: version 3 added the code section's bounds
/// line ([`bounds_line`]), without which the manifest's numbers cannot be checked against
/// the code.
pub const OLDEST_VERSION: u32 = 3;
/// Alignment of every section's start in the file.
pub const SECTION_ALIGN: u64 = 64;

/// Element type of a tensor, spelled as in TDSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    I32,
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }
}

/// Where a named tensor lives in the arena.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorSlot {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte offset in the arena (a multiple of the manifest's `alignment`).
    pub offset: u64,
    /// `product(shape) * dtype size`.
    pub bytes: u64,
    /// For an `i32` input used as indices (class labels, embedding ids): every value must lie
    /// in `[0, index_bound)`. [`crate::Session::set_input`] checks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_bound: Option<u64>,
}

/// Persistent tensor kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PersistentKind {
    /// A trainable (or frozen) parameter.
    Param,
    /// Optimizer state (momentum, Adam moments, step counters).
    State,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PersistentSlot {
    #[serde(flatten)]
    pub slot: TensorSlot,
    pub kind: PersistentKind,
    /// A param drawn from its initialiser at load instead of stored: the distribution and
    /// the seed (format version 2; see [`crate::init`]). Absent: the initial bytes are the
    /// `persistent` section's (zero past its end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<crate::init::Recipe>,
    /// ZeRO-1: this optimizer state is one rank's shard of a state shaped like the param
    /// named here (rank `r` holds block `r` of its elements, zero past their end). Absent:
    /// every rank holds the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_of: Option<String>,
}

impl PersistentSlot {
    /// The shape and bytes of the whole tensor this slot holds a shard of (`None` when it
    /// is whole, or names no param: [`validate`] refuses that).
    pub fn whole<'a>(&self, m: &'a Manifest) -> Option<&'a TensorSlot> {
        let of = self.shard_of.as_ref()?;
        m.persistent
            .iter()
            .find(|p| p.kind == PersistentKind::Param && &p.slot.name == of)
            .map(|p| &p.slot)
    }
}

/// One kernel launch of the step, in launch order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelEntry {
    /// Function name in the code section (CLIF: `%name`; PTX: `.entry name`).
    pub name: String,
    /// CPU: the kernel's outer loop runs over `[0, extent)`; the function takes `[lo, hi)`.
    /// CUDA: the number of threads in the grid's x dimension (before blocking).
    pub extent: u64,
    /// CPU: disjoint `[lo, hi)` ranges may run at the same time on different threads.
    pub parallel: bool,
    /// CUDA launch shape (absent on the CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<Launch>,
    /// The earlier kernels (indices into `kernels`, ascending) that this one must wait for:
    /// those that write bytes it reads, or read or write bytes it writes (directly; the
    /// others follow through them). The CUDA executor builds the step's graph from these
    /// edges, so kernels that do not depend on each other may overlap. Absent: the kernel
    /// waits for the one before it (launch order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<u32>>,
    /// One line on what the kernel computes (the fused graph nodes), for humans.
    #[serde(default)]
    pub describe: String,
    /// A collective of a data-parallel step (`tcc build --gpus N`): what the ranks combine
    /// after this kernel runs. A single session runs the kernel alone, which is the whole
    /// op on one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<Collective>,
}

/// What the ranks of a data-parallel step combine across their arenas after a kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Collective {
    pub op: CollectiveOp,
    /// The arena bytes `[offset, offset + bytes)` the kernel writes (its result):
    /// `bytes / dtype size` elements of `dtype`. An all-reduce sums them in place after
    /// the kernel; the other ops write them from `input` instead of the kernel.
    pub offset: u64,
    pub bytes: u64,
    pub dtype: DType,
    /// The kernel only copies those bytes onto themselves (the result took its operand's
    /// buffer): a data-parallel executor may skip it.
    #[serde(default)]
    pub in_place: bool,
    /// The operand's bytes, for every op but the all-reduce (which reduces its result in
    /// place): the kernel of such an op is a placeholder a data-parallel executor never
    /// launches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Region>,
}

/// Arena bytes `[offset, offset + bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub offset: u64,
    pub bytes: u64,
}

/// The collectives a step may contain (`N` ranks; rank `r`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    /// Every rank gets the element-wise sum over the ranks.
    AllReduceSum,
    /// The input is `N` blocks of the result's size; rank `r` gets block `r` of the
    /// element-wise sum over the ranks.
    ReduceScatterSum,
    /// The result is `N` blocks of the input's size; block `r` is rank `r`'s input.
    AllGather,
    /// Within each rank: the result is block `r` of the input cut into blocks of the
    /// result's size, zero past the input's end (`N` blocks cover the input).
    Shard,
}

/// A CUDA launch configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

/// One planned buffer (for tools and checks; the runtime does not need it to run).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanBuffer {
    /// Name of the graph node that owns the buffer (`%12` or a tensor name).
    pub owner: String,
    pub offset: u64,
    pub bytes: u64,
    /// Live over kernel launches `[start, end)`; persistent buffers span the whole step.
    pub start: usize,
    pub end: usize,
    /// `persistent`, `input` or `transient`.
    pub kind: String,
}

/// The memory plan as shipped.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanInfo {
    pub persistent_bytes: u64,
    pub lower_bound: u64,
    pub method: String,
    pub buffers: Vec<PlanBuffer>,
}

/// A binary section of the file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    pub name: String,
    /// Byte offset from the start of the file (a multiple of [`SECTION_ALIGN`]).
    pub offset: u64,
    pub len: u64,
    /// The section's [`checksum`] as 16 lowercase hex digits (key `xxh3_64`; formats 3 and
    /// 4 wrote an FNV-1a 64 under `fnv1a64`, read and checked as such).
    #[serde(rename = "xxh3_64", alias = "fnv1a64")]
    pub checksum: String,
}

/// Which kind of code the `code` section holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// Cranelift IR text, one function per kernel.
    Cpu,
    /// PTX text, one `.entry` per kernel.
    Cuda,
}

/// The name every check output starts with ([`Manifest::checks`]); not a TDSL name, so no
/// program output can take it.
pub const CHECK_PREFIX: &str = "tcc.check.";

/// What an in-step check's output holds ([`Check`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    /// The count of index values an op was handed outside `[0, bound)`: the step fails
    /// when it is not zero. (Format 3's only kind, so the default.)
    #[default]
    IndexRange,
    /// The sum of the magnitudes of the params after the step's updates (their L1 norm):
    /// the step fails when it is not finite, that is when a gradient held NaN or infinity
    /// (every optimizer carries it into its param) or an update left f32's range. `bound`
    /// is 0.
    FiniteUpdates,
}

/// An output the runtime checks after every step ([`Manifest::checks`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// The output's name (a scalar f32 output starting with [`CHECK_PREFIX`]).
    pub output: String,
    /// What is checked: "embedding into `wte`", "the params `train` updates".
    pub what: String,
    pub bound: u64,
    #[serde(default, skip_serializing_if = "is_index_range")]
    pub kind: CheckKind,
}

fn is_index_range(k: &CheckKind) -> bool {
    *k == CheckKind::IndexRange
}

/// The JSON manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// `tcc <version>`.
    pub producer: String,
    pub model: String,
    pub target: Target,
    pub arena_bytes: u64,
    /// Alignment the arena base must have (and every offset is a multiple of).
    pub alignment: u64,
    pub inputs: Vec<TensorSlot>,
    pub outputs: Vec<TensorSlot>,
    /// Params and optimizer state, in declaration order; all lie in
    /// `[0, plan.persistent_bytes)`.
    pub persistent: Vec<PersistentSlot>,
    pub kernels: Vec<KernelEntry>,
    /// The ranks a data-parallel step was built for (`tcc build --gpus N`): its loss's
    /// gradient is seeded with `1/N` and its kernels carry the collectives that sum the
    /// gradients. Absent: a step that runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<u32>,
    pub plan: PlanInfo,
    /// Machine code of a `cuda` artifact for one GPU architecture, assembled from the PTX by
    /// `ptxas` at build time (the `sass` section). Absent: the driver compiles the PTX at
    /// load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sass: Option<Sass>,
    /// In-step checks: outputs (scalar f32) that count the index values an op was handed
    /// outside `[0, bound)` in the step ([`CheckKind::IndexRange`]; [`crate::Session::run`]
    /// fails a step whose count is not zero), or that sum the magnitudes of the params the
    /// step's updates wrote ([`CheckKind::FiniteUpdates`]; the step fails when the sum is
    /// not finite, unless [`crate::Session::set_allow_nonfinite`]). Absent: nothing to
    /// check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<Check>,
    /// Sections present in the file: `code` (UTF-8 text) and `persistent` (the initial
    /// bytes of the arena's persistent region, `plan.persistent_bytes` long); `sass` with
    /// [`Manifest::sass`].
    pub sections: Vec<Section>,
}

/// The `sass` section's contents: one cubin per piece of the PTX module, each holding
/// whole `.entry` functions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sass {
    /// The architecture `ptxas` compiled for (`-arch`), `sm_90a` say: the cubins load on
    /// GPUs of that compute capability (exactly, with the `a` suffix; the same major and a
    /// minor at least as high, without).
    pub arch: String,
    /// The `ptxas` that made them (its `--version` line naming the release).
    pub assembler: String,
    /// The [`checksum`] of the PTX they were made from (the `code` section's), as 16 hex
    /// digits: cubins of other PTX are refused (key `code_xxh3_64`; `code_fnv1a64` in
    /// formats 3 and 4).
    #[serde(rename = "code_xxh3_64", alias = "code_fnv1a64")]
    pub code_checksum: String,
    pub pieces: Vec<SassPiece>,
}

/// One cubin: bytes `[offset, offset + len)` of the `sass` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SassPiece {
    pub offset: u64,
    pub len: u64,
    /// The kernels (`kernels[i].name`) whose code it holds.
    pub entries: Vec<String>,
}

impl Sass {
    /// The compute capability `arch` names (`sm_90a` → `(9, 0, true)`: major, minor, and
    /// whether the code is for exactly that capability), `None` when it names none.
    pub fn capability(&self) -> Option<(u32, u32, bool)> {
        let digits = self.arch.strip_prefix("sm_")?;
        let (digits, exact) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Some((major.parse().ok()?, minor.parse().ok()?, exact))
    }

    /// Whether the cubins load on a GPU of compute capability `major.minor`.
    pub fn runs_on(&self, major: u32, minor: u32) -> bool {
        match self.capability() {
            Some((ma, mi, true)) => (ma, mi) == (major, minor),
            Some((ma, mi, false)) => ma == major && mi <= minor,
            None => false,
        }
    }

    /// Checks the pieces against the section's length and the kernels: every piece lies in
    /// the section, after the previous one, and every kernel is in exactly one piece; and
    /// that the cubins were made from the PTX whose checksum is `code_checksum`.
    pub fn check(
        &self,
        section_len: u64,
        kernels: &[&str],
        code_checksum: &str,
    ) -> Result<(), String> {
        if self.code_checksum != code_checksum {
            return Err(format!(
                "SASS made from PTX with checksum `{}`, but the code section's is `{code_checksum}`",
                self.code_checksum
            ));
        }
        if self.capability().is_none() {
            return Err(format!(
                "SASS architecture `{}` is not `sm_NN` or `sm_NNa`",
                self.arch
            ));
        }
        let mut home = std::collections::BTreeMap::new();
        let mut end = 0u64;
        for (i, p) in self.pieces.iter().enumerate() {
            let at = format!(
                "SASS piece {i} (bytes [{}, {}+{}))",
                p.offset, p.offset, p.len
            );
            if p.len == 0 {
                return Err(format!("{at} is empty"));
            }
            if p.offset < end {
                return Err(format!(
                    "{at} overlaps the piece before, which ends at {end}"
                ));
            }
            match p.offset.checked_add(p.len) {
                Some(e) if e <= section_len => end = e,
                _ => {
                    return Err(format!(
                        "{at} lies outside the {section_len}-byte `sass` section"
                    ))
                }
            }
            for e in &p.entries {
                if home.insert(e.as_str(), i).is_some() {
                    return Err(format!("SASS: kernel `{e}` is in two pieces"));
                }
            }
        }
        for k in kernels {
            if home.remove(k).is_none() {
                return Err(format!("SASS: no piece holds kernel `{k}`"));
            }
        }
        if let Some(e) = home.keys().next() {
            return Err(format!(
                "SASS: piece entry `{e}` is no kernel of the manifest"
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        })
    }
}

impl TensorSlot {
    /// Number of elements (`product(shape)`; 1 for a scalar), or `None` on overflow.
    pub fn elements(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The slot's byte range in the arena (the manifest has been validated by [`read`] or
    /// [`validate`], so the range fits `usize`).
    pub fn range(&self) -> std::ops::Range<usize> {
        let start = self.offset as usize;
        start..start + self.bytes as usize
    }
}

impl Manifest {
    /// The section named `name`, if the file has one.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }
}

/// Length of the fixed header before the manifest: magic, version, reserved, manifest length.
pub const HEADER_BYTES: usize = 24;

/// The checksum of format `version`'s sections and manifest: XXH3-64 (seed 0) from
/// version 5, [`fnv1a64`] before.
pub fn checksum(version: u32, bytes: &[u8]) -> u64 {
    if version >= 5 {
        xxhash_rust::xxh3::xxh3_64(bytes)
    } else {
        fnv1a64(bytes)
    }
}

/// The checksum this crate writes ([`checksum`] of [`FORMAT_VERSION`]), as 16 lowercase hex
/// digits.
pub fn checksum_hex(bytes: &[u8]) -> String {
    format!("{:016x}", checksum(FORMAT_VERSION, bytes))
}

/// FNV-1a 64-bit hash (offset basis `cbf29ce484222325`, prime `100000001b3`): the checksum
/// of formats 3 and 4.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

/// Serialises an artifact: the header, `manifest` as JSON and `sections` in the given order.
///
/// `manifest.sections` is ignored and rewritten from `sections` (offsets, lengths and
/// checksums), and `manifest.format_version` is written as [`FORMAT_VERSION`]. Every section
/// starts at a multiple of [`SECTION_ALIGN`]; the gaps are zero. The output depends only on
/// the arguments, so writing the same model twice gives the same bytes.
pub fn write(manifest: &Manifest, sections: &[(&str, &[u8])]) -> Vec<u8> {
    let mut m = manifest.clone();
    m.format_version = FORMAT_VERSION;
    // Each section's checksum, once (the layout below may run several times).
    let sums: Vec<String> = sections
        .iter()
        .map(|(_, bytes)| checksum_hex(bytes))
        .collect();
    let lay_out = |m: &mut Manifest, base: u64| {
        let mut at = base;
        m.sections = sections
            .iter()
            .zip(&sums)
            .map(|((name, bytes), sum)| {
                let s = Section {
                    name: (*name).to_string(),
                    offset: at,
                    len: bytes.len() as u64,
                    checksum: sum.clone(),
                };
                at = align_up(at + bytes.len() as u64, SECTION_ALIGN);
                s
            })
            .collect();
    };
    // The section offsets are part of the manifest, so its length depends on them. Grow the
    // base until the manifest fits in front of it; the base only grows, so this terminates
    // (a manifest that shrinks below the base just leaves more zero padding).
    let mut base = align_up(HEADER_BYTES as u64, SECTION_ALIGN);
    let json = loop {
        lay_out(&mut m, base);
        // Serialising these plain structs (strings, integers, vectors; no maps with
        // non-string keys, no floats) cannot fail.
        let json = serde_json::to_vec(&m).unwrap_or_default();
        let needed = align_up((HEADER_BYTES + json.len()) as u64, SECTION_ALIGN);
        if needed <= base {
            break json;
        }
        base = needed;
    };
    let total = m
        .sections
        .last()
        .map_or(base, |s| s.offset + s.len)
        .max((HEADER_BYTES + json.len()) as u64);
    let mut out = Vec::with_capacity(total as usize);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&manifest_check(FORMAT_VERSION, &json).to_le_bytes());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (s, (_, bytes)) in m.sections.iter().zip(sections) {
        out.resize(s.offset as usize, 0);
        out.extend_from_slice(bytes);
    }
    out
}

/// The manifest's checksum in the header (bytes 12..16): format `version`'s [`checksum`] of
/// the manifest's bytes folded to 32 bits, never 0 (a reader refuses a 0 there).
pub fn manifest_check(version: u32, json: &[u8]) -> u32 {
    let h = checksum(version, json);
    ((h ^ (h >> 32)) as u32).max(1)
}

/// The first line of a code section: a comment (`;` in CLIF, `//` in PTX) stating what the
/// code was compiled for: the arena bytes it addresses (every offset it uses lies below)
/// and, for each kernel in launch order, the extent its loop bound or thread guard was
/// compiled with, whether its range may be split over threads, and, on CUDA, the grid,
/// block and dynamic shared bytes its indexing assumes. The writer puts it there from the same plan the code was generated from;
/// [`check_bounds`] refuses a manifest whose numbers differ.
pub fn bounds_line(m: &Manifest) -> String {
    use std::fmt::Write as _;
    let mut s = match m.target {
        Target::Cpu => String::from(";"),
        Target::Cuda => String::from("//"),
    };
    let _ = write!(
        s,
        " tcc-bounds arena={} align={} checks={}",
        m.arena_bytes,
        m.alignment,
        checks_bounds(m)
    );
    for k in &m.kernels {
        let _ = write!(s, " {}={}", k.name, kernel_bounds(k));
    }
    s.push('\n');
    s
}

/// The in-step checks' entry in [`bounds_line`]: `output:bound` of each index check and
/// `output:finite` of each finite check, comma-separated.
fn checks_bounds(m: &Manifest) -> String {
    let each: Vec<String> = m
        .checks
        .iter()
        .map(|c| match c.kind {
            CheckKind::IndexRange => format!("{}:{}", c.output, c.bound),
            CheckKind::FiniteUpdates => format!("{}:finite", c.output),
        })
        .collect();
    each.join(",")
}

/// Whether an output is an in-step check's count ([`Manifest::checks`]): not one of the
/// program's own results.
pub fn is_check_output(name: &str) -> bool {
    name.starts_with(CHECK_PREFIX)
}

/// A kernel's entry in [`bounds_line`]: its extent, `p` after it where chunks of the range
/// may run at once (compiled for that: `parallel`), then on CUDA
/// `:gx,gy,gz:bx,by,bz:shared`, then `/` and the kernels it waits for (`after`), which
/// the code's reads and writes need: a dropped edge would let two kernels race.
fn kernel_bounds(k: &KernelEntry) -> String {
    let extent = format!("{}{}", k.extent, if k.parallel { "p" } else { "" });
    let mut s = match &k.launch {
        None => extent,
        Some(l) => format!(
            "{extent}:{},{},{}:{},{},{}:{}",
            l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2], l.shared_bytes
        ),
    };
    if let Some(after) = &k.after {
        let deps: Vec<String> = after.iter().map(u32::to_string).collect();
        s.push('/');
        s.push_str(&deps.join(","));
    }
    s
}

/// Checks the manifest's arena size, kernels, extents and launch shapes against the code
/// section's bounds line ([`bounds_line`]), naming the first number that differs.
pub fn check_bounds(m: &Manifest, code: &str) -> Result<(), crate::Error> {
    use crate::Error;
    let want = bounds_line(m);
    let first = code.split('\n').next().unwrap_or("");
    if first == want.trim_end_matches('\n') {
        return Ok(());
    }
    let mut words = first
        .strip_prefix(';')
        .or_else(|| first.strip_prefix("//"))
        .unwrap_or("")
        .split(' ')
        .filter(|w| !w.is_empty());
    if words.next() != Some("tcc-bounds") {
        return Err(Error::BadManifest(
            "the code section does not start with its `tcc-bounds` line (what the code was \
             compiled for), so the manifest cannot be checked against it"
                .into(),
        ));
    }
    // The line's fields before the kernels, each `key=value`: the code's value where it
    // differs from the manifest's (`None` for a field that matches).
    let mut differs = |key: &str, ours: &str| {
        let code = words
            .next()
            .and_then(|w| w.strip_prefix(key))
            .and_then(|w| w.strip_prefix('='));
        (code != Some(ours)).then(|| code.unwrap_or("none stated").to_string())
    };
    if let Some(code) = differs("arena", &m.arena_bytes.to_string()) {
        return Err(Error::BadManifest(format!(
            "the manifest's arena is {} bytes, but the code addresses {code} bytes",
            m.arena_bytes
        )));
    }
    if let Some(code) = differs("align", &m.alignment.to_string()) {
        return Err(Error::BadManifest(format!(
            "the manifest's alignment is {}, but the code was compiled for {code}",
            m.alignment
        )));
    }
    let checks = checks_bounds(m);
    if let Some(code) = differs("checks", &checks) {
        return Err(Error::BadManifest(format!(
            "the manifest's in-step checks `{checks}` are not the code's `{code}`"
        )));
    }
    let code_kernels: Vec<&str> = words.collect();
    for (i, k) in m.kernels.iter().enumerate() {
        let Some(entry) = code_kernels.get(i) else {
            return Err(Error::BadManifest(format!(
                "the manifest launches {} kernels, but the code was compiled for {}",
                m.kernels.len(),
                code_kernels.len()
            )));
        };
        let (name, spec) = entry.split_once('=').unwrap_or((entry, ""));
        if name != k.name {
            return Err(Error::BadManifest(format!(
                "kernel {i} is `{}` in the manifest but `{name}` in the code's bounds",
                k.name
            )));
        }
        let ours = kernel_bounds(k);
        if spec != ours {
            return Err(Error::BadManifest(format!(
                "kernel `{name}`: the manifest's extent{} `{ours}` is not the `{spec}` the \
                 code was compiled for (`p`: split over threads; `/`: the kernels it waits for)",
                if k.launch.is_some() {
                    " and launch (extent:grid:block:shared bytes)"
                } else {
                    ""
                }
            )));
        }
    }
    if code_kernels.len() != m.kernels.len() {
        return Err(Error::BadManifest(format!(
            "the manifest launches {} kernels, but the code was compiled for {}",
            m.kernels.len(),
            code_kernels.len()
        )));
    }
    Err(Error::BadManifest(
        "the code's bounds line is not written as the manifest's would be".into(),
    ))
}

/// The longest manifest [`declared_len`] reads (1 GiB).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// How long an artifact says it is, from its first bytes ([`crate::fsutil::read_declared`]):
/// the header gives the manifest's length, the manifest its sections' ends. Bytes that are
/// not an artifact's stop the read; [`read`] then says what is wrong with them.
pub fn declared_len(prefix: &[u8]) -> crate::fsutil::Declared {
    use crate::fsutil::Declared;
    if prefix.len() < HEADER_BYTES {
        return Declared::Header(HEADER_BYTES as u64);
    }
    if prefix[..8] != MAGIC {
        return Declared::Stop;
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&prefix[16..24]);
    let json_len = u64::from_le_bytes(len8);
    // No manifest is that long (gpt's is under 1 MiB): stop, and [`read`] says truncated.
    if json_len > MAX_MANIFEST_BYTES {
        return Declared::Stop;
    }
    let json_end = HEADER_BYTES as u64 + json_len;
    if (prefix.len() as u64) < json_end {
        return Declared::Header(json_end);
    }
    #[derive(Deserialize)]
    struct Sections {
        sections: Vec<Section>,
    }
    match serde_json::from_slice::<Sections>(&prefix[HEADER_BYTES..json_end as usize]) {
        Ok(m) => Declared::Total(
            m.sections
                .iter()
                .map(|s| s.offset.saturating_add(s.len))
                .fold(json_end, u64::max),
        ),
        Err(_) => Declared::Stop,
    }
}

/// The byte ranges of an artifact's sections, by name, in file order.
pub type SectionRanges = Vec<(String, std::ops::Range<usize>)>;

/// Parses and checks an artifact: the header, the manifest ([`validate`]) and every section
/// (inside the file, checksum). Returns the manifest and each section's byte range in `bytes`.
pub fn read(bytes: &[u8]) -> Result<(Manifest, SectionRanges), crate::Error> {
    use crate::Error;
    if bytes.len() < HEADER_BYTES || bytes[..8] != MAGIC {
        return Err(Error::NotAnArtifact);
    }
    let word = |at: usize| [bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]];
    let version = u32::from_le_bytes(word(8));
    if version > FORMAT_VERSION {
        return Err(Error::NewerVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version == 0 {
        return Err(Error::BadManifest(
            "format version 0 does not exist (versions start at 1)".into(),
        ));
    }
    if version < OLDEST_VERSION {
        return Err(Error::BadManifest(format!(
            "format version {version} is older than the oldest this runtime reads \
             ({OLDEST_VERSION}, whose code states what it was compiled for): rebuild the \
             artifact with this tcc"
        )));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&bytes[16..24]);
    let json_len = u64::from_le_bytes(len8);
    let json_end = (HEADER_BYTES as u64).saturating_add(json_len);
    if json_end > bytes.len() as u64 {
        return Err(Error::Truncated {
            section: "manifest".into(),
            needed: json_end,
            have: bytes.len() as u64,
        });
    }
    let json = &bytes[HEADER_BYTES..json_end as usize];
    let check = u32::from_le_bytes(word(12));
    // Formats 3 and later always carry it (never 0): a zero is refused, not skipped.
    if check != manifest_check(version, json) {
        return Err(Error::Corrupt {
            section: "manifest".into(),
        });
    }
    let manifest: Manifest = serde_json::from_slice(json)
        .map_err(|e| Error::BadManifest(format!("the manifest is not valid: {e}")))?;
    if manifest.format_version != version {
        return Err(Error::BadManifest(format!(
            "the header says format version {version} but the manifest says {}",
            manifest.format_version
        )));
    }
    validate(&manifest)?;

    let mut ranges = Vec::with_capacity(manifest.sections.len());
    for s in &manifest.sections {
        if ranges.iter().any(|(n, _): &(String, _)| *n == s.name) {
            return Err(Error::BadManifest(format!(
                "section `{}` is listed twice",
                s.name
            )));
        }
        if !s.offset.is_multiple_of(SECTION_ALIGN) || s.offset < json_end {
            return Err(Error::BadManifest(format!(
                "section `{}` starts at byte {}, which is not a multiple of {SECTION_ALIGN} \
                 after the manifest (which ends at byte {json_end})",
                s.name, s.offset
            )));
        }
        let end = s.offset.saturating_add(s.len);
        if end > bytes.len() as u64 {
            return Err(Error::Truncated {
                section: s.name.clone(),
                needed: end,
                have: bytes.len() as u64,
            });
        }
        let range = s.offset as usize..end as usize;
        let want = Some(&s.checksum)
            .filter(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| {
                Error::BadManifest(format!(
                    "section `{}` has checksum `{}`, which is not 16 hex digits",
                    s.name, s.checksum
                ))
            })?;
        if checksum(version, &bytes[range.clone()]) != want {
            return Err(Error::Corrupt {
                section: s.name.clone(),
            });
        }
        ranges.push((s.name.clone(), range));
    }
    // Every other byte is the writer's zero padding, and nothing follows the last section:
    // so every byte of the file is checked by something.
    let mut covered: Vec<std::ops::Range<usize>> = ranges.iter().map(|(_, r)| r.clone()).collect();
    covered.push(0..json_end as usize);
    covered.sort_by_key(|r| (r.start, r.end));
    let mut at = 0usize;
    for r in &covered {
        if r.start > at && bytes[at..r.start].iter().any(|&b| b != 0) {
            return Err(Error::Corrupt {
                section: "padding".into(),
            });
        }
        at = at.max(r.end);
    }
    if at < bytes.len() {
        return Err(Error::BadManifest(format!(
            "the file goes on after its last section, which ends at byte {at}"
        )));
    }
    Ok((manifest, ranges))
}

/// Checks that a manifest describes a usable arena: the alignment is a power of two, every
/// slot's offset is a multiple of it, every slot and plan buffer lies inside `arena_bytes`,
/// every slot's `bytes` equals `product(shape) * dtype size`, persistent slots lie in
/// `[0, plan.persistent_bytes)`, names are unique per list, kernel extents fit an `i64` and
/// every kernel waits only for earlier kernels (`after`, ascending).
pub fn validate(m: &Manifest) -> Result<(), crate::Error> {
    use crate::Error;
    let bad = |msg: String| Err(Error::BadManifest(msg));
    if m.alignment == 0 || !m.alignment.is_power_of_two() {
        return bad(format!("alignment {} is not a power of two", m.alignment));
    }
    // Everything must be addressable on this host.
    if usize::try_from(m.arena_bytes).is_err() || m.arena_bytes > isize::MAX as u64 {
        return bad(format!(
            "arena of {} bytes does not fit this host's address space",
            m.arena_bytes
        ));
    }
    if usize::try_from(m.alignment).is_err() || m.alignment > 1 << 30 {
        return bad(format!("alignment {} is too large", m.alignment));
    }
    if m.plan.persistent_bytes > m.arena_bytes {
        return bad(format!(
            "the persistent region ({} bytes) is larger than the arena ({} bytes)",
            m.plan.persistent_bytes, m.arena_bytes
        ));
    }
    for c in &m.checks {
        if c.kind == CheckKind::FiniteUpdates && c.bound != 0 {
            return bad(format!(
                "check `{}`: a finite check with a bound of {} (it has none)",
                c.output, c.bound
            ));
        }
        let scalar = m.outputs.iter().any(|o| {
            o.name == c.output && o.dtype == DType::F32 && o.shape.iter().product::<usize>() == 1
        });
        if !c.output.starts_with(CHECK_PREFIX) || !scalar {
            return bad(format!(
                "check `{}` does not name a scalar f32 output starting with `{CHECK_PREFIX}`",
                c.output
            ));
        }
    }
    let check_slot = |kind: &str, s: &TensorSlot, limit: u64, region: &str| {
        if let Some(b) = s.index_bound {
            if s.dtype != DType::I32 || b > 1 << 31 {
                return bad(format!(
                    "{kind} `{}`: an index bound of {b} on a {} tensor",
                    s.name, s.dtype
                ));
            }
        }
        let elements = s.elements().ok_or_else(|| {
            Error::BadManifest(format!(
                "{kind} `{}`: shape {:?} overflows",
                s.name, s.shape
            ))
        })?;
        let expect = (elements as u64).checked_mul(s.dtype.size_bytes() as u64);
        if expect != Some(s.bytes) {
            return bad(format!(
                "{kind} `{}`: {} {:?} needs {} bytes but the manifest says {}",
                s.name,
                s.dtype,
                s.shape,
                expect.map_or_else(|| "too many".to_string(), |b| b.to_string()),
                s.bytes
            ));
        }
        if !s.offset.is_multiple_of(m.alignment) {
            return bad(format!(
                "{kind} `{}`: offset {} is not a multiple of the alignment {}",
                s.name, s.offset, m.alignment
            ));
        }
        match s.offset.checked_add(s.bytes) {
            Some(end) if end <= limit => Ok(()),
            _ => bad(format!(
                "{kind} `{}`: bytes [{}, {}+{}) lie outside the {region} ({limit} bytes)",
                s.name, s.offset, s.offset, s.bytes
            )),
        }
    };
    let unique = |kind: &str, names: &mut dyn Iterator<Item = &String>| {
        let mut seen = std::collections::HashSet::new();
        for n in names {
            if !seen.insert(n) {
                return bad(format!("{kind} `{n}` is listed twice"));
            }
        }
        Ok(())
    };
    for s in &m.inputs {
        check_slot("input", s, m.arena_bytes, "arena")?;
    }
    for s in &m.outputs {
        check_slot("output", s, m.arena_bytes, "arena")?;
    }
    for p in &m.persistent {
        check_slot(
            "persistent tensor",
            &p.slot,
            m.plan.persistent_bytes,
            "persistent region",
        )?;
        if let Some(r) = &p.init {
            let name = &p.slot.name;
            if m.format_version < 2 {
                return bad(format!(
                    "param `{name}` has an initialiser, which format version {} does not have",
                    m.format_version
                ));
            }
            if p.kind != PersistentKind::Param
                || !matches!(p.slot.dtype, DType::F32 | DType::F16 | DType::Bf16)
            {
                return bad(format!(
                    "`{name}` has an initialiser but is not a floating-point param"
                ));
            }
            let finite = match r.dist {
                crate::init::Dist::Zeros | crate::init::Dist::Ones => true,
                crate::init::Dist::Uniform { lo, hi } => lo.is_finite() && hi.is_finite(),
                crate::init::Dist::Normal { mean, std } => mean.is_finite() && std.is_finite(),
            };
            if !finite {
                return bad(format!("param `{name}`: its initialiser is not finite"));
            }
        }
    }
    for p in &m.persistent {
        let Some(of) = &p.shard_of else { continue };
        let name = &p.slot.name;
        let Some(whole) = p.whole(m) else {
            return bad(format!("`{name}` is a shard of `{of}`, which is no param"));
        };
        let ranks = u64::from(m.ranks.unwrap_or(0));
        let want = whole.elements().map(|n| (n as u64).div_ceil(ranks.max(1)));
        if p.kind != PersistentKind::State
            || ranks < 2
            || p.slot.dtype != whole.dtype
            || p.slot.shape.len() != 1
            || want != Some(p.slot.shape[0] as u64)
        {
            return bad(format!(
                "`{name}`: a {} {:?} cannot be one of {ranks} shards of `{of}` ({} {:?})",
                p.slot.dtype, p.slot.shape, whole.dtype, whole.shape
            ));
        }
    }
    unique("input", &mut m.inputs.iter().map(|s| &s.name))?;
    unique("output", &mut m.outputs.iter().map(|s| &s.name))?;
    unique(
        "persistent tensor",
        &mut m.persistent.iter().map(|p| &p.slot.name),
    )?;
    for b in &m.plan.buffers {
        match b.offset.checked_add(b.bytes) {
            Some(end) if end <= m.arena_bytes => {}
            _ => {
                return bad(format!(
                    "plan buffer of `{}`: bytes [{}, {}+{}) lie outside the arena ({} bytes)",
                    b.owner, b.offset, b.offset, b.bytes, m.arena_bytes
                ))
            }
        }
    }
    for (i, k) in m.kernels.iter().enumerate() {
        if k.extent > i64::MAX as u64 {
            return bad(format!(
                "kernel `{}`: extent {} does not fit an i64",
                k.name, k.extent
            ));
        }
        let after = k.after.as_deref().unwrap_or_default();
        if let Some(&d) = after.iter().find(|&&d| d as usize >= i) {
            return bad(format!(
                "kernel `{}` (number {i}) waits for kernel number {d}, which is not an \
                 earlier one",
                k.name
            ));
        }
        if after.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!(
                "kernel `{}`: `after` {after:?} is not strictly ascending",
                k.name
            ));
        }
        if let Some(c) = &k.collective {
            let elem = c.dtype.size_bytes() as u64;
            let inside = c
                .offset
                .checked_add(c.bytes)
                .is_some_and(|end| end <= m.arena_bytes);
            if !inside || c.bytes == 0 || !c.bytes.is_multiple_of(elem) {
                return bad(format!(
                    "kernel `{}`: its collective's bytes [{}, {}+{}) are not whole {} \
                     elements inside the arena ({} bytes)",
                    k.name, c.offset, c.offset, c.bytes, c.dtype, m.arena_bytes
                ));
            }
            if !c.offset.is_multiple_of(m.alignment) {
                return bad(format!(
                    "kernel `{}`: its collective's offset {} is not a multiple of the \
                     alignment {}",
                    k.name, c.offset, m.alignment
                ));
            }
            let Some(ranks) = m.ranks else {
                return bad(format!(
                    "kernel `{}` has a collective but the step names no ranks",
                    k.name
                ));
            };
            if let Err(why) = collective_sizes(c, u64::from(ranks), m) {
                return bad(format!("kernel `{}`: its collective {why}", k.name));
            }
        }
    }
    if m.ranks == Some(0) {
        return bad("a data-parallel step of 0 ranks".into());
    }
    Ok(())
}

/// Whether a collective's input fits its op, its result and the arena.
fn collective_sizes(c: &Collective, ranks: u64, m: &Manifest) -> std::result::Result<(), String> {
    let elem = c.dtype.size_bytes() as u64;
    if ranks == 0 || elem == 0 {
        return Err("names no ranks".into());
    }
    let input = match (c.op, c.input) {
        (CollectiveOp::AllReduceSum, None) => return Ok(()),
        (CollectiveOp::AllReduceSum, Some(_)) => {
            return Err("is an all-reduce with an input".into())
        }
        (_, None) => return Err(format!("({:?}) names no input", c.op)),
        (_, Some(i)) => i,
    };
    if c.in_place {
        return Err("is marked in place but has an input".into());
    }
    if c.op == CollectiveOp::ReduceScatterSum && c.dtype == DType::Bool {
        return Err("sums bool elements".into());
    }
    if !input.offset.is_multiple_of(m.alignment.max(1)) {
        return Err(format!(
            "input offset {} is not a multiple of the alignment {}",
            input.offset, m.alignment
        ));
    }
    let end = c
        .offset
        .checked_add(c.bytes)
        .ok_or("result ends past 2^64")?;
    let inside = input
        .offset
        .checked_add(input.bytes)
        .is_some_and(|end| end <= m.arena_bytes);
    if !inside || input.bytes == 0 || !input.bytes.is_multiple_of(elem) {
        return Err(format!(
            "input [{}, {}+{}) is not whole {} elements inside the arena",
            input.offset, input.offset, input.bytes, c.dtype
        ));
    }
    if input.offset < end && c.offset < input.offset + input.bytes {
        return Err("input overlaps its result".into());
    }
    let fits = match c.op {
        CollectiveOp::AllReduceSum => true,
        CollectiveOp::ReduceScatterSum => ranks.checked_mul(c.bytes) == Some(input.bytes),
        CollectiveOp::AllGather => ranks.checked_mul(input.bytes) == Some(c.bytes),
        CollectiveOp::Shard => {
            (input.bytes / elem).div_ceil(ranks).checked_mul(elem) == Some(c.bytes)
        }
    };
    if !fits {
        return Err(format!(
            "({:?}) of {} input bytes into {} result bytes does not fit {ranks} ranks",
            c.op, input.bytes, c.bytes
        ));
    }
    Ok(())
}
