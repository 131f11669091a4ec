//! Tensor descriptions (pure): data types, quantization, sizes; and their raw QNN form.

use crate::error::{Error, Result};
use crate::ffi;
use std::ffi::CString;

/// The QNN data types Leap uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    F32,
    F16,
    /// Signed 8-bit fixed point: `real = (q + offset) * scale`.
    SFixed8,
    /// Unsigned 8-bit fixed point.
    UFixed8,
    /// Unsigned 16-bit fixed point.
    UFixed16,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F32 => 4,
            DataType::F16 | DataType::UFixed16 => 2,
            DataType::SFixed8 | DataType::UFixed8 => 1,
        }
    }

    /// Whether the type carries scale/offset quantization.
    pub fn is_quantized(self) -> bool {
        matches!(
            self,
            DataType::SFixed8 | DataType::UFixed8 | DataType::UFixed16
        )
    }

    /// The short name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::SFixed8 => "sfixed8",
            DataType::UFixed8 => "ufixed8",
            DataType::UFixed16 => "ufixed16",
        }
    }

    pub(crate) fn raw(self) -> u32 {
        match self {
            DataType::F32 => ffi::DATATYPE_FLOAT_32,
            DataType::F16 => ffi::DATATYPE_FLOAT_16,
            DataType::SFixed8 => ffi::DATATYPE_SFIXED_POINT_8,
            DataType::UFixed8 => ffi::DATATYPE_UFIXED_POINT_8,
            DataType::UFixed16 => ffi::DATATYPE_UFIXED_POINT_16,
        }
    }
}

/// Per-tensor linear quantization, QNN's convention: `real = (q + offset) * scale`
/// (so `offset` is minus the zero point).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quant {
    pub scale: f32,
    pub offset: i32,
}

impl Quant {
    /// Symmetric int8 stored as `UFIXED_POINT_8`: `u = i + 128`, offset -128.
    pub fn symmetric_u8(scale: f32) -> Quant {
        Quant {
            scale,
            offset: -128,
        }
    }

    /// Symmetric 16-bit stored as `UFIXED_POINT_16`: offset -32768.
    pub fn symmetric_u16(scale: f32) -> Quant {
        Quant {
            scale,
            offset: -32768,
        }
    }

    /// The real value of the stored integer `q`.
    pub fn dequantize(self, q: i64) -> f32 {
        ((q + self.offset as i64) as f64 * self.scale as f64) as f32
    }
}

/// How the graph uses a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A graph input the application writes at execute.
    Input,
    /// A graph output the application reads at execute.
    Output,
    /// An intermediate the backend owns.
    Native,
    /// Constant data baked into the graph at creation.
    Static,
}

impl Role {
    fn raw(self) -> u32 {
        match self {
            Role::Input => ffi::TENSOR_TYPE_APP_WRITE,
            Role::Output => ffi::TENSOR_TYPE_APP_READ,
            Role::Native => ffi::TENSOR_TYPE_NATIVE,
            Role::Static => ffi::TENSOR_TYPE_STATIC,
        }
    }
}

/// A tensor of a static-shape graph: what Leap needs to create it and to size-check buffers.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub role: Role,
    pub dtype: DataType,
    pub dims: Vec<u32>,
    pub quant: Option<Quant>,
    /// Assigned by the backend (tensorCreateGraphTensor, or a context binary's info).
    pub id: u32,
}

impl TensorSpec {
    /// A tensor; quantized types need [`TensorSpec::quantized`].
    pub fn new(name: &str, role: Role, dtype: DataType, dims: &[u32]) -> TensorSpec {
        TensorSpec {
            name: name.to_string(),
            role,
            dtype,
            dims: dims.to_vec(),
            quant: None,
            id: 0,
        }
    }

    /// The same tensor with quantization parameters.
    pub fn quantized(mut self, quant: Quant) -> TensorSpec {
        self.quant = Some(quant);
        self
    }

    /// Elements in the tensor.
    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Bytes a buffer for this tensor must have.
    pub fn bytes(&self) -> usize {
        self.elements() * self.dtype.size()
    }

    /// Check that a buffer is exactly this tensor's size. QNN's graphExecute does not check
    /// `dataSize`, and an undersized buffer crashes the process (probe §7), so every buffer
    /// goes through here first.
    ///
    /// # Errors
    /// [`Error::BufferSize`].
    pub fn check_buffer(&self, len: usize) -> Result<()> {
        let expected = self.bytes();
        if len == expected && u32::try_from(len).is_ok() {
            Ok(())
        } else {
            Err(Error::BufferSize {
                tensor: self.name.clone(),
                dims: self.dims.clone(),
                dtype: self.dtype.name(),
                expected,
                got: len,
            })
        }
    }
}

