//! A grouped bar chart (`leap bench`'s flash-budget sweep), drawn by `plotters` into an RGB
//! buffer and written as a PNG by `png`.
//!
//! plotters lays out the axes, ticks, captions and legend; this module picks the canvas size,
//! the y headroom that keeps the bars clear of the legend, and where each bar goes. Text uses
//! DejaVu Sans (a Latin-1 subset in `cli/assets/`, see its README) compiled into the binary and
//! handed to plotters through `ab_glyph`, so a chart needs no system font and looks the same on
//! every machine.

use std::io::Write as _;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One group of bars (an x position), e.g. a flash budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub label: String,
    /// One value per series; NaN (or any non-finite value) = no bar.
    pub values: Vec<f64>,
}

/// Render a grouped bar chart: `series` names (legend, one colour each), groups along x,
/// y axis from 0 with plotters' ticks, `title` at the top, `x_label`/`y_label` axis captions,
/// each bar labelled with its value (1 decimal) above it.
///
/// The file is written to a temporary file next to `path` and renamed over it, so a reader
/// never sees half a PNG.
///
/// # Errors
/// No series, a group whose value count differs from the series count, a drawing error, or
/// the file cannot be written.
pub fn bar_chart_png(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[String],
    groups: &[Group],
) -> Result<()> {
    let chart = render(title, x_label, y_label, series, groups)?;
    let png = encode_png(chart.width, chart.height, &chart.rgb)?;
    write_atomically(path, &png)
}

// ---------------------------------------------------------------------------------------
// Layout and drawing.

/// Canvas size when everything fits; the chart grows (up to `MAX_WIDTH`) when it does not.
const WIDTH: u32 = 900;
const HEIGHT: u32 = 500;
const MAX_WIDTH: u32 = 4000;
/// Space around the chart, and the bands under and left of the plot for ticks and captions.
const MARGIN: u32 = 14;
const X_LABEL_AREA: u32 = 62;
/// The least plot height (pixels) under the legend's band; the canvas grows to keep it.
const MIN_PLOT_HEIGHT: u32 = 220;
/// Share of a group's slot that its bars take (the rest is space between groups).
const GROUP_FILL: f64 = 0.8;

/// Font sizes (pixels): the title tries each in turn until it fits the width.
const TITLE_SIZES: [f64; 4] = [22.0, 18.0, 15.0, 12.0];
const LABEL_SIZE: f64 = 15.0;
const SMALL_LABEL_SIZE: f64 = 11.0;
const CAPTION_SIZE: f64 = 16.0;
const LEGEND_SIZE: f64 = 15.0;
const VALUE_SIZE: f64 = 13.0;
const SMALL_VALUE_SIZE: f64 = 10.0;
/// plotters' legend: its inner margin, swatch column and line height (`MultiLineText`'s).
const LEGEND_MARGIN: u32 = 8;
const LEGEND_SWATCH: u32 = 24;
const LEGEND_LINE: f64 = 1.25;
/// plotters 0.3.7 draws ab_glyph text about a quarter of its size higher than the box it lays
/// out; y tick labels and legend swatches move by this share of their size to line up.
const TEXT_RISE: f64 = 0.25;

/// The family name the embedded font is registered under (plotters' default family).
const FONT_FAMILY: &str = "sans-serif";
const FONT_TTF: &[u8] = include_bytes!("../../assets/DejaVuSans-subset.ttf");

const BACKGROUND: RGBColor = RGBColor(255, 255, 255);
const TEXT: RGBColor = RGBColor(33, 33, 33);
const AXIS: RGBColor = RGBColor(0, 0, 0);
const GRID: RGBColor = RGBColor(225, 225, 225);
/// Series colours (matplotlib's "tab10"), cycled beyond ten series.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn series_colour(series: usize) -> RGBColor {
    PALETTE[series % PALETTE.len()]
}

/// A rectangle of pixels: columns by rows.
type PixelRect = (Range<i32>, Range<i32>);

/// Where one bar went, in pixels (tests check the pixels against it).
#[derive(Debug, Clone)]
#[cfg_attr(not(test), allow(dead_code))]
struct Bar {
    group: usize,
    series: usize,
    x: Range<i32>,
    y: Range<i32>,
}

/// A rendered chart (RGB rows, top to bottom) and where its parts are.
#[cfg_attr(not(test), allow(dead_code))]
struct Chart {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
    /// The plot area in pixels; bars stand on its bottom.
    plot: PixelRect,
    /// The top of the y axis (value units).
    y_top: f64,
    bars: Vec<Bar>,
}

