use std::path::PathBuf;

/// Everything that can go wrong between Leap and llama.cpp.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file does not exist.
    #[error("model file {path} does not exist; `leap models` lists the models Leap can fetch")]
    ModelNotFound { path: PathBuf },
    /// The file is not a GGUF ggml can read (bad magic, bad header, truncated metadata).
    #[error("{path} is not a valid GGUF file: {reason}")]
    InvalidGguf { path: PathBuf, reason: String },
    /// The GGUF header is fine but its tensor data runs past the end of the file.
    #[error(
        "{path} is truncated: its tensors need {expected} bytes but the file has {actual}; \
         download or assemble it again (`leap models fetch`)"
    )]
    TruncatedGguf {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    /// llama.cpp refused to load the model.
    #[error("llama.cpp could not load {path}: {reason}")]
    ModelLoad { path: PathBuf, reason: String },
    /// llama.cpp could not create a context.
    #[error("llama.cpp could not create a context (n_ctx {n_ctx}): {reason}")]
    ContextInit { n_ctx: u32, reason: String },
    /// `llama_decode` found no room in the KV cache.
    #[error(
        "no KV-cache slot for a batch of {n_tokens} tokens (context {n_ctx}); \
         raise --ctx or shorten the prompt"
    )]
    KvCacheFull { n_tokens: usize, n_ctx: u32 },
    /// A decode's observer stopped it for a failure (a streamed model file that changed).
    #[error("decode stopped: {reason}")]
    Stopped { reason: String },
    /// The check set with `Context::set_cancel` stopped `llama_decode` (the caller gave up
    /// on the work: a client hung up).
    #[error("cancelled")]
    Cancelled,
    /// `llama_decode` was aborted by the abort callback.
    #[error("llama_decode was aborted")]
    Aborted,
    /// `llama_decode` rejected the batch.
    #[error("llama_decode rejected the batch of {n_tokens} tokens: {reason}")]
    InvalidBatch { n_tokens: usize, reason: String },
    /// Any other `llama_decode` failure.
    #[error("llama_decode failed with status {code}: {reason}")]
    Decode { code: i32, reason: String },
    /// A batch was filled past the capacity it was made with.
    #[error("batch is full: capacity {capacity} tokens")]
    BatchFull { capacity: usize },
    /// A token was given more sequence ids than the batch was made for.
    #[error("a token has {given} sequence ids but the batch allows {max}")]
    TooManySeqIds { given: usize, max: usize },
    /// A sequence id is outside the context's `n_seq_max`.
    #[error("sequence id {seq} is outside 0..{n_seq_max}; create the context with more sequences")]
    SeqIdOutOfRange { seq: i32, n_seq_max: u32 },
    /// Logits were asked for a batch row that did not request output.
    #[error("no logits for batch row {row}: the row was not marked for output in the last decode")]
    NoLogits { row: i32 },
    /// A token id outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {n_vocab} tokens")]
    InvalidToken { token: i32, n_vocab: i32 },
    /// Tokenization failed.
    #[error("tokenizing {len} bytes of text failed (status {code})")]
    Tokenize { len: usize, code: i32 },
    /// A grammar (GBNF) llama.cpp cannot parse, or a JSON schema it cannot turn into one.
    #[error("{what}: {reason}")]
    Grammar { what: &'static str, reason: String },
    /// The model has no chat template, or applying it failed.
    #[error("chat template: {reason}")]
    ChatTemplate { reason: String },
    /// A string handed to C contained a NUL byte.
    #[error("{what} contains a NUL byte")]
    NulByte { what: &'static str },
    /// llama.cpp's speculative decoding (the anchor) failed.
    #[error("llama.cpp speculative decoding ({kind}): {reason}")]
    Speculative { kind: String, reason: String },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
