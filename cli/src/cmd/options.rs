//! The option groups several subcommands flatten into theirs ([`RuntimeArgs`],
//! [`SamplingArgs`]), and the values they share: the default thread count and `--flash-budget`
//! sizes.

use std::path::PathBuf;

use anyhow::{bail, ensure, Result};
use clap::Args;
use leap_host::sampler::SamplingParams;
use leap_host::FlashAttn;

#[derive(Args, Clone)]
pub struct RuntimeArgs {
    /// Threads for decoding and prefill (default: one per physical core, as llama.cpp).
    #[arg(short, long, default_value_t = default_threads())]
    pub threads: i32,
    /// Context length in tokens: the prompt and what is generated together (`leap generate`
    /// stops at its end, with a warning).
    #[arg(short = 'c', long, visible_alias = "ctx-size", default_value_t = 4096)]
    pub ctx: u32,
    /// llama.cpp's flash attention (`-fa` too): on, off or auto. Off keeps speculative output
    /// identical to plain decoding (ggml's CPU flash attention rounds a batch otherwise than
    /// one row).
    #[arg(long, default_value = "off")]
    pub flash_attn: FlashAttn,
    /// Who computes the quantized matrix products (and attention's f16 ones, and Gemma's GELU
    /// unit) of decoding, speculative verification and prefill: `leap` (Leap's ggml device: each weight block
    /// unpacked once for all rows, results bit-identical to ggml's) or `ggml` (llama.cpp's CPU
    /// backend alone).
    /// `leap bench` always runs the plain and llama:* modes on ggml's.
    #[arg(long, default_value = "leap", value_parser = ["leap", "ggml"])]
    pub kernels: String,
    /// Leap's sparse attention (shadowAttn): `off`, `on` (each query attends the 20% of its
    /// keys an int8 estimate ranks highest, when it sees 1024 keys or more), or that fraction
    /// (`0.3`). Turns flash attention on; a `MODEL.leap.gguf` sidecar's per-head budgets are
    /// used when present. Approximate: output may differ from dense attention.
    #[arg(long, default_value = "off")]
    pub sparse: String,
    /// Where sparse attention's estimate runs: `cpu` (the leap-cpu device) or `opencl` (the
    /// leap-opencl device: a phone's GPU, PoCL on a PC).
    #[arg(long, default_value = "cpu")]
    pub estimate: leap_backend::attn::EstimateOn,
    /// The model's sidecar (default: MODEL.leap.gguf next to the model). Its early-exit head
    /// (`leap train-heads`) lets `leap` prune verification rows; a head trained on another
    /// model, or a sidecar that cannot be read, is ignored with a warning.
    #[arg(long)]
    pub sidecar: Option<PathBuf>,
}

impl RuntimeArgs {
    /// Register Leap's ggml device (before any context exists) when asked for, and what it is
    /// to do for `model`'s contexts (sparse attention with the sidecar's per-head budgets).
    pub fn setup_for(&self, model: Option<&std::path::Path>) -> Result<leap_backend::DeviceConfig> {
        let sparse = leap_cli::attn::parse_sparse(&self.sparse)?;
        if sparse.is_some() && self.kernels != "leap" {
            bail!("--sparse runs on Leap's device: drop --kernels ggml");
        }
        let on = self.kernels == "leap";
        let opencl = sparse.is_some() && self.estimate == leap_backend::attn::EstimateOn::OpenCl;
        if opencl {
            leap_backend::want_opencl();
        }
        if on {
            leap_backend::register();
        }
        if opencl && !leap_backend::opencl_registered() {
            bail!(
                "--estimate opencl: no usable OpenCL device here ({}); install one (PoCL: scripts/setup) or use --estimate cpu",
                leap_backend::opencl_unavailable_reason()
            );
        }
        let sparse = match (sparse, model) {
            (Some(s), Some(m)) => Some(leap_cli::attn::with_sidecar(s, m)?),
            (s, _) => s,
        }
        .map(|s| leap_backend::attn::Sparse {
            estimate_on: self.estimate,
            ..s
        });
        Ok(leap_backend::DeviceConfig {
            kernels: on,
            sparse,
            ..Default::default()
        })
    }

