//! A grouped bar chart, rendered to a PNG file without a graphics dependency: an RGB
//! canvas, a built-in 5x7 bitmap font (drawn at 2x), and a PNG encoder of its own (zlib by
//! `flate2`, chunk CRCs by `crc32fast`).

use std::io::Write as _;
use std::path::Path;

use anyhow::{bail, Context as _, Result};
use flate2::write::ZlibEncoder;
use flate2::Compression;

/// One group of bars (an x position), e.g. a flash budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub label: String,
    /// One value per series; NaN (or any non-finite value) = no bar.
    pub values: Vec<f64>,
}

/// Render a grouped bar chart: `series` names (legend, one colour each), groups along x,
/// y axis from 0 to a rounded-up max with 4-6 labelled ticks, `title` at the top,
/// `x_label`/`y_label` axis captions, each bar labelled with its value (1 decimal) above it.
///
/// The file is written to a temporary file next to `path` and renamed over it, so a reader
/// never sees half a PNG.
pub fn bar_chart_png(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[String],
    groups: &[Group],
) -> Result<()> {
    let chart = render(title, x_label, y_label, series, groups)?;
    let png = encode_png(chart.canvas.width, chart.canvas.height, &chart.canvas.data)?;
    write_atomically(path, &png)
}

// ---------------------------------------------------------------------------------------
// Layout and drawing.

/// Canvas size when everything fits; the chart grows (up to the maxima) when it does not.
const WIDTH: usize = 900;
const HEIGHT: usize = 500;
const MAX_WIDTH: usize = 4000;
/// Scale of the ordinary text: 5x7 glyphs become 10x14 pixels.
const TEXT_SCALE: usize = 2;

type Rgb = [u8; 3];

const BACKGROUND: Rgb = [255, 255, 255];
const TEXT: Rgb = [33, 33, 33];
const AXIS: Rgb = [0, 0, 0];
const GRID: Rgb = [225, 225, 225];
/// Series colours (matplotlib's "tab10"), cycled beyond ten series. None of them is used by
/// anything else on the canvas.
const PALETTE: [Rgb; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

fn series_colour(series: usize) -> Rgb {
    PALETTE[series % PALETTE.len()]
}

/// A rectangle of pixels, `x0..x1` by `y0..y1` (ends exclusive).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rect {
    x0: i64,
    y0: i64,
    x1: i64,
    y1: i64,
}

/// Where one bar went (tests check the pixels against it).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(test), allow(dead_code))]
struct Bar {
    group: usize,
    series: usize,
    rect: Rect,
}

/// A rendered chart and where its parts are.
#[cfg_attr(not(test), allow(dead_code))]
struct Chart {
    canvas: Canvas,
    /// The plot area: bars stand on `y1` (the x axis is the row `y1`), `y0` is the top tick.
    plot: Rect,
    bars: Vec<Bar>,
}

