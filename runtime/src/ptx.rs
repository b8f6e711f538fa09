//! PTX text as the CUDA executor loads it: a module of many `.entry` functions is split
//! into pieces that the driver compiles on several threads at once (a cold compile of gpt's
//! 410 kernels: 49 s as one module, 6 s in pieces on 16 threads of an H100 host). Public so
//! that the compiler's tests can assemble every piece on its own.

/// Splits a PTX module into about `pieces` modules of whole `.entry` functions, each with
/// the module's preamble, balanced by size; `None` when the text has anything else at
/// module scope after its first entry (a `.global`, a `.func`, ...).
pub fn split(code: &str, pieces: usize) -> Option<Vec<String>> {
    const ENTRY: &str = ".visible .entry ";
    let mut starts = Vec::new();
    let mut at = 0;
    for line in code.split_inclusive('\n') {
        if line.starts_with(ENTRY) {
            starts.push(at);
        } else if !starts.is_empty() && line.starts_with('.') {
            let ok = [".maxntid", ".minnctapersm", ".reqntid", ".maxnreg"]
                .iter()
                .any(|d| line.starts_with(d));
            if !ok {
                return None;
            }
        }
        at += line.len();
    }
    let first = *starts.first()?;
    let preamble = &code[..first];
    if pieces < 2 || starts.len() < 2 {
        return Some(vec![code.to_string()]);
    }
    starts.push(code.len());
    let body = code.len() - first;
    let target = body.div_ceil(pieces).max(1);
    let mut out = Vec::new();
    let mut lo = first;
    for w in starts.windows(2).skip(1) {
        let end = w[0];
        if end - lo >= target {
            out.push(format!("{preamble}{}", &code[lo..end]));
            lo = end;
        }
    }
    if lo < code.len() {
        out.push(format!("{preamble}{}", &code[lo..]));
    }
    Some(out)
}

/// The name of each `.entry` of a piece of PTX, in order.
pub fn entry_names(code: &str) -> impl Iterator<Item = &str> {
    code.lines().filter_map(|l| {
        let rest = l.strip_prefix(".visible .entry ")?;
        Some(rest.split('(').next().unwrap_or(rest).trim())
    })
}

