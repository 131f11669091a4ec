//! Chat messages: a /v1/chat/completions body's messages, checked, then rendered with every
//! chat template llama.cpp knows (what `leap serve` does before tokenizing; no model needed).
//!
//! Input: the first byte picks the template, the rest is the request body.
#![no_main]

use std::ffi::CStr;
use std::sync::OnceLock;

use leap_host::model::{apply_template, ChatMessage};
use leap_server::oai::{self, ChatRequest};
use libfuzzer_sys::fuzz_target;

/// The names of llama.cpp's built-in chat templates (`chatml`, `gemma`, `llama3`, ...).
fn templates() -> &'static [String] {
    static NAMES: OnceLock<Vec<String>> = OnceLock::new();
    NAMES.get_or_init(|| {
        // SAFETY: with `len` 0 llama.cpp writes nothing and returns the count; then it fills
        // at most `len` pointers to NUL-terminated names that live as long as the library.
        unsafe {
            let n = llama_cpp_sys_2::llama_chat_builtin_templates(std::ptr::null_mut(), 0);
            let mut p = vec![std::ptr::null(); n as usize];
            let got = llama_cpp_sys_2::llama_chat_builtin_templates(p.as_mut_ptr(), p.len());
            p.truncate(got as usize);
            p.iter()
                .map(|&s| CStr::from_ptr(s).to_string_lossy().into_owned())
                .collect()
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let names = templates();
    let tmpl = &names[pick as usize % names.len()];
    let Ok(r) = oai::parse::<ChatRequest>(body) else {
        return;
    };
    let Ok(msgs) = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| m.to_chat(i))
        .collect::<Result<Vec<ChatMessage>, _>>()
    else {
        return;
    };
    for add_assistant in [true, false] {
        let _ = apply_template(tmpl, &msgs, add_assistant);
    }
});
