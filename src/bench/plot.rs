//! Line charts of benchmark results, written as PNG: panels side by side over a message-size x
//! axis (log2, labelled `8B`, `32K`, `1G`), each with its own y axis (log10 with 1-2-5 ticks, or
//! linear from zero), grid lines, and one legend for the whole chart below them.
//!
//! Drawn on a CPU pixel buffer with an embedded bitmap font (`plot/font.rs`), so it needs no system
//! libraries and no font files. A series keeps its colour, marker and dash in every panel: styles
//! follow labels, in order of first appearance. Values an axis cannot show (NaN, infinities, zero
//! or negative on a log axis) are skipped and break the line there; empty panels and series draw
//! as empty axes. Rendering never panics on its input; only writing the file can fail.

mod axis;
mod canvas;
mod font;

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use axis::{Mapping, Scale, Tick};
use canvas::{text_height, text_width, Canvas, Marker, Pen, Point, Rgb, CAP_HEIGHT};

/// One line of a panel: `(x, y)` points joined in the order given, x in message bytes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// Legend text; series with the same label share a style across panels.
    pub label: String,
    /// `(message bytes, value)` pairs.
    pub points: Vec<(f64, f64)>,
}

/// One plot area with its own y axis.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Panel {
    /// Text above the plot area.
    pub title: String,
    /// Text along the y axis, e.g. `latency (us)`.
    pub y_label: String,
    /// A log10 y axis (for latency) rather than a linear one from zero (for bandwidth).
    pub log_y: bool,
    /// The lines drawn.
    pub series: Vec<Series>,
}

/// A whole figure: its panels side by side, each [`PANEL_WIDTH`] pixels wide.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chart {
    /// Text across the top.
    pub title: String,
    /// Text under every panel's x axis, e.g. `message size`.
    pub x_label: String,
    /// Left to right.
    pub panels: Vec<Panel>,
}

/// Width of each panel in pixels; a chart of two panels is 1600 pixels wide.
pub const PANEL_WIDTH: u32 = 800;
/// Height of the panels in pixels; the title and legend add to it (about 700 in all).
pub const PANEL_HEIGHT: u32 = 580;

const BACKGROUND: Rgb = [255, 255, 255];
const INK: Rgb = [32, 32, 32];
const FAINT_INK: Rgb = [150, 150, 150];
const FRAME: Rgb = [64, 64, 64];
const GRID: Rgb = [214, 214, 214];
const MINOR_GRID: Rgb = [238, 238, 238];

/// Colours for series in order (the Tableau 10 palette), then markers and dashes to tell them apart
/// in grey or beyond ten series.
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
const MARKERS: [Marker; 8] = [
    Marker::Circle,
    Marker::Square,
    Marker::TriangleUp,
    Marker::Diamond,
    Marker::TriangleDown,
    Marker::Cross,
    Marker::Plus,
    Marker::HollowSquare,
];
/// The first ten series are solid; later rounds of the palette are dashed, then dotted.
const DASHES: [Option<(f64, f64)>; 3] = [None, Some((10.0, 6.0)), Some((3.0, 4.0))];

const LINE_WIDTH: f64 = 2.0;
const MARKER_RADIUS: f64 = 4.5;

/// Scale of the bitmap font for the chart title, and for everything else.
const TITLE_SCALE: i64 = 3;
const TEXT_SCALE: i64 = 2;
const MARGIN: i64 = 16;
/// Tick marks stick this far out of the frame; labels sit this far beyond them.
const TICK_LENGTH: i64 = 6;
const LABEL_GAP: i64 = 6;
/// Least space between two x labels and between the centres of two y labels.
const X_LABEL_SPACE: i64 = 16;
const Y_LABEL_PITCH: i64 = 28;
const LEGEND_ROW: i64 = 30;
const LEGEND_SAMPLE: i64 = 40;
const LEGEND_SPACING: i64 = 36;

/// How one series is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Style {
    pen: Pen,
    marker: Marker,
}

impl Style {
    fn nth(index: usize) -> Style {
        Style {
            pen: Pen {
                color: PALETTE[index % PALETTE.len()],
                width: LINE_WIDTH,
                dash: DASHES[(index / PALETTE.len()) % DASHES.len()],
            },
            marker: MARKERS[index % MARKERS.len()],
        }
    }
}

/// A rectangle in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rect {
    x: i64,
    y: i64,
    w: i64,
    h: i64,
}

