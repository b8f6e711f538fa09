//! An SVG picture of a plan: each buffer is a rectangle in (schedule step × arena offset),
//! with a hover title (node, type, source line); lines mark the arena size and the max-live
//! lower bound; a second panel draws the eager live-bytes curve at the same byte scale.

use crate::analysis::liveness::BufferKind;
use crate::eager::memory::EagerMemory;
use crate::ir::Graph;
use crate::plan::Plan;
use std::fmt::Write;
use tcc_grammar::span::SourceMap;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0))
}

/// Renders the plan (and the eager curve) as a standalone SVG document.
pub fn render(g: &Graph, plan: &Plan, eager: &EagerMemory, sources: &SourceMap) -> String {
    let (w, h, margin, gap) = (760.0f64, 520.0f64, 60.0f64, 40.0f64);
    let ew = 360.0f64;
    let total_w = margin + w + gap + ew + 20.0;
    let total_h = h + 2.0 * margin;
    let steps = plan.liveness.order.len().max(1) as f64;
    let top_bytes = plan.arena_bytes.max(eager.peak_bytes()).max(1) as f64;
    let y = |bytes: f64| margin + h - bytes / top_bytes * h;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0}" height="{total_h:.0}" viewBox="0 0 {total_w:.0} {total_h:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<title>tcc memory plan of model {}</title>"#,
        esc(&g.name)
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{total_w:.0}" height="{total_h:.0}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{margin}" y="20" font-size="14">model {}: arena {} (lower bound {}), eager peak {}</text>"#,
        esc(&g.name),
        mib(plan.arena_bytes),
        mib(plan.lower_bound),
        mib(eager.peak_bytes())
    );
    let _ = writeln!(
        s,
        r#"<rect x="{margin}" y="{margin}" width="{w}" height="{h}" fill="none" stroke="black"/>"#
    );
    for (i, b) in plan.liveness.buffers.iter().enumerate() {
        if b.bytes == 0 {
            continue;
        }
        let x0 = margin + b.start as f64 / steps * w;
        let x1 = margin + b.end as f64 / steps * w;
        let off = plan.offsets[i] as f64;
        let (y1, y0) = (y(off), y(off + b.bytes as f64));
        let fill = match b.kind {
            BufferKind::Persistent => "lightsteelblue",
            BufferKind::Input => "palegreen",
            BufferKind::Transient if b.output => "sandybrown",
            BufferKind::Transient => "thistle",
        };
        let node = g.node(b.owner);
        let loc = sources.location(node.span);
        let title = format!(
            "{} {} ({} bytes) at offset {}, steps {}..{}, {}",
            node.op.name(),
            node.ty,
            b.bytes,
            plan.offsets[i],
            b.start,
            b.end,
            loc
        );
        let _ = writeln!(
            s,
            r#"<rect x="{x0:.2}" y="{y0:.2}" width="{:.2}" height="{:.2}" fill="{fill}" stroke="gray" stroke-width="0.3"><title>{}</title></rect>"#,
            (x1 - x0).max(0.5),
            (y1 - y0).max(0.5),
            esc(&title)
        );
    }
    for (label, bytes, color) in [
        ("arena", plan.arena_bytes, "red"),
        ("lower bound", plan.lower_bound, "green"),
    ] {
        let yy = y(bytes as f64);
        let _ = writeln!(
            s,
            r#"<line x1="{margin}" y1="{yy:.2}" x2="{:.2}" y2="{yy:.2}" stroke="{color}" stroke-dasharray="6,3"/><text x="{:.2}" y="{:.2}" fill="{color}">{label} {}</text>"#,
            margin + w,
            margin + 4.0,
            yy - 4.0,
            mib(bytes)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{margin}" y="{:.0}">schedule step →  (offset ↑)</text>"#,
        margin + h + 20.0
    );
    // Eager live bytes, same byte scale.
    let ex = margin + w + gap;
    let _ = writeln!(
        s,
        r#"<rect x="{ex}" y="{margin}" width="{ew}" height="{h}" fill="none" stroke="black"/>"#
    );
    let base = (eager.persistent_bytes() + eager.input_bytes) as f64;
    let n = eager.timeline.len().max(1) as f64;
    let mut pts = String::new();
    for (i, &t) in eager.timeline.iter().enumerate() {
        let _ = write!(
            pts,
            "{:.2},{:.2} ",
            ex + i as f64 / n * ew,
            y(base + t as f64)
        );
    }
    let _ = writeln!(
        s,
        r#"<polyline points="{pts}" fill="none" stroke="purple"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{ex}" y="{:.0}">eager live bytes (peak {})</text>"#,
        margin + h + 20.0,
        mib(eager.peak_bytes())
    );
    let _ = writeln!(s, "</svg>");
    s
}
