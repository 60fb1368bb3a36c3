//! Line charts of benchmark results, drawn with plotters and written as PNG: panels side by side
//! over a message-size x axis (log2, labelled `8B`, `32K`, `1G`), each with its own y axis (log10
//! with 1-2-5 ticks, or linear from zero), grid lines, and one legend for the whole chart below
//! them.
//!
//! Text is set in Noto Sans, which `ttf-noto-sans` embeds in the binary, through plotters'
//! `ab_glyph` renderer: plotting needs no system fonts, fontconfig or font files, so it works on a
//! bare GPU machine. A series keeps its colour, marker and dash in every panel: styles follow
//! labels, in order of first appearance. Values an axis cannot show (NaN, infinities, zero or
//! negative on a log axis) are skipped and break the line there; empty panels and series draw as
//! empty axes. Rendering never panics on its input.

mod axis;

use std::collections::HashMap;
use std::fmt::Display;
use std::path::Path;
use std::sync::OnceLock;

use axis::{Axis, Mapping};
use doorbell::{Error, Result};
use plotters::coord::{CoordTranslate, Shift};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};

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

const BACKGROUND: RGBColor = RGBColor(255, 255, 255);
const INK: RGBColor = RGBColor(32, 32, 32);
const FAINT_INK: RGBColor = RGBColor(150, 150, 150);
const FRAME: RGBColor = RGBColor(64, 64, 64);
const GRID: RGBColor = RGBColor(214, 214, 214);
const MINOR_GRID: RGBColor = RGBColor(238, 238, 238);

/// Colours for series in order (the Tableau 10 palette), then markers and dashes to tell them apart
/// in grey or beyond ten series.
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
/// The first ten series are solid; later rounds of the palette are dashed, then dotted
/// (`(dash, gap)` in pixels).
const DASHES: [Option<(i32, i32)>; 3] = [None, Some((10, 6)), Some((3, 4))];

const LINE_WIDTH: u32 = 2;
const MARKER_RADIUS: i32 = 5;

/// Font sizes in pixels.
const TITLE_SIZE: u32 = 30;
const PANEL_TITLE_SIZE: u32 = 22;
const AXIS_TITLE_SIZE: u32 = 20;
const LABEL_SIZE: u32 = 18;
const LEGEND_SIZE: u32 = 19;

const MARGIN: u32 = 16;
/// Height of the band the chart title sits in.
const TITLE_BAND: u32 = 56;
/// Tick marks stick this far out of the frame; plotters sets their labels twice as far.
const TICK_LENGTH: u32 = 6;
/// Room under the plot for the x tick labels and the x axis title.
const X_LABEL_AREA: u32 = 58;
/// Least distance between the centres of two x labels and of two y labels.
const X_LABEL_PITCH: u32 = 80;
const Y_LABEL_PITCH: u32 = 34;
const LEGEND_ROW: u32 = 32;
const LEGEND_SAMPLE: i32 = 40;
const LEGEND_GAP: i32 = 8;
const LEGEND_SPACING: i32 = 36;

/// The family name plotters' `ab_glyph` renderer finds the embedded font under.
const FONT: &str = "sans-serif";
/// plotters centres text on the layout box `ab_glyph` reports, which sits above the glyphs:
/// digits and capitals come out centred on the anchor when it is moved down by this fraction of
/// the font size (measured on Noto Sans from 18 to 30 pixels).
const CENTRE_DROP: f64 = 0.17;

/// Series markers, drawn at every point and in the legend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Cross,
    Plus,
    HollowSquare,
}

/// How one series is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Style {
    color: RGBColor,
    marker: Marker,
    dash: Option<(i32, i32)>,
}