fn render(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[String],
    groups: &[Group],
) -> Result<Chart> {
    if series.is_empty() {
        bail!("bar chart {title:?}: no series given (need at least one series name)");
    }
    for g in groups {
        if g.values.len() != series.len() {
            bail!(
                "bar chart {title:?}: group {:?} has {} values, but there are {} series",
                g.label,
                g.values.len(),
                series.len()
            );
        }
    }

    let ns = series.len();
    let ng = groups.len();
    let s = TEXT_SCALE;
    let line_h = (GLYPH_H * s) as i64;

    // The y axis.
    let max = groups
        .iter()
        .flat_map(|g| g.values.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let (step, intervals) = nice_axis(max);
    let top_value = step * intervals as f64;
    let decimals = decimals_of(step);
    let tick_labels: Vec<String> = (0..=intervals)
        .map(|k| format!("{:.*}", decimals, k as f64 * step))
        .collect();
    let tick_label_w = tick_labels
        .iter()
        .map(|t| text_width(t, s))
        .max()
        .unwrap_or(0);

    // Horizontal layout: [y label] [tick labels] [ticks] plot.
    let y_label_w = if y_label.is_empty() { 0 } else { line_h + 12 };
    let left = 12 + y_label_w + tick_label_w as i64 + 12;
    let right_margin = 24i64;

    // Every bar at least as wide as its value label at scale 1 (else the canvas grows).
    let value_labels: Vec<Vec<Option<String>>> = groups
        .iter()
        .map(|g| {
            g.values
                .iter()
                .map(|v| v.is_finite().then(|| format!("{v:.1}")))
                .collect()
        })
        .collect();
    let widest_value = value_labels
        .iter()
        .flatten()
        .flatten()
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(0);
    let min_bar_w = (widest_value * GLYPH_ADVANCE + 3) as f64;
    let needed_plot_w = (ng * ns) as f64 * min_bar_w / GROUP_FILL;
    let width = ((left + right_margin) as f64 + needed_plot_w)
        .ceil()
        .clamp(WIDTH as f64, MAX_WIDTH as f64) as usize;

    // Vertical layout: title, legend rows, plot, group labels, x label.
    let title_scale = [3, 2, 1]
        .into_iter()
        .find(|&sc| text_width(title, sc) + 20 <= width)
        .unwrap_or(1);
    let title_y = 12i64;
    let title_h = if title.is_empty() {
        0
    } else {
        (GLYPH_H * title_scale) as i64
    };
    let legend_y = title_y + title_h + 14;
    let legend = legend_layout(series, width as i64, legend_y);
    let legend_end = legend
        .iter()
        .map(|item| item.1 + LEGEND_ROW_H)
        .max()
        .unwrap_or(legend_y);
    let plot_top = legend_end + 26; // room for a value label above the tallest bar
    let below_plot = 10
        + line_h
        + if x_label.is_empty() {
            12
        } else {
            12 + line_h + 12
        };
    let height = HEIGHT.max((plot_top + 200 + below_plot) as usize);
    let plot = Rect {
        x0: left,
        y0: plot_top,
        x1: width as i64 - right_margin,
        y1: height as i64 - below_plot,
    };
    let plot_w = (plot.x1 - plot.x0) as f64;
    let plot_h = (plot.y1 - plot.y0) as f64;

    let mut canvas = Canvas::new(width, height, BACKGROUND);

    // Grid lines and y ticks.
    let tick_y = |k: usize| plot.y1 - (k as f64 / intervals as f64 * plot_h).round() as i64;
    for k in 1..=intervals {
        canvas.hline(plot.x0, plot.x1, tick_y(k), GRID);
    }

    // Bars.
    let mut bars = Vec::new();
    let slot = if ng == 0 { plot_w } else { plot_w / ng as f64 };
    let bar_w = slot * GROUP_FILL / ns as f64;
    let gap = if bar_w >= 10.0 {
        2
    } else if bar_w >= 5.0 {
        1
    } else {
        0
    };
    let value_scale = if (text_width_chars(widest_value, 2) as f64) < bar_w - gap as f64 {
        2
    } else {
        1
    };
    for (gi, g) in groups.iter().enumerate() {
        let inner_x0 = plot.x0 as f64 + gi as f64 * slot + slot * (1.0 - GROUP_FILL) / 2.0;
        for (si, &v) in g.values.iter().enumerate() {
            if !v.is_finite() {
                continue;
            }
            let x0 = (inner_x0 + si as f64 * bar_w).round() as i64;
            let x1 = ((inner_x0 + (si + 1) as f64 * bar_w).round() as i64 - gap).max(x0 + 1);
            let h = ((v.max(0.0) / top_value) * plot_h)
                .round()
                .clamp(0.0, plot_h) as i64;
            let rect = Rect {
                x0,
                y0: plot.y1 - h,
                x1,
                y1: plot.y1,
            };
            canvas.fill_rect(rect, series_colour(si));
            bars.push(Bar {
                group: gi,
                series: si,
                rect,
            });
            if let Some(label) = &value_labels[gi][si] {
                let lw = text_width(label, value_scale) as i64;
                let ly = rect.y0 - 4 - (GLYPH_H * value_scale) as i64;
                canvas.text((x0 + x1) / 2 - lw / 2, ly, label, value_scale, TEXT);
            }
        }
    }

    // Axes, drawn over the bars' feet.
    canvas.vline(plot.x0 - 1, plot.y0, plot.y1 + 1, AXIS);
    canvas.hline(plot.x0 - 1, plot.x1, plot.y1, AXIS);
    for (k, label) in tick_labels.iter().enumerate() {
        let y = tick_y(k);
        canvas.hline(plot.x0 - 6, plot.x0 - 1, y, AXIS);
        let lw = text_width(label, s) as i64;
        canvas.text(plot.x0 - 10 - lw, y - line_h / 2, label, s, TEXT);
    }

    // Group labels under the groups.
    for (gi, g) in groups.iter().enumerate() {
        let sc = if (text_width(&g.label, s) as f64) <= slot - 4.0 {
            s
        } else {
            1
        };
        let cx = plot.x0 as f64 + (gi as f64 + 0.5) * slot;
        let lw = text_width(&g.label, sc) as f64;
        canvas.text(
            (cx - lw / 2.0).round() as i64,
            plot.y1 + 10,
            &g.label,
            sc,
            TEXT,
        );
    }

    // Axis captions.
    if !x_label.is_empty() {
        let lw = text_width(x_label, s) as i64;
        let y = plot.y1 + 10 + line_h + 12;
        canvas.text((plot.x0 + plot.x1) / 2 - lw / 2, y, x_label, s, TEXT);
    }
    if !y_label.is_empty() {
        let lw = text_width(y_label, s) as i64;
        let y = ((plot.y0 + plot.y1) / 2 - lw / 2).max(0);
        canvas.text_vertical(12, y, y_label, s, TEXT);
    }

    // Title and legend.
    if !title.is_empty() {
        let tw = text_width(title, title_scale) as i64;
        canvas.text(width as i64 / 2 - tw / 2, title_y, title, title_scale, TEXT);
    }
    for &(x, y, si) in &legend {
        canvas.fill_rect(
            Rect {
                x0: x,
                y0: y + 1,
                x1: x + SWATCH,
                y1: y + 1 + SWATCH,
            },
            series_colour(si),
        );
        canvas.text(x + SWATCH + 6, y, &series[si], s, TEXT);
    }

    Ok(Chart { canvas, plot, bars })
}

/// Share of a group's slot that its bars take (the rest is space between groups).
const GROUP_FILL: f64 = 0.8;
const SWATCH: i64 = 14;
const LEGEND_ROW_H: i64 = 22;
const LEGEND_GAP: i64 = 24;

/// Legend entries (swatch x, row y, series), flowed into centred rows.
fn legend_layout(series: &[String], width: i64, y: i64) -> Vec<(i64, i64, usize)> {
    let item_w = |name: &str| SWATCH + 6 + text_width(name, TEXT_SCALE) as i64;
    let avail = width - 40;
    let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut row_w = 0i64;
    for (si, name) in series.iter().enumerate() {
        let w = item_w(name);
        let row = rows.last_mut().expect("one row at least");
        if !row.is_empty() && row_w + LEGEND_GAP + w > avail {
            rows.push(vec![si]);
            row_w = w;
        } else {
            row_w += if row.is_empty() { w } else { LEGEND_GAP + w };
            row.push(si);
        }
    }
    let mut out = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let total: i64 = row.iter().map(|&si| item_w(&series[si])).sum::<i64>()
            + LEGEND_GAP * (row.len() as i64 - 1);
        let mut x = ((width - total) / 2).max(20);
        for &si in row {
            out.push((x, y + r as i64 * LEGEND_ROW_H, si));
            x += item_w(&series[si]) + LEGEND_GAP;
        }
    }
    out
}

