//! An RGB pixel buffer and the few things a chart draws on it: rectangles, thick anti-aliased line
//! segments (solid or dashed), markers and bitmap text. Everything clips to the image and skips
//! non-finite coordinates, so callers may hand it any point.

use super::font::{self, GLYPH_HEIGHT, GLYPH_WIDTH};

/// A colour as red, green, blue.
pub(super) type Rgb = [u8; 3];

/// A position in pixels; (0, 0) is the top-left corner of the image.
pub(super) type Point = (f64, f64);

/// Horizontal distance from one glyph to the next, before scaling.
const ADVANCE: i64 = GLYPH_WIDTH as i64 + 1;
/// Height of a capital letter or digit, before scaling; text is centred on it.
pub(super) const CAP_HEIGHT: i64 = 7;
/// Samples per pixel along each axis when filling a marker.
const SUPERSAMPLE: u32 = 4;

/// How a line is stroked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Pen {
    /// Stroke colour.
    pub color: Rgb,
    /// Stroke width in pixels.
    pub width: f64,
    /// Dash length and gap in pixels; `None` for a solid line.
    pub dash: Option<(f64, f64)>,
}

/// The shape drawn at each data point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Cross,
    Plus,
    HollowSquare,
}

impl Marker {
    /// Whether (`u`, `v`) lies inside the shape, in units of the marker's radius (`v` grows
    /// downwards).
    fn contains(self, u: f64, v: f64) -> bool {
        let (au, av) = (u.abs(), v.abs());
        match self {
            Marker::Circle => u * u + v * v <= 1.0,
            Marker::Square => au.max(av) <= 0.8,
            Marker::TriangleUp => (-1.0..=0.75).contains(&v) && au <= (v + 1.0) / 1.5,
            Marker::TriangleDown => (-0.75..=1.0).contains(&v) && au <= (1.0 - v) / 1.5,
            Marker::Diamond => au + av <= 1.1,
            Marker::Cross => (au - av).abs() <= 0.4 && au.max(av) <= 0.95,
            Marker::Plus => au.min(av) <= 0.25 && au.max(av) <= 1.05,
            Marker::HollowSquare => (0.5..=0.85).contains(&au.max(av)),
        }
    }
}

/// Width in pixels of `text` at `scale`.
pub(super) fn text_width(text: &str, scale: i64) -> i64 {
    match text.chars().count() as i64 {
        0 => 0,
        n => (n * ADVANCE - 1) * scale,
    }
}

/// Height in pixels of a line of text at `scale`, descenders included.
pub(super) fn text_height(scale: i64) -> i64 {
    GLYPH_HEIGHT as i64 * scale
}

/// An RGB image, 8 bits per channel, rows top to bottom.
pub(super) struct Canvas {
    width: i64,
    height: i64,
    pixels: Vec<u8>,
}

