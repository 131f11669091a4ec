//! `leap profile`: what a target call of k rows costs here, relative to one row.

use std::io::Write;

use anyhow::Result;
use clap::Args;
use leap_cli::models;
use leap_host::{ContextParams, Model, ModelParams};

use super::options::RuntimeArgs;

#[derive(Args)]
pub struct ProfileArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// Tokens of context in the KV cache while measuring.
    #[arg(long, default_value_t = 1000)]
    context: usize,
    /// Row counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,6,8,12,16")]
    rows: Vec<usize>,
    /// Rounds of measurement: each round times every row count once, and the median over the
    /// rounds is reported (so a busy moment on a shared machine moves no figure much).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Which paths to time, comma separated: `llama` (llama.cpp's call with every row's logits,
    /// and with the last row's only, the output projection by ggml as in Leap's own contexts;
    /// llama.cpp built with Leap, `--spec-type leap`, has Leap's device compute it, for less)
    /// and `engine` (Leap's: the call cut before the output projection, then every row
    /// projected in one pass). One path alone takes about half the time of both.
    #[arg(long, value_delimiter = ',', default_value = "llama,engine", value_parser = ["llama", "engine"])]
    paths: Vec<String>,
    /// Also show where each call's time goes: the time Leap's device spent on each kind of
    /// node (weight products, attention, ...), and the rest of the call (ggml's CPU backend
    /// and llama.cpp), as means over `--reps` calls of each row count, on the engine's path
    /// when it is timed (else llama.cpp's, every row's logits). The per-kind figures are
    /// wall time: a node's threads wait for each other inside it.
    #[arg(long)]
    ops: bool,
    #[command(flatten)]
    runtime: RuntimeArgs,
}

pub fn profile(a: ProfileArgs) -> Result<()> {
    let path = models::resolve(&a.model)?;
    let device = leap_backend::Device::new(a.runtime.setup_for(Some(&path))?);
    let model = Model::load(&path, &ModelParams::default())?;
    let model = std::sync::Arc::new(model);
    let (mut ctx, od) = device.bind(|| {
        leap_host::project::OnDemand::context(
            &model,
            &ContextParams {
                n_ctx: a
                    .runtime
                    .ctx
                    .max((a.context + a.rows.iter().max().unwrap_or(&1) + 8) as u32),
                n_threads: a.runtime.threads,
                n_threads_batch: a.runtime.threads,
                flash_attn: a.runtime.flash_attn(),
                ..Default::default()
            },
        )
    })?;
    // Real text for the context: the vocabulary's own pieces would do, but a repeated
    // paragraph keeps the attention pattern ordinary.
    let para = "Packages are installed, upgraded and removed with apt, which resolves dependencies                 and calls dpkg to unpack and configure each archive. ";
    let mut text = String::new();
    let mut tokens = Vec::new();
    while tokens.len() < a.context.max(1) {
        text.push_str(para);
        tokens = model.tokenize(&text, true, false)?;
    }
    tokens.truncate(a.context.max(1));
    let paths = leap_spec::control::Paths {
        llama: a.paths.iter().any(|p| p == "llama"),
        engine: a.paths.iter().any(|p| p == "engine"),
    };
    let curve = leap_spec::control::measure_cost_curve(
        &mut ctx,
        od.as_ref(),
        &tokens,
        &a.rows,
        a.reps,
        paths,
    )?;
    let one = curve.iter().find(|p| p.rows == 1).unwrap_or(&curve[0]);
    let (base, engine_base) = (one.all_logits, one.engine());
    // A figure and its ratio to the one-row call's, or dashes for a path not timed.
    let cell = |x: Option<f64>, base: Option<f64>| match (x, base) {
        (Some(x), Some(b)) => (format!("{:.2} ms", x * 1e3), format!("{:.2}x", x / b)),
        // A path not timed at one row is timed at none.
        _ => ("-".into(), "-".into()),
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{} | context {} | {} threads | flash-attn {} | kernels {}",
        model.desc(),
        tokens.len(),
        a.runtime.threads,
        a.runtime.flash_attn().as_str(),
        a.runtime.kernels
    )?;
    writeln!(
        out,
        "{:>5} {:>12} {:>10} {:>12} {:>10} {:>12} {:>12} {:>10}",
        "rows",
        "all logits",
        "vs 1 row",
        "last logits",
        "vs 1 row",
        "hidden only",
        "project all",
        "vs 1 row"
    )?;
    for p in &curve {
        let (all, all_x) = cell(p.all_logits, base);
        let (last, last_x) = cell(p.last_logits, base);
        let (cut, proj) = p.cut.map_or(("-".into(), "-".into()), |(c, j)| {
            (format!("{:.2} ms", c * 1e3), format!("{:.2} ms", j * 1e3))
        });
        let engine = match p.cut {
            Some(_) => cell(p.engine(), engine_base).1,
            None => "-".into(),
        };
        writeln!(
            out,
            "{:>5} {:>12} {:>10} {:>12} {:>10} {:>12} {:>12} {:>10}",
            p.rows, all, all_x, last, last_x, cut, proj, engine
        )?;
    }
    if od.is_some() && paths.engine {
        writeln!(
        out,
            "hidden only: the call cut before the output projection (Leap's on-demand projection); \
             project all: every row's logits in one pass afterwards (the engine's path: \
             the last column, hidden only + project all against one row's)"
        )?;
    }
    if a.ops {
        drop(out);
        ops(
            &device,
            &mut ctx,
            od.as_ref().filter(|_| paths.engine),
            &tokens,
            &a,
        )?;
    }
    Ok(())
}

