//! Reading a model file beside llama.cpp, in one place: a read-only mapping of a byte range
//! ([`Mapping`]: the on-demand projection's output weights, flash's residency control over
//! the whole file), and reads around the page cache ([`read_direct`], [`read_full_at`],
//! [`aligned_span`]: the draft vocabulary's rows and flash's streamed chunks), whose pages
//! would otherwise stay resident behind a DRAM budget's back.

use std::ffi::c_void;
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// A read-only shared mapping of bytes `offset..offset + size` of a file (the same page cache
/// llama.cpp's own mapping of the file uses). Unmapped when dropped.
#[derive(Debug)]
pub struct Mapping {
    /// The mapping's start (page-aligned, at or before `offset`).
    base: *mut c_void,
    /// Bytes mapped from `base`.
    mapped: usize,
    /// Where the wanted range starts after `base`.
    skip: usize,
    /// The wanted range's length.
    len: usize,
}

// SAFETY: the mapping is read-only and lives as long as the value.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map bytes `offset..offset + size` of `file` (an empty range maps one page, never
    /// read).
    ///
    /// # Errors
    /// What `mmap` says.
    pub fn new(file: &File, offset: u64, size: usize) -> std::io::Result<Self> {
        let page = page_size() as u64;
        let start = offset / page * page;
        let skip = (offset - start) as usize;
        let mapped = (skip + size).max(1);
        // SAFETY: a fresh read-only shared mapping of an open file; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            base,
            mapped,
            skip,
            len: size,
        })
    }

    /// The first byte of the wanted range.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: `skip < mapped`, inside the mapping.
        unsafe { (self.base as *const u8).add(self.skip) }
    }

    /// The wanted range's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the wanted range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping's page-aligned start and length, for `madvise`, `mincore` and `mlock`.
    pub fn pages(&self) -> (*mut c_void, usize) {
        (self.base, self.mapped)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`mapped` are the mapping made in `new`.
        unsafe { libc::munmap(self.base, self.mapped) };
    }
}

/// The system's page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

/// `O_DIRECT`'s alignment of offsets, lengths and buffers.
pub const DIRECT_ALIGN: u64 = 4096;

/// `path` opened for reads around the page cache (`O_DIRECT`).
///
/// # Errors
/// The file cannot be opened, or its file system refuses `O_DIRECT` (tmpfs).
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// The aligned read covering bytes `r`: its file offset and length.
pub fn aligned_span(r: &Range<u64>) -> (u64, usize) {
    let a = r.start / DIRECT_ALIGN * DIRECT_ALIGN;
    let b = r.end.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    (a, (b - a) as usize)
}

/// Fill `buf` from `f` at `offset` (retrying short and interrupted reads). The file may end
/// inside `buf` only past byte `need` (an aligned read's last page); before it, that is an
/// `UnexpectedEof` error.
///
/// # Errors
/// Read errors; the file ending before `need`.
pub fn read_full_at(f: &File, buf: &mut [u8], offset: u64, need: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) if offset + (done as u64) < need => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the model file ended early",
                ))
            }
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Read `buf.len()` bytes at `at` from `f` (opened with [`open_direct`]) through an aligned
/// bounce buffer.
///
/// # Errors
/// Read errors; the file ending before the range does.
pub fn read_direct(f: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let end = at + buf.len() as u64;
    let (start, len) = aligned_span(&(at..end));
    let layout = std::alloc::Layout::from_size_align(len, DIRECT_ALIGN as usize)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a non-zero size (buf is not empty) with a valid alignment.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        return Err(std::io::ErrorKind::OutOfMemory.into());
    }
    // SAFETY: `p` points at `len` freshly allocated bytes, freed below.
    let bounce = unsafe { std::slice::from_raw_parts_mut(p, len) };
    let r = read_full_at(f, bounce, start, end);
    if r.is_ok() {
        let off = (at - start) as usize;
        buf.copy_from_slice(&bounce[off..off + buf.len()]);
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(p, layout) };
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_and_direct_reads_see_the_file_s_bytes() {
        let dir = std::env::temp_dir().join(format!("leap-fileio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bytes");
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        // An unaligned range.
        let m = Mapping::new(&f, 4100, 5000).unwrap();
        assert_eq!(m.len(), 5000);
        // SAFETY: the mapping holds 5000 readable bytes from `as_ptr`.
        let got = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert_eq!(got, &data[4100..9100]);
        assert_eq!(m.pages().0 as usize % page_size(), 0);
        assert_eq!(aligned_span(&(4100..9100)), (4096, 8192));
        // Direct reads where the file system allows them (not on tmpfs), plain ones otherwise.
        let d = open_direct(&path).unwrap_or_else(|_| File::open(&path).unwrap());
        let mut buf = vec![0u8; 300];
        read_direct(&d, &mut buf, data.len() as u64 - 300).unwrap();
        assert_eq!(
            buf,
            &data[data.len() - 300..],
            "the file ends inside the last page"
        );
        let mut past = vec![0u8; 10];
        assert!(read_direct(&d, &mut past, data.len() as u64 - 5).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