/// A step (1, 2, 2.5 or 5 times a power of ten) and a number of intervals (3 to 5, or fewer
/// only for a tiny chart) so that `step * intervals` is the smallest such top >= `max`:
/// 4 to 6 labelled ticks, counting 0.
fn nice_axis(max: f64) -> (f64, usize) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    // Start well below (the first step gives > 5 intervals), then walk up.
    let mut exp = (max / 5.0).log10().floor() as i32 - 1;
    loop {
        // 1 / 10^k is correctly rounded where 10^-k is not (0.1 * 2.0 == 0.2 exactly).
        let mag = if exp >= 0 {
            10f64.powi(exp)
        } else {
            1.0 / 10f64.powi(-exp)
        };
        for m in [1.0, 2.0, 2.5, 5.0] {
            let step = m * mag;
            // The tolerance keeps 0.7 / 0.1 = 6.999... from rounding to 7 and 0.3 / 0.1 from
            // becoming 3.0000001 -> 4.
            let n = (max / step - 1e-9).ceil().max(1.0);
            if n <= 5.0 {
                return (step, n as usize);
            }
        }
        exp += 1;
    }
}

/// Decimals needed to print multiples of `step` exactly (2.5 -> 1, 0.25 -> 2, 50 -> 0).
fn decimals_of(step: f64) -> usize {
    (0..=6)
        .find(|&d| {
            let scaled = step * 10f64.powi(d as i32);
            (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
        })
        .unwrap_or(6)
}

/// An RGB canvas, rows top to bottom.
struct Canvas {
    width: usize,
    height: usize,
    data: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize, background: Rgb) -> Self {
        let data = background
            .iter()
            .copied()
            .cycle()
            .take(width * height * 3)
            .collect();
        Canvas {
            width,
            height,
            data,
        }
    }

    /// Sets one pixel; anything off the canvas is clipped.
    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x < 0 || y < 0 || x >= self.width as i64 || y >= self.height as i64 {
            return;
        }
        let i = (y as usize * self.width + x as usize) * 3;
        self.data[i..i + 3].copy_from_slice(&c);
    }

    fn fill_rect(&mut self, r: Rect, c: Rgb) {
        let x0 = r.x0.max(0);
        let x1 = r.x1.min(self.width as i64);
        let y0 = r.y0.max(0);
        let y1 = r.y1.min(self.height as i64);
        for y in y0..y1 {
            for x in x0..x1 {
                self.set(x, y, c);
            }
        }
    }

    /// The row `y` from `x0` to `x1` (exclusive).
    fn hline(&mut self, x0: i64, x1: i64, y: i64, c: Rgb) {
        self.fill_rect(
            Rect {
                x0,
                y0: y,
                x1,
                y1: y + 1,
            },
            c,
        );
    }

    /// The column `x` from `y0` to `y1` (exclusive).
    fn vline(&mut self, x: i64, y0: i64, y1: i64, c: Rgb) {
        self.fill_rect(
            Rect {
                x0: x,
                y0,
                x1: x + 1,
                y1,
            },
            c,
        );
    }

    /// Text with its top-left corner at (x, y).
    fn text(&mut self, x: i64, y: i64, s: &str, scale: usize, c: Rgb) {
        for_each_text_pixel(s, scale, |u, v| self.set(x + u, y + v, c));
    }

    /// Text turned a quarter left (reading bottom to top, as a y-axis caption), occupying
    /// `x..x + 8*scale` (descenders included) and `y..y + text_width`.
    fn text_vertical(&mut self, x: i64, y: i64, s: &str, scale: usize, c: Rgb) {
        let w = text_width(s, scale) as i64;
        for_each_text_pixel(s, scale, |u, v| self.set(x + v, y + w - 1 - u, c));
    }
}

