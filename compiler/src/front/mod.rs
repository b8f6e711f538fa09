//! The front end: source text → one [`Graph`] per model.
//!
//! Steps: decode and parse the user's file and the shipped prelude; collect declarations
//! (duplicates are errors); apply `--set` overrides and evaluate constants in dependency
//! order; lower the selected model(s) (see [`lower`]); verify each graph.

mod builtins;
mod lower;
pub mod micro_batch;
pub use lower::MAX_EXPR_DEPTH;
mod value;

pub use value::Value;

use crate::ir::{verify::verify, Graph};
use lower::{FnInfo, Lowerer, ProgramInfo};
use std::collections::{BTreeMap, BTreeSet};
use tcc_grammar::ast::{ConstDecl, Expr, ExprKind, FnDecl, Item, ModelDecl, Program};
use tcc_grammar::diag::Diagnostic;
use tcc_grammar::span::{FileId, SourceMap, Span};

/// The standard prelude, written in TDSL and compiled into the binary.
pub const PRELUDE: &str = include_str!("prelude.tdsl");
/// Every function a program calls by name without defining it: the builtins and the
/// prelude's functions (an importer must not bind these names).
pub fn predefined_functions() -> impl Iterator<Item = &'static str> {
    let prelude = PRELUDE.lines().filter_map(|l| {
        let rest = l.trim_start().strip_prefix("fn ")?;
        rest.split('(').next().map(str::trim)
    });
    builtins::names().chain(prelude)
}

/// The name the prelude has in diagnostics.
pub const PRELUDE_NAME: &str = "<prelude>";

/// Which models to lower.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ModelSelection {
    /// The named model; with `None`, the file's only model (an error if it has several).
    One(Option<String>),
    /// Every model in the file (what `tcc check` does without `--model`).
    #[default]
    All,
}

/// Front-end options.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--set NAME=VALUE` overrides, in command-line order.
    pub sets: Vec<(String, String)>,
    pub models: ModelSelection,
}

/// A successful front-end run: the graphs and any warnings.
#[derive(Debug)]
pub struct Lowered {
    pub graphs: Vec<Graph>,
    pub warnings: Vec<Diagnostic>,
}

/// A compilation's sources: the user's file plus the prelude.
pub struct Sources {
    pub map: SourceMap,
    pub user: FileId,
    pub prelude: FileId,
    /// Set when the file's bytes could not be decoded; the diagnostics are here.
    decode_errors: Vec<Diagnostic>,
}

impl Sources {
    /// Registers the user's file from raw bytes (decoding problems are reported later by
    /// [`compile`]) and the prelude.
    pub fn new(name: &str, bytes: &[u8]) -> Sources {
        let mut map = SourceMap::new();
        let text = String::from_utf8_lossy(bytes).into_owned();
        let user = map.add(name, text);
        let prelude = map.add(PRELUDE_NAME, PRELUDE);
        let decode_errors = match tcc_grammar::decode_source(bytes, user) {
            Ok(_) => Vec::new(),
            Err(d) => d,
        };
        Sources {
            map,
            user,
            prelude,
            decode_errors,
        }
    }

    fn text(&self, id: FileId) -> &str {
        self.map.get(id).map(|f| f.text.as_str()).unwrap_or("")
    }
}

/// The graph of a test program with one model (unit tests of passes and analyses).
#[cfg(test)]
pub(crate) fn test_graph(src: &str) -> Graph {
    let mut sources = Sources::new("t.tdsl", src.as_bytes());
    match compile(&mut sources, &Options::default()) {
        Ok(mut l) if l.graphs.len() == 1 => l.graphs.remove(0),
        other => panic!("test program does not compile: {other:?}"),
    }
}

/// Runs the front end. Errors come back all together, in source order.
pub fn compile(sources: &mut Sources, opts: &Options) -> Result<Lowered, Vec<Diagnostic>> {
    if !sources.decode_errors.is_empty() {
        return Err(sources.decode_errors.clone());
    }
    let user_prog = tcc_grammar::parse(sources.text(sources.user), sources.user)?;
    let prelude_prog = match tcc_grammar::parse(sources.text(sources.prelude), sources.prelude) {
        Ok(p) => p,
        Err(mut d) => {
            d.insert(
                0,
                Diagnostic::error(
                    "E0001",
                    "internal error: the standard prelude does not parse",
                ),
            );
            return Err(d);
        }
    };
    // `--set` values are parsed as expressions from their own pseudo-files.
    let mut set_exprs = Vec::new();
    let mut diags = Vec::new();
    for (name, value) in &opts.sets {
        let id = sources.map.add(format!("--set {name}"), value.clone());
        match tcc_grammar::parse_expr(value, id) {
            Ok(e) => set_exprs.push((name.clone(), e)),
            Err(d) => diags.extend(d),
        }
    }
    let texts = &sources.map;
    lower_program(
        &user_prog,
        &prelude_prog,
        &set_exprs,
        opts,
        sources.prelude,
        texts,
        diags,
    )
}

