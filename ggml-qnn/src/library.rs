//! Finding, loading and version-checking the QNN libraries.
//!
//! The backend library (`libQnnHtp.so`) and the system library (`libQnnSystem.so`) are opened
//! with `RTLD_NOW | RTLD_LOCAL`; [`Api`] keeps each library alive next to the function table
//! it produced. The provider list is walked and the first provider whose core API is
//! `2.x` with `x >= CORE_API_MIN_MINOR` is taken; its version is checked before a single slot
//! of its table is read, and only the slots Leap declares in [`crate::ffi::slot`] are read.

use crate::error::{check, Error, Result};
use crate::ffi::{self, slot, ErrorHandle, Handle, Version};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The core API major version Leap's declarations follow.
pub const CORE_API_MAJOR: u32 = 2;
/// The oldest core API minor with the table and `Qnn_TensorV2_t` layouts Leap declares.
pub const CORE_API_MIN_MINOR: u32 = 14;
/// The newest core API Leap was tested against (the onnxruntime-qnn 2.7.0 wheel).
pub const CORE_API_TESTED: Version = Version {
    major: 2,
    minor: 40,
    patch: 0,
};
/// The system API major version Leap's binary-info declarations follow.
pub const SYSTEM_API_MAJOR: u32 = 1;
/// `QNN_BACKEND_ID_HTP`.
pub const BACKEND_ID_HTP: u32 = 6;
/// The backend library Leap uses.
pub const HTP_LIBRARY: &str = "libQnnHtp.so";
/// The system library (context-binary introspection).
pub const SYSTEM_LIBRARY: &str = "libQnnSystem.so";
/// Environment variable naming the directory of the QNN libraries.
pub const LIB_DIR_ENV: &str = "LEAP_QNN_LIB_DIR";

/// Where `scripts/fetch-qnn` puts the wheel's libraries:
/// `$LEAP_QNN_CACHE` or `~/.cache/leap/qnn`, then `onnxruntime-qnn-2.7.0`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("LEAP_QNN_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => dirs::cache_dir()?.join("leap").join("qnn"),
    };
    Some(base.join("onnxruntime-qnn-2.7.0"))
}

/// The directories searched, in order: `explicit` (`--lib-dir`), `$LEAP_QNN_LIB_DIR`, the cache.
pub fn search_dirs(explicit: Option<&Path>) -> Vec<PathBuf> {
    if let Some(dir) = explicit {
        return vec![dir.to_path_buf()];
    }
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os(LIB_DIR_ENV) {
        dirs.push(PathBuf::from(dir));
    }
    dirs.extend(cache_dir());
    dirs
}

/// The first `dirs` entry holding `file`.
///
/// # Errors
/// [`Error::LibraryNotFound`] naming the directories searched.
pub fn find_library(dirs: &[PathBuf], file: &str) -> Result<PathBuf> {
    dirs.iter()
        .map(|d| d.join(file))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::LibraryNotFound {
            file: file.to_string(),
            dirs: dirs.to_vec(),
        })
}

