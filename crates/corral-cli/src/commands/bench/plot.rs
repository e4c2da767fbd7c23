//! A line chart of TTFT against prompt length, one line per strategy, as SVG or PNG. Both
//! axes are logarithmic, so the fixed cost (flat left part) and the marginal rate (slope)
//! both show. One layout feeds both renderers; the PNG is rasterised here (lines, dots and
//! an 8×8 bitmap font) and encoded with the `png` crate.

use std::fmt::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [[u8; 3]; 6] = [
    [0x1f, 0x77, 0xb4],
    [0xd6, 0x27, 0x28],
    [0x2c, 0xa0, 0x2c],
    [0xff, 0x7f, 0x0e],
    [0x94, 0x67, 0xbd],
    [0x8c, 0x56, 0x4b],
];
const GRID: [u8; 3] = [0xdd, 0xdd, 0xdd];
const INK: [u8; 3] = [0x33, 0x33, 0x33];

/// One line: a name and its (prompt tokens, TTFT ms) points.
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
}

/// Text placement relative to its anchor point.
#[derive(Clone, Copy, PartialEq)]
enum Anchor {
    Start,
    Middle,
    End,
}

/// A grid line at a decade, with its tick label.
struct GridLine {
    from: (f64, f64),
    to: (f64, f64),
    label: String,
    label_at: (f64, f64),
    anchor: Anchor,
}

/// One series as drawn.
struct Line {
    color: [u8; 3],
    points: Vec<(f64, f64)>,
    name: String,
    legend_at: (f64, f64),
}

/// Everything to draw, in pixel coordinates.
struct Layout {
    title: String,
    grid: Vec<GridLine>,
    frame: (f64, f64, f64, f64),
    x_label: (f64, f64),
    y_label: (f64, f64),
    lines: Vec<Line>,
}

fn positive(v: f64) -> f64 {
    v.max(1e-3)
}

/// Powers of ten covering `lo..hi`, as log10 exponents.
fn decades(lo: f64, hi: f64) -> (f64, f64) {
    (
        lo.log10().floor(),
        hi.log10().ceil().max(lo.log10().floor() + 1.0),
    )
}

fn layout(title: &str, series: &[Series]) -> Layout {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let lo = |f: fn(&(f64, f64)) -> f64| {
        all.iter()
            .map(|p| positive(f(p)))
            .fold(f64::INFINITY, f64::min)
    };
    let hi = |f: fn(&(f64, f64)) -> f64| all.iter().map(|p| positive(f(p))).fold(1.0, f64::max);
    let (x0, x1) = decades(lo(|p| p.0), hi(|p| p.0));
    let (y0, y1) = decades(lo(|p| p.1), hi(|p| p.1));
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let px = |x: f64| LEFT + (positive(x).log10() - x0) / (x1 - x0) * plot_w;
    let py = |y: f64| TOP + plot_h - (positive(y).log10() - y0) / (y1 - y0) * plot_h;
    let mut grid = Vec::new();
    for e in (x0 as i32)..=(x1 as i32) {
        let x = px(10f64.powi(e));
        let label = format!("{}", 10f64.powi(e));
        grid.push(GridLine {
            from: (x, TOP),
            to: (x, TOP + plot_h),
            label,
            label_at: (x, TOP + plot_h + 18.0),
            anchor: Anchor::Middle,
        });
    }
    for e in (y0 as i32)..=(y1 as i32) {
        let y = py(10f64.powi(e));
        let label = format!("{}", 10f64.powi(e));
        grid.push(GridLine {
            from: (LEFT, y),
            to: (LEFT + plot_w, y),
            label,
            label_at: (LEFT - 6.0, y + 4.0),
            anchor: Anchor::End,
        });
    }
    let lines = series
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut points = s.points.clone();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mapped = points.iter().map(|&(x, y)| (px(x), py(y))).collect();
            Line {
                color: COLORS[i % COLORS.len()],
                points: mapped,
                name: s.name.clone(),
                legend_at: (LEFT + plot_w + 15.0, TOP + 10.0 + i as f64 * 20.0),
            }
        })
        .collect();
    Layout {
        title: title.to_string(),
        grid,
        frame: (LEFT, TOP, plot_w, plot_h),
        x_label: (LEFT + plot_w / 2.0, HEIGHT - 15.0),
        y_label: (20.0, TOP + plot_h / 2.0),
        lines,
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// The chart as an SVG document.
pub(crate) fn svg(title: &str, series: &[Series]) -> String {
    let l = layout(title, series);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(&l.title)
    );
    for g in &l.grid {
        let ((x1, y1), (x2, y2), (tx, ty), label) = (g.from, g.to, g.label_at, &g.label);
        let anchor = if g.anchor == Anchor::End {
            "end"
        } else {
            "middle"
        };
        let _ = writeln!(
            s,
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{}"/><text x="{tx:.1}" y="{ty:.1}" text-anchor="{anchor}">{label}</text>"#,
            hex(GRID)
        );
    }
    let (fx, fy, fw, fh) = l.frame;
    let _ = writeln!(
        s,
        r#"<rect x="{fx}" y="{fy}" width="{fw}" height="{fh}" fill="none" stroke="{}"/>"#,
        hex(INK)
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">prompt tokens (log)</text>"#,
        l.x_label.0, l.x_label.1
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{:.1}) rotate(-90)" text-anchor="middle">TTFT ms (log)</text>"#,
        l.y_label.0, l.y_label.1
    );
    for line in &l.lines {
        let (color, points, name, (lx, ly)) =
            (hex(line.color), &line.points, &line.name, line.legend_at);
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (x, y) in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
            );
        }
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            lx + 20.0,
            lx + 26.0,
            ly + 4.0,
            escape(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// An RGB raster with the few drawing primitives the chart needs.
struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize) -> Self {
        Self {
            width,
            height,
            pixels: vec![255; width * height * 3],
        }
    }

    fn dot(&mut self, x: i64, y: i64, color: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            let i = (y as usize * self.width + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&color);
        }
    }

    /// A line `width` pixels thick.
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), color: [u8; 3], width: i64) {
        let steps = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as i64;
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            let (x, y) = (
                (x0 + (x1 - x0) * t).round() as i64,
                (y0 + (y1 - y0) * t).round() as i64,
            );
            for dx in 0..width {
                for dy in 0..width {
                    self.dot(x + dx - width / 2, y + dy - width / 2, color);
                }
            }
        }
    }

    fn disc(&mut self, (cx, cy): (f64, f64), radius: i64, color: [u8; 3]) {
        let (cx, cy) = (cx.round() as i64, cy.round() as i64);
        for dy in -radius..=radius {
            for dx in -radius..=radius {
                if dx * dx + dy * dy <= radius * radius {
                    self.dot(cx + dx, cy + dy, color);
                }
            }
        }
    }

    /// ASCII text in the 8×8 font, baseline-ish at `y` like SVG text.
    fn text(&mut self, (x, y): (f64, f64), text: &str, anchor: Anchor, color: [u8; 3]) {
        let width = 8.0 * text.chars().count() as f64;
        let left = match anchor {
            Anchor::Start => x,
            Anchor::Middle => x - width / 2.0,
            Anchor::End => x - width,
        };
        let (left, top) = (left.round() as i64, (y - 8.0).round() as i64);
        for (i, c) in text.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY
                .get(c as usize)
                .copied()
                .unwrap_or(font8x8::legacy::BASIC_LEGACY[b'?' as usize]);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) != 0 {
                        self.dot(left + i as i64 * 8 + col, top + row as i64, color);
                    }
                }
            }
        }
    }
}

