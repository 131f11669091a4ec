//! Owning types for the QNN object chain: backend -> device -> context -> graph.
//!
//! Each holds an `Arc` of its parent, so a child keeps its parent (and the loaded library)
//! alive and `Drop` frees in reverse order: context, device, backend, log. Graphs have no free
//! call in QNN; they live as long as their context.

use crate::error::{check, Error, Result};
use crate::ffi::{self, Handle};
use crate::library::Api;
use crate::tensor::{RawTensor, Role, TensorSpec};
use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::Arc;
use std::time::Instant;

struct BackendInner {
    api: Arc<Api>,
    handle: Handle,
    log: Handle,
}

impl Drop for BackendInner {
    fn drop(&mut self) {
        // SAFETY: the handles came from backendCreate/logCreate of this library and every child
        // (holding an Arc of this) is gone.
        unsafe {
            if let Err(e) = check("backendFree", (self.api.fns.backend_free)(self.handle)) {
                log::warn!("{e}");
            }
            if !self.log.is_null() {
                let _ = (self.api.fns.log_free)(self.log);
            }
        }
    }
}

/// A QNN backend (`backendCreate`), with Leap's logger installed.
#[derive(Clone)]
pub struct Backend(Arc<BackendInner>);

impl Backend {
    /// Create the backend; QNN's log goes to the `log` crate.
    ///
    /// # Errors
    /// [`Error::Status`] from logCreate or backendCreate.
    pub fn new(api: Arc<Api>) -> Result<Backend> {
        crate::log::install();
        let mut log = ptr::null_mut();
        // SAFETY: the shim's callback has QNN's log-callback signature and lives forever.
        let logged = check("logCreate", unsafe {
            (api.fns.log_create)(
                ffi::leap_qnn_log_callback as ffi::LogCallback,
                crate::log::qnn_level(),
                &mut log,
            )
        });
        if let Err(e) = logged {
            log::warn!("QNN logging unavailable: {e}");
            log = ptr::null_mut();
        }
        let mut handle = ptr::null_mut();
        // SAFETY: a NULL config is allowed; `log` is NULL or a log handle of this library.
        let created = check("backendCreate", unsafe {
            (api.fns.backend_create)(log, ptr::null(), &mut handle)
        });
        if let Err(e) = created {
            if !log.is_null() {
                // SAFETY: the log handle was created above and nothing else uses it.
                unsafe { (api.fns.log_free)(log) };
            }
            return Err(e);
        }
        Ok(Backend(Arc::new(BackendInner { api, handle, log })))
    }

    /// The library this backend came from.
    pub fn api(&self) -> &Arc<Api> {
        &self.0.api
    }
}

struct DeviceInner {
    backend: Backend,
    handle: Handle,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if self.handle.is_null() {
            return;
        }
        // SAFETY: the handle came from deviceCreate and no context uses it any more.
        let freed = unsafe { (self.backend.0.api.fns.device_free)(self.handle) };
        if let Err(e) = check("deviceFree", freed) {
            log::warn!("{e}");
        }
    }
}

/// A QNN device (`deviceCreate`).
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

impl Device {
    /// Create the default device, or (HTP, tested API only) one emulating a SoC model, e.g. 57
    /// (SM8650), with which the x86 emulator computes f32 graphs in fp16 as a phone does.
    ///
    /// # Errors
    /// [`Error::Status`] from deviceCreate, [`Error::Shape`] for a SoC config the library's API
    /// version was not tested with.
    pub fn new(backend: &Backend, soc_model: Option<u32>) -> Result<Device> {
        let api = &backend.0.api;
        let custom;
        let config;
        let configs: [*const c_void; 2];
        let config_ptr = match soc_model {
            None => ptr::null(),
            Some(soc) => {
                if !api.htp_device_config_supported() {
                    return Err(Error::Shape(
                        "a SoC device config needs the HTP backend at the tested core API 2.40",
                    ));
                }
                custom = ffi::HtpDeviceCustomConfig {
                    option: ffi::HTP_DEVICE_CONFIG_OPTION_SOC,
                    _pad: 0,
                    soc_model: soc,
                    _rest: 0,
                };
                config = ffi::DeviceConfig {
                    option: 0,
                    custom: (&custom as *const ffi::HtpDeviceCustomConfig).cast(),
                };
                configs = [(&config as *const ffi::DeviceConfig).cast(), ptr::null()];
                configs.as_ptr()
            }
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the config list is NULL or NULL-terminated and outlives the call.
        check("deviceCreate", unsafe {
            (api.fns.device_create)(backend.0.log, config_ptr, &mut handle)
        })?;
        Ok(Device(Arc::new(DeviceInner {
            backend: backend.clone(),
            handle,
        })))
    }

    fn api(&self) -> &Api {
        &self.0.backend.0.api
    }
}

struct ContextInner {
    device: Device,
    handle: Handle,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the handle came from contextCreate(FromBinary); its graphs hold an Arc of
        // this, so none is alive.
        let freed = unsafe { (self.device.api().fns.context_free)(self.handle, ptr::null_mut()) };
        if let Err(e) = check("contextFree", freed) {
            log::warn!("{e}");
        }
    }
}

