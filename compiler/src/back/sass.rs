//! SASS for `cuda` artifacts: the PTX module assembled at build time by NVIDIA's `ptxas`,
//! so that loading the artifact compiles nothing (a cold driver compile of gpt's PTX takes
//! seconds even in parallel pieces; loading its cubins, a fraction of one).
//!
//! The module is cut into [`PIECES`] pieces of whole entries ([`tcc_runtime::ptx::split`],
//! the split the runtime uses for the driver), each assembled by its own `ptxas` process, on
//! one thread per core (at most 16). The piece count is fixed, not the core count, so for
//! one `ptxas` the bytes do not depend on the machine; whether an artifact carries SASS at
//! all, and which `ptxas` made it, does (`tcc build --sass off` gives PTX-only artifacts
//! the same everywhere). The runtime loads the cubins where the GPU's compute capability
//! matches [`Sass::arch`] and falls back to the PTX, which the artifact always carries,
//! where it does not.

use std::path::{Path, PathBuf};
use std::process::Command;
use tcc_runtime::artifact::{Sass, SassPiece};

/// How many pieces the module is cut into (fewer when it has fewer entries).
pub const PIECES: usize = 64;

/// Offsets of cubins within the `sass` section are multiples of this.
const PIECE_ALIGN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum SassError {
    #[error(
        "no `ptxas` found (looked on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin and \
         /usr/local/cuda/bin; set $TCC_PTXAS to one, e.g. the one `pip install \
         nvidia-cuda-nvcc` puts under site-packages/nvidia/cu13/bin)"
    )]
    NotFound,
    #[error("$TCC_PTXAS is `{0}`, which is not an executable file")]
    NotAFile(String),
    #[error("cannot run `{path}`: {message}")]
    Run { path: String, message: String },
    #[error("`ptxas` failed on piece {piece} of the PTX (kernels {entries}): {message}")]
    Assemble {
        piece: usize,
        entries: String,
        message: String,
    },
    #[error("the PTX module has no `.target sm_NN` line")]
    NoTarget,
    #[error("the PTX module cannot be split into whole entries")]
    Split,
    #[error("{0}")]
    Io(String),
}

/// A `ptxas` that ran (`--version` answered).
#[derive(Clone, Debug)]
pub struct Ptxas {
    pub path: PathBuf,
    /// The line of `ptxas --version` that names the release ("Cuda compilation tools,
    /// release 13.0, V13.0.88"), or its last line.
    pub version: String,
}

impl Ptxas {
    /// Where `ptxas` is: `$TCC_PTXAS` when set (and only there; an error when it is no
    /// executable file), else the first executable `ptxas` in an absolute directory of
    /// `PATH`, in `$CUDA_HOME/bin` or `$CUDA_PATH/bin`, or in `/usr/local/cuda/bin`.
    pub fn locate() -> Result<PathBuf, SassError> {
        if let Some(p) = std::env::var_os("TCC_PTXAS") {
            let p = PathBuf::from(p);
            return if executable(&p) {
                Ok(p)
            } else {
                Err(SassError::NotAFile(p.display().to_string()))
            };
        }
        let path_dirs = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default();
        let homes = ["CUDA_HOME", "CUDA_PATH"]
            .iter()
            .filter_map(std::env::var_os)
            .map(|h| PathBuf::from(h).join("bin"));
        path_dirs
            .into_iter()
            .chain(homes)
            .chain(std::iter::once(PathBuf::from("/usr/local/cuda/bin")))
            // A relative entry (an empty one is the current directory) is not looked in.
            .filter(|d| d.is_absolute())
            .map(|d| d.join("ptxas"))
            .find(|p| executable(p))
            .ok_or(SassError::NotFound)
    }

    /// [`Ptxas::locate`], then asks it for its version.
    pub fn find() -> Result<Ptxas, SassError> {
        Ptxas::at(&Ptxas::locate()?)
    }

