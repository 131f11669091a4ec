//! Running work on the threads ggml's CPU backend uses (its OpenMP team), so Leap's own
//! parallel work neither spawns threads nor competes with ggml's workers, which spin for a
//! while after each graph.

use std::ffi::{c_int, c_uint, c_void};
use std::path::Path;
use std::sync::OnceLock;

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpInt = unsafe extern "C" fn() -> c_int;
type GompBarrier = unsafe extern "C" fn();

/// libgomp's entry points (ggml's CPU backend brings OpenMP).
#[derive(Clone, Copy)]
struct Gomp {
    parallel: GompParallel,
    thread: OmpInt,
    threads: OmpInt,
    /// `GOMP_barrier`, for [`parallel_phased`].
    barrier: Option<GompBarrier>,
}

/// libgomp's entry points when the process has them.
fn gomp() -> Option<Gomp> {
    static GOMP: OnceLock<Option<Gomp>> = OnceLock::new();
    *GOMP.get_or_init(|| {
        // SAFETY: dlsym on the global namespace with NUL-terminated names; the symbols, when
        // present, have these C signatures (libgomp's ABI, also provided by LLVM's libomp).
        unsafe {
            let p = libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr());
            let t = libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_thread_num".as_ptr());
            let n = libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_num_threads".as_ptr());
            let b = libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_barrier".as_ptr());
            if p.is_null() || t.is_null() || n.is_null() {
                return None;
            }
            Some(Gomp {
                parallel: std::mem::transmute::<*mut c_void, GompParallel>(p),
                thread: std::mem::transmute::<*mut c_void, OmpInt>(t),
                threads: std::mem::transmute::<*mut c_void, OmpInt>(n),
                barrier: (!b.is_null()).then(|| std::mem::transmute::<*mut c_void, GompBarrier>(b)),
            })
        }
    })
}

/// Threads to decode with when the user names none, as llama.cpp chooses them: one per
/// physical core (hyper-threads share a core's arithmetic units, and a second thread on a core
/// slows both), within what the process may use (its CPU affinity and cgroup quota).
pub fn default_threads() -> i32 {
    let allowed = std::thread::available_parallelism().map_or(4, |n| n.get());
    let cores = physical_cores(Path::new("/sys/devices/system/cpu")).unwrap_or(allowed);
    cores.clamp(1, allowed.max(1)) as i32
}

