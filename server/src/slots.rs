//! Slots: `--parallel N` threads, each with its own [`Session`] (a llama.cpp context and the
//! engine decoding in it), taking requests from one queue. A request never shares a batch with
//! another, so its tokens do not depend on what else is running. A slot's session is kept
//! across requests: earlier requests and answers feed its drafter, and it keeps the KV cache of
//! its last prompt and output. A queued request goes to the idle slot whose cache shares the
//! longest prefix with its prompt, so a conversation's next turn finds its earlier turns.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use leap_host::Token;
use leap_spec::session::{Request, Runtime, Session};
use leap_spec::text::TextStream;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a finished request reports.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub finish: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub target_calls: u64,
}

impl Outcome {
    /// OpenAI's `usage`.
    pub fn usage(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    /// llama-server's `timings`, with Leap's target calls.
    pub fn timings(&self) -> serde_json::Value {
        let per_s = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        serde_json::json!({
            "prompt_n": self.prompt_tokens,
            "prompt_ms": self.prefill_seconds * 1e3,
            "prompt_per_second": per_s(self.prompt_tokens, self.prefill_seconds),
            "predicted_n": self.completion_tokens,
            "predicted_ms": self.decode_seconds * 1e3,
            "predicted_per_second": per_s(self.completion_tokens, self.decode_seconds),
            "target_calls": self.target_calls,
            "accepted_per_call": if self.target_calls > 0 {
                self.completion_tokens as f64 / self.target_calls as f64
            } else {
                0.0
            },
        })
    }
}

/// What a slot sends back while it works on a request.
#[derive(Debug)]
pub enum Event {
    /// More text (complete UTF-8, never part of a stop string).
    Text(String),
    Done(Outcome),
    Error(ApiError),
}

/// A request for a slot.
pub struct Job {
    pub prompt: Vec<Token>,
    /// `None`: to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: leap_host::sampler::SamplingParams,
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
}

/// The queue and what each slot holds, under one lock.
#[derive(Default)]
struct Sched {
    queue: VecDeque<Job>,
    /// Per slot: idle, and the tokens its KV cache holds (its last prompt and output).
    idle: Vec<bool>,
    held: Vec<Vec<Token>>,
    closed: bool,
}

impl Sched {
    /// The idle slot a job goes to: the one whose cache shares the longest prefix with its
    /// prompt (a conversation's next turn finds its earlier turns there), the lowest on ties.
    fn best_slot(&self, prompt: &[Token]) -> Option<usize> {
        (0..self.idle.len())
            .filter(|&i| self.idle[i])
            .max_by_key(|&i| (common_prefix(&self.held[i], prompt), std::cmp::Reverse(i)))
    }

