//! Leap's sidecar: `MODEL.leap.gguf` next to `MODEL.gguf`, what GGUF model distributors ship
//! beside their models. A GGUF file of metadata written and read with ggml's own `gguf.h`:
//! the per-head sparse-attention profile (`leap profile-heads`, keys `leap.attn.*`) and the
//! early-exit head (`leap train-heads`, keys `leap.exit.*`, stored and loaded by `leap-spec`'s
//! `exit` module).
//!
//! Saving rewrites the file from the keys loaded, so a tool that updates its own keys keeps
//! everyone else's.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use llama_cpp_sys_2 as sys;

use crate::{backend, Error, Result};

/// Format version written to `leap.sidecar.version`.
pub const VERSION: u32 = 1;

/// A sidecar value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U32(u32),
    F32(f32),
    Str(String),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

/// A sidecar's key/values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sidecar {
    pub kv: Vec<(String, Value)>,
}

/// Where the sidecar of `model` is: `dir/name.gguf` -> `dir/name.leap.gguf`.
pub fn path_for(model: &Path) -> PathBuf {
    let stem = model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = stem.strip_suffix(".gguf").unwrap_or(&stem);
    model.with_file_name(format!("{stem}.leap.gguf"))
}

struct Ctx(*mut sys::gguf_context);

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: created by gguf_init_*, freed once.
        unsafe { sys::gguf_free(self.0) }
    }
}

/// The elements of array `i` of `c`, copied.
///
/// # Safety
/// `i` is in `0..gguf_get_n_kv`, and key `i` is an array of `T` (4-byte `f32` or `i32`).
unsafe fn array<T: Copy>(c: &Ctx, i: i64) -> Vec<T> {
    // SAFETY: `i` is a valid array key (the caller's contract).
    let n = unsafe { sys::gguf_get_arr_n(c.0, i) };
    if n == 0 {
        // ggml's data pointer of an empty array is null, which no slice may have.
        return Vec::new();
    }
    // SAFETY: non-null (n > 0), `n` elements of `T` owned by `c` (std::vector storage, so
    // aligned for `T`), copied out before `c` can go.
    unsafe {
        let p = sys::gguf_get_arr_data(c.0, i).cast::<T>();
        std::slice::from_raw_parts(p, n).to_vec()
    }
}

fn cstring(s: &str, what: &'static str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::NulByte { what })
}

impl Sidecar {
    /// A value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// An f32 array by key.
    pub fn f32s(&self, key: &str) -> Option<&[f32]> {
        match self.get(key)? {
            Value::F32s(v) => Some(v),
            _ => None,
        }
    }

    /// An i32 array by key.
    pub fn i32s(&self, key: &str) -> Option<&[i32]> {
        match self.get(key)? {
            Value::I32s(v) => Some(v),
            _ => None,
        }
    }

    /// A u32 by key.
    pub fn u32(&self, key: &str) -> Option<u32> {
        match self.get(key)? {
            Value::U32(v) => Some(*v),
            _ => None,
        }
    }

