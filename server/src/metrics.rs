//! Counters for `GET /metrics`, in Prometheus' text format (names as llama-server's, with a
//! `leap:` prefix, plus Leap's target calls and accepted tokens per call). Those llama-server
//! also has are repeated under its `llamacpp:` prefix, so its dashboards read them as they are.

use std::fmt::Write as _;
use std::sync::Mutex;

use crate::slots::Outcome;

#[derive(Debug, Default)]
struct Counts {
    requests: u64,
    failed: u64,
    cancelled: u64,
    processing: u64,
    deferred: u64,
    prompt_tokens: u64,
    prompt_seconds: f64,
    tokens: u64,
    decode_seconds: f64,
    target_calls: u64,
}

/// The server's counters (shared by the slots and the handlers).
#[derive(Debug, Default)]
pub struct Metrics(Mutex<Counts>);

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Counts)) {
        if let Ok(mut c) = self.0.lock() {
            f(&mut c);
        }
    }

    /// A request entered the queue.
    pub fn queued(&self) {
        self.with(|c| c.deferred += 1);
    }

    /// A slot took a request from the queue.
    pub fn dequeued(&self) {
        self.with(|c| c.deferred = c.deferred.saturating_sub(1));
    }

    pub fn started(&self) {
        self.with(|c| c.processing += 1);
    }

    pub fn finished(&self) {
        self.with(|c| c.processing = c.processing.saturating_sub(1));
    }

    pub fn failed(&self) {
        self.with(|c| c.failed += 1);
    }

    /// The client hung up before its request finished.
    pub fn cancelled(&self) {
        self.with(|c| c.cancelled += 1);
    }

    /// Requests decoding or queued now.
    pub fn in_flight(&self) -> u64 {
        self.0.lock().map_or(0, |c| c.processing + c.deferred)
    }

    /// A request finished.
    pub fn record(&self, o: &Outcome) {
        self.with(|c| {
            c.requests += 1;
            c.prompt_tokens += o.prompt_tokens as u64;
            c.prompt_seconds += o.prefill_seconds;
            c.tokens += o.completion_tokens as u64;
            c.decode_seconds += o.decode_seconds;
            c.target_calls += o.target_calls;
        });
    }

    /// The Prometheus text.
    pub fn render(&self) -> String {
        let c = match self.0.lock() {
            Ok(c) => c,
            Err(p) => p.into_inner(),
        };
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let rows: [(&str, &str, &str, f64); 13] = [
            (
                "requests_total",
                "counter",
                "Requests completed.",
                c.requests as f64,
            ),
            (
                "requests_failed_total",
                "counter",
                "Requests the engine failed on.",
                c.failed as f64,
            ),
            (
                "requests_cancelled_total",
                "counter",
                "Requests whose client hung up first.",
                c.cancelled as f64,
            ),
            (
                "requests_processing",
                "gauge",
                "Requests being decoded now.",
                c.processing as f64,
            ),
            (
                "requests_deferred",
                "gauge",
                "Requests waiting for a free slot.",
                c.deferred as f64,
            ),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens prefilled.",
                c.prompt_tokens as f64,
            ),
            (
                "prompt_seconds_total",
                "counter",
                "Seconds of prefill.",
                c.prompt_seconds,
            ),
            (
                "prompt_tokens_seconds",
                "gauge",
                "Prefill tokens per second over all requests.",
                ratio(c.prompt_tokens as f64, c.prompt_seconds),
            ),
            (
                "tokens_predicted_total",
                "counter",
                "Tokens generated.",
                c.tokens as f64,
            ),
            (
                "tokens_predicted_seconds_total",
                "counter",
                "Seconds of decoding (after each prompt's prefill).",
                c.decode_seconds,
            ),
            (
                "predicted_tokens_seconds",
                "gauge",
                "Decode tokens per second over all requests.",
                ratio(c.tokens as f64, c.decode_seconds),
            ),
            (
                "target_calls_total",
                "counter",
                "Target-model calls during decoding.",
                c.target_calls as f64,
            ),
            (
                "accepted_tokens_per_call",
                "gauge",
                "Tokens generated per target call (1 for plain decoding).",
                ratio(c.tokens as f64, c.target_calls as f64),
            ),
        ];
        // The names llama-server's /metrics has, with the same meaning.
        const LLAMA: &[&str] = &[
            "requests_processing",
            "requests_deferred",
            "prompt_tokens_total",
            "prompt_seconds_total",
            "prompt_tokens_seconds",
            "tokens_predicted_total",
            "tokens_predicted_seconds_total",
            "predicted_tokens_seconds",
        ];
        let mut s = String::new();
        for (name, kind, help, v) in rows {
            for prefix in ["leap"]
                .into_iter()
                .chain(LLAMA.contains(&name).then_some("llamacpp"))
            {
                let _ = writeln!(s, "# HELP {prefix}:{name} {help}");
                let _ = writeln!(s, "# TYPE {prefix}:{name} {kind}");
                let _ = writeln!(s, "{prefix}:{name} {v}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slots::Finish;

    #[test]
    fn renders_counts_and_ratios() {
        let m = Metrics::default();
        m.record(&Outcome {
            finish: Finish::Length,
            prompt_tokens: 10,
            cached_tokens: 0,
            completion_tokens: 30,
            prefill_seconds: 0.5,
            decode_seconds: 2.0,
            target_calls: 12,
            logprobs: None,
            tokens: Vec::new(),
            word: false,
        });
        let t = m.render();
        assert!(t.contains("leap:requests_total 1\n"), "{t}");
        assert!(t.contains("leap:tokens_predicted_total 30\n"), "{t}");
        assert!(t.contains("leap:predicted_tokens_seconds 15\n"), "{t}");
        assert!(t.contains("leap:accepted_tokens_per_call 2.5\n"), "{t}");
        // llama-server's names for what it also counts, Leap's own under leap: only.
        assert!(t.contains("llamacpp:tokens_predicted_total 30\n"), "{t}");
        assert!(t.contains("llamacpp:prompt_tokens_seconds 20\n"), "{t}");
        assert!(!t.contains("llamacpp:accepted"), "{t}");
        assert!(
            t.contains("# TYPE leap:target_calls_total counter\n"),
            "{t}"
        );
    }
}
