//! Slots: `--parallel N` threads, each with its own [`Session`] (a llama.cpp context and the
//! engine decoding in it), taking requests from one bounded queue. A request never shares a
//! batch with another, so its tokens do not depend on what else is running.
//!
//! A slot's session is kept across requests of one tenant: earlier requests and answers feed
//! its drafter, and it keeps the KV cache of its last prompt and output, so a conversation's
//! next turn prefills only what is new. A tenant is the API key a request came with (or
//! everyone, with `--shared-cache`); before a slot takes another tenant's request it forgets
//! all of that ([`Session::forget`]), so how fast a request runs says nothing about what other
//! clients sent. A queued request goes to the idle slot whose cache, of its own tenant, shares
//! the longest prefix with its prompt.
//!
//! A client that hangs up stops its request within a graph node, prefill included
//! ([`Session::set_cancel`]). A slot that panics fails its request with a 500, forgets its
//! state and takes the next one.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use leap_host::Token;
use leap_spec::session::{Request, Runtime, Session};
use leap_spec::text::TextOut;
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
    /// Prompt tokens whose KV cache the slot kept from its last request (not prefilled).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub target_calls: u64,
    /// Each emitted token's log-probability and the most likely tokens there, when the
    /// request asked (`logprobs`).
    pub logprobs: Option<Vec<Logprob>>,
    /// The tokens emitted (an end-of-generation token is not).
    pub tokens: Vec<Token>,
    /// A stop string ended the output (`finish` is then [`Finish::Stop`] too).
    pub word: bool,
}

/// A token as `logprobs` reports it: its text (invalid UTF-8 replaced), its bytes, its
/// log-probability.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub id: Token,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// An emitted token's [`Piece`] and the `top_logprobs` most likely tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    pub token: Piece,
    pub top: Vec<Piece>,
}

impl Logprob {
    /// [`Session::score`]'s figures with each token's text.
    fn all(model: &leap_host::Model, lps: Vec<leap_spec::session::TokenLogprob>) -> Vec<Self> {
        let piece = |t: Token, logprob: f32| {
            let bytes = model.token_to_piece(t, false).unwrap_or_default();
            Piece {
                id: t,
                text: String::from_utf8_lossy(&bytes).into_owned(),
                bytes,
                logprob,
            }
        };
        lps.into_iter()
            .map(|l| Logprob {
                token: piece(l.token, l.logprob),
                top: l.top.into_iter().map(|(t, lp)| piece(t, lp)).collect(),
            })
            .collect()
    }
}

