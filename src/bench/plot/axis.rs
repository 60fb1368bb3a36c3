//! Axis scales and their ticks: where a value lands along an axis, which values get a grid line,
//! and how the labels read (`8B`, `32K`, `1G` for message sizes; `0.05`, `20`, `2e6` for numbers).
//!
//! Tick density follows the axis's length in pixels, so labels never overlap however wide the
//! data range is, and every loop here is bounded by that length, not by the data.

use std::f64::consts::LOG10_2;

/// How values map onto an axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mapping {
    /// log2 of a byte count; ticks at powers of two.
    Log2Bytes,
    /// log10; ticks at 1, 2 and 5 times powers of ten.
    Log10,
    /// Linear from zero (or below, for negative data); ticks at a 1, 2, 2.5 or 5 step.
    Linear,
}

/// One grid line.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Tick {
    /// Position along the axis: 0 at the low end, 1 at the high end.
    pub at: f64,
    /// The tick's text; `None` for a grid line without one.
    pub label: Option<String>,
}

/// Grid lines closer than this many pixels are left out.
const MIN_GRID_PX: f64 = 4.0;
/// Share of the rounded data range left empty at each end, so markers clear the frame.
const MARGIN: f64 = 0.03;
/// Tolerance when comparing transformed values that were computed in different ways.
const EPS: f64 = 1e-9;
/// The most ticks an axis draws; reached only by absurd inputs, and then ticks are left out.
const MAX_TICKS: i64 = 4096;

/// log10 of 1, 2 and 5: the "1-2-5" points of a decade.
const LOG10_125: [f64; 3] = [0.0, LOG10_2, 1.0 - LOG10_2];
const MANTISSA_125: [i64; 3] = [1, 2, 5];

/// An axis fitted to data: its ends and how densely it is labelled.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scale {
    mapping: Mapping,
    /// Data range rounded out to tick values (octaves, 1-2-5 points, or multiples of `step`), in
    /// transformed units. These ends are labelled when there is room.
    round_lo: f64,
    round_hi: f64,
    /// The axis ends: the rounded range widened by [`MARGIN`] on each side.
    lo: f64,
    hi: f64,
    /// Linear axes only: the distance between ticks.
    step: f64,
    /// Length of the axis in pixels.
    length_px: f64,
    /// Least distance in pixels between the centres of two labels.
    label_gap_px: f64,
}

impl Mapping {
    /// The value in axis units (log2, log10 or itself), or `None` when this axis cannot show it.
    fn transform(self, v: f64) -> Option<f64> {
        if !v.is_finite() {
            return None;
        }
        match self {
            Mapping::Log2Bytes => (v > 0.0).then(|| v.log2()),
            Mapping::Log10 => (v > 0.0).then(|| v.log10()),
            Mapping::Linear => Some(v),
        }
    }

    /// Whether this axis can show `v`.
    pub fn accepts(self, v: f64) -> bool {
        self.transform(v).is_some()
    }
}

impl Scale {
    /// Fits an axis of `length_px` pixels to `values`, skipping those it cannot show. With no
    /// values at all it spans a default range (1B..1K, 1..10, or 0..1).
    pub fn fit(
        mapping: Mapping,
        values: impl IntoIterator<Item = f64>,
        length_px: f64,
        label_gap_px: f64,
    ) -> Scale {
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for t in values.into_iter().filter_map(|v| mapping.transform(v)) {
            min = min.min(t);
            max = max.max(t);
        }
        let data = (min <= max).then_some((min, max));
        let length_px = length_px.max(1.0);
        let mut step = 1.0;
        let (round_lo, round_hi) = match mapping {
            Mapping::Log2Bytes => {
                let (lo, hi) = data.map_or((0.0, 10.0), |(min, max)| (min.floor(), max.ceil()));
                if lo < hi {
                    (lo, hi)
                } else {
                    (lo - 1.0, hi + 1.0)
                }
            }
            Mapping::Log10 => {
                let (lo, hi) = data.map_or((0, 3), |(min, max)| {
                    (index_125_floor(min), index_125_ceil(max))
                });
                let (lo, hi) = if lo < hi { (lo, hi) } else { (lo - 1, hi + 1) };
                (log_125(lo), log_125(hi))
            }
            Mapping::Linear => {
                let (min, max) = data.map_or((0.0, 1.0), |(min, max)| (min.min(0.0), max.max(0.0)));
                let span = if max > min { max - min } else { 1.0 };
                step = nice_step(span * label_gap_px.max(1.0) / length_px);
                let lo = (min / step).floor() * step;
                let hi = (max / step).ceil() * step;
                (lo, if hi > lo { hi } else { lo + step })
            }
        };
        let pad = (round_hi - round_lo) * MARGIN;
        Scale {
            mapping,
            round_lo,
            round_hi,
            lo: round_lo - pad,
            hi: round_hi + pad,
            step,
            length_px,
            label_gap_px: label_gap_px.max(1.0),
        }
    }