/// Legend entries placed in rows: each label with the left edge of its sample line.
struct Legend {
    rows: Vec<Vec<(String, i64)>>,
}

impl Chart {
    /// Renders the chart and writes it to `path` as an 8-bit RGB PNG.
    pub fn render_png(&self, path: &Path) -> Result<()> {
        let (width, height, rgb) = self.render_rgb();
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let encoding = |e: png::EncodingError| Error::io("encoding plot as PNG", e.into());
        let mut writer = encoder.write_header().map_err(encoding)?;
        writer.write_image_data(&rgb).map_err(encoding)?;
        writer.finish().map_err(encoding)?;
        std::fs::write(path, &bytes)
            .map_err(|e| Error::io(format!("writing plot to {}", path.display()), e))
    }

    /// Renders the chart: `(width, height, pixels)` with three bytes (red, green, blue) per pixel,
    /// rows top to bottom.
    pub fn render_rgb(&self) -> (u32, u32, Vec<u8>) {
        let width = i64::from(PANEL_WIDTH) * self.panels.len().max(1) as i64;
        let styles = self.styles();
        let legend = Legend::place(&styles.labels, width);
        let title_band = if self.title.is_empty() {
            MARGIN
        } else {
            2 * MARGIN + text_height(TITLE_SCALE)
        };
        let legend_top = title_band + i64::from(PANEL_HEIGHT);
        let height = legend_top + legend.rows.len() as i64 * LEGEND_ROW + MARGIN;
        let (width, height) = (clamp_u32(width), clamp_u32(height));
        let mut canvas = Canvas::new(width, height, BACKGROUND);

        let title_x = (i64::from(width) - text_width(&self.title, TITLE_SCALE)) / 2;
        canvas.text(title_x, MARGIN, &self.title, TITLE_SCALE, INK);
        if self.panels.is_empty() {
            let area = Rect {
                x: 0,
                y: title_band,
                w: i64::from(width),
                h: i64::from(PANEL_HEIGHT),
            };
            centred_note(&mut canvas, area, "no data");
        }
        for (i, panel) in self.panels.iter().enumerate() {
            let area = Rect {
                x: i as i64 * i64::from(PANEL_WIDTH),
                y: title_band,
                w: i64::from(PANEL_WIDTH),
                h: i64::from(PANEL_HEIGHT),
            };
            draw_panel(&mut canvas, panel, &self.x_label, area, &styles);
        }
        legend.draw(&mut canvas, legend_top, &styles);
        (width, height, canvas.into_rgb())
    }

    /// Every distinct series label in order of first appearance, each with its style.
    fn styles(&self) -> Styles {
        let mut styles = Styles::default();
        for series in self.panels.iter().flat_map(|p| &p.series) {
            if !styles.index.contains_key(series.label.as_str()) {
                styles
                    .index
                    .insert(series.label.clone(), styles.labels.len());
                styles.labels.push(series.label.clone());
            }
        }
        styles
    }
}

/// Styles by label, so a label looks the same in every panel and in the legend.
#[derive(Default)]
struct Styles {
    labels: Vec<String>,
    index: HashMap<String, usize>,
}

impl Styles {
    fn of(&self, label: &str) -> Style {
        Style::nth(self.index.get(label).copied().unwrap_or(0))
    }
}

fn clamp_u32(v: i64) -> u32 {
    u32::try_from(v.max(1)).unwrap_or(u32::MAX)
}

