//! Lowering: from the AST of one model to a [`Graph`].
//!
//! Lowering is an interpreter over the AST. Compile-time values (constants, loop variables,
//! shape variables, literals) are folded; tensor values become graph nodes. Functions are
//! inlined at every call with their shape variables bound from the arguments; `for` loops are
//! unrolled. Errors are collected (not thrown): an expression that fails yields
//! [`Value::Poison`], which silently poisons everything computed from it, so each mistake is
//! reported once and independent mistakes are all reported.

use super::builtins;
use super::value::{fold_binary, fold_unary, Value};
use crate::ir::{DType, Graph, Init, NodeId, Op, Optimizer, Scalar, Shape, TensorType, TrainSpec};
use std::collections::BTreeMap;
use tcc_grammar::ast::*;
use tcc_grammar::diag::Diagnostic;
use tcc_grammar::span::{FileId, Span};

/// Most nested function calls before lowering gives up (recursion is caught earlier).
const MAX_CALL_DEPTH: usize = 64;
/// Most `for` iterations in one model, all loops together (unrolling is static).
const MAX_UNROLL: usize = 100_000;

/// Everything program-wide a model's lowering may look at.
pub(crate) struct ProgramInfo<'a> {
    pub consts: BTreeMap<String, Value>,
    pub fns: BTreeMap<String, FnInfo<'a>>,
}

#[derive(Clone, Copy)]
pub(crate) struct FnInfo<'a> {
    pub decl: &'a FnDecl,
    pub prelude: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BindKind {
    Let,
    Input,
    Param,
    LoopVar,
    FnParam,
    ShapeVar,
}

#[derive(Clone, Debug)]
struct Binding {
    value: Value,
    span: Span,
    kind: BindKind,
}

/// The variables one function body (or the model body) sees.
struct Frame {
    scopes: Vec<BTreeMap<String, Binding>>,
    /// Prelude functions do not see the user's constants.
    sees_consts: bool,
    /// Dtype variables bound for this call (`F` in `x: F[..]`).
    dtype_vars: BTreeMap<String, DType>,
    /// `(function name, call site)` for user functions, for notes on errors.
    call: Option<(String, Span)>,
}

impl Frame {
    fn new(sees_consts: bool, call: Option<(String, Span)>) -> Frame {
        Frame {
            scopes: vec![BTreeMap::new()],
            sees_consts,
            dtype_vars: BTreeMap::new(),
            call,
        }
    }
}

/// Where a statement sits: what it may declare.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StmtCtx {
    ModelTop,
    ModelNested,
    Function,
}

pub(crate) struct Lowerer<'a, 'd> {
    prog: &'a ProgramInfo<'a>,
    pub graph: Graph,
    diags: &'d mut Vec<Diagnostic>,
    frames: Vec<Frame>,
    /// Span in user code that nodes made inside prelude functions are attributed to.
    anchor: Option<Span>,
    checkpoint: Option<u32>,
    next_checkpoint: u32,
    /// The outermost user-function call being inlined (see `Node::block`).
    block: Option<u32>,
    next_block: u32,
    next_seed: u64,
    unrolled: usize,
    prelude_file: FileId,
    train_seen: bool,
    output_names: BTreeMap<String, Span>,
    source_texts: Option<SourceTexts<'a>>,
    /// Expressions being evaluated, nested (see [`MAX_EXPR_DEPTH`]), and whether the limit
    /// was reported.
    depth: usize,
    too_deep: bool,
}

/// Deepest expression nesting lowered (a sum of N terms nests N deep). Lowering recurses
/// once a level; `tcc` runs the compiler on a 1 GiB stack, which held a million levels
/// (1.2 GB resident, 2.4 s), so this keeps a tenth of that with room for the recursion
/// around it.
pub const MAX_EXPR_DEPTH: usize = 100_000;

/// Result of a block: its value (the last expression, or `return`).
enum Flow {
    Value(Value, Span),
    Return(Value, Span),
    None,
}

impl<'a, 'd> Lowerer<'a, 'd> {
    pub fn new(
        prog: &'a ProgramInfo<'a>,
        model: &str,
        prelude_file: FileId,
        diags: &'d mut Vec<Diagnostic>,
    ) -> Self {
        Lowerer {
            prog,
            graph: Graph::new(model),
            diags,
            frames: vec![Frame::new(true, None)],
            anchor: None,
            checkpoint: None,
            next_checkpoint: 0,
            block: None,
            next_block: 0,
            next_seed: 0,
            unrolled: 0,
            prelude_file,
            train_seen: false,
            output_names: BTreeMap::new(),
            source_texts: None,
            depth: 0,
            too_deep: false,
        }
    }

    // ----------------------------------------------------------------- diagnostics

    /// Reports an error at `span`, adding call-stack context: for prelude code the primary
    /// label moves to the user's call site and the prelude line becomes a secondary label.
    pub fn error(
        &mut self,
        code: &'static str,
        message: impl Into<String>,
        span: Span,
        label: impl Into<String>,
    ) {
        let label = label.into();
        let mut d = Diagnostic::error(code, message);
        match self.anchor {
            Some(anchor) if span.file == self.prelude_file => {
                d = d
                    .with_primary(anchor, label)
                    .with_secondary(span, "in the standard prelude, here");
            }
            _ => d = d.with_primary(span, label),
        }
        for f in self.frames.iter().rev() {
            if let Some((name, site)) = &f.call {
                if site.file != self.prelude_file && Some(*site) != self.anchor {
                    d = d.with_secondary(*site, format!("in this call to `{name}`"));
                }
            }
        }
        self.diags.push(d);
    }

    fn warn(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    fn node_span(&self, span: Span) -> Span {
        match self.anchor {
            Some(a) if span.file == self.prelude_file => a,
            _ => span,
        }
    }

    /// Adds a node; a shape/dtype rule violation is reported at `span`.
    pub fn add(&mut self, op: Op, inputs: Vec<NodeId>, span: Span) -> Value {
        let at = self.node_span(span);
        match self.graph.add(op, inputs, at, self.checkpoint) {
            Ok(id) => {
                if let Some(b) = self.block {
                    self.graph.set_block(id, b);
                }
                Value::Tensor(id)
            }
            Err(e) => {
                self.error(e.code, e.message, span, e.detail);
                Value::Poison
            }
        }
    }

    pub fn ty(&self, id: NodeId) -> TensorType {
        self.graph.ty(id).clone()
    }

    pub fn next_seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed - 1
    }

    // ----------------------------------------------------------------- names

    fn frame(&mut self) -> &mut Frame {
        // The model frame is pushed in `new` and never popped.
        let last = self.frames.len() - 1;
        &mut self.frames[last]
    }

    fn lookup(&self, name: &str) -> Option<&Binding> {
        let f = self.frames.last()?;
        f.scopes.iter().rev().find_map(|s| s.get(name))
    }

    fn bind(&mut self, name: &Ident, value: Value, kind: BindKind) {
        if name.name == "_" {
            return;
        }
        let b = Binding {
            value,
            span: name.span,
            kind,
        };
        if let Some(scope) = self.frame().scopes.last_mut() {
            scope.insert(name.name.clone(), b);
        }
    }

    fn visible_names(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        if let Some(f) = self.frames.last() {
            for s in &f.scopes {
                v.extend(s.keys().cloned());
            }
            if f.sees_consts {
                v.extend(self.prog.consts.keys().cloned());
            }
        }
        v
    }

