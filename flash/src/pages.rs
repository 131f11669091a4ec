//! Residency control over a model file's pages: a read-only shared mapping (the same page
//! cache llama.cpp's own mapping of the file uses), with prefetch, eviction and `mincore`.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use leap_host::fileio::{self, Mapping as FileMapping};

use crate::{Error, Result};

/// A read-only mapping of a whole file.
pub struct Pages {
    path: PathBuf,
    file: File,
    map: FileMapping,
    page: usize,
}

fn io<'a>(path: &'a Path, what: &'static str) -> impl Fn(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        path: path.display().to_string(),
        what,
        source,
    }
}

impl Pages {
    /// Map `path` read-only.
    ///
    /// # Errors
    /// The file cannot be opened or mapped.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(io(path, "opening"))?;
        let len = file.metadata().map_err(io(path, "reading metadata"))?.len() as usize;
        let map = FileMapping::new(&file, 0, len).map_err(io(path, "mapping"))?;
        // No readahead on faults: this mapping reads exactly the ranges asked for (with
        // WILLNEED, in large reads), so what is resident is what the plan says.
        let page = fileio::page_size();
        let (base, mapped) = map.pages();
        // SAFETY: advice on the fresh mapping.
        unsafe { libc::madvise(base, mapped, libc::MADV_RANDOM) };
        // Nor on reads through this descriptor: `load` reads what it is asked, no more.
        // SAFETY: advice on an open descriptor.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        Ok(Self {
            path: path.to_owned(),
            file,
            map,
            page,
        })
    }

    /// Bytes mapped (the file's size when opened).
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// An empty file.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// `r` widened to whole pages, after checking it lies in the file as it is now (a
    /// truncated file would fault on access: SIGBUS).
    fn span(&self, r: &Range<u64>) -> Result<(usize, usize)> {
        let now = self
            .file
            .metadata()
            .map_err(io(&self.path, "reading metadata"))?
            .len();
        if r.end > self.map.len() as u64 || r.end > now || r.start > r.end {
            return Err(Error::OutOfFile {
                path: self.path.display().to_string(),
                start: r.start,
                end: r.end,
                len: now.min(self.map.len() as u64),
            });
        }
        let start = r.start as usize / self.page * self.page;
        let end = (r.end as usize).div_ceil(self.page) * self.page;
        Ok((
            start,
            end.min(self.map.len().div_ceil(self.page) * self.page) - start,
        ))
    }

    /// Bytes of `r` (in whole pages) resident in DRAM now, by `mincore`.
    ///
    /// # Errors
    /// `r` outside the file, or `mincore` failing.
    pub fn resident(&self, r: Range<u64>) -> Result<u64> {
        let (start, len) = self.span(&r)?;
        let mut vec = vec![0u8; len.div_ceil(self.page)];
        // SAFETY: the span lies inside the mapping; `vec` has a byte per page.
        let rc = unsafe { libc::mincore(self.base().add(start), len, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(io(&self.path, "mincore")(std::io::Error::last_os_error()));
        }
        Ok(vec.iter().filter(|&&v| v & 1 != 0).count() as u64 * self.page as u64)
    }

    /// Whether the file is still the one mapped: not truncated below the mapping (a fault
    /// there would be a SIGBUS) and not deleted.
    ///
    /// # Errors
    /// [`Error::OutOfFile`] for a shorter file; [`Error::Io`] for a deleted one.
    pub fn check(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let m = self
            .file
            .metadata()
            .map_err(io(&self.path, "reading metadata"))?;
        if m.len() < self.map.len() as u64 {
            return Err(Error::OutOfFile {
                path: self.path.display().to_string(),
                start: 0,
                end: self.map.len() as u64,
                len: m.len(),
            });
        }
        if m.nlink() == 0 {
            // Unlinked: deleted, or another file renamed over its path (a model updated in
            // place by a download). The mapping still reads the old file, but it is gone for
            // the next run and no longer the file the user names: stop, saying which.
            let replaced = std::fs::metadata(&self.path).is_ok_and(|now| now.ino() != m.ino());
            return Err(io(&self.path, "streaming")(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                if replaced {
                    "the model file was replaced while in use (another file is at its path now)"
                } else {
                    "the model file was deleted while in use"
                },
            )));
        }
        Ok(())
    }

    /// Ask the kernel to start reading `r` (returns at once).
    ///
    /// # Errors
    /// `r` outside the file.
    pub fn prefetch(&self, r: Range<u64>) -> Result<()> {
        let (start, len) = self.span(&r)?;
        // SAFETY: inside the mapping; advice only.
        unsafe { libc::madvise(self.base().add(start), len, libc::MADV_WILLNEED) };
        Ok(())
    }

    /// Read `r` into DRAM now: `POSIX_FADV_WILLNEED`, then the whole range read through the
    /// page cache into a 1 MB per-thread scratch buffer (no mapping's pages touched); returns
    /// the bytes covered.
    ///
    /// # Errors
    /// `r` outside the file.
    pub fn load(&self, r: Range<u64>) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let (start, len) = self.span(&r)?;
        // SAFETY: advice only; the kernel starts reading the whole range in large requests.
        unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                start as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        // Then wait for it by reading it through the page cache into a scratch buffer:
        // no page of any mapping is touched (faulting a page at a time costs more than the
        // copy), and the pages are in the cache for llama.cpp's mapping to find.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; 1 << 20]);
        }
        SCRATCH.with(|b| -> Result<()> {
            let mut b = b.borrow_mut();
            let mut off = start;
            while off < start + len {
                let n = b.len().min(start + len - off);
                match self.file.read_at(&mut b[..n], off as u64) {
                    Ok(0) => break,
                    Ok(k) => off += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(io(&self.path, "reading")(e)),
                }
            }
            Ok(())
        })?;
        Ok(len as u64)
    }

    /// Drop `r`'s pages from DRAM: this mapping's references, then the page cache (pages
    /// another mapping still uses stay: evict those through that mapping too).
    ///
    /// # Errors
    /// `r` outside the file.
    pub fn evict(&self, r: Range<u64>) -> Result<()> {
        let (start, len) = self.span(&r)?;
        // SAFETY: inside the mapping; a read-only shared file mapping is refilled from the
        // file on the next access.
        unsafe {
            libc::madvise(self.base().add(start), len, libc::MADV_DONTNEED);
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                start as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
        Ok(())
    }

    /// Address of this mapping (to tell it from other mappings of the file).
    pub fn address(&self) -> usize {
        self.base() as usize
    }

    /// The mapping's start: the file's offset 0.
    fn base(&self) -> *mut libc::c_void {
        self.map.pages().0
    }

    /// Drop `r`'s pages from another read-only mapping of this file (llama.cpp's), so that
    /// the page cache can let them go ([`Pages::evict`] after). `m` says where that mapping
    /// has the file's offset 0 and which address ranges of it are really mapped: only those
    /// are touched (MADV_DONTNEED on memory that is not the file's would zero it).
    pub fn evict_at(&self, m: &Mapping, r: Range<u64>) {
        self.advise_at(m, r, libc::MADV_DONTNEED);
    }

    /// No read-around on faults in `r` of another mapping of the file (llama.cpp's): a fault
    /// there would otherwise read neighbouring pages, streamed ones included, behind the
    /// plan's back.
    pub fn no_readaround_at(&self, m: &Mapping, r: Range<u64>) {
        self.advise_at(m, r, libc::MADV_RANDOM);
    }

    fn advise_at(&self, m: &Mapping, r: Range<u64>, advice: libc::c_int) {
        let Ok((start, len)) = self.span(&r) else {
            return;
        };
        let (lo, hi) = (m.base + start, m.base + start + len);
        for a in &m.areas {
            let (x, y) = (lo.max(a.start), hi.min(a.end));
            if x < y {
                // SAFETY: advice on pages of a file mapping found in /proc/self/maps, within
                // one of its areas; MADV_DONTNEED on a shared read-only file mapping refaults
                // from the file.
                unsafe { libc::madvise(x as *mut libc::c_void, y - x, advice) };
            }
        }
    }

    /// Undo [`Pages::lock`] on `r`.
    pub fn unlock(&self, r: Range<u64>) {
        if let Ok((start, len)) = self.span(&r) {
            // SAFETY: inside the mapping.
            unsafe { libc::munlock(self.base().add(start), len) };
        }
    }

    /// Lock `r` in memory (pinned sections); false where the system refuses.
    pub fn lock(&self, r: Range<u64>) -> bool {
        match self.span(&r) {
            // SAFETY: inside the mapping.
            Ok((start, len)) => unsafe { libc::mlock(self.base().add(start), len) == 0 },
            Err(_) => false,
        }
    }
}

