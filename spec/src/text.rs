//! A generation's bytes as front ends hand them on: complete UTF-8 only. A token may end
//! inside a multi-byte character (byte-fallback tokens); its bytes wait for the token that
//! completes it. `leap generate`, `leap serve` and the C API all stream through this.

/// Token bytes in, complete characters out.
#[derive(Debug, Default)]
pub struct TextStream {
    /// Bytes of a character not yet complete (at most 3).
    pending: Vec<u8>,
}

/// How many leading bytes of `b` can go out now: all but an incomplete character at the end
/// (bytes that can never be UTF-8 go out as they are).
fn ready(b: &[u8]) -> usize {
    let mut at = 0;
    while at < b.len() {
        match std::str::from_utf8(&b[at..]) {
            Ok(_) => return b.len(),
            Err(e) => match e.error_len() {
                Some(n) => at += e.valid_up_to() + n,
                None => return at + e.valid_up_to(),
            },
        }
    }
    b.len()
}

impl TextStream {
    /// Add one token's bytes; returns the bytes that are ready (complete characters, and
    /// bytes that can never be UTF-8, unchanged).
    pub fn push_bytes(&mut self, piece: &[u8]) -> Vec<u8> {
        self.pending.extend_from_slice(piece);
        let n = ready(&self.pending);
        self.pending.drain(..n).collect()
    }

    /// [`TextStream::push_bytes`] as text: bytes that can never be UTF-8 become U+FFFD.
    pub fn push(&mut self, piece: &[u8]) -> String {
        String::from_utf8_lossy(&self.push_bytes(piece)).into_owned()
    }

    /// What is left when the generation ends: an incomplete character's bytes.
    pub fn finish_bytes(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }

    /// [`TextStream::finish_bytes`] as text (U+FFFD, or "").
    pub fn finish(&mut self) -> String {
        String::from_utf8_lossy(&self.finish_bytes()).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_character_arrives_whole() {
        let mut t = TextStream::default();
        let e = "é".as_bytes(); // C3 A9
        assert_eq!(t.push(b"caf"), "caf");
        assert_eq!(t.push(&e[..1]), "");
        assert_eq!(t.push(&[e[1], b'!']), "é!");
        let euro = "€".as_bytes(); // E2 82 AC, one byte per token
        assert_eq!(t.push(&euro[..1]), "");
        assert_eq!(t.push(&euro[1..2]), "");
        assert_eq!(t.push(&euro[2..]), "€");
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn bytes_that_are_never_utf8_become_replacements() {
        let mut t = TextStream::default();
        assert_eq!(t.push(b"a\xffb"), "a\u{FFFD}b");
        // A lead byte followed by a non-continuation byte.
        assert_eq!(t.push(b"\xc3"), "");
        assert_eq!(t.push(b"x"), "\u{FFFD}x");
        // As bytes, they pass unchanged.
        assert_eq!(t.push_bytes(b"a\xffb"), b"a\xffb");
    }

    #[test]
    fn an_unfinished_character_is_flushed_at_the_end() {
        let mut t = TextStream::default();
        assert_eq!(t.push(b"ok \xe2\x82"), "ok ");
        assert_eq!(t.finish(), "\u{FFFD}");
        assert_eq!(t.finish(), "");
        assert_eq!(t.push_bytes(b"\xe2\x82"), b"");
        assert_eq!(t.finish_bytes(), b"\xe2\x82");
    }
}