/// Draws one panel inside `area`: title, grid, series, frame, ticks and axis labels.
fn draw_panel(canvas: &mut Canvas, panel: &Panel, x_label: &str, area: Rect, styles: &Styles) {
    let x_map = Mapping::Log2Bytes;
    let y_map = if panel.log_y {
        Mapping::Log10
    } else {
        Mapping::Linear
    };
    let shown = |&(x, y): &(f64, f64)| x_map.accepts(x) && y_map.accepts(y);
    let points = || {
        panel
            .series
            .iter()
            .flat_map(|s| &s.points)
            .filter(|p| shown(p))
    };

    let title_h = if panel.title.is_empty() {
        0
    } else {
        text_height(TEXT_SCALE) + 10
    };
    let top = area.y + MARGIN + title_h;
    let label_h = text_height(TEXT_SCALE);
    let x_label_h = if x_label.is_empty() { 0 } else { label_h + 10 };
    let bottom = area.y + area.h - MARGIN - x_label_h - label_h - LABEL_GAP - TICK_LENGTH;
    let plot_h = (bottom - top).max(1);
    let y_scale = Scale::fit(
        y_map,
        points().map(|p| p.1),
        plot_h as f64,
        Y_LABEL_PITCH as f64,
    );
    let y_ticks = y_scale.ticks();
    let y_labels_w = y_ticks
        .iter()
        .filter_map(|t| t.label.as_deref())
        .map(|l| text_width(l, TEXT_SCALE))
        .max()
        .unwrap_or(0);
    let y_label_w = if panel.y_label.is_empty() {
        0
    } else {
        label_h + 10
    };
    let left = area.x + MARGIN + y_label_w + y_labels_w + LABEL_GAP + TICK_LENGTH;
    let plot = Rect {
        x: left,
        y: top,
        w: (area.x + area.w - 2 * MARGIN - left).max(1),
        h: plot_h,
    };
    let widest_x_label = text_width("512K", TEXT_SCALE);
    let x_scale = Scale::fit(
        x_map,
        points().map(|p| p.0),
        plot.w as f64,
        (widest_x_label + X_LABEL_SPACE) as f64,
    );
    let x_ticks = x_scale.ticks();
    let to_px = |x: f64, y: f64| -> Option<Point> {
        let (fx, fy) = (x_scale.fraction(x)?, y_scale.fraction(y)?);
        Some((
            plot.x as f64 + fx * plot.w as f64,
            (plot.y + plot.h) as f64 - fy * plot.h as f64,
        ))
    };

    draw_grid(canvas, plot, &x_ticks, &y_ticks);
    for series in &panel.series {
        let style = styles.of(&series.label);
        let path: Vec<Option<Point>> = series
            .points
            .iter()
            .map(|p| if shown(p) { to_px(p.0, p.1) } else { None })
            .collect();
        draw_series(canvas, &path, style);
    }
    if points().next().is_none() {
        centred_note(canvas, plot, "no data");
    }
    draw_frame(canvas, plot);
    draw_tick_labels(canvas, plot, &x_ticks, &y_ticks);

    let centre_x = plot.x + plot.w / 2;
    let title_x = centre_x - text_width(&panel.title, TEXT_SCALE) / 2;
    canvas.text(title_x, area.y + MARGIN, &panel.title, TEXT_SCALE, INK);
    let x_label_x = centre_x - text_width(x_label, TEXT_SCALE) / 2;
    let x_label_y = plot.y + plot.h + TICK_LENGTH + LABEL_GAP + label_h + 10;
    canvas.text(x_label_x, x_label_y, x_label, TEXT_SCALE, INK);
    let y_label_y = plot.y + plot.h / 2 - text_width(&panel.y_label, TEXT_SCALE) / 2;
    canvas.text_up(area.x + MARGIN, y_label_y, &panel.y_label, TEXT_SCALE, INK);
}

/// Vertical lines at the x ticks and horizontal ones at the y ticks; labelled ticks darker.
fn draw_grid(canvas: &mut Canvas, plot: Rect, x_ticks: &[Tick], y_ticks: &[Tick]) {
    // Unlabelled lines first, so labelled ones stay unbroken where they cross.
    for labelled in [false, true] {
        let color = if labelled { GRID } else { MINOR_GRID };
        for tick in x_ticks.iter().filter(|t| t.label.is_some() == labelled) {
            let x = x_px(plot, tick.at);
            canvas.fill_rect(x, plot.y, 1, plot.h, color);
        }
        for tick in y_ticks.iter().filter(|t| t.label.is_some() == labelled) {
            let y = y_px(plot, tick.at);
            canvas.fill_rect(plot.x, y, plot.w, 1, color);
        }
    }
}

fn x_px(plot: Rect, at: f64) -> i64 {
    plot.x + (at * plot.w as f64).round() as i64
}

fn y_px(plot: Rect, at: f64) -> i64 {
    plot.y + plot.h - (at * plot.h as f64).round() as i64
}

/// Joins consecutive shown points (a `None` breaks the line), then marks each point.
fn draw_series(canvas: &mut Canvas, path: &[Option<Point>], style: Style) {
    let mut dash_phase = 0.0;
    for pair in path.windows(2) {
        if let [Some(from), Some(to)] = *pair {
            canvas.segment(from, to, &style.pen, dash_phase);
            dash_phase += (to.0 - from.0).hypot(to.1 - from.1);
        } else {
            dash_phase = 0.0;
        }
    }
    for &at in path.iter().flatten() {
        canvas.marker(at, style.marker, MARKER_RADIUS, style.pen.color);
    }
}

