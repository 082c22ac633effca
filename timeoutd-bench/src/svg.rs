//! The chart: hand-written SVG, one panel per measurement.

use crate::{Report, human};

const WIDTH: f64 = 960.0;
const LABEL_W: f64 = 250.0;
const BAR_W: f64 = 560.0;
const BAR_H: f64 = 22.0;
const GAP: f64 = 8.0;
const BLUE: &str = "#4e79a7";
const ORANGE: &str = "#f28e2b";
const GREEN: &str = "#59a14f";
const RED: &str = "#e15759";

pub struct Bar {
    pub label: String,
    pub value: f64,
    pub color: &'static str,
}

fn bar(label: impl Into<String>, value: f64, color: &'static str) -> Bar {
    Bar {
        label: label.into(),
        value,
        color,
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn fmt(v: f64) -> String {
    match v {
        v if !v.is_finite() => "n/a".into(),
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 1.0 => format!("{v:.1}"),
        v => format!("{v:.3}"),
    }
}

/// Horizontal bars with optional vertical target markers; returns (svg, height).
fn hbars(title: &str, unit: &str, bars: &[Bar], marks: &[(f64, String)], y0: f64) -> (String, f64) {
    let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
    let max = bars
        .iter()
        .map(|b| finite(b.value))
        .chain(marks.iter().map(|m| m.0))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let x = |v: f64| LABEL_W + finite(v).max(0.0) / max * BAR_W;
    let mut s = format!(
        r#"<text x="10" y="{}" font-size="15" font-weight="bold">{}</text>"#,
        y0 + 16.0,
        esc(title)
    );
    let top = y0 + 28.0;
    for (i, b) in bars.iter().enumerate() {
        let y = top + i as f64 * (BAR_H + GAP);
        s += &format!(
            r#"<text x="{}" y="{}" text-anchor="end">{}</text><rect x="{LABEL_W}" y="{y}" width="{}" height="{BAR_H}" fill="{}"/><text x="{}" y="{}">{} {}</text>"#,
            LABEL_W - 8.0,
            y + 15.0,
            esc(&b.label),
            x(b.value) - LABEL_W,
            b.color,
            x(b.value) + 6.0,
            y + 15.0,
            fmt(b.value),
            esc(unit)
        );
    }
    let bottom = top + bars.len() as f64 * (BAR_H + GAP);
    for (v, label) in marks {
        s += &format!(
            r#"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="{RED}" stroke-dasharray="5,3" stroke-width="1.5"/><text x="{0}" y="{3}" fill="{RED}" font-size="11" text-anchor="middle">{4}</text>"#,
            x(*v),
            top - 4.0,
            bottom,
            bottom + 12.0,
            esc(label)
        );
    }
    (s, bottom + 30.0 - y0)
}

/// Vertical histogram bars of counts per bucket; returns (svg, height).
fn histogram(title: &str, buckets: &[(String, usize)], y0: f64) -> (String, f64) {
    let plot_h = 150.0;
    let max = buckets.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64;
    let slot = (WIDTH - 80.0) / buckets.len().max(1) as f64;
    let base = y0 + 40.0 + plot_h;
    let mut s = format!(
        r#"<text x="10" y="{}" font-size="15" font-weight="bold">{}</text>"#,
        y0 + 16.0,
        esc(title)
    );
    for (i, (label, count)) in buckets.iter().enumerate() {
        let h = *count as f64 / max * plot_h;
        let x = 40.0 + i as f64 * slot;
        let mid = x + slot / 2.0;
        s += &format!(
            r#"<rect x="{}" y="{}" width="{}" height="{h}" fill="{BLUE}"/><text x="{mid}" y="{}" text-anchor="middle" font-size="11">{count}</text><text x="{mid}" y="{}" text-anchor="middle" font-size="11">{}</text>"#,
            x + 4.0,
            base - h,
            slot - 8.0,
            base - h - 4.0,
            base + 14.0,
            esc(label)
        );
    }
    s += &format!(
        r#"<line x1="40" y1="{base}" x2="{}" y2="{base}" stroke="black"/><text x="{}" y="{}" text-anchor="middle" font-size="11">lateness bucket (ms): rows received</text>"#,
        WIDTH - 40.0,
        WIDTH / 2.0,
        base + 30.0
    );
    (s, base + 44.0 - y0)
}

pub(crate) fn chart(r: &Report) -> String {
    let mut panels = Vec::new();
    let mut bottom = 50.0;
    let mut add = |(s, h): (String, f64)| {
        panels.push(s);
        bottom += h;
        bottom
    };
    let p = r.publish.rows_per_sec;
    let throughput = [
        bar("baseline publish (lapin)", p, BLUE),
        bar("baseline delete (sqlx)", r.delete.rows_per_sec, GREEN),
        bar(
            format!(
                "burst (timeoutd), {:.0}% of publish",
                100.0 * r.burst.rows_per_sec / p
            ),
            r.burst.rows_per_sec,
            ORANGE,
        ),
    ];
    let marks = [(0.8 * p, "target 80% of publish".to_owned())];
    let y1 = add(hbars("Throughput", "rows/s", &throughput, &marks, 50.0));
    let y3 = match r.steady.first() {
        Some(s) => {
            let title = format!("Steady {}/s for {} s: lateness histogram", s.rate, s.secs);
            let y2 = add(histogram(&title, &s.histogram, y1));
            let pct = [
                bar("p50", s.p50_ms, BLUE),
                bar("p90", s.p90_ms, BLUE),
                bar("p99", s.p99_ms, ORANGE),
                bar("max", s.max_ms, RED),
            ];
            let marks = [(5.0, "p99 ≤ 5".to_owned()), (20.0, "max ≤ 20".to_owned())];
            add(hbars("Steady lateness percentiles", "ms", &pct, &marks, y2))
        }
        None => y1,
    };
    let idle: Vec<Bar> = r
        .idle_scan
        .iter()
        .map(|i| {
            bar(
                format!("{} rows not due", human(i.rows)),
                i.median_ms,
                GREEN,
            )
        })
        .collect();
    let marks = [(1.0, "1 ms".to_owned())];
    let y4 = add(hbars("Idle scan (median)", "ms", &idle, &marks, y3));
    let m = &r.memory;
    let mem = [
        bar("idle, before burst", m.idle_before_mib, BLUE),
        bar("peak (VmHWM), burst", m.burst_peak_mib, ORANGE),
        bar("idle, after steady", m.idle_after_mib, BLUE),
    ];
    let marks = [
        (32.0, "32 MiB idle".to_owned()),
        (96.0, "96 MiB peak".to_owned()),
    ];
    let height = add(hbars("Daemon memory (RSS)", "MiB", &mem, &marks, y4));
    let header = format!(
        "timeoutd-bench {} · batch {} · tick {} ms · burst {} rows",
        r.meta.started_at.format("%Y-%m-%d %H:%M UTC"),
        r.meta.daemon_scan_batch_size,
        r.meta.daemon_election_tick_ms,
        r.burst.rows
    );
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="10" y="28" font-size="18" font-weight="bold">{}</text>{}</svg>
"#,
        esc(&header),
        panels.join("")
    )
}
