//! The axes of a chart: which values each can show, where its ticks go and what they say.
//!
//! plotters draws every axis linearly, so a log axis is drawn over mapped values (log2 of a
//! message size, log10 of a latency) and its ticks carry the labels of the values before mapping.
//! Tick positions and texts are chosen here, from integers where the axis is logarithmic, so a
//! label never shows a floating-point round-off. Fitting never panics and always yields a finite,
//! non-empty range, whatever the values.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

/// How an axis places values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mapping {
    /// log2 of a byte count; labels `8B`, `32K`, `1G`.
    Log2Bytes,
    /// log10; labels at 1-2-5 steps, or fewer where they would crowd.
    Log10,
    /// Linear, always including zero; labels at 1-2-2.5-5 steps.
    Linear,
}

/// A labelled tick, at a mapped position.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Tick {
    pub at: f64,
    pub label: String,
}

/// An axis fitted to its data: the mapped range to draw, the labelled ticks (bold grid lines) and
/// the unlabelled ones (light grid lines).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Axis {
    pub range: Range<f64>,
    pub ticks: Vec<Tick>,
    pub minor: Vec<f64>,
}

/// Room left at each end of the range, as a fraction of it, so that markers on the extreme
/// values are not cut by the frame.
const PAD: f64 = 0.03;
/// Unlabelled ticks are left out when there would be more than this many.
const MAX_MINOR: usize = 120;

impl Mapping {
    /// The position of `v` on the axis, or `None` where the axis cannot show it: NaN, infinities,
    /// and zero or negative values on a log axis.
    pub fn map(self, v: f64) -> Option<f64> {
        let at = match self {
            Mapping::Log2Bytes if v > 0.0 => v.log2(),
            Mapping::Log10 if v > 0.0 => v.log10(),
            Mapping::Linear => v,
            _ => return None,
        };
        at.is_finite().then_some(at)
    }
}

impl Axis {
    /// Fits an axis to `positions` (values already mapped, all finite) with at most `max_labels`
    /// labelled ticks (two at the least). With no positions the axis spans a default range.
    pub fn fit(
        mapping: Mapping,
        positions: impl IntoIterator<Item = f64>,
        max_labels: usize,
    ) -> Axis {
        let (lo, hi) = positions
            .into_iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let max_labels = max_labels.max(2);
        let (lo, hi, ticks, minor) = match mapping {
            Mapping::Log2Bytes => {
                // 8 B to 1 GiB when there is nothing to show.
                let (lo, hi) = whole_span(lo, hi, (3.0, 30.0));
                let (ticks, minor) = log2_ticks(lo, hi, max_labels);
                (lo as f64, hi as f64, ticks, minor)
            }
            Mapping::Log10 => {
                // 1 to 100 when there is nothing to show.
                let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 2.0) };
                log10_ticks(lo, hi, max_labels)
            }
            Mapping::Linear => {
                let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
                linear_ticks(lo.min(0.0), hi.max(0.0), max_labels)
            }
        };
        let pad = PAD * (hi - lo);
        let range = if pad.is_finite() && pad > 0.0 {
            lo - pad..hi + pad
        } else {
            lo..hi
        };
        Axis {
            range,
            ticks,
            minor,
        }
    }

    /// The label of the tick at `at` (a position plotters hands back from [`Axis::ticks`]).
    pub fn label_at(&self, at: f64) -> String {
        self.ticks
            .iter()
            .find(|t| t.at == at)
            .map(|t| t.label.clone())
            .unwrap_or_default()
    }
}