/// Checks that `b` is a 64-bit little-endian ELF image whose headers, program segments and
/// sections all lie inside it, as a cubin `ptxas` writes is. The driver reads a cubin from
/// a pointer alone, following the offsets in its headers, so the CUDA executor checks an
/// artifact's cubins with this before handing them over.
pub fn check_elf(b: &[u8]) -> Result<(), String> {
    let u16_at = |o: usize| -> Option<u64> {
        Some(u64::from(u16::from_le_bytes(
            b.get(o..o + 2)?.try_into().ok()?,
        )))
    };
    let u32_at = |o: usize| -> Option<u64> {
        Some(u64::from(u32::from_le_bytes(
            b.get(o..o + 4)?.try_into().ok()?,
        )))
    };
    let u64_at =
        |o: usize| -> Option<u64> { Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?)) };
    let len = b.len() as u64;
    if b.len() < 64 || !b.starts_with(b"\x7fELF") {
        return Err("not an ELF image".into());
    }
    if b[4] != 2 || b[5] != 1 {
        return Err("not a 64-bit little-endian ELF image".into());
    }
    let header = |o: usize| u16_at(o).ok_or_else(|| "a truncated ELF header".to_string());
    let (ehsize, phentsize, phnum) = (header(0x34)?, header(0x36)?, header(0x38)?);
    let (shentsize, shnum, shstrndx) = (header(0x3a)?, header(0x3c)?, header(0x3e)?);
    let offset = |o: usize| u64_at(o).ok_or_else(|| "a truncated ELF header".to_string());
    let (phoff, shoff) = (offset(0x20)?, offset(0x28)?);
    if ehsize < 64 {
        return Err(format!("an ELF header of {ehsize} bytes"));
    }
    // A table of `n` entries of `size` bytes (at least `min`) at `off`, inside the image.
    let table = |what: &str, off: u64, n: u64, size: u64, min: u64| -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        match n.checked_mul(size).and_then(|t| t.checked_add(off)) {
            Some(end) if size >= min && end <= len => Ok(()),
            _ => Err(format!(
                "its {what} table ({n} entries of {size} bytes at {off}) does not fit its {len} bytes"
            )),
        }
    };
    table("program header", phoff, phnum, phentsize, 56)?;
    table("section header", shoff, shnum, shentsize, 64)?;
    if shnum > 0 && shstrndx >= shnum {
        return Err(format!(
            "its section names are in section {shstrndx} of {shnum}"
        ));
    }
    let inside = |what: &str, i: u64, off: Option<u64>, size: Option<u64>| -> Result<(), String> {
        match (off, size) {
            (Some(o), Some(s)) if o.checked_add(s).is_some_and(|e| e <= len) => Ok(()),
            _ => Err(format!("its {what} {i} lies outside its {len} bytes")),
        }
    };
    for i in 0..phnum {
        let at = (phoff + i * phentsize) as usize;
        inside("segment", i, u64_at(at + 8), u64_at(at + 0x20))?;
    }
    for i in 0..shnum {
        let at = (shoff + i * shentsize) as usize;
        // SHT_NOBITS (8) takes no bytes of the file.
        if u32_at(at + 4) != Some(8) {
            inside("section", i, u64_at(at + 0x18), u64_at(at + 0x20))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRE: &str =
        "//\n.version 8.0\n.target sm_90\n.address_size 64\n\n.extern .shared .align 16 .b8 s[];\n\n";

    fn entry(name: &str, body_lines: usize) -> String {
        let mut e =
            format!(".visible .entry {name}(\n\t.param .u64 arena\n)\n.maxntid 256, 1, 1\n{{\n");
        for i in 0..body_lines {
            e.push_str(&format!("\tadd.s32 %r{i}, %r{i}, 1;\n"));
        }
        e.push_str("$L_end:\n\tret;\n}\n\n");
        e
    }

    #[test]
    fn pieces_hold_every_entry_once_after_the_preamble() {
        let sizes = [3, 40, 5, 5, 60, 1, 9];
        let code: String = std::iter::once(PRE.to_string())
            .chain(
                sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| entry(&format!("k{i}"), n)),
            )
            .collect();
        for pieces in [1, 2, 3, 4, 16] {
            let out = split(&code, pieces).unwrap();
            assert!(
                !out.is_empty() && out.len() <= pieces,
                "{pieces}: {}",
                out.len()
            );
            let mut names = Vec::new();
            let mut body = String::new();
            for p in &out {
                assert!(p.starts_with(PRE), "{p}");
                body.push_str(&p[PRE.len()..]);
                names.extend(entry_names(p).map(str::to_string));
            }
            assert_eq!(body, code[PRE.len()..], "{pieces} pieces");
            let want: Vec<String> = (0..sizes.len()).map(|i| format!("k{i}")).collect();
            assert_eq!(names, want);
        }
        assert!(split(&code, 4).unwrap().len() > 1);
    }

    #[test]
    fn module_scope_declarations_after_an_entry_are_not_split() {
        let two = |mid: &str| format!("{PRE}{}{mid}{}", entry("k0", 2), entry("k1", 2));
        assert_eq!(split(&two(".global .align 4 .b32 g;\n"), 4), None);
        assert_eq!(split(&two(".func f()\n{\n}\n"), 4), None);
        assert!(split(&two(""), 4).is_some());
        // No entry at all: nothing to split along.
        assert_eq!(split(PRE, 4), None);
    }

    /// A minimal ELF64 image: the header, one section header (a 16-byte section at 128),
    /// no segments.
    fn elf() -> Vec<u8> {
        let mut b = vec![0u8; 208];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x28..0x30].copy_from_slice(&144u64.to_le_bytes()); // e_shoff
        b[0x34..0x36].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        b[0x3c..0x3e].copy_from_slice(&1u16.to_le_bytes()); // e_shnum
        b[144 + 4..144 + 8].copy_from_slice(&1u32.to_le_bytes()); // SHT_PROGBITS
        b[144 + 0x18..144 + 0x20].copy_from_slice(&128u64.to_le_bytes());
        b[144 + 0x20..144 + 0x28].copy_from_slice(&16u64.to_le_bytes());
        b
    }

    #[test]
    fn elf_images_whose_offsets_leave_them_are_refused() {
        assert_eq!(check_elf(&elf()), Ok(()));
        let bad = |edit: &dyn Fn(&mut Vec<u8>), needle: &str| {
            let mut b = elf();
            edit(&mut b);
            match check_elf(&b) {
                Err(e) => assert!(e.contains(needle), "{needle}: {e}"),
                Ok(()) => panic!("{needle}: accepted"),
            }
        };
        bad(&|b| b.truncate(63), "not an ELF image");
        bad(&|b| b[0] = 0, "not an ELF image");
        bad(&|b| b[4] = 1, "64-bit little-endian");
        bad(
            &|b| b[0x28..0x30].copy_from_slice(&200u64.to_le_bytes()),
            "section header table",
        );
        bad(
            &|b| b[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes()),
            "section header table",
        );
        bad(
            &|b| b[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes()),
            "section header table",
        );
        bad(
            &|b| b[144 + 0x20..144 + 0x28].copy_from_slice(&81u64.to_le_bytes()),
            "section 0",
        );
        bad(
            &|b| b[144 + 0x18..144 + 0x20].copy_from_slice(&u64::MAX.to_le_bytes()),
            "section 0",
        );
        bad(
            &|b| b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes()),
            "section names",
        );
        bad(
            &|b| {
                b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
                b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
                b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
                b[64 + 0x20..64 + 0x28].copy_from_slice(&1000u64.to_le_bytes());
            },
            "segment 0",
        );
        // A section that takes no file bytes may say any size.
        let mut b = elf();
        b[144 + 4..144 + 8].copy_from_slice(&8u32.to_le_bytes());
        b[144 + 0x20..144 + 0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(check_elf(&b), Ok(()));
    }
}