fn draw_frame(canvas: &mut Canvas, plot: Rect) {
    canvas.fill_rect(plot.x, plot.y, plot.w + 1, 1, FRAME);
    canvas.fill_rect(plot.x, plot.y + plot.h, plot.w + 1, 1, FRAME);
    canvas.fill_rect(plot.x, plot.y, 1, plot.h + 1, FRAME);
    canvas.fill_rect(plot.x + plot.w, plot.y, 1, plot.h + 1, FRAME);
}

/// Tick marks outside the frame and their labels: centred under x ticks, right-aligned beside y
/// ticks and centred on them.
fn draw_tick_labels(canvas: &mut Canvas, plot: Rect, x_ticks: &[Tick], y_ticks: &[Tick]) {
    let below = plot.y + plot.h;
    for tick in x_ticks {
        let x = x_px(plot, tick.at);
        if let Some(label) = &tick.label {
            canvas.fill_rect(x, below, 1, TICK_LENGTH, FRAME);
            let label_x = x - text_width(label, TEXT_SCALE) / 2;
            canvas.text(
                label_x,
                below + TICK_LENGTH + LABEL_GAP,
                label,
                TEXT_SCALE,
                INK,
            );
        } else {
            canvas.fill_rect(x, below, 1, TICK_LENGTH / 2, FRAME);
        }
    }
    for tick in y_ticks {
        let y = y_px(plot, tick.at);
        if let Some(label) = &tick.label {
            canvas.fill_rect(plot.x - TICK_LENGTH, y, TICK_LENGTH, 1, FRAME);
            let label_x = plot.x - TICK_LENGTH - LABEL_GAP - text_width(label, TEXT_SCALE);
            let label_y = y - CAP_HEIGHT * TEXT_SCALE / 2;
            canvas.text(label_x, label_y, label, TEXT_SCALE, INK);
        } else {
            canvas.fill_rect(plot.x - TICK_LENGTH / 2, y, TICK_LENGTH / 2, 1, FRAME);
        }
    }
}

fn centred_note(canvas: &mut Canvas, area: Rect, note: &str) {
    let x = area.x + (area.w - text_width(note, TEXT_SCALE)) / 2;
    let y = area.y + (area.h - CAP_HEIGHT * TEXT_SCALE) / 2;
    canvas.text(x, y, note, TEXT_SCALE, FAINT_INK);
}

impl Legend {
    /// Lays the labels out in centred rows that fit `width`; a label too long for a row gets
    /// one of its own and is clipped at the image's edge.
    fn place(labels: &[String], width: i64) -> Legend {
        let room = width - 2 * MARGIN;
        let entry_w = |label: &str| LEGEND_SAMPLE + 8 + text_width(label, TEXT_SCALE);
        let mut rows: Vec<Vec<&String>> = Vec::new();
        let mut used = 0;
        for label in labels {
            let w = entry_w(label);
            match rows.last_mut() {
                Some(row) if used + LEGEND_SPACING + w <= room => {
                    row.push(label);
                    used += LEGEND_SPACING + w;
                }
                _ => {
                    rows.push(vec![label]);
                    used = w;
                }
            }
        }
        let rows = rows
            .into_iter()
            .map(|row| {
                let total: i64 = row.iter().map(|l| entry_w(l)).sum::<i64>()
                    + LEGEND_SPACING * (row.len() as i64 - 1);
                let mut x = MARGIN + (room - total).max(0) / 2;
                row.into_iter()
                    .map(|label| {
                        let at = x;
                        x += entry_w(label) + LEGEND_SPACING;
                        (label.clone(), at)
                    })
                    .collect()
            })
            .collect();
        Legend { rows }
    }

