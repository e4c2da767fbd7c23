//! A line chart of TTFT against prompt length, one line per strategy, as SVG. Both axes are
//! logarithmic, so the fixed cost (flat left part) and the marginal rate (slope) both show.

use std::fmt::Write;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// One line: a name and its (prompt tokens, TTFT ms) points.
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Powers of ten covering `lo..hi`, as log10 exponents.
fn decades(lo: f64, hi: f64) -> (f64, f64) {
    (
        lo.log10().floor(),
        hi.log10().ceil().max(lo.log10().floor() + 1.0),
    )
}

/// The SVG document.
pub(crate) fn svg(title: &str, series: &[Series]) -> String {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let positive = |v: f64| v.max(1e-3);
    let (x0, x1) = decades(
        all.iter()
            .map(|p| positive(p.0))
            .fold(f64::INFINITY, f64::min),
        all.iter().map(|p| positive(p.0)).fold(1.0, f64::max),
    );
    let (y0, y1) = decades(
        all.iter()
            .map(|p| positive(p.1))
            .fold(f64::INFINITY, f64::min),
        all.iter().map(|p| positive(p.1)).fold(1.0, f64::max),
    );
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + (positive(x).log10() - x0) / (x1 - x0) * plot_w;
    let py = |y: f64| TOP + plot_h - (positive(y).log10() - y0) / (y1 - y0) * plot_h;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(title)
    );
    for e in (x0 as i32)..=(x1 as i32) {
        let x = px(10f64.powi(e));
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0,
            10f64.powi(e)
        );
    }
    for e in (y0 as i32)..=(y1 as i32) {
        let y = py(10f64.powi(e));
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0,
            10f64.powi(e)
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">prompt tokens (log)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20,{:.1}) rotate(-90)" text-anchor="middle">TTFT ms (log)</text>"#,
        TOP + plot_h / 2.0
    );
    for (i, line) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut points = line.points.clone();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(x, y) in &points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let lx = LEFT + plot_w + 15.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            lx + 20.0,
            lx + 26.0,
            ly + 4.0,
            escape(&line.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_series_and_point() {
        let series = vec![
            Series {
                name: "grouped".into(),
                points: vec![(10.0, 1.0), (300.0, 20.0)],
            },
            Series {
                name: "per-expert <base>".into(),
                points: vec![(10.0, 5.0), (300.0, 40.0)],
            },
        ];
        let doc = svg("TTFT", &series);
        assert_eq!(doc.matches("<polyline").count(), 2);
        assert_eq!(doc.matches("<circle").count(), 4);
        assert!(doc.contains("per-expert &lt;base&gt;"));
        assert!(doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
    }
}
