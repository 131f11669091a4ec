//! Running work on the threads ggml's CPU backend uses (its OpenMP team), so Leap's own
//! parallel work neither spawns threads nor competes with ggml's workers, which spin for a
//! while after each graph.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpInt = unsafe extern "C" fn() -> c_int;

/// libgomp's entry points when the process has them (ggml's CPU backend brings OpenMP).
fn gomp() -> Option<(GompParallel, OmpInt, OmpInt)> {
    static GOMP: OnceLock<Option<(GompParallel, OmpInt, OmpInt)>> = OnceLock::new();
    *GOMP.get_or_init(|| {
        // SAFETY: dlsym on the global namespace with NUL-terminated names; the symbols, when
        // present, have these C signatures (libgomp's ABI, also provided by LLVM's libomp).
        unsafe {
            let p = libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr());
            let t = libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_thread_num".as_ptr());
            let n = libc::dlsym(libc::RTLD_DEFAULT, c"omp_get_num_threads".as_ptr());
            if p.is_null() || t.is_null() || n.is_null() {
                return None;
            }
            Some((
                std::mem::transmute::<*mut c_void, GompParallel>(p),
                std::mem::transmute::<*mut c_void, OmpInt>(t),
                std::mem::transmute::<*mut c_void, OmpInt>(n),
            ))
        }
    })
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
    if let Some((par, tid, nth)) = gomp() {
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
    std::thread::scope(|s| {
        for t in 1..threads {
            s.spawn(move || f(t, threads));
        }
        f(0, threads);
    });
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