// ---------------------------------------------------------------------------------------
// The bitmap font.

const GLYPH_W: usize = 5;
/// Rows from the top of a capital to the baseline (what layout counts as a line's height).
const GLYPH_H: usize = 7;
/// Rows a glyph may use: one more for descenders.
const GLYPH_ROWS: usize = 8;
/// Glyph width plus one column of space, in font pixels.
const GLYPH_ADVANCE: usize = GLYPH_W + 1;

/// Width in pixels of `s` at `scale` (no trailing space).
fn text_width(s: &str, scale: usize) -> usize {
    text_width_chars(s.chars().count(), scale)
}

fn text_width_chars(chars: usize, scale: usize) -> usize {
    (chars * GLYPH_ADVANCE).saturating_sub(1) * scale
}

/// Calls `f(u, v)` for every lit pixel of `s` drawn at `scale`, (0, 0) being the top-left.
fn for_each_text_pixel(s: &str, scale: usize, mut f: impl FnMut(i64, i64)) {
    for (i, ch) in s.chars().enumerate() {
        let glyph = glyph(ch);
        for (col, bits) in glyph.iter().enumerate() {
            for row in 0..GLYPH_ROWS {
                if bits & (1 << row) == 0 {
                    continue;
                }
                let u0 = (i * GLYPH_ADVANCE + col) * scale;
                let v0 = row * scale;
                for dv in 0..scale {
                    for du in 0..scale {
                        f((u0 + du) as i64, (v0 + dv) as i64);
                    }
                }
            }
        }
    }
}

/// Columns of a glyph, left to right; bit 0 is the top row, bit 7 the descender row.
fn glyph(ch: char) -> [u8; 5] {
    match ch as u32 {
        c @ 32..=126 => FONT[(c - 32) as usize],
        _ => UNKNOWN_GLYPH,
    }
}

/// A box, for characters the font does not have.
const UNKNOWN_GLYPH: [u8; 5] = [0x7F, 0x41, 0x41, 0x41, 0x7F];

