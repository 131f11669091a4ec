//! A loaded model: metadata, vocabulary, tokenizer and chat template.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::{backend, Error, GgufInfo, Result, Token};

/// How to load a model.
#[derive(Debug, Clone)]
pub struct ModelParams {
    /// Map the file instead of reading it into memory (llama.cpp's default).
    pub mmap: bool,
    /// Load only the vocabulary (fast; for tokenizer work).
    pub vocab_only: bool,
    /// Let llama.cpp repack weights into its CPU-optimised layouts (llama.cpp's default, off
    /// here). A repacked matrix takes batches of 4+ rows through a GEMM that rounds otherwise than
    /// the one-row GEMV, so verified tokens would not be bit-identical to decoded ones; decoding
    /// one row is as fast either way on the CPUs we measured.
    pub extra_bufts: bool,
}

impl Default for ModelParams {
    fn default() -> Self {
        Self {
            mmap: true,
            vocab_only: false,
            extra_bufts: false,
        }
    }
}

/// A model loaded by llama.cpp. Share it with `Arc`; contexts keep it alive.
pub struct Model {
    raw: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
    path: PathBuf,
    /// What the tokenizer can make of text, read off the vocabulary at first use.
    text_facts: std::sync::OnceLock<TextFacts>,
    /// The chat template used instead of the GGUF's ([`Model::set_chat_template`]).
    template: std::sync::OnceLock<String>,
}

/// Read off the vocabulary once: how much text a token can cover, and the control tokens'
/// texts (what `parse_special` turns into control tokens).
struct TextFacts {
    /// The longest token text in bytes (as stored: `▁`, `Ġ` and `<0x0A>` are longer than the
    /// text they stand for, so no token covers more bytes of a prompt than this).
    longest: usize,
    /// The texts of control (and unknown) tokens, which llama.cpp matches only with
    /// `parse_special`; `None` when the vocabulary has none.
    control: Option<aho_corasick::AhoCorasick>,
}

// SAFETY: a llama_model is immutable after loading; llama.cpp documents concurrent contexts on
// one model as supported, and every method here only reads it.
unsafe impl Send for Model {}
// SAFETY: as above, shared reads of an immutable model are thread-safe.
unsafe impl Sync for Model {}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: `raw` came from llama_model_load_from_file and is freed exactly once; every
        // Context holds an Arc<Model>, so none outlives it.
        unsafe { sys::llama_model_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("path", &self.path).finish()
    }
}

/// The progress callback of one [`Model::load_reporting`], as llama.cpp calls it.
struct Report<'a> {
    progress: Option<&'a mut dyn FnMut(f32) -> bool>,
    /// The callback said stop.
    stopped: bool,
}

impl Report<'_> {
    unsafe extern "C" fn trampoline(fraction: f32, user: *mut std::ffi::c_void) -> bool {
        // SAFETY: `user` is the `Report` of the load in progress (load_reporting), alive and
        // used by nothing else during llama_model_load_from_file.
        let r = unsafe { &mut *user.cast::<Report<'_>>() };
        let go_on = match r.progress.as_mut() {
            Some(f) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(fraction)))
                .unwrap_or(false),
            None => true,
        };
        r.stopped |= !go_on;
        go_on
    }
}

