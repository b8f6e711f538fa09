//! `tcc-grammar`: the TDSL front door — lexer (logos), parser (lalrpop), AST with spans, and
//! the [`Diagnostic`] type every stage of the compiler reports through.
//!
//! ```
//! use tcc_grammar::{parse, span::SourceMap};
//! let mut sources = SourceMap::new();
//! let file = sources.add("tiny.tdsl", "const N = 4\nmodel m { input x: f32[N]\n output x }");
//! let program = parse(sources.get(file).unwrap().text.as_str(), file).unwrap();
//! assert_eq!(program.items.len(), 2);
//! ```

pub mod ast;
pub mod diag;
pub mod lexer;
pub mod span;

#[allow(clippy::all, clippy::pedantic, unused_parens, dead_code)]
mod tdsl {
    include!(concat!(env!("OUT_DIR"), "/tdsl.rs"));
}

use diag::Diagnostic;
use lalrpop_util::{ErrorRecovery, ParseError};
use lexer::{LexErrorKind, Tok};
use span::{FileId, Span};

pub use ast::Program;

/// Checks that raw bytes are a TDSL source: UTF-8 without NUL bytes, not empty.
/// Returns the text or the diagnostics (with spans into `file`, whose text should be the
/// lossy decoding of `bytes` so the spans render).
pub fn decode_source(bytes: &[u8], file: FileId) -> Result<&str, Vec<Diagnostic>> {
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let at = e.valid_up_to();
            let len = e.error_len().unwrap_or(1);
            return Err(vec![Diagnostic::error("E0105", "file is not valid UTF-8")
                .with_primary(
                    Span::new(file, at, at + 1),
                    format!("invalid byte sequence of length {len} at byte {at}"),
                )
                .with_note("TDSL sources must be UTF-8 text")]);
        }
    };
    let nuls: Vec<Diagnostic> = text
        .match_indices('\0')
        .map(|(i, _)| {
            Diagnostic::error("E0106", "NUL byte in source")
                .with_primary(Span::new(file, i, i + 1), "NUL byte here")
                .with_note("TDSL sources are text; is this a binary file?")
        })
        .collect();
    if !nuls.is_empty() {
        return Err(nuls);
    }
    Ok(text)
}

/// Parses one file. On failure returns every lexical error, or every syntax error the
/// parser's statement-level recovery found.
pub fn parse(src: &str, file: FileId) -> Result<Program, Vec<Diagnostic>> {
    let (tokens, lex_errors) = lexer::tokenize(src, file);
    if !lex_errors.is_empty() {
        return Err(lex_errors);
    }
    let mut recovered = Vec::new();
    let result = tdsl::ProgramParser::new().parse(
        file,
        &mut recovered,
        tokens.into_iter().map(Ok::<_, LexErrorKind>),
    );
    let mut diags: Vec<Diagnostic> = recovered
        .into_iter()
        .map(|ErrorRecovery { error, .. }| syntax_error(error, src, file))
        .collect();
    match result {
        Ok(program) if diags.is_empty() => {
            if program.items.is_empty() {
                return Err(vec![Diagnostic::error("E0107", "empty program")
                    .with_primary(Span::new(file, 0, 0), "no declarations in this file")
                    .with_note("a TDSL file needs at least one `model name { … }`")]);
            }
            Ok(program)
        }
        Ok(_) => Err(diags),
        Err(e) => {
            diags.push(syntax_error(e, src, file));
            Err(diags)
        }
    }
}

/// Parses a single expression (used for `--set NAME=EXPR` values and tests).
pub fn parse_expr(src: &str, file: FileId) -> Result<ast::Expr, Vec<Diagnostic>> {
    let (tokens, lex_errors) = lexer::tokenize(src, file);
    if !lex_errors.is_empty() {
        return Err(lex_errors);
    }
    let mut recovered = Vec::new();
    tdsl::ExprParser::new()
        .parse(
            file,
            &mut recovered,
            tokens.into_iter().map(Ok::<_, LexErrorKind>),
        )
        .map_err(|e| vec![syntax_error(e, src, file)])
}

fn describe_expected(expected: &[String]) -> String {
    let has = |t: &str| expected.iter().any(|e| e.trim_matches('"') == t);
    if has("ident") && has("int") && has("(") && expected.len() > 6 {
        return "an expression".to_string();
    }
    let mut names: Vec<String> = expected
        .iter()
        .map(|e| match e.trim_matches('"') {
            "ident" => "identifier".to_string(),
            "int" => "integer".to_string(),
            "float" => "number".to_string(),
            "string" => "string".to_string(),
            "sep" => "end of statement".to_string(),
            other => format!("`{other}`"),
        })
        .collect();
    names.dedup();
    match names.len() {
        0 => "nothing more".to_string(),
        1 => names.remove(0),
        n if n <= 8 => {
            let last = names.pop().unwrap_or_default();
            format!("{} or {}", names.join(", "), last)
        }
        _ => {
            let shown = names[..6].join(", ");
            format!("one of {shown}, …")
        }
    }
}

fn syntax_error(e: ParseError<usize, Tok, LexErrorKind>, src: &str, file: FileId) -> Diagnostic {
    match e {
        ParseError::InvalidToken { location } => Diagnostic::error("E0101", "invalid token")
            .with_primary(Span::new(file, location, location + 1), "not a TDSL token"),
        ParseError::UnrecognizedEof { location, expected } => {
            let at = location.min(src.len());
            let start = at.saturating_sub(1);
            Diagnostic::error("E0110", "unexpected end of file").with_primary(
                Span::new(file, start, at),
                format!("expected {} after this", describe_expected(&expected)),
            )
        }
        ParseError::UnrecognizedToken {
            token: (l, tok, r),
            expected,
        } => {
            let found = if tok == Tok::Sep {
                if src.get(l..r) == Some(";") {
                    "`;`".to_string()
                } else {
                    "end of line".to_string()
                }
            } else {
                tok.describe()
            };
            let (l, r) = if tok == Tok::Sep && src.get(l..r) != Some(";") {
                // Point at the end of the line, not at the invisible newline.
                (l, l)
            } else {
                (l, r)
            };
            Diagnostic::error("E0111", format!("unexpected {found}")).with_primary(
                Span::new(file, l, r),
                format!("expected {}", describe_expected(&expected)),
            )
        }
        ParseError::ExtraToken { token: (l, tok, r) } => {
            Diagnostic::error("E0111", format!("unexpected {}", tok.describe()))
                .with_primary(Span::new(file, l, r), "expected end of file")
        }
        ParseError::User { error } => {
            Diagnostic::error("E0101", format!("lexical error: {error:?}"))
                .with_primary(Span::new(file, 0, 0), "here")
        }
    }
}
