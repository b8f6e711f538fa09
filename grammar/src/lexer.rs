//! The TDSL lexer (logos) and the newline filter that turns line breaks into statement
//! separators.
//!
//! Newlines matter in TDSL: inside `{ }` they end statements. [`tokenize`] runs logos, then a
//! small filter decides which line breaks are separators:
//! - inside `(` or `[` a line break is whitespace (an open bracket continues the expression);
//! - at the top level, between declarations, it is whitespace too;
//! - inside `{ }` it becomes [`Tok::Sep`] unless the line ends in a binary operator, `,`,
//!   `=`, `:`, `->` or `{` (the expression or statement continues), and consecutive separators
//!   collapse. A separator right before `{` or `}` is dropped.
//!
//! `;` is an explicit separator and follows the same rules.

use crate::diag::Diagnostic;
use crate::span::{FileId, Span};
use logos::{FilterResult, Logos};
use std::fmt;

/// What went wrong while lexing one token.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum LexErrorKind {
    #[default]
    UnexpectedChar,
    UnterminatedComment,
    UnterminatedString,
    BadNumber,
}

/// A token of TDSL. Keywords are separate variants; dtype names are identifiers.
#[derive(Logos, Clone, Debug, PartialEq)]
#[logos(error = LexErrorKind)]
#[logos(skip r"[ \t\r\x0c]+")]
#[logos(skip(r"//[^\n]*", allow_greedy = true))]
pub enum Tok {
    #[token("\n")]
    Newline,
    #[token("/*", block_comment)]
    BlockComment,

    // keywords
    #[token("const")]
    Const,
    #[token("fn")]
    Fn,
    #[token("model")]
    Model,
    #[token("input")]
    Input,
    #[token("param")]
    Param,
    #[token("output")]
    Output,
    #[token("train")]
    Train,
    #[token("minimize")]
    Minimize,
    #[token("let")]
    Let,
    #[token("for")]
    For,
    #[token("in")]
    In,
    #[token("return")]
    Return,
    #[token("checkpoint")]
    Checkpoint,
    #[token("true")]
    True,
    #[token("false")]
    False,
    #[token("if")]
    If,
    #[token("else")]
    Else,
    #[token("inf")]
    Inf,

    #[regex(r"[A-Za-z_][A-Za-z0-9_]*", |lex| lex.slice().to_string())]
    Ident(String),
    #[regex(r"[0-9][0-9_]*", parse_int)]
    Int(i64),
    #[regex(r"[0-9][0-9_]*\.[0-9][0-9_]*([eE][+-]?[0-9][0-9_]*)?", parse_float)]
    #[regex(r"[0-9][0-9_]*[eE][+-]?[0-9][0-9_]*", parse_float)]
    Float(f64),
    #[regex(r#""([^"\\\n]|\\.)*""#, |lex| unescape(lex.slice()), allow_greedy = true)]
    Str(String),
    #[regex(r#""([^"\\\n]|\\.)*"#, unterminated_string, allow_greedy = true)]
    UnterminatedStr,

    #[token("(")]
    LParen,
    #[token(")")]
    RParen,
    #[token("[")]
    LBracket,
    #[token("]")]
    RBracket,
    #[token("{")]
    LBrace,
    #[token("}")]
    RBrace,
    #[token(",")]
    Comma,
    #[token(":")]
    Colon,
    #[token(";")]
    Semi,
    #[token("..")]
    DotDot,
    #[token("->")]
    Arrow,
    #[token("=")]
    Eq,
    #[token("==")]
    EqEq,
    #[token("!=")]
    NotEq,
    #[token("<")]
    Lt,
    #[token("<=")]
    Le,
    #[token(">")]
    Gt,
    #[token(">=")]
    Ge,
    #[token("+")]
    Plus,
    #[token("-")]
    Minus,
    #[token("*")]
    Star,
    #[token("/")]
    Slash,
    #[token("%")]
    Percent,
    #[token("@")]
    At,
    #[token("!")]
    Bang,
    #[token("&&")]
    AndAnd,
    #[token("||")]
    OrOr,

    /// A statement separator made by the newline filter (never produced by logos itself).
    Sep,
}

fn parse_int(lex: &mut logos::Lexer<Tok>) -> Result<i64, LexErrorKind> {
    lex.slice()
        .replace('_', "")
        .parse::<i64>()
        .map_err(|_| LexErrorKind::BadNumber)
}