/// ASCII 32..=126, the classic 5x7 LCD font: five columns each, bit 0 at the top; g, j, p,
/// q and y descend into an eighth row (bit 7) below the baseline.
const FONT: [[u8; 5]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00], // ' '
    [0x00, 0x00, 0x5F, 0x00, 0x00], // !
    [0x00, 0x07, 0x00, 0x07, 0x00], // "
    [0x14, 0x7F, 0x14, 0x7F, 0x14], // #
    [0x24, 0x2A, 0x7F, 0x2A, 0x12], // $
    [0x23, 0x13, 0x08, 0x64, 0x62], // %
    [0x36, 0x49, 0x55, 0x22, 0x50], // &
    [0x00, 0x05, 0x03, 0x00, 0x00], // '
    [0x00, 0x1C, 0x22, 0x41, 0x00], // (
    [0x00, 0x41, 0x22, 0x1C, 0x00], // )
    [0x08, 0x2A, 0x1C, 0x2A, 0x08], // *
    [0x08, 0x08, 0x3E, 0x08, 0x08], // +
    [0x00, 0x50, 0x30, 0x00, 0x00], // ,
    [0x08, 0x08, 0x08, 0x08, 0x08], // -
    [0x00, 0x60, 0x60, 0x00, 0x00], // .
    [0x20, 0x10, 0x08, 0x04, 0x02], // /
    [0x3E, 0x51, 0x49, 0x45, 0x3E], // 0
    [0x00, 0x42, 0x7F, 0x40, 0x00], // 1
    [0x42, 0x61, 0x51, 0x49, 0x46], // 2
    [0x21, 0x41, 0x45, 0x4B, 0x31], // 3
    [0x18, 0x14, 0x12, 0x7F, 0x10], // 4
    [0x27, 0x45, 0x45, 0x45, 0x39], // 5
    [0x3C, 0x4A, 0x49, 0x49, 0x30], // 6
    [0x01, 0x71, 0x09, 0x05, 0x03], // 7
    [0x36, 0x49, 0x49, 0x49, 0x36], // 8
    [0x06, 0x49, 0x49, 0x29, 0x1E], // 9
    [0x00, 0x36, 0x36, 0x00, 0x00], // :
    [0x00, 0x56, 0x36, 0x00, 0x00], // ;
    [0x08, 0x14, 0x22, 0x41, 0x00], // <
    [0x14, 0x14, 0x14, 0x14, 0x14], // =
    [0x00, 0x41, 0x22, 0x14, 0x08], // >
    [0x02, 0x01, 0x51, 0x09, 0x06], // ?
    [0x32, 0x49, 0x79, 0x41, 0x3E], // @
    [0x7E, 0x11, 0x11, 0x11, 0x7E], // A
    [0x7F, 0x49, 0x49, 0x49, 0x36], // B
    [0x3E, 0x41, 0x41, 0x41, 0x22], // C
    [0x7F, 0x41, 0x41, 0x22, 0x1C], // D
    [0x7F, 0x49, 0x49, 0x49, 0x41], // E
    [0x7F, 0x09, 0x09, 0x09, 0x01], // F
    [0x3E, 0x41, 0x49, 0x49, 0x7A], // G
    [0x7F, 0x08, 0x08, 0x08, 0x7F], // H
    [0x00, 0x41, 0x7F, 0x41, 0x00], // I
    [0x20, 0x40, 0x41, 0x3F, 0x01], // J
    [0x7F, 0x08, 0x14, 0x22, 0x41], // K
    [0x7F, 0x40, 0x40, 0x40, 0x40], // L
    [0x7F, 0x02, 0x0C, 0x02, 0x7F], // M
    [0x7F, 0x04, 0x08, 0x10, 0x7F], // N
    [0x3E, 0x41, 0x41, 0x41, 0x3E], // O
    [0x7F, 0x09, 0x09, 0x09, 0x06], // P
    [0x3E, 0x41, 0x51, 0x21, 0x5E], // Q
    [0x7F, 0x09, 0x19, 0x29, 0x46], // R
    [0x46, 0x49, 0x49, 0x49, 0x31], // S
    [0x01, 0x01, 0x7F, 0x01, 0x01], // T
    [0x3F, 0x40, 0x40, 0x40, 0x3F], // U
    [0x1F, 0x20, 0x40, 0x20, 0x1F], // V
    [0x3F, 0x40, 0x38, 0x40, 0x3F], // W
    [0x63, 0x14, 0x08, 0x14, 0x63], // X
    [0x07, 0x08, 0x70, 0x08, 0x07], // Y
    [0x61, 0x51, 0x49, 0x45, 0x43], // Z
    [0x00, 0x7F, 0x41, 0x41, 0x00], // [
    [0x02, 0x04, 0x08, 0x10, 0x20], // backslash
    [0x00, 0x41, 0x41, 0x7F, 0x00], // ]
    [0x04, 0x02, 0x01, 0x02, 0x04], // ^
    [0x40, 0x40, 0x40, 0x40, 0x40], // _
    [0x00, 0x01, 0x02, 0x04, 0x00], // `
    [0x20, 0x54, 0x54, 0x54, 0x78], // a
    [0x7F, 0x48, 0x44, 0x44, 0x38], // b
    [0x38, 0x44, 0x44, 0x44, 0x20], // c
    [0x38, 0x44, 0x44, 0x48, 0x7F], // d
    [0x38, 0x54, 0x54, 0x54, 0x18], // e
    [0x08, 0x7E, 0x09, 0x01, 0x02], // f
    [0x18, 0xA4, 0xA4, 0xA4, 0x7C], // g
    [0x7F, 0x08, 0x04, 0x04, 0x78], // h
    [0x00, 0x44, 0x7D, 0x40, 0x00], // i
    [0x40, 0x80, 0x84, 0x7D, 0x00], // j
    [0x7F, 0x10, 0x28, 0x44, 0x00], // k
    [0x00, 0x41, 0x7F, 0x40, 0x00], // l
    [0x7C, 0x04, 0x18, 0x04, 0x78], // m
    [0x7C, 0x08, 0x04, 0x04, 0x78], // n
    [0x38, 0x44, 0x44, 0x44, 0x38], // o
    [0xFC, 0x24, 0x24, 0x24, 0x18], // p
    [0x18, 0x24, 0x24, 0x18, 0xFC], // q
    [0x7C, 0x08, 0x04, 0x04, 0x08], // r
    [0x48, 0x54, 0x54, 0x54, 0x20], // s
    [0x04, 0x3F, 0x44, 0x40, 0x20], // t
    [0x3C, 0x40, 0x40, 0x20, 0x7C], // u
    [0x1C, 0x20, 0x40, 0x20, 0x1C], // v
    [0x3C, 0x40, 0x30, 0x40, 0x3C], // w
    [0x44, 0x28, 0x10, 0x28, 0x44], // x
    [0x9C, 0xA0, 0xA0, 0xA0, 0x7C], // y
    [0x44, 0x64, 0x54, 0x4C, 0x44], // z
    [0x00, 0x08, 0x36, 0x41, 0x00], // {
    [0x00, 0x00, 0x7F, 0x00, 0x00], // |
    [0x00, 0x41, 0x36, 0x08, 0x00], // }
    [0x08, 0x04, 0x08, 0x10, 0x08], // ~
];