/// A chat message for [`Model::apply_chat_template`].
#[derive(Debug, Clone)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Model {
    /// Load a GGUF model. The file is checked with ggml's GGUF parser first, so a missing,
    /// corrupt or truncated file is a typed error rather than whatever llama.cpp does with it.
    ///
    /// # Errors
    /// [`Error::ModelNotFound`], [`Error::InvalidGguf`], [`Error::TruncatedGguf`],
    /// [`Error::ModelLoad`].
    pub fn load(path: &Path, params: &ModelParams) -> Result<Arc<Model>> {
        Self::load_reporting(path, params, None)
    }

    /// [`Model::load`], calling `progress` with the fraction loaded (0 to 1) as llama.cpp
    /// loads the weights; a `false` from it stops the load ([`Error::Cancelled`]).
    ///
    /// # Errors
    /// As [`Model::load`]; [`Error::Cancelled`].
    pub fn load_reporting(
        path: &Path,
        params: &ModelParams,
        progress: Option<&mut dyn FnMut(f32) -> bool>,
    ) -> Result<Arc<Model>> {
        backend::init();
        GgufInfo::open(path)?;
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::NulByte { what: "model path" })?;
        // SAFETY: returns a plain struct of defaults.
        let mut mp = unsafe { sys::llama_model_default_params() };
        mp.n_gpu_layers = 0;
        mp.load_mode = if params.mmap {
            sys::LLAMA_LOAD_MODE_MMAP
        } else {
            sys::LLAMA_LOAD_MODE_NONE
        };
        mp.vocab_only = params.vocab_only;
        mp.use_extra_bufts = params.extra_bufts;
        let mut report = Report {
            progress,
            stopped: false,
        };
        if report.progress.is_some() {
            mp.progress_callback = Some(Report::trampoline);
            mp.progress_callback_user_data = (&raw mut report).cast();
        }
        backend::take_last_problem();
        // SAFETY: `cpath` is NUL-terminated and outlives the call; `mp` is fully initialised;
        // `report`, which the progress callback gets, outlives the call.
        let raw = unsafe { sys::llama_model_load_from_file(cpath.as_ptr(), mp) };
        if raw.is_null() && report.stopped {
            return Err(Error::Cancelled);
        }
        let raw = NonNull::new(raw).ok_or_else(|| Error::ModelLoad {
            path: path.to_path_buf(),
            reason: backend::reason_or("llama_model_load_from_file returned null"),
        })?;
        // SAFETY: `raw` is a live model; the vocab pointer lives as long as the model.
        let vocab = unsafe { sys::llama_model_get_vocab(raw.as_ptr()) };
        let vocab = NonNull::new(vocab.cast_mut()).ok_or_else(|| Error::ModelLoad {
            path: path.to_path_buf(),
            reason: "model has no vocabulary".into(),
        })?;
        Ok(Arc::new(Model {
            raw,
            vocab,
            path: path.to_path_buf(),
            text_facts: std::sync::OnceLock::new(),
            template: std::sync::OnceLock::new(),
        }))
    }

    pub(crate) fn raw(&self) -> *mut sys::llama_model {
        self.raw.as_ptr()
    }

    pub(crate) fn vocab(&self) -> *const sys::llama_vocab {
        self.vocab.as_ptr()
    }

    /// The file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> i32 {
        // SAFETY: live vocab.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) }
    }

    /// Number of transformer blocks.
    pub fn n_layer(&self) -> i32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_layer(self.raw()) }
    }

    /// Embedding width.
    pub fn n_embd(&self) -> i32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_embd(self.raw()) }
    }

    /// Attention heads.
    pub fn n_head(&self) -> i32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_head(self.raw()) }
    }

    /// Key/value heads.
    pub fn n_head_kv(&self) -> i32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_head_kv(self.raw()) }
    }

    /// Context length the model was trained with.
    pub fn n_ctx_train(&self) -> i32 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_ctx_train(self.raw()) }
    }

    /// Whether the model keeps recurrent state (Mamba, RWKV; or in part, as hybrid models such
    /// as Jamba or LFM2 do): llama.cpp's memory then cannot drop the last positions of a
    /// sequence ([`crate::Context::seq_rm`] returns false), so a rejected draft cannot be
    /// rolled back; only a whole sequence can be cleared.
    pub fn is_recurrent(&self) -> bool {
        // SAFETY: live model.
        unsafe {
            sys::llama_model_is_recurrent(self.raw()) || sys::llama_model_is_hybrid(self.raw())
        }
    }

    /// Bytes of weights.
    pub fn size(&self) -> u64 {
        // SAFETY: live model.
        unsafe { sys::llama_model_size(self.raw()) }
    }

    /// Number of parameters.
    pub fn n_params(&self) -> u64 {
        // SAFETY: live model.
        unsafe { sys::llama_model_n_params(self.raw()) }
    }

    /// llama.cpp's one-line description, e.g. `gemma3 270M Q4_K - Medium`.
    pub fn desc(&self) -> String {
        let mut buf = vec![0u8; 256];
        // SAFETY: `buf` has `buf.len()` writable bytes; llama.cpp writes a NUL-terminated string.
        let n = unsafe { sys::llama_model_desc(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        buf.truncate(n.clamp(0, 255) as usize);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// A metadata value as a string.
    pub fn meta(&self, key: &str) -> Option<String> {
        let ckey = CString::new(key).ok()?;
        let mut buf = vec![0u8; 512];
        loop {
            // SAFETY: `ckey` is NUL-terminated; `buf` has `buf.len()` writable bytes.
            let n = unsafe {
                sys::llama_model_meta_val_str(
                    self.raw(),
                    ckey.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n < 0 {
                return None;
            }
            if (n as usize) < buf.len() {
                buf.truncate(n as usize);
                return Some(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize(n as usize + 1, 0);
        }
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn token_bos(&self) -> Option<Token> {
        // SAFETY: live vocab.
        let t = unsafe { sys::llama_vocab_bos(self.vocab()) };
        (t >= 0).then_some(t)
    }

    /// End-of-sequence token, if the model has one.
    pub fn token_eos(&self) -> Option<Token> {
        // SAFETY: live vocab.
        let t = unsafe { sys::llama_vocab_eos(self.vocab()) };
        (t >= 0).then_some(t)
    }

    /// Whether the tokenizer adds BOS to a prompt.
    pub fn add_bos(&self) -> bool {
        // SAFETY: live vocab.
        unsafe { sys::llama_vocab_get_add_bos(self.vocab()) }
    }

    /// Whether `token` ends generation (EOS, EOT and the like).
    pub fn is_eog(&self, token: Token) -> bool {
        // SAFETY: live vocab; llama.cpp range-checks the id.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token) }
    }

    /// Tokenize `text`. `add_special` adds BOS/EOS as the model requires; `parse_special`
    /// turns control-token text (`<start_of_turn>`) into control tokens.
    ///
    /// # Errors
    /// [`Error::Tokenize`].
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len()).map_err(|_| Error::Tokenize {
            len: text.len(),
            code: i32::MIN,
        })?;
        let mut out: Vec<Token> = vec![0; text.len() / 2 + 8];
        for _ in 0..2 {
            // SAFETY: `text` points to `len` bytes (no NUL needed: the length is passed);
            // `out` has `out.len()` writable tokens.
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast::<c_char>(),
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                out.truncate(n as usize);
                return Ok(out);
            }
            if n == i32::MIN {
                break;
            }
            out.resize((-n) as usize, 0);
        }
        Err(Error::Tokenize {
            len: text.len(),
            code: -1,
        })
    }

    fn check_token(&self, token: Token) -> Result<()> {
        let n_vocab = self.n_vocab();
        if token < 0 || token >= n_vocab {
            return Err(Error::InvalidToken { token, n_vocab });
        }
        Ok(())
    }

    /// The bytes of one token (may be a partial UTF-8 sequence). `special` renders control
    /// tokens as their text instead of nothing.
    ///
    /// # Errors
    /// [`Error::InvalidToken`].
    pub fn token_to_piece(&self, token: Token, special: bool) -> Result<Vec<u8>> {
        self.check_token(token)?;
        let mut buf = vec![0u8; 32];
        loop {
            // SAFETY: `buf` has `buf.len()` writable bytes; the token id was range-checked.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab(),
                    token,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// Text of a token sequence. `remove_special` drops BOS/EOS; `unparse_special` renders
    /// control tokens as text.
    ///
    /// # Errors
    /// [`Error::InvalidToken`].
    pub fn detokenize(
        &self,
        tokens: &[Token],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<String> {
        for &t in tokens {
            self.check_token(t)?;
        }
        let mut buf = vec![0u8; tokens.len() * 8 + 16];
        loop {
            // SAFETY: `tokens` are valid ids (checked); `buf` has `buf.len()` writable bytes.
            let n = unsafe {
                sys::llama_detokenize(
                    self.vocab(),
                    tokens.as_ptr(),
                    tokens.len() as i32,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    remove_special,
                    unparse_special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize((-n) as usize, 0);
        }
    }

    fn text_facts(&self) -> &TextFacts {
        self.text_facts.get_or_init(|| {
            let mut longest = 1;
            let mut control = Vec::new();
            for t in 0..self.n_vocab() {
                // SAFETY: `t` is in the vocabulary; the text is owned by the model.
                let (p, attr) = unsafe {
                    (
                        sys::llama_vocab_get_text(self.vocab(), t),
                        sys::llama_vocab_get_attr(self.vocab(), t),
                    )
                };
                if p.is_null() {
                    continue;
                }
                // SAFETY: non-null NUL-terminated string owned by the model.
                let text = unsafe { CStr::from_ptr(p) }.to_bytes();
                longest = longest.max(text.len());
                let special = sys::LLAMA_TOKEN_ATTR_CONTROL | sys::LLAMA_TOKEN_ATTR_UNKNOWN;
                if attr & special != 0 && !text.is_empty() {
                    control.push(text.to_vec());
                }
            }
            let control = (!control.is_empty())
                .then(|| aho_corasick::AhoCorasick::new(&control).ok())
                .flatten();
            TextFacts { longest, control }
        })
    }

    /// The most bytes of text one token can stand for: a prompt of more than `n_ctx` times
    /// this many bytes cannot fit a context of `n_ctx` tokens (so it can be refused without
    /// tokenizing it).
    pub fn max_token_bytes(&self) -> usize {
        self.text_facts().longest
    }

    /// Whether `text` holds the text of a control token (`<|im_end|>`, `<start_of_turn>`):
    /// what tokenizing with `parse_special` would turn into one.
    pub fn has_control_text(&self, text: &str) -> bool {
        self.text_facts()
            .control
            .as_ref()
            .is_some_and(|ac| ac.is_match(text))
    }

    /// `messages` in the model's chat template, as tokens: the template's own control tokens
    /// (`<|im_start|>`, `<start_of_turn>`) as control tokens, the messages' text as text (a
    /// message that says `<|im_end|>` cannot end its turn). BOS as the model wants it.
    ///
    /// When no message holds control-token text (nearly always), these are the tokens of the
    /// rendered prompt tokenized whole with `parse_special`, as llama-server tokenizes it.
    /// Otherwise the prompt is tokenized piece by piece: the template's text between the
    /// messages with `parse_special`, each message's text without.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] when llama.cpp cannot apply the template, or when it changes
    /// a message that holds control-token text in a way this cannot follow; tokenization.
    pub fn chat_tokens(&self, messages: &[ChatMessage], add_assistant: bool) -> Result<Vec<Token>> {
        let text = self.apply_chat_template(messages, add_assistant)?;
        if !messages.iter().any(|m| self.has_control_text(&m.content)) {
            return self.tokenize(&text, true, true);
        }
        let pieces = self.template_pieces(messages, add_assistant, &text)?;
        let mut out = Vec::new();
        if self.add_bos() {
            out.extend(self.token_bos());
        }
        for (i, (piece, is_message)) in pieces.iter().enumerate() {
            let mut toks = self.tokenize(piece, false, !is_message)?;
            // The template may begin with BOS's text itself: one BOS, as a whole tokenize
            // would give (llama.cpp warns about two).
            if i == 0 && !out.is_empty() && toks.first() == out.first() {
                toks.remove(0);
            }
            out.extend(toks);
        }
        Ok(out)
    }

    /// `text` (the messages rendered) cut into the template's own text and the messages' text,
    /// in order: `(piece, true)` for a message's. The template's pieces come from rendering
    /// it with markers for the messages; each message's text is found between them as the
    /// template wrote it (whole, or trimmed as some templates do).
    fn template_pieces(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
        text: &str,
    ) -> Result<Vec<(String, bool)>> {
        let mark = |i: usize| format!("\u{E000}{i}\u{E001}");
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                role: m.role.clone(),
                content: mark(i),
            })
            .collect();
        let skeleton = self.apply_chat_template(&marked, add_assistant)?;
        // Alternate template text and message indices, as the markers appear.
        let mut parts: Vec<Result<String, usize>> = Vec::new();
        let mut rest = skeleton.as_str();
        while let Some(at) = rest.find('\u{E000}') {
            let end = rest[at..].find('\u{E001}').map(|e| at + e);
            let idx = end.and_then(|e| rest[at + 3..e].parse::<usize>().ok());
            let (Some(end), Some(idx)) = (end, idx.filter(|&i| i < messages.len())) else {
                break;
            };
            parts.push(Ok(rest[..at].to_string()));
            parts.push(Err(idx));
            rest = &rest[end + 3..];
        }
        parts.push(Ok(rest.to_string()));
        let changed = || Error::ChatTemplate {
            reason: "this model's chat template changes message text in a way Leap cannot \
                     follow, and a message holds control-token text"
                .into(),
        };
        let mut out = Vec::new();
        let mut at = 0;
        for (k, part) in parts.iter().enumerate() {
            match part {
                Ok(t) => {
                    if !text[at..].starts_with(t.as_str()) {
                        return Err(changed());
                    }
                    at += t.len();
                    out.push((t.clone(), false));
                }
                Err(i) => {
                    let c = messages[*i].content.as_str();
                    let next = match parts.get(k + 1) {
                        Some(Ok(t)) => t.as_str(),
                        _ => "",
                    };
                    let last = k + 2 == parts.len();
                    let found = [c, c.trim(), c.trim_start(), c.trim_end()]
                        .into_iter()
                        .find(|cand| {
                            let after = &text[at..];
                            after.starts_with(cand)
                                && if last {
                                    after[cand.len()..] == *next
                                } else {
                                    after[cand.len()..].starts_with(next)
                                }
                        })
                        .ok_or_else(changed)?;
                    at += found.len();
                    out.push((found.to_string(), true));
                }
            }
        }
        if at != text.len() {
            return Err(changed());
        }
        Ok(out.into_iter().filter(|(p, _)| !p.is_empty()).collect())
    }

    /// Use `tmpl` (the name of a template llama.cpp knows, `chatml`, `llama3`, `gemma`, ...,
    /// or a template's text) for chats instead of the GGUF's, as llama.cpp's
    /// `--chat-template`; once per model.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] for a template llama.cpp does not know (tried on a message
    /// first), or a second call.
    pub fn set_chat_template(&self, tmpl: &str) -> Result<()> {
        let probe = ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        };
        apply_template(tmpl, &[probe], true).map_err(|e| match e {
            Error::ChatTemplate { .. } => Error::ChatTemplate {
                reason: "llama.cpp knows no such template: give one's name (chatml, llama3, \
                         gemma, phi3, mistral-v7, ...) or a template's text"
                    .into(),
            },
            e => e,
        })?;
        self.template
            .set(tmpl.to_string())
            .map_err(|_| Error::ChatTemplate {
                reason: "the chat template was already set".into(),
            })
    }

    /// The chat template chats use: [`Model::set_chat_template`]'s, or the GGUF's default.
    pub fn chat_template_in_use(&self) -> Option<String> {
        self.template
            .get()
            .cloned()
            .or_else(|| self.chat_template(None))
    }

    /// The model's chat template (the default one when `name` is `None`).
    pub fn chat_template(&self, name: Option<&str>) -> Option<String> {
        let cname = name.map(CString::new).transpose().ok()?;
        // SAFETY: `cname` is null or NUL-terminated; the result is owned by the model.
        let p = unsafe {
            sys::llama_model_chat_template(
                self.raw(),
                cname.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null NUL-terminated string owned by the model.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// Render `messages` with the model's chat template; `add_assistant` appends the prefix
    /// that starts the assistant's turn. A model without a template gets ChatML, as
    /// llama-server gives it (with a warning, once).
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] when llama.cpp cannot apply the template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String> {
        let tmpl = self.chat_template_in_use().unwrap_or_else(|| {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                log::warn!(
                    "{} has no chat template; using ChatML, as llama-server does",
                    self.path.display()
                );
            });
            "chatml".to_string()
        });
        apply_template(&tmpl, messages, add_assistant)
    }
}

/// Render `messages` with the chat template `tmpl` (a Jinja template from a GGUF, or the name
/// of one llama.cpp knows, e.g. `chatml`), as [`Model::apply_chat_template`] does; no model
/// needed. llama.cpp recognises the template by its text and formats with its own code.
///
/// # Errors
/// [`Error::NulByte`] for a NUL in the template or a message, [`Error::ChatTemplate`] when
/// llama.cpp does not know the template.
pub fn apply_template(tmpl: &str, messages: &[ChatMessage], add_assistant: bool) -> Result<String> {
    let ctmpl = CString::new(tmpl).map_err(|_| Error::NulByte {
        what: "chat template",
    })?;
    let owned: Vec<(CString, CString)> = messages
        .iter()
        .map(|m| {
            Ok((
                CString::new(m.role.as_str())?,
                CString::new(m.content.as_str())?,
            ))
        })
        .collect::<Result<_, std::ffi::NulError>>()
        .map_err(|_| Error::NulByte {
            what: "chat message",
        })?;
    let msgs: Vec<sys::llama_chat_message> = owned
        .iter()
        .map(|(r, c)| sys::llama_chat_message {
            role: r.as_ptr(),
            content: c.as_ptr(),
        })
        .collect();
    let mut buf = vec![0u8; 256 + messages.iter().map(|m| m.content.len() * 2).sum::<usize>()];
    loop {
        // SAFETY: `ctmpl` and every string in `msgs` (owned by `owned`) are NUL-terminated
        // and live across the call; `buf` has `buf.len()` writable bytes.
        let n = unsafe {
            sys::llama_chat_apply_template(
                ctmpl.as_ptr(),
                msgs.as_ptr(),
                msgs.len(),
                add_assistant,
                buf.as_mut_ptr().cast(),
                buf.len() as i32,
            )
        };
        if n < 0 {
            return Err(Error::ChatTemplate {
                reason: "llama.cpp does not support this model's chat template".into(),
            });
        }
        if (n as usize) <= buf.len() {
            buf.truncate(n as usize);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        buf.resize(n as usize, 0);
    }
}
