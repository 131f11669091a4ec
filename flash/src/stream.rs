//! The in-call driver: llama.cpp's eval callback at layer boundaries reads the next streamed
//! blocks ahead (a loader thread touches their pages while the current block computes),
//! waits for a block before its matrices run (the time blocked on I/O), and evicts a
//! streamed block once the next one starts, through llama.cpp's own mapping of the file and
//! the page cache. Pinned sections are read once and locked.
//!
//! A streamed output projection is read in chunks when Leap's own projection computes it
//! ([`Streamer::row_stream`], [`Streamer::stream_projection`]): the first chunk during the
//! call's last layers, the next while one computes (with `O_DIRECT` into a pool of aligned
//! buffers where the file system allows, else through the page cache), and a chunk leaves
//! memory once done. When llama.cpp computes it instead (one ggml node, `result_output`), it
//! is resident whole while that node runs and is evicted right after it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use leap_host::fileio::{self, DIRECT_ALIGN};
use leap_host::project::RowStream;
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
    /// Most bytes of streamed sections resident at a layer or output-chunk boundary, by
    /// `mincore` (sampled: one boundary in [`SAMPLE`], rotating over the boundaries of
    /// successive calls, since a look at every boundary would cost more than the call).
    pub peak_streamed_resident: u64,
    /// llama.cpp's own output projection ran in this call (a single node, so the streamed
    /// output weights were resident whole while it ran).
    pub llama_output: bool,
}

/// One layer or chunk boundary in this many measures the resident streamed bytes.
pub const SAMPLE: u64 = 23;

/// What the loader reads: a section, or a chunk of the streamed output projection (Leap's
/// own projection works through it a chunk at a time, see [`Streamer::row_stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Sec(Section),
    Out(usize),
}

/// The streamed output projection's chunks: file bytes `start..end`, `chunk` bytes each.
#[derive(Debug, Clone, Copy)]
struct Chunks {
    start: u64,
    end: u64,
    chunk: u64,
}

impl Chunks {
    fn len(&self) -> usize {
        (self.end - self.start).div_ceil(self.chunk) as usize
    }

    fn range(&self, j: usize) -> std::ops::Range<u64> {
        let a = self.start + j as u64 * self.chunk;
        a..(a + self.chunk).min(self.end)
    }
}

/// Output chunks read with `O_DIRECT` (no page cache: no copy, no eviction, no faults) into
/// a bounded pool of aligned buffers, one per chunk in flight, which Leap's projection
/// computes from directly.
struct Direct {
    file: std::fs::File,
    /// Aligned buffers (addresses), `cap` bytes each; chunk `j` uses `bufs[j % bufs.len()]`.
    bufs: Vec<usize>,
    cap: usize,
    /// The allocations behind `bufs` (never resized while shared).
    _mem: Vec<Vec<u8>>,
}

impl Direct {
    fn new(path: &Path, chunk: u64, slots: usize) -> Option<Self> {
        let file = fileio::open_direct(path)
            .map_err(|e| log::debug!("flash: no O_DIRECT for {}: {e}", path.display()))
            .ok()?;
        // Whole pages: an aligned read of the chunk needs at most two pages more.
        let cap = ((chunk + 2 * DIRECT_ALIGN).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN) as usize;
        let mut mem = Vec::new();
        let mut bufs = Vec::new();
        for _ in 0..slots {
            let v = vec![0u8; cap + DIRECT_ALIGN as usize];
            let p = v.as_ptr() as usize;
            bufs.push(p.div_ceil(DIRECT_ALIGN as usize) * DIRECT_ALIGN as usize);
            mem.push(v);
        }
        Some(Self {
            file,
            bufs,
            cap,
            _mem: mem,
        })
    }