/// Another mapping of a file: where it has the file's offset 0, and the address ranges of it
/// that are mapped (llama.cpp unmaps the parts no tensor uses; Leap's projection maps one
/// tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub base: usize,
    pub areas: Vec<std::ops::Range<usize>>,
}

/// The mappings of the file at `path` in this process other than the one whose offset 0 is at
/// `except` (ours), from `/proc/self/maps`.
pub fn mappings_of(path: &Path, except: usize) -> Vec<Mapping> {
    let want = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut out: Vec<Mapping> = Vec::new();
    for l in maps.lines() {
        let found = (|| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let (_perms, off, _dev, _inode) = (f.next()?, f.next()?, f.next()?, f.next()?);
            let file = f.next()?;
            let (a, b) = range.split_once('-')?;
            let start = usize::from_str_radix(a, 16).ok()?;
            let end = usize::from_str_radix(b, 16).ok()?;
            // Each area starts `offset` bytes into the mapping of the whole file.
            let base = start.checked_sub(usize::from_str_radix(off, 16).ok()?)?;
            (Path::new(file) == want && base != except).then_some((base, start..end))
        })();
        if let Some((base, area)) = found {
            match out.iter_mut().find(|m| m.base == base) {
                Some(m) => m.areas.push(area),
                None => out.push(Mapping {
                    base,
                    areas: vec![area],
                }),
            }
        }
    }
    out
}

/// Bytes this process has caused to be read from storage (`/proc/self/io`'s `read_bytes`:
/// page-cache hits do not count), or `None` where the kernel does not say.
pub fn io_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}