/// Registers the embedded font with plotters (once per process).
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT_TTF).is_ok()
    });
    ensure!(
        ok,
        "the chart font (cli/assets/DejaVuSans-subset.ttf) does not load"
    );
    Ok(())
}

fn font(size: f64) -> FontDesc<'static> {
    FontDesc::new(FontFamily::Name(FONT_FAMILY), size, FontStyle::Normal)
}

/// Width in pixels of `text` at `size`.
fn text_width(text: &str, size: f64) -> Result<u32> {
    Ok(font(size).box_size(text).map_err(draw_error)?.0)
}

fn draw_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
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
    register_font()?;
    let layout = Layout::new(title, y_label, series, groups)?;
    let (width, height) = (layout.width, layout.height);
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    let (plot, bars) = draw(&mut rgb, &layout, title, x_label, y_label, series, groups)?;
    Ok(Chart {
        width,
        height,
        rgb,
        plot,
        y_top: layout.y_top,
        bars,
    })
}

/// The sizes a chart of these data needs.
struct Layout {
    width: u32,
    height: u32,
    title_size: f64,
    /// The band left of the plot: tick labels and the y caption.
    y_label_area: u32,
    /// The top of the y axis (value units).
    y_top: f64,
    group_label_size: f64,
    value_size: f64,
    /// Pixels left blank at each side of a bar.
    bar_gap: u32,
}

impl Layout {
    fn new(title: &str, y_label: &str, series: &[String], groups: &[Group]) -> Result<Layout> {
        let ns = series.len();
        let ng = groups.len();
        let max = groups
            .iter()
            .flat_map(|g| g.values.iter().copied())
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);

        // The legend sits in the plot's top-left corner: the tallest bar and its label stay
        // `above_bars` pixels under the plot's top, out of its way.
        let legend_bottom =
            5 + 2 * LEGEND_MARGIN + (ns as f64 * LEGEND_SIZE * LEGEND_LINE).ceil() as u32 + 4;
        let above_bars = legend_bottom + VALUE_SIZE as u32 + 8;

        // Left band: y tick labels and the caption. No tick is wider than the axis' top with
        // the ticks' decimals, and the top is at most `top_bound` (the plot is never lower
        // than MIN_PLOT_HEIGHT under `above_bars`).
        let top_bound =
            max.max(1.0) * f64::from(MIN_PLOT_HEIGHT + above_bars) / f64::from(MIN_PLOT_HEIGHT);
        let widest_tick = format!("{top_bound:.*}", tick_decimals(top_bound));
        let tick_w = text_width(&widest_tick, LABEL_SIZE)?;
        let y_label_area = tick_w + 18 + if y_label.is_empty() { 0 } else { 30 };

        // Width: every bar at least as wide as its value label in the small size.
        let (mut widest_value, mut widest_small_value) = (0, 0);
        for label in groups.iter().flat_map(value_labels).flatten() {
            widest_value = widest_value.max(text_width(&label, VALUE_SIZE)?);
            widest_small_value = widest_small_value.max(text_width(&label, SMALL_VALUE_SIZE)?);
        }
        let needed_plot_w = (ng * ns) as f64 * f64::from(widest_small_value + 4) / GROUP_FILL;
        let width = (f64::from(y_label_area + 2 * MARGIN) + needed_plot_w)
            .ceil()
            .clamp(f64::from(WIDTH), f64::from(MAX_WIDTH)) as u32;

        // Height: the title's band, the plot, the band under it.
        let mut title_size = TITLE_SIZES[TITLE_SIZES.len() - 1];
        for size in TITLE_SIZES {
            if text_width(title, size)? + 2 * MARGIN <= width {
                title_size = size;
                break;
            }
        }
        let (_, title_h) = font(title_size).box_size(title).map_err(draw_error)?;
        // What plotters' `titled` takes: the text and up to 5 pixels above and below it.
        let title_band = if title.is_empty() {
            0
        } else {
            title_h + 2 * (title_h / 2).min(5)
        };
        let fixed = title_band + 2 * MARGIN + X_LABEL_AREA;
        let height = HEIGHT.max(fixed + above_bars + MIN_PLOT_HEIGHT);
        let plot_h = height - fixed;
        let y_top = if max > 0.0 {
            max * f64::from(plot_h) / f64::from(plot_h - above_bars)
        } else {
            1.0
        };