/// A QNN context: owns graphs; can be serialized to a context binary and created from one.
#[derive(Clone)]
pub struct Context(Arc<ContextInner>);

impl Context {
    /// `contextCreate` on `device`.
    ///
    /// # Errors
    /// [`Error::Status`].
    pub fn new(device: &Device) -> Result<Context> {
        let api = device.api();
        let mut handle = ptr::null_mut();
        // SAFETY: handles of this library; a NULL config is allowed.
        check("contextCreate", unsafe {
            (api.fns.context_create)(
                device.0.backend.0.handle,
                device.0.handle,
                ptr::null(),
                &mut handle,
            )
        })?;
        Ok(Context(Arc::new(ContextInner {
            device: device.clone(),
            handle,
        })))
    }

    /// `contextCreateFromBinary`: a context whose graphs come from a saved binary.
    ///
    /// # Errors
    /// [`Error::Status`] (30010 for a corrupted or truncated binary).
    pub fn from_binary(device: &Device, binary: &[u8]) -> Result<Context> {
        let api = device.api();
        let mut handle = ptr::null_mut();
        // SAFETY: `binary` is readable for its length during the call; QNN copies what it keeps.
        check("contextCreateFromBinary", unsafe {
            (api.fns.context_create_from_binary)(
                device.0.backend.0.handle,
                device.0.handle,
                ptr::null(),
                binary.as_ptr().cast(),
                binary.len() as u64,
                &mut handle,
                ptr::null_mut(),
            )
        })?;
        Ok(Context(Arc::new(ContextInner {
            device: device.clone(),
            handle,
        })))
    }

    /// The serialized context (after its graphs are finalized).
    ///
    /// # Errors
    /// [`Error::Status`] from contextGetBinarySize/contextGetBinary.
    pub fn binary(&self) -> Result<Vec<u8>> {
        let api = self.0.device.api();
        let mut size = 0u64;
        // SAFETY: a valid context handle and out-pointer.
        check("contextGetBinarySize", unsafe {
            (api.fns.context_get_binary_size)(self.0.handle, &mut size)
        })?;
        let mut buf = vec![0u8; size as usize];
        let mut written = 0u64;
        // SAFETY: `buf` has `size` writable bytes, which is what we tell QNN.
        check("contextGetBinary", unsafe {
            (api.fns.context_get_binary)(self.0.handle, buf.as_mut_ptr().cast(), size, &mut written)
        })?;
        buf.truncate(written.min(size) as usize);
        Ok(buf)
    }

    /// Start a new graph in this context (`graphCreate`).
    ///
    /// # Errors
    /// [`Error::Status`] (6003 for a duplicate name, 1100 in a context made from a binary).
    pub fn graph(&self, name: &str) -> Result<GraphBuilder> {
        let cname = CString::new(name).map_err(|_| Error::Name(name.to_string()))?;
        let mut handle = ptr::null_mut();
        // SAFETY: valid context handle, NUL-terminated name, NULL config.
        check("graphCreate", unsafe {
            (self.0.device.api().fns.graph_create)(
                self.0.handle,
                cname.as_ptr(),
                ptr::null(),
                &mut handle,
            )
        })?;
        Ok(GraphBuilder {
            context: self.clone(),
            handle,
            name: name.to_string(),
            tensors: Vec::new(),
            keep: Vec::new(),
        })
    }

    /// `graphRetrieve` a finalized graph of a context created from a binary. `tensors` are the
    /// graph's inputs and outputs with the ids the binary records ([`crate::binary`]).
    ///
    /// # Errors
    /// [`Error::Status`] (6003 for a name the binary does not have).
    pub fn retrieve(&self, name: &str, tensors: Vec<TensorSpec>) -> Result<Graph> {
        let cname = CString::new(name).map_err(|_| Error::Name(name.to_string()))?;
        let mut handle = ptr::null_mut();
        // SAFETY: valid context handle and NUL-terminated name.
        check("graphRetrieve", unsafe {
            (self.0.device.api().fns.graph_retrieve)(self.0.handle, cname.as_ptr(), &mut handle)
        })?;
        Ok(Graph::new(self.clone(), handle, name, tensors))
    }
}

