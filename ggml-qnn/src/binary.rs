//! Context binaries: save a finalized context to a file, and on the next run create the
//! context from it and retrieve its graph, so start-up does not pay finalize again.
//!
//! The graph's tensor ids are read back with libQnnSystem (`systemContextGetBinaryInfo`):
//! graphExecute matches tensors by id, not by name (probe §5).

use crate::backend::{Context, Device, Graph};
use crate::error::{check, Error, Result};
use crate::library::SystemApi;
use crate::tensor::TensorSpec;
use std::ffi::CStr;
use std::path::Path;
use std::time::Instant;

/// A graph input or output as a context binary describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BinaryTensor {
    pub name: String,
    pub id: u32,
    pub dims: Vec<u32>,
}

/// What libQnnSystem reads from a context binary with one graph.
#[derive(Clone, Debug)]
pub struct BinaryGraph {
    pub info_version: u32,
    pub num_graphs: u32,
    pub graph: String,
    pub inputs: Vec<BinaryTensor>,
    pub outputs: Vec<BinaryTensor>,
}

/// # Safety
/// `t` points to `n` `Qnn_Tensor_t` (144-byte stride, V1 or V2; the fields read are common).
unsafe fn tensors(t: *const crate::ffi::Tensor, n: u32) -> Vec<BinaryTensor> {
    (0..n as usize)
        .map(|i| {
            let v = &(*t.add(i)).v2;
            BinaryTensor {
                name: if v.name.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(v.name).to_string_lossy().into_owned()
                },
                id: v.id,
                dims: if v.dimensions.is_null() {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(v.dimensions, v.rank as usize).to_vec()
                },
            }
        })
        .collect()
}

/// Read a context binary's (first) graph with libQnnSystem.
///
/// # Errors
/// [`Error::Status`] from the system library, [`Error::Binary`] for an unknown info version or
/// a binary without graphs.
pub fn inspect(system: &SystemApi, binary: &[u8]) -> Result<BinaryGraph> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check("systemContextCreate", unsafe {
        (system.fns.context_create)(&mut handle)
    })?;
    // QNN may write to the buffer it parses; give it a copy.
    let mut copy = binary.to_vec();
    let mut info = std::ptr::null();
    let mut info_size = 0u64;
    // SAFETY: `copy` is valid for its length; the info stays owned by `handle` until freed.
    let result = check("systemContextGetBinaryInfo", unsafe {
        (system.fns.context_get_binary_info)(
            handle,
            copy.as_mut_ptr().cast(),
            copy.len() as u64,
            &mut info,
            &mut info_size,
        )
    })
    .and_then(|_| {
        if info.is_null() {
            return Err(Error::Binary("libQnnSystem returned no binary info"));
        }
        // SAFETY: `info` points to a BinaryInfo owned by `handle`.
        let info = unsafe { &*info };
        if !(1..=3).contains(&info.version) {
            return Err(Error::Binary(
                "unknown binary-info version (Leap reads 1 to 3)",
            ));
        }
        let prefix = &info.info;
        if prefix.num_graphs == 0 || prefix.graphs.is_null() {
            return Err(Error::Binary("the binary holds no graph"));
        }
        // SAFETY: at least one GraphInfo; its V1..V3 share the prefix read here.
        let g = unsafe { &*prefix.graphs };
        if !(1..=3).contains(&g.version) {
            return Err(Error::Binary(
                "unknown graph-info version (Leap reads 1 to 3)",
            ));
        }
        // SAFETY: name, inputs and outputs as the graph info describes them.
        Ok(unsafe {
            BinaryGraph {
                info_version: info.version,
                num_graphs: prefix.num_graphs,
                graph: CStr::from_ptr(g.name).to_string_lossy().into_owned(),
                inputs: tensors(g.inputs, g.num_inputs),
                outputs: tensors(g.outputs, g.num_outputs),
            }
        })
    });
    // SAFETY: the handle came from systemContextCreate; the info is not used after this.
    unsafe { (system.fns.context_free)(handle) };
    result
}

/// Serialize `graph`'s context into `path` (written atomically).
///
/// # Errors
/// [`Error::Status`], [`Error::Io`].
pub fn save(graph: &Graph, path: &Path) -> Result<usize> {
    let bytes = graph.context().binary()?;
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, &bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(bytes.len())
}

/// Create a context from the binary at `path` and retrieve the graph that `specs` (inputs,
/// then outputs, as built) describe; the ids come from the binary's info, matched by name.
/// Returns the graph and the time it took.
///
/// # Errors
/// [`Error::Io`], [`Error::Binary`] when the binary's graph does not match `specs`,
/// [`Error::Status`].
pub fn load(
    device: &Device,
    system: &SystemApi,
    path: &Path,
    graph_name: &str,
    specs: &[TensorSpec],
) -> Result<(Graph, f64)> {
    let t = Instant::now();
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let info = inspect(system, &bytes)?;
    if info.graph != graph_name {
        return Err(Error::Binary("the binary's graph has another name"));
    }
    let mut specs = specs.to_vec();
    for spec in &mut specs {
        let found = info
            .inputs
            .iter()
            .chain(&info.outputs)
            .find(|t| t.name == spec.name)
            .ok_or(Error::Binary("a graph tensor is missing from the binary"))?;
        if found.dims != spec.dims {
            return Err(Error::Binary("a graph tensor has other dims in the binary"));
        }
        spec.id = found.id;
    }
    let context = Context::from_binary(device, &bytes)?;
    let graph = context.retrieve(graph_name, specs)?;
    Ok((graph, t.elapsed().as_secs_f64() * 1e3))
}
