//! Bindings for ggml's backend interface (`ggml-backend-impl.h`, which llama-cpp-sys-2 does
//! not bind) from the exact llama.cpp tree llama-cpp-sys-2 vendored and built: the plugin's
//! structs must match the host's ggml field for field.

use std::path::PathBuf;

fn main() {
    let src = PathBuf::from(
        std::env::var("DEP_LEAPHOST_SRCDIR").expect("leap-host exports the llama.cpp source dir"),
    );
    println!("cargo:rerun-if-changed=build.rs");
    let ggml = src.join("ggml");
    let b = bindgen::Builder::default()
        .header_contents(
            "leap_backend.h",
            "#include \"ggml-backend-impl.h\"\n#include \"ggml-cpu.h\"\n",
        )
        .clang_arg(format!("-I{}", ggml.join("include").display()))
        .clang_arg(format!("-I{}", ggml.join("src").display()))
        .allowlist_type("ggml_backend_.*")
        .allowlist_type("ggml_tensor")
        .allowlist_type("ggml_type_traits_cpu")
        .allowlist_function("ggml_backend_register")
        .allowlist_function("ggml_backend_buft_is_host")
        .allowlist_function("ggml_backend_buft_name")
        .allowlist_function("ggml_backend_buffer_get_type")
        .allowlist_function("ggml_backend_cpu_buffer_type")
        .allowlist_function("ggml_backend_dev_count")
        .allowlist_function("ggml_backend_dev_get")
        .allowlist_function("ggml_backend_dev_name")
        .allowlist_function("ggml_get_type_traits_cpu")
        .allowlist_function("ggml_cpu_init")
        .allowlist_function("ggml_row_size")
        .allowlist_function("ggml_is_contiguous")
        .allowlist_function("ggml_graph_n_nodes")
        .allowlist_function("ggml_graph_node")
        .allowlist_function("ggml_type_name")
        .allowlist_type("ggml_glu_op")
        .allowlist_var("GGML_BACKEND_API_VERSION")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate()
        .expect("bindgen of ggml-backend-impl.h");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("ggml_backend.rs");
    b.write_to_file(out).expect("write bindings");
}
