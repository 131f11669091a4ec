//! Process resource usage (CPU time, peak RSS) for benchmark accounting.

fn rusage() -> libc::rusage {
    // SAFETY: getrusage writes into the zeroed struct we pass; RUSAGE_SELF is always valid.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    }
}

/// User + system CPU seconds of this process so far.
pub fn cpu_seconds() -> f64 {
    let ru = rusage();
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Peak resident set size of this process in bytes.
pub fn peak_rss_bytes() -> u64 {
    rusage().ru_maxrss as u64 * 1024
}