    fn resolve_name(&mut self, name: &str, span: Span) -> Value {
        if let Some(b) = self.lookup(name) {
            return b.value.clone();
        }
        let sees_consts = self.frames.last().is_some_and(|f| f.sees_consts);
        if sees_consts {
            if let Some(v) = self.prog.consts.get(name) {
                return v.clone();
            }
        }
        if let Some(dt) = DType::from_name(name) {
            return Value::DType(dt);
        }
        let mut msg = "not found in this scope".to_string();
        if let Some(s) = suggest(name, self.visible_names().iter().map(String::as_str)) {
            msg = format!("not found in this scope; did you mean `{s}`?");
        } else if self.prog.fns.contains_key(name) || builtins::is_builtin(name) {
            msg = format!("`{name}` is a function: call it as `{name}(…)`");
        }
        self.error("E0201", format!("unknown name `{name}`"), span, msg);
        Value::Poison
    }

    // ----------------------------------------------------------------- model

    pub fn lower_model(&mut self, model: &'a ModelDecl) {
        let flow = self.lower_stmts(&model.body.stmts, StmtCtx::ModelTop);
        if let Flow::Return(_, span) = flow {
            self.error(
                "E0218",
                "`return` outside a function",
                span,
                "models return values with `output`",
            );
        }
        if self.output_names.is_empty() && !self.train_seen {
            self.warn(
                Diagnostic::warning(
                    "W0001",
                    format!("model `{}` has no `output` and no `train`", model.name.name),
                )
                .with_primary(model.name.span, "this model computes nothing observable"),
            );
        }
    }

    fn lower_stmts(&mut self, stmts: &'a [Stmt], ctx: StmtCtx) -> Flow {
        let mut last = Flow::None;
        for (i, stmt) in stmts.iter().enumerate() {
            last = Flow::None;
            match &stmt.kind {
                StmtKind::Error => {}
                StmtKind::Input { name, ty } => {
                    if self.model_top_only(ctx, "input", stmt.span) {
                        self.declare_input(name, ty);
                    }
                }
                StmtKind::Param { name, ty, init } => {
                    if self.model_top_only(ctx, "param", stmt.span) {
                        self.declare_param(name, ty, init.as_ref());
                    }
                }
                StmtKind::Let { pat, value } => {
                    let v = self.eval(value);
                    self.bind_pattern(pat, v);
                }
                StmtKind::Assign { name, value } => {
                    let v = self.eval(value);
                    self.assign(name, v);
                }
                StmtKind::For { var, lo, hi, body } => self.lower_for(var, lo, hi, body, ctx),
                StmtKind::Output { items } => {
                    if self.model_top_only(ctx, "output", stmt.span) {
                        self.lower_output(items);
                    }
                }
                StmtKind::Train { optimizer, loss } => {
                    if self.model_top_only(ctx, "train", stmt.span) {
                        self.lower_train(optimizer, loss, stmt.span);
                    }
                }
                StmtKind::Return(e) => {
                    let v = self.eval(e);
                    if i + 1 != stmts.len() {
                        self.error(
                            "E0218",
                            "code after `return`",
                            stmts[i + 1].span,
                            "this is never run",
                        );
                    }
                    return Flow::Return(v, e.span);
                }
                StmtKind::Expr(e) => {
                    let v = self.eval(e);
                    last = Flow::Value(v, e.span);
                }
            }
        }
        last
    }

    fn model_top_only(&mut self, ctx: StmtCtx, what: &str, span: Span) -> bool {
        if ctx == StmtCtx::ModelTop {
            return true;
        }
        let place = if ctx == StmtCtx::Function {
            "inside a function"
        } else {
            "inside a nested block"
        };
        self.error(
            "E0218",
            format!("`{what}` is not allowed {place}"),
            span,
            format!("`{what}` belongs at the top level of a model body"),
        );
        false
    }

    fn check_redeclared(&mut self, name: &Ident, what: &str) -> bool {
        if let Some(prev) = self.lookup(&name.name) {
            if matches!(prev.kind, BindKind::Input | BindKind::Param) {
                let prev_span = prev.span;
                self.diags.push(
                    Diagnostic::error("E0205", format!("`{}` is declared twice", name.name))
                        .with_primary(name.span, format!("second declaration of this {what}"))
                        .with_secondary(prev_span, "first declared here"),
                );
                return true;
            }
        }
        false
    }

    /// Evaluates a type written in a model (`f32[B, 784]`): a concrete dtype and constant dims.
    fn concrete_type(&mut self, ty: &'a TypeExpr) -> Option<TensorType> {
        let dtype = match DType::from_name(&ty.dtype.name) {
            Some(d) => d,
            None => {
                let hint = suggest(&ty.dtype.name, DType::ALL.iter().map(|d| d.name()))
                    .map(|s| format!("did you mean `{s}`?"))
                    .unwrap_or_else(|| "expected one of f32, f16, bf16, i32, bool".into());
                self.error(
                    "E0213",
                    format!("unknown dtype `{}`", ty.dtype.name),
                    ty.dtype.span,
                    hint,
                );
                return None;
            }
        };
        let Some(dims) = &ty.dims else {
            self.error(
                "E0213",
                "a tensor type needs a shape",
                ty.span,
                format!(
                    "write `{}[…]` (`{}[]` for a scalar)",
                    ty.dtype.name, ty.dtype.name
                ),
            );
            return None;
        };
        let mut out = Vec::with_capacity(dims.len());
        let mut ok = true;
        for d in dims {
            match d {
                DimExpr::Rest(span) => {
                    self.error(
                        "E0316",
                        "`..` is only allowed in function signatures",
                        *span,
                        "write every dimension",
                    );
                    ok = false;
                }
                DimExpr::Expr(e) => match self.eval_dim(e) {
                    Some(n) => out.push(n),
                    None => ok = false,
                },
            }
        }
        ok.then(|| TensorType::new(dtype, out))
    }

    /// Evaluates a dimension: a positive compile-time integer.
    fn eval_dim(&mut self, e: &'a Expr) -> Option<usize> {
        match self.eval(e) {
            Value::Int(n) if n > 0 => Some(n as usize),
            Value::Int(n) => {
                self.error(
                    "E0316",
                    "dimension must be positive",
                    e.span,
                    format!("this is {n}"),
                );
                None
            }
            Value::Poison => None,
            other => {
                self.error(
                    "E0316",
                    "dimension must be a compile-time integer",
                    e.span,
                    format!("this is {}", other.kind()),
                );
                None
            }
        }
    }

    fn declare_input(&mut self, name: &'a Ident, ty: &'a TypeExpr) {
        if self.check_redeclared(name, "input") {
            return;
        }
        let v = match self.concrete_type(ty) {
            Some(t) => self.add(
                Op::Input {
                    name: name.name.clone(),
                    ty: t,
                },
                vec![],
                name.span.to(ty.span),
            ),
            None => Value::Poison,
        };
        self.bind(name, v, BindKind::Input);
    }

    fn declare_param(&mut self, name: &'a Ident, ty: &'a TypeExpr, init: Option<&'a Expr>) {
        if self.check_redeclared(name, "param") {
            return;
        }
        let t = self.concrete_type(ty);
        let init = match init {
            None => Some(Init::External),
            Some(e) => self.param_init(e),
        };
        let v = match (t, init) {
            (Some(t), Some(init)) => {
                if !t.dtype.is_float() && !matches!(init, Init::Zeros | Init::Ones | Init::External)
                {
                    self.error(
                        "E0402",
                        format!("random initialiser for a {} param", t.dtype),
                        ty.span,
                        "`normal` and `uniform` need a float dtype",
                    );
                    Value::Poison
                } else {
                    self.add(
                        Op::Param {
                            name: name.name.clone(),
                            ty: t,
                            init,
                        },
                        vec![],
                        name.span.to(ty.span),
                    )
                }
            }
            _ => Value::Poison,
        };
        self.bind(name, v, BindKind::Param);
    }

