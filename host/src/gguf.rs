//! Reading a GGUF file's header with ggml's own parser (`gguf.h`): key/values and the tensor
//! table with absolute byte ranges. No second parser: `flash/` builds its layer map on this.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use llama_cpp_sys_2 as sys;

use crate::{backend, Error, Result};

/// A GGUF metadata value, as far as Leap needs to see it.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Any integer type, widened.
    Int(i64),
    /// `f32` or `f64`, widened.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array: its element type name and length (contents are not copied).
    Array { elem: String, len: usize },
}

impl std::fmt::Display for GgufValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GgufValue::Int(v) => write!(f, "{v}"),
            GgufValue::Float(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::Str(s) => write!(f, "{s}"),
            GgufValue::Array { elem, len } => write!(f, "[{elem}; {len}]"),
        }
    }
}

/// One tensor of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    /// Tensor name, e.g. `blk.3.attn_q.weight`.
    pub name: String,
    /// ggml type name, e.g. `q4_K`.
    pub ggml_type: String,
    /// Shape, ggml order (`ne[0]` is the row length).
    pub ne: [i64; 4],
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl GgufTensor {
    /// The block index for `blk.N.*` tensors.
    pub fn block(&self) -> Option<u32> {
        self.name
            .strip_prefix("blk.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    }
}

/// The header of a GGUF file: version, metadata, tensor table.
#[derive(Debug, Clone)]
pub struct GgufInfo {
    /// The file.
    pub path: PathBuf,
    /// GGUF format version.
    pub version: u32,
    /// Size of the file in bytes.
    pub file_size: u64,
    /// Offset of the tensor data section.
    pub data_offset: u64,
    /// Metadata key/values in file order.
    pub kv: Vec<(String, GgufValue)>,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
}

impl GgufInfo {
    /// Read and check `path`: it must exist, parse as GGUF, and hold all its tensor data.
    ///
    /// # Errors
    /// [`Error::ModelNotFound`], [`Error::InvalidGguf`] or [`Error::TruncatedGguf`].
    pub fn open(path: &Path) -> Result<Self> {
        backend::init();
        let meta = std::fs::metadata(path).map_err(|_| Error::ModelNotFound {
            path: path.to_path_buf(),
        })?;
        let file_size = meta.len();
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::NulByte { what: "model path" })?;
        let params = sys::gguf_init_params {
            no_alloc: true,
            ctx: std::ptr::null_mut(),
        };
        backend::take_last_problem();
        // SAFETY: `cpath` is NUL-terminated and lives across the call; with `no_alloc` and a
        // null `ctx` ggml reads only the header and returns null on any parse failure.
        let raw = unsafe { sys::gguf_init_from_file(cpath.as_ptr(), params) };
        if raw.is_null() {
            return Err(Error::InvalidGguf {
                path: path.to_path_buf(),
                reason: backend::reason_or("ggml could not parse the header"),
            });
        }
        let guard = GgufCtx(raw);
        let info = guard.read(path, file_size);
        let end = info
            .tensors
            .iter()
            .map(|t| t.offset + t.size)
            .max()
            .unwrap_or(0);
        if end > file_size {
            return Err(Error::TruncatedGguf {
                path: path.to_path_buf(),
                expected: end,
                actual: file_size,
            });
        }
        Ok(info)
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A string value by key.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        match self.get(key)? {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// `general.architecture`, e.g. `gemma3`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.size).sum()
    }
}

/// Owns a `gguf_context`.
struct GgufCtx(*mut sys::gguf_context);

impl Drop for GgufCtx {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `gguf_init_from_file` and is freed exactly once.
        unsafe { sys::gguf_free(self.0) }
    }
}

/// # Safety
/// `p` must be null or a NUL-terminated string that is valid for the duration of the call.
unsafe fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl GgufCtx {
    fn read(&self, path: &Path, file_size: u64) -> GgufInfo {
        let c = self.0;
        // SAFETY (whole block): `c` is a live gguf_context; every index passed is in
        // 0..gguf_get_n_kv / 0..gguf_get_n_tensors, and every returned string pointer is owned
        // by the context, which outlives this function's copies of them.
        unsafe {
            let data_offset = sys::gguf_get_data_offset(c) as u64;
            let mut kv = Vec::new();
            for i in 0..sys::gguf_get_n_kv(c) {
                let key = cstr(sys::gguf_get_key(c, i));
                let t = sys::gguf_get_kv_type(c, i);
                let v = match t {
                    sys::GGUF_TYPE_UINT8 => GgufValue::Int(sys::gguf_get_val_u8(c, i) as i64),
                    sys::GGUF_TYPE_INT8 => GgufValue::Int(sys::gguf_get_val_i8(c, i) as i64),
                    sys::GGUF_TYPE_UINT16 => GgufValue::Int(sys::gguf_get_val_u16(c, i) as i64),
                    sys::GGUF_TYPE_INT16 => GgufValue::Int(sys::gguf_get_val_i16(c, i) as i64),
                    sys::GGUF_TYPE_UINT32 => GgufValue::Int(sys::gguf_get_val_u32(c, i) as i64),
                    sys::GGUF_TYPE_INT32 => GgufValue::Int(sys::gguf_get_val_i32(c, i) as i64),
                    sys::GGUF_TYPE_UINT64 => GgufValue::Int(sys::gguf_get_val_u64(c, i) as i64),
                    sys::GGUF_TYPE_INT64 => GgufValue::Int(sys::gguf_get_val_i64(c, i)),
                    sys::GGUF_TYPE_FLOAT32 => GgufValue::Float(sys::gguf_get_val_f32(c, i) as f64),
                    sys::GGUF_TYPE_FLOAT64 => GgufValue::Float(sys::gguf_get_val_f64(c, i)),
                    sys::GGUF_TYPE_BOOL => GgufValue::Bool(sys::gguf_get_val_bool(c, i)),
                    sys::GGUF_TYPE_STRING => GgufValue::Str(cstr(sys::gguf_get_val_str(c, i))),
                    _ => GgufValue::Array {
                        elem: cstr(sys::gguf_type_name(sys::gguf_get_arr_type(c, i))),
                        len: sys::gguf_get_arr_n(c, i),
                    },
                };
                kv.push((key, v));
            }
            let mut tensors = Vec::new();
            for i in 0..sys::gguf_get_n_tensors(c) {
                let ne_ptr = sys::gguf_get_tensor_ne(c, i);
                let mut ne = [1i64; 4];
                if !ne_ptr.is_null() {
                    ne.copy_from_slice(std::slice::from_raw_parts(ne_ptr, 4));
                }
                tensors.push(GgufTensor {
                    name: cstr(sys::gguf_get_tensor_name(c, i)),
                    ggml_type: cstr(sys::ggml_type_name(sys::gguf_get_tensor_type(c, i))),
                    ne,
                    offset: data_offset + sys::gguf_get_tensor_offset(c, i) as u64,
                    size: sys::gguf_get_tensor_size(c, i) as u64,
                });
            }
            GgufInfo {
                path: path.to_path_buf(),
                version: sys::gguf_get_version(c),
                file_size,
                data_offset,
                kv,
                tensors,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_index_comes_from_the_name() {
        let t = |name: &str| GgufTensor {
            name: name.into(),
            ggml_type: "f32".into(),
            ne: [1; 4],
            offset: 0,
            size: 0,
        };
        assert_eq!(t("blk.17.attn_q.weight").block(), Some(17));
        assert_eq!(t("token_embd.weight").block(), None);
        assert_eq!(t("blk.x.ffn_up.weight").block(), None);
    }

    #[test]
    fn a_missing_file_is_not_found() {
        let e = GgufInfo::open(Path::new("/nonexistent/leap/model.gguf")).unwrap_err();
        assert!(matches!(e, Error::ModelNotFound { .. }));
    }
}
