//! Hand-written declarations of the QNN C API subset Leap uses (LP64: x86-64 and aarch64).
//!
//! There are no Qualcomm headers in this repository. The layouts below are transcribed from
//! the public API reference and measured against the x86-64 `libQnnHtp.so` of the
//! `onnxruntime-qnn` 2.7.0 wheel (core API 2.40; `../shared/notes/qnn_x86_probe.md` §8).
//! The compile-time asserts pin every size and offset that library was seen to read; the API is
//! only source-compatible across 2.x, so [`crate::library`] checks the version a library
//! reports before any slot of its table is used.

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

/// `Qnn_ErrorHandle_t`: the error code is in the low 16 bits.
pub type ErrorHandle = u64;
/// Any QNN handle (backend, device, context, graph, log, profile, signal).
pub type Handle = *mut c_void;

/// `Qnn_Version_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The fixed head of `QnnInterface_t`; the function table follows at byte 40.
#[repr(C)]
pub struct InterfaceHead {
    pub backend_id: u32,
    pub provider_name: *const c_char,
    pub core_api: Version,
    pub backend_api: Version,
}
/// Byte offset of the function table in `QnnInterface_t`.
pub const INTERFACE_TABLE_OFFSET: usize = 40;

/// The fixed head of `QnnSystemInterface_t`; its table follows at byte 32.
#[repr(C)]
pub struct SystemInterfaceHead {
    pub backend_id: u32,
    pub provider_name: *const c_char,
    pub system_api: Version,
}
/// Byte offset of the function table in `QnnSystemInterface_t`.
pub const SYSTEM_TABLE_OFFSET: usize = 32;

/// `QnnInterface_getProviders` / `QnnSystemInterface_getProviders`.
pub type GetProvidersFn =
    unsafe extern "C" fn(providers: *mut *const *const c_void, n: *mut u32) -> ErrorHandle;

/// Slot indices (8 bytes each) of the modern core-API 2.x table (`qnn_opencl.md` §1.2).
pub mod slot {
    pub const BACKEND_CREATE: usize = 1;
    pub const BACKEND_GET_API_VERSION: usize = 3;
    pub const BACKEND_GET_BUILD_ID: usize = 4;
    pub const BACKEND_VALIDATE_OP_CONFIG: usize = 7;
    pub const BACKEND_FREE: usize = 8;
    pub const CONTEXT_CREATE: usize = 9;
    pub const CONTEXT_GET_BINARY_SIZE: usize = 11;
    pub const CONTEXT_GET_BINARY: usize = 12;
    pub const CONTEXT_CREATE_FROM_BINARY: usize = 13;
    pub const CONTEXT_FREE: usize = 14;
    pub const GRAPH_CREATE: usize = 15;
    pub const GRAPH_ADD_NODE: usize = 18;
    pub const GRAPH_FINALIZE: usize = 19;
    pub const GRAPH_RETRIEVE: usize = 20;
    pub const GRAPH_EXECUTE: usize = 21;
    pub const TENSOR_CREATE_GRAPH_TENSOR: usize = 24;
    pub const LOG_CREATE: usize = 25;
    pub const LOG_FREE: usize = 27;
    pub const DEVICE_CREATE: usize = 40;
    pub const DEVICE_FREE: usize = 43;
    /// Slots Leap reads; a table is only read up to here.
    pub const COUNT: usize = 44;

    /// System table: systemContextCreate, systemContextGetBinaryInfo, -, systemContextFree.
    pub const SYSTEM_CONTEXT_CREATE: usize = 0;
    pub const SYSTEM_CONTEXT_GET_BINARY_INFO: usize = 1;
    pub const SYSTEM_CONTEXT_FREE: usize = 3;
    pub const SYSTEM_COUNT: usize = 4;
}

// Data types (`Qnn_DataType_t`).
pub const DATATYPE_FLOAT_32: u32 = 0x0232;
pub const DATATYPE_FLOAT_16: u32 = 0x0216;
pub const DATATYPE_SFIXED_POINT_8: u32 = 0x0308;
pub const DATATYPE_UFIXED_POINT_8: u32 = 0x0408;
pub const DATATYPE_UFIXED_POINT_16: u32 = 0x0416;
pub const DATATYPE_BOOL_8: u32 = 0x0508;