    fn param_init(&mut self, e: &'a Expr) -> Option<Init> {
        const EXPECTED: &str = "expected `zeros`, `ones`, `normal(mean, std)` or `uniform(lo, hi)`";
        match &e.kind {
            ExprKind::Name(n) if n == "zeros" => Some(Init::Zeros),
            ExprKind::Name(n) if n == "ones" => Some(Init::Ones),
            ExprKind::Call { callee, args }
                if callee.name == "normal" || callee.name == "uniform" =>
            {
                let names: &[&str] = if callee.name == "normal" {
                    &["mean", "std"]
                } else {
                    &["lo", "hi"]
                };
                let vals = self.bind_call_args(&callee.name, names, &[], args, e.span)?;
                let mut nums = Vec::new();
                for (v, span) in vals.into_iter().flatten() {
                    match v.as_f64() {
                        Some(x) => nums.push(x),
                        None => {
                            self.error(
                                "E0212",
                                "initialiser arguments must be numbers",
                                span,
                                format!("this is {}", v.kind()),
                            );
                            return None;
                        }
                    }
                }
                if callee.name == "normal" {
                    if nums[1] < 0.0 {
                        self.error(
                            "E0316",
                            "negative standard deviation",
                            e.span,
                            "std must be >= 0",
                        );
                        return None;
                    }
                    Some(Init::Normal {
                        mean: nums[0],
                        std: nums[1],
                    })
                } else {
                    if nums[0] > nums[1] {
                        self.error("E0316", "empty uniform range", e.span, "lo must be <= hi");
                        return None;
                    }
                    Some(Init::Uniform {
                        lo: nums[0],
                        hi: nums[1],
                    })
                }
            }
            _ => {
                self.error("E0220", "unknown param initialiser", e.span, EXPECTED);
                None
            }
        }
    }

    fn bind_pattern(&mut self, pat: &'a Pattern, v: Value) {
        match pat {
            Pattern::Name(n) => self.bind(n, v, BindKind::Let),
            Pattern::Tuple(ps, span) => match v {
                Value::Tuple(vs) if vs.len() == ps.len() => {
                    for (p, v) in ps.iter().zip(vs) {
                        self.bind_pattern(p, v);
                    }
                }
                Value::Poison => {
                    for p in ps {
                        self.bind_pattern(p, Value::Poison);
                    }
                }
                other => {
                    let found = match &other {
                        Value::Tuple(vs) => format!("a tuple of {}", vs.len()),
                        v => v.kind().to_string(),
                    };
                    self.error(
                        "E0217",
                        "tuple pattern does not match the value",
                        *span,
                        format!(
                            "this pattern takes {} values; the right side gives {found}",
                            ps.len()
                        ),
                    );
                    for p in ps {
                        self.bind_pattern(p, Value::Poison);
                    }
                }
            },
        }
    }

    fn assign(&mut self, name: &'a Ident, v: Value) {
        let frame = match self.frames.last_mut() {
            Some(f) => f,
            None => return,
        };
        let found = frame
            .scopes
            .iter_mut()
            .rev()
            .find_map(|s| s.get_mut(&name.name));
        match found {
            Some(b) if b.kind == BindKind::LoopVar => {
                self.error(
                    "E0211",
                    format!("cannot assign to loop variable `{}`", name.name),
                    name.span,
                    "loop variables are constants",
                );
            }
            Some(b) => {
                b.value = v;
            }
            None => {
                let hint = if self.prog.consts.contains_key(&name.name) {
                    format!(
                        "`{}` is a constant; constants change only with `--set`",
                        name.name
                    )
                } else {
                    format!("declare it first: `let {} = …`", name.name)
                };
                self.error(
                    "E0211",
                    format!("assignment to undeclared `{}`", name.name),
                    name.span,
                    hint,
                );
            }
        }
    }

