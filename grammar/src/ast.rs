//! The TDSL abstract syntax tree. Every node carries the [`Span`] it was parsed from.

use crate::span::Span;

/// A name as written, with where.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// A whole file.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Program {
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Const(ConstDecl),
    Fn(FnDecl),
    Model(ModelDecl),
}

impl Item {
    pub fn name(&self) -> &Ident {
        match self {
            Item::Const(c) => &c.name,
            Item::Fn(f) => &f.name,
            Item::Model(m) => &m.name,
        }
    }
}

/// `const NAME = expr`
#[derive(Clone, Debug, PartialEq)]
pub struct ConstDecl {
    pub name: Ident,
    pub value: Expr,
    pub span: Span,
}

/// `fn name(params) -> TYPE { body }`
#[derive(Clone, Debug, PartialEq)]
pub struct FnDecl {
    pub name: Ident,
    pub params: Vec<FnParam>,
    pub ret: TypeExpr,
    pub body: Block,
    pub span: Span,
}

/// One function parameter: `x: f32[N, D]`, or a compile-time scalar `axis: int = -1`.
#[derive(Clone, Debug, PartialEq)]
pub struct FnParam {
    pub name: Ident,
    pub ty: TypeExpr,
    pub default: Option<Expr>,
    pub span: Span,
}

/// `DTYPE[d0, d1, …]`, or a bare name (`int`, `float`, `bool` for compile-time scalars).
#[derive(Clone, Debug, PartialEq)]
pub struct TypeExpr {
    pub dtype: Ident,
    /// `None` for a bare name with no brackets.
    pub dims: Option<Vec<DimExpr>>,
    pub span: Span,
}

/// One dimension in a type: an integer expression, or `..` for any number of leading dims.
#[derive(Clone, Debug, PartialEq)]
pub enum DimExpr {
    Expr(Expr),
    Rest(Span),
}

/// `model name { stmts }`
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDecl {
    pub name: Ident,
    pub body: Block,
    pub span: Span,
}

/// `{ stmt; stmt; … }`
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub stmts: Vec<Stmt>,
    pub span: Span,
}

/// One item of `output`: a name (`output loss`), a named expression (`output pred =
/// argmax(h, axis: -1)`) or an expression whose name the compiler derives.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputItem {
    pub name: Option<Ident>,
    pub value: Expr,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Stmt {
    pub kind: StmtKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum StmtKind {
    /// `input NAME: TYPE`
    Input { name: Ident, ty: TypeExpr },
    /// `param NAME: TYPE [= INIT]`
    Param {
        name: Ident,
        ty: TypeExpr,
        init: Option<Expr>,
    },
    /// `let PATTERN = expr`
    Let { pat: Pattern, value: Expr },
    /// `NAME = expr`
    Assign { name: Ident, value: Expr },
    /// `for VAR in LO..HI { body }`
    For {
        var: Ident,
        lo: Expr,
        hi: Expr,
        body: Block,
    },
    /// `output a, b, name = expr, expr, …`
    Output { items: Vec<OutputItem> },
    /// `train OPT minimize LOSS`
    Train { optimizer: Expr, loss: Expr },
    /// `return expr`
    Return(Expr),
    /// A bare expression (a block's value when last).
    Expr(Expr),
    /// A statement that failed to parse; the error is already reported.
    Error,
}

/// The left side of `let`.
#[derive(Clone, Debug, PartialEq)]
pub enum Pattern {
    Name(Ident),
    Tuple(Vec<Pattern>, Span),
}

impl Pattern {
    pub fn span(&self) -> Span {
        match self {
            Pattern::Name(i) => i.span,
            Pattern::Tuple(_, s) => *s,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Neg,
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    MatMul,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Or => "||",
            BinOp::And => "&&",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::MatMul => "@",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Inf,
    Bool(bool),
    Str(String),
    Name(String),
    Unary(UnOp, Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    Call {
        callee: Ident,
        args: Vec<Arg>,
    },
    Index {
        base: Box<Expr>,
        items: Vec<IndexItem>,
    },
    List(Vec<Expr>),
    Tuple(Vec<Expr>),
    Checkpoint(Block),
    If {
        cond: Box<Expr>,
        then: Block,
        otherwise: Block,
    },
    /// An expression that failed to parse; the error is already reported.
    Error,
}

/// A call argument, positional or `name: value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    pub name: Option<Ident>,
    pub value: Expr,
}

/// One item inside `x[ … ]`.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexItem {
    /// `i`: selects along the axis and drops it.
    Index(Expr),
    /// `lo:hi`, either bound optional.
    Slice {
        lo: Option<Expr>,
        hi: Option<Expr>,
        span: Span,
    },
    /// `..`: as many full slices as needed.
    Ellipsis(Span),
}
