//! The chart as a person would check it: the PNG decodes to the rendered pixels, titles, axes,
//! grid and legend have ink where they belong, styles follow labels, and awkward input renders.

use super::*;

/// A latency panel with six series and a bus-bandwidth panel with three, as the allreduce
/// example draws them.
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
        ("doorbell graph", 3.1, 340.0),
        ("NCCL graph", 9.0, 360.0),
        ("NCCL symm graph", 4.0, 260.0),
        ("doorbell eager", 5.0, 330.0),
        ("NCCL eager", 10.0, 350.0),
        ("NCCL symm eager", 8.0, 250.0),
    ];
    let panel = |title: &str, y_label: &str, busbw: bool| Panel {
        title: title.to_string(),
        y_label: y_label.to_string(),
        log_y: !busbw,
        series: lines
            .iter()
            .take(if busbw { 3 } else { 6 })
            .map(|&(label, base, peak)| series(label, base, peak, busbw))
            .collect(),
    };
    Chart {
        title: "allreduce (sum), 8 ranks, bfloat16: CUDA graph and eager".to_string(),
        x_label: "message size (bytes)".to_string(),
        panels: vec![
            panel("latency", "us", false),
            panel("bus bandwidth", "GB/s", true),
        ],
    }
}

fn temp_png(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("doorbell-plot-{}-{name}.png", std::process::id()))
}

/// A rectangle of the image, in pixels.
#[derive(Clone, Copy, Debug)]
struct Rect {
    x: u32,
    y: u32,
    w: u32,
    h: u32,
}

/// Whether any pixel of `area` passes `test`.
fn any_pixel(rgb: &[u8], width: u32, area: Rect, test: impl Fn([u8; 3]) -> bool) -> bool {
    (area.y..area.y + area.h).any(|y| {
        (area.x..area.x + area.w).any(|x| {
            let at = (y as usize * width as usize + x as usize) * 3;
            test([rgb[at], rgb[at + 1], rgb[at + 2]])
        })
    })
}

fn rgb(c: RGBColor) -> [u8; 3] {
    [c.0, c.1, c.2]
}

/// Dark enough to be text (anti-aliased edges are lighter; every glyph has a core this dark).
fn inked(p: [u8; 3]) -> bool {
    p.iter().all(|&c| c < 100)
}

#[test]
fn png_file_decodes_to_the_rendered_pixels() {
    let chart = sample_chart();
    let path = temp_png("two-panels");
    chart.render_png(&path).expect("writable temp dir");
    let bytes = std::fs::read(&path).expect("just written");
    let _ = std::fs::remove_file(&path);

    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 20_000, "a chart of {} bytes", bytes.len());
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .expect("a PNG the png crate reads back");
    let mut decoded = vec![0; reader.output_buffer_size().expect("small image")];
    let info = reader.next_frame(&mut decoded).expect("one frame");
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.width, 2 * PANEL_WIDTH);
    assert!((650..=750).contains(&info.height), "height {}", info.height);
    let (width, height, pixels) = chart.render_rgb().expect("renders");
    assert_eq!((info.width, info.height), (width, height));
    assert_eq!(decoded, pixels);
    let ink = pixels.chunks(3).filter(|p| p != &rgb(BACKGROUND)).count();
    assert!(ink > pixels.len() / 3 / 50, "only {ink} pixels drawn");
}

#[test]
fn legend_axes_and_titles_are_drawn() {
    let chart = sample_chart();
    let (width, height, pixels) = chart.render_rgb().expect("renders");
    assert_eq!(pixels.len(), width as usize * height as usize * 3);
    let legend_top = TITLE_BAND + PANEL_HEIGHT;
    let legend = Rect {
        x: 0,
        y: legend_top,
        w: width,
        h: height - legend_top,
    };
    // The legend shows every series' colour at full strength (its stroke and marker).
    for (i, &color) in PALETTE.iter().take(6).enumerate() {
        assert!(
            any_pixel(&pixels, width, legend, |p| p == rgb(color)),
            "series {i}"
        );
    }
    assert!(any_pixel(&pixels, width, legend, inked), "legend labels");
    let title = Rect {
        x: 0,
        y: 0,
        w: width,
        h: TITLE_BAND,
    };
    assert!(any_pixel(&pixels, width, title, inked), "title");
    for panel in 0..2 {
        let x = panel * PANEL_WIDTH;
        // Rotated y title and tick labels in the left margin of each panel.
        let margin = Rect {
            x: x + MARGIN,
            y: TITLE_BAND + 60,
            w: 60,
            h: 400,
        };
        assert!(
            any_pixel(&pixels, width, margin, inked),
            "panel {panel} y labels"
        );
        // x tick labels and the x title under the plot.
        let under = Rect {
            x: x + 120,
            y: legend_top - X_LABEL_AREA - MARGIN + 2 * TICK_LENGTH,
            w: 600,
            h: X_LABEL_AREA - 2 * TICK_LENGTH,
        };
        assert!(
            any_pixel(&pixels, width, under, inked),
            "panel {panel} x labels"
        );
        let inside = Rect {
            x: x + 150,
            y: TITLE_BAND + 60,
            w: 500,
            h: 400,
        };
        assert!(
            any_pixel(&pixels, width, inside, |p| p == rgb(GRID)),
            "panel {panel} grid"
        );
        assert!(
            any_pixel(&pixels, width, inside, |p| p == rgb(PALETTE[0])),
            "panel {panel} first series"
        );
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
    // The empty series has nothing to draw: no legend entry, no style of its own.
    assert_eq!(styles.labels, ["b", "c", "a"]);
    assert_eq!(styles.of("c"), Style::nth(1));
    let colors: Vec<RGBColor> = (0..8).map(|i| Style::nth(i).color).collect();
    for (i, c) in colors.iter().enumerate() {
        assert!(!colors[..i].contains(c), "eight series, eight colours");
    }
    assert_eq!(Style::nth(0).dash, None);
    assert!(Style::nth(10).dash.is_some());
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
            label: "unicode \u{b5}s \u{2603} and a very long label ".repeat(8),
            points: vec![(4096.0, 2.0), (4096.0, 2.0)],
        },
        Series {
            label: "subnormal".to_string(),
            points: vec![(8.0, 5e-324), (16.0, 0.0)],
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
        let (width, height, pixels) = chart.render_rgb().expect("renders");
        assert!(width >= PANEL_WIDTH && height >= PANEL_HEIGHT);
        assert_eq!(pixels.len(), width as usize * height as usize * 3);
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

/// With `DOORBELL_PLOT_SAMPLE=FILE.png`, writes the sample chart there for a person to look
/// at (the other tests only check pixels).
#[test]
fn sample_chart_for_a_person() {
    if let Some(path) = std::env::var_os("DOORBELL_PLOT_SAMPLE") {
        sample_chart()
            .render_png(Path::new(&path))
            .expect("writable sample path");
    }
}
