//! The canonical text form of kernels (what snapshots and `--emit kernels` show).
//!
//! ```text
//! kernel k0 [256, 1024] parallel  ; matmul %5, add %6, relu %7
//!   matmul batch=[] m=256 n=1024 k=784 a=%2[0 + i*784 + k*1] b=%3[0 + k*1024 + j*1]
//!   e0 = acc
//!   ...
//!   store %7[e4] = e9
//! ```
//! Buffers are named by their owning node (`%7`, the graph printer's numbering of the
//! same graph); `@offset` follows when a plan is given.

use super::lower::reachable;
use super::offsets::Offsets;
use super::{ExprId, Kernel, Operand, E};
use crate::ir::NodeId;
use std::collections::HashMap;
use std::fmt::Write;

/// Prints kernels; `offsets` adds arena offsets to buffer names when given.
pub fn print_kernels(kernels: &[Kernel], offsets: Option<&Offsets>) -> String {
    let mut out = String::new();
    for k in kernels {
        print_kernel(&mut out, k, offsets);
    }
    out
}

fn buf_name(n: NodeId, offsets: Option<&Offsets>) -> String {
    match offsets.and_then(|o| o.get(n)) {
        Some(o) => format!("%{}@{}", n.index(), o),
        None => format!("%{}", n.index()),
    }
}

fn operand(
    o: &Operand,
    rows: &str,
    cols: &str,
    offsets: Option<&Offsets>,
    name: &dyn Fn(&ExprId) -> String,
) -> String {
    if let Some(g) = &o.gather {
        return format!(
            "gather({}: {rows}=v{}, {cols}=v{}{})",
            name(&g.value),
            g.row,
            g.col,
            if g.k_fast { ", k fastest" } else { "" }
        );
    }
    let mut s = format!("{}:{}[{}", buf_name(o.buf, offsets), o.dtype, o.base);
    for (i, st) in o.batch_strides.iter().enumerate() {
        if *st != 0 {
            let _ = write!(s, " + b{i}*{st}");
        }
    }
    let _ = write!(s, " + {rows}*{} + {cols}*{}]", o.rs, o.cs);
    s
}

fn print_kernel(out: &mut String, k: &Kernel, offsets: Option<&Offsets>) {
    let _ = writeln!(
        out,
        "kernel {} {:?}{}  ; {}",
        k.name,
        k.domain,
        if k.parallel { " parallel" } else { "" },
        k.describe
    );
    // Gathered matmul operands first, then the stores.
    let mut roots: Vec<ExprId> = k
        .matmul
        .iter()
        .flat_map(|mm| [&mm.a, &mm.b])
        .filter_map(|o| o.gather.as_ref().map(|g| g.value))
        .collect();
    roots.extend(k.stores.iter().flat_map(|s| [s.index, s.value]));
    let live = reachable(&k.pool, &roots);
    let mut name: HashMap<ExprId, String> = HashMap::new();
    for (i, &e) in live.iter().enumerate() {
        name.insert(e, format!("e{i}"));
    }
    let n = |x: &ExprId| name.get(x).cloned().unwrap_or_else(|| "?".into());
    if let Some(mm) = &k.matmul {
        let mut split = if mm.rows.len() > 1 || mm.cols.len() > 1 {
            format!(" rows={:?} cols={:?}", mm.rows, mm.cols)
        } else {
            String::new()
        };
        if mm.split_k > 1 {
            let _ = write!(split, " split_k={}", mm.split_k);
        }
        for s in &mm.skip {
            let _ = write!(split, " skip {s}");
        }
        let _ = writeln!(
            out,
            "  matmul batch={:?} m={} n={} k={}{split} a={} b={}",
            mm.batch,
            mm.m,
            mm.n,
            mm.k,
            operand(&mm.a, "i", "k", offsets, &n),
            operand(&mm.b, "k", "j", offsets, &n)
        );
    }
    for &e in &live {
        let ty = k.pool.ty(e).name();
        let body = match k.pool.get(e) {
            E::Var(v) => format!("v{v}"),
            E::Int(v) => format!("{v}"),
            E::F32(b) => format!("{:?}", f32::from_bits(*b)),
            E::I32(v) => format!("{v}i32"),
            E::Bool(v) => format!("{v}"),
            E::Load { buf, dtype, index } => {
                format!("load {}:{}[{}]", buf_name(*buf, offsets), dtype, n(index))
            }
            E::Un(op, a) => format!("{} {}", op.name(), n(a)),
            E::Bin(op, a, b) => format!("{} {}, {}", op.name(), n(a), n(b)),
            E::IMin(a, b) => format!("imin {}, {}", n(a), n(b)),
            E::IMax(a, b) => format!("imax {}, {}", n(a), n(b)),
            E::Select(c, a, b) => format!("select {}, {}, {}", n(c), n(a), n(b)),
            E::Cast(t, a) => format!("cast.{} {}", t.name(), n(a)),
            E::Round(d, a) => format!("round.{} {}", d.name(), n(a)),
            E::Reduce { op, vars, body } => format!(
                "reduce.{} {} over {}",
                op.name(),
                n(body),
                vars.iter()
                    .map(|(v, e)| format!("v{v}<{e}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            E::ArgMax { vars, body } => format!(
                "argmax {} over {}",
                n(body),
                vars.iter()
                    .map(|(v, e)| format!("v{v}<{e}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            E::Uniform { seed, index } => format!("uniform seed={seed} {}", n(index)),
            E::Acc => "acc".into(),
        };
        let _ = writeln!(out, "  {} : {ty} = {body}", n(&e));
    }
    for s in &k.stores {
        let _ = writeln!(
            out,
            "  store {}:{}[{}] {} {}",
            buf_name(s.buf, offsets),
            s.dtype,
            n(&s.index),
            if s.accumulate { "+=" } else { "=" },
            n(&s.value)
        );
    }
}