/// The chart as PNG bytes.
pub(crate) fn png(title: &str, series: &[Series]) -> Result<Vec<u8>, png::EncodingError> {
    let l = layout(title, series);
    let mut c = Canvas::new(WIDTH as usize, HEIGHT as usize);
    c.text((WIDTH / 2.0, 28.0), &l.title, Anchor::Middle, INK);
    for g in &l.grid {
        c.line(g.from, g.to, GRID, 1);
        c.text(g.label_at, &g.label, g.anchor, INK);
    }
    let (fx, fy, fw, fh) = l.frame;
    for (a, b) in [
        ((fx, fy), (fx + fw, fy)),
        ((fx + fw, fy), (fx + fw, fy + fh)),
        ((fx + fw, fy + fh), (fx, fy + fh)),
        ((fx, fy + fh), (fx, fy)),
    ] {
        c.line(a, b, INK, 1);
    }
    c.text(l.x_label, "prompt tokens (log)", Anchor::Middle, INK);
    c.text((fx, fy - 6.0), "TTFT ms (log)", Anchor::Start, INK);
    for line in &l.lines {
        let (lx, ly) = line.legend_at;
        for pair in line.points.windows(2) {
            c.line(pair[0], pair[1], line.color, 2);
        }
        for p in &line.points {
            c.disc(*p, 3, line.color);
        }
        c.line((lx, ly), (lx + 20.0, ly), line.color, 2);
        c.text((lx + 26.0, ly + 4.0), &line.name, Anchor::Start, INK);
    }
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, WIDTH as u32, HEIGHT as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(&c.pixels)?;
    Ok(out)
}

/// Refuses a plot path that is neither .svg nor .png (before a bench runs, not after).
pub(crate) fn check_path(path: &Path) -> Result<()> {
    if !matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("svg" | "png")
    ) {
        bail!(
            "--plot {}: the file must end in .svg or .png",
            path.display()
        );
    }
    Ok(())
}

/// Writes the chart to `path`: PNG for a .png name, SVG otherwise.
pub(crate) fn write(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let bytes = if path.extension().and_then(|e| e.to_str()) == Some("png") {
        png(title, series).context("encoding the PNG plot")?
    } else {
        svg(title, series).into_bytes()
    };
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series() -> Vec<Series> {
        vec![
            Series {
                name: "grouped".into(),
                points: vec![(10.0, 1.0), (300.0, 20.0)],
            },
            Series {
                name: "per-expert <base>".into(),
                points: vec![(10.0, 5.0), (300.0, 40.0)],
            },
        ]
    }

    #[test]
    fn svg_draws_every_series_and_point() {
        let doc = svg("TTFT", &series());
        assert_eq!(doc.matches("<polyline").count(), 2);
        assert_eq!(doc.matches("<circle").count(), 4);
        assert!(doc.contains("per-expert &lt;base&gt;"));
        assert!(doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
    }

    #[test]
    fn png_is_a_png_with_both_series_colors() {
        let bytes = png("TTFT", &series()).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = ::png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (760, 480));
        let pixels = &buf[..info.buffer_size()];
        for color in &COLORS[..2] {
            assert!(pixels.chunks(3).any(|p| p == color), "missing {color:?}");
        }
    }
}
