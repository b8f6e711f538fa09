//! Reading files with a bound on what is read, and writing them so that a failure never
//! loses the previous one.

use std::fs::File;
use std::io::{self, Read, Write};
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

/// What a file's first bytes say of its length, for [`read_declared`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Declared {
    /// The header is longer: read up to this many bytes before asking again.
    Header(u64),
    /// The whole file is this many bytes long.
    Total(u64),
    /// The bytes are not of this format: stop, and let the parser say what is wrong.
    Stop,
}

/// Reads a file whose header declares its length: `declare` is shown the bytes read so far
/// (at first up to `first`) and says how many more to read. At most the declared length and
/// one byte past it are read, so a trailing byte is still seen by the parser, and an endless
/// or huge file (`/dev/zero`, a wrong path) is never read whole. The buffer is reserved
/// fallibly: a length that cannot be allocated is an `OutOfMemory` error, not an abort. A
/// file that ends early is returned as it is (the parser reports it truncated).
pub fn read_declared(
    path: &Path,
    first: u64,
    mut declare: impl FnMut(&[u8]) -> Declared,
) -> io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let mut buf = Vec::new();
    let mut want = first;
    loop {
        if !fill(&mut f, &mut buf, want)? {
            return Ok(buf);
        }
        match declare(&buf) {
            Declared::Header(n) if n > buf.len() as u64 => want = n,
            Declared::Header(_) | Declared::Stop => return Ok(buf),
            Declared::Total(n) => {
                fill(&mut f, &mut buf, n.saturating_add(1))?;
                return Ok(buf);
            }
        }
    }
}

/// Reads at most `limit` bytes of `path` (for files no header sizes: sources, JSON): a
/// longer file is an `InvalidData` error naming the limit, after `limit + 1` bytes, so an
/// endless one is refused too.
pub fn read_capped(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    read_capped_checked(path, limit, 0, |_| Ok(()))
}

/// [`read_capped`] that first reads up to `first` bytes and hands them to `check`, whose
/// error stops the read there (a file that cannot be of its format is refused before up to
/// `limit` bytes of it are read). One handle reads it all, so a pipe loses nothing.
pub fn read_capped_checked(
    path: &Path,
    limit: u64,
    first: u64,
    check: impl FnOnce(&[u8]) -> io::Result<()>,
) -> io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let mut buf = Vec::new();
    if let Ok(m) = f.metadata() {
        if m.is_file() && m.len() > limit {
            return Err(too_long(limit));
        }
    }
    fill(&mut f, &mut buf, first.min(limit.saturating_add(1)))?;
    check(&buf)?;
    fill(&mut f, &mut buf, limit.saturating_add(1))?;
    if buf.len() as u64 > limit {
        return Err(too_long(limit));
    }
    Ok(buf)
}

fn too_long(limit: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("the file is longer than the {limit} bytes tcc reads of such a file"),
    )
}

