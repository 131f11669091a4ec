//! The `leap-bench/1` report of `../shared/BENCH.md`. Fields may be added, never renamed or
//! dropped: people, CI and release notes read them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Schema tag.
pub const SCHEMA: &str = "leap-bench/1";

/// The whole report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub model: String,
    pub draft: Option<String>,
    pub threads: i32,
    pub ctx: u32,
    pub cpu: String,
    pub workload: String,
    pub n_requests: usize,
    pub n_skipped: usize,
    pub flash_budget: Option<f64>,
    pub flash_attn: String,
    /// Sampling temperature (0 = greedy). Added field.
    #[serde(default)]
    pub temp: f32,
    /// Modes in the order given on the command line (a BTreeMap keeps the JSON stable).
    pub modes: BTreeMap<String, ModeReport>,
}

/// One mode's totals and per-request rows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ModeReport {
    pub decode_tokens_per_s: f64,
    pub generated_tokens: u64,
    pub decode_seconds: f64,
    pub prefill_seconds: f64,
    pub target_calls: u64,
    pub mean_accepted_per_call: f64,
    pub drafted_tokens: u64,
    pub cpu_seconds: f64,
    pub peak_rss_bytes: u64,
    pub storage_read_bytes: Option<u64>,
    pub identical_to_plain: Option<bool>,
    /// Mean wall time of drafting per target call, in milliseconds. Added field.
    #[serde(default)]
    pub draft_ms_per_call: f64,
    /// Mean calibration time per prompt token, in milliseconds (Leap's in-context
    /// calibration; 0 without it). Added field.
    #[serde(default)]
    pub calib_ms_per_prompt_token: f64,
    /// Mean wall time of verification (target call + on-demand projection) per target
    /// call, in milliseconds (Leap's modes; 0 for the others). Added field.
    #[serde(default)]
    pub verify_ms_per_call: f64,
    /// The on-demand output projection's part of `verify_ms_per_call`. Added field.
    #[serde(default)]
    pub project_ms_per_call: f64,
    /// Flash streaming (`--flash-budget`): the most weight bytes resident during a decode
    /// call, pinned plus streamed (`mincore` at layer and chunk boundaries). Added field.
    #[serde(default)]
    pub flash_peak_resident_bytes: Option<u64>,
    /// Flash streaming: seconds decode calls waited for weights to be read. Added field.
    #[serde(default)]
    pub flash_blocked_seconds: Option<f64>,
    /// Rows that entered verification during decode (target-call rows). Added field.
    #[serde(default)]
    pub verify_rows: u64,
    /// Rows that went on past the early-exit layer (all of them without pruning heads).
    /// Added field.
    #[serde(default)]
    pub rows_after_exit: u64,
    /// Rows whose logits were computed (output-projection rows). Added field.
    #[serde(default)]
    pub output_rows: u64,
    /// In calls the early-exit head decided on: accepted drafted tokens, and those on the
    /// part of the tree pruning kept (`leap:exit-measure`: would have kept, on the same
    /// trees). Added fields.
    #[serde(default)]
    pub exit_accepted: u64,
    #[serde(default)]
    pub exit_accepted_kept: u64,
    /// Seconds the early-exit head took deciding. Added field.
    #[serde(default)]
    pub exit_seconds: f64,
    /// Requests whose output differs from `plain` (ids). Added field.
    #[serde(default)]
    pub differing_requests: Vec<String>,
    /// Mean time to first token, in seconds: the prefill, from whose logits the first token
    /// is sampled (`server:*`: the server's own `prompt_ms`). Added field.
    #[serde(default)]
    pub mean_ttft_seconds: f64,
    /// End to end: generated tokens over prefill plus decode seconds. Added field.
    #[serde(default)]
    pub e2e_tokens_per_s: f64,
    pub requests: Vec<RequestReport>,
}

/// One request in one mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestReport {
    pub id: String,
    /// Added field: the request's task.
    #[serde(default)]
    pub task: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub decode_seconds: f64,
    /// Added field.
    #[serde(default)]
    pub prefill_seconds: f64,
    pub target_calls: u64,
    /// Added field.
    #[serde(default)]
    pub drafted_tokens: u64,
    /// Added field: wall time spent drafting.
    #[serde(default)]
    pub draft_seconds: f64,
    /// Added field: wall time of in-context calibration beyond the prefill, part of
    /// `prefill_seconds`.
    #[serde(default)]
    pub calib_seconds: f64,
    /// Added field: wall time of verification (Leap's modes), part of `decode_seconds`.
    #[serde(default)]
    pub verify_seconds: f64,
    /// Added field: the on-demand output projection's part of `verify_seconds`.
    #[serde(default)]
    pub project_seconds: f64,
    /// Added field: rows that entered verification.
    #[serde(default)]
    pub verify_rows: u64,
    /// Added field: rows past the early-exit layer.
    #[serde(default)]
    pub rows_after_exit: u64,
    /// Added field: rows whose logits were computed.
    #[serde(default)]
    pub output_rows: u64,
    /// Added fields: as the mode's.
    #[serde(default)]
    pub exit_accepted: u64,
    #[serde(default)]
    pub exit_accepted_kept: u64,
    #[serde(default)]
    pub exit_seconds: f64,
    pub output_sha256: String,
}

