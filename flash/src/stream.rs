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
    /// Seconds of the call (from its first layer to its output; for a call cut before its
    /// output, to the next call).
    pub seconds: f64,
    /// Most bytes of streamed blocks resident at a layer boundary (`mincore`).
    pub peak_streamed_resident: u64,
}

#[derive(Default)]
struct State {
    /// Sections the loader finished (cleared when evicted).
    loaded: HashSet<Section>,
    /// Sections asked for and not evicted since.
    requested: HashSet<Section>,
    call: Option<(Instant, Option<u64>)>,
    current: CallStats,
    calls: Vec<CallStats>,
}

struct Shared {
    map: LayerMap,
    plan: Plan,
    pages: Pages,
    path: std::path::PathBuf,
    /// Where other mappings of the file (llama.cpp's, Leap's on-demand projection's) have
    /// its offset 0, from /proc/self/maps (looked up at the first eviction: the contexts and
    /// projections of a run exist by then).
    bases: Mutex<Option<Vec<usize>>>,
    state: Mutex<State>,
    done: Condvar,
    ahead: usize,
    load: Mutex<mpsc::Sender<Section>>,
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
        let (tx, rx) = mpsc::channel::<Section>();
        let shared = Arc::new(Shared {
            map,
            plan,
            pages,
            path: path.to_owned(),
            bases: Mutex::new(None),
            state: Mutex::new(State::default()),
            done: Condvar::new(),
            ahead: ahead.max(1),
            load: Mutex::new(tx),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("leap-flash-loader".into())
            .spawn(move || {
                while let Ok(s) = rx.recv() {
                    let Some(sh) = weak.upgrade() else { break };
                    for r in sh.map.ranges(s) {
                        if let Err(e) = sh.pages.load(r.clone()) {
                            log::error!("flash: reading {s:?}: {e}");
                        }
                    }
                    let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                    st.loaded.insert(s);
                    sh.done.notify_all();
                }
            })
            .expect("spawning the flash loader");
        // The first streamed block before the first call.
        let s = Self { shared };
        s.shared.request(Section::Block(0));
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

    /// Close the last call's statistics (a call cut before its output projection, as Leap's
    /// on-demand projection does, is otherwise closed when the next one starts: its storage
    /// reads include the projection's).
    pub fn flush(&self) {
        finish(&mut self.shared.state.lock().unwrap_or_else(|e| e.into_inner()));
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

    /// The output projection's section when it is streamed.
    fn streamed_output(&self) -> Option<Section> {
        self.plan
            .streamed
            .iter()
            .copied()
            .find(|s| matches!(s, Section::Output | Section::Embed))
    }

    /// Ask the loader for `s` if it is streamed and not asked for yet.
    fn request(&self, s: Section) {
        if !self.plan.streamed.contains(&s) {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.requested.insert(s) {
            let _ = self.load.lock().unwrap_or_else(|e| e.into_inner()).send(s);
        }
    }

    /// Wait until `s` (if streamed) is read; the seconds waited.
    fn wait(&self, s: Section) -> f64 {
        if !self.plan.streamed.contains(&s) {
            return 0.0;
        }
        self.request(s);
        let t = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !st.loaded.contains(&s) {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        t.elapsed().as_secs_f64()
    }

    /// The other mappings of the model file (see `bases`).
    fn bases(&self) -> Vec<usize> {
        let mut cached = self.bases.lock().unwrap_or_else(|e| e.into_inner());
        if cached.is_none() {
            let mut bases = Vec::new();
            let ours = self.pages.address();
            let want = std::fs::canonicalize(&self.path).unwrap_or_else(|_| self.path.clone());
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
            for l in maps.lines() {
                let found = (|| {
                    let mut f = l.split_whitespace();
                    let range = f.next()?;
                    let (_perms, off, _dev, _inode) = (f.next()?, f.next()?, f.next()?, f.next()?);
                    let file = f.next()?;
                    let start = usize::from_str_radix(range.split('-').next()?, 16).ok()?;
                    // llama.cpp unmaps the parts no tensor uses, so one mapping may be several
                    // areas: each starts `offset` bytes into the mapping of the whole file.
                    let base = start.checked_sub(usize::from_str_radix(off, 16).ok()?)?;
                    (base != ours && Path::new(file) == want).then_some(base)
                })();
                if let Some(b) = found {
                    if !bases.contains(&b) {
                        bases.push(b);
                    }
                }
            }
            *cached = Some(bases);
        }
        cached.clone().unwrap_or_default()
    }

    /// Drop section `s` from DRAM: llama.cpp's mapping, ours, the page cache.
    fn evict(&self, s: Section) {
        let bases = self.bases();
        for r in self.map.ranges(s) {
            for &b in &bases {
                self.pages.evict_at(b, r.clone());
            }
            let _ = self.pages.evict(r.clone());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.loaded.remove(&s);
        st.requested.remove(&s);
    }

    fn streamed_resident(&self) -> u64 {
        self.plan
            .streamed
            .iter()
            .filter(|s| matches!(s, Section::Block(_)))
            .flat_map(|&s| self.map.ranges(s))
            .map(|r| self.pages.resident(r.clone()).unwrap_or(0))
            .sum()
    }
}

/// Close the call in progress, if any.
fn finish(st: &mut State) {
    if let Some((t0, r0)) = st.call.take() {
        st.current.seconds = t0.elapsed().as_secs_f64();
        st.current.read_bytes = match (r0, io_read_bytes()) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => 0,
        };
        let c = st.current;
        st.calls.push(c);
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
                    // A call cut before its output (Leap's on-demand projection) ends here.
                    finish(&mut st);
                    st.call = Some((Instant::now(), io_read_bytes()));
                    st.current = CallStats::default();
                    st.calls.is_empty()
                };
                // The output projection, if Leap's own projection read it after the last call.
                if let Some(out) = sh.streamed_output() {
                    sh.evict(out);
                }
                if first {
                    // Loading the model may have read everything: start from the plan.
                    for s in sh.plan.streamed.clone() {
                        let asked = sh
                            .state
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .requested
                            .contains(&s);
                        if !asked {
                            sh.evict(s);
                        }
                    }
                }
            }
            let blocked = sh.wait(Section::Block(i));
            for b in i + 1..=i + sh.ahead {
                sh.request(Section::Block(b));
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
            // The output projection (a single node) next: it is read as it runs (reading it
            // ahead with the loader left the storage reads uncounted in /proc/self/io: not
            // understood yet). With Leap's on-demand projection the graph stops here.
        } else if name == "result_output" {
            if let Some(out) = sh.streamed_output() {
                sh.evict(out);
            }
            finish(&mut sh.state.lock().unwrap_or_else(|e| e.into_inner()));
            // The next call's first streamed block, between calls.
            if let Some(b) = (0..sh.map.blocks()).find(|&b| sh.streamed(b)) {
                sh.request(Section::Block(b));
            }
        }
        true
    }
}
