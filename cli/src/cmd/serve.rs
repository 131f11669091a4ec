//! `leap serve`: llama-server's HTTP API over Leap's engine (the server itself is
//! `leap-server`, server/).

use anyhow::Result;
use clap::Args;
use leap_cli::models;

#[derive(Args)]
pub struct ServeArgs {
    /// A model name (`leap models`) or a path to a GGUF file.
    #[arg(short, long, default_value = models::DEFAULT_MODEL)]
    model: String,
    #[command(flatten)]
    pub(crate) serve: leap_server::ServeArgs,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    leap_server::run(&models::resolve(&a.model)?, &a.serve)
}
