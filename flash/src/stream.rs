//! The in-call driver: llama.cpp's eval callback at layer boundaries reads the next streamed
//! blocks ahead (a loader thread touches their pages while the current block computes),
//! waits for a block before its matrices run (the time blocked on I/O), and evicts a
//! streamed block once the next one starts, through llama.cpp's own mapping of the file and
//! the page cache. Pinned sections are read once and locked.
//!
//! The output projection is one ggml node: when it is streamed it is resident whole while
//! that node runs and is evicted right after it (`result_output`); streaming it in chunks
//! needs Leap's own projection (not done yet).

use std::collections::HashSet;
use std::ops::Range;
use std::path::Path;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use leap_host::{EvalObserver, TensorView};

use crate::{io_read_bytes, LayerMap, Pages, Plan, Result, Section};

/// What one target call read and waited for.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CallStats {
    /// Bytes the process read from storage during the call (`/proc/self/io`).
    pub read_bytes: u64,
    /// Seconds the call waited for a streamed block to be read.
    pub blocked_seconds: f64,
    /// Seconds of the whole call (from its first layer to its output).
    pub seconds: f64,
    /// Most bytes of streamed blocks resident at a layer boundary (`mincore`).
    pub peak_streamed_resident: u64,
}

#[derive(Default)]
struct State {
    /// Blocks the loader finished (cleared when evicted).
    loaded: HashSet<usize>,
    /// Blocks asked for and not evicted since.
    requested: HashSet<usize>,
    call: Option<(Instant, Option<u64>)>,
    current: CallStats,
    calls: Vec<CallStats>,
}

struct Shared {
    map: LayerMap,
    plan: Plan,
    pages: Pages,
    path: std::path::PathBuf,
    /// Where llama.cpp mapped the file's offset 0 (from /proc/self/maps on first use).
    llama_base: Mutex<Option<usize>>,
    state: Mutex<State>,
    done: Condvar,
    ahead: usize,
    load: Mutex<mpsc::Sender<usize>>,
}

/// Streams a model's blocks during llama.cpp's decodes: give [`Streamer::observer`] to the
/// context, keep the `Streamer` for the statistics.
pub struct Streamer {
    shared: Arc<Shared>,
}

impl Streamer {
    /// A streamer for the model at `path` with `plan`, reading `ahead` blocks ahead. Pinned
    /// sections are read now and locked in memory where the system allows.
    ///
    /// # Errors
    /// The file cannot be mapped.
    pub fn new(path: &Path, map: LayerMap, plan: Plan, ahead: usize) -> Result<Self> {
        let pages = Pages::open(path)?;
        for s in &plan.pinned {
            for r in map.ranges(*s) {
                pages.load(r.clone())?;
                if !pages.lock(r.clone()) {
                    log::debug!("flash: could not lock {s:?} (RLIMIT_MEMLOCK); kept, not locked");
                }
            }
        }
        let (tx, rx) = mpsc::channel::<usize>();
        let shared = Arc::new(Shared {
            map,
            plan,
            pages,
            path: path.to_owned(),
            llama_base: Mutex::new(None),
            state: Mutex::new(State::default()),
            done: Condvar::new(),
            ahead: ahead.max(1),
            load: Mutex::new(tx),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("leap-flash-loader".into())
            .spawn(move || {
                while let Ok(b) = rx.recv() {
                    let Some(sh) = weak.upgrade() else { break };
                    for r in sh.map.ranges(Section::Block(b)) {
                        if let Err(e) = sh.pages.load(r.clone()) {
                            log::error!("flash: reading block {b}: {e}");
                        }
                    }
                    let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                    st.loaded.insert(b);
                    sh.done.notify_all();
                }
            })
            .expect("spawning the flash loader");
        // The first streamed block before the first call.
        let s = Self { shared };
        s.shared.request(0);
        Ok(s)
    }

    /// The eval-callback half, for [`leap_host::Context::with_observer`].
    pub fn observer(&self) -> Box<dyn EvalObserver> {
        Box::new(Observer(self.shared.clone()))
    }

    /// The plan in use.
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// Statistics of every call so far.
    pub fn calls(&self) -> Vec<CallStats> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .calls
            .clone()
    }

    /// Bytes of `s` resident now.
    ///
    /// # Errors
    /// The file changed under the mapping.
    pub fn resident(&self, s: Section) -> Result<u64> {
        self.shared
            .map
            .ranges(s)
            .iter()
            .map(|r| self.shared.pages.resident(r.clone()))
            .sum()
    }
}

impl Shared {
    fn streamed(&self, b: usize) -> bool {
        self.plan.streamed.contains(&Section::Block(b))
    }