    fn lower_for(
        &mut self,
        var: &'a Ident,
        lo: &'a Expr,
        hi: &'a Expr,
        body: &'a Block,
        ctx: StmtCtx,
    ) {
        let bound = |this: &mut Self, e: &'a Expr| match this.eval(e) {
            Value::Int(n) => Some(n),
            Value::Poison => None,
            other => {
                this.error(
                    "E0216",
                    "loop bounds must be compile-time integers",
                    e.span,
                    format!("this is {}", other.kind()),
                );
                None
            }
        };
        let (Some(a), Some(b)) = (bound(self, lo), bound(self, hi)) else {
            return;
        };
        let n = b.saturating_sub(a).max(0) as usize;
        self.unrolled = self.unrolled.saturating_add(n);
        if self.unrolled > MAX_UNROLL {
            self.error(
                "E0216",
                "too many loop iterations to unroll",
                lo.span.to(hi.span),
                format!("more than {MAX_UNROLL} in this model"),
            );
            return;
        }
        let inner = if ctx == StmtCtx::Function {
            StmtCtx::Function
        } else {
            StmtCtx::ModelNested
        };
        for i in a..b {
            self.frame().scopes.push(BTreeMap::new());
            self.bind(var, Value::Int(i), BindKind::LoopVar);
            let errors_before = self.diags.len();
            let flow = self.lower_stmts(&body.stmts, inner);
            self.frame().scopes.pop();
            if let Flow::Return(_, span) = flow {
                self.error(
                    "E0218",
                    "`return` inside a loop",
                    span,
                    "a function returns its last expression",
                );
            }
            // One iteration's errors are every iteration's errors: report them once.
            if self.diags[errors_before..].iter().any(Diagnostic::is_error) {
                break;
            }
        }
    }

    /// `output a, pred = expr, expr`: a name outputs its value under that name, `name =
    /// expr` under the name given, and a bare expression under a derived name (the called
    /// function's, `argmax`, else `output` and its position; `_2`, `_3`, … when taken).
    fn lower_output(&mut self, items: &'a [OutputItem]) {
        for (k, item) in items.iter().enumerate() {
            let (name, span, value) = match (&item.name, &item.value.kind) {
                (Some(n), _) => (n.name.clone(), n.span, self.eval(&item.value)),
                (None, ExprKind::Name(n)) => (
                    n.clone(),
                    item.value.span,
                    self.resolve_name(n, item.value.span),
                ),
                (None, kind) => {
                    let base = match kind {
                        ExprKind::Call { callee, .. } => callee.name.clone(),
                        _ => format!("output{}", k + 1),
                    };
                    let mut name = base.clone();
                    let mut i = 2;
                    while self.output_names.contains_key(&name)
                        || items.iter().any(|o| {
                            o.name.as_ref().map(|n| &n.name) == Some(&name)
                                || matches!(&o.value.kind, ExprKind::Name(n) if o.name.is_none() && *n == name)
                        })
                    {
                        name = format!("{base}_{i}");
                        i += 1;
                    }
                    (name, item.value.span, self.eval(&item.value))
                }
            };
            if let Some(prev) = self.output_names.get(&name) {
                let prev = *prev;
                self.diags.push(
                    Diagnostic::error("E0219", format!("`{name}` is output twice"))
                        .with_primary(span, "second output of this name")
                        .with_secondary(prev, "first output here"),
                );
                continue;
            }
            self.output_names.insert(name.clone(), span);
            match value {
                Value::Tensor(id) => self.graph.outputs.push((name, id)),
                Value::Poison => {}
                other => self.error(
                    "E0212",
                    "only tensors can be output",
                    span,
                    format!("`{name}` is {}", other.kind()),
                ),
            }
        }
    }

    fn lower_train(&mut self, opt: &'a Expr, loss: &'a Expr, span: Span) {
        if self.train_seen {
            self.error(
                "E0503",
                "a model has at most one `train`",
                span,
                "second `train` here",
            );
            return;
        }
        self.train_seen = true;
        let optimizer = self.optimizer(opt);
        let loss_v = self.eval(loss);
        let loss_id = match loss_v {
            Value::Tensor(id) => {
                let t = self.ty(id);
                if t != TensorType::scalar(DType::F32) {
                    let hint = if t.rank() != 0 {
                        "reduce it first, e.g. `mean(…)`"
                    } else {
                        "cast it: `cast(loss, f32)`"
                    };
                    self.error(
                        "E0501",
                        "the loss must be a scalar f32",
                        loss.span,
                        format!("this is {t}; {hint}"),
                    );
                    None
                } else {
                    Some(id)
                }
            }
            Value::Poison => None,
            other => {
                self.error(
                    "E0501",
                    "the loss must be a scalar f32 tensor",
                    loss.span,
                    format!("this is {}", other.kind()),
                );
                None
            }
        };
        if self.graph.params.is_empty() {
            self.error(
                "E0502",
                "nothing to train",
                span,
                "this model declares no `param`",
            );
            return;
        }
        if let (Some(optimizer), Some(loss)) = (optimizer, loss_id) {
            self.graph.train = Some(TrainSpec {
                optimizer,
                loss,
                span,
            });
        }
    }

    fn optimizer(&mut self, e: &'a Expr) -> Option<Optimizer> {
        let ExprKind::Call { callee, args } = &e.kind else {
            self.error(
                "E0220",
                "expected an optimizer",
                e.span,
                "expected `sgd(lr: …)`, `adam(lr: …)` or `adamw(lr: …)`",
            );
            return None;
        };
        let (names, defaults): (&[&str], &[(&str, f64)]) = match callee.name.as_str() {
            "sgd" => (
                &["lr", "momentum", "weight_decay"],
                &[("momentum", 0.0), ("weight_decay", 0.0)],
            ),
            "adam" => (
                &["lr", "beta1", "beta2", "eps"],
                &[("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8)],
            ),
            "adamw" => (
                &["lr", "beta1", "beta2", "eps", "weight_decay"],
                &[
                    ("beta1", 0.9),
                    ("beta2", 0.999),
                    ("eps", 1e-8),
                    ("weight_decay", 0.01),
                ],
            ),
            other => {
                let hint = suggest(other, ["sgd", "adam", "adamw"].into_iter())
                    .map(|s| format!("did you mean `{s}`?"))
                    .unwrap_or_else(|| "known optimizers: sgd, adam, adamw".into());
                self.error(
                    "E0220",
                    format!("unknown optimizer `{other}`"),
                    callee.span,
                    hint,
                );
                return None;
            }
        };
        let optional: Vec<&str> = defaults.iter().map(|(n, _)| *n).collect();
        let vals = self.bind_call_args(&callee.name, names, &optional, args, e.span)?;
        let mut nums = Vec::with_capacity(names.len());
        for (i, v) in vals.into_iter().enumerate() {
            let x = match v {
                None => defaults
                    .iter()
                    .find(|(n, _)| *n == names[i])
                    .map(|(_, d)| *d)
                    .unwrap_or(0.0),
                Some((v, span)) => match v.as_f64() {
                    Some(x) if x.is_finite() && x >= 0.0 => x,
                    Some(x) => {
                        self.error(
                            "E0220",
                            format!("invalid `{}`", names[i]),
                            span,
                            format!("{x:?} must be finite and >= 0"),
                        );
                        return None;
                    }
                    None => {
                        self.error(
                            "E0212",
                            format!("`{}` must be a compile-time number", names[i]),
                            span,
                            format!("this is {}", v.kind()),
                        );
                        return None;
                    }
                },
            };
            nums.push(x);
        }
        Some(match callee.name.as_str() {
            "sgd" => Optimizer::Sgd {
                lr: nums[0],
                momentum: nums[1],
                weight_decay: nums[2],
            },
            "adam" => Optimizer::Adam {
                lr: nums[0],
                beta1: nums[1],
                beta2: nums[2],
                eps: nums[3],
            },
            _ => Optimizer::AdamW {
                lr: nums[0],
                beta1: nums[1],
                beta2: nums[2],
                eps: nums[3],
                weight_decay: nums[4],
            },
        })
    }

    // ----------------------------------------------------------------- expressions

    /// Evaluates an expression; past [`MAX_EXPR_DEPTH`] nested levels it reports E0221 once
    /// and gives a poisoned value.
    pub fn eval(&mut self, e: &'a Expr) -> Value {
        if self.depth >= MAX_EXPR_DEPTH {
            if !self.too_deep {
                self.too_deep = true;
                self.error(
                    "E0221",
                    format!("expression nested more than {MAX_EXPR_DEPTH} levels deep"),
                    e.span,
                    "nesting reaches the limit here; split it with `let` bindings",
                );
            }
            return Value::Poison;
        }
        self.depth += 1;
        let v = self.eval_expr(e);
        self.depth -= 1;
        v
    }

    fn eval_expr(&mut self, e: &'a Expr) -> Value {
        match &e.kind {
            ExprKind::Int(v) => Value::Int(*v),
            ExprKind::Float(v) => Value::Float(*v),
            ExprKind::Inf => Value::Float(f64::INFINITY),
            ExprKind::Bool(b) => Value::Bool(*b),
            ExprKind::Str(s) => Value::Str(s.clone()),
            ExprKind::Error => Value::Poison,
            ExprKind::Name(n) => self.resolve_name(n, e.span),
            ExprKind::Unary(op, x) => {
                let v = self.eval(x);
                self.unary(*op, v, e.span)
            }
            ExprKind::Binary(op, a, b) => {
                let va = self.eval(a);
                let vb = self.eval(b);
                self.binary(*op, va, vb, e.span)
            }
            ExprKind::Call { callee, args } => self.call(callee, args, e.span),
            ExprKind::Index { base, items } => {
                let v = self.eval(base);
                self.index(v, items, e.span)
            }
            ExprKind::List(items) => Value::List(items.iter().map(|x| self.eval(x)).collect()),
            ExprKind::Tuple(items) => Value::Tuple(items.iter().map(|x| self.eval(x)).collect()),
            ExprKind::Checkpoint(block) => {
                let outer = self.checkpoint;
                if outer.is_none() {
                    self.checkpoint = Some(self.next_checkpoint);
                    self.next_checkpoint += 1;
                }
                let v = self.eval_block(block, "checkpoint block");
                self.checkpoint = outer;
                v
            }
            ExprKind::If {
                cond,
                then,
                otherwise,
            } => match self.eval(cond) {
                Value::Bool(true) => self.eval_block(then, "`if` branch"),
                Value::Bool(false) => self.eval_block(otherwise, "`else` branch"),
                Value::Poison => Value::Poison,
                other => {
                    let hint = if matches!(other, Value::Tensor(_)) {
                        "`if` chooses at compile time; use `where(cond, a, b)` for tensors"
                            .to_string()
                    } else {
                        format!("this is {}, expected a compile-time boolean", other.kind())
                    };
                    self.error(
                        "E0216",
                        "`if` condition must be a compile-time boolean",
                        cond.span,
                        hint,
                    );
                    Value::Poison
                }
            },
        }
    }

    fn eval_block(&mut self, block: &'a Block, what: &str) -> Value {
        let ctx = if self.frames.len() > 1 {
            StmtCtx::Function
        } else {
            StmtCtx::ModelNested
        };
        self.frame().scopes.push(BTreeMap::new());
        let flow = self.lower_stmts(&block.stmts, ctx);
        self.frame().scopes.pop();
        match flow {
            Flow::Value(v, _) => v,
            Flow::Return(_, span) => {
                self.error(
                    "E0218",
                    format!("`return` inside a {what}"),
                    span,
                    "the block's last expression is its value",
                );
                Value::Poison
            }
            Flow::None => {
                self.error(
                    "E0218",
                    format!("{what} has no value"),
                    block.span,
                    "end it with an expression",
                );
                Value::Poison
            }
        }
    }

    fn unary(&mut self, op: UnOp, v: Value, span: Span) -> Value {
        match (op, v) {
            (_, Value::Poison) => Value::Poison,
            (UnOp::Neg, Value::Tensor(id)) => {
                self.add(Op::Unary(crate::ir::UnaryOp::Neg), vec![id], span)
            }
            (UnOp::Not, Value::Tensor(id)) => {
                self.add(Op::Unary(crate::ir::UnaryOp::Not), vec![id], span)
            }
            (UnOp::Not, Value::Bool(b)) => Value::Bool(!b),
            (UnOp::Neg, v) => match fold_unary("neg", &v) {
                Ok(r) => r,
                Err(m) => {
                    self.error("E0212", "cannot negate this value", span, m);
                    Value::Poison
                }
            },
            (UnOp::Not, v) => {
                self.error(
                    "E0212",
                    "`!` needs a boolean",
                    span,
                    format!("found {}", v.kind()),
                );
                Value::Poison
            }
        }
    }

    pub fn binary(&mut self, op: BinOp, a: Value, b: Value, span: Span) -> Value {
        if matches!(a, Value::Poison) || matches!(b, Value::Poison) {
            return Value::Poison;
        }
        let ir_op = match op {
            BinOp::Add => crate::ir::BinaryOp::Add,
            BinOp::Sub => crate::ir::BinaryOp::Sub,
            BinOp::Mul => crate::ir::BinaryOp::Mul,
            BinOp::Div => crate::ir::BinaryOp::Div,
            BinOp::Rem => crate::ir::BinaryOp::Rem,
            BinOp::Eq => crate::ir::BinaryOp::Eq,
            BinOp::Ne => crate::ir::BinaryOp::Ne,
            BinOp::Lt => crate::ir::BinaryOp::Lt,
            BinOp::Le => crate::ir::BinaryOp::Le,
            BinOp::Gt => crate::ir::BinaryOp::Gt,
            BinOp::Ge => crate::ir::BinaryOp::Ge,
            BinOp::And => crate::ir::BinaryOp::And,
            BinOp::Or => crate::ir::BinaryOp::Or,
            BinOp::MatMul => {
                return match (a, b) {
                    (Value::Tensor(x), Value::Tensor(y)) => self.add(Op::MatMul, vec![x, y], span),
                    (x, y) => {
                        let found = if matches!(x, Value::Tensor(_)) {
                            y.kind()
                        } else {
                            x.kind()
                        };
                        self.error(
                            "E0212",
                            "`@` needs two tensors",
                            span,
                            format!("found {found}; use `*` to scale"),
                        );
                        Value::Poison
                    }
                };
            }
        };
        self.elementwise2(ir_op, op.symbol(), a, b, span)
    }

    /// An elementwise binary op on any mix of tensors and compile-time scalars.
    pub fn elementwise2(
        &mut self,
        op: crate::ir::BinaryOp,
        what: &str,
        a: Value,
        b: Value,
        span: Span,
    ) -> Value {
        match (&a, &b) {
            (Value::Poison, _) | (_, Value::Poison) => Value::Poison,
            (Value::Tensor(x), Value::Tensor(y)) => self.add(Op::Binary(op), vec![*x, *y], span),
            (Value::Tensor(x), s) | (s, Value::Tensor(x)) if s.is_scalar() => {
                let dtype = self.ty(*x).dtype;
                let Some(lit) = self.literal(s, dtype, span) else {
                    return Value::Poison;
                };
                let (l, r) = if matches!(a, Value::Tensor(_)) {
                    (*x, lit)
                } else {
                    (lit, *x)
                };
                self.add(Op::Binary(op), vec![l, r], span)
            }
            (x, y) if x.is_scalar() && y.is_scalar() => {
                let folded = fold_binary(op, what, x, y);
                match folded {
                    Ok(v) => v,
                    Err(m) => {
                        self.error(
                            "E0212",
                            format!("cannot evaluate `{what}` at compile time"),
                            span,
                            m,
                        );
                        Value::Poison
                    }
                }
            }
            _ => {
                let bad = if a.is_scalar() || matches!(a, Value::Tensor(_)) {
                    &b
                } else {
                    &a
                };
                self.error(
                    "E0212",
                    format!("`{what}` is not defined for {}", bad.kind()),
                    span,
                    format!("found {} and {}", a.kind(), b.kind()),
                );
                Value::Poison
            }
        }
    }

    /// A scalar literal node of `dtype` ("literals adopt the other operand's dtype").
    pub fn literal(&mut self, s: &Value, dtype: DType, span: Span) -> Option<NodeId> {
        let value = match (s, dtype) {
            (Value::Bool(b), DType::Bool) => Scalar::Bool(*b),
            (Value::Int(v), DType::I32) if i32::try_from(*v).is_ok() => Scalar::Int(*v),
            (Value::Float(v), DType::I32) if v.fract() == 0.0 && v.abs() < 2.0f64.powi(31) => {
                Scalar::Int(*v as i64)
            }
            (Value::Int(v), d) if d.is_float() => Scalar::Float(*v as f64),
            (Value::Float(v), d) if d.is_float() => Scalar::Float(*v),
            _ => {
                let shown = match s {
                    Value::Int(v) => v.to_string(),
                    Value::Float(v) => format!("{v:?}"),
                    Value::Bool(b) => b.to_string(),
                    other => other.kind().to_string(),
                };
                self.error(
                    "E0403",
                    format!("literal does not fit {dtype}"),
                    span,
                    format!("`{shown}` is not representable as {dtype}"),
                );
                return None;
            }
        };
        match self.add(Op::Literal { value, dtype }, vec![], span) {
            Value::Tensor(id) => Some(id),
            _ => None,
        }
    }

    fn index(&mut self, v: Value, items: &'a [IndexItem], span: Span) -> Value {
        let id = match v {
            Value::Tensor(id) => id,
            Value::Poison => return Value::Poison,
            Value::List(vs) | Value::Tuple(vs) => {
                // Indexing a compile-time list/tuple (e.g. the result of `split`).
                if let [IndexItem::Index(e)] = items {
                    return match self.eval(e) {
                        Value::Int(i) => {
                            let n = vs.len() as i64;
                            let j = if i < 0 { i + n } else { i };
                            if (0..n).contains(&j) {
                                vs[j as usize].clone()
                            } else {
                                self.error(
                                    "E0308",
                                    "index out of range",
                                    e.span,
                                    format!("index {i} into {n} values"),
                                );
                                Value::Poison
                            }
                        }
                        Value::Poison => Value::Poison,
                        other => {
                            self.error(
                                "E0216",
                                "index must be a compile-time integer",
                                e.span,
                                format!("this is {}", other.kind()),
                            );
                            Value::Poison
                        }
                    };
                }
                self.error(
                    "E0308",
                    "lists take one integer index",
                    span,
                    "write `list[i]`",
                );
                return Value::Poison;
            }
            other => {
                self.error(
                    "E0212",
                    format!("cannot index {}", other.kind()),
                    span,
                    "only tensors and tuples can be indexed",
                );
                return Value::Poison;
            }
        };
        let t = self.ty(id);
        let rank = t.rank();
        let ellipses = items
            .iter()
            .filter(|i| matches!(i, IndexItem::Ellipsis(_)))
            .count();
        if ellipses > 1 {
            self.error(
                "E0308",
                "more than one `..` in an index",
                span,
                "`..` may appear once",
            );
            return Value::Poison;
        }
        let explicit = items.len() - ellipses;
        if explicit > rank {
            self.error(
                "E0308",
                "too many indices",
                span,
                format!("{explicit} indices for {t}"),
            );
            return Value::Poison;
        }
        // Expand `..` (and trailing omitted axes) to full slices.
        let mut per_axis: Vec<Option<&'a IndexItem>> = Vec::with_capacity(rank);
        for it in items {
            if let IndexItem::Ellipsis(_) = it {
                for _ in 0..(rank - explicit) {
                    per_axis.push(None);
                }
            } else {
                per_axis.push(Some(it));
            }
        }
        while per_axis.len() < rank {
            per_axis.push(None);
        }
        let mut ranges = Vec::with_capacity(rank);
        let mut selects = Vec::new();
        for (axis, item) in per_axis.iter().enumerate() {
            let d = t.dims()[axis];
            match item {
                None | Some(IndexItem::Ellipsis(_)) => ranges.push((0, d)),
                Some(IndexItem::Index(e)) => {
                    let Some(i) = self.index_bound(e, d, false) else {
                        return Value::Poison;
                    };
                    ranges.push((0, d));
                    selects.push((axis, i));
                }
                Some(IndexItem::Slice { lo, hi, span: s }) => {
                    let lo_v = match lo {
                        Some(e) => match self.index_bound(e, d, true) {
                            Some(v) => v,
                            None => return Value::Poison,
                        },
                        None => 0,
                    };
                    let hi_v = match hi {
                        Some(e) => match self.index_bound(e, d, true) {
                            Some(v) => v,
                            None => return Value::Poison,
                        },
                        None => d,
                    };
                    if lo_v >= hi_v {
                        self.error(
                            "E0308",
                            "empty slice",
                            *s,
                            format!("{lo_v}:{hi_v} on axis {axis} of {t} selects nothing"),
                        );
                        return Value::Poison;
                    }
                    ranges.push((lo_v, hi_v));
                }
            }
        }
        let mut cur = Value::Tensor(id);
        if ranges
            .iter()
            .zip(t.dims())
            .any(|(&(s, e), &d)| s != 0 || e != d)
        {
            cur = match cur {
                Value::Tensor(x) => self.add(Op::Slice { ranges }, vec![x], span),
                v => v,
            };
        }
        for &(axis, i) in selects.iter().rev() {
            cur = match cur {
                Value::Tensor(x) => self.add(Op::Select { axis, index: i }, vec![x], span),
                v => v,
            };
        }
        cur
    }

    /// A compile-time index into an axis of size `d` (negative counts from the end).
    /// Slice bounds may equal `d`; element indices may not.
    fn index_bound(&mut self, e: &'a Expr, d: usize, is_bound: bool) -> Option<usize> {
        match self.eval(e) {
            Value::Int(i) => {
                let j = if i < 0 { i + d as i64 } else { i };
                let max = if is_bound { d as i64 } else { d as i64 - 1 };
                if j < 0 || j > max {
                    self.error(
                        "E0308",
                        "index out of range",
                        e.span,
                        format!("{i} on an axis of size {d}"),
                    );
                    None
                } else {
                    Some(j as usize)
                }
            }
            Value::Poison => None,
            Value::Tensor(_) => {
                self.error(
                    "E0216",
                    "index must be a compile-time integer",
                    e.span,
                    "this is a tensor; use `embedding(table, ids)` to gather rows",
                );
                None
            }
            other => {
                self.error(
                    "E0216",
                    "index must be a compile-time integer",
                    e.span,
                    format!("this is {}", other.kind()),
                );
                None
            }
        }
    }

    // ----------------------------------------------------------------- calls

    fn call(&mut self, callee: &'a Ident, args: &'a [Arg], span: Span) -> Value {
        if let Some(info) = self.prog.fns.get(callee.name.as_str()).copied() {
            return self.inline_fn(info, args, span);
        }
        if builtins::is_builtin(&callee.name) {
            return builtins::lower_builtin(self, callee, args, span);
        }
        let mut candidates: Vec<String> = self.prog.fns.keys().cloned().collect();
        candidates.extend(builtins::names().map(str::to_string));
        let hint = match suggest(&callee.name, candidates.iter().map(String::as_str)) {
            Some(s) => format!("no function of this name; did you mean `{s}`?"),
            None => "no function of this name".to_string(),
        };
        self.error(
            "E0202",
            format!("unknown function `{}`", callee.name),
            callee.span,
            hint,
        );
        for a in args {
            let _ = self.eval(&a.value);
        }
        Value::Poison
    }

    /// Evaluates call arguments and matches them to parameter names. Returns, per parameter,
    /// the value and its span (`None` for an omitted optional one), or `None` after
    /// reporting an error.
    pub fn bind_call_args(
        &mut self,
        fname: &str,
        params: &[&str],
        optional: &[&str],
        args: &'a [Arg],
        span: Span,
    ) -> Option<Vec<Option<(Value, Span)>>> {
        let mut out: Vec<Option<(Value, Span)>> = vec![None; params.len()];
        let mut ok = true;
        let mut seen_named = false;
        let mut positional = 0usize;
        let given = args.iter().filter(|a| a.name.is_none()).count();
        for a in args {
            let v = self.eval(&a.value);
            if matches!(v, Value::Poison) {
                ok = false;
            }
            match &a.name {
                None => {
                    if seen_named {
                        self.error(
                            "E0208",
                            "positional argument after a named one",
                            a.value.span,
                            "move it before the named arguments",
                        );
                        ok = false;
                        continue;
                    }
                    if positional >= params.len() {
                        let n = params.len();
                        self.error(
                            "E0203",
                            format!(
                                "`{fname}` takes {n} positional argument{} but {given} were given",
                                if n == 1 { "" } else { "s" }
                            ),
                            a.value.span,
                            "unexpected argument",
                        );
                        ok = false;
                        positional += 1;
                        continue;
                    }
                    out[positional] = Some((v, a.value.span));
                    positional += 1;
                }
                Some(name) => {
                    seen_named = true;
                    match params.iter().position(|p| *p == name.name) {
                        Some(i) if out[i].is_some() => {
                            self.error(
                                "E0207",
                                format!("argument `{}` given twice", name.name),
                                name.span,
                                "already given",
                            );
                            ok = false;
                        }
                        Some(i) => out[i] = Some((v, a.value.span)),
                        None => {
                            let list = params
                                .iter()
                                .map(|p| format!("`{p}`"))
                                .collect::<Vec<_>>()
                                .join(", ");
                            let hint = match suggest(&name.name, params.iter().copied()) {
                                Some(s) => format!("did you mean `{s}`? `{fname}` takes {list}"),
                                None if params.is_empty() => {
                                    format!("`{fname}` takes no arguments")
                                }
                                None => format!("`{fname}` takes {list}"),
                            };
                            self.error(
                                "E0204",
                                format!("`{fname}` has no argument `{}`", name.name),
                                name.span,
                                hint,
                            );
                            ok = false;
                        }
                    }
                }
            }
        }
        if ok {
            let missing: Vec<&str> = params
                .iter()
                .zip(&out)
                .filter(|(p, v)| v.is_none() && !optional.contains(p))
                .map(|(p, _)| *p)
                .collect();
            if !missing.is_empty() {
                let list = missing
                    .iter()
                    .map(|p| format!("`{p}`"))
                    .collect::<Vec<_>>()
                    .join(", ");
                self.error(
                    "E0206",
                    format!(
                        "missing argument{} {list} in call to `{fname}`",
                        if missing.len() > 1 { "s" } else { "" }
                    ),
                    span,
                    format!("`{fname}` needs {list}"),
                );
                ok = false;
            }
        }
        ok.then_some(out)
    }

    fn inline_fn(&mut self, info: FnInfo<'a>, args: &'a [Arg], span: Span) -> Value {
        let f = info.decl;
        let recursive = self
            .frames
            .iter()
            .any(|fr| fr.call.as_ref().is_some_and(|(n, _)| *n == f.name.name));
        if recursive || self.frames.len() > MAX_CALL_DEPTH {
            self.error(
                "E0210",
                format!("recursive call to `{}`", f.name.name),
                span,
                "functions are inlined, so they cannot call themselves",
            );
            return Value::Poison;
        }
        let names: Vec<&str> = f.params.iter().map(|p| p.name.name.as_str()).collect();
        let optional: Vec<&str> = f
            .params
            .iter()
            .filter(|p| p.default.is_some())
            .map(|p| p.name.name.as_str())
            .collect();
        let Some(vals) = self.bind_call_args(&f.name.name, &names, &optional, args, span) else {
            return Value::Poison;
        };
        // Enter the function's frame.
        let outer_anchor = self.anchor;
        if info.prelude && self.anchor.is_none() {
            self.anchor = Some(span);
        }
        let outer_block = self.block;
        if !info.prelude && self.block.is_none() {
            self.block = Some(self.next_block);
            self.next_block += 1;
        }
        self.frames
            .push(Frame::new(!info.prelude, Some((f.name.name.clone(), span))));
        let ok = self.bind_fn_params(f, vals, span);
        let result = if ok {
            match self.lower_stmts(&f.body.stmts, StmtCtx::Function) {
                Flow::Value(v, s) | Flow::Return(v, s) => self.check_return(f, v, s),
                Flow::None => {
                    self.error(
                        "E0218",
                        format!("function `{}` has no result", f.name.name),
                        f.body.span,
                        "end the body with an expression",
                    );
                    Value::Poison
                }
            }
        } else {
            Value::Poison
        };
        self.frames.pop();
        self.anchor = outer_anchor;
        self.block = outer_block;
        result
    }

    /// Binds a function's parameters: dtype variables, shape variables, scalar params with
    /// defaults. Reports mismatches at the argument with both types shown.
    fn bind_fn_params(
        &mut self,
        f: &'a FnDecl,
        vals: Vec<Option<(Value, Span)>>,
        call_span: Span,
    ) -> bool {
        let mut ok = true;
        let mut deferred: Vec<(&'a Expr, usize, Span, &'a FnParam, TensorType)> = Vec::new();
        for (p, v) in f.params.iter().zip(vals) {
            let (v, vspan) = match v {
                Some(x) => x,
                None => match &p.default {
                    Some(d) => (self.eval(d), call_span),
                    None => (Value::Poison, call_span),
                },
            };
            if matches!(v, Value::Poison) {
                ok = false;
                self.bind(&p.name, Value::Poison, BindKind::FnParam);
                continue;
            }
            let scalar_kind = p.ty.dims.is_none().then_some(p.ty.dtype.name.as_str());
            match scalar_kind {
                Some(kind @ ("int" | "float" | "bool")) => {
                    let fits = matches!(
                        (kind, &v),
                        ("int", Value::Int(_))
                            | ("float", Value::Int(_) | Value::Float(_))
                            | ("bool", Value::Bool(_))
                    );
                    if !fits {
                        self.error(
                            "E0311",
                            format!(
                                "argument `{}` of `{}` has the wrong kind",
                                p.name.name, f.name.name
                            ),
                            vspan,
                            format!("expected a compile-time {kind}, found {}", v.kind()),
                        );
                        ok = false;
                    }
                    self.bind(&p.name, v, BindKind::FnParam);
                }
                Some(other) => {
                    self.error(
                        "E0213",
                        format!("unknown parameter type `{other}`"),
                        p.ty.span,
                        "expected a tensor type `DTYPE[dims]`, or `int`, `float`, `bool`",
                    );
                    ok = false;
                }
                None => {
                    // A tensor parameter. A compile-time scalar argument becomes a literal
                    // when the dtype is known.
                    let v = match v {
                        s if s.is_scalar() => match DType::from_name(&p.ty.dtype.name) {
                            Some(dt) => match self.literal(&s, dt, vspan) {
                                Some(id) => Value::Tensor(id),
                                None => Value::Poison,
                            },
                            None => {
                                self.error(
                                    "E0311",
                                    format!(
                                        "argument `{}` of `{}` must be a tensor",
                                        p.name.name, f.name.name
                                    ),
                                    vspan,
                                    format!("found {}", s.kind()),
                                );
                                Value::Poison
                            }
                        },
                        other => other,
                    };
                    let Value::Tensor(id) = v else {
                        if !matches!(v, Value::Poison) {
                            self.error(
                                "E0311",
                                format!(
                                    "argument `{}` of `{}` must be a tensor",
                                    p.name.name, f.name.name
                                ),
                                vspan,
                                format!("found {}", v.kind()),
                            );
                        }
                        ok = false;
                        self.bind(&p.name, Value::Poison, BindKind::FnParam);
                        continue;
                    };
                    let t = self.ty(id);
                    if !self.match_type(f, p, &t, vspan, &mut deferred) {
                        ok = false;
                    }
                    self.bind(&p.name, Value::Tensor(id), BindKind::FnParam);
                }
            }
        }
        // Compound dimensions (`D / H`, `2 * N`) once every plain variable is bound.
        for (e, actual, vspan, p, t) in deferred {
            match self.eval(e) {
                Value::Int(n) if n >= 0 && n as usize == actual => {}
                Value::Int(_) => {
                    self.param_mismatch(f, p, &t, vspan);
                    ok = false;
                }
                Value::Poison => ok = false,
                other => {
                    self.error(
                        "E0316",
                        "dimension must be a compile-time integer",
                        e.span,
                        format!("this is {}", other.kind()),
                    );
                    ok = false;
                }
            }
        }
        ok
    }

    fn param_mismatch(&mut self, f: &FnDecl, p: &FnParam, t: &TensorType, vspan: Span) {
        let declared = self.describe_type(&p.ty);
        let d = Diagnostic::error(
            "E0311",
            format!(
                "argument `{}` of `{}` does not match its declared type",
                p.name.name, f.name.name
            ),
        );
        let primary = match self.anchor {
            Some(a) if vspan.file == self.prelude_file => a,
            _ => vspan,
        };
        let mut d = d
            .with_primary(
                primary,
                format!("this is {t}, but `{}` is declared {declared}", p.name.name),
            )
            .with_secondary(p.ty.span, "declared here");
        let bound = self.bound_vars_note();
        if !bound.is_empty() {
            d = d.with_note(bound);
        }
        self.diags.push(d);
    }

    fn bound_vars_note(&self) -> String {
        let Some(f) = self.frames.last() else {
            return String::new();
        };
        let mut parts: Vec<String> = f
            .dtype_vars
            .iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect();
        if let Some(scope) = f.scopes.first() {
            parts.extend(
                scope
                    .iter()
                    .filter(|(_, b)| b.kind == BindKind::ShapeVar)
                    .map(|(k, b)| match &b.value {
                        Value::Int(n) => format!("{k} = {n}"),
                        _ => format!("{k} = ?"),
                    }),
            );
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("in this call: {}", parts.join(", "))
        }
    }

    fn describe_type(&self, ty: &TypeExpr) -> String {
        let text = self.source_text(ty.span);
        text.unwrap_or_else(|| ty.dtype.name.clone())
    }

    fn source_text(&self, span: Span) -> Option<String> {
        self.source_texts.as_ref().and_then(|f| f(span))
    }

    /// Matches an argument's type against a parameter type, binding variables.
    fn match_type(
        &mut self,
        f: &'a FnDecl,
        p: &'a FnParam,
        t: &TensorType,
        vspan: Span,
        deferred: &mut Vec<(&'a Expr, usize, Span, &'a FnParam, TensorType)>,
    ) -> bool {
        let dname = &p.ty.dtype.name;
        match DType::from_name(dname) {
            Some(dt) if dt != t.dtype => {
                self.param_mismatch(f, p, t, vspan);
                return false;
            }
            Some(_) => {}
            None => {
                let bound = self
                    .frames
                    .last()
                    .and_then(|fr| fr.dtype_vars.get(dname))
                    .copied();
                match bound {
                    Some(dt) if dt != t.dtype => {
                        self.param_mismatch(f, p, t, vspan);
                        return false;
                    }
                    Some(_) => {}
                    None => {
                        self.frame().dtype_vars.insert(dname.clone(), t.dtype);
                    }
                }
            }
        }
        let Some(dims) = &p.ty.dims else {
            return true;
        };
        let Some(pairs) = dim_pairs(dims, t.dims()) else {
            self.param_mismatch(f, p, t, vspan);
            return false;
        };
        let mut ok = true;
        for (e, actual) in pairs {
            if let ExprKind::Name(n) = &e.kind {
                let known = self.lookup(n).is_some()
                    || (self.frames.last().is_some_and(|fr| fr.sees_consts)
                        && self.prog.consts.contains_key(n.as_str()));
                if !known {
                    let id = Ident {
                        name: n.clone(),
                        span: e.span,
                    };
                    self.bind(&id, Value::Int(actual as i64), BindKind::ShapeVar);
                    continue;
                }
                if let Some(Value::Int(v)) = self.lookup(n).map(|b| b.value.clone()) {
                    if v as usize != actual {
                        self.param_mismatch(f, p, t, vspan);
                        ok = false;
                        break;
                    }
                    continue;
                }
            }
            deferred.push((e, actual, vspan, p, t.clone()));
        }
        ok
    }

    fn check_return(&mut self, f: &'a FnDecl, v: Value, vspan: Span) -> Value {
        let id = match &v {
            Value::Tensor(id) => *id,
            Value::Poison => return v,
            Value::Tuple(_) => return v,
            other if f.ret.dims.is_none() => {
                let kind = f.ret.dtype.name.as_str();
                let fits = matches!(
                    (kind, other),
                    ("int", Value::Int(_))
                        | ("float", Value::Int(_) | Value::Float(_))
                        | ("bool", Value::Bool(_))
                );
                if !fits {
                    self.error(
                        "E0312",
                        format!("`{}` returns the wrong kind of value", f.name.name),
                        vspan,
                        format!("declared `{kind}`, found {}", other.kind()),
                    );
                    return Value::Poison;
                }
                return v;
            }
            other => {
                self.error(
                    "E0312",
                    format!("`{}` must return a tensor", f.name.name),
                    vspan,
                    format!("found {}", other.kind()),
                );
                return Value::Poison;
            }
        };
        let t = self.ty(id);
        let expected = self.expected_return(f, &t);
        match expected {
            Ok(()) => v,
            Err(why) => {
                let declared = self.describe_type(&f.ret);
                let primary = match self.anchor {
                    Some(a) if vspan.file == self.prelude_file => a,
                    _ => vspan,
                };
                let mut d = Diagnostic::error(
                    "E0312",
                    format!(
                        "`{}` returns a value that does not match its declared type",
                        f.name.name
                    ),
                )
                .with_primary(primary, format!("this is {t}, declared {declared}{why}"))
                .with_secondary(f.ret.span, "declared here");
                let note = self.bound_vars_note();
                if !note.is_empty() {
                    d = d.with_note(note);
                }
                self.diags.push(d);
                Value::Poison
            }
        }
    }

    fn expected_return(&mut self, f: &'a FnDecl, t: &TensorType) -> Result<(), String> {
        let dname = &f.ret.dtype.name;
        let dt = DType::from_name(dname).or_else(|| {
            self.frames
                .last()
                .and_then(|fr| fr.dtype_vars.get(dname))
                .copied()
        });
        if let Some(dt) = dt {
            if dt != t.dtype {
                return Err(format!(" (dtype {dt} expected)"));
            }
        }
        let Some(dims) = &f.ret.dims else {
            return Err(" (a tensor type needs `[…]`)".into());
        };
        let Some(pairs) = dim_pairs(dims, t.dims()) else {
            let fixed = dims
                .iter()
                .filter(|d| matches!(d, DimExpr::Expr(_)))
                .count();
            return Err(format!(" (rank {fixed} expected)"));
        };
        for (e, actual) in pairs {
            match self.eval(e) {
                Value::Int(n) if n >= 0 && n as usize == actual => {}
                Value::Int(n) => return Err(format!(" (dimension {n} expected, found {actual})")),
                _ => return Err(String::new()),
            }
        }
        Ok(())
    }
}

impl<'a, 'd> Lowerer<'a, 'd> {
    /// Installs a way to read source text (for quoting declared types in messages).
    pub fn with_source_texts(mut self, f: SourceTexts<'a>) -> Self {
        self.source_texts = Some(f);
        self
    }
}

/// Pairs each dimension expression of a declared type with the actual dimension it
/// describes; `..` (at most once) absorbs any number of leading or middle dims. `None` when
/// the ranks cannot match.
fn dim_pairs<'e>(dims: &'e [DimExpr], actual: &[usize]) -> Option<Vec<(&'e Expr, usize)>> {
    let rests = dims
        .iter()
        .filter(|d| matches!(d, DimExpr::Rest(_)))
        .count();
    let fixed = dims.len() - rests;
    if rests > 1 || (rests == 0 && actual.len() != fixed) || actual.len() < fixed {
        return None;
    }
    let split = dims
        .iter()
        .position(|d| matches!(d, DimExpr::Rest(_)))
        .unwrap_or(dims.len());
    let tail_off = actual.len() - dims.len().saturating_sub(split + 1);
    let mut pairs = Vec::with_capacity(fixed);
    for (i, d) in dims.iter().enumerate() {
        if let DimExpr::Expr(e) = d {
            let at = if i < split {
                i
            } else {
                tail_off + (i - split - 1)
            };
            pairs.push((e, actual[at]));
        }
    }
    Some(pairs)
}

/// Reads the source text of a span.
pub type SourceTexts<'a> = Box<dyn Fn(Span) -> Option<String> + 'a>;

/// The closest candidate to `name` by edit distance, if close enough to be a likely typo.
pub fn suggest<'s>(name: &str, candidates: impl Iterator<Item = &'s str>) -> Option<String> {
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        if c == name {
            continue;
        }
        let d = strsim::osa_distance(name, c);
        let limit = (name.len().max(c.len()) / 3).max(1);
        if d <= limit && best.is_none_or(|(bd, bc)| d < bd || (d == bd && c < bc)) {
            best = Some((d, c));
        }
    }
    best.map(|(_, c)| c.to_string())
}

/// Turns shape values into a [`Shape`] (for builtins that take `[dims]`).
pub fn shape_of(v: &[Value]) -> Option<Shape> {
    v.iter()
        .map(|x| match x {
            Value::Int(n) if *n > 0 => Some(*n as usize),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .map(Shape)
}