    /// The `ptxas` at `path`, if it runs.
    pub fn at(path: &Path) -> Result<Ptxas, SassError> {
        let run_error = |message: String| SassError::Run {
            path: path.display().to_string(),
            message,
        };
        let out = Command::new(path)
            .arg("--version")
            .output()
            .map_err(|e| run_error(e.to_string()))?;
        if !out.status.success() {
            return Err(run_error(format!("`--version` exited with {}", out.status)));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let version = text
            .lines()
            .find(|l| l.contains("release"))
            .or_else(|| text.lines().rev().find(|l| !l.trim().is_empty()))
            .unwrap_or("unknown")
            .trim()
            .to_string();
        Ok(Ptxas {
            path: path.to_path_buf(),
            version,
        })
    }

    /// Assembles `ptx` for the architecture its `.target` names, in [`PIECES`] pieces on
    /// `threads` threads. Returns the manifest's description and the `sass` section's bytes.
    pub fn assemble(&self, ptx: &str, threads: usize) -> Result<(Sass, Vec<u8>), SassError> {
        let arch = ptx
            .lines()
            .find_map(|l| l.strip_prefix(".target "))
            .map(str::trim)
            .filter(|a| a.starts_with("sm_"))
            .ok_or(SassError::NoTarget)?
            .to_string();
        let pieces = tcc_runtime::ptx::split(ptx, PIECES).ok_or(SassError::Split)?;
        // Private to this user (0700), removed on drop.
        let dir = tempfile::Builder::new()
            .prefix("tcc-sass-")
            .tempdir()
            .map_err(|e| SassError::Io(format!("cannot make a scratch directory: {e}")))?;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::atomic::AtomicBool::new(false);
        let mut results: Vec<(usize, Result<Vec<u8>, SassError>)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.min(16).min(pieces.len()).max(1))
                .map(|_| {
                    let (next, failed, pieces, dir, arch) =
                        (&next, &failed, &pieces, dir.path(), &arch);
                    s.spawn(move || {
                        let mut out = Vec::new();
                        use std::sync::atomic::Ordering::Relaxed;
                        while !failed.load(Relaxed) {
                            let i = next.fetch_add(1, Relaxed);
                            let Some(p) = pieces.get(i) else { break };
                            let r = self.piece(dir, i, p, arch);
                            failed.fetch_or(r.is_err(), Relaxed);
                            out.push((i, r));
                        }
                        out
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| {
                    w.join().unwrap_or_else(|_| {
                        vec![(0, Err(SassError::Io("a ptxas thread panicked".into())))]
                    })
                })
                .collect()
        });
        // The first failing piece in order, whatever thread ran it.
        results.sort_by_key(|r| r.0);
        let mut cubins: Vec<Option<Vec<u8>>> = vec![None; pieces.len()];
        for (i, r) in results {
            if let Some(slot) = cubins.get_mut(i) {
                *slot = Some(r?);
            }
        }
        let mut section = Vec::new();
        let mut described = Vec::with_capacity(pieces.len());
        for (i, (piece, cubin)) in pieces.iter().zip(cubins).enumerate() {
            let cubin =
                cubin.ok_or_else(|| SassError::Io(format!("piece {i} was not assembled")))?;
            section.resize(section.len().next_multiple_of(PIECE_ALIGN), 0);
            described.push(SassPiece {
                offset: section.len() as u64,
                len: cubin.len() as u64,
                entries: tcc_runtime::ptx::entry_names(piece)
                    .map(str::to_string)
                    .collect(),
            });
            section.extend_from_slice(&cubin);
        }
        let sass = Sass {
            arch,
            assembler: self.version.clone(),
            code_checksum: tcc_runtime::artifact::checksum_hex(ptx.as_bytes()),
            pieces: described,
        };
        Ok((sass, section))
    }

    /// Assembles piece `i` in `dir` (relative names, so no path of this machine can reach
    /// the cubin); its cubin's bytes.
    fn piece(&self, dir: &Path, i: usize, ptx: &str, arch: &str) -> Result<Vec<u8>, SassError> {
        let io = |e: std::io::Error| SassError::Io(format!("piece {i}: {e}"));
        let (src, dst) = (format!("piece{i}.ptx"), format!("piece{i}.cubin"));
        std::fs::write(dir.join(&src), ptx).map_err(io)?;
        let out = Command::new(&self.path)
            .current_dir(dir)
            .arg(format!("-arch={arch}"))
            .arg(&src)
            .arg("-o")
            .arg(&dst)
            .output()
            .map_err(|e| SassError::Run {
                path: self.path.display().to_string(),
                message: e.to_string(),
            })?;
        if !out.status.success() {
            let entries: Vec<&str> = tcc_runtime::ptx::entry_names(ptx).collect();
            return Err(SassError::Assemble {
                piece: i,
                entries: entries.join(", "),
                message: String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
        }
        std::fs::read(dir.join(&dst)).map_err(io)
    }
}

/// Whether `p` is a file this process may run.
fn executable(p: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        p.is_file()
    }
}