fn lower_program(
    user: &Program,
    prelude: &Program,
    sets: &[(String, Expr)],
    opts: &Options,
    prelude_file: FileId,
    texts: &SourceMap,
    mut diags: Vec<Diagnostic>,
) -> Result<Lowered, Vec<Diagnostic>> {
    // Declarations and duplicates.
    let mut first: BTreeMap<&str, Span> = BTreeMap::new();
    let mut consts: BTreeMap<String, &ConstDecl> = BTreeMap::new();
    let mut fns: BTreeMap<String, FnInfo> = BTreeMap::new();
    let mut models: Vec<&ModelDecl> = Vec::new();
    for item in &user.items {
        let name = item.name();
        if let Some(prev) = first.get(name.name.as_str()) {
            diags.push(
                Diagnostic::error("E0205", format!("`{}` is declared twice", name.name))
                    .with_primary(name.span, "second declaration")
                    .with_secondary(*prev, "first declared here"),
            );
            continue;
        }
        first.insert(&name.name, name.span);
        match item {
            Item::Const(c) => {
                consts.insert(c.name.name.clone(), c);
            }
            Item::Fn(f) => {
                check_fn_params(f, &mut diags);
                fns.insert(
                    f.name.name.clone(),
                    FnInfo {
                        decl: f,
                        prelude: false,
                    },
                );
            }
            Item::Model(m) => models.push(m),
        }
    }
    for item in &prelude.items {
        if let Item::Fn(f) = item {
            fns.entry(f.name.name.clone()).or_insert(FnInfo {
                decl: f,
                prelude: true,
            });
        }
    }
    // `--set` overrides.
    let mut const_exprs: BTreeMap<String, (&Expr, Span)> = consts
        .iter()
        .map(|(n, c)| (n.clone(), (&c.value, c.name.span)))
        .collect();
    for (name, e) in sets {
        match const_exprs.get_mut(name) {
            Some(slot) => slot.0 = e,
            None => {
                let mut d = Diagnostic::error(
                    "E0214",
                    format!("`--set {name}`: no constant named `{name}`"),
                );
                if let Some(s) = lower::suggest(name, consts.keys().map(String::as_str)) {
                    d = d.with_note(format!("did you mean `{s}`?"));
                }
                let known: Vec<&str> = consts.keys().map(String::as_str).collect();
                d = d.with_note(if known.is_empty() {
                    "this file declares no constants".to_string()
                } else {
                    format!("constants in this file: {}", known.join(", "))
                });
                diags.push(d);
            }
        }
    }
    let const_values = eval_consts(&const_exprs, prelude_file, texts, &mut diags);
    let prog = ProgramInfo {
        consts: const_values,
        fns,
    };
    // Model selection.
    let selected: Vec<&ModelDecl> = match &opts.models {
        ModelSelection::All => models.clone(),
        ModelSelection::One(None) if models.len() == 1 => models.clone(),
        ModelSelection::One(None) => {
            if models.is_empty() {
                diags.push(
                    Diagnostic::error("E0209", "no model in this file")
                        .with_note("declare one: `model name { … }`"),
                );
            } else {
                let names: Vec<&str> = models.iter().map(|m| m.name.name.as_str()).collect();
                diags.push(
                    Diagnostic::error(
                        "E0209",
                        format!(
                            "this file has {} models; pick one with `--model NAME`",
                            models.len()
                        ),
                    )
                    .with_note(format!("models: {}", names.join(", "))),
                );
            }
            Vec::new()
        }
        ModelSelection::One(Some(name)) => match models.iter().find(|m| m.name.name == *name) {
            Some(m) => vec![*m],
            None => {
                let names: Vec<&str> = models.iter().map(|m| m.name.name.as_str()).collect();
                let mut d = Diagnostic::error("E0209", format!("no model named `{name}`"));
                if let Some(s) = lower::suggest(name, names.iter().copied()) {
                    d = d.with_note(format!("did you mean `{s}`?"));
                }
                diags.push(d.with_note(format!("models in this file: {}", names.join(", "))));
                Vec::new()
            }
        },
    };
    if models.is_empty() && matches!(opts.models, ModelSelection::All) {
        diags.push(
            Diagnostic::error("E0209", "no model in this file")
                .with_note("declare one: `model name { … }`"),
        );
    }
    let mut graphs = Vec::new();
    {
        for m in selected {
            let mut lw = Lowerer::new(&prog, &m.name.name, prelude_file, &mut diags)
                .with_source_texts(Box::new(move |s: Span| {
                    texts
                        .get(s.file)
                        .and_then(|f| f.text.get(s.range()))
                        .map(str::to_string)
                }));
            lw.lower_model(m);
            let graph = std::mem::take(&mut lw.graph);
            drop(lw);
            if let Err(errs) = verify(&graph) {
                for e in errs {
                    diags.push(
                        Diagnostic::error("E0002", format!("internal compiler error: {e}"))
                            .with_primary(m.name.span, "while lowering this model"),
                    );
                }
            }
            graphs.push(graph);
        }
    }
    let (errors, warnings): (Vec<_>, Vec<_>) = diags.into_iter().partition(Diagnostic::is_error);
    if errors.is_empty() {
        Ok(Lowered { graphs, warnings })
    } else {
        let mut all = errors;
        all.extend(warnings);
        Err(all)
    }
}