    /// Where `v` lies along the axis (0 at the low end, 1 at the high end), or `None` when the
    /// axis cannot show it.
    pub fn fraction(&self, v: f64) -> Option<f64> {
        self.mapping.transform(v).map(|t| self.fraction_of(t))
    }

    fn fraction_of(&self, t: f64) -> f64 {
        (t - self.lo) / (self.hi - self.lo)
    }

    fn px_per_unit(&self) -> f64 {
        self.length_px / (self.hi - self.lo)
    }

    /// The axis's grid lines from low to high, labelled where labels fit.
    pub fn ticks(&self) -> Vec<Tick> {
        match self.mapping {
            Mapping::Log2Bytes => self.log2_ticks(),
            Mapping::Log10 => self.log10_ticks(),
            Mapping::Linear => self.linear_ticks(),
        }
    }

    /// Octaves, labelled every 1, 2, 5, 10, ... octaves as room allows (so `1K`, `1M`, `1G`
    /// are labelled before `64K`), plus the rounded data ends.
    fn log2_ticks(&self) -> Vec<Tick> {
        let per_octave = self.px_per_unit();
        let every = multiple_125(self.label_gap_px / per_octave);
        let (first, last) = (self.lo.ceil() as i64, self.hi.floor() as i64);
        let ends = [self.round_lo as i64, self.round_hi as i64];
        let grid_each = per_octave >= MIN_GRID_PX;
        let marks = (first..=last)
            .filter(|k| grid_each || k.rem_euclid(every) == 0 || ends.contains(k))
            .map(|k| (k, k as f64, k.rem_euclid(every) == 0));
        self.finish(marks, &ends, format_bytes)
    }

    /// 1-2-5 points: all labelled when a decade is tall enough, otherwise every 1, 2, 5, ...
    /// decades, plus the rounded data ends.
    fn log10_ticks(&self) -> Vec<Tick> {
        let per_decade = self.px_per_unit();
        let label_all = per_decade * LOG10_2 >= self.label_gap_px;
        let every = multiple_125(self.label_gap_px / per_decade);
        let (first, last) = (index_125_ceil(self.lo), index_125_floor(self.hi));
        let ends = [
            index_125_floor(self.round_lo + EPS),
            index_125_ceil(self.round_hi - EPS),
        ];
        let grid_125 = per_decade * LOG10_2 >= MIN_GRID_PX;
        let grid_decades = per_decade >= MIN_GRID_PX;
        let marks = (first..=last).filter_map(|n| {
            let decade = n.div_euclid(3);
            let is_decade = n.rem_euclid(3) == 0;
            let labelled = label_all || (is_decade && decade.rem_euclid(every) == 0);
            let grid = grid_125 || (is_decade && grid_decades);
            (labelled || grid || ends.contains(&n)).then_some((n, log_125(n), labelled))
        });
        self.finish(marks, &ends, format_125)
    }

    /// Multiples of the fitted step, all labelled.
    fn linear_ticks(&self) -> Vec<Tick> {
        let step = self.step;
        let (first, last) = ((self.lo / step).ceil(), (self.hi / step).floor());
        if !(first.is_finite() && last.is_finite()) || last - first > MAX_TICKS as f64 {
            return Vec::new();
        }
        let marks = (first as i64..=last as i64).map(|n| (n, n as f64 * step, true));
        self.finish(marks, &[], |n| format_linear(n as f64 * step, step))
    }