    /// The first queued job `slot` should take, if any.
    fn take_for(&mut self, slot: usize) -> Option<Job> {
        let k = self
            .queue
            .iter()
            .position(|j| self.best_slot(&j.prompt) == Some(slot))?;
        self.queue.remove(k)
    }
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The slots and their queue. Dropping it lets each slot finish its request, then joins them.
pub struct Pool {
    sched: Arc<(Mutex<Sched>, Condvar)>,
    /// Set by [`Pool::abort`]: every slot stops its job at the next token.
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Start `n` slots on `rt`, each creating its session on its own thread. Returns when
    /// every slot is ready.
    ///
    /// # Errors
    /// A session that could not be created (memory for the context).
    pub fn start(rt: Arc<Runtime>, n: usize, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let sched = Arc::new((
            Mutex::new(Sched {
                idle: vec![true; n],
                held: vec![Vec::new(); n],
                ..Default::default()
            }),
            Condvar::new(),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = mpsc::channel();
        for i in 0..n {
            let (rt, sched, stop, metrics, ready) = (
                Arc::clone(&rt),
                Arc::clone(&sched),
                Arc::clone(&stop),
                Arc::clone(&metrics),
                ready_tx.clone(),
            );
            let t = std::thread::Builder::new()
                .name(format!("leap-slot-{i}"))
                .spawn(move || {
                    let mut session = match rt.session() {
                        Ok(s) => {
                            let _ = ready.send(Ok(()));
                            s
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    drop(ready);
                    let (lock, cv) = &*sched;
                    loop {
                        let job = {
                            let Ok(mut s) = lock.lock() else { return };
                            loop {
                                if let Some(j) = s.take_for(i) {
                                    s.idle[i] = false;
                                    break j;
                                }
                                if s.closed && s.queue.is_empty() {
                                    return;
                                }
                                s = match cv.wait(s) {
                                    Ok(s) => s,
                                    Err(_) => return,
                                };
                            }
                        };
                        metrics.dequeued();
                        if job.events.is_closed() {
                            metrics.cancelled();
                        } else {
                            serve(&rt, &mut session, job, &stop, &metrics, i);
                        }
                        let Ok(mut s) = lock.lock() else { return };
                        s.idle[i] = true;
                        s.held[i] = session.held().to_vec();
                        drop(s);
                        // Another slot may have left a job for this one.
                        cv.notify_all();
                    }
                })?;
            threads.push(t);
        }
        drop(ready_tx);
        let pool = Self {
            sched,
            stop,
            threads,
        };
        for r in ready_rx.iter().take(n) {
            r?;
        }
        Ok(pool)
    }

    /// Queue a job; the idle slot that holds most of its prompt takes it (or the next to
    /// become idle).
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let (lock, cv) = &*self.sched;
        let mut s = lock
            .lock()
            .map_err(|_| ApiError::internal("a slot panicked"))?;
        if s.closed {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        s.queue.push_back(job);
        drop(s);
        cv.notify_all();
        Ok(())
    }

    /// Give up on the requests in flight: the queued ones are dropped (their clients are told
    /// the server is shutting down) and each slot stops its job at the next token.
    pub fn abort(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let (lock, cv) = &*self.sched;
        if let Ok(mut s) = lock.lock() {
            s.closed = true;
            s.queue.clear();
        }
        cv.notify_all();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let (lock, cv) = &*self.sched;
        if let Ok(mut s) = lock.lock() {
            s.closed = true;
        }
        cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Run one job on a slot's session, streaming its text as [`Event`]s, until it ends, its
/// client hangs up or `stop` is set.
fn serve(
    rt: &Runtime,
    session: &mut Session,
    job: Job,
    stop: &AtomicBool,
    metrics: &Metrics,
    slot: usize,
) {
    let model = rt.model();
    let n_ctx = session.n_ctx() as usize;
    let max_tokens = job
        .max_tokens
        .unwrap_or_else(|| n_ctx.saturating_sub(job.prompt.len()));
    let req = Request {
        max_tokens,
        sampling: job.sampling,
    };
    metrics.started();
    let t0 = Instant::now();
    let mut text = TextOut::new(job.stop.clone());
    let mut gone = false;
    let mut on_token = |t: Token| {
        let piece = model.token_to_piece(t, false).unwrap_or_default();
        let (out, stop_string) = text.push(&piece);
        if !out.is_empty() && job.events.send(Event::Text(out)).is_err() {
            gone = true;
            return false;
        }
        if job.events.is_closed() || stop.load(Ordering::Relaxed) {
            gone = true;
            return false;
        }
        !stop_string
    };
    let r = session.generate(&job.prompt, &req, &mut on_token);
    metrics.finished();
    let g = match r {
        Ok(g) => g,
        Err(e) => {
            log::warn!("slot {slot}: request failed: {e}");
            metrics.failed();
            let _ = job.events.send(Event::Error(e.into()));
            return;
        }
    };
    if gone {
        log::info!(
            "slot {slot}: the client hung up (or the server stopped it) after {} tokens; slot freed",
            g.tokens.len()
        );
        metrics.cancelled();
        return;
    }
    let rest = text.finish();
    if !rest.is_empty() {
        let _ = job.events.send(Event::Text(rest));
    }
    let eog = g.tokens.last().is_some_and(|&t| model.is_eog(t));
    let finish = if eog || text.stopped {
        Finish::Stop
    } else {
        Finish::Length
    };
    let o = Outcome {
        finish,
        prompt_tokens: job.prompt.len(),
        completion_tokens: g.tokens.len(),
        prefill_seconds: g.prefill_seconds,
        decode_seconds: g.decode_seconds,
        target_calls: g.target_calls,
    };
    metrics.record(&o);
    log::info!(
        "slot {slot}: {} prompt tokens, {} tokens in {:.2} s ({:.1} tok/s, {:.2} per target call), {:.2} s in all",
        o.prompt_tokens,
        o.completion_tokens,
        o.decode_seconds,
        if o.decode_seconds > 0.0 { o.completion_tokens as f64 / o.decode_seconds } else { 0.0 },
        if o.target_calls > 0 { o.completion_tokens as f64 / o.target_calls as f64 } else { 0.0 },
        t0.elapsed().as_secs_f64()
    );
    let _ = job.events.send(Event::Done(o));
}

/// A generation's text as it may be sent: complete UTF-8 only ([`TextStream`]), and never
/// text that could be the start of a stop string (held back until it is known not to be
/// one). At a stop string the text before it is the output and the rest is dropped.
#[derive(Debug, Default)]
pub struct TextOut {
    utf8: TextStream,
    /// The complete characters so far.
    text: String,
    /// How much of `text` went out.
    sent: usize,
    stops: Vec<String>,
    /// A stop string was found.
    pub stopped: bool,
}

impl TextOut {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Default::default()
        }
    }

    /// Add a token's bytes; returns the text that may go out now, and whether a stop string
    /// ended the output.
    pub fn push(&mut self, piece: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.text.push_str(&self.utf8.push(piece));
        let text = self.text.as_str();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string can only end in the new text: search from where one could start.
        let mut from = self.sent.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            self.stopped = true;
            let out = text.get(self.sent..at).unwrap_or("").to_string();
            self.sent = at.max(self.sent);
            return (out, true);
        }
        // Hold back the longest tail that begins some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
                    .take(1)
            })
            .max()
            .unwrap_or(0);
        let upto = text.len() - hold;
        if upto <= self.sent {
            return (String::new(), false);
        }
        let out = text[self.sent..upto].to_string();
        self.sent = upto;
        (out, false)
    }

    /// The end of the generation: whatever was held back (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(&self.utf8.finish());
        let rest = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::{Sched, TextOut};

    #[test]
    fn a_job_goes_to_the_idle_slot_holding_most_of_its_prompt() {
        let s = Sched {
            idle: vec![true, false, true, true],
            held: vec![vec![1, 2], vec![1, 2, 3, 4, 5], vec![1, 2, 3, 9], vec![]],
            ..Default::default()
        };
        assert_eq!(s.best_slot(&[1, 2, 3, 4, 5, 6]), Some(2), "slot 1 is busy");
        assert_eq!(s.best_slot(&[7]), Some(0), "the lowest on ties");
        let none = Sched {
            idle: vec![false],
            held: vec![vec![]],
            ..Default::default()
        };
        assert_eq!(none.best_slot(&[1]), None);
    }

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, String, bool) {
        let mut t = TextOut::new(stops.iter().map(|s| s.to_string()).collect());
        let mut outs = Vec::new();
        for p in pieces {
            let (o, stop) = t.push(p);
            outs.push(o);
            if stop {
                break;
            }
        }
        let rest = t.finish();
        let all = outs.concat() + &rest;
        (outs, all, t.stopped)
    }

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let e = "é".as_bytes();
        let (outs, all, _) = run(&[], &[b"caf", &e[..1], &e[1..], b"!"]);
        assert_eq!(outs, vec!["caf", "", "é", "!"]);
        assert_eq!(all, "café!");
    }

    #[test]
    fn stop_strings_cut_the_output_even_across_tokens() {
        let (outs, all, stopped) = run(&["\n\n"], &[b"one", b"\n", b"\ntwo"]);
        assert!(stopped);
        assert_eq!(all, "one");
        // The first newline was held back: it could have started the stop string.
        assert_eq!(outs, vec!["one", "", ""]);
        let (_, all, stopped) = run(&["END"], &[b"abc E", b"N", b"D more"]);
        assert!(stopped);
        assert_eq!(all, "abc ");
    }

    #[test]
    fn a_held_back_prefix_that_is_not_a_stop_goes_out() {
        let (outs, all, stopped) = run(&["STOP"], &[b"ST", b"ART", b"S"]);
        assert!(!stopped);
        assert_eq!(outs, vec!["", "START", ""]);
        assert_eq!(all, "STARTS");
    }

    #[test]
    fn the_earliest_stop_wins() {
        let (_, all, _) = run(&["b", "a"], &[b"xxab"]);
        assert_eq!(all, "xx");
    }
}