    /// Ask the loader for block `b` if it is streamed and not asked for yet.
    fn request(&self, b: usize) {
        if b >= self.map.blocks() || !self.streamed(b) {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.requested.insert(b) {
            let _ = self.load.lock().unwrap_or_else(|e| e.into_inner()).send(b);
        }
    }

    /// Wait until block `b` (if streamed) is read; the seconds waited.
    fn wait(&self, b: usize) -> f64 {
        if !self.streamed(b) {
            return 0.0;
        }
        self.request(b);
        let t = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !st.loaded.contains(&b) {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        t.elapsed().as_secs_f64()
    }

    /// Where llama.cpp mapped the model file (offset 0), from /proc/self/maps.
    fn llama_base(&self) -> Option<usize> {
        let mut base = self.llama_base.lock().unwrap_or_else(|e| e.into_inner());
        if base.is_none() {
            let ours = self.pages.address();
            let want = std::fs::canonicalize(&self.path).ok()?;
            let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
            *base = maps.lines().find_map(|l| {
                let mut f = l.split_whitespace();
                let range = f.next()?;
                let (_perms, off, _dev, _inode) = (f.next()?, f.next()?, f.next()?, f.next()?);
                let file = f.next()?;
                let start = usize::from_str_radix(range.split('-').next()?, 16).ok()?;
                // llama.cpp unmaps the parts no tensor uses, so its mapping may be several
                // areas: each starts `offset` bytes into the one mapping of the whole file.
                let base = start.checked_sub(usize::from_str_radix(off, 16).ok()?)?;
                (base != ours && std::path::Path::new(file) == want).then_some(base)
            });
        }
        *base
    }

    /// Drop section `s` from DRAM: llama.cpp's mapping, ours, the page cache.
    fn evict(&self, s: Section) {
        let base = self.llama_base();
        for r in self.map.ranges(s) {
            if let Some(b) = base {
                self.pages.evict_at(b, r.clone());
            }
            let _ = self.pages.evict(r.clone());
        }
        if let Section::Block(b) = s {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.loaded.remove(&b);
            st.requested.remove(&b);
        }
    }

    fn streamed_resident(&self) -> u64 {
        self.plan
            .streamed
            .iter()
            .filter(|s| matches!(s, Section::Block(_)))
            .flat_map(|&s| {
                self.map
                    .ranges(s)
                    .iter()
                    .cloned()
                    .collect::<Vec<Range<u64>>>()
            })
            .map(|r| self.pages.resident(r).unwrap_or(0))
            .sum()
    }
}

struct Observer(Arc<Shared>);

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("attn_norm-")?.parse().ok()
}

impl EvalObserver for Observer {
    fn wants(&mut self, t: &TensorView<'_>) -> bool {
        let n = t.name();
        layer_of(n).is_some() || n == "result_norm" || n == "result_output"
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        let sh = &self.0;
        let name = t.name();
        if let Some(i) = layer_of(name) {
            if i == 0 {
                let first = {
                    let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                    st.call = Some((Instant::now(), io_read_bytes()));
                    st.current = CallStats::default();
                    st.calls.is_empty()
                };
                if first {
                    // Loading the model may have read everything: start from the plan.
                    for s in sh.plan.streamed.clone() {
                        let asked = matches!(s, Section::Block(b) if sh.state.lock().unwrap_or_else(|e| e.into_inner()).requested.contains(&b));
                        if !asked {
                            sh.evict(s);
                        }
                    }
                }
            }
            let blocked = sh.wait(i);
            for b in i + 1..=i + sh.ahead {
                sh.request(b);
            }
            if i > 0 && sh.streamed(i - 1) {
                sh.evict(Section::Block(i - 1));
            }
            let resident = sh.streamed_resident();
            let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
            st.current.blocked_seconds += blocked;
            st.current.peak_streamed_resident = st.current.peak_streamed_resident.max(resident);
        } else if name == "result_norm" {
            let last = sh.map.blocks().saturating_sub(1);
            if sh.streamed(last) {
                sh.evict(Section::Block(last));
            }
            // The output projection (a single node) next: it is read as it runs.
        } else if name == "result_output" {
            for s in sh.plan.streamed.clone() {
                if matches!(s, Section::Output | Section::Embed) {
                    sh.evict(s);
                }
            }
            let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((t0, r0)) = st.call.take() {
                st.current.seconds = t0.elapsed().as_secs_f64();
                st.current.read_bytes = match (r0, io_read_bytes()) {
                    (Some(a), Some(b)) => b.saturating_sub(a),
                    _ => 0,
                };
                let c = st.current;
                st.calls.push(c);
            }
            drop(st);
            // The next call's first streamed block, between calls.
            if let Some(b) = (0..sh.map.blocks()).find(|&b| sh.streamed(b)) {
                sh.request(b);
            }
        }
        true
    }
}