fn open(path: &Path) -> Result<libloading::Library> {
    // SAFETY: loading a library runs its initialisers; the QNN libraries' are the vendor's
    // ordinary C++ static constructors (measured: no side effects beyond one stderr line).
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL,
        )
    }
    .map_err(|source| Error::Load {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(lib.into())
}

/// Call a `*_getProviders` function and return the provider pointers.
fn providers(
    lib: &libloading::Library,
    path: &Path,
    symbol: &'static str,
) -> Result<Vec<*const u8>> {
    // SAFETY: the symbol, when present, has the `QnnInterface_getProviders` signature in every
    // QNN library (public API); its type is declared in `ffi::GetProvidersFn`.
    let get: libloading::Symbol<ffi::GetProvidersFn> = unsafe { lib.get(symbol.as_bytes()) }
        .map_err(|_| Error::NotQnn {
            path: path.to_path_buf(),
            symbol,
        })?;
    let mut list: *const *const c_void = std::ptr::null();
    let mut n = 0u32;
    // SAFETY: both out-pointers are valid; the library owns the returned list for its lifetime.
    check(symbol, unsafe { get(&mut list, &mut n) })?;
    if list.is_null() || n == 0 {
        return Err(Error::NoProvider {
            path: path.to_path_buf(),
        });
    }
    // SAFETY: the library returned `n` provider pointers at `list`.
    Ok((0..n as usize)
        .map(|i| unsafe { *list.add(i) }.cast::<u8>())
        .filter(|p| !p.is_null())
        .collect())
}

/// # Safety
/// `table` points to at least `index + 1` readable function-pointer slots.
unsafe fn read_slot<F: Copy>(
    table: *const *const c_void,
    index: usize,
    name: &'static str,
    path: &Path,
) -> Result<F> {
    let ptr = *table.add(index);
    if ptr.is_null() {
        return Err(Error::MissingFunction {
            path: path.to_path_buf(),
            slot: name,
        });
    }
    debug_assert_eq!(
        std::mem::size_of::<F>(),
        std::mem::size_of::<*const c_void>()
    );
    Ok(std::mem::transmute_copy::<*const c_void, F>(&ptr))
}

unsafe fn c_string(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

macro_rules! table {
    ($(#[$doc:meta])* $name:ident { $($field:ident : $index:expr => fn($($arg:ty),*);)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        #[allow(missing_docs)]
        pub struct $name {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> ErrorHandle,)*
        }
        impl $name {
            /// # Safety
            /// `table` is a QNN function table of a version whose slots match the indices.
            unsafe fn read(table: *const *const c_void, path: &Path) -> Result<Self> {
                Ok(Self { $($field: read_slot(table, $index, stringify!($field), path)?,)* })
            }
        }
    };
}

table! {
    /// The core-API functions Leap calls (`QNN_INTERFACE_VER_TYPE`, modern 2.x order).
    Fns {
        backend_create: slot::BACKEND_CREATE => fn(Handle, *const *const c_void, *mut Handle);
        backend_get_build_id: slot::BACKEND_GET_BUILD_ID => fn(*mut *const c_char);
        backend_validate_op_config: slot::BACKEND_VALIDATE_OP_CONFIG => fn(Handle, ffi::OpConfig);
        backend_free: slot::BACKEND_FREE => fn(Handle);
        context_create: slot::CONTEXT_CREATE => fn(Handle, Handle, *const *const c_void, *mut Handle);
        context_get_binary_size: slot::CONTEXT_GET_BINARY_SIZE => fn(Handle, *mut u64);
        context_get_binary: slot::CONTEXT_GET_BINARY => fn(Handle, *mut c_void, u64, *mut u64);
        context_create_from_binary: slot::CONTEXT_CREATE_FROM_BINARY =>
            fn(Handle, Handle, *const *const c_void, *const c_void, u64, *mut Handle, Handle);
        context_free: slot::CONTEXT_FREE => fn(Handle, Handle);
        graph_create: slot::GRAPH_CREATE => fn(Handle, *const c_char, *const *const c_void, *mut Handle);
        graph_add_node: slot::GRAPH_ADD_NODE => fn(Handle, ffi::OpConfig);
        graph_finalize: slot::GRAPH_FINALIZE => fn(Handle, Handle, Handle);
        graph_retrieve: slot::GRAPH_RETRIEVE => fn(Handle, *const c_char, *mut Handle);
        graph_execute: slot::GRAPH_EXECUTE =>
            fn(Handle, *const ffi::Tensor, u32, *mut ffi::Tensor, u32, Handle, Handle);
        tensor_create_graph_tensor: slot::TENSOR_CREATE_GRAPH_TENSOR => fn(Handle, *mut ffi::Tensor);
        log_create: slot::LOG_CREATE => fn(ffi::LogCallback, u32, *mut Handle);
        log_free: slot::LOG_FREE => fn(Handle);
        device_create: slot::DEVICE_CREATE => fn(Handle, *const *const c_void, *mut Handle);
        device_free: slot::DEVICE_FREE => fn(Handle);
    }
}

table! {
    /// The system-API functions Leap calls (context-binary introspection).
    SystemFns {
        context_create: slot::SYSTEM_CONTEXT_CREATE => fn(*mut Handle);
        context_get_binary_info: slot::SYSTEM_CONTEXT_GET_BINARY_INFO =>
            fn(Handle, *mut c_void, u64, *mut *const ffi::BinaryInfo, *mut u64);
        context_free: slot::SYSTEM_CONTEXT_FREE => fn(Handle);
    }
}

/// A loaded QNN backend library and its version-checked function table.
pub struct Api {
    pub fns: Fns,
    pub path: PathBuf,
    pub provider: String,
    pub backend_id: u32,
    pub core_api: Version,
    pub backend_api: Version,
    pub system: Option<SystemApi>,
    // Declared last: dropped after everything that may call into it.
    _lib: libloading::Library,
}

/// The loaded system library.
pub struct SystemApi {
    pub fns: SystemFns,
    pub path: PathBuf,
    pub system_api: Version,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("path", &self.path)
            .field("provider", &self.provider)
            .field("core_api", &self.core_api)
            .field("backend_api", &self.backend_api)
            .finish()
    }
}

impl Api {
    /// Load `libQnnHtp.so` (and `libQnnSystem.so` when present) from the first directory of
    /// [`search_dirs`]`(lib_dir)` that has it.
    ///
    /// # Errors
    /// A missing library, a library that is not QNN, or a core API outside `2.14..`.
    pub fn load(lib_dir: Option<&Path>) -> Result<Arc<Api>> {
        let dirs = search_dirs(lib_dir);
        let path = find_library(&dirs, HTP_LIBRARY)?;
        let mut api = Self::open_backend(&path)?;
        if let Some(dir) = path.parent() {
            let system = dir.join(SYSTEM_LIBRARY);
            if system.is_file() {
                match SystemApi::open(&system) {
                    Ok(s) => api.system = Some(s),
                    Err(e) => log::warn!(
                        "QNN system library unusable, no context-binary introspection: {e}"
                    ),
                }
            }
        }
        Ok(Arc::new(api))
    }

    /// Open one backend library and negotiate its provider.
    ///
    /// # Errors
    /// [`Error::Load`], [`Error::NotQnn`], [`Error::NoProvider`], [`Error::UnsupportedApi`],
    /// [`Error::MissingFunction`].
    pub fn open_backend(path: &Path) -> Result<Api> {
        let lib = open(path)?;
        let list = providers(&lib, path, "QnnInterface_getProviders")?;
        let mut first = None;
        for p in list {
            // SAFETY: every provider starts with the `QnnInterface_t` head (stable across 2.x).
            let head = unsafe { &*p.cast::<ffi::InterfaceHead>() };
            // SAFETY: a NUL-terminated name or NULL.
            let provider = unsafe { c_string(head.provider_name) };
            let core = head.core_api;
            if core.major == CORE_API_MAJOR && core.minor >= CORE_API_MIN_MINOR {
                if core.minor > CORE_API_TESTED.minor {
                    log::warn!(
                        "{}: QNN core API {core} is newer than the {CORE_API_TESTED} Leap was tested with",
                        path.display()
                    );
                }
                // SAFETY: the version is in the supported range, whose tables have at least
                // `slot::COUNT` slots at byte 40 in this order.
                let fns = unsafe { Fns::read(p.add(ffi::INTERFACE_TABLE_OFFSET).cast(), path)? };
                return Ok(Api {
                    fns,
                    path: path.to_path_buf(),
                    provider,
                    backend_id: head.backend_id,
                    core_api: core,
                    backend_api: head.backend_api,
                    system: None,
                    _lib: lib,
                });
            }
            first.get_or_insert((provider, core));
        }
        let (provider, found) = first.unwrap_or_default();
        Err(Error::UnsupportedApi {
            path: path.to_path_buf(),
            provider,
            found,
            major: CORE_API_MAJOR,
            min_minor: CORE_API_MIN_MINOR,
        })
    }

    /// The backend's build id (`backendGetBuildId`), e.g. `v2.51.0.260929181845`.
    pub fn build_id(&self) -> Option<String> {
        let mut id: *const c_char = std::ptr::null();
        // SAFETY: one valid out-pointer; the library owns the string.
        let ok = check("backendGetBuildId", unsafe {
            (self.fns.backend_get_build_id)(&mut id)
        });
        // SAFETY: a NUL-terminated string or NULL.
        ok.ok().map(|_| unsafe { c_string(id) })
    }

    /// Whether the HTP device custom config (SoC model) may be passed: its union moved between
    /// API versions, so only the tested minor is trusted.
    pub fn htp_device_config_supported(&self) -> bool {
        self.backend_id == BACKEND_ID_HTP
            && self.core_api.major == CORE_API_TESTED.major
            && self.core_api.minor == CORE_API_TESTED.minor
    }
}

impl SystemApi {
    /// Open `libQnnSystem.so` and check its system API major version.
    ///
    /// # Errors
    /// As [`Api::open_backend`].
    pub fn open(path: &Path) -> Result<SystemApi> {
        let lib = open(path)?;
        let list = providers(&lib, path, "QnnSystemInterface_getProviders")?;
        let mut found = Version::default();
        for p in list {
            // SAFETY: every system provider starts with the `QnnSystemInterface_t` head.
            let head = unsafe { &*p.cast::<ffi::SystemInterfaceHead>() };
            if head.system_api.major == SYSTEM_API_MAJOR {
                // SAFETY: system API 1.x tables have at least `SYSTEM_COUNT` slots at byte 32.
                let fns = unsafe { SystemFns::read(p.add(ffi::SYSTEM_TABLE_OFFSET).cast(), path)? };
                return Ok(SystemApi {
                    fns,
                    path: path.to_path_buf(),
                    system_api: head.system_api,
                    _lib: lib,
                });
            }
            found = head.system_api;
        }
        Err(Error::UnsupportedApi {
            path: path.to_path_buf(),
            provider: "system".into(),
            found,
            major: SYSTEM_API_MAJOR,
            min_minor: 0,
        })
    }
}

// SAFETY: the function table is plain data and the library stays loaded while `Api` lives; the
// QNN HTP library was measured to accept calls from several threads (probe §7).
unsafe impl Send for Api {}
// SAFETY: as above; `Api` has no interior mutability.
unsafe impl Sync for Api {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_dir_wins_and_missing_library_is_typed() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            search_dirs(Some(dir.path())),
            vec![dir.path().to_path_buf()]
        );
        let err = Api::load(Some(dir.path())).unwrap_err();
        assert!(matches!(err, Error::LibraryNotFound { ref file, .. } if file == HTP_LIBRARY));
        assert!(err.to_string().contains("scripts/fetch-qnn"));
    }

    #[test]
    fn a_library_that_is_not_qnn_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        // Any shared object without the QNN entry point: the unwinder library every Rust
        // program built for glibc has mapped (found where it is, on any architecture).
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let lib = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.ends_with("/libgcc_s.so.1"))
            .expect("libgcc_s.so.1 is mapped into this test");
        std::fs::copy(lib, dir.path().join(HTP_LIBRARY)).unwrap();
        let err = Api::load(Some(dir.path())).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotQnn {
                    symbol: "QnnInterface_getProviders",
                    ..
                }
            ),
            "{err}"
        );
    }
}