/// `--ops`: per row count, the device's time per kind of node and the rest of the call.
fn ops(
    device: &leap_backend::Device,
    ctx: &mut leap_host::Context,
    od: Option<&leap_host::project::OnDemand>,
    context: &[leap_host::Token],
    a: &ProfileArgs,
) -> Result<()> {
    use leap_backend::OpClass;
    let max_rows = a.rows.iter().copied().max().unwrap_or(1);
    let mut batch = leap_host::Batch::new(max_rows, 1);
    let reps = a.reps.max(1);
    // Per row count: the mean call and the device's times per call.
    let mut per = Vec::with_capacity(a.rows.len());
    for &k in &a.rows {
        let mut call = 0.0;
        device.start_timing();
        for _ in 0..reps {
            call += match od {
                Some(od) => {
                    od.arm(true);
                    let t = leap_spec::control::timed_call(ctx, &mut batch, context, k, true, true);
                    od.disarm();
                    let t = t?;
                    od.take_hidden()?;
                    t
                }
                None => leap_spec::control::timed_call(ctx, &mut batch, context, k, true, false)?,
            };
        }
        let times = device.take_timing();
        per.push((k, call / reps as f64, times));
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "where a call's time goes ({}, ms per call, means over {reps} calls):",
        if od.is_some() {
            "the engine's path, cut before the output projection"
        } else {
            "llama.cpp's call with every row's logits"
        }
    )?;
    write!(out, "{:>5} {:>9}", "rows", "call")?;
    for c in OpClass::ALL {
        write!(out, " {:>12}", c.name())?;
    }
    writeln!(out, " {:>12}", "rest")?;
    let row = |out: &mut std::io::StdoutLock<'_>, label: &str, call: f64, t: &[f64]| {
        write!(out, "{label:>5} {:>9.3}", call * 1e3)?;
        for x in t {
            write!(out, " {:>12.3}", x * 1e3)?;
        }
        writeln!(out, " {:>12.3}", (call - t.iter().sum::<f64>()) * 1e3)
    };
    let reps_f = reps as f64;
    for (k, call, times) in &per {
        let t: Vec<f64> = OpClass::ALL.iter().map(|&c| times.of(c) / reps_f).collect();
        row(&mut out, &k.to_string(), *call, &t)?;
    }
    // What each row past the first adds, at the largest row count.
    if let (Some((1, c1, t1)), Some((k, ck, tk))) = (per.iter().find(|p| p.0 == 1), per.last()) {
        if *k > 1 {
            let d = (*k - 1) as f64;
            let t: Vec<f64> = OpClass::ALL
                .iter()
                .map(|&c| (tk.of(c) - t1.of(c)) / reps_f / d)
                .collect();
            row(&mut out, "+row", (ck - c1) / d, &t)?;
        }
    }
    writeln!(
        out,
        "kinds: Leap's device's nodes by kind (wall time, its threads included); rest: the call's \
         other time (ggml's CPU backend's nodes, llama.cpp's own work); +row: what each row \
         past the first added, from one row to the largest row count"
    )?;
    Ok(())
}