    /// Turns `(index, transformed position, labelled)` marks into ticks, labelling each of `ends`
    /// that is at least a label gap away from every other label.
    fn finish(
        &self,
        marks: impl Iterator<Item = (i64, f64, bool)>,
        ends: &[i64],
        label: impl Fn(i64) -> String,
    ) -> Vec<Tick> {
        let mut marks: Vec<(i64, f64, bool)> = marks.take(MAX_TICKS as usize).collect();
        let px = |t: f64| self.fraction_of(t) * self.length_px;
        for &end in ends {
            let Some(at) = marks.iter().position(|&(n, _, _)| n == end) else {
                continue;
            };
            let clear = marks
                .iter()
                .filter(|&&(n, _, labelled)| labelled && n != end)
                .all(|&(_, t, _)| (px(t) - px(marks[at].1)).abs() >= self.label_gap_px);
            if clear {
                marks[at].2 = true;
            }
        }
        marks
            .into_iter()
            .map(|(n, t, labelled)| Tick {
                at: self.fraction_of(t),
                label: labelled.then(|| label(n)),
            })
            .collect()
    }
}

/// log10 of the `n`th 1-2-5 point: index 0 is 1, 1 is 2, 2 is 5, 3 is 10, -1 is 0.5.
fn log_125(n: i64) -> f64 {
    n.div_euclid(3) as f64 + LOG10_125[n.rem_euclid(3) as usize]
}

/// Index of the largest 1-2-5 point at or below log10 value `t`.
fn index_125_floor(t: f64) -> i64 {
    let decade = 3 * t.floor() as i64;
    (decade..decade + 3)
        .rev()
        .find(|&n| log_125(n) <= t + EPS)
        .unwrap_or(decade)
}

/// Index of the smallest 1-2-5 point at or above log10 value `t`.
fn index_125_ceil(t: f64) -> i64 {
    let decade = 3 * t.floor() as i64;
    (decade..=decade + 3)
        .find(|&n| log_125(n) >= t - EPS)
        .unwrap_or(decade + 3)
}

/// The smallest of 1, 2, 5, 10, 20, 50, ... that is at least `least` (capped at 10^15).
fn multiple_125(least: f64) -> i64 {
    let mut base = 1i64;
    while base < 1_000_000_000_000_000 {
        for m in MANTISSA_125 {
            if (m * base) as f64 >= least {
                return m * base;
            }
        }
        base *= 10;
    }
    base
}