// Tensor types (`Qnn_TensorType_t`).
pub const TENSOR_TYPE_APP_WRITE: u32 = 0;
pub const TENSOR_TYPE_APP_READ: u32 = 1;
pub const TENSOR_TYPE_NATIVE: u32 = 3;
pub const TENSOR_TYPE_STATIC: u32 = 4;

pub const TENSOR_VERSION_2: u32 = 2;
pub const TENSOR_DATA_FORMAT_DENSE: u32 = 0;
pub const TENSOR_MEMTYPE_RAW: u32 = 0;
pub const DEFINITION_DEFINED: u32 = 1;
pub const UNDEFINED: u32 = 0x7FFF_FFFF;
pub const QUANTIZATION_ENCODING_SCALE_OFFSET: u32 = 0;
pub const OPCONFIG_VERSION_1: u32 = 1;
pub const PARAMTYPE_SCALAR: u32 = 0;

// Log levels (`QnnLog_Level_t`).
pub const LOG_LEVEL_ERROR: u32 = 1;
pub const LOG_LEVEL_WARN: u32 = 2;
pub const LOG_LEVEL_INFO: u32 = 3;
pub const LOG_LEVEL_VERBOSE: u32 = 4;

/// `Qnn_ScaleOffset_t`: `real = (q + offset) * scale`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScaleOffset {
    pub scale: f32,
    pub offset: i32,
}

/// The encoding union of `Qnn_QuantizeParams_t` (32 bytes, pointer-aligned).
#[repr(C)]
#[derive(Clone, Copy)]
pub union QuantEncoding {
    pub scale_offset: ScaleOffset,
    pub pad: [u64; 4],
}

/// `Qnn_QuantizeParams_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QuantizeParams {
    pub encoding_definition: u32,
    pub quantization_encoding: u32,
    pub encoding: QuantEncoding,
}

/// `Qnn_ClientBuffer_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ClientBuffer {
    pub data: *mut c_void,
    pub data_size: u32,
}

/// The memory union of a tensor.
#[repr(C)]
#[derive(Clone, Copy)]
pub union TensorMem {
    pub client_buf: ClientBuffer,
    pub mem_handle: Handle,
}

/// `Qnn_SparseParams_t` (unused: `kind = UNDEFINED`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SparseParams {
    pub kind: u32,
    pub a: u32,
    pub b: u32,
}

/// `Qnn_TensorV2_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorV2 {
    pub id: u32,
    pub name: *const c_char,
    pub tensor_type: u32,
    pub data_format: u32,
    pub data_type: u32,
    pub quantize_params: QuantizeParams,
    pub rank: u32,
    pub dimensions: *mut u32,
    pub mem_type: u32,
    pub mem: TensorMem,
    pub is_dynamic_dimensions: *mut u8,
    pub sparse_params: SparseParams,
    pub is_produced: u8,
}

/// `Qnn_Tensor_t` (version 2; the union is sized by V2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Tensor {
    pub version: u32,
    pub v2: TensorV2,
}

/// The value union of `Qnn_Scalar_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ScalarValue {
    pub bool8: u8,
    pub u32: u32,
    pub f32: f32,
    pub u64: u64,
}

/// `Qnn_Scalar_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Scalar {
    pub data_type: u32,
    pub value: ScalarValue,
}

/// The payload union of `Qnn_Param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ParamValue {
    pub scalar: Scalar,
    pub tensor: Tensor,
}

/// `Qnn_Param_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Param {
    pub param_type: u32,
    pub name: *const c_char,
    pub value: ParamValue,
}

/// `Qnn_OpConfigV1_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OpConfigV1 {
    pub name: *const c_char,
    pub package_name: *const c_char,
    pub type_name: *const c_char,
    pub num_params: u32,
    pub params: *mut Param,
    pub num_inputs: u32,
    pub inputs: *mut Tensor,
    pub num_outputs: u32,
    pub outputs: *mut Tensor,
}

/// `Qnn_OpConfig_t` (passed by value to backendValidateOpConfig and graphAddNode).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OpConfig {
    pub version: u32,
    pub v1: OpConfigV1,
}

/// `QnnDevice_Config_t` with option CUSTOM (0).
#[repr(C)]
pub struct DeviceConfig {
    pub option: u32,
    pub custom: *const c_void,
}

