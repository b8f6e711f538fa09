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
}
