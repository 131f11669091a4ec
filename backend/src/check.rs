//! What the device's checks against the loaded ggml share: a private ggml context in which a
//! check builds an op on its own data, has ggml's CPU backend compute it, and runs the device's
//! code on the same node.

use crate::ffi as g;

/// A private ggml context for a check's few tensors and graph.
pub(crate) struct Ctx(pub(crate) *mut llama_cpp_sys_2::ggml_context);

impl Ctx {
    pub(crate) fn new() -> Option<Ctx> {
        // SAFETY: ggml allocates the context's memory itself.
        let ctx = unsafe {
            llama_cpp_sys_2::ggml_init(llama_cpp_sys_2::ggml_init_params {
                mem_size: 32 << 20,
                mem_buffer: std::ptr::null_mut(),
                no_alloc: false,
            })
        };
        (!ctx.is_null()).then_some(Ctx(ctx))
    }

    /// A new f32 tensor of shape `ne`, each element the next of `values`.
    pub(crate) fn tensor(
        &self,
        ne: [i64; 4],
        values: &mut impl FnMut() -> f32,
    ) -> *mut llama_cpp_sys_2::ggml_tensor {
        use llama_cpp_sys_2 as sys;
        // SAFETY: a tensor of the context, its data as large as its elements.
        unsafe {
            let t = sys::ggml_new_tensor_4d(self.0, sys::GGML_TYPE_F32, ne[0], ne[1], ne[2], ne[3]);
            let n = ne.iter().product::<i64>() as usize;
            let d = std::slice::from_raw_parts_mut(sys::ggml_get_data(t).cast::<f32>(), n);
            d.iter_mut().for_each(|v| *v = values());
            t
        }
    }

    /// A new f32 tensor of shape `ne` holding `values` (as many as its elements).
    pub(crate) fn tensor_of(
        &self,
        ne: [i64; 4],
        values: &[f32],
    ) -> *mut llama_cpp_sys_2::ggml_tensor {
        assert_eq!(ne.iter().product::<i64>() as usize, values.len());
        let mut v = values.iter().copied();
        self.tensor(ne, &mut || v.next().unwrap_or_default())
    }

    /// ggml's result for `out` (its CPU backend, 2 threads), or `None` when the graph fails.
    ///
    /// # Safety
    /// `out` is a node of this context whose sources are its tensors.
    pub(crate) unsafe fn ggml(&self, out: *mut llama_cpp_sys_2::ggml_tensor) -> Option<Vec<u32>> {
        use llama_cpp_sys_2 as sys;
        let gf = sys::ggml_new_graph(self.0);
        sys::ggml_build_forward_expand(gf, out);
        (sys::ggml_graph_compute_with_ctx(self.0, gf, 2) == sys::GGML_STATUS_SUCCESS).then(|| {
            let n = sys::ggml_nelements(out) as usize;
            std::slice::from_raw_parts(sys::ggml_get_data(out).cast::<u32>(), n).to_vec()
        })
    }

    /// Whether `compute` run on every node of `out`'s graph in order (views skipped; the
    /// nodes' outputs spoiled first) gives `want`, with 1 and 2 threads.
    ///
    /// # Safety
    /// `out` is a node of this context whose sources are its tensors; `compute` computes
    /// each of the graph's nodes.
    pub(crate) unsafe fn device(
        &self,
        out: *mut llama_cpp_sys_2::ggml_tensor,
        want: &[u32],
        compute: &dyn Fn(&mut g::ggml_tensor, usize),
    ) -> bool {
        use llama_cpp_sys_2 as sys;
        let gf = sys::ggml_new_graph(self.0);
        sys::ggml_build_forward_expand(gf, out);
        let nodes: Vec<&mut g::ggml_tensor> = (0..sys::ggml_graph_n_nodes(gf))
            .map(|i| &mut *sys::ggml_graph_node(gf, i).cast::<g::ggml_tensor>())
            .filter(|t| {
                !matches!(
                    t.op,
                    g::GGML_OP_VIEW
                        | g::GGML_OP_PERMUTE
                        | g::GGML_OP_TRANSPOSE
                        | g::GGML_OP_RESHAPE
                )
            })
            .collect();
        let data = sys::ggml_get_data(out).cast::<u32>();
        [1, 2].into_iter().all(|threads| {
            for t in &nodes {
                std::ptr::write_bytes(
                    t.data.cast::<u8>(),
                    0xff,
                    sys::ggml_nbytes((*t as *const g::ggml_tensor).cast()),
                );
            }
            for t in &nodes {
                let t = *t as *const g::ggml_tensor as *mut g::ggml_tensor;
                compute(&mut *t, threads);
            }
            std::slice::from_raw_parts(data, want.len()) == want
        })
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context `new` made.
        unsafe { llama_cpp_sys_2::ggml_free(self.0) }
    }
}