/// Parameter names must be unique and scalar-kind params must come with sensible defaults.
fn check_fn_params(f: &FnDecl, diags: &mut Vec<Diagnostic>) {
    let mut seen: BTreeMap<&str, Span> = BTreeMap::new();
    for p in &f.params {
        if let Some(prev) = seen.get(p.name.name.as_str()) {
            diags.push(
                Diagnostic::error(
                    "E0205",
                    format!("parameter `{}` is declared twice", p.name.name),
                )
                .with_primary(p.name.span, "second declaration")
                .with_secondary(*prev, "first declared here"),
            );
        }
        seen.insert(&p.name.name, p.name.span);
    }
}

/// Names a constant expression refers to.
fn const_refs(e: &Expr, out: &mut BTreeSet<String>) {
    match &e.kind {
        ExprKind::Name(n) => {
            out.insert(n.clone());
        }
        ExprKind::Unary(_, x) => const_refs(x, out),
        ExprKind::Binary(_, a, b) => {
            const_refs(a, out);
            const_refs(b, out);
        }
        ExprKind::Call { args, .. } => args.iter().for_each(|a| const_refs(&a.value, out)),
        ExprKind::List(xs) | ExprKind::Tuple(xs) => xs.iter().for_each(|x| const_refs(x, out)),
        ExprKind::Index { base, .. } => const_refs(base, out),
        ExprKind::If { cond, .. } => const_refs(cond, out),
        _ => {}
    }
}

/// Evaluates every constant (with overrides applied) in dependency order.
fn eval_consts(
    exprs: &BTreeMap<String, (&Expr, Span)>,
    prelude_file: FileId,
    texts: &SourceMap,
    diags: &mut Vec<Diagnostic>,
) -> BTreeMap<String, Value> {
    // Depth-first topological order with cycle detection.
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    fn visit(
        name: &str,
        exprs: &BTreeMap<String, (&Expr, Span)>,
        marks: &mut BTreeMap<String, Mark>,
        order: &mut Vec<String>,
        diags: &mut Vec<Diagnostic>,
        stack: &mut Vec<String>,
    ) {
        match marks.get(name) {
            Some(Mark::Done) => return,
            Some(Mark::Visiting) => {
                let start = stack.iter().position(|s| s == name).unwrap_or(0);
                let mut cycle = stack[start..].to_vec();
                cycle.push(name.to_string());
                let span = exprs.get(name).map(|e| e.1).unwrap_or_default();
                diags.push(
                    Diagnostic::error("E0215", format!("constant `{name}` depends on itself"))
                        .with_primary(span, format!("cycle: {}", cycle.join(" → "))),
                );
                return;
            }
            None => {}
        }
        let Some((e, _)) = exprs.get(name) else {
            return;
        };
        marks.insert(name.to_string(), Mark::Visiting);
        stack.push(name.to_string());
        let mut refs = BTreeSet::new();
        const_refs(e, &mut refs);
        for r in refs {
            if exprs.contains_key(&r) {
                visit(&r, exprs, marks, order, diags, stack);
            }
        }
        stack.pop();
        marks.insert(name.to_string(), Mark::Done);
        order.push(name.to_string());
    }
    let mut marks = BTreeMap::new();
    let mut order = Vec::new();
    let errors_before = diags.len();
    for name in exprs.keys() {
        visit(name, exprs, &mut marks, &mut order, diags, &mut Vec::new());
    }
    let mut values: BTreeMap<String, Value> = BTreeMap::new();
    if diags.len() > errors_before {
        // A cycle: every constant is poisoned, so uses of them report nothing more.
        return exprs.keys().map(|k| (k.clone(), Value::Poison)).collect();
    }
    for name in order {
        let Some((e, span)) = exprs.get(&name) else {
            continue;
        };
        let prog = ProgramInfo {
            consts: values.clone(),
            fns: BTreeMap::new(),
        };
        let v = {
            let mut lw = Lowerer::new(&prog, "<const>", prelude_file, diags).with_source_texts(
                Box::new(move |s: Span| {
                    texts
                        .get(s.file)
                        .and_then(|f| f.text.get(s.range()))
                        .map(str::to_string)
                }),
            );
            let v = lw.eval(e);
            let made_nodes = lw.graph.node_count() > 0;
            match v {
                Value::Int(_) | Value::Float(_) | Value::Bool(_) => v,
                Value::Poison => v,
                other => {
                    let what = if made_nodes { "a tensor" } else { other.kind() };
                    lw.error(
                        "E0216",
                        format!("constant `{name}` is not a compile-time number"),
                        e.span,
                        format!("this is {what}"),
                    );
                    Value::Poison
                }
            }
        };
        let _ = span;
        values.insert(name, v);
    }
    values
}