/// A scalar parameter of a node.
#[derive(Clone, Debug)]
pub enum Param {
    Bool(&'static str, bool),
    U32(&'static str, u32),
}

/// A graph under construction: tensors and nodes, then [`GraphBuilder::finalize`].
pub struct GraphBuilder {
    context: Context,
    handle: Handle,
    name: String,
    tensors: Vec<TensorSpec>,
    /// Static data and names QNN may read until finalize.
    keep: Vec<Box<[u8]>>,
}

/// A tensor of a [`GraphBuilder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorRef(usize);

impl GraphBuilder {
    fn api(&self) -> &Api {
        self.context.0.device.api()
    }

    /// Add a tensor; `data` is required for (and only for) [`Role::Static`] tensors and is
    /// size-checked against the spec.
    ///
    /// # Errors
    /// [`Error::BufferSize`], [`Error::Shape`], [`Error::Status`] from tensorCreateGraphTensor.
    pub fn tensor(&mut self, spec: TensorSpec, data: Option<&[u8]>) -> Result<TensorRef> {
        if spec.dtype.is_quantized() != spec.quant.is_some() {
            return Err(Error::Shape(
                "quantized tensors need scale/offset, others must not have it",
            ));
        }
        let mut raw = RawTensor::new(&spec)?;
        match (spec.role, data) {
            (Role::Static, Some(bytes)) => {
                spec.check_buffer(bytes.len())?;
                let mut copy: Box<[u8]> = bytes.into();
                raw.set_buffer(copy.as_mut_ptr(), copy.len());
                self.keep.push(copy);
            }
            (Role::Static, None) => return Err(Error::Shape("a static tensor needs its data")),
            (_, Some(_)) => return Err(Error::Shape("only static tensors take data at creation")),
            (_, None) => {}
        }
        // SAFETY: `raw` is a valid V2 tensor whose name, dims and data outlive the call (static
        // data is kept in `self.keep` until finalize); the backend writes the id back.
        check("tensorCreateGraphTensor", unsafe {
            (self.api().fns.tensor_create_graph_tensor)(self.handle, &mut raw.raw)
        })?;
        let mut spec = spec;
        spec.id = raw.raw.v2.id;
        self.tensors.push(spec);
        Ok(TensorRef(self.tensors.len() - 1))
    }

    /// Add a `qti.aisw` op node. It is validated with backendValidateOpConfig first: graphAddNode
    /// accepts invalid ops and may compute garbage later (probe §7).
    ///
    /// # Errors
    /// [`Error::Status`] from validation or graphAddNode.
    pub fn node(
        &mut self,
        name: &str,
        op: &str,
        params: &[Param],
        inputs: &[TensorRef],
        outputs: &[TensorRef],
    ) -> Result<()> {
        let cname = CString::new(name).map_err(|_| Error::Name(name.to_string()))?;
        let cop = CString::new(op).map_err(|_| Error::Name(op.to_string()))?;
        let package = c"qti.aisw";
        let param_names = params
            .iter()
            .map(|p| match p {
                Param::Bool(n, _) | Param::U32(n, _) => CString::new(*n),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Error::Name(name.to_string()))?;
        let mut raw_params: Vec<ffi::Param> = params
            .iter()
            .zip(&param_names)
            .map(|(p, n)| {
                let scalar = match *p {
                    Param::Bool(_, b) => ffi::Scalar {
                        data_type: ffi::DATATYPE_BOOL_8,
                        value: ffi::ScalarValue { u64: b as u64 },
                    },
                    Param::U32(_, v) => ffi::Scalar {
                        data_type: 0x0132,
                        value: ffi::ScalarValue { u64: v as u64 },
                    },
                };
                ffi::Param {
                    param_type: ffi::PARAMTYPE_SCALAR,
                    name: n.as_ptr(),
                    value: ffi::ParamValue { scalar },
                }
            })
            .collect();
        let raws = |refs: &[TensorRef]| -> Result<Vec<RawTensor>> {
            refs.iter()
                .map(|r| {
                    let spec = self
                        .tensors
                        .get(r.0)
                        .ok_or(Error::Shape("tensor of another graph"))?;
                    RawTensor::new(spec)
                })
                .collect()
        };
        let mut ins = raws(inputs)?;
        let mut outs = raws(outputs)?;
        let mut in_raw: Vec<ffi::Tensor> = ins.iter_mut().map(|t| t.raw).collect();
        let mut out_raw: Vec<ffi::Tensor> = outs.iter_mut().map(|t| t.raw).collect();
        let config = ffi::OpConfig {
            version: ffi::OPCONFIG_VERSION_1,
            v1: ffi::OpConfigV1 {
                name: cname.as_ptr(),
                package_name: package.as_ptr(),
                type_name: cop.as_ptr(),
                num_params: raw_params.len() as u32,
                params: raw_params.as_mut_ptr(),
                num_inputs: in_raw.len() as u32,
                inputs: in_raw.as_mut_ptr(),
                num_outputs: out_raw.len() as u32,
                outputs: out_raw.as_mut_ptr(),
            },
        };
        let backend = self.context.0.device.0.backend.0.handle;
        // SAFETY: every pointer in `config` points into locals alive for both calls; the
        // tensors carry the ids the backend assigned.
        unsafe {
            check(
                "backendValidateOpConfig",
                (self.api().fns.backend_validate_op_config)(backend, config),
            )?;
            check(
                "graphAddNode",
                (self.api().fns.graph_add_node)(self.handle, config),
            )?;
        }
        Ok(())
    }

    /// `graphFinalize`; returns the executable graph and the time finalize took.
    ///
    /// # Errors
    /// [`Error::Status`] (1002/1100 mean the graph is invalid).
    pub fn finalize(self) -> Result<(Graph, f64)> {
        let t = Instant::now();
        // SAFETY: a graph handle of this library; NULL profile and signal.
        check("graphFinalize", unsafe {
            (self.api().fns.graph_finalize)(self.handle, ptr::null_mut(), ptr::null_mut())
        })?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let io = self
            .tensors
            .into_iter()
            .filter(|t| matches!(t.role, Role::Input | Role::Output))
            .collect();
        Ok((Graph::new(self.context, self.handle, &self.name, io), ms))
    }
}

/// A finalized (or retrieved) graph, executable with size-checked buffers.
pub struct Graph {
    context: Context,
    handle: Handle,
    name: String,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
}

// SAFETY: a graph handle may be executed from any thread, also concurrently (probe §7: two
// threads executing one graph gave correct results); the specs are immutable.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}
// SAFETY: QNN handles are process-wide; the library was measured multithread-safe (probe §7).
unsafe impl Send for BackendInner {}
// SAFETY: as above.
unsafe impl Sync for BackendInner {}
// SAFETY: as above.
unsafe impl Send for DeviceInner {}
// SAFETY: as above.
unsafe impl Sync for DeviceInner {}
// SAFETY: as above.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Graph {
    fn new(context: Context, handle: Handle, name: &str, io: Vec<TensorSpec>) -> Graph {
        let (inputs, outputs) = io.into_iter().partition(|t| t.role == Role::Input);
        Graph {
            context,
            handle,
            name: name.to_string(),
            inputs,
            outputs,
        }
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The context the graph lives in.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// Inputs in creation order.
    pub fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    /// Outputs in creation order.
    pub fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    /// Run the graph. Every buffer must be exactly its tensor's size (checked here: QNN does
    /// not check and would write past a short buffer).
    ///
    /// # Errors
    /// [`Error::TensorCount`], [`Error::BufferSize`], [`Error::Status`] from graphExecute.
    pub fn execute(&self, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<()> {
        let count = |what, expected: usize, got: usize| {
            if expected == got {
                Ok(())
            } else {
                Err(Error::TensorCount {
                    graph: self.name.clone(),
                    what,
                    expected,
                    got,
                })
            }
        };
        count("inputs", self.inputs.len(), inputs.len())?;
        count("outputs", self.outputs.len(), outputs.len())?;
        let mut ins = Vec::with_capacity(inputs.len());
        for (spec, buf) in self.inputs.iter().zip(inputs) {
            spec.check_buffer(buf.len())?;
            let mut raw = RawTensor::new(spec)?;
            // QNN only reads APP_WRITE buffers.
            raw.set_buffer(buf.as_ptr().cast_mut(), buf.len());
            ins.push(raw);
        }
        let mut outs = Vec::with_capacity(outputs.len());
        for (spec, buf) in self.outputs.iter().zip(outputs.iter_mut()) {
            spec.check_buffer(buf.len())?;
            let mut raw = RawTensor::new(spec)?;
            raw.set_buffer(buf.as_mut_ptr(), buf.len());
            outs.push(raw);
        }
        let in_raw: Vec<ffi::Tensor> = ins.iter().map(|t| t.raw).collect();
        let mut out_raw: Vec<ffi::Tensor> = outs.iter().map(|t| t.raw).collect();
        // SAFETY: every client buffer was checked above to be exactly its tensor's size, the
        // tensors carry this graph's ids, and all pointers outlive the (synchronous) call.
        check("graphExecute", unsafe {
            (self.context.0.device.api().fns.graph_execute)(
                self.handle,
                in_raw.as_ptr(),
                in_raw.len() as u32,
                out_raw.as_mut_ptr(),
                out_raw.len() as u32,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        })
    }
}