    /// Draws each entry as a short stroke with its marker, then its label.
    fn draw(&self, canvas: &mut Canvas, top: i64, styles: &Styles) {
        for (r, row) in self.rows.iter().enumerate() {
            let centre_y = top + r as i64 * LEGEND_ROW + LEGEND_ROW / 2;
            for (label, x) in row {
                let style = styles.of(label);
                let (from, to) = (*x as f64, (*x + LEGEND_SAMPLE) as f64);
                let y = centre_y as f64;
                canvas.segment((from, y), (to, y), &style.pen, 0.0);
                let middle = (from + to) / 2.0;
                canvas.marker((middle, y), style.marker, MARKER_RADIUS, style.pen.color);
                let label_y = centre_y - CAP_HEIGHT * TEXT_SCALE / 2;
                canvas.text(x + LEGEND_SAMPLE + 8, label_y, label, TEXT_SCALE, INK);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A latency panel and a bus-bandwidth panel, each with four series, as the collective
    /// examples draw them.
    fn sample_chart() -> Chart {
        let sizes: Vec<f64> = (3..=30).map(|k| f64::from(1u32 << k)).collect();
        let series = |label: &str, base_us: f64, peak_gbs: f64, busbw: bool| Series {
            label: label.to_string(),
            points: sizes
                .iter()
                .map(|&bytes| {
                    let us = base_us + bytes / (peak_gbs * 1e3);
                    let y = if busbw { bytes / us / 1e3 } else { us };
                    (bytes, y)
                })
                .collect(),
        };
        let lines = [
            ("doorbell ll", 3.1, 150.0),
            ("doorbell simple", 9.0, 360.0),
            ("nccl ring", 18.0, 330.0),
            ("nccl tree", 22.0, 280.0),
        ];
        let panel = |title: &str, y_label: &str, busbw: bool| Panel {
            title: title.to_string(),
            y_label: y_label.to_string(),
            log_y: !busbw,
            series: lines
                .iter()
                .map(|&(label, base, peak)| series(label, base, peak, busbw))
                .collect(),
        };
        Chart {
            title: "allreduce, 8 x H100 (fp32, sum)".to_string(),
            x_label: "message size".to_string(),
            panels: vec![
                panel("latency", "latency (us)", false),
                panel("bus bandwidth", "busbw (GB/s)", true),
            ],
        }
    }

    fn temp_png(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("doorbell-plot-{}-{name}.png", std::process::id()))
    }

    fn pixel(rgb: &[u8], width: u32, x: i64, y: i64) -> Rgb {
        let at = ((y * i64::from(width) + x) * 3) as usize;
        [rgb[at], rgb[at + 1], rgb[at + 2]]
    }

    /// Whether any pixel of `area` has exactly `color`.
    fn has_color(rgb: &[u8], width: u32, area: Rect, color: Rgb) -> bool {
        (area.y..area.y + area.h)
            .any(|y| (area.x..area.x + area.w).any(|x| pixel(rgb, width, x, y) == color))
    }

    fn has_ink(rgb: &[u8], width: u32, area: Rect) -> bool {
        (area.y..area.y + area.h)
            .any(|y| (area.x..area.x + area.w).any(|x| pixel(rgb, width, x, y) != BACKGROUND))
    }

    #[test]
    fn png_file_has_the_rendered_size_and_pixels() {
        let chart = sample_chart();
        let path = temp_png("two-panels");
        chart.render_png(&path).expect("writable temp dir");
        let bytes = std::fs::read(&path).expect("just written");
        let _ = std::fs::remove_file(&path);

        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        let width = u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        let height = u32::from_be_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
        assert_eq!(width, 2 * PANEL_WIDTH);
        assert!((650..=750).contains(&height), "height {height}");

        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
            .read_info()
            .expect("a PNG the png crate reads back");
        let mut decoded = vec![0; reader.output_buffer_size().expect("small image")];
        let info = reader.next_frame(&mut decoded).expect("one frame");
        assert_eq!((info.width, info.height), (width, height));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(decoded, chart.render_rgb().2);
    }

    #[test]
    fn legend_axes_and_titles_are_drawn() {
        let chart = sample_chart();
        let (width, height, rgb) = chart.render_rgb();
        assert_eq!(rgb.len(), width as usize * height as usize * 3);
        let w = i64::from(width);
        let title_band = 2 * MARGIN + text_height(TITLE_SCALE);
        let legend_top = title_band + i64::from(PANEL_HEIGHT);

        // The legend shows every series' colour at full strength (its stroke and marker).
        let legend = Rect {
            x: 0,
            y: legend_top,
            w,
            h: i64::from(height) - legend_top,
        };
        for (i, &color) in PALETTE.iter().take(4).enumerate() {
            assert!(has_color(&rgb, width, legend, color), "series {i}");
        }
        assert!(has_color(&rgb, width, legend, INK), "legend labels");
        assert!(
            has_ink(
                &rgb,
                width,
                Rect {
                    x: 0,
                    y: 0,
                    w,
                    h: title_band
                }
            ),
            "title"
        );
        for panel in 0..2 {
            let x = panel * i64::from(PANEL_WIDTH);
            // Rotated y label and tick labels in the left margin of each panel.
            let margin = Rect {
                x: x + MARGIN,
                y: title_band + 60,
                w: 80,
                h: 400,
            };
            assert!(
                has_color(&rgb, width, margin, INK),
                "panel {panel} y labels"
            );
            // x tick labels under the plot.
            let under = Rect {
                x: x + 120,
                y: legend_top - 70,
                w: 600,
                h: 40,
            };
            assert!(has_color(&rgb, width, under, INK), "panel {panel} x labels");
            assert!(
                has_color(&rgb, width, under, FRAME),
                "panel {panel} x ticks"
            );
            let inside = Rect {
                x: x + 150,
                y: title_band + 60,
                w: 500,
                h: 400,
            };
            assert!(has_color(&rgb, width, inside, GRID), "panel {panel} grid");
        }
    }

    #[test]
    fn series_keep_their_style_across_panels() {
        let chart = Chart {
            panels: vec![
                Panel {
                    series: vec![Series::default(), series_named("b"), series_named("c")],
                    ..Panel::default()
                },
                Panel {
                    series: vec![series_named("c"), series_named("a")],
                    ..Panel::default()
                },
            ],
            ..Chart::default()
        };
        let styles = chart.styles();
        assert_eq!(styles.labels, ["", "b", "c", "a"]);
        assert_eq!(styles.of("c"), Style::nth(2));
        let colors: Vec<Rgb> = (0..8).map(|i| Style::nth(i).pen.color).collect();
        for (i, c) in colors.iter().enumerate() {
            assert!(!colors[..i].contains(c), "eight series, eight colours");
        }
    }

    fn series_named(label: &str) -> Series {
        Series {
            label: label.to_string(),
            points: vec![(8.0, 1.0), (64.0, 2.0)],
        }
    }

    #[test]
    fn empty_and_degenerate_input_renders_without_panicking() {
        let awkward = vec![
            Series::default(),
            Series {
                label: "one point".to_string(),
                points: vec![(1024.0, 5.0)],
            },
            Series {
                label: "nothing drawable".to_string(),
                points: vec![
                    (f64::NAN, 1.0),
                    (0.0, 1.0),
                    (-8.0, 2.0),
                    (8.0, f64::INFINITY),
                    (16.0, f64::NAN),
                ],
            },
            Series {
                label: "gaps, zeros and extremes".to_string(),
                points: vec![
                    (8.0, 0.0),
                    (16.0, -3.0),
                    (32.0, 1e-300),
                    (64.0, f64::NAN),
                    (1e300, 1e300),
                    (f64::MIN_POSITIVE, 7.0),
                ],
            },
            Series {
                label: "flat".to_string(),
                points: vec![(4096.0, 0.0); 3],
            },
            Series {
                label: "unicode \u{b5}s and a very long label ".repeat(8),
                points: vec![(4096.0, 2.0), (4096.0, 2.0)],
            },
        ];
        let panels = |series: Vec<Series>| {
            vec![
                Panel {
                    log_y: true,
                    series: series.clone(),
                    ..Panel::default()
                },
                Panel {
                    log_y: false,
                    series,
                    title: "t".to_string(),
                    y_label: "y".to_string(),
                },
            ]
        };
        let charts = [
            Chart::default(),
            Chart {
                panels: vec![Panel::default()],
                ..Chart::default()
            },
            Chart {
                title: "awkward".to_string(),
                x_label: "bytes".to_string(),
                panels: panels(awkward.clone()),
            },
        ]
        .into_iter()
        .chain(awkward.into_iter().map(|s| Chart {
            panels: panels(vec![s]),
            ..Chart::default()
        }));
        for chart in charts {
            let (width, height, rgb) = chart.render_rgb();
            assert!(width >= PANEL_WIDTH && height >= PANEL_HEIGHT);
            assert_eq!(rgb.len(), width as usize * height as usize * 3);
        }
    }

    #[test]
    fn an_unwritable_path_is_an_io_error() {
        let path = temp_png("missing-dir").join("plot.png");
        match Chart::default().render_png(&path) {
            Err(Error::Io { what, .. }) => assert!(what.contains("plot.png"), "{what}"),
            other => panic!("expected an Io error, got {other:?}"),
        }
    }
}