impl Outcome {
    /// OpenAI's `usage`.
    pub fn usage(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// llama-server's `timings` (`prompt_n`: the prompt tokens prefilled, `cache_n`: those
    /// kept from the slot's last request); with `drafting`, Leap's target calls too.
    pub fn timings(&self, drafting: bool) -> serde_json::Value {
        let per_s = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let prefilled = self.prompt_tokens.saturating_sub(self.cached_tokens);
        let mut t = serde_json::json!({
            "cache_n": self.cached_tokens,
            "prompt_n": prefilled,
            "prompt_ms": self.prefill_seconds * 1e3,
            "prompt_per_second": per_s(prefilled, self.prefill_seconds),
            "predicted_n": self.completion_tokens,
            "predicted_ms": self.decode_seconds * 1e3,
            "predicted_per_second": per_s(self.completion_tokens, self.decode_seconds),
        });
        if drafting {
            t["target_calls"] = self.target_calls.into();
            t["accepted_per_call"] = if self.target_calls > 0 {
                self.completion_tokens as f64 / self.target_calls as f64
            } else {
                0.0
            }
            .into();
        }
        t
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

/// Whose cache and drafting history a request may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tenant {
    /// Everyone's (`--shared-cache`).
    Shared,
    /// The requests made with API key number `k`.
    Key(usize),
    /// Its own only (no API key, no `--shared-cache`).
    Alone,
}

impl Tenant {
    /// Whether a request of `self` may use what a request of `before` left.
    fn may_use(self, before: Option<Tenant>) -> bool {
        self != Tenant::Alone && before == Some(self)
    }
}

/// A request for a slot.
pub struct Job {
    pub prompt: Vec<Token>,
    /// `None`: to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: leap_host::sampler::SamplingParams,
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
    pub tenant: Tenant,
    /// Reuse the KV cache the slot kept (llama-server's `cache_prompt`); false prefills the
    /// whole prompt.
    pub cache_prompt: bool,
    /// Report each token's log-probability and this many most likely tokens with it.
    pub logprobs: Option<usize>,
    /// Structured output: the grammar the output follows (taken by the slot that runs it).
    pub grammar: Mutex<Option<leap_host::grammar::Grammar>>,
    /// The slot that must run it (llama-server's `id_slot`); `None`: the best idle one.
    pub slot: Option<usize>,
}

/// What a slot runs jobs with: a [`Session`] in the server ([`SlotWorker`]).
pub trait Worker {
    /// Run `job` to its end (its events sent), or until its client hangs up or `stop` is set.
    fn run(&mut self, job: &Job, stop: &Arc<AtomicBool>);
    /// Forget what earlier jobs left (the next one is another tenant's, or one panicked).
    fn forget(&mut self);
    /// The tokens whose KV cache it keeps.
    fn held(&self) -> Vec<Token>;
}

/// Makes slot `i`'s worker, on the slot's own thread.
pub type MakeWorker = dyn Fn(usize) -> anyhow::Result<Box<dyn Worker>> + Send + Sync;

/// The queue and what each slot holds, under one lock.
#[derive(Default)]
struct Sched {
    queue: VecDeque<Job>,
    /// Per slot: idle, the tokens its KV cache holds (its last prompt and output), and the
    /// tenant they belong to.
    idle: Vec<bool>,
    held: Vec<Vec<Token>>,
    owner: Vec<Option<Tenant>>,
    closed: bool,
}

impl Sched {
    /// The idle slot a job goes to: the one it names (`id_slot`), once idle; else the one
    /// whose cache, of the job's tenant, shares the longest prefix with its prompt (a
    /// conversation's next turn finds its earlier turns there), the lowest on ties.
    fn best_slot(&self, prompt: &[Token], tenant: Tenant, pinned: Option<usize>) -> Option<usize> {
        if let Some(s) = pinned {
            return self.idle.get(s).copied().unwrap_or(false).then_some(s);
        }
        (0..self.idle.len())
            .filter(|&i| self.idle[i])
            .max_by_key(|&i| {
                let shared = if tenant.may_use(self.owner.get(i).copied().flatten()) {
                    common_prefix(&self.held[i], prompt)
                } else {
                    0
                };
                (shared, std::cmp::Reverse(i))
            })
    }

    /// The first queued job `slot` should take, if any.
    fn take_for(&mut self, slot: usize) -> Option<Job> {
        let k = self
            .queue
            .iter()
            .position(|j| self.best_slot(&j.prompt, j.tenant, j.slot) == Some(slot))?;
        self.queue.remove(k)
    }
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The slots and their queue. Dropping it lets each slot finish its request, then joins them.
pub struct Pool {
    sched: Arc<(Mutex<Sched>, Condvar)>,
    /// Set by [`Pool::abort`]: every slot stops its job at once.
    stop: Arc<AtomicBool>,
    /// Jobs waiting for a slot, at most.
    max_queue: usize,
    threads: Vec<JoinHandle<()>>,
}

/// What `GET /slots` shows of a slot: not its prompt (another tenant's), only whether it
/// is busy and how much its cache holds.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotView {
    pub id: usize,
    pub processing: bool,
    pub cached_tokens: usize,
}

impl Pool {
    /// Each slot as `/slots` shows it.
    pub fn view(&self) -> Vec<SlotView> {
        let s = self.sched.0.lock().unwrap_or_else(|e| e.into_inner());
        (0..s.idle.len())
            .map(|i| SlotView {
                id: i,
                processing: !s.idle[i],
                cached_tokens: s.held.get(i).map_or(0, Vec::len),
            })
            .collect()
    }

    /// Start `n` slots decoding with `rt`, each creating its session on its own thread;
    /// at most `max_queue` requests wait. Returns when every slot is ready.
    ///
    /// # Errors
    /// A session that could not be created (memory for the context).
    pub fn start(
        rt: Arc<Runtime>,
        n: usize,
        max_queue: usize,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let m = Arc::clone(&metrics);
        let make: Arc<MakeWorker> = Arc::new(move |i| {
            let w: Box<dyn Worker> = Box::new(SlotWorker {
                session: rt.session()?,
                rt: Arc::clone(&rt),
                metrics: Arc::clone(&m),
                slot: i,
            });
            Ok(w)
        });
        Self::start_with(n, max_queue, metrics, make)
    }

    /// [`Pool::start`] with the workers `make` gives.
    ///
    /// # Errors
    /// A worker that could not be made.
    pub fn start_with(
        n: usize,
        max_queue: usize,
        metrics: Arc<Metrics>,
        make: Arc<MakeWorker>,
    ) -> anyhow::Result<Self> {
        let sched = Arc::new((
            Mutex::new(Sched {
                idle: vec![true; n],
                held: vec![Vec::new(); n],
                owner: vec![None; n],
                ..Default::default()
            }),
            Condvar::new(),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = mpsc::channel();
        for i in 0..n {
            let (sched, stop, metrics, ready, make) = (
                Arc::clone(&sched),
                Arc::clone(&stop),
                Arc::clone(&metrics),
                ready_tx.clone(),
                Arc::clone(&make),
            );
            let t = std::thread::Builder::new()
                .name(format!("leap-slot-{i}"))
                .spawn(move || {
                    let worker = match make(i) {
                        Ok(w) => {
                            let _ = ready.send(Ok(()));
                            w
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    drop(ready);
                    slot_loop(i, worker, &sched, &stop, &metrics);
                })?;
            threads.push(t);
        }
        drop(ready_tx);
        let pool = Self {
            sched,
            stop,
            max_queue,
            threads,
        };
        for r in ready_rx.iter().take(n) {
            r?;
        }
        Ok(pool)
    }

    /// Queue a job; the idle slot that holds most of its prompt takes it (or the next to
    /// become idle).
    ///
    /// # Errors
    /// A 503 with `Retry-After` when `max_queue` jobs wait already (more than the idle
    /// slots will take at once), or when the server is shutting down.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let (lock, cv) = &*self.sched;
        let mut s = lock
            .lock()
            .map_err(|_| ApiError::internal("the scheduler failed"))?;
        if s.closed {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let idle = s.idle.iter().filter(|&&i| i).count();
        if s.queue.len() >= self.max_queue + idle {
            return Err(ApiError::busy(
                format!(
                    "{} requests are waiting for a slot already (--max-queue); retry later",
                    s.queue.len()
                ),
                "queue_full",
                5,
            ));
        }
        s.queue.push_back(job);
        drop(s);
        cv.notify_all();
        Ok(())
    }

    /// Give up on the requests in flight: the queued ones are dropped (their clients are told
    /// the server is shutting down) and each slot stops its job at once.
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

/// Slot `i`: take jobs until the pool closes. A job of another tenant than the last finds the
/// worker's state forgotten; a job that panics is failed with a 500 and the slot goes on.
fn slot_loop(
    i: usize,
    mut worker: Box<dyn Worker>,
    sched: &(Mutex<Sched>, Condvar),
    stop: &Arc<AtomicBool>,
    metrics: &Metrics,
) {
    let (lock, cv) = sched;
    loop {
        let (job, before) = {
            let Ok(mut s) = lock.lock() else { return };
            loop {
                if let Some(j) = s.take_for(i) {
                    s.idle[i] = false;
                    break (j, s.owner[i]);
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
        // The other slots look again: a job that waited for this one may be theirs now.
        cv.notify_all();
        metrics.dequeued();
        if !job.tenant.may_use(before) && before.is_some() {
            worker.forget();
        }
        if job.events.is_closed() {
            metrics.cancelled();
        } else if catch_unwind(AssertUnwindSafe(|| worker.run(&job, stop))).is_err() {
            log::error!("slot {i}: panicked on a request (a bug); its state is forgotten");
            metrics.failed();
            let _ = job.events.send(Event::Error(ApiError::internal(
                "the server failed on this request (a bug: its log says more); retry",
            )));
            worker.forget();
        }
        let held = worker.held();
        let Ok(mut s) = lock.lock() else { return };
        s.idle[i] = true;
        s.held[i] = held;
        s.owner[i] = Some(job.tenant);
        drop(s);
        // Another slot may have left a job for this one.
        cv.notify_all();
    }
}

/// A slot's session, running the server's jobs.
pub struct SlotWorker {
    rt: Arc<Runtime>,
    session: Session,
    metrics: Arc<Metrics>,
    slot: usize,
}

impl Worker for SlotWorker {
    fn run(&mut self, job: &Job, stop: &Arc<AtomicBool>) {
        if !job.cache_prompt {
            self.session.forget_prefix();
        }
        // A hang-up or an abort stops the decode in flight, prefill included.
        let (events, stop) = (job.events.clone(), Arc::clone(stop));
        self.session.set_cancel(Some(Arc::new(move || {
            events.is_closed() || stop.load(Ordering::Relaxed)
        })));
        serve(&self.rt, &mut self.session, job, &self.metrics, self.slot);
        self.session.set_cancel(None);
    }

    fn forget(&mut self) {
        self.session.forget();
    }

    fn held(&self) -> Vec<Token> {
        self.session.held().to_vec()
    }
}

/// Counts a request as decoding until dropped (a panic included).
struct Busy<'a>(&'a Metrics);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.finished();
    }
}

/// Run one job on a slot's session, streaming its text as [`Event`]s, until it ends or its
/// client hangs up (or the pool is aborted: the session's cancel check).
fn serve(rt: &Runtime, session: &mut Session, job: &Job, metrics: &Metrics, slot: usize) {
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
    let busy = Busy(metrics);
    let t0 = Instant::now();
    let mut text = TextOut::new(job.stop.clone());
    let mut gone = false;
    let mut streamed = 0;
    let mut emitted = Vec::new();
    let mut on_token = |t: Token| {
        streamed += 1;
        emitted.push(t);
        let piece = model.token_to_piece(t, false).unwrap_or_default();
        let (out, stop_string) = text.push(&piece);
        if !out.is_empty() && job.events.send(Event::Text(out)).is_err() {
            gone = true;
            return false;
        }
        !stop_string
    };
    let grammar = job.grammar.lock().ok().and_then(|mut g| g.take());
    let r = match grammar {
        Some(mut g) => session.generate_constrained(&job.prompt, &req, &mut g, &mut on_token),
        None => session.generate(&job.prompt, &req, &mut on_token),
    };
    drop(busy);
    let g = match r {
        Ok(g) => g,
        Err(e) if e.is_cancelled() || job.events.is_closed() => {
            log::info!(
                "slot {slot}: the client hung up (or the server stopped it) after {streamed} tokens; slot freed"
            );
            metrics.cancelled();
            return;
        }
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
    let logprobs = match job.logprobs {
        None => None,
        Some(top) => match session.score(&job.prompt, &emitted, top) {
            Ok(lps) => Some(Logprob::all(model, lps)),
            Err(e) => {
                log::warn!("slot {slot}: log-probabilities failed: {e}");
                metrics.failed();
                let _ = job.events.send(Event::Error(e.into()));
                return;
            }
        },
    };
    let eog = g.tokens.last().is_some_and(|&t| model.is_eog(t));
    let finish = if eog || text.stopped {
        Finish::Stop
    } else {
        Finish::Length
    };
    let o = Outcome {
        finish,
        prompt_tokens: job.prompt.len(),
        cached_tokens: session.cached_tokens(),
        completion_tokens: g.tokens.len(),
        prefill_seconds: g.prefill_seconds,
        decode_seconds: g.decode_seconds,
        target_calls: g.target_calls,
        logprobs,
        tokens: emitted,
        word: text.stopped,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_goes_to_the_idle_slot_holding_most_of_its_prompt() {
        let k = Some(Tenant::Key(0));
        let s = Sched {
            idle: vec![true, false, true, true],
            held: vec![vec![1, 2], vec![1, 2, 3, 4, 5], vec![1, 2, 3, 9], vec![]],
            owner: vec![k, k, k, None],
            ..Default::default()
        };
        let key = Tenant::Key(0);
        assert_eq!(
            s.best_slot(&[1, 2, 3, 4, 5, 6], key, None),
            Some(2),
            "slot 1 is busy"
        );
        assert_eq!(s.best_slot(&[7], key, None), Some(0), "the lowest on ties");
        // A job that names a slot waits for it, whatever the others hold.
        assert_eq!(s.best_slot(&[1, 2, 3, 4, 5, 6], key, Some(3)), Some(3));
        assert_eq!(s.best_slot(&[1, 2, 3, 4, 5, 6], key, Some(1)), None);
        // Another tenant's cache counts for nothing, nor anyone's for a lone request.
        assert_eq!(
            s.best_slot(&[1, 2, 3, 4, 5, 6], Tenant::Key(1), None),
            Some(0)
        );
        assert_eq!(
            s.best_slot(&[1, 2, 3, 4, 5, 6], Tenant::Alone, None),
            Some(0)
        );
        let none = Sched {
            idle: vec![false],
            held: vec![vec![]],
            owner: vec![None],
            ..Default::default()
        };
        assert_eq!(none.best_slot(&[1], key, None), None);
    }

    /// A worker that answers each job with its prompt's length as text, panics on a prompt
    /// of `[666]`, waits on `[777]` until its client hangs up, and logs what it was asked.
    struct Fake {
        log: Arc<Mutex<Vec<String>>>,
        held: Vec<Token>,
    }

    impl Worker for Fake {
        fn run(&mut self, job: &Job, _stop: &Arc<AtomicBool>) {
            self.log
                .lock()
                .unwrap()
                .push(format!("run {:?}", job.prompt));
            match job.prompt.as_slice() {
                [666] => panic!("a bug"),
                [777] => {
                    while !job.events.is_closed() {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                    }
                }
                _ => {}
            }
            self.held = job.prompt.clone();
            let _ = job.events.send(Event::Text(job.prompt.len().to_string()));
            let _ = job.events.send(Event::Done(Outcome {
                finish: Finish::Stop,
                prompt_tokens: job.prompt.len(),
                cached_tokens: 0,
                completion_tokens: 0,
                prefill_seconds: 0.0,
                decode_seconds: 0.0,
                target_calls: 0,
                logprobs: None,
                tokens: Vec::new(),
                word: false,
            }));
        }

        fn forget(&mut self) {
            self.log.lock().unwrap().push("forget".into());
            self.held.clear();
        }

        fn held(&self) -> Vec<Token> {
            self.held.clone()
        }
    }

    fn fake_pool(max_queue: usize) -> (Pool, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = Arc::clone(&log);
        let make: Arc<MakeWorker> = Arc::new(move |_| {
            Ok(Box::new(Fake {
                log: Arc::clone(&l),
                held: Vec::new(),
            }) as Box<dyn Worker>)
        });
        let pool = Pool::start_with(1, max_queue, Arc::new(Metrics::default()), make).unwrap();
        (pool, log)
    }

    fn job(
        prompt: Vec<Token>,
        tenant: Tenant,
    ) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let j = Job {
            prompt,
            max_tokens: Some(1),
            sampling: Default::default(),
            stop: Vec::new(),
            events: tx,
            tenant,
            cache_prompt: true,
            logprobs: None,
            grammar: Mutex::new(None),
            slot: None,
        };
        (j, rx)
    }

    /// The events of a job, to its last.
    fn wait(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(e) = rx.blocking_recv() {
            let last = !matches!(e, Event::Text(_));
            out.push(e);
            if last {
                break;
            }
        }
        out
    }

    #[test]
    fn a_panicking_job_gets_a_500_and_the_slot_goes_on() {
        let (pool, log) = fake_pool(4);
        let (j, rx) = job(vec![666], Tenant::Shared);
        pool.submit(j).unwrap();
        match wait(rx).as_slice() {
            [Event::Error(e)] => assert_eq!(e.status, 500),
            other => panic!("{other:?}"),
        }
        let (j, rx) = job(vec![1, 2, 3], Tenant::Shared);
        pool.submit(j).unwrap();
        assert!(matches!(wait(rx).as_slice(), [Event::Text(t), Event::Done(_)] if t == "3"));
        let log = log.lock().unwrap().clone();
        assert_eq!(log, ["run [666]", "forget", "run [1, 2, 3]"]);
    }

    #[test]
    fn a_slot_forgets_between_tenants_only() {
        let (pool, log) = fake_pool(4);
        for (p, t) in [
            (1, Tenant::Key(0)),
            (2, Tenant::Key(0)),
            (3, Tenant::Key(1)),
            (4, Tenant::Shared),
            (5, Tenant::Shared),
            (6, Tenant::Alone),
            (7, Tenant::Alone),
        ] {
            let (j, rx) = job(vec![p], t);
            pool.submit(j).unwrap();
            wait(rx);
        }
        let log = log.lock().unwrap().join(", ");
        assert_eq!(
            log,
            "run [1], run [2], forget, run [3], forget, run [4], run [5], forget, run [6], \
             forget, run [7]"
        );
    }

    #[test]
    fn the_queue_is_bounded() {
        let (pool, _log) = fake_pool(1);
        // The slot takes one that waits for its client; one more waits in the queue.
        let (busy, busy_rx) = job(vec![777], Tenant::Shared);
        pool.submit(busy).unwrap();
        // Until the slot took it, it counts as queued: wait for the queue to empty.
        for _ in 0..400 {
            if pool.sched.0.lock().unwrap().queue.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (queued, queued_rx) = job(vec![1], Tenant::Shared);
        pool.submit(queued).unwrap();
        let (over, _rx) = job(vec![2], Tenant::Shared);
        let e = pool.submit(over).unwrap_err();
        assert_eq!(e.status, 503);
        assert_eq!(e.code, Some("queue_full"));
        assert!(e.retry_after.is_some());
        // The client of the first hangs up: the queued one runs.
        drop(busy_rx);
        assert!(matches!(
            wait(queued_rx).as_slice(),
            [Event::Text(_), Event::Done(_)]
        ));
    }
}