// ---------------------------------------------------------------------------------------
// PNG.

const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];

/// An 8-bit RGB, non-interlaced PNG of `rgb` (rows top to bottom, 3 bytes a pixel).
fn encode_png(width: usize, height: usize, rgb: &[u8]) -> Result<Vec<u8>> {
    if width == 0 || height == 0 || rgb.len() != width * height * 3 {
        bail!(
            "PNG: {} bytes of pixels do not make a {width}x{height} RGB image",
            rgb.len()
        );
    }
    let (w, h) = (u32::try_from(width)?, u32::try_from(height)?);

    // Each scanline: filter type 0 (none), then the row.
    let mut raw = Vec::with_capacity(height * (1 + 3 * width));
    for row in rgb.chunks_exact(3 * width) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut z = ZlibEncoder::new(Vec::new(), Compression::default());
    z.write_all(&raw).context("PNG: compressing the pixels")?;
    let idat = z.finish().context("PNG: compressing the pixels")?;

    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);

    let mut out = Vec::with_capacity(idat.len() + 64);
    out.extend_from_slice(&PNG_SIGNATURE);
    png_chunk(&mut out, b"IHDR", &ihdr)?;
    png_chunk(&mut out, b"IDAT", &idat)?;
    png_chunk(&mut out, b"IEND", &[])?;
    Ok(out)
}

/// Length, type, data, CRC-32 of type and data.
fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) -> Result<()> {
    let len = u32::try_from(data.len())
        .ok()
        .filter(|&l| l <= i32::MAX as u32)
        .context("PNG: chunk too large")?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc = crc32fast::Hasher::new();
    crc.update(kind);
    crc.update(data);
    out.extend_from_slice(&crc.finalize().to_be_bytes());
    Ok(())
}

