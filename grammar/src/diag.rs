//! Diagnostics: one type for every user-facing error, rendered as rustc renders them.
//!
//! A [`Diagnostic`] has a code (`E0301`), a message, labelled spans (one primary, any number
//! of secondary ones, possibly in other files such as the prelude) and notes. Rendering goes
//! through `codespan-reporting` against a [`SourceMap`].

use crate::span::{SourceMap, Span};
use codespan_reporting::diagnostic::{Diagnostic as CsDiagnostic, Label as CsLabel, Severity};
use codespan_reporting::files::{Error as FilesError, Files};
use codespan_reporting::term::{self, termcolor::WriteColor};

/// How bad a diagnostic is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Error,
    Warning,
}

/// A span with a message under it.
#[derive(Clone, Debug, PartialEq)]
pub struct Label {
    pub span: Span,
    pub message: String,
    pub primary: bool,
}

/// One user-facing error or warning.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    pub level: Level,
    pub code: &'static str,
    pub message: String,
    pub labels: Vec<Label>,
    pub notes: Vec<String>,
}

impl Diagnostic {
    pub fn error(code: &'static str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            level: Level::Error,
            code,
            message: message.into(),
            labels: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn warning(code: &'static str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            level: Level::Warning,
            ..Diagnostic::error(code, message)
        }
    }

    /// Adds the primary label (the span underlined with `^`).
    pub fn with_primary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: true,
        });
        self
    }

    /// Adds a secondary label (underlined with `-`).
    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Diagnostic {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: false,
        });
        self
    }

    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    pub fn is_error(&self) -> bool {
        self.level == Level::Error
    }

    /// The primary span, if any.
    pub fn primary_span(&self) -> Option<Span> {
        self.labels.iter().find(|l| l.primary).map(|l| l.span)
    }

    fn to_codespan(&self, sources: &SourceMap) -> CsDiagnostic<u32> {
        let severity = match self.level {
            Level::Error => Severity::Error,
            Level::Warning => Severity::Warning,
        };
        let labels = self
            .labels
            .iter()
            .map(|l| {
                let range = char_aligned(sources, l.span);
                let base = if l.primary {
                    CsLabel::primary(l.span.file.0, range)
                } else {
                    CsLabel::secondary(l.span.file.0, range)
                };
                base.with_message(l.message.clone())
            })
            .collect();
        CsDiagnostic::new(severity)
            .with_code(self.code)
            .with_message(self.message.clone())
            .with_labels(labels)
            .with_notes(self.notes.clone())
    }

    /// Renders into a colour-capable writer (a terminal's stderr).
    pub fn emit(&self, sources: &SourceMap, out: &mut dyn WriteColor) -> std::io::Result<()> {
        let config = term::Config::default();
        let files = FilesAdapter(sources);
        let styles = term::Styles::default();
        let mut writer = term::StylesWriter::new(out, &styles);
        term::emit_to_write_style(&mut writer, &config, &files, &self.to_codespan(sources))
            .map_err(std::io::Error::other)
    }

    /// Renders to plain text (no colours), as tests and snapshots see it.
    pub fn render(&self, sources: &SourceMap) -> String {
        let config = term::Config::default();
        let files = FilesAdapter(sources);
        term::emit_into_string(&config, &files, &self.to_codespan(sources))
            .unwrap_or_else(|_| format!("error[{}]: {}\n", self.code, self.message))
    }
}

/// A span's byte range clamped into its file and widened to character boundaries, so that
/// rendering never slices a multi-byte character.
fn char_aligned(sources: &SourceMap, span: Span) -> std::ops::Range<usize> {
    let Some(file) = sources.get(span.file) else {
        return 0..0;
    };
    let text = file.text.as_str();
    let mut start = (span.start as usize).min(text.len());
    let mut end = (span.end as usize).clamp(start, text.len());
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    while !text.is_char_boundary(end) {
        end += 1;
    }
    start..end
}

/// Renders several diagnostics, in order, as plain text.
pub fn render_all(diags: &[Diagnostic], sources: &SourceMap) -> String {
    diags.iter().map(|d| d.render(sources)).collect()
}

struct FilesAdapter<'a>(&'a SourceMap);

impl<'a> Files<'a> for FilesAdapter<'a> {
    type FileId = u32;
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, id: u32) -> Result<&'a str, FilesError> {
        self.0
            .get(crate::span::FileId(id))
            .map(|f| f.name.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn source(&'a self, id: u32) -> Result<&'a str, FilesError> {
        self.0
            .get(crate::span::FileId(id))
            .map(|f| f.text.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn line_index(&'a self, id: u32, byte_index: usize) -> Result<usize, FilesError> {
        let f = self
            .0
            .get(crate::span::FileId(id))
            .ok_or(FilesError::FileMissing)?;
        Ok(match f.line_starts().binary_search(&byte_index) {
            Ok(l) => l,
            Err(l) => l.saturating_sub(1),
        })
    }

    fn line_range(
        &'a self,
        id: u32,
        line_index: usize,
    ) -> Result<std::ops::Range<usize>, FilesError> {
        let f = self
            .0
            .get(crate::span::FileId(id))
            .ok_or(FilesError::FileMissing)?;
        let starts = f.line_starts();
        let start = *starts.get(line_index).ok_or(FilesError::LineTooLarge {
            given: line_index,
            max: starts.len().saturating_sub(1),
        })?;
        let end = starts.get(line_index + 1).copied().unwrap_or(f.text.len());
        Ok(start..end)
    }
}