/// Reads from `f` until `buf` holds `want` bytes; `false` when the file ended first. The
/// buffer is reserved fallibly: where the file is a regular one, exactly what it can still
/// give (its length and one byte, to see the end), so a declared length far beyond the real
/// one costs no memory and the buffer is not grown past the file; else in steps of at most
/// 64 MiB as bytes come.
fn fill(f: &mut File, buf: &mut Vec<u8>, want: u64) -> io::Result<bool> {
    const STEP: u64 = 64 << 20;
    let no_memory = || {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("cannot allocate {want} bytes to read the file"),
        )
    };
    if let Ok(m) = f.metadata() {
        if m.is_file() {
            let to = want
                .min(m.len().saturating_add(1))
                .saturating_sub(buf.len() as u64);
            let to = usize::try_from(to).map_err(|_| no_memory())?;
            buf.try_reserve_exact(to).map_err(|_| no_memory())?;
        }
    }
    while (buf.len() as u64) < want {
        let chunk = (want - buf.len() as u64).min(STEP);
        if buf.len() == buf.capacity() {
            buf.try_reserve(chunk as usize).map_err(|_| no_memory())?;
        }
        if Read::take(&mut *f, chunk).read_to_end(buf)? == 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How long a `.safetensors` file says it is ([`read_declared`]): 8 bytes give the JSON
/// header's length, the header every tensor's `data_offsets`. Headers over 100 MB (the
/// format's own limit) or that are not JSON stop the read, for the parser to report.
pub fn safetensors_len(prefix: &[u8]) -> Declared {
    const MAX_HEADER: u64 = 100_000_000;
    let Some(len8) = prefix.get(..8) else {
        return Declared::Header(8);
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(len8);
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Declared::Stop;
    }
    let Some(json) = prefix.get(8..8 + n as usize) else {
        return Declared::Header(8 + n);
    };
    let Ok(serde_json::Value::Object(entries)) = serde_json::from_slice(json) else {
        return Declared::Stop;
    };
    let end = entries
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(_, e)| e.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    Declared::Total((8 + n).saturating_add(end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tcc-fsutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn read_capped_refuses_longer_files() {
        let p = file("capped", &[7u8; 100]);
        assert_eq!(read_capped(&p, 100).unwrap().len(), 100);
        let err = read_capped(&p, 99).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("99 bytes"), "{err}");
        #[cfg(unix)]
        {
            let err = read_capped(Path::new("/dev/zero"), 1 << 20).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        }
    }

    /// A two-stage header: one byte gives the header's length, the header's last byte the
    /// body's.
    fn two_stage(prefix: &[u8]) -> Declared {
        match prefix {
            [] => Declared::Header(1),
            [0, ..] => Declared::Stop,
            [h, rest @ ..] if rest.len() + 1 < 1 + *h as usize => Declared::Header(1 + *h as u64),
            [h, ..] => Declared::Total(1 + *h as u64 + u64::from(prefix[*h as usize])),
        }
    }

    #[test]
    fn read_declared_reads_the_declared_length_and_one_byte_more() {
        // Header of 2 bytes, body of 3: 6 bytes in all.
        let bytes = [2u8, 9, 3, 1, 2, 3, 4, 5, 6];
        let p = file("declared", &bytes);
        assert_eq!(read_declared(&p, 1, two_stage).unwrap(), &bytes[..7]);
        let p = file("exact", &bytes[..6]);
        let read = read_declared(&p, 1, two_stage).unwrap();
        assert_eq!(read, &bytes[..6]);
        // Reserved for the file's bytes and the one that shows its end, no more.
        assert!(read.capacity() <= 7, "{}", read.capacity());
        // Ends early: returned as it is.
        let p = file("short", &bytes[..4]);
        assert_eq!(read_declared(&p, 1, two_stage).unwrap(), &bytes[..4]);
        let p = file("stop", &[0u8, 1, 2, 3]);
        assert_eq!(read_declared(&p, 1, two_stage).unwrap(), &[0u8]);
        // A length far beyond the file costs nothing.
        let p = file("huge", &[1u8, 255, 0]);
        assert_eq!(read_declared(&p, 1, two_stage).unwrap(), &[1u8, 255, 0]);
        #[cfg(unix)]
        assert_eq!(
            read_declared(Path::new("/dev/zero"), 1, two_stage).unwrap(),
            &[0u8]
        );
    }

    #[test]
    fn safetensors_len_follows_the_header() {
        let json = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"__metadata__":{"x":"y"}}"#;
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        assert_eq!(safetensors_len(&bytes[..3]), Declared::Header(8));
        assert_eq!(
            safetensors_len(&bytes),
            Declared::Header(8 + json.len() as u64)
        );
        bytes.extend_from_slice(json);
        assert_eq!(
            safetensors_len(&bytes),
            Declared::Total(8 + json.len() as u64 + 12)
        );
        assert_eq!(safetensors_len(&[0xff; 8]), Declared::Stop);
        let mut bad = 4u64.to_le_bytes().to_vec();
        bad.extend_from_slice(b"nope");
        assert_eq!(safetensors_len(&bad), Declared::Stop);
    }
}