impl Canvas {
    /// A `width` x `height` image filled with `background`.
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        let count = width as usize * height as usize;
        Canvas {
            width: i64::from(width),
            height: i64::from(height),
            pixels: background.repeat(count),
        }
    }

    /// The pixels, three bytes each, row by row.
    pub fn into_rgb(self) -> Vec<u8> {
        self.pixels
    }

    /// Mixes `color` into pixel (`x`, `y`) by `coverage` (0 keeps the pixel, 1 replaces it).
    fn blend(&mut self, x: i64, y: i64, color: Rgb, coverage: f64) {
        if !(0..self.width).contains(&x) || !(0..self.height).contains(&y) {
            return;
        }
        let at = ((y * self.width + x) * 3) as usize;
        let coverage = coverage.clamp(0.0, 1.0);
        for (pixel, &c) in self.pixels[at..at + 3].iter_mut().zip(&color) {
            let mixed = f64::from(*pixel) + (f64::from(c) - f64::from(*pixel)) * coverage;
            *pixel = mixed.round() as u8;
        }
    }

    /// Fills the `w` x `h` rectangle whose top-left corner is (`x`, `y`).
    pub fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, color: Rgb) {
        let (x0, x1) = (x.max(0), x.saturating_add(w).min(self.width));
        let (y0, y1) = (y.max(0), y.saturating_add(h).min(self.height));
        for row in y0..y1 {
            for col in x0..x1 {
                let at = ((row * self.width + col) * 3) as usize;
                self.pixels[at..at + 3].copy_from_slice(&color);
            }
        }
    }

    /// The pixel range, clipped to the image, that a shape spanning `lo..=hi` on an axis of
    /// `size` pixels can touch; empty when it lies outside or is not finite.
    fn span(lo: f64, hi: f64, size: i64) -> std::ops::Range<i64> {
        if !(lo.is_finite() && hi.is_finite()) || hi < 0.0 || lo >= size as f64 {
            return 0..0;
        }
        (lo.floor().max(0.0) as i64)..(hi.ceil().min(size as f64 - 1.0) as i64 + 1)
    }

    /// Strokes the segment `from`-`to` with round ends. `dash_phase` is how far along the dash
    /// pattern `from` lies, so that a polyline's dashes run on across its joints.
    pub fn segment(&mut self, from: Point, to: Point, pen: &Pen, dash_phase: f64) {
        let half = pen.width / 2.0;
        let reach = half + 1.0;
        let xs = Self::span(
            from.0.min(to.0) - reach,
            from.0.max(to.0) + reach,
            self.width,
        );
        let ys = Self::span(
            from.1.min(to.1) - reach,
            from.1.max(to.1) + reach,
            self.height,
        );
        let (dx, dy) = (to.0 - from.0, to.1 - from.1);
        let length_sq = dx * dx + dy * dy;
        let length = length_sq.sqrt();
        for y in ys {
            for x in xs.clone() {
                let (px, py) = (x as f64 + 0.5, y as f64 + 0.5);
                let t = if length_sq > 0.0 {
                    (((px - from.0) * dx + (py - from.1) * dy) / length_sq).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let distance = (px - from.0 - t * dx).hypot(py - from.1 - t * dy);
                let coverage = half + 0.5 - distance;
                if coverage <= 0.0 {
                    continue;
                }
                if let Some((on, off)) = pen.dash {
                    if (dash_phase + t * length).rem_euclid(on + off) >= on {
                        continue;
                    }
                }
                self.blend(x, y, pen.color, coverage);
            }
        }
    }

    /// Fills `shape` centred on `at`, `radius` pixels from centre to edge, anti-aliased by
    /// supersampling.
    pub fn marker(&mut self, at: Point, shape: Marker, radius: f64, color: Rgb) {
        let xs = Self::span(at.0 - radius - 1.0, at.0 + radius + 1.0, self.width);
        let ys = Self::span(at.1 - radius - 1.0, at.1 + radius + 1.0, self.height);
        let n = f64::from(SUPERSAMPLE);
        for y in ys {
            for x in xs.clone() {
                let mut inside = 0u32;
                for sy in 0..SUPERSAMPLE {
                    for sx in 0..SUPERSAMPLE {
                        let u = (x as f64 + (f64::from(sx) + 0.5) / n - at.0) / radius;
                        let v = (y as f64 + (f64::from(sy) + 0.5) / n - at.1) / radius;
                        inside += u32::from(shape.contains(u, v));
                    }
                }
                if inside > 0 {
                    self.blend(x, y, color, f64::from(inside) / (n * n));
                }
            }
        }
    }

    /// Writes `text` left to right with its top-left corner at (`x`, `y`), each font pixel a
    /// `scale` x `scale` block.
    pub fn text(&mut self, x: i64, y: i64, text: &str, scale: i64, color: Rgb) {
        for (i, c) in text.chars().enumerate() {
            let left = x.saturating_add(i as i64 * ADVANCE * scale);
            if left >= self.width {
                break;
            }
            self.glyph(
                c,
                |gx, gy| (left + gx * scale, y + gy * scale),
                scale,
                color,
            );
        }
    }

    /// Writes `text` rotated a quarter turn anticlockwise, reading bottom to top, inside the box
    /// whose top-left corner is (`x`, `y`): [`text_height`] wide and [`text_width`] tall.
    pub fn text_up(&mut self, x: i64, y: i64, text: &str, scale: i64, color: Rgb) {
        let bottom = y + text_width(text, scale);
        for (i, c) in text.chars().enumerate() {
            let along = i as i64 * ADVANCE * scale;
            if bottom - along < 0 {
                break;
            }
            let place = |gx: i64, gy: i64| (x + gy * scale, bottom - along - (gx + 1) * scale);
            self.glyph(c, place, scale, color);
        }
    }

    /// Fills a block for each lit pixel of `c`'s glyph at the corner `place` gives for it.
    fn glyph(&mut self, c: char, place: impl Fn(i64, i64) -> (i64, i64), scale: i64, color: Rgb) {
        let glyph = font::glyph(c);
        for gy in 0..GLYPH_HEIGHT {
            for gx in 0..GLYPH_WIDTH {
                if font::lit(glyph, gx, gy) {
                    let (px, py) = place(gx as i64, gy as i64);
                    self.fill_rect(px, py, scale, scale, color);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WHITE: Rgb = [255, 255, 255];
    const BLACK: Rgb = [0, 0, 0];

    fn dark_pixels(canvas: &Canvas) -> usize {
        canvas.pixels.chunks(3).filter(|p| p[0] < 128).count()
    }

    #[test]
    fn drawing_outside_or_at_infinity_is_clipped_not_a_panic() {
        let mut canvas = Canvas::new(20, 10, WHITE);
        let pen = Pen {
            color: BLACK,
            width: 2.0,
            dash: Some((4.0, 2.0)),
        };
        canvas.segment((-1e12, 5.0), (1e12, 5.0), &pen, 0.0);
        canvas.segment((f64::NAN, 0.0), (5.0, f64::INFINITY), &pen, 0.0);
        canvas.segment((3.0, 3.0), (3.0, 3.0), &pen, 0.0);
        canvas.marker((-50.0, -50.0), Marker::Circle, 5.0, BLACK);
        canvas.marker((f64::NAN, 2.0), Marker::Cross, 5.0, BLACK);
        canvas.text(-7, -3, "clipped", 2, BLACK);
        canvas.text(i64::MAX - 5, 0, "far", 2, BLACK);
        canvas.text_up(15, -40, "up", 3, BLACK);
        canvas.fill_rect(i64::MIN, i64::MIN, i64::MAX, i64::MAX, BLACK);
        assert_eq!(canvas.into_rgb().len(), 20 * 10 * 3);
    }

    #[test]
    fn a_horizontal_segment_is_two_pixels_thick() {
        let mut canvas = Canvas::new(20, 10, WHITE);
        let pen = Pen {
            color: BLACK,
            width: 2.0,
            dash: None,
        };
        canvas.segment((2.0, 5.0), (18.0, 5.0), &pen, 0.0);
        let column: Vec<u8> = (0..10).map(|y| canvas.pixels[(y * 20 + 10) * 3]).collect();
        assert_eq!(column, [255, 255, 255, 255, 0, 0, 255, 255, 255, 255]);
    }

    #[test]
    fn dashes_leave_gaps() {
        let solid = Pen {
            color: BLACK,
            width: 2.0,
            dash: None,
        };
        let dashed = Pen {
            dash: Some((6.0, 6.0)),
            ..solid
        };
        let mut a = Canvas::new(100, 10, WHITE);
        let mut b = Canvas::new(100, 10, WHITE);
        a.segment((2.0, 5.0), (98.0, 5.0), &solid, 0.0);
        b.segment((2.0, 5.0), (98.0, 5.0), &dashed, 0.0);
        let (a, b) = (dark_pixels(&a), dark_pixels(&b));
        assert!(b * 3 > a && b * 3 < a * 2, "solid {a}, dashed {b}");
    }

    #[test]
    fn text_up_is_text_turned_a_quarter() {
        let mut across = Canvas::new(40, 40, WHITE);
        let mut up = Canvas::new(40, 40, WHITE);
        across.text(0, 0, "Lg1", 1, BLACK);
        up.text_up(0, 0, "Lg1", 1, BLACK);
        let (w, h) = (text_width("Lg1", 1), text_height(1));
        for y in 0..h {
            for x in 0..w {
                let a = across.pixels[((y * 40 + x) * 3) as usize];
                let b = up.pixels[(((w - 1 - x) * 40 + y) * 3) as usize];
                assert_eq!(a, b, "font pixel ({x}, {y})");
            }
        }
        assert!(dark_pixels(&across) > 0);
    }

    #[test]
    fn every_marker_is_filled_near_its_centre() {
        for shape in [
            Marker::Circle,
            Marker::Square,
            Marker::TriangleUp,
            Marker::Diamond,
            Marker::TriangleDown,
            Marker::Cross,
            Marker::Plus,
            Marker::HollowSquare,
        ] {
            let mut canvas = Canvas::new(20, 20, WHITE);
            canvas.marker((10.0, 10.0), shape, 5.0, BLACK);
            let dark = dark_pixels(&canvas);
            assert!((10..=120).contains(&dark), "{shape:?}: {dark} dark pixels");
        }
    }
}
