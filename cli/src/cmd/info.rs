//! `leap info`: a GGUF model's architecture, layers, vocabulary and sizes, its tensors, and
//! the flash layer's view of it under a DRAM budget.

use std::io::Write;

use anyhow::Result;
use clap::Args;
use leap_cli::models;
use leap_host::{GgufInfo, Model, ModelParams};

use super::options::parse_budget;

#[derive(Args)]
pub struct InfoArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    model: String,
    /// Also list every tensor.
    #[arg(long)]
    tensors: bool,
    /// Also show what flash streaming would keep resident with this fraction of the
    /// weights (or bytes, with a unit: `64M`) as the DRAM budget, and how much of each
    /// part of the file is in DRAM now.
    #[arg(long)]
    flash_budget: Option<String>,
}

pub fn info(a: InfoArgs) -> Result<()> {
    let path = models::resolve(&a.model)?;
    let g = GgufInfo::open(&path)?;
    let m = Model::load(&path, &ModelParams::default())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "file          {}", path.display())?;
    writeln!(out, "description   {}", m.desc())?;
    writeln!(out, "architecture  {}", g.architecture().unwrap_or("?"))?;
    if let Some(name) = g.get_str("general.name") {
        writeln!(out, "name          {name}")?;
    }
    writeln!(out, "layers        {}", m.n_layer())?;
    writeln!(out, "embedding     {}", m.n_embd())?;
    writeln!(out, "heads         {} (kv {})", m.n_head(), m.n_head_kv())?;
    writeln!(out, "vocabulary    {} tokens", m.n_vocab())?;
    writeln!(out, "train context {}", m.n_ctx_train())?;
    writeln!(out, "parameters    {:.1} M", m.n_params() as f64 / 1e6)?;
    writeln!(out, "weights       {:.1} MB", m.size() as f64 / 1e6)?;
    writeln!(
        out,
        "file size     {:.1} MB (GGUF v{}, {} tensors, {} metadata keys)",
        g.file_size as f64 / 1e6,
        g.version,
        g.tensors.len(),
        g.kv.len()
    )?;
    writeln!(
        out,
        "chat template {}",
        if m.chat_template(None).is_some() {
            "yes"
        } else {
            "no"
        }
    )?;
    if a.tensors {
        for t in &g.tensors {
            writeln!(
                out,
                "  {:<40} {:<6} {:?} {} bytes @ {}",
                t.name, t.ggml_type, t.ne, t.size, t.offset
            )?;
        }
    }
    if let Some(b) = &a.flash_budget {
        flash_info(&mut out, &path, b)?;
    }
    Ok(())
}

/// The flash layer's view of a model: its sections, what a budget keeps resident, and what
/// is in DRAM now.
fn flash_info(out: &mut impl Write, path: &std::path::Path, budget: &str) -> Result<()> {
    use leap_flash::{plan, LayerMap, Pages, Section, Strategy};
    let map = LayerMap::open(path)?;
    let pages = Pages::open(path)?;
    let per_call = map.per_call_bytes();
    let budget = parse_budget(budget, per_call)?;
    let mb = |b: u64| b as f64 / 1e6;
    let resident = |s: Section| -> Result<u64> {
        map.ranges(s)
            .iter()
            .map(|r| Ok(pages.resident(r.clone())?))
            .sum()
    };
    writeln!(
        out,
        "flash         {:.1} MB read by every target call ({} blocks, output projection {}{:.1} MB)",
        mb(per_call),
        map.blocks(),
        if map.tied_output { "tied to the embeddings: " } else { "" },
        mb(map.bytes(if map.tied_output { Section::Embed } else { Section::Output }))
    )?;
    for (s, _) in &map.sections {
        writeln!(
            out,
            "  {:<14} {:>8.2} MB, {:>8.2} MB in DRAM now",
            format!("{s:?}"),
            mb(map.bytes(*s)),
            mb(resident(*s)?)
        )?;
    }
    // Streamed a block at a time (the output projection in chunks of that size), one ahead.
    let chunk = map.largest_block().max(1);
    for strategy in [Strategy::Fill, Strategy::FirstLayers, Strategy::OutputFirst] {
        let p = plan(&map, budget, chunk, 1, strategy);
        writeln!(
        out,
            "budget {:.1} MB, {strategy:?}: {:.1} MB pinned ({} sections), {:.1} MB streamed a call, window {:.1} MB",
            mb(budget),
            mb(p.pinned_bytes),
            p.pinned.len(),
            mb(p.streamed_bytes),
            mb(p.window)
        )?;
    }
    Ok(())
}