impl Style {
    fn nth(index: usize) -> Style {
        Style {
            color: PALETTE[index % PALETTE.len()],
            marker: MARKERS[index % MARKERS.len()],
            dash: DASHES[(index / PALETTE.len()) % DASHES.len()],
        }
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

impl Chart {
    /// Renders the chart and writes it to `path` as an 8-bit RGB PNG, whatever the file name.
    pub fn render_png(&self, path: &Path) -> Result<()> {
        let (width, height, rgb) = self.render_rgb()?;
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
    pub fn render_rgb(&self) -> Result<(u32, u32, Vec<u8>)> {
        register_embedded_font()?;
        let styles = self.styles();
        let panels = u32::try_from(self.panels.len().max(1)).unwrap_or(u32::MAX);
        let width = PANEL_WIDTH.saturating_mul(panels);
        let legend = Legend::place(&styles.labels, width)?;
        let title_band = if self.title.is_empty() {
            MARGIN
        } else {
            TITLE_BAND
        };
        let height = title_band + PANEL_HEIGHT + legend.height();
        let mut rgb = vec![0; width as usize * height as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
            self.draw(&root, title_band, &legend, &styles)?;
            root.present().map_err(drawing)?;
        }
        Ok((width, height, rgb))
    }

    /// Draws the chart on `root`: the title in a band `title_band` pixels high, the panels side by
    /// side under it, and the legend at the bottom.
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        title_band: u32,
        legend: &Legend,
        styles: &Styles,
    ) -> Result<()> {
        root.fill(&BACKGROUND).map_err(drawing)?;
        let (top, rest) = root.split_vertically(title_band);
        let (panels_area, legend_area) = rest.split_vertically(PANEL_HEIGHT);
        let centred = Pos::new(HPos::Center, VPos::Center);
        let (width, _) = top.dim_in_pixel();
        let title_at = (
            width as i32 / 2,
            title_band as i32 / 2 + centre_drop(TITLE_SIZE),
        );
        top.draw_text(&self.title, &text(TITLE_SIZE).pos(centred), title_at)
            .map_err(drawing)?;
        if self.panels.is_empty() {
            centred_note(&panels_area, "no data")?;
        }
        let areas = panels_area.split_evenly((1, self.panels.len().max(1)));
        for (panel, area) in self.panels.iter().zip(&areas) {
            draw_panel(area, panel, &self.x_label, styles)?;
        }
        legend.draw(&legend_area, styles)
    }

    /// Every distinct series label in order of first appearance, each with its style.
    fn styles(&self) -> Styles {
        let mut styles = Styles::default();
        // Series with nothing to draw (a baseline that was skipped) get no legend entry.
        let drawn = |s: &&Series| s.points.iter().any(|(x, y)| x.is_finite() && y.is_finite());
        for series in self.panels.iter().flat_map(|p| &p.series).filter(drawn) {
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

/// Registers the embedded Noto Sans with plotters, once per process.
fn register_embedded_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *REGISTERED
        .get_or_init(|| register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok());
    if registered {
        Ok(())
    } else {
        Err(Error::io(
            "loading the plot font",
            std::io::Error::other("the embedded Noto Sans is not a font ab_glyph can read"),
        ))
    }
}

/// plotters' errors (a text it could not lay out, in practice) as doorbell's.
fn drawing(e: impl Display) -> Error {
    Error::io("drawing the plot", std::io::Error::other(e.to_string()))
}

fn text(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&INK)
}

/// How far below a line to anchor text of `size` that is to look centred on it.
fn centre_drop(size: u32) -> i32 {
    (f64::from(size) * CENTRE_DROP).round() as i32
}

/// Width of `s` in pixels when set at `size`.
fn text_width(s: &str, size: u32) -> Result<i32> {
    let (w, _) = (FONT, size).into_font().box_size(s).map_err(drawing)?;
    Ok(i32::try_from(w).unwrap_or(i32::MAX))
}

fn centred_note<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, note: &str) -> Result<()> {
    let (w, h) = area.dim_in_pixel();
    let style = (FONT, LABEL_SIZE)
        .into_font()
        .color(&FAINT_INK)
        .pos(Pos::new(HPos::Center, VPos::Center));
    let at = (w as i32 / 2, h as i32 / 2 + centre_drop(LABEL_SIZE));
    area.draw_text(note, &style, at).map_err(drawing)
}

/// A series' points as positions on the axes, `None` where an axis cannot show the point.
type Positions = Vec<Option<(f64, f64)>>;

/// Draws one panel inside `area`: title, grid, axes with their labels, series and frame.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    x_label: &str,
    styles: &Styles,
) -> Result<()> {
    let y_map = if panel.log_y {
        Mapping::Log10
    } else {
        Mapping::Linear
    };
    let place = |&(x, y): &(f64, f64)| Some((Mapping::Log2Bytes.map(x)?, y_map.map(y)?));
    let paths: Vec<(&Series, Positions)> = panel
        .series
        .iter()
        .map(|s| (s, s.points.iter().map(place).collect()))
        .collect();
    let shown = || paths.iter().flat_map(|(_, path)| path.iter().flatten());
    let caption = if panel.title.is_empty() {
        0
    } else {
        PANEL_TITLE_SIZE + 8
    };
    let plot_height = PANEL_HEIGHT.saturating_sub(2 * MARGIN + X_LABEL_AREA + caption);
    let y_axis = Axis::fit(
        y_map,
        shown().map(|p| p.1),
        (plot_height / Y_LABEL_PITCH) as usize,
    );
    let widest_y_label = y_axis
        .ticks
        .iter()
        .map(|t| text_width(&t.label, LABEL_SIZE))
        .try_fold(0, |w, t| t.map(|t| w.max(t)))?;
    let y_title = if panel.y_label.is_empty() {
        0
    } else {
        AXIS_TITLE_SIZE + 8
    };
    let y_label_area = y_title + widest_y_label as u32 + 3 * TICK_LENGTH;
    let plot_width = PANEL_WIDTH.saturating_sub(2 * MARGIN + y_label_area);
    let x_axis = Axis::fit(
        Mapping::Log2Bytes,
        shown().map(|p| p.0),
        (plot_width / X_LABEL_PITCH) as usize,
    );

    let mut builder = ChartBuilder::on(area);
    builder
        .margin(MARGIN)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(y_label_area);
    if !panel.title.is_empty() {
        builder.caption(&panel.title, text(PANEL_TITLE_SIZE));
    }
    let mut chart = builder
        .build_cartesian_2d(x_axis.clone(), y_axis.clone())
        .map_err(drawing)?;
    let x_tick_label = |at: &f64| x_axis.label_at(*at);
    let y_tick_label = |at: &f64| y_axis.label_at(*at);
    let mut mesh = chart.configure_mesh();
    mesh.x_label_formatter(&x_tick_label)
        .y_label_formatter(&y_tick_label)
        .label_style(text(LABEL_SIZE))
        .axis_desc_style(text(AXIS_TITLE_SIZE))
        .bold_line_style(GRID)
        .light_line_style(MINOR_GRID)
        .axis_style(FRAME)
        .set_all_tick_mark_size(TICK_LENGTH)
        .y_label_offset(centre_drop(LABEL_SIZE));
    if !x_label.is_empty() {
        mesh.x_desc(x_label);
    }
    if !panel.y_label.is_empty() {
        mesh.y_desc(&panel.y_label);
    }
    mesh.draw().map_err(drawing)?;

    let plot = chart.plotting_area();
    for (series, path) in &paths {
        let style = styles.of(&series.label);
        // Consecutive shown points make one stroke; a point that cannot be shown breaks it.
        for run in path.split(Option::is_none) {
            let run: Vec<(f64, f64)> = run.iter().flatten().copied().collect();
            draw_line(plot, run, style)?;
        }
        for &at in path.iter().flatten() {
            draw_marker(plot, at, style)?;
        }
    }
    let plot = plot.strip_coord_spec();
    if shown().next().is_none() {
        centred_note(&plot, "no data")?;
    }
    // The mesh drew the left and bottom edges as axis lines, just outside the plot.
    let (w, h) = plot.dim_in_pixel();
    let (right, bottom) = (w as i32 - 1, h as i32 - 1);
    let top_and_right = vec![(0, 0), (right, 0), (right, bottom)];
    plot.draw(&PathElement::new(top_and_right, FRAME.stroke_width(1)))
        .map_err(drawing)
}

/// Joins `points` (in `area`'s coordinates) with the series' stroke.
fn draw_line<DB, CT>(area: &DrawingArea<DB, CT>, points: Vec<CT::From>, style: Style) -> Result<()>
where
    DB: DrawingBackend,
    CT: CoordTranslate,
    CT::From: Clone,
{
    if points.len() < 2 {
        return Ok(());
    }
    let stroke = style.color.stroke_width(LINE_WIDTH);
    match style.dash {
        None => area.draw(&PathElement::new(points, stroke)),
        Some((dash, gap)) => area.draw(&DashedPathElement::new(points, dash, gap, stroke)),
    }
    .map_err(drawing)
}

/// Draws the series' marker centred on `at` (in `area`'s coordinates); its size is in pixels.
fn draw_marker<DB, CT>(area: &DrawingArea<DB, CT>, at: CT::From, style: Style) -> Result<()>
where
    DB: DrawingBackend,
    CT: CoordTranslate,
    CT::From: Clone,
{
    let r = MARKER_RADIUS;
    let fill = style.color.filled();
    let stroke = style.color.stroke_width(2);
    let shape =
        |corners: Vec<(i32, i32)>| EmptyElement::at(at.clone()) + Polygon::new(corners, fill);
    match style.marker {
        Marker::Circle => area.draw(&(EmptyElement::at(at.clone()) + Circle::new((0, 0), r, fill))),
        Marker::Square => {
            let s = r - 1;
            area.draw(&(EmptyElement::at(at.clone()) + Rectangle::new([(-s, -s), (s, s)], fill)))
        }
        Marker::HollowSquare => {
            let s = r - 1;
            area.draw(&(EmptyElement::at(at.clone()) + Rectangle::new([(-s, -s), (s, s)], stroke)))
        }
        Marker::TriangleUp => area.draw(&shape(vec![(0, -r - 1), (r + 1, r - 1), (-r - 1, r - 1)])),
        Marker::TriangleDown => {
            area.draw(&shape(vec![(0, r + 1), (r + 1, 1 - r), (-r - 1, 1 - r)]))
        }
        Marker::Diamond => area.draw(&shape(vec![
            (0, -r - 1),
            (r + 1, 0),
            (0, r + 1),
            (-r - 1, 0),
        ])),
        Marker::Cross => area.draw(
            &(EmptyElement::at(at.clone())
                + PathElement::new(vec![(-r, -r), (r, r)], stroke)
                + PathElement::new(vec![(-r, r), (r, -r)], stroke)),
        ),
        Marker::Plus => area.draw(
            &(EmptyElement::at(at.clone())
                + PathElement::new(vec![(-r - 1, 0), (r + 1, 0)], stroke)
                + PathElement::new(vec![(0, -r - 1), (0, r + 1)], stroke)),
        ),
    }
    .map_err(drawing)
}

/// Legend entries placed in centred rows: each label with the left edge of its sample line.
struct Legend {
    rows: Vec<Vec<(String, i32)>>,
}

impl Legend {
    /// Lays the labels out in rows that fit `width`; a label too long for a row gets one of its
    /// own and is clipped at the image's edge.
    fn place(labels: &[String], width: u32) -> Result<Legend> {
        let room = i32::try_from(width).unwrap_or(i32::MAX) - 2 * MARGIN as i32;
        let mut rows: Vec<Vec<(&String, i32)>> = Vec::new();
        let mut used = 0;
        for label in labels {
            let w = LEGEND_SAMPLE + LEGEND_GAP + text_width(label, LEGEND_SIZE)?;
            match rows.last_mut() {
                Some(row) if used + LEGEND_SPACING + w <= room => {
                    row.push((label, w));
                    used += LEGEND_SPACING + w;
                }
                _ => {
                    rows.push(vec![(label, w)]);
                    used = w;
                }
            }
        }
        let rows = rows
            .into_iter()
            .map(|row| {
                let total: i32 =
                    row.iter().map(|(_, w)| w + LEGEND_SPACING).sum::<i32>() - LEGEND_SPACING;
                let mut x = MARGIN as i32 + (room - total).max(0) / 2;
                row.into_iter()
                    .map(|(label, w)| {
                        let at = x;
                        x += w + LEGEND_SPACING;
                        (label.clone(), at)
                    })
                    .collect()
            })
            .collect();
        Ok(Legend { rows })
    }

    /// Pixels the legend takes under the panels.
    fn height(&self) -> u32 {
        self.rows.len() as u32 * LEGEND_ROW + MARGIN
    }

    /// Draws each entry as a short stroke with its marker, then its label.
    fn draw<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        styles: &Styles,
    ) -> Result<()> {
        let label_style = text(LEGEND_SIZE).pos(Pos::new(HPos::Left, VPos::Center));
        for (r, row) in self.rows.iter().enumerate() {
            let y = r as i32 * LEGEND_ROW as i32 + LEGEND_ROW as i32 / 2;
            for (label, x) in row {
                let style = styles.of(label);
                draw_line(area, vec![(*x, y), (x + LEGEND_SAMPLE, y)], style)?;
                draw_marker(area, (x + LEGEND_SAMPLE / 2, y), style)?;
                let at = (x + LEGEND_SAMPLE + LEGEND_GAP, y + centre_drop(LEGEND_SIZE));
                area.draw_text(label, &label_style, at).map_err(drawing)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