    /// Register Leap's ggml device when asked for (no model-specific settings).
    pub fn setup(&self) -> leap_backend::DeviceConfig {
        self.setup_for(None).unwrap_or_else(|e| {
            eprintln!("leap: error: {e:#}");
            std::process::exit(2)
        })
    }

    /// The flash-attention setting: on whenever sparse attention is (the device takes
    /// llama.cpp's flash-attention nodes).
    pub fn flash_attn(&self) -> FlashAttn {
        if self.sparse != "off" {
            FlashAttn::On
        } else {
            self.flash_attn
        }
    }
}

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Top-k when sampling.
    #[arg(long, default_value_t = 40)]
    pub top_k: i32,
    /// Top-p (nucleus) when sampling.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p when sampling.
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Seed of the sampler; -1 draws one at random (as llama.cpp's `-s -1`).
    #[arg(short = 's', long, default_value_t = 0x5eed, allow_negative_numbers = true,
          value_parser = parse_seed)]
    pub seed: u32,
}

/// A `--seed`: 0 to 4294967295, or -1 for a random one.
fn parse_seed(s: &str) -> Result<u32, String> {
    match s.trim().parse::<i64>() {
        Ok(-1) => Ok(SamplingParams::random_seed()),
        Ok(n) => u32::try_from(n)
            .map_err(|_| format!("{n}: from 0 to 4294967295, or -1 for a random one")),
        Err(e) => Err(format!("{s}: {e}")),
    }
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temp: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

/// One thread per physical core, as llama.cpp's `-t` ([`leap_host::par::default_threads`]).
pub fn default_threads() -> i32 {
    leap_host::par::default_threads()
}

/// A DRAM budget for flash streaming, in bytes: a fraction of `total` (the bytes every target
/// call reads) in (0, 1] (`0.25`), or a size with a unit (`64M`, `1.5G`, `800K`) above zero and
/// at most `total`. Anything else is refused, saying why: a budget of nothing, more than the
/// weights, or more than all of them would be a silent no-op or a misreading.
pub fn parse_budget(s: &str, total: u64) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1e3),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        Some('G' | 'g') => (&t[..t.len() - 1], 1e9),
        _ => (t, 0.0),
    };
    let v: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
        .ok_or_else(|| {
            anyhow::anyhow!("--flash-budget {s:?}: a fraction (0.25) or a size (64M)")
        })?;
    let mb = total as f64 / 1e6;
    if mul == 0.0 {
        ensure!(
            v > 0.0 && v <= 1.0,
            "--flash-budget {s}: a fraction of the weights must be above 0 and at most 1 \
             (the model's {mb:.1} MB)"
        );
        return Ok(((v * total as f64) as u64).max(1));
    }
    let bytes = v * mul;
    ensure!(bytes >= 1.0, "--flash-budget {s}: a size must be above 0");
    ensure!(
        bytes <= total as f64,
        "--flash-budget {s}: more than the model's {mb:.1} MB of weights (all of it fits: \
         leave --flash-budget out)"
    );
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_budget;

    const MB100: u64 = 100_000_000;

    #[test]
    fn budgets_inside_the_model_are_taken() {
        assert_eq!(parse_budget("0.25", MB100).unwrap(), 25_000_000);
        assert_eq!(parse_budget("1", MB100).unwrap(), MB100);
        assert_eq!(parse_budget("64M", MB100).unwrap(), 64_000_000);
        assert_eq!(parse_budget("800k", MB100).unwrap(), 800_000);
        assert_eq!(parse_budget("0.1G", MB100).unwrap(), MB100);
    }

    #[test]
    fn budgets_of_nothing_or_beyond_the_model_are_refused() {
        for (arg, says) in [
            ("0", "above 0"),
            ("1.5", "at most 1"),
            ("-0.5", "above 0"),
            ("0M", "above 0"),
            ("10G", "more than the model's 100.0 MB"),
            ("nan", "a fraction (0.25) or a size"),
            ("inf", "a fraction (0.25) or a size"),
            ("lots", "a fraction (0.25) or a size"),
            ("", "a fraction (0.25) or a size"),
        ] {
            let e = parse_budget(arg, MB100).unwrap_err().to_string();
            assert!(e.contains(says), "{arg:?}: {e}");
            assert!(!e.contains('\n'), "{arg:?}: one line, got {e:?}");
        }
    }
}