    /// Read chunk `j` (file bytes `r`) into its buffer.
    fn read(&self, j: usize, r: &std::ops::Range<u64>) -> std::io::Result<()> {
        let (off, len) = fileio::aligned_span(r);
        assert!(len <= self.cap, "chunk larger than the pool's buffers");
        let base = self.bufs[j % self.bufs.len()];
        // SAFETY: the buffer has `cap >= len` bytes from `base`; chunk `j`'s slot is not
        // read by the projection while the loader fills it (the chunk using it before was
        // released with `after`, which comes before this chunk is requested).
        let buf = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) };
        fileio::read_full_at(&self.file, buf, off, r.end)
    }

    /// Where chunk `j`'s first byte (file offset `r.start`) is in its buffer.
    fn at(&self, j: usize, r: &std::ops::Range<u64>) -> *const u8 {
        let (off, _) = fileio::aligned_span(r);
        (self.bufs[j % self.bufs.len()] + (r.start - off) as usize) as *const u8
    }

    /// Bytes of the pool resident now (`mincore`): it is given back after each pass.
    fn resident(&self) -> u64 {
        let page = DIRECT_ALIGN as usize;
        let mut n = 0u64;
        for &b in &self.bufs {
            let mut v = vec![0u8; self.cap / page];
            // SAFETY: `b..b + cap` (whole pages) lies inside the buffer's allocation of
            // `cap + DIRECT_ALIGN` bytes, `b` being its first aligned address.
            if unsafe { libc::mincore(b as *mut libc::c_void, self.cap, v.as_mut_ptr()) } == 0 {
                n += v.iter().filter(|&&x| x & 1 != 0).count() as u64 * page as u64;
            }
        }
        n
    }

    /// Give the pool's memory back until the next pass (the next read refaults zero pages).
    fn release(&self) {
        for &b in &self.bufs {
            // SAFETY: whole pages inside the buffer's allocation (see `resident`); DONTNEED on private
            // anonymous memory makes them read as zeros, and the next read overwrites them.
            unsafe { libc::madvise(b as *mut libc::c_void, self.cap, libc::MADV_DONTNEED) };
        }
    }
}

