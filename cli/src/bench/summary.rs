//! What a bench run prints for people: the table of every mode (stderr), the table against
//! the stock llama-server modes, and a flash-budget sweep's table and chart.

use anyhow::Result;

use super::{chart, Report};

/// Where a sweep writes the report of budget `b`: `out` with `.flashB` before the extension.
pub fn sweep_path(out: &std::path::Path, b: f64) -> std::path::PathBuf {
    let stem = out
        .file_stem()
        .map_or_else(|| "bench".into(), |s| s.to_string_lossy().into_owned());
    let ext = out
        .extension()
        .map_or_else(|| "json".into(), |e| e.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.flash{b}.{ext}"))
}

/// Lever's Table 6 for a sweep of flash budgets: decode tok/s of every mode at each budget
/// (with `plain` as flash-AR, each mode's speed-up over it and storage bytes per token), as
/// text, and as a bar chart written to `chart`.
///
/// # Errors
/// The chart cannot be written.
pub fn sweep(reports: &[Report], modes: &[String], chart: &std::path::Path) -> Result<String> {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = write!(s, "{:>8}", "budget");
    for m in modes {
        let _ = write!(
            s,
            " {:>16} {:>9} {:>10}",
            format!("{m} tok/s"),
            "vs AR",
            "MB/token"
        );
    }
    let _ = writeln!(s);
    let mut groups = Vec::new();
    for r in reports {
        let b = r.flash_budget.unwrap_or(1.0);
        let ar = r.modes.get("plain").map(|m| m.decode_tokens_per_s);
        let _ = write!(s, "{b:>8}");
        let mut values = Vec::new();
        for m in modes {
            let Some(x) = r.modes.get(m) else {
                let _ = write!(s, " {:>16} {:>9} {:>10}", "-", "-", "-");
                values.push(f64::NAN);
                continue;
            };
            let vs = ar
                .filter(|a| *a > 0.0)
                .map_or("-".into(), |a| format!("{:.2}x", x.decode_tokens_per_s / a));
            let mb =
                x.storage_read_bytes.unwrap_or(0) as f64 / 1e6 / x.generated_tokens.max(1) as f64;
            let _ = write!(s, " {:>16.2} {:>9} {:>10.1}", x.decode_tokens_per_s, vs, mb);
            values.push(x.decode_tokens_per_s);
        }
        let _ = writeln!(s);
        groups.push(chart::Group {
            label: format!("{b}"),
            values,
        });
    }
    let series: Vec<String> = modes
        .iter()
        .map(|m| {
            if m == "plain" {
                "flash-AR (plain)".into()
            } else {
                m.clone()
            }
        })
        .collect();
    let model = reports.first().map_or("", |r| r.model.as_str());
    chart::bar_chart_png(
        chart,
        &format!("Decode speed under a DRAM budget: {model}"),
        "DRAM budget (fraction of the weights)",
        "decode tok/s",
        &series,
        &groups,
    )?;
    Ok(s)
}

/// The human table for stderr: mode, tok/s, speed-up over plain, accepted per call, identical.
pub fn table(report: &Report, order: &[String]) -> String {
    use std::fmt::Write;
    let base = report.modes.get("plain").map(|m| m.decode_tokens_per_s);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<22} {:>9} {:>9} {:>10} {:>9} {:>10} {:>9} {:>11} {:>9} {:>10}  rows verify/exit/out",
        "mode",
        "tok/s",
        "vs plain",
        "acc/call",
        "ms/call",
        "verify ms",
        "draft ms",
        "calib ms/t",
        "cpu s",
        "identical",
    );
    for name in order {
        let Some(m) = report.modes.get(name) else {
            continue;
        };
        let speed = base
            .filter(|b| *b > 0.0)
            .map_or("-".into(), |b| format!("{:.2}x", m.decode_tokens_per_s / b));
        let ident = match m.identical_to_plain {
            Some(true) => "yes".to_string(),
            Some(false) => format!("NO ({})", m.differing_requests.len()),
            None => "-".into(),
        };
        let _ = writeln!(
            s,
            "{:<22} {:>9.2} {:>9} {:>10.2} {:>9.2} {:>10} {:>9.3} {:>11.4} {:>9.2} {:>10}  {}/{}/{}",
            name,
            m.decode_tokens_per_s,
            speed,
            m.mean_accepted_per_call,
            1e3 * m.decode_seconds / m.target_calls.max(1) as f64,
            if m.verify_ms_per_call > 0.0 {
                format!(
                    "{:.2}+{:.2}",
                    m.verify_ms_per_call - m.project_ms_per_call,
                    m.project_ms_per_call
                )
            } else {
                "-".into()
            },
            m.draft_ms_per_call,
            m.calib_ms_per_prompt_token,
            m.cpu_seconds,
            ident,
            m.verify_rows,
            m.rows_after_exit,
            m.output_rows
        );
        if m.exit_accepted > 0 {
            let _ = writeln!(
                s,
                "{:<22} early exit kept {:.0}% of rows past its layer; {}/{} accepted drafts \
                 on kept rows ({:.1}%); deciding {:.2} ms a call",
                "",
                100.0 * m.rows_after_exit as f64 / m.verify_rows.max(1) as f64,
                m.exit_accepted_kept,
                m.exit_accepted,
                100.0 * m.exit_accepted_kept as f64 / m.exit_accepted as f64,
                1e3 * m.exit_seconds / m.target_calls.max(1) as f64
            );
        }
    }
    if let Some(f) = report.flash_budget {
        let _ = writeln!(
            s,
            "flash budget {f}: {:<11} {:>12} {:>12} {:>14} {:>12}",
            "mode", "MB/token", "MB/call", "blocked s/tok", "peak MB"
        );
        for name in order {
            let Some(m) = report.modes.get(name) else {
                continue;
            };
            let read = m.storage_read_bytes.unwrap_or(0) as f64 / 1e6;
            let _ = writeln!(
                s,
                "{:>24} {:>12.1} {:>12.1} {:>14.4} {:>12.1}",
                name,
                read / m.generated_tokens.max(1) as f64,
                read / m.target_calls.max(1) as f64,
                m.flash_blocked_seconds.unwrap_or(0.0) / m.generated_tokens.max(1) as f64,
                m.flash_peak_resident_bytes.unwrap_or(0) as f64 / 1e6,
            );
        }
    }
    s.push_str(&anchor_table(report, order));
    let _ = write!(
        s,
        "{} requests ({} skipped), {} threads, ctx {}, flash-attn {}",
        report.n_requests, report.n_skipped, report.threads, report.ctx, report.flash_attn
    );
    s
}