/// plotters draws the axis linearly over positions: labels and bold grid lines at the labelled
/// ticks, light grid lines at the others. (Its own `with_key_points` would do, but leaves an f64
/// axis without the label formatting its mesh needs.)
impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, at: &f64, limit: (i32, i32)) -> i32 {
        let Range { start, end } = self.range;
        let pixels = f64::from(limit.1 - limit.0) * (at - start) / (end - start);
        // `as` saturates, and turns the NaN of a span too wide for f64 into 0.
        limit.0.saturating_add(pixels.round() as i32)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.minor.clone()
        } else {
            self.ticks.iter().map(|t| t.at).collect()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// The whole units around `lo..=hi` (at least one apart, centred on a single value), or
/// `default` when there are no values.
fn whole_span(lo: f64, hi: f64, default: (f64, f64)) -> (i64, i64) {
    let (lo, hi) = if lo <= hi { (lo, hi) } else { default };
    let (lo, hi) = (lo.floor() as i64, hi.ceil() as i64);
    if lo == hi {
        (lo - 1, hi + 1)
    } else {
        (lo, hi)
    }
}

/// 1, 2, 3, 5, 10, 20, 30, 50, ...: tick steps in whole units (log2 steps of bytes, decades).
fn whole_steps() -> impl Iterator<Item = i64> {
    (0..18).flat_map(|e| [1, 2, 3, 5].map(|m| m * 10i64.pow(e)))
}

/// The multiples of `step` in `lo..=hi`.
fn multiples(lo: i64, hi: i64, step: i64) -> impl Iterator<Item = i64> {
    let first = lo.div_euclid(step) + i64::from(lo.rem_euclid(step) != 0);
    (first..=hi.div_euclid(step)).map(move |k| k * step)
}

/// Ticks at powers of two: labelled every `step` (the smallest that fits), unlabelled at the
/// others.
fn log2_ticks(lo: i64, hi: i64, max_labels: usize) -> (Vec<Tick>, Vec<f64>) {
    let step = whole_steps()
        .find(|&s| multiples(lo, hi, s).count() <= max_labels)
        .unwrap_or(i64::MAX);
    let ticks = multiples(lo, hi, step)
        .map(|k| Tick {
            at: k as f64,
            label: bytes_label(k),
        })
        .collect();
    let minor = if hi - lo <= MAX_MINOR as i64 {
        (lo..=hi)
            .filter(|k| k.rem_euclid(step) != 0)
            .map(|k| k as f64)
            .collect()
    } else {
        Vec::new()
    };
    (ticks, minor)
}

/// `2^k` bytes as the tables print sizes: `8B`, `32K`, `1G`.
fn bytes_label(k: i64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    match usize::try_from(k / 10) {
        Ok(unit) if k >= 0 && unit < UNITS.len() => format!("{}{}", 1 << (k % 10), UNITS[unit]),
        _ => format!("2^{k}B"),
    }
}

/// The mantissas of the 1-2-5 ladder a log10 axis ends and is labelled on.
const LADDER: [i64; 3] = [1, 2, 5];
/// Slack when comparing a position with a rung, so that log10(1000) = 2.9999999999999996 counts
/// as the rung 1000.
const RUNG_SLACK: f64 = 1e-9;

/// Rung `i` of the 1-2-5 ladder as `(mantissa, decade)`: rung 0 is 1, rung 1 is 2, rung 3 is 10.
fn rung(i: i64) -> (i64, i64) {
    (LADDER[i.rem_euclid(3) as usize], i.div_euclid(3))
}

fn rung_at(i: i64) -> f64 {
    let (m, decade) = rung(i);
    decade as f64 + (m as f64).log10()
}

/// The highest rung at or below position `v`.
fn rung_below(v: f64) -> i64 {
    let first = 3 * (v + RUNG_SLACK).floor() as i64;
    (first..first + 3)
        .rev()
        .find(|&i| rung_at(i) <= v + RUNG_SLACK)
        .unwrap_or(first)
}

/// The lowest rung at or above position `v`.
fn rung_above(v: f64) -> i64 {
    let first = 3 * (v - RUNG_SLACK).floor() as i64;
    (first..first + 3)
        .find(|&i| rung_at(i) >= v - RUNG_SLACK)
        .unwrap_or(first + 3)
}

/// A log10 axis over positions `lo..=hi`. Where few enough rungs of the 1-2-5 ladder cover the
/// data, the axis ends on the rungs just outside it and labels every rung (so 2248 to 2497 us
/// spans 2000 to 5000, not 1000 to 10000), the other whole multiples unlabelled. Otherwise it
/// ends on whole decades and labels every decade, or every few. Returns the ends with the ticks.
fn log10_ticks(lo: f64, hi: f64, max_labels: usize) -> (f64, f64, Vec<Tick>, Vec<f64>) {
    let (first, last) = match (rung_below(lo), rung_above(hi)) {
        (a, b) if a == b => (a - 1, b + 1),
        ends => ends,
    };
    let at = |decade: i64, m: i64| decade as f64 + (m as f64).log10();
    if last - first < max_labels as i64 {
        let ticks = (first..=last)
            .map(|i| {
                let (m, decade) = rung(i);
                Tick {
                    at: rung_at(i),
                    label: decimal_label(m, decade),
                }
            })
            .collect();
        let (start, end) = (rung_at(first), rung_at(last));
        let minor = (rung(first).1..=rung(last).1)
            .flat_map(|d| [3, 4, 6, 7, 8, 9].map(|m| at(d, m)))
            .filter(|&p| start < p && p < end)
            .collect();
        return (start, end, ticks, minor);
    }
    let (lo, hi) = whole_span(lo, hi, (0.0, 2.0));
    let step = whole_steps()
        .find(|&s| multiples(lo, hi, s).count() <= max_labels)
        .unwrap_or(i64::MAX);
    let ticks = multiples(lo, hi, step)
        .map(|d| Tick {
            at: d as f64,
            label: decimal_label(1, d),
        })
        .collect();
    let minor = if step > 1 && hi - lo <= MAX_MINOR as i64 {
        (lo..=hi)
            .filter(|d| d.rem_euclid(step) != 0)
            .map(|d| d as f64)
            .collect()
    } else if step == 1 && (hi - lo) * 8 <= MAX_MINOR as i64 {
        (lo..hi)
            .flat_map(|d| (2..10).map(move |m| at(d, m)))
            .collect()
    } else {
        Vec::new()
    };
    (lo as f64, hi as f64, ticks, minor)
}

/// `m * 10^e` written out: `500`, `0.02`, and `1e9` where digits would run long.
fn decimal_label(m: i64, e: i64) -> String {
    match e {
        0..=5 => format!("{}", m * 10i64.pow(e as u32)),
        -4..=-1 => {
            let digits = (-e) as usize;
            format!("0.{:0>digits$}", m)
        }
        _ => format!("{m}e{e}"),
    }
}

/// A linear axis over `lo..=hi` (which includes zero), widened to whole steps of 1, 2, 2.5 or 5
/// times a power of ten, labelled at each step with unlabelled ticks halfway. Returns the
/// widened ends with the ticks.
fn linear_ticks(lo: f64, hi: f64, max_labels: usize) -> (f64, f64, Vec<Tick>, Vec<f64>) {
    let hi = if hi > lo { hi } else { lo + 1.0 };
    let rough = (hi - lo) / (max_labels - 1) as f64;
    if !rough.is_normal() {
        // A span too wide for f64 (values near f64::MAX both ways) or too narrow for a step
        // (subnormal values): no step fits, so the axis is drawn bare.
        return (lo, hi, Vec::new(), Vec::new());
    }
    let exp = rough.log10().floor() as i32;
    let (tenths, step) = [10, 20, 25, 50, 100]
        .into_iter()
        .map(|tenths| (tenths, f64::from(tenths) / 10.0 * 10f64.powi(exp)))
        .find(|&(_, step)| step >= rough)
        .unwrap_or((100, 10f64.powi(exp + 1)));
    let (first, last) = ((lo / step).floor(), (hi / step).ceil());
    let decimals = (-exp + i32::from(tenths == 25)).max(0) as usize;
    let label = |v: f64| {
        if !(1e-4..1e6).contains(&step) {
            format!("{v:e}")
        } else {
            format!("{v:.decimals$}")
        }
    };
    let count = (last - first) as i64;
    // `+ 0.0` turns a -0 into 0, which prints without its sign.
    let ticks = (0..=count)
        .map(|i| (first + i as f64) * step + 0.0)
        .map(|at| Tick {
            at,
            label: label(at),
        })
        .collect();
    let minor = (0..count)
        .map(|i| (first + i as f64 + 0.5) * step)
        .collect();
    (first * step, last * step, ticks, minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(axis: &Axis) -> Vec<&str> {
        axis.ticks.iter().map(|t| t.label.as_str()).collect()
    }

    fn log2(bytes: impl IntoIterator<Item = f64>) -> Vec<f64> {
        bytes
            .into_iter()
            .filter_map(|b| Mapping::Log2Bytes.map(b))
            .collect()
    }

    #[test]
    fn message_sizes_label_as_bytes() {
        let sizes = (3..=30).map(|k| f64::from(1u32 << k));
        let axis = Axis::fit(Mapping::Log2Bytes, log2(sizes), 8);
        assert_eq!(labels(&axis), ["32B", "1K", "32K", "1M", "32M", "1G"]);
        assert_eq!(axis.minor.len(), 28 - 6);
        assert!(axis.range.start < 3.0 && axis.range.end > 30.0);
        let axis = Axis::fit(Mapping::Log2Bytes, log2([64.0, 4096.0]), 20);
        assert_eq!(
            labels(&axis),
            ["64B", "128B", "256B", "512B", "1K", "2K", "4K"]
        );
        assert_eq!(axis.label_at(10.0), "1K");
        assert_eq!(axis.label_at(10.5), "");
        assert_eq!(bytes_label(-1), "2^-1B");
        assert_eq!(bytes_label(49), "512T");
        assert_eq!(bytes_label(50), "2^50B");
    }

    #[test]
    fn log10_labels_thin_out_as_decades_grow() {
        let us =
            |v: &[f64]| -> Vec<f64> { v.iter().filter_map(|&x| Mapping::Log10.map(x)).collect() };
        let axis = Axis::fit(Mapping::Log10, us(&[3.0, 4800.0]), 14);
        assert_eq!(
            labels(&axis),
            ["2", "5", "10", "20", "50", "100", "200", "500", "1000", "2000", "5000"]
        );
        // Within a decade the axis ends on the 1-2-5 rungs around the data.
        let axis = Axis::fit(Mapping::Log10, us(&[2248.0, 2497.0]), 14);
        assert_eq!(labels(&axis), ["2000", "5000"]);
        assert_eq!(axis.minor.len(), 2, "3000 and 4000");
        let axis = Axis::fit(Mapping::Log10, us(&[1000.0]), 14);
        assert_eq!(labels(&axis), ["500", "1000", "2000"]);
        let axis = Axis::fit(Mapping::Log10, us(&[0.02, 4800.0]), 8);
        assert_eq!(
            labels(&axis),
            ["0.01", "0.1", "1", "10", "100", "1000", "10000"]
        );
        let axis = Axis::fit(Mapping::Log10, us(&[1e-300, 1e300]), 10);
        assert!(axis.ticks.len() <= 10 && axis.ticks.len() >= 2);
        assert!(axis.minor.len() <= MAX_MINOR);
        assert_eq!(decimal_label(5, -3), "0.005");
        assert_eq!(decimal_label(2, 7), "2e7");
    }

    #[test]
    fn linear_axes_start_at_zero_and_step_nicely() {
        let axis = Axis::fit(Mapping::Linear, [0.4, 355.0], 10);
        assert_eq!(
            labels(&axis),
            ["0", "50", "100", "150", "200", "250", "300", "350", "400"]
        );
        let axis = Axis::fit(Mapping::Linear, [0.1, 0.9], 5);
        assert_eq!(labels(&axis), ["0.00", "0.25", "0.50", "0.75", "1.00"]);
        assert!(axis.range.start < 0.0 && axis.range.end > 1.0);
    }

    #[test]
    fn degenerate_data_still_gives_a_finite_range() {
        let cases: [(Mapping, Vec<f64>); 7] = [
            (Mapping::Log2Bytes, vec![]),
            (Mapping::Log2Bytes, vec![12.0]),
            (Mapping::Log2Bytes, log2([f64::MIN_POSITIVE, 1e300])),
            (Mapping::Log10, vec![]),
            (Mapping::Linear, vec![]),
            (Mapping::Linear, vec![0.0, 0.0]),
            (Mapping::Linear, vec![-f64::MAX, f64::MAX]),
        ];
        for (mapping, positions) in cases {
            let axis = Axis::fit(mapping, positions.clone(), 6);
            let Range { start, end } = axis.range;
            assert!(
                start.is_finite() && end.is_finite() && start < end,
                "{mapping:?} {positions:?}"
            );
            assert!(axis.ticks.len() <= 6, "{mapping:?} {positions:?}");
        }
        for v in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            assert_eq!(Mapping::Log10.map(v), None);
            assert_eq!(Mapping::Log2Bytes.map(v), None);
        }
        assert_eq!(Mapping::Linear.map(-1.0), Some(-1.0));
        assert_eq!(Mapping::Linear.map(f64::NAN), None);
    }
}