/// A [`TensorSpec`] in QNN's form, with the C strings it points into kept alive.
pub(crate) struct RawTensor {
    pub raw: ffi::Tensor,
    _name: CString,
    _dims: Box<[u32]>,
}

impl RawTensor {
    /// # Errors
    /// [`Error::Name`] for a name with a NUL byte.
    pub fn new(spec: &TensorSpec) -> Result<RawTensor> {
        let name = CString::new(spec.name.as_str()).map_err(|_| Error::Name(spec.name.clone()))?;
        let mut dims: Box<[u32]> = spec.dims.clone().into_boxed_slice();
        let quantize_params = match spec.quant {
            Some(q) => ffi::QuantizeParams {
                encoding_definition: ffi::DEFINITION_DEFINED,
                quantization_encoding: ffi::QUANTIZATION_ENCODING_SCALE_OFFSET,
                encoding: ffi::QuantEncoding {
                    scale_offset: ffi::ScaleOffset {
                        scale: q.scale,
                        offset: q.offset,
                    },
                },
            },
            None => ffi::QuantizeParams {
                encoding_definition: ffi::UNDEFINED,
                quantization_encoding: ffi::UNDEFINED,
                encoding: ffi::QuantEncoding { pad: [0; 4] },
            },
        };
        let raw = ffi::Tensor {
            version: ffi::TENSOR_VERSION_2,
            v2: ffi::TensorV2 {
                id: spec.id,
                name: name.as_ptr(),
                tensor_type: spec.role.raw(),
                data_format: ffi::TENSOR_DATA_FORMAT_DENSE,
                data_type: spec.dtype.raw(),
                quantize_params,
                rank: dims.len() as u32,
                dimensions: dims.as_mut_ptr(),
                mem_type: ffi::TENSOR_MEMTYPE_RAW,
                mem: ffi::TensorMem {
                    client_buf: ffi::ClientBuffer {
                        data: std::ptr::null_mut(),
                        data_size: 0,
                    },
                },
                is_dynamic_dimensions: std::ptr::null_mut(),
                sparse_params: ffi::SparseParams {
                    kind: ffi::UNDEFINED,
                    a: 0,
                    b: 0,
                },
                is_produced: 0,
            },
        };
        Ok(RawTensor {
            raw,
            _name: name,
            _dims: dims,
        })
    }

    /// Point the tensor at a client buffer (already size-checked by the caller).
    pub fn set_buffer(&mut self, data: *mut u8, len: usize) {
        self.raw.v2.mem.client_buf = ffi::ClientBuffer {
            data: data.cast(),
            data_size: len as u32,
        };
    }
}

/// View f32s as bytes (for graph buffers).
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of u8 is valid; the length is exact.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

/// View f32s as mutable bytes (for graph outputs).
pub fn f32_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), std::mem::size_of_val(x)) }
}

/// View u16s as bytes.
pub fn u16_bytes(x: &[u16]) -> &[u8] {
    // SAFETY: u16 has no padding and any byte pattern of u8 is valid; the length is exact.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

/// View u16s as mutable bytes.
pub fn u16_bytes_mut(x: &mut [u16]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid u16.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), std::mem::size_of_val(x)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_sizes_are_checked_exactly() {
        let t = TensorSpec::new("q", Role::Input, DataType::UFixed8, &[2, 4, 64]);
        assert_eq!(t.bytes(), 512);
        assert!(t.check_buffer(512).is_ok());
        let err = t.check_buffer(511).unwrap_err();
        assert!(matches!(
            err,
            Error::BufferSize {
                expected: 512,
                got: 511,
                ..
            }
        ));
        assert!(t.check_buffer(513).is_err());
        let f = TensorSpec::new("y", Role::Output, DataType::F32, &[3, 5]);
        assert_eq!(f.bytes(), 60);
    }

    #[test]
    fn quantization_follows_qnn_sign_convention() {
        let q = Quant::symmetric_u8(0.5);
        assert_eq!(q.dequantize(128), 0.0);
        assert_eq!(q.dequantize(130), 1.0);
        assert_eq!(q.dequantize(0), -64.0);
    }

    #[test]
    fn raw_tensor_points_at_its_own_strings() {
        let spec = TensorSpec::new("x", Role::Input, DataType::F32, &[1, 8])
            .quantized(Quant::symmetric_u8(1.0));
        let raw = RawTensor::new(&spec).unwrap();
        assert_eq!(raw.raw.v2.rank, 2);
        // SAFETY: the tensor's dims point into its own boxed slice.
        assert_eq!(unsafe { *raw.raw.v2.dimensions.add(1) }, 8);
        assert!(
            RawTensor::new(&TensorSpec::new("a\0b", Role::Input, DataType::F32, &[1])).is_err()
        );
    }
}