#[derive(Default)]
struct State {
    /// What the loader finished (cleared when evicted).
    loaded: HashSet<Key>,
    /// What was asked for and not evicted since.
    requested: HashSet<Key>,
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
    bases: Mutex<Option<Vec<crate::pages::Mapping>>>,
    state: Mutex<State>,
    done: Condvar,
    ahead: usize,
    load: Mutex<mpsc::Sender<Key>>,
    /// Set once Leap's projection streams the output in chunks ([`Streamer::row_stream`]).
    chunks: Mutex<Option<Chunks>>,
    /// Boundaries seen (for [`SAMPLE`]).
    ticks: std::sync::atomic::AtomicU64,
    /// Measure at one boundary in this many ([`SAMPLE`] unless set).
    sample: std::sync::atomic::AtomicU64,
    /// Why streaming cannot go on (the file was truncated or deleted, a read failed).
    error: Mutex<Option<String>>,
    /// Output chunks read with O_DIRECT (set with the chunks, where the file system allows).
    direct: Mutex<Option<Arc<Direct>>>,
    /// Whether to try O_DIRECT for the output chunks (`LEAP_FLASH_DIRECT=0` says no).
    allow_direct: std::sync::atomic::AtomicBool,
    /// Whether a projection pass follows the next calls: its first chunk is then read during
    /// their last layers (see `RowStream::prefetch`).
    prefetch_output: std::sync::atomic::AtomicBool,
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
        let (tx, rx) = mpsc::channel::<Key>();
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
            chunks: Mutex::new(None),
            ticks: Default::default(),
            sample: SAMPLE.into(),
            error: Mutex::new(None),
            direct: Mutex::new(None),
            allow_direct: std::env::var("LEAP_FLASH_DIRECT")
                .map_or(true, |v| v != "0")
                .into(),
            prefetch_output: true.into(),
        });
        shared.pin()?;
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("leap-flash-loader".into())
            .spawn(move || {
                while let Ok(s) = rx.recv() {
                    let Some(sh) = weak.upgrade() else { break };
                    if let (Key::Out(j), Some(d)) = (s, sh.direct()) {
                        for r in sh.ranges(s) {
                            if let Err(e) = d.read(j, &r) {
                                sh.fail(format!(
                                    "streaming the model's weights: {}: {e}",
                                    sh.path.display()
                                ));
                            }
                        }
                        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                        st.loaded.insert(s);
                        sh.done.notify_all();
                        continue;
                    }
                    for r in sh.ranges(s) {
                        // Mapping the pages into llama.cpp's mapping ahead of the compute
                        // (MADV_POPULATE_READ) was tried: slower (186 vs 166 ms a call).
                        if let Err(e) = sh.pages.load(r) {
                            sh.fail(format!("streaming the model's weights: {e}"));
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
        s.shared.request(Key::Sec(Section::Block(0)));
        Ok(s)
    }

    /// Let the pinned weights go (unlocked, left to the page cache): for several streamers of
    /// one model in a process whose runs take turns (`leap bench`'s modes), where another's
    /// plan runs next. Pinned pages of a suspended streamer are not this run's to keep.
    pub fn suspend(&self) {
        for r in self.shared.pinned_ranges() {
            self.shared.pages.unlock(r);
        }
    }

    /// Start a run from this plan's state: its pinned weights read and locked again, every
    /// streamed section (another plan may have kept some resident) dropped from memory.
    ///
    /// # Errors
    /// The file cannot be read.
    pub fn resume(&self) -> Result<()> {
        let sh = &self.shared;
        sh.pin()?;
        for s in sh.plan.streamed.clone() {
            sh.evict_section(s);
        }
        Ok(())
    }

    /// The hook that lets Leap's own output projection (`leap_host::project::OnDemand`, rows of
    /// `row_bytes`) stream the output weights a window's worth at a time: the next chunk is
    /// read while one computes, and a chunk leaves memory once done. `None` when the plan
    /// keeps the output projection resident.
    pub fn row_stream(&self, row_bytes: usize) -> Option<Arc<dyn RowStream>> {
        let sh = &self.shared;
        let out = sh.streamed_output()?;
        let r = sh.map.ranges(out);
        let (start, end) = (r.first()?.start, r.last()?.end);
        // One unit of the window per chunk (the other holds the chunk read ahead), in whole
        // 512-row steps so that most chunk ends fall on page boundaries.
        let unit = (sh.plan.window / (1 + sh.ahead as u64)).max(1);
        let step = 512 * row_bytes as u64;
        let rows = (unit / step).max(1) * 512;
        *sh.chunks.lock().unwrap_or_else(|e| e.into_inner()) = Some(Chunks {
            start,
            end,
            chunk: rows * row_bytes as u64,
        });
        *sh.direct.lock().unwrap_or_else(|e| e.into_inner()) = sh
            .allow_direct
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| Direct::new(&sh.path, rows * row_bytes as u64, 1 + sh.ahead))
            .flatten()
            .map(Arc::new);
        Some(Arc::new(OutputRows {
            shared: sh.clone(),
            rows: rows as usize,
        }))
    }

    /// `od` (Leap's projection of a context this streamer observes) reading the streamed
    /// output weights through [`Streamer::row_stream`]; unchanged when they are resident.
    pub fn stream_projection(
        &self,
        od: leap_host::project::OnDemand,
    ) -> leap_host::project::OnDemand {
        let rows = self.row_stream(od.row_bytes());
        od.with_stream(rows)
    }

    /// Read the output projection's chunks with `O_DIRECT` into a pool of Leap's (the
    /// default where the file system allows; `LEAP_FLASH_DIRECT=0` turns it off), or
    /// through the page cache. Takes effect at [`Streamer::row_stream`].
    pub fn direct(self, on: bool) -> Self {
        self.shared
            .allow_direct
            .store(on, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Whether the output chunks are read with `O_DIRECT` (after [`Streamer::row_stream`]).
    pub fn reads_direct(&self) -> bool {
        self.shared.direct().is_some()
    }

    /// Measure the resident streamed bytes at one boundary in `every` (1: at every boundary,
    /// for tests; costs a `mincore` over the streamed sections each time).
    pub fn measure_every(self, every: u64) -> Self {
        self.shared
            .sample
            .store(every.max(1), std::sync::atomic::Ordering::Relaxed);
        self
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
    /// The ranges the plan pins: its pinned sections and the pinned prefix of a streamed
    /// output projection (Strategy::Fill).
    fn pinned_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let mut v: Vec<_> = self
            .plan
            .pinned
            .iter()
            .flat_map(|&s| self.map.ranges(s).iter().cloned())
            .collect();
        if self.plan.output_pinned > 0 {
            let end = self.pinned_end();
            v.push(end - self.plan.output_pinned..end);
        }
        v
    }

    /// Read the pinned ranges and lock them in memory where the system allows.
    fn pin(&self) -> Result<()> {
        for r in self.pinned_ranges() {
            self.pages.load(r.clone())?;
            if !self.pages.lock(r.clone()) {
                log::debug!("flash: could not lock {r:?} (RLIMIT_MEMLOCK); kept, not locked");
            }
        }
        Ok(())
    }

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

    fn direct(&self) -> Option<Arc<Direct>> {
        self.direct
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Record why streaming cannot go on (the first reason is kept).
    fn fail(&self, why: String) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            log::error!("flash: {why}");
            *e = Some(why);
        }
    }

    /// Whether streaming can go on: no failure so far and the file is still the one mapped.
    fn healthy(&self) -> std::result::Result<(), String> {
        if let Err(e) = self.pages.check() {
            self.fail(format!("streaming the model's weights: {e}"));
        }
        match &*self.error.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The file ranges of `k`.
    fn ranges(&self, k: Key) -> Vec<std::ops::Range<u64>> {
        match k {
            Key::Sec(s) => self.map.ranges(s).to_vec(),
            Key::Out(j) => self.chunks().map(|c| vec![c.range(j)]).unwrap_or_default(),
        }
    }

    fn chunks(&self) -> Option<Chunks> {
        *self.chunks.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_streamed(&self, k: Key) -> bool {
        match k {
            Key::Sec(s) => self.plan.streamed.contains(&s),
            Key::Out(j) => self
                .chunks()
                .is_some_and(|c| j < c.len() && c.range(j).end > self.pinned_end()),
        }
    }

    /// Where the pinned prefix of a streamed output projection ends (its start if none).
    fn pinned_end(&self) -> u64 {
        self.streamed_output()
            .and_then(|o| self.map.ranges(o).first().map(|r| r.start))
            .map_or(0, |s| s + self.plan.output_pinned)
    }

    /// `r` without the pinned prefix of the output projection.
    fn unpinned(&self, mut r: std::ops::Range<u64>) -> std::ops::Range<u64> {
        if self.plan.output_pinned > 0 {
            let end = self.pinned_end();
            let start = end - self.plan.output_pinned;
            if r.start < end && r.end > start {
                r.start = r
                    .start
                    .max(end.div_ceil(PAGE) * PAGE)
                    .min(r.end.max(r.start));
            }
        }
        r
    }

    /// The first output chunk that streams.
    fn first_streamed_chunk(&self) -> usize {
        let n = self.chunks().map_or(0, |c| c.len());
        (0..n).find(|&j| self.is_streamed(Key::Out(j))).unwrap_or(0)
    }

    /// Ask the loader for `s` if it is streamed and not asked for yet.
    fn request(&self, s: Key) {
        if !self.is_streamed(s) {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.requested.insert(s) {
            let _ = self.load.lock().unwrap_or_else(|e| e.into_inner()).send(s);
        }
    }

    /// Wait until `s` (if streamed) is read; the seconds waited.
    fn wait(&self, s: Key) -> f64 {
        if !self.is_streamed(s) {
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
    fn bases(&self) -> Vec<crate::pages::Mapping> {
        let mut cached = self.bases.lock().unwrap_or_else(|e| e.into_inner());
        if cached.is_none() {
            let maps = crate::pages::mappings_of(&self.path, self.pages.address());
            // Faults in those mappings read exactly the page they need (the loader reads
            // streamed data ahead in large reads).
            for m in &maps {
                for s in &self.plan.streamed {
                    for r in self.map.ranges(*s) {
                        self.pages.no_readaround_at(m, r.clone());
                    }
                }
            }
            *cached = Some(maps);
        }
        cached.clone().unwrap_or_default()
    }

    /// Drop `s` from DRAM: llama.cpp's mapping, ours, the page cache.
    fn evict(&self, s: Key) {
        let bases = self.bases();
        for mut r in self.ranges(s) {
            if let (Key::Out(j), Some(c)) = (s, self.chunks()) {
                // A page a chunk shares with the next one goes with the next one (it is read
                // ahead and about to be used).
                if j + 1 < c.len() {
                    r.end = r.end / PAGE * PAGE;
                }
                r.start = r.start / PAGE * PAGE;
                if r.end <= r.start {
                    continue;
                }
            }
            let r = self.unpinned(self.widen(s, r));
            if r.is_empty() {
                continue;
            }
            for m in &bases {
                self.pages.evict_at(m, r.clone());
            }
            let _ = self.pages.evict(r.clone());
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.loaded.remove(&s);
        st.requested.remove(&s);
    }

    /// `r` (of `s`) grown over the neighbouring streamed data that is not in use: the page
    /// cache keeps large folios (up to 2 MB here) that a range only partly covers, so one
    /// straddling two blocks leaves only when both are evicted in one go.
    fn widen(&self, s: Key, r: std::ops::Range<u64>) -> std::ops::Range<u64> {
        let idle = {
            let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<std::ops::Range<u64>> = Vec::new();
            for &x in &self.plan.streamed {
                if x != Section::Embed && x != Section::Output || self.chunks().is_none() {
                    if Key::Sec(x) != s && st.requested.contains(&Key::Sec(x)) {
                        continue;
                    }
                    v.extend(self.map.ranges(x).iter().cloned());
                }
            }
            if let (Key::Out(j), Some(c)) = (s, self.chunks()) {
                if j > 0 && !st.requested.contains(&Key::Out(j - 1)) {
                    v.push(c.range(j - 1));
                }
            }
            v
        };
        let mut out = r.clone();
        for x in &idle {
            if x.end <= r.start && x.end + PAGE >= r.start {
                out.start = out.start.min(x.start);
            }
            if x.start >= r.end && x.start <= r.end + PAGE {
                out.end = out.end.max(x.end);
            }
        }
        out
    }

    /// Drop a whole section, output chunks included.
    fn evict_section(&self, s: Section) {
        self.evict(Key::Sec(s));
        if Some(s) == self.streamed_output() {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.loaded.retain(|k| !matches!(k, Key::Out(_)));
            st.requested.retain(|k| !matches!(k, Key::Out(_)));
        }
    }

    /// Bytes of the streamed sections (blocks and output projection) resident now.
    fn streamed_resident(&self) -> u64 {
        self.plan
            .streamed
            .iter()
            .flat_map(|&s| self.map.ranges(s))
            .map(|r| self.unpinned(r.clone()))
            .filter(|r| !r.is_empty())
            .map(|r| self.pages.resident(r).unwrap_or(0))
            .sum()
    }

    /// A layer or chunk boundary: the seconds waited for its data, and (sampled) what is
    /// resident.
    fn boundary(&self, blocked: f64) {
        self.note_resident(false);
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .current
            .blocked_seconds += blocked;
    }

    /// Record the streamed bytes resident now in the call's peak (at one boundary in
    /// [`SAMPLE`], or always with `force`).
    fn note_resident(&self, force: bool) {
        let tick = self
            .ticks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let every = self
            .sample
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(1);
        if !force && !tick.is_multiple_of(every) {
            return;
        }
        // The direct-read pool is memory the streamed output occupies too.
        let resident = self.streamed_resident() + self.direct().map_or(0, |d| d.resident());
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.current.peak_streamed_resident = st.current.peak_streamed_resident.max(resident);
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

/// Pages of the file as the evictions round them.
const PAGE: u64 = 4096;

/// [`Streamer::row_stream`]'s hook.
struct OutputRows {
    shared: Arc<Shared>,
    rows: usize,
}

impl RowStream for OutputRows {
    fn chunk_rows(&self) -> usize {
        self.rows
    }

    fn before(
        &self,
        rows: std::ops::Range<usize>,
    ) -> std::result::Result<Option<*const u8>, String> {
        let sh = &self.shared;
        let j = rows.start / self.rows;
        let blocked = sh.wait(Key::Out(j));
        sh.healthy()?;
        // Read into the pool: the rows are there (a pinned chunk is in the mapping).
        let src = match (sh.direct(), sh.is_streamed(Key::Out(j)), sh.chunks()) {
            (Some(d), true, Some(c)) => Some(d.at(j, &c.range(j))),
            _ => None,
        };
        for k in j + 1..=j + sh.ahead {
            sh.request(Key::Out(k));
        }
        sh.boundary(blocked);
        Ok(src)
    }

    fn prefetch(&self, on: bool) {
        self.shared
            .prefetch_output
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn after(&self, rows: std::ops::Range<usize>) {
        let sh = &self.shared;
        let k = Key::Out(rows.start / self.rows);
        if let Some(d) = sh.direct() {
            // Nothing of it is in the page cache: release its buffer.
            let idle = {
                let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                st.loaded.remove(&k);
                st.requested.remove(&k);
                !st.requested.iter().any(|k| matches!(k, Key::Out(_)))
            };
            // The pass is over: the pool's memory goes back until the next one.
            if idle {
                d.release();
            }
        } else {
            sh.evict(k);
        }
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

    fn failure(&mut self) -> Option<String> {
        self.0
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn observe(&mut self, t: &TensorView<'_>) -> bool {
        let sh = &self.0;
        let name = t.name();
        // The next layer reads the file through llama.cpp's mapping: a truncated file would
        // fault (SIGBUS), a deleted one is gone for the next run. Stop the decode instead.
        if name != "result_output" && sh.healthy().is_err() {
            return false;
        }
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
                    sh.evict_section(out);
                }
                if first {
                    // Loading the model may have read everything: start from the plan.
                    for s in sh.plan.streamed.clone() {
                        let asked = sh
                            .state
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .requested
                            .contains(&Key::Sec(s));
                        if !asked {
                            sh.evict_section(s);
                        }
                    }
                }
            }
            let blocked = sh.wait(Key::Sec(Section::Block(i)));
            if sh.healthy().is_err() {
                return false;
            }
            for b in i + 1..=i + sh.ahead {
                sh.request(Key::Sec(Section::Block(b)));
            }
            // Leap's projection streams the output in chunks: the first is read while the
            // last blocks compute.
            if i + sh.ahead >= sh.map.blocks()
                && sh
                    .prefetch_output
                    .load(std::sync::atomic::Ordering::Relaxed)
            {
                sh.request(Key::Out(sh.first_streamed_chunk()));
            }
            if i > 0 && sh.streamed(i - 1) {
                sh.evict(Key::Sec(Section::Block(i - 1)));
            }
            sh.boundary(blocked);
        } else if name == "result_norm" {
            let last = sh.map.blocks().saturating_sub(1);
            if sh.streamed(last) {
                sh.evict(Key::Sec(Section::Block(last)));
            }
            // The output projection (a single node) next: it is read as it runs (reading it
            // ahead with the loader left the storage reads uncounted in /proc/self/io: not
            // understood yet). With Leap's on-demand projection the graph stops here.
        } else if name == "result_output" {
            // llama.cpp's projection (one node) had the whole output resident.
            sh.note_resident(true);
            sh.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .current
                .llama_output = true;
            if let Some(out) = sh.streamed_output() {
                sh.evict_section(out);
            }
            finish(&mut sh.state.lock().unwrap_or_else(|e| e.into_inner()));
            // The next call's first streamed block, between calls.
            if let Some(b) = (0..sh.map.blocks()).find(|&b| sh.streamed(b)) {
                sh.request(Key::Sec(Section::Block(b)));
            }
        }
        true
    }
}
