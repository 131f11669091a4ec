//! One error type for the crate; every QNN status goes through [`check`].

use crate::ffi::{ErrorHandle, Version};
use std::path::PathBuf;

/// A QNN status code (`Qnn_ErrorHandle_t & 0xFFFF`), with names for the codes seen in practice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    /// The code's name from QnnCommon.h and the per-component headers, if Leap knows it.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "QNN_SUCCESS",
            1000 => "QNN_COMMON_ERROR_NOT_SUPPORTED",
            1002 => "QNN_COMMON_ERROR_MEM_ALLOC",
            1003 => "QNN_COMMON_ERROR_SYSTEM",
            1004 => "QNN_COMMON_ERROR_INVALID_ARGUMENT",
            1005 => "QNN_COMMON_ERROR_OPERATION_NOT_PERMITTED",
            1006 => "QNN_COMMON_ERROR_PLATFORM_NOT_SUPPORTED",
            1007 => "QNN_COMMON_ERROR_SYSTEM_COMMUNICATION",
            1008 => "QNN_COMMON_ERROR_INCOMPATIBLE_BINARIES",
            1009 => "QNN_COMMON_ERROR_LOADING_BINARIES",
            1010 => "QNN_COMMON_ERROR_RESOURCE_UNAVAILABLE",
            1011 => "QNN_COMMON_ERROR_SYSTEM_COMMUNICATION_FATAL",
            1100 => "QNN_COMMON_ERROR_GENERAL",
            3110 => "QNN_OP_PACKAGE_ERROR_VALIDATION_FAILURE",
            4000 => "QNN_BACKEND_ERROR_CANNOT_INITIALIZE",
            4002 => "QNN_BACKEND_ERROR_TERMINATE_FAILED",
            4003 => "QNN_BACKEND_ERROR_NOT_SUPPORTED",
            4004 => "QNN_BACKEND_ERROR_INVALID_ARGUMENT",
            4005 => "QNN_BACKEND_ERROR_OP_PACKAGE_NOT_FOUND",
            4012 => "QNN_BACKEND_ERROR_INVALID_CONFIG",
            5007 => "QNN_CONTEXT_ERROR_GET_BINARY_FAILED",
            6000 => "QNN_GRAPH_ERROR_INVALID_ARGUMENT",
            6001 => "QNN_GRAPH_ERROR_INVALID_HANDLE",
            6002 => "QNN_GRAPH_ERROR_GRAPH_DOES_NOT_EXIST",
            6003 => "QNN_GRAPH_ERROR_INVALID_NAME",
            6004 => "QNN_GRAPH_ERROR_INVALID_TENSOR",
            6023 => "QNN_GRAPH_ERROR_GRAPH_NOT_FINALIZED",
            7003 => "QNN_TENSOR_ERROR_ALREADY_EXISTS",
            14001 => "QNN_DEVICE_ERROR_INVALID_CONFIG",
            30010 => "QNN_SYSTEM_CONTEXT_ERROR (context blob rejected)",
            _ => return None,
        })
    }

    /// The API component a code belongs to (QnnCommon.h ranges).
    pub fn component(self) -> &'static str {
        match self.0 {
            1000..=1999 => "common",
            2000..=2999 => "property",
            3000..=3999 => "op package",
            4000..=4999 => "backend",
            5000..=5999 => "context",
            6000..=6999 => "graph",
            7000..=7999 => "tensor",
            8000..=8999 => "memory",
            9000..=9999 => "signal",
            10000..=10999 => "error",
            11000..=11999 => "log",
            12000..=12999 => "profile",
            13000..=13999 => "performance infrastructure",
            14000..=14999 => "device",
            30000..=49999 => "system",
            60000..=60999 => "interface",
            _ => "unknown",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{} ({name})", self.0),
            None => write!(f, "{} ({} error)", self.0, self.component()),
        }
    }
}

/// What went wrong with the QNN device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no {file} in {dirs:?}; run scripts/fetch-qnn (or pass --lib-dir / set LEAP_QNN_LIB_DIR)"
    )]
    LibraryNotFound { file: String, dirs: Vec<PathBuf> },
    #[error("cannot load {path}: {source}")]
    Load {
        path: PathBuf,
        source: libloading::Error,
    },
    #[error("{path} is not a QNN library: it does not export {symbol}")]
    NotQnn { path: PathBuf, symbol: &'static str },
    #[error("{path} lists no QNN interface provider")]
    NoProvider { path: PathBuf },
    #[error(
        "{path}: provider {provider} reports core API {found}; Leap supports {major}.x from {major}.{min_minor}"
    )]
    UnsupportedApi {
        path: PathBuf,
        provider: String,
        found: Version,
        major: u32,
        min_minor: u32,
    },
    #[error("{path}: the QNN function {slot} is missing from the interface table")]
    MissingFunction { path: PathBuf, slot: &'static str },
    #[error("QNN {call} failed: {status}")]
    Status { call: &'static str, status: Status },
    #[error(
        "tensor {tensor}: buffer of {got} bytes, the graph needs {expected} ({dims:?} x {dtype})"
    )]
    BufferSize {
        tensor: String,
        dims: Vec<u32>,
        dtype: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("graph {graph} takes {expected} {what}, got {got}")]
    TensorCount {
        graph: String,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("name {0:?} contains a NUL byte")]
    Name(String),
    #[error("{0}")]
    Shape(&'static str),
    #[error("context binary: {0}")]
    Binary(&'static str),
    #[error("context binary {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Turn a QNN return value into `Ok` or a typed [`Error::Status`] naming the call.
pub fn check(call: &'static str, err: ErrorHandle) -> Result<()> {
    let code = (err & 0xFFFF) as u32;
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Status {
            call,
            status: Status(code),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_named_and_low_bits_count() {
        assert!(check("x", 0).is_ok());
        // High bits carry backend-specific data; only the low 16 are the code.
        assert!(check("x", 0x1234_0000).is_ok());
        let err = check("graphExecute", 6004).unwrap_err();
        assert!(matches!(
            err,
            Error::Status {
                status: Status(6004),
                ..
            }
        ));
        assert_eq!(
            err.to_string(),
            "QNN graphExecute failed: 6004 (QNN_GRAPH_ERROR_INVALID_TENSOR)"
        );
        assert_eq!(Status(14999).to_string(), "14999 (device error)");
    }
}