/// The number of physical cores under `sys` (`/sys/devices/system/cpu`): CPUs that list the
/// same hardware threads as siblings are one core. `None` when the topology is not there.
fn physical_cores(sys: &Path) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for cpu in 0.. {
        let f = sys.join(format!("cpu{cpu}/topology/thread_siblings_list"));
        match std::fs::read_to_string(&f) {
            Ok(s) => {
                cores.insert(s.trim().to_string());
            }
            Err(_) => break,
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Work for [`parallel`]: called as `f(thread, threads)` on each thread.
pub type Job<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// Run `f(thread, threads)` on `threads` threads: the OpenMP team ggml uses when there is one
/// (no thread of our own, and its threads are already awake), else scoped threads.
pub fn parallel(threads: usize, f: Job<'_>) {
    if threads <= 1 {
        f(0, 1);
        return;
    }
    if let Some(Gomp {
        parallel: par,
        thread: tid,
        threads: nth,
        ..
    }) = gomp()
    {
        struct Data<'a> {
            f: Job<'a>,
            tid: OmpInt,
            nth: OmpInt,
        }
        extern "C" fn trampoline(p: *mut c_void) {
            // SAFETY: `p` is the `Data` below, alive for the whole parallel region.
            let d = unsafe { &*(p as *const Data<'_>) };
            // SAFETY: OpenMP runtime queries, inside a parallel region.
            let (t, n) = unsafe { ((d.tid)(), (d.nth)()) };
            (d.f)(t.max(0) as usize, n.max(1) as usize);
        }
        let d = Data { f, tid, nth };
        // SAFETY: the region runs `trampoline` on every team thread and returns after all
        // finished, so `d` outlives it.
        unsafe {
            par(
                trampoline,
                &d as *const Data<'_> as *mut c_void,
                threads as c_uint,
                0,
            )
        };
        return;
    }
    scoped(threads, f);
}

/// Run `f(thread, threads)` on `threads` scoped threads, the calling thread one of them.
fn scoped(threads: usize, f: Job<'_>) {
    std::thread::scope(|s| {
        for t in 1..threads {
            s.spawn(move || f(t, threads));
        }
        f(0, threads);
    });
}

/// Where the threads of a [`parallel_phased`] region wait for each other.
pub struct Phase(Wait);

enum Wait {
    /// One thread: nothing to wait for.
    Alone,
    /// libgomp's team barrier (`#pragma omp barrier`, as ggml's own graphs wait): spins a
    /// while, then sleeps, so a thread whose partner lost its core gives its own up.
    Team(GompBarrier),
    /// The scoped threads' barrier where there is no OpenMP.
    Scoped(std::sync::Barrier),
}

impl Phase {
    /// Return once every thread of the region has called this (as many times).
    pub fn wait(&self) {
        match &self.0 {
            Wait::Alone => {}
            // SAFETY: called inside the region's parallel function, by every team thread.
            Wait::Team(b) => unsafe { b() },
            Wait::Scoped(b) => {
                b.wait();
            }
        }
    }
}

/// [`parallel`], the threads able to wait for each other ([`Phase::wait`]) between steps:
/// one region where two in a row would each pay a start. Every thread must call `wait` the
/// same number of times.
pub fn parallel_phased(threads: usize, f: &(dyn Fn(usize, usize, &Phase) + Sync)) {
    if threads <= 1 {
        return f(0, 1, &Phase(Wait::Alone));
    }
    match gomp().and_then(|g| g.barrier) {
        Some(b) => {
            let phase = Phase(Wait::Team(b));
            parallel(threads, &|t, n| f(t, n, &phase));
        }
        None => phased_scoped(threads, f),
    }
}

/// [`parallel_phased`] on scoped threads (no OpenMP, or no `GOMP_barrier`).
fn phased_scoped(threads: usize, f: &(dyn Fn(usize, usize, &Phase) + Sync)) {
    let phase = Phase(Wait::Scoped(std::sync::Barrier::new(threads)));
    scoped(threads, &|t, n| f(t, n, &phase));
}

/// Tasks `0..n` shared by a parallel region's threads: each thread first takes its own
/// contiguous run of them (thread t's share of an even split, in address order, which the
/// hardware prefetchers follow), and once that is done takes what is left of the others' runs
/// from their far ends. A static split makes every thread wait for the slowest: on a 2-core VM
/// one of SmolLM2's ~18 us weight products had a thread idle for ~30% of it, whichever started
/// late or lost its share of memory bandwidth.
pub struct Shares {
    /// Thread t's run, `[next, end)`: next in the low 32 bits, end in the high.
    runs: Vec<Run>,
}

/// One thread's run, on a cache line (and its prefetched pair) of its own: runs side by side
/// made every task's claim move the line between the cores. Claims took 0.61-0.72 ms of
/// thread time a step with the runs side by side and one task a claim, 0.27-0.40 on lines of
/// their own, 0.08-0.11 claimed as [`Shares::claim`] does (`perf` of `make llama`'s
/// llama-server on Gemma, whose output projection is 4,096 tasks a call).
#[repr(align(128))]
struct Run(std::sync::atomic::AtomicU64);

impl Shares {
    /// `tasks` tasks for `threads` threads (at most `u32::MAX` tasks).
    pub fn new(tasks: usize, threads: usize) -> Self {
        let t = threads.max(1);
        let tasks = tasks.min(u32::MAX as usize);
        let runs = (0..t)
            .map(|i| {
                let (lo, hi) = (i * tasks / t, (i + 1) * tasks / t);
                Run(std::sync::atomic::AtomicU64::new(
                    lo as u64 | (hi as u64) << 32,
                ))
            })
            .collect();
        Self { runs }
    }

    /// The next tasks for thread `tid` (of the `threads` given to [`Shares::new`]), a range of
    /// them, or `None` once every task has been taken. Each task is handed out once. A claim
    /// takes a quarter of what is left of the run it is taken from (one task at least), so a
    /// run of thousands of tasks costs a few dozen locked instructions (the runs' type says what
    /// one a task cost), and the claims still shrink to single tasks where the threads meet.
    pub fn claim(&self, tid: usize) -> Option<std::ops::Range<usize>> {
        use std::sync::atomic::Ordering::Relaxed;
        let n = self.runs.len();
        // Its own run from the front, then the others' from the back (the next thread's
        // first: with two threads, each ends where the other is).
        for (k, run) in (0..n).map(|k| (k, &self.runs[(tid + k) % n].0)) {
            let mut v = run.load(Relaxed);
            loop {
                let (lo, hi) = (v & 0xffff_ffff, v >> 32);
                if lo >= hi {
                    break;
                }
                let take = (hi - lo).div_ceil(4);
                let (tasks, left) = if k == 0 {
                    (lo..lo + take, (lo + take) | hi << 32)
                } else {
                    (hi - take..hi, lo | (hi - take) << 32)
                };
                match run.compare_exchange_weak(v, left, Relaxed, Relaxed) {
                    Ok(_) => return Some(tasks.start as usize..tasks.end as usize),
                    Err(now) => v = now,
                }
            }
        }
        None
    }

    /// Thread `tid`'s tasks, [`Shares::claim`] after claim until they run out.
    pub fn iter(&self, tid: usize) -> impl Iterator<Item = usize> + '_ {
        let mut tasks = 0..0;
        std::iter::from_fn(move || {
            if tasks.is_empty() {
                tasks = self.claim(tid)?;
            }
            tasks.next()
        })
    }
}

/// Let the OpenMP team of the calling thread go (its worker threads end), when the process
/// has OpenMP's `omp_pause_resource_all` (libgomp since GCC 9, LLVM's libomp); the next
/// parallel region on this thread makes a new one (tens of microseconds). Call it when a
/// thread is done with ggml for a while, outside any parallel region.
///
/// ggml's CPU backend runs each graph on the calling thread's team, and libgomp keeps a
/// thread's team for as long as the thread lives. While it manages more threads than there
/// are CPUs it all but stops spinning between parallel regions, and a graph of ~250 of them
/// (Gemma 3's one-row call) then takes 3-4x as long. A server's slot threads, or an app's
/// threads that each ran a generation once, kept that many teams alive for good.
pub fn release_team() {
    type Pause = unsafe extern "C" fn(c_int) -> c_int;
    static PAUSE: OnceLock<Option<Pause>> = OnceLock::new();
    let pause = *PAUSE.get_or_init(|| {
        // SAFETY: dlsym on the global namespace with a NUL-terminated name; the symbol, when
        // present, is OpenMP 5.0's `int omp_pause_resource_all(omp_pause_resource_t)`.
        unsafe {
            let p = libc::dlsym(libc::RTLD_DEFAULT, c"omp_pause_resource_all".as_ptr());
            (!p.is_null()).then(|| std::mem::transmute::<*mut c_void, Pause>(p))
        }
    });
    if let Some(pause) = pause {
        // omp_pause_soft (1): the threads end, the runtime stays usable. Inside a parallel
        // region libgomp refuses (nonzero) and nothing changes.
        // SAFETY: a plain call into the OpenMP runtime.
        unsafe {
            pause(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a [`Phase::wait`], every thread sees what every other wrote before it, however
    /// late the others come to it; and the waits can repeat. On an OpenMP team and on scoped
    /// threads.
    #[test]
    fn a_phase_waits_for_every_thread() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        type Phased = fn(usize, &(dyn Fn(usize, usize, &Phase) + Sync));
        // The OpenMP team's barrier where the process has it, and the scoped threads' one.
        let runs: [(Phased, &str); 2] = [(parallel_phased, "team"), (phased_scoped, "scoped")];
        for ((run, name), threads) in runs.into_iter().flat_map(|r| [1, 2, 3].map(|t| (r, t))) {
            let slots: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            let seen = AtomicUsize::new(0);
            run(threads, &|t, n, phase| {
                assert_eq!(n, threads);
                for round in 1..=2 {
                    std::thread::sleep(std::time::Duration::from_millis(10 * t as u64));
                    slots[t].store(round, Ordering::Relaxed);
                    phase.wait();
                    if slots.iter().all(|s| s.load(Ordering::Relaxed) == round) {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                    phase.wait();
                }
            });
            assert_eq!(seen.into_inner(), 2 * threads, "{name}, {threads} threads");
        }
    }

    /// Every task goes to exactly one thread, however unevenly the threads run; a thread
    /// takes its own run first, in order, then the others' from their ends.
    #[test]
    fn shares_hand_out_every_task_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        for (tasks, threads) in [(0, 2), (1, 2), (10, 2), (10, 3), (97, 4), (5, 1)] {
            let shares = Shares::new(tasks, threads);
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            scoped(threads, &|t, _| {
                for task in shares.iter(t) {
                    counts[task].fetch_add(1, Ordering::Relaxed);
                    // Thread 0 is slow: the others take most of its run.
                    if t == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                }
            });
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(
                    c.load(Ordering::Relaxed),
                    1,
                    "task {i} of {tasks}, {threads} threads"
                );
            }
        }
        // One thread alone takes them in order.
        let s = Shares::new(7, 1);
        assert_eq!(s.iter(0).collect::<Vec<_>>(), (0..7).collect::<Vec<_>>());
        // Two: thread 1, its own run done, takes thread 0's from the end.
        let s = Shares::new(6, 2);
        assert_eq!(s.claim(1), Some(3..4));
        assert_eq!(s.iter(1).collect::<Vec<_>>(), vec![4, 5, 2, 1, 0]);
        assert_eq!(s.claim(0), None);
        // Claims of a quarter of what is left: 100 tasks in 14 claims, the last ones single.
        let s = Shares::new(100, 1);
        let claims: Vec<_> = std::iter::from_fn(|| s.claim(0)).collect();
        assert_eq!(claims.first(), Some(&(0..25)));
        assert_eq!(claims.last(), Some(&(99..100)));
        assert!(claims.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(claims.len(), 14);
    }

    #[test]
    fn hyper_threads_count_once() {
        let dir = std::env::temp_dir().join(format!("leap-par-{}", std::process::id()));
        // Two cores of two hyper-threads each (cpu0/cpu2 and cpu1/cpu3), as Intel numbers them.
        for (cpu, siblings) in [(0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")] {
            let t = dir.join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&t).unwrap();
            std::fs::write(t.join("thread_siblings_list"), format!("{siblings}\n")).unwrap();
        }
        assert_eq!(physical_cores(&dir), Some(2));
        assert_eq!(physical_cores(&dir.join("none")), None);
        std::fs::remove_dir_all(&dir).unwrap();
        let d = default_threads();
        assert!(d >= 1 && d as usize <= std::thread::available_parallelism().unwrap().get());
    }
}