impl ModeReport {
    /// Fill the totals from the per-request rows.
    pub fn total(&mut self) {
        self.generated_tokens = self
            .requests
            .iter()
            .map(|r| r.generated_tokens as u64)
            .sum();
        self.decode_seconds = self.requests.iter().map(|r| r.decode_seconds).sum();
        self.prefill_seconds = self.requests.iter().map(|r| r.prefill_seconds).sum();
        self.target_calls = self.requests.iter().map(|r| r.target_calls).sum();
        self.drafted_tokens = self.requests.iter().map(|r| r.drafted_tokens).sum();
        self.decode_tokens_per_s = ratio(self.generated_tokens as f64, self.decode_seconds);
        self.mean_accepted_per_call = ratio(self.generated_tokens as f64, self.target_calls as f64);
        let draft: f64 = self.requests.iter().map(|r| r.draft_seconds).sum();
        self.draft_ms_per_call = ratio(draft * 1e3, self.target_calls as f64);
        let calib: f64 = self.requests.iter().map(|r| r.calib_seconds).sum();
        let prompt: usize = self.requests.iter().map(|r| r.prompt_tokens).sum();
        self.calib_ms_per_prompt_token = ratio(calib * 1e3, prompt as f64);
        let verify: f64 = self.requests.iter().map(|r| r.verify_seconds).sum();
        self.verify_ms_per_call = ratio(verify * 1e3, self.target_calls as f64);
        let project: f64 = self.requests.iter().map(|r| r.project_seconds).sum();
        self.project_ms_per_call = ratio(project * 1e3, self.target_calls as f64);
        self.verify_rows = self.requests.iter().map(|r| r.verify_rows).sum();
        self.rows_after_exit = self.requests.iter().map(|r| r.rows_after_exit).sum();
        self.output_rows = self.requests.iter().map(|r| r.output_rows).sum();
        self.exit_accepted = self.requests.iter().map(|r| r.exit_accepted).sum();
        self.exit_accepted_kept = self.requests.iter().map(|r| r.exit_accepted_kept).sum();
        self.exit_seconds = self.requests.iter().map(|r| r.exit_seconds).sum();
        self.mean_ttft_seconds = ratio(self.prefill_seconds, self.requests.len() as f64);
        self.e2e_tokens_per_s = ratio(
            self.generated_tokens as f64,
            self.prefill_seconds + self.decode_seconds,
        );
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// SHA-256 of token ids as little-endian i32, hex (the report's `output_sha256`).
pub fn tokens_sha256(tokens: &[i32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Check a report (as JSON) against the contract: every required field present with the
/// right type, and the derived totals consistent. Returns the problems found.
pub fn validate(v: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    let mut problems = Vec::new();
    fn check(problems: &mut Vec<String>, obj: &Value, key: &str, ok: fn(&Value) -> bool, at: &str) {
        match obj.get(key) {
            None => problems.push(format!("{at}: missing `{key}`")),
            Some(x) if !ok(x) => problems.push(format!("{at}: `{key}` has the wrong type ({x})")),
            _ => {}
        }
    }
    let num = |x: &Value| x.is_number();
    let uint = |x: &Value| x.is_u64();
    let string = |x: &Value| x.is_string();
    let str_or_null = |x: &Value| x.is_string() || x.is_null();
    let num_or_null = |x: &Value| x.is_number() || x.is_null();
    let bool_or_null = |x: &Value| x.is_boolean() || x.is_null();
    let object = |x: &Value| x.is_object();
    let array = |x: &Value| x.is_array();
    check(&mut problems, v, "schema", string, "report");
    if v.get("schema")
        .and_then(Value::as_str)
        .is_some_and(|s| s != SCHEMA)
    {
        problems.push(format!("report: schema is not {SCHEMA}"));
    }
    for k in ["model", "cpu", "workload", "flash_attn"] {
        check(&mut problems, v, k, string, "report");
    }
    check(&mut problems, v, "draft", str_or_null, "report");
    for k in ["threads", "ctx", "n_requests", "n_skipped"] {
        check(&mut problems, v, k, uint, "report");
    }
    check(&mut problems, v, "flash_budget", num_or_null, "report");
    check(&mut problems, v, "modes", object, "report");
    let Some(modes) = v.get("modes").and_then(Value::as_object) else {
        return problems;
    };
    for (name, m) in modes {
        let at = format!("mode {name}");
        for k in [
            "decode_tokens_per_s",
            "decode_seconds",
            "prefill_seconds",
            "mean_accepted_per_call",
            "cpu_seconds",
        ] {
            check(&mut problems, m, k, num, &at);
        }
        for k in [
            "generated_tokens",
            "target_calls",
            "drafted_tokens",
            "peak_rss_bytes",
        ] {
            check(&mut problems, m, k, uint, &at);
        }
        check(
            &mut problems,
            m,
            "storage_read_bytes",
            |x| x.is_u64() || x.is_null(),
            &at,
        );
        check(&mut problems, m, "identical_to_plain", bool_or_null, &at);
        check(&mut problems, m, "requests", array, &at);
        let reqs = m
            .get("requests")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut gen = 0u64;
        let mut secs = 0f64;
        for (i, r) in reqs.iter().enumerate() {
            let at = format!("mode {name} request {i}");
            check(&mut problems, r, "id", string, &at);
            check(
                &mut problems,
                r,
                "output_sha256",
                |x| x.as_str().is_some_and(|s| s.len() == 64),
                &at,
            );
            for k in ["prompt_tokens", "generated_tokens", "target_calls"] {
                check(&mut problems, r, k, uint, &at);
            }
            check(&mut problems, r, "decode_seconds", num, &at);
            gen += r
                .get("generated_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            secs += r
                .get("decode_seconds")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
        }
        if m.get("generated_tokens").and_then(Value::as_u64) != Some(gen) {
            problems.push(format!(
                "{at}: generated_tokens is not the sum over its requests"
            ));
        }
        let tps = m
            .get("decode_tokens_per_s")
            .and_then(Value::as_f64)
            .unwrap_or(-1.0);
        if secs > 0.0 && ((gen as f64 / secs) - tps).abs() > 1e-6 * tps.max(1.0) {
            problems.push(format!(
                "{at}: decode_tokens_per_s is not generated_tokens / decode_seconds"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut m = ModeReport::default();
        m.requests.push(RequestReport {
            id: "a".into(),
            generated_tokens: 10,
            decode_seconds: 0.5,
            target_calls: 5,
            draft_seconds: 0.01,
            output_sha256: tokens_sha256(&[1, 2, 3]),
            ..Default::default()
        });
        m.total();
        Report {
            schema: SCHEMA.into(),
            model: "m.gguf".into(),
            draft: None,
            threads: 2,
            ctx: 4096,
            cpu: "cpu".into(),
            workload: "w.jsonl".into(),
            n_requests: 1,
            n_skipped: 0,
            flash_budget: None,
            flash_attn: "auto".into(),
            temp: 0.0,
            modes: [("plain".to_string(), m)].into_iter().collect(),
        }
    }

    #[test]
    fn totals_follow_requests() {
        let r = sample();
        let m = &r.modes["plain"];
        assert_eq!(m.generated_tokens, 10);
        assert!((m.decode_tokens_per_s - 20.0).abs() < 1e-9);
        assert!((m.mean_accepted_per_call - 2.0).abs() < 1e-9);
        assert!((m.draft_ms_per_call - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_valid_report_validates() {
        let v = serde_json::to_value(sample()).unwrap();
        assert_eq!(validate(&v), Vec::<String>::new());
    }

    #[test]
    fn validation_catches_missing_and_inconsistent_fields() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v.as_object_mut().unwrap().remove("cpu");
        v["modes"]["plain"]["decode_tokens_per_s"] = serde_json::json!(99.0);
        v["modes"]["plain"]["requests"][0]["output_sha256"] = serde_json::json!("short");
        let p = validate(&v);
        assert!(p.iter().any(|s| s.contains("missing `cpu`")), "{p:?}");
        assert!(p.iter().any(|s| s.contains("decode_tokens_per_s")), "{p:?}");
        assert!(p.iter().any(|s| s.contains("output_sha256")), "{p:?}");
    }

    #[test]
    fn token_hash_is_little_endian_i32() {
        // sha256 of the 4 bytes 01 00 00 00
        assert_eq!(
            tokens_sha256(&[1]),
            "67abdd721024f0ff4e0b3f4c2fc13bc5bad42d0b7851d456d88d203d15aaa450"
        );
    }
}
