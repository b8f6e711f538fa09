//! Writing files so that a failure never loses the previous one.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: into a temporary file in the same directory, synced
/// to disk, then renamed over `path` (and the directory synced), so a write that fails
/// partway (disk full, a file-size limit) leaves the previous file whole and no temporary
/// file behind. A symlink is followed (its target is replaced); a path that exists and is
/// not a regular file (`/dev/null`, a pipe) is written in place, as it cannot be renamed
/// over.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let target: PathBuf = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    if let Ok(m) = std::fs::metadata(&target) {
        if !m.is_file() {
            return std::fs::write(&target, bytes);
        }
    }
    let name = target
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    // The rename is durable once the directory is synced (not every platform can).
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