/// The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `least`; 1 for a `least`
/// that is not a positive finite number.
fn nice_step(least: f64) -> f64 {
    if !(least.is_finite() && least > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(least.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&step| step >= least * (1.0 - EPS))
        .unwrap_or(10.0 * magnitude)
}

/// `2^k` bytes as `8B`, `32K`, `1M`, `512G`; outside 1B..512E as `2^k`.
pub(super) fn format_bytes(k: i64) -> String {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    match usize::try_from(k) {
        Ok(k) if k < 10 * UNITS.len() => format!("{}{}", 1u64 << (k % 10), UNITS[k / 10]),
        _ => format!("2^{k}"),
    }
}

/// The `n`th 1-2-5 point as `0.005`, `20`, `50000`, or `2e6` / `5e-5` outside that span.
pub(super) fn format_125(n: i64) -> String {
    let (decade, mantissa) = (n.div_euclid(3), MANTISSA_125[n.rem_euclid(3) as usize]);
    match decade {
        0..=4 => (mantissa * 10i64.pow(decade as u32)).to_string(),
        -4..=-1 => {
            let decimals = decade.unsigned_abs() as usize;
            format!(
                "{:.*}",
                decimals,
                mantissa as f64 * 10f64.powi(decade as i32)
            )
        }
        _ => format!("{mantissa}e{decade}"),
    }
}

/// A tick value on a linear axis with as many decimals as `step` needs; very large or very small
/// magnitudes switch to `1.5e7` form.
pub(super) fn format_linear(value: f64, step: f64) -> String {
    if value == 0.0 {
        return "0".to_string();
    }
    if value.abs() >= 1e7 || step < 1e-4 {
        // One digit more than the step's leading digit needs covers steps of 2.5; zeros trimmed.
        let digits = (value.abs().log10().floor() - step.log10().floor() + 1.0).clamp(0.0, 15.0);
        let digits = digits as usize;
        let text = format!("{value:.digits$e}");
        return match text.split_once('e') {
            Some((mantissa, exponent)) if mantissa.contains('.') => {
                let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
                format!("{mantissa}e{exponent}")
            }
            _ => text,
        };
    }
    let decimals = (0..=6)
        .find(|&d| {
            let scaled = step * 10f64.powi(d);
            (scaled - scaled.round()).abs() <= EPS * scaled.max(1.0)
        })
        .unwrap_or(6) as usize;
    format!("{value:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(ticks: &[Tick]) -> Vec<&str> {
        ticks.iter().filter_map(|t| t.label.as_deref()).collect()
    }

    #[test]
    fn byte_labels_read_as_sizes() {
        let got: Vec<String> = [0, 3, 10, 15, 20, 25, 30, 39, 69, 70, -1]
            .into_iter()
            .map(format_bytes)
            .collect();
        let want = [
            "1B", "8B", "1K", "32K", "1M", "32M", "1G", "512G", "512E", "2^70", "2^-1",
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn decade_labels_read_as_numbers() {
        let got: Vec<String> = [0, 1, 2, 3, 5, 14, 15, -1, -5, -7, -12, -13]
            .into_iter()
            .map(format_125)
            .collect();
        let want = [
            "1", "2", "5", "10", "50", "50000", "1e5", "0.5", "0.02", "0.005", "0.0001", "5e-5",
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn linear_labels_use_the_step_precision() {
        assert_eq!(format_linear(0.30000000000000004, 0.1), "0.3");
        assert_eq!(format_linear(7.5, 2.5), "7.5");
        assert_eq!(format_linear(200.0, 50.0), "200");
        assert_eq!(format_linear(0.0, 0.25), "0");
        assert_eq!(format_linear(2.5e7, 5e6), "2.5e7");
    }

    #[test]
    fn message_sizes_from_8b_to_1g_label_round_units() {
        let sizes = (3..=30).map(|k| f64::from(1u32 << k));
        let scale = Scale::fit(Mapping::Log2Bytes, sizes, 700.0, 60.0);
        let ticks = scale.ticks();
        assert_eq!(ticks.len(), 28, "one grid line per octave");
        assert_eq!(
            labels(&ticks),
            ["32B", "1K", "32K", "1M", "32M", "1G"].as_slice()
        );
        assert!(ticks.iter().all(|t| (0.0..=1.0).contains(&t.at)));
    }

    #[test]
    fn log_y_has_decades_and_2_5_subdivisions() {
        let scale = Scale::fit(Mapping::Log10, [3.0, 700.0], 500.0, 26.0);
        let ticks = scale.ticks();
        assert_eq!(
            labels(&ticks),
            ["2", "5", "10", "20", "50", "100", "200", "500", "1000"].as_slice()
        );
        // Squeezed, only decades keep labels but 2 and 5 keep their grid lines.
        let scale = Scale::fit(Mapping::Log10, [3.0, 700.0], 150.0, 26.0);
        let ticks = scale.ticks();
        assert_eq!(labels(&ticks), ["2", "10", "100", "1000"].as_slice());
        assert_eq!(ticks.len(), 9);
    }

    #[test]
    fn linear_y_starts_at_zero_with_nice_steps() {
        let scale = Scale::fit(Mapping::Linear, [12.0, 187.3], 480.0, 60.0);
        assert_eq!(
            labels(&scale.ticks()),
            ["0", "25", "50", "75", "100", "125", "150", "175", "200"].as_slice()
        );
    }

    #[test]
    fn degenerate_data_still_gives_a_usable_axis() {
        for mapping in [Mapping::Log2Bytes, Mapping::Log10, Mapping::Linear] {
            for values in [
                vec![],
                vec![f64::NAN, f64::INFINITY, -1.0, 0.0],
                vec![4.0],
                vec![1e-300, 1e300],
                vec![f64::MAX, -f64::MAX],
                vec![f64::MIN_POSITIVE / 4.0],
            ] {
                let scale = Scale::fit(mapping, values.clone(), 600.0, 40.0);
                assert!(scale.hi > scale.lo, "{mapping:?} {values:?}");
                let ticks = scale.ticks();
                assert!(ticks.len() <= MAX_TICKS as usize, "{mapping:?} {values:?}");
                for v in values.into_iter().filter(|&v| mapping.accepts(v)) {
                    let at = scale.fraction(v).unwrap_or(f64::NAN);
                    assert!(
                        at.is_nan() || (-EPS..=1.0 + EPS).contains(&at),
                        "{mapping:?} {v}"
                    );
                }
            }
        }
    }
}