/// Writes `bytes` to a temporary file in `path`'s directory, then renames it to `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file path", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let written = write_then_rename(&tmp, path, bytes);
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn write_then_rename(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f =
        std::fs::File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    /// A decoded 8-bit RGB PNG.
    struct Decoded {
        width: usize,
        height: usize,
        rgb: Vec<u8>,
    }

    impl Decoded {
        fn pixel(&self, x: usize, y: usize) -> Rgb {
            let i = (y * self.width + x) * 3;
            [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
        }

        /// Pixels of colour `c` in `x0..x1` by `y0..y1`.
        fn count(&self, c: Rgb, x0: usize, x1: usize, y0: usize, y1: usize) -> usize {
            (y0..y1)
                .flat_map(|y| (x0..x1).map(move |x| (x, y)))
                .filter(|&(x, y)| self.pixel(x, y) == c)
                .count()
        }
    }

    /// A minimal, independent PNG checker: signature, chunk CRCs, IHDR, IEND, filter bytes.
    fn decode(bytes: &[u8]) -> Decoded {
        assert_eq!(
            &bytes[..8],
            &[137, 80, 78, 71, 13, 10, 26, 10],
            "PNG signature"
        );
        let mut pos = 8;
        let mut chunks: Vec<([u8; 4], &[u8])> = Vec::new();
        while pos < bytes.len() {
            assert!(pos + 12 <= bytes.len(), "truncated chunk at {pos}");
            let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            let kind: [u8; 4] = bytes[pos + 4..pos + 8].try_into().unwrap();
            let data = &bytes[pos + 8..pos + 8 + len];
            let crc = u32::from_be_bytes(bytes[pos + 8 + len..pos + 12 + len].try_into().unwrap());
            assert_eq!(
                crc,
                crc32fast::hash(&bytes[pos + 4..pos + 8 + len]),
                "CRC of chunk {:?}",
                String::from_utf8_lossy(&kind)
            );
            chunks.push((kind, data));
            pos += 12 + len;
        }
        assert_eq!(pos, bytes.len(), "bytes after the last chunk");
        assert_eq!(&chunks[0].0, b"IHDR");
        let (last_kind, last_data) = chunks.last().unwrap();
        assert_eq!(last_kind, b"IEND");
        assert!(last_data.is_empty());

        let ihdr = chunks[0].1;
        assert_eq!(ihdr.len(), 13);
        let width = u32::from_be_bytes(ihdr[0..4].try_into().unwrap()) as usize;
        let height = u32::from_be_bytes(ihdr[4..8].try_into().unwrap()) as usize;
        assert_eq!(&ihdr[8..], &[8, 2, 0, 0, 0], "8-bit RGB, no interlace");

        let idat: Vec<u8> = chunks
            .iter()
            .filter(|(k, _)| k == b"IDAT")
            .flat_map(|(_, d)| d.iter().copied())
            .collect();
        let mut raw = Vec::new();
        flate2::read::ZlibDecoder::new(&idat[..])
            .read_to_end(&mut raw)
            .expect("IDAT inflates");
        assert_eq!(raw.len(), height * (1 + 3 * width), "decompressed length");
        let mut rgb = Vec::with_capacity(width * height * 3);
        for line in raw.chunks_exact(1 + 3 * width) {
            assert_eq!(line[0], 0, "filter type 0");
            rgb.extend_from_slice(&line[1..]);
        }
        Decoded { width, height, rgb }
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    fn sample() -> (Vec<String>, Vec<Group>) {
        let series = names(&["plain", "leap", "llama:draft"]);
        let groups = vec![
            Group {
                label: "0.5 GB".into(),
                values: vec![3.2, 7.9, 5.1],
            },
            Group {
                label: "1 GB".into(),
                values: vec![4.0, 11.3, f64::NAN],
            },
            Group {
                label: "2 GB".into(),
                values: vec![6.1, 14.6, 9.8],
            },
            Group {
                label: "unlimited".into(),
                values: vec![8.7, 16.2, 12.4],
            },
        ];
        (series, groups)
    }

    const TITLE: &str = "Decode speed by flash budget (Qwen3-8B, x=4, 100%_ok)";
    const X_LABEL: &str = "flash budget";
    const Y_LABEL: &str = "decode tokens/s";

    #[test]
    fn writes_a_png_with_the_bars_where_they_belong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.png");
        let (series, groups) = sample();
        bar_chart_png(&path, TITLE, X_LABEL, Y_LABEL, &series, &groups).unwrap();
        // Nothing left over but the chart.
        let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(entries.len(), 1);

        let bytes = std::fs::read(&path).unwrap();
        if let Some(copy) = std::env::var_os("LEAP_CHART_SAMPLE") {
            std::fs::write(copy, &bytes).unwrap();
        }
        let png = decode(&bytes);
        assert!((800..=1000).contains(&png.width), "{}", png.width);
        assert!((450..=600).contains(&png.height), "{}", png.height);

        // The layout the file was drawn from (rendering is deterministic).
        let chart = render(TITLE, X_LABEL, Y_LABEL, &series, &groups).unwrap();
        assert_eq!(
            (png.width, png.height),
            (chart.canvas.width, chart.canvas.height)
        );
        assert_eq!(png.rgb, chart.canvas.data);
        assert_eq!(chart.bars.len(), 11, "one bar per finite value");

        // Each bar is solid in its series' colour.
        for bar in &chart.bars {
            let r = bar.rect;
            let (x0, x1, y0, y1) = (r.x0 as usize, r.x1 as usize, r.y0 as usize, r.y1 as usize);
            assert!(y1 > y0 && x1 > x0);
            let c = series_colour(bar.series);
            assert_eq!(png.count(c, x0, x1, y0, y1), (x1 - x0) * (y1 - y0));
        }

        // Independently of the bars' rectangles: in each group's slice of the plot, the
        // pixels of a series' colour follow the values.
        let p = chart.plot;
        let slot = (p.x1 - p.x0) as usize / groups.len();
        let in_group = |g: usize, s: usize| {
            let x0 = p.x0 as usize + g * slot;
            png.count(
                series_colour(s),
                x0,
                x0 + slot,
                p.y0 as usize,
                p.y1 as usize,
            )
        };
        for (g, group) in groups.iter().enumerate() {
            for s in 0..series.len() {
                for t in 0..series.len() {
                    let (a, b) = (group.values[s], group.values[t]);
                    if a.is_finite() && b.is_finite() && a > b + 0.5 {
                        assert!(in_group(g, s) > in_group(g, t), "group {g}: {s} vs {t}");
                    }
                }
            }
        }
        // The NaN makes no bar; the tallest bar (16.2 of a 20 axis) fills ~81% of the height.
        assert_eq!(in_group(1, 2), 0);
        let tallest = chart
            .bars
            .iter()
            .find(|b| b.group == 3 && b.series == 1)
            .unwrap();
        let h = (tallest.rect.y1 - tallest.rect.y0) as f64 / (p.y1 - p.y0) as f64;
        assert!((h - 16.2 / 20.0).abs() < 0.01, "{h}");
        // Same series, growing values across groups: more pixels.
        assert!(in_group(3, 1) > in_group(2, 1) && in_group(2, 1) > in_group(0, 1));

        // The legend shows every colour outside the plot area too.
        for s in 0..series.len() {
            let above = png.count(series_colour(s), 0, png.width, 0, p.y0 as usize);
            assert_eq!(
                above,
                (SWATCH * SWATCH) as usize,
                "legend swatch of series {s}"
            );
        }
        // Text: title at the top, tick labels left of the axis, captions below/left.
        let text_in = |x0: usize, x1: usize, y0: usize, y1: usize| png.count(TEXT, x0, x1, y0, y1);
        assert!(text_in(0, png.width, 0, 40) > 200, "title");
        assert!(
            text_in(40, p.x0 as usize - 6, p.y0 as usize - 8, png.height) > 100,
            "ticks"
        );
        assert!(
            text_in(0, 30, p.y0 as usize, p.y1 as usize) > 100,
            "y caption"
        );
        assert!(
            text_in(0, png.width, p.y1 as usize + 1, png.height) > 200,
            "x labels"
        );
        // Value labels sit just above their bars.
        for bar in &chart.bars {
            let r = bar.rect;
            let band = (r.y0 - 4 - 14) as usize..(r.y0 - 4) as usize;
            assert!(
                text_in(r.x0 as usize - 8, r.x1 as usize + 8, band.start, band.end) > 20,
                "label of bar {bar:?}"
            );
        }
    }

    #[test]
    fn axis_is_rounded_up_with_four_to_six_ticks() {
        assert_eq!(nice_axis(10.0), (2.0, 5));
        assert_eq!(nice_axis(11.0), (2.5, 5));
        assert_eq!(nice_axis(16.2), (5.0, 4));
        assert_eq!(nice_axis(4.0), (1.0, 4));
        assert_eq!(nice_axis(123.4), (25.0, 5));
        assert_eq!(nice_axis(0.0), (0.2, 5));
        assert_eq!(nice_axis(f64::NAN), (0.2, 5));
        let mut v = 0.013;
        while v < 1e7 {
            let (step, n) = nice_axis(v);
            assert!((3..=5).contains(&n), "{v}: {n} intervals");
            assert!(
                step * n as f64 >= v * (1.0 - 1e-9),
                "{v}: top {}",
                step * n as f64
            );
            assert!(step * ((n - 1) as f64) < v, "{v}: not the smallest top");
            v *= 1.37;
        }
        assert_eq!(decimals_of(2.5), 1);
        assert_eq!(decimals_of(0.25), 2);
        assert_eq!(decimals_of(50.0), 0);
        assert_eq!(decimals_of(0.1 * 2.0), 1);
    }

    #[test]
    fn font_covers_printable_ascii_and_boxes_the_rest() {
        for c in '!'..='~' {
            assert_ne!(glyph(c), [0; 5], "{c:?} is blank");
            assert_ne!(glyph(c), UNKNOWN_GLYPH, "{c:?} is a box");
        }
        assert_eq!(glyph(' '), [0; 5]);
        assert_eq!(glyph('é'), UNKNOWN_GLYPH);
        assert_eq!(glyph('\t'), UNKNOWN_GLYPH);
        // Distinct glyphs for the characters charts use.
        let mut chars: Vec<char> = ('0'..='9')
            .chain('A'..='Z')
            .chain('a'..='z')
            .chain(".,:-+/()x%_=".chars())
            .collect();
        chars.sort();
        chars.dedup();
        for (i, &a) in chars.iter().enumerate() {
            for &b in &chars[i + 1..] {
                assert_ne!(glyph(a), glyph(b), "{a:?} and {b:?} look alike");
            }
        }
    }

    #[test]
    fn many_bars_widen_the_canvas_and_text_is_clipped_not_a_panic() {
        let series: Vec<String> = (0..12).map(|i| format!("mode {i}")).collect();
        let groups: Vec<Group> = (0..8)
            .map(|g| Group {
                label: format!("a rather long group label {g}"),
                values: (0..12).map(|s| 1000.0 * (g * 12 + s) as f64).collect(),
            })
            .collect();
        let chart = render(&"long title ".repeat(40), "x", "y", &series, &groups).unwrap();
        assert!(chart.canvas.width > WIDTH);
        assert!(chart.canvas.width <= MAX_WIDTH);
        assert_eq!(chart.bars.len(), 96);
        // No groups at all: just axes.
        let empty = render("t", "x", "y", &series, &[]).unwrap();
        assert!(empty.bars.is_empty());
    }

    #[test]
    fn bad_input_is_an_error_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.png");

        let err = bar_chart_png(&path, "t", "x", "y", &[], &[]).unwrap_err();
        assert!(err.to_string().contains("no series"), "{err}");

        let (series, mut groups) = sample();
        groups[2].values.pop();
        let err = bar_chart_png(&path, "t", "x", "y", &series, &groups).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("\"2 GB\"") && msg.contains("2 values") && msg.contains("3 series"),
            "{msg}"
        );

        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        // A path that cannot be written is an error too, with the path in it.
        let missing = dir.path().join("no/such/dir/chart.png");
        let (series, groups) = sample();
        let err = bar_chart_png(&missing, "t", "x", "y", &series, &groups).unwrap_err();
        assert!(format!("{err:#}").contains("no/such/dir"), "{err:#}");
    }
}
