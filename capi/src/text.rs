//! A generation's bytes as the token callback gets them: complete UTF-8 only. A token may end
//! inside a multi-byte character (byte-fallback tokens); its bytes wait for the token that
//! completes it.

/// Token bytes in, complete UTF-8 out.
#[derive(Debug, Default)]
pub struct TextStream {
    /// Bytes of a character not yet complete (at most 3).
    pending: Vec<u8>,
}

impl TextStream {
    /// Add one token's bytes; returns the text they complete. Bytes that can never be UTF-8
    /// become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut at = 0;
        while at < self.pending.len() {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    out.push_str(s);
                    at = self.pending.len();
                }
                Err(e) => {
                    let valid = &self.pending[at..at + e.valid_up_to()];
                    out.push_str(&String::from_utf8_lossy(valid));
                    at += e.valid_up_to();
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            at += n;
                        }
                        // An incomplete character at the end: keep it for the next token.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..at);
        out
    }

    /// What is left when the generation ends: an incomplete character, as U+FFFD (or "").
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
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
    }

    #[test]
    fn an_unfinished_character_is_flushed_at_the_end() {
        let mut t = TextStream::default();
        assert_eq!(t.push(b"ok \xe2\x82"), "ok ");
        assert_eq!(t.finish(), "\u{FFFD}");
        assert_eq!(t.finish(), "");
    }
}