fn parse_float(lex: &mut logos::Lexer<Tok>) -> Result<f64, LexErrorKind> {
    lex.slice()
        .replace('_', "")
        .parse::<f64>()
        .map_err(|_| LexErrorKind::BadNumber)
}

fn unterminated_string(_: &mut logos::Lexer<Tok>) -> FilterResult<(), LexErrorKind> {
    FilterResult::Error(LexErrorKind::UnterminatedString)
}

fn unescape(s: &str) -> String {
    let inner = &s[1..s.len() - 1];
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(other) => out.push(other),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Skips a nestable `/* … */` comment; errors when the file ends inside it.
fn block_comment(lex: &mut logos::Lexer<Tok>) -> FilterResult<(), LexErrorKind> {
    let rest = lex.remainder().as_bytes();
    let mut depth = 1usize;
    let mut i = 0;
    while i < rest.len() {
        if rest[i] == b'/' && rest.get(i + 1) == Some(&b'*') {
            depth += 1;
            i += 2;
        } else if rest[i] == b'*' && rest.get(i + 1) == Some(&b'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                lex.bump(i);
                return FilterResult::Skip;
            }
        } else {
            i += 1;
        }
    }
    lex.bump(rest.len());
    FilterResult::Error(LexErrorKind::UnterminatedComment)
}

impl Tok {
    /// True for tokens after which a line break does not end the statement.
    fn continues_line(&self) -> bool {
        use Tok::*;
        matches!(
            self,
            Plus | Minus
                | Star
                | Slash
                | Percent
                | At
                | AndAnd
                | OrOr
                | EqEq
                | NotEq
                | Lt
                | Le
                | Gt
                | Ge
                | Comma
                | Eq
                | Colon
                | Arrow
                | LBrace
                | Bang
                | DotDot
        )
    }

    /// How the token reads in an error message ("expected `)`").
    pub fn describe(&self) -> String {
        use Tok::*;
        match self {
            Ident(s) => format!("identifier `{s}`"),
            Int(v) => format!("integer `{v}`"),
            Float(v) => format!("number `{v}`"),
            Str(_) => "string".to_string(),
            Newline | Sep => "end of statement".to_string(),
            other => format!("`{other}`"),
        }
    }
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Tok::*;
        let s = match self {
            Newline => "\\n",
            BlockComment => "/*",
            Const => "const",
            Fn => "fn",
            Model => "model",
            Input => "input",
            Param => "param",
            Output => "output",
            Train => "train",
            Minimize => "minimize",
            Let => "let",
            For => "for",
            In => "in",
            Return => "return",
            Checkpoint => "checkpoint",
            True => "true",
            False => "false",
            If => "if",
            Else => "else",
            Inf => "inf",
            Ident(s) => return write!(f, "{s}"),
            Int(v) => return write!(f, "{v}"),
            Float(v) => return write!(f, "{v:?}"),
            Str(s) => return write!(f, "{s:?}"),
            UnterminatedStr => "\"",
            LParen => "(",
            RParen => ")",
            LBracket => "[",
            RBracket => "]",
            LBrace => "{",
            RBrace => "}",
            Comma => ",",
            Colon => ":",
            Semi => ";",
            DotDot => "..",
            Arrow => "->",
            Eq => "=",
            EqEq => "==",
            NotEq => "!=",
            Lt => "<",
            Le => "<=",
            Gt => ">",
            Ge => ">=",
            Plus => "+",
            Minus => "-",
            Star => "*",
            Slash => "/",
            Percent => "%",
            At => "@",
            Bang => "!",
            AndAnd => "&&",
            OrOr => "||",
            Sep => ";",
        };
        f.write_str(s)
    }
}

/// A token with its byte range, as lalrpop's external-lexer interface wants it.
pub type Spanned = (usize, Tok, usize);