        let plot_w = width - y_label_area - 2 * MARGIN;
        let slot_w = f64::from(plot_w) / ng.max(1) as f64;
        let bar_w = slot_w * GROUP_FILL / ns as f64;
        let mut group_label_size = LABEL_SIZE;
        for g in groups {
            if f64::from(text_width(&g.label, LABEL_SIZE)?) > slot_w - 6.0 {
                group_label_size = SMALL_LABEL_SIZE;
            }
        }
        let value_size = if f64::from(widest_value) <= bar_w - 2.0 {
            VALUE_SIZE
        } else {
            SMALL_VALUE_SIZE
        };
        Ok(Layout {
            width,
            height,
            title_size,
            y_label_area,
            y_top,
            group_label_size,
            value_size,
            bar_gap: u32::from(bar_w >= 10.0),
        })
    }
}

/// The label above each bar (none for a non-finite value).
fn value_labels(g: &Group) -> Vec<Option<String>> {
    g.values
        .iter()
        .map(|v| v.is_finite().then(|| format!("{v:.1}")))
        .collect()
}

/// Draws the chart into `rgb` (`layout.width` x `layout.height` RGB pixels); returns the plot
/// area and the bars, in pixels.
fn draw(
    rgb: &mut [u8],
    layout: &Layout,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[String],
    groups: &[Group],
) -> Result<(PixelRect, Vec<Bar>)> {
    let ns = series.len();
    let root = BitMapBackend::with_buffer(rgb, (layout.width, layout.height)).into_drawing_area();
    root.fill(&BACKGROUND).map_err(draw_error)?;
    let area = if title.is_empty() {
        root.clone()
    } else {
        root.titled(title, font(layout.title_size).color(&TEXT))
            .map_err(draw_error)?
    };

    // x: group g is centred on g; y: 0 to y_top.
    let mut chart = ChartBuilder::on(&area)
        .margin(MARGIN)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(layout.y_label_area)
        .build_cartesian_2d(GroupAxis(groups.len()), 0.0..layout.y_top)
        .map_err(draw_error)?;

    let group_label = |x: &f64| {
        groups
            .get(x.round() as usize)
            .map(|g| g.label.clone())
            .unwrap_or_default()
    };
    let tick = |y: &f64| format_tick(*y, layout.y_top);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .axis_style(AXIS)
        .x_labels(groups.len().max(1))
        .y_labels(6)
        .y_label_offset((LABEL_SIZE * TEXT_RISE).round() as i32)
        .x_label_formatter(&group_label)
        .y_label_formatter(&tick)
        .x_label_style(font(layout.group_label_size).color(&TEXT))
        .y_label_style(font(LABEL_SIZE).color(&TEXT))
        .axis_desc_style(font(CAPTION_SIZE).color(&TEXT))
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(draw_error)?;

    // Bar si of group g spans its share of [g - fill/2, g + fill/2].
    let share = GROUP_FILL / ns as f64;
    let span = |g: usize, si: usize| {
        let x0 = g as f64 - GROUP_FILL / 2.0 + si as f64 * share;
        (x0, x0 + share)
    };
    let gap = layout.bar_gap;
    let mut bars = Vec::new();
    let rise = (LEGEND_SIZE * TEXT_RISE / 2.0).round() as i32;
    for (si, name) in series.iter().enumerate() {
        let colour = series_colour(si);
        let mut rects = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            if !g.values[si].is_finite() {
                continue;
            }
            let (x0, x1) = span(gi, si);
            let v = g.values[si].max(0.0);
            let mut r = Rectangle::new([(x0, v), (x1, 0.0)], colour.filled());
            r.set_margin(0, 0, gap, gap);
            rects.push(r);
            let (left, top) = chart.backend_coord(&(x0, v));
            let (right, bottom) = chart.backend_coord(&(x1, 0.0));
            bars.push(Bar {
                group: gi,
                series: si,
                x: left + gap as i32..right - gap as i32,
                y: top..bottom,
            });
        }
        chart
            .draw_series(rects)
            .map_err(draw_error)?
            .label(name)
            .legend(move |(x, y)| {
                Rectangle::new([(x, y - 7 - rise), (x + 13, y + 6 - rise)], colour.filled())
            });
    }

    // Each bar's value just above it.
    let value_style = font(layout.value_size)
        .color(&TEXT)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    let mut labels = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        for (si, label) in value_labels(g).into_iter().enumerate() {
            if let Some(label) = label {
                let (x0, x1) = span(gi, si);
                let at = ((x0 + x1) / 2.0, g.values[si].max(0.0));
                labels.push(EmptyElement::at(at) + Text::new(label, (0, -4), value_style.clone()));
            }
        }
    }
    chart.draw_series(labels).map_err(draw_error)?;

    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .margin(LEGEND_MARGIN)
        .legend_area_size(LEGEND_SWATCH)
        .label_font(font(LEGEND_SIZE).color(&TEXT))
        .background_style(BACKGROUND.mix(0.85))
        .border_style(GRID)
        .draw()
        .map_err(draw_error)?;

    let plot = chart.plotting_area().get_pixel_range();
    root.present().map_err(draw_error)?;
    Ok((plot, bars))
}