    /// Set (replace or add) a value.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
    }

    /// The sidecar at `path` to add keys to and save back: what it holds, or an empty one when
    /// there is none, or (with a warning) when the file there cannot be read, which saving
    /// then replaces.
    pub fn load_or_new(path: &Path) -> Self {
        match Self::load(path) {
            Ok(s) => s.unwrap_or_default(),
            Err(e) => {
                log::warn!("{}: replacing an unreadable sidecar ({e})", path.display());
                Self::default()
            }
        }
    }

    /// Read `path`; `Ok(None)` if there is no such file.
    ///
    /// # Errors
    /// [`Error::InvalidGguf`] if it exists but is not a GGUF file ggml can read, or has a
    /// key whose name is not UTF-8, or that a NUL byte cuts short to "" or to another key's
    /// name (which Leap could not save back as it was).
    pub fn load(path: &Path) -> Result<Option<Self>> {
        if !path.exists() {
            return Ok(None);
        }
        backend::init();
        let cpath =
            CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::NulByte {
                what: "sidecar path",
            })?;
        let params = sys::gguf_init_params {
            no_alloc: true,
            ctx: std::ptr::null_mut(),
        };
        // SAFETY: NUL-terminated path; ggml returns null on failure.
        let raw = unsafe { sys::gguf_init_from_file(cpath.as_ptr(), params) };
        if raw.is_null() {
            return Err(Error::InvalidGguf {
                path: path.to_path_buf(),
                reason: backend::reason_or("ggml could not parse the sidecar"),
            });
        }
        let c = Ctx(raw);
        let mut out = Sidecar::default();
        // SAFETY: indices in 0..n_kv; strings and arrays are owned by `c`, copied out.
        unsafe {
            for i in 0..sys::gguf_get_n_kv(c.0) {
                // A GGUF key is length-prefixed bytes. One that is not UTF-8 would be kept (and
                // saved) under another name, maybe another key's; one with a NUL byte is cut
                // short by the C string gguf.h gives and takes, to "" (which ggml refuses to
                // save) or to the name of an earlier key (which saving would overwrite).
                let raw_key = sys::gguf_get_key(c.0, i);
                let name = CStr::from_ptr(raw_key);
                let key = match name.to_str() {
                    Ok(k) if !k.is_empty() && sys::gguf_find_key(c.0, raw_key) == i => k.to_owned(),
                    _ => {
                        return Err(Error::InvalidGguf {
                            path: path.to_path_buf(),
                            reason: format!(
                                "key {i} ({:?}) is not UTF-8, or has a NUL byte",
                                name.to_string_lossy()
                            ),
                        })
                    }
                };
                let v = match sys::gguf_get_kv_type(c.0, i) {
                    sys::GGUF_TYPE_UINT32 => Value::U32(sys::gguf_get_val_u32(c.0, i)),
                    sys::GGUF_TYPE_FLOAT32 => Value::F32(sys::gguf_get_val_f32(c.0, i)),
                    sys::GGUF_TYPE_STRING => Value::Str(
                        CStr::from_ptr(sys::gguf_get_val_str(c.0, i))
                            .to_string_lossy()
                            .into_owned(),
                    ),
                    sys::GGUF_TYPE_ARRAY
                        if sys::gguf_get_arr_type(c.0, i) == sys::GGUF_TYPE_FLOAT32 =>
                    {
                        Value::F32s(array(&c, i))
                    }
                    sys::GGUF_TYPE_ARRAY
                        if sys::gguf_get_arr_type(c.0, i) == sys::GGUF_TYPE_INT32 =>
                    {
                        Value::I32s(array(&c, i))
                    }
                    // Other types (general.* keys, later formats): not Leap's to keep.
                    _ => continue,
                };
                out.kv.push((key, v));
            }
        }
        Ok(Some(out))
    }

    /// Write to `path` (through a temporary file, so a reader never sees half a sidecar).
    ///
    /// # Errors
    /// [`Error::Io`]-like failures as [`Error::InvalidGguf`] with the reason.
    pub fn save(&self, path: &Path) -> Result<()> {
        backend::init();
        // SAFETY: an empty context, filled with owned copies of our values, freed by `Ctx`.
        let c = Ctx(unsafe { sys::gguf_init_empty() });
        let version = cstring("leap.sidecar.version", "sidecar key")?;
        // SAFETY: valid context and NUL-terminated key.
        unsafe { sys::gguf_set_val_u32(c.0, version.as_ptr(), VERSION) };
        for (k, v) in &self.kv {
            if k == "leap.sidecar.version" {
                continue;
            }
            let key = cstring(k, "sidecar key")?;
            // SAFETY: gguf copies the key and the data.
            unsafe {
                match v {
                    Value::U32(x) => sys::gguf_set_val_u32(c.0, key.as_ptr(), *x),
                    Value::F32(x) => sys::gguf_set_val_f32(c.0, key.as_ptr(), *x),
                    Value::Str(s) => {
                        let s = cstring(s, "sidecar string")?;
                        sys::gguf_set_val_str(c.0, key.as_ptr(), s.as_ptr())
                    }
                    Value::F32s(a) => sys::gguf_set_arr_data(
                        c.0,
                        key.as_ptr(),
                        sys::GGUF_TYPE_FLOAT32,
                        a.as_ptr().cast(),
                        a.len(),
                    ),
                    Value::I32s(a) => sys::gguf_set_arr_data(
                        c.0,
                        key.as_ptr(),
                        sys::GGUF_TYPE_INT32,
                        a.as_ptr().cast(),
                        a.len(),
                    ),
                }
            }
        }
        let tmp = path.with_extension("gguf.tmp");
        let ctmp =
            CString::new(tmp.as_os_str().as_encoded_bytes()).map_err(|_| Error::NulByte {
                what: "sidecar path",
            })?;
        // SAFETY: valid context and path.
        let ok = unsafe { sys::gguf_write_to_file(c.0, ctmp.as_ptr(), false) };
        if !ok {
            return Err(Error::InvalidGguf {
                path: tmp,
                reason: backend::reason_or("ggml could not write the sidecar"),
            });
        }
        std::fs::rename(&tmp, path).map_err(|e| Error::InvalidGguf {
            path: path.to_path_buf(),
            reason: format!("renaming {}: {e}", tmp.display()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_path_sits_next_to_the_model() {
        assert_eq!(
            path_for(Path::new("/m/gemma-3-270m-q4_k_m.gguf")),
            Path::new("/m/gemma-3-270m-q4_k_m.leap.gguf")
        );
        assert_eq!(path_for(Path::new("model")), Path::new("model.leap.gguf"));
    }

    #[test]
    fn round_trip_keeps_every_value() {
        let dir = std::env::temp_dir().join(format!("leap-sidecar-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.leap.gguf");
        let mut s = Sidecar::default();
        s.set("leap.attn.keep", Value::F32s(vec![0.1, 0.25, 1.0]));
        s.set("leap.exit.shadow", Value::I32s(vec![-3, 0, 262_143]));
        s.set("leap.attn.n_layer", Value::U32(3));
        s.set("leap.attn.global_keep", Value::F32(0.2));
        s.set("leap.attn.corpus", Value::Str("wiki.txt".into()));
        s.save(&p).unwrap();
        let back = Sidecar::load(&p).unwrap().unwrap();
        for (k, v) in &s.kv {
            assert_eq!(back.get(k), Some(v), "{k}");
        }
        assert_eq!(back.u32("leap.sidecar.version"), Some(VERSION));
        // Updating one key keeps the others.
        let mut upd = back.clone();
        upd.set("leap.attn.n_layer", Value::U32(4));
        upd.save(&p).unwrap();
        let again = Sidecar::load(&p).unwrap().unwrap();
        assert_eq!(again.u32("leap.attn.n_layer"), Some(4));
        assert_eq!(again.f32s("leap.attn.keep"), Some(&[0.1, 0.25, 1.0][..]));
        assert!(Sidecar::load(&dir.join("none.gguf")).unwrap().is_none());
        std::fs::write(dir.join("bad.gguf"), b"not a gguf").unwrap();
        assert!(Sidecar::load(&dir.join("bad.gguf")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A key, its GGUF type and its value's bytes.
    type Kv<'a> = (&'a [u8], (u32, Vec<u8>));

    /// A GGUF v3 file of `kv` and no tensors.
    fn gguf(kv: &[Kv<'_>]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (k, (t, v)) in kv {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(*k);
            b.extend(t.to_le_bytes());
            b.extend(v);
        }
        b
    }

    /// Found by `make fuzz` (target `sidecar`): an empty array made a slice of ggml's null data
    /// pointer; a key with a NUL byte read as "" or as an earlier key's name, on which saving
    /// aborted the process inside ggml; a key that was not UTF-8 read as another key's name,
    /// and saving kept one of the two values.
    #[test]
    fn empty_arrays_read_and_keys_that_cannot_be_saved_back_are_refused() {
        let dir = std::env::temp_dir().join(format!("leap-sidecar-nul-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.leap.gguf");
        let mut s = Sidecar::default();
        s.set("leap.attn.keep", Value::F32s(Vec::new()));
        s.set("leap.exit.shadow", Value::I32s(Vec::new()));
        s.save(&p).unwrap();
        let back = Sidecar::load(&p).unwrap().unwrap();
        assert_eq!(back.f32s("leap.attn.keep"), Some(&[][..]));
        assert_eq!(back.i32s("leap.exit.shadow"), Some(&[][..]));

        let float = |x: f32| (sys::GGUF_TYPE_FLOAT32, x.to_le_bytes().to_vec());
        let uint = |x: u32| (sys::GGUF_TYPE_UINT32, x.to_le_bytes().to_vec());
        for kv in [
            // Read as "": ggml asserts a key is not empty when it is saved.
            vec![(&b"\0\0ap.exit.temperature"[..], float(1.0))],
            // Both read as general.alignment, the second an f32, which ggml aborts on saving.
            vec![
                (&b"general.alignment\0a"[..], uint(32)),
                (&b"general.alignment\0b"[..], float(1.0)),
            ],
            // Both read as "leap\u{fffd}exit.layer".
            vec![
                (&b"leap\x87exit.layer"[..], uint(2)),
                (&b"leap\xef\xbf\xbdexit.layer"[..], uint(3)),
            ],
        ] {
            std::fs::write(&p, gguf(&kv)).unwrap();
            let e = Sidecar::load(&p).unwrap_err().to_string();
            assert!(e.contains("not UTF-8, or has a NUL byte"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