/// Lexes a whole file. Returns the filtered token stream and every lexical error found
/// (lexing goes on after an error, skipping the bad character).
pub fn tokenize(src: &str, file: FileId) -> (Vec<Spanned>, Vec<Diagnostic>) {
    let mut raw = Vec::new();
    // Lexical errors as (kind, start, end); a run of unexpected characters is one error (a
    // line of 5,000 stray characters gave 5,000 errors, each rendering the whole line).
    let mut bad: Vec<(LexErrorKind, usize, usize)> = Vec::new();
    let mut lex = Tok::lexer(src);
    while let Some(res) = lex.next() {
        let range = lex.span();
        match res {
            Ok(tok) => raw.push((range.start, tok, range.end)),
            Err(LexErrorKind::UnexpectedChar) => match bad.last_mut() {
                Some((LexErrorKind::UnexpectedChar, _, end)) if *end == range.start => {
                    *end = range.end;
                }
                _ => bad.push((LexErrorKind::UnexpectedChar, range.start, range.end)),
            },
            Err(kind) => bad.push((kind, range.start, range.end)),
        }
    }
    let errors = bad
        .into_iter()
        .map(|(kind, start, end)| lex_error(kind, src, Span::new(file, start, end)))
        .collect();
    (filter_newlines(raw), errors)
}

fn lex_error(kind: LexErrorKind, src: &str, span: Span) -> Diagnostic {
    match kind {
        LexErrorKind::UnterminatedComment => {
            let start = Span::new(span.file, span.start as usize, span.start as usize + 2);
            Diagnostic::error("E0102", "unterminated block comment")
                .with_primary(start, "this comment is never closed")
                .with_note("block comments `/* … */` nest: every `/*` needs its own `*/`")
        }
        LexErrorKind::UnterminatedString => {
            Diagnostic::error("E0103", "unterminated string literal")
                .with_primary(span, "this string has no closing `\"` on its line")
        }
        LexErrorKind::BadNumber => Diagnostic::error("E0104", "number literal out of range")
            .with_primary(span, "does not fit in a 64-bit integer"),
        LexErrorKind::UnexpectedChar
            if src
                .get(span.range())
                .is_some_and(|s| s.chars().nth(1).is_some()) =>
        {
            let text = src.get(span.range()).unwrap_or("");
            let n = text.chars().count();
            let shown: String = text
                .chars()
                .take(16)
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            Diagnostic::error("E0101", format!("{n} unexpected characters")).with_primary(
                span,
                format!(
                    "`{shown}`{} is not part of any TDSL token",
                    if n > 16 { "…" } else { "" }
                ),
            )
        }
        LexErrorKind::UnexpectedChar => {
            let ch = src
                .get(span.range())
                .and_then(|s| s.chars().next())
                .unwrap_or('?');
            let what = if ch == '\0' {
                "NUL byte".to_string()
            } else if ch.is_control() {
                format!("control character U+{:04X}", ch as u32)
            } else {
                format!("character `{ch}`")
            };
            Diagnostic::error("E0101", format!("unexpected {what}"))
                .with_primary(span, "not part of any TDSL token")
        }
    }
}

fn filter_newlines(raw: Vec<Spanned>) -> Vec<Spanned> {
    let mut out: Vec<Spanned> = Vec::with_capacity(raw.len());
    let mut brackets: Vec<char> = Vec::new();
    for (s, tok, e) in raw {
        match tok {
            Tok::Newline | Tok::Semi => {
                match brackets.last() {
                    Some('{') => {}
                    // In `( … )` / `[ … ]` a line break is whitespace; a `;` is kept so the
                    // parser reports it.
                    Some(_) if tok == Tok::Newline => continue,
                    Some(_) => {
                        out.push((s, tok, e));
                        continue;
                    }
                    // Top level: declarations need no separator.
                    None => continue,
                }
                let last = out.last().map(|(_, t, _)| t);
                if matches!(last, None | Some(Tok::Sep) | Some(Tok::LBrace)) {
                    continue;
                }
                if tok == Tok::Newline && last.is_some_and(Tok::continues_line) {
                    continue;
                }
                out.push((s, Tok::Sep, e));
            }
            Tok::Else => {
                if matches!(out.last(), Some((_, Tok::Sep, _))) {
                    out.pop();
                }
                out.push((s, tok, e));
            }
            Tok::LBrace | Tok::RBrace => {
                if matches!(out.last(), Some((_, Tok::Sep, _))) {
                    out.pop();
                }
                if tok == Tok::LBrace {
                    brackets.push('{');
                } else if brackets.last() == Some(&'{') {
                    brackets.pop();
                }
                out.push((s, tok, e));
            }
            Tok::LParen | Tok::LBracket => {
                brackets.push('(');
                out.push((s, tok, e));
            }
            Tok::RParen | Tok::RBracket => {
                if brackets.last() == Some(&'(') {
                    brackets.pop();
                }
                out.push((s, tok, e));
            }
            _ => out.push((s, tok, e)),
        }
    }
    out
}