/// `QnnHtpDevice_CustomConfig_t`: option SOC (0); the union is at byte 8 from API 2.40 on
/// (it was at 4 in API-2.32-era copies; the probe measured the difference).
#[repr(C)]
pub struct HtpDeviceCustomConfig {
    pub option: u32,
    pub _pad: u32,
    /// The first member of the union (at byte 8).
    pub soc_model: u32,
    pub _rest: u32,
}
pub const HTP_DEVICE_CONFIG_OPTION_SOC: u32 = 0;

/// `QnnSystemContext_BinaryInfo_t`: a version, then (at byte 8) a union whose V1..V3 members
/// share the prefix Leap reads ([`BinaryInfoPrefix`]).
#[repr(C)]
pub struct BinaryInfo {
    pub version: u32,
    pub info: BinaryInfoPrefix,
}

/// The prefix shared by binary-info versions 1 to 3.
#[repr(C)]
pub struct BinaryInfoPrefix {
    pub backend_id: u32,
    pub build_id: *const c_char,
    pub core_api: Version,
    pub backend_api: Version,
    pub soc_version: *const c_char,
    pub context_blob_version: Version,
    pub context_blob_size: u64,
    pub num_context_tensors: u32,
    pub context_tensors: *const Tensor,
    pub num_graphs: u32,
    /// `QnnSystemContext_GraphInfo_t*`; its element size differs by version, so Leap only
    /// reads the first element.
    pub graphs: *const GraphInfo,
}

/// `QnnSystemContext_GraphInfo_t`: a version, then the V1 prefix (shared by V1..V3) at byte 8.
#[repr(C)]
pub struct GraphInfo {
    pub version: u32,
    pub name: *const c_char,
    pub num_inputs: u32,
    pub inputs: *const Tensor,
    pub num_outputs: u32,
    pub outputs: *const Tensor,
}

// Layouts measured on the 2.40 library (probe §8-§9).
const _: () = {
    assert!(size_of::<Version>() == 12);
    assert!(size_of::<InterfaceHead>() == INTERFACE_TABLE_OFFSET);
    assert!(size_of::<SystemInterfaceHead>() == SYSTEM_TABLE_OFFSET);
    assert!(size_of::<QuantizeParams>() == 40);
    assert!(size_of::<TensorV2>() == 136);
    assert!(offset_of!(TensorV2, quantize_params) == 32);
    assert!(offset_of!(TensorV2, rank) == 72);
    assert!(offset_of!(TensorV2, dimensions) == 80);
    assert!(offset_of!(TensorV2, mem_type) == 88);
    assert!(offset_of!(TensorV2, mem) == 96);
    assert!(offset_of!(TensorV2, is_dynamic_dimensions) == 112);
    assert!(offset_of!(TensorV2, sparse_params) == 120);
    assert!(offset_of!(TensorV2, is_produced) == 132);
    assert!(size_of::<Tensor>() == 144);
    assert!(offset_of!(Tensor, v2) == 8);
    assert!(size_of::<Scalar>() == 16);
    assert!(size_of::<Param>() == 160);
    assert!(size_of::<OpConfigV1>() == 72);
    assert!(size_of::<OpConfig>() == 80);
    assert!(size_of::<DeviceConfig>() == 16);
    assert!(size_of::<HtpDeviceCustomConfig>() == 16);
    assert!(offset_of!(HtpDeviceCustomConfig, soc_model) == 8);
    assert!(offset_of!(BinaryInfo, info) == 8);
    assert!(offset_of!(BinaryInfoPrefix, num_graphs) == 88);
    assert!(offset_of!(BinaryInfoPrefix, graphs) == 96);
    assert!(offset_of!(GraphInfo, name) == 8);
};

/// A log callback with QNN's signature; the C shim implements it.
pub type LogCallback = unsafe extern "C" fn(*const c_char, u32, u64, *mut c_void);

extern "C" {
    /// Defined in `shim/log.c`.
    pub fn leap_qnn_log_callback(fmt: *const c_char, level: u32, timestamp: u64, args: *mut c_void);
    /// Defined in `shim/log.c`: where formatted messages go.
    pub fn leap_qnn_set_log_sink(sink: Option<unsafe extern "C" fn(u32, *const c_char)>);
}