/// End to end and per task, against the stock llama-server modes of the run (`server:*`):
/// each mode's time to first token, end-to-end tok/s, and decode tok/s per task, with its
/// decode and end-to-end ratios over every `server:*` mode (no ratio columns without one).
/// Empty with fewer than two modes.
pub fn anchor_table(report: &Report, order: &[String]) -> String {
    use std::fmt::Write;
    let anchors: Vec<&String> = order.iter().filter(|m| m.starts_with("server:")).collect();
    let modes: Vec<&String> = order
        .iter()
        .filter(|m| report.modes.contains_key(*m))
        .collect();
    let mut s = String::new();
    if modes.len() < 2 {
        return s;
    }
    let mut tasks: Vec<&str> = Vec::new();
    if let Some(m) = report.modes.get(modes[0]) {
        for r in &m.requests {
            if !tasks.contains(&r.task.as_str()) {
                tasks.push(&r.task);
            }
        }
    }
    tasks.sort_unstable();
    let _ = write!(s, "{:<22} {:>8} {:>9}", "mode", "TTFT s", "e2e tok/s");
    for t in &tasks {
        let _ = write!(s, " {:>12}", format!("{t} tok/s"));
    }
    for a in &anchors {
        let _ = write!(s, " {:>24}", format!("decode/e2e vs {a}"));
    }
    let _ = writeln!(s);
    for name in &modes {
        let m = &report.modes[*name];
        let _ = write!(
            s,
            "{:<22} {:>8.3} {:>9.2}",
            name, m.mean_ttft_seconds, m.e2e_tokens_per_s
        );
        for t in &tasks {
            let (n, secs) = m
                .requests
                .iter()
                .filter(|r| r.task == *t)
                .fold((0usize, 0f64), |(n, d), r| {
                    (n + r.generated_tokens, d + r.decode_seconds)
                });
            let v = if secs > 0.0 { n as f64 / secs } else { 0.0 };
            let _ = write!(s, " {v:>12.2}");
        }
        for a in &anchors {
            let x = &report.modes[*a];
            let r = |u: f64, v: f64| {
                if v > 0.0 {
                    format!("{:.2}x", u / v)
                } else {
                    "-".into()
                }
            };
            let _ = write!(
                s,
                " {:>24}",
                format!(
                    "{} / {}",
                    r(m.decode_tokens_per_s, x.decode_tokens_per_s),
                    r(m.e2e_tokens_per_s, x.e2e_tokens_per_s)
                )
            );
        }
        let _ = writeln!(s);
    }
    s
}