/// The x axis: group g is centred on x = g, with a tick (and its label) under each group.
struct GroupAxis(usize);

impl Ranged for GroupAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        RangedCoordf64::from(self.range()).map(value, limit)
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let every = self.0.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0).step_by(every).map(|g| g as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..self.0.max(1) as f64 - 0.5
    }
}

/// Decimals a tick label of an axis up to `top` may need: 3 significant digits of the top.
fn tick_decimals(top: f64) -> usize {
    (2 - top.max(1e-6).log10().floor() as i32).clamp(0, 6) as usize
}

/// A y tick label: the decimals the axis may need (`top` the axis' top), no trailing zeros.
fn format_tick(v: f64, top: f64) -> String {
    let s = format!("{v:.*}", tick_decimals(top));
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// An 8-bit RGB PNG of `width` x `height` pixels.
fn encode_png(width: u32, height: u32, rgb: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().context("PNG: writing the header")?;
    writer
        .write_image_data(rgb)
        .context("PNG: compressing the pixels")?;
    writer.finish().context("PNG: finishing the file")?;
    Ok(out)
}

/// Writes `bytes` to a temporary file in `path`'s directory, then renames it to `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("creating a temporary file for {}", path.display()))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.persist(path)
        .with_context(|| format!("renaming a temporary file to {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Rgb = [u8; 3];

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

        /// Pixels in `x` by `y` (clipped to the image) for which `f` holds.
        fn count(&self, f: impl Fn(Rgb) -> bool, x: Range<i32>, y: Range<i32>) -> usize {
            let clip = |r: Range<i32>, n: usize| {
                r.start.max(0) as usize..r.end.clamp(0, n as i32) as usize
            };
            let (x, y) = (clip(x, self.width), clip(y, self.height));
            y.flat_map(|y| x.clone().map(move |x| (x, y)))
                .filter(|&(x, y)| f(self.pixel(x, y)))
                .count()
        }
    }

    /// Decodes with the `png` crate's decoder, which checks chunk CRCs and zlib checksums.
    fn decode(bytes: &[u8]) -> Decoded {
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().expect("PNG header");
        let mut rgb = vec![0; reader.output_buffer_size().expect("frame size")];
        let info = reader.next_frame(&mut rgb).expect("PNG pixels");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        rgb.truncate(info.buffer_size());
        Decoded {
            width: info.width as usize,
            height: info.height as usize,
            rgb,
        }
    }

    fn is(c: RGBColor) -> impl Fn(Rgb) -> bool {
        move |p| p == [c.0, c.1, c.2]
    }

    /// Text and axes: dark greys (the text colour, antialiased on white, and black). The
    /// grid (225) is lighter, and no series colour of the first seven is grey.
    fn is_ink(p: Rgb) -> bool {
        let (lo, hi) = (p.iter().min().unwrap(), p.iter().max().unwrap());
        *hi < 200 && hi - lo <= 12
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
        assert_eq!((png.width, png.height), (WIDTH as usize, HEIGHT as usize));

        // The layout the file was drawn from (rendering is deterministic).
        let chart = render(TITLE, X_LABEL, Y_LABEL, &series, &groups).unwrap();
        assert_eq!(png.rgb, chart.rgb);
        assert_eq!(chart.bars.len(), 11, "one bar per finite value");
        let (px, py) = chart.plot.clone();
        assert!(px.start > 60 && px.end < png.width as i32 - 5, "{px:?}");
        assert!(py.start > 30 && py.end < png.height as i32 - 40, "{py:?}");

        // Each bar is solid in its series' colour (1 pixel in from its edges), as tall as
        // its value on the axis.
        for bar in &chart.bars {
            let (x, y) = (
                bar.x.start + 1..bar.x.end - 1,
                bar.y.start + 1..bar.y.end - 1,
            );
            assert!(x.end > x.start + 10 && y.end > y.start, "{bar:?}");
            let area = (x.end - x.start) as usize * (y.end - y.start) as usize;
            let colour = series_colour(bar.series);
            assert_eq!(png.count(is(colour), x, y), area, "{bar:?}");
            let v = groups[bar.group].values[bar.series];
            let h = f64::from(bar.y.end - bar.y.start);
            let expected = v / chart.y_top * f64::from(py.end - py.start);
            assert!(
                (h - expected).abs() <= 2.0,
                "{bar:?}: {h} px for {expected}"
            );
        }

        // Independently of the bars' rectangles: in each group's slice of the plot, the
        // pixels of a series' colour follow the values.
        let slot = (px.end - px.start) / groups.len() as i32;
        let in_group = |g: usize, s: usize| {
            let x0 = px.start + g as i32 * slot;
            png.count(is(series_colour(s)), x0..x0 + slot, py.clone())
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
        // The NaN makes no bar (the first group's slice also holds the legend's swatches).
        assert_eq!(in_group(1, 2), 0);
        assert!(in_group(3, 1) > in_group(2, 1) && in_group(2, 1) > in_group(1, 1));

        // The legend: a swatch of every colour outside the bars, with the names beside it.
        for s in 0..series.len() {
            let colour = series_colour(s);
            let all = png.count(is(colour), 0..png.width as i32, 0..png.height as i32);
            let in_bars: usize = chart
                .bars
                .iter()
                .filter(|b| b.series == s)
                .map(|b| png.count(is(colour), b.x.clone(), b.y.clone()))
                .sum();
            assert!(
                all - in_bars >= 150,
                "legend swatch of series {s}: {}",
                all - in_bars
            );
        }
        let legend = px.start..px.start + 200;
        assert!(
            png.count(is_ink, legend, py.start..py.start + 70) > 300,
            "legend names"
        );
        // The tallest bar's value label stays under the legend.
        let top = chart.bars.iter().map(|b| b.y.start).min().unwrap();
        assert!(
            top > py.start + 70 + 14,
            "bar top at {top}, plot top at {}",
            py.start
        );

        // Text: title at the top, tick labels left of the axis, captions below/left.
        let w = png.width as i32;
        assert!(png.count(is_ink, 0..w, 0..py.start - 5) > 300, "title");
        assert!(
            png.count(is_ink, 45..px.start - 8, py.clone()) > 100,
            "ticks"
        );
        assert!(png.count(is_ink, 0..45, py.clone()) > 100, "y caption");
        let below = py.end + 8..png.height as i32;
        assert!(
            png.count(is_ink, px.clone(), below.clone()) > 300,
            "x labels"
        );
        // Each group's label under its own slot.
        for g in 0..groups.len() as i32 {
            let x0 = px.start + g * slot;
            let labels = py.end + 8..py.end + 30;
            assert!(
                png.count(is_ink, x0..x0 + slot, labels) > 30,
                "label of group {g}"
            );
        }
        // Value labels sit just above their bars.
        for bar in &chart.bars {
            let band = bar.y.start - 4 - 16..bar.y.start - 2;
            let x = bar.x.start - 8..bar.x.end + 8;
            assert!(png.count(is_ink, x, band) > 20, "label of bar {bar:?}");
        }
    }

    #[test]
    fn tick_labels_have_the_decimals_the_axis_needs() {
        assert_eq!(format_tick(2.5, 17.8), "2.5");
        assert_eq!(format_tick(10.0, 17.8), "10");
        assert_eq!(format_tick(0.0, 17.8), "0");
        assert_eq!(format_tick(0.25, 1.2), "0.25");
        assert_eq!(format_tick(0.1 + 0.2, 1.0), "0.3");
        assert_eq!(format_tick(1000.0, 4000.0), "1000");
        assert_eq!(format_tick(0.025, 0.1), "0.025");
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
        let title = "long title ".repeat(40);
        let chart = render(&title, "x", "y", &series, &groups).unwrap();
        assert!(
            chart.width > WIDTH && chart.width <= MAX_WIDTH,
            "{}",
            chart.width
        );
        assert!(
            chart.height > HEIGHT,
            "twelve legend rows: {}",
            chart.height
        );
        assert_eq!(chart.bars.len(), 96);
        // The tallest bar stays under the twelve-row legend.
        let top = chart.bars.iter().map(|b| b.y.start).min().unwrap();
        let rows = (12.0 * LEGEND_SIZE * LEGEND_LINE) as i32;
        assert!(top > chart.plot.1.start + rows, "bar top {top}");
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
