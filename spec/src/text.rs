//! A generation's bytes as front ends hand them on: complete UTF-8 only. A token may end
//! inside a multi-byte character (byte-fallback tokens); its bytes wait for the token that
//! completes it. `leap generate`, `leap serve` and the C API all stream through this; the last
//! two cut the text at stop strings too ([`TextOut`]).

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

/// A generation's text as it may be sent: complete UTF-8 only ([`TextStream`]), and never
/// text that could be the start of a stop string (held back until it is known not to be
/// one). At a stop string the text before it is the output and the rest is dropped.
#[derive(Debug, Default)]
pub struct TextOut {
    utf8: TextStream,
    /// The complete characters so far.
    text: String,
    /// How much of `text` went out.
    sent: usize,
    stops: Vec<String>,
    /// A stop string was found.
    pub stopped: bool,
}

impl TextOut {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Default::default()
        }
    }

    /// Add a token's bytes; returns the text that may go out now, and whether a stop string
    /// ended the output.
    pub fn push(&mut self, piece: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.text.push_str(&self.utf8.push(piece));
        let text = self.text.as_str();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string can only end in the new text: search from where one could start.
        let mut from = self.sent.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            self.stopped = true;
            let out = text.get(self.sent..at).unwrap_or("").to_string();
            self.sent = at.max(self.sent);
            return (out, true);
        }
        // Hold back the longest tail that begins some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
                    .take(1)
            })
            .max()
            .unwrap_or(0);
        let upto = text.len() - hold;
        if upto <= self.sent {
            return (String::new(), false);
        }
        let out = text[self.sent..upto].to_string();
        self.sent = upto;
        (out, false)
    }

    /// The end of the generation: whatever was held back (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(&self.utf8.finish());
        let rest = self.text[self.sent..].to_string();
        self.sent = self.text.len();
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

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, String, bool) {
        let mut t = TextOut::new(stops.iter().map(|s| s.to_string()).collect());
        let mut outs = Vec::new();
        for p in pieces {
            let (o, stop) = t.push(p);
            outs.push(o);
            if stop {
                break;
            }
        }
        let rest = t.finish();
        let all = outs.concat() + &rest;
        (outs, all, t.stopped)
    }

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let e = "é".as_bytes();
        let (outs, all, _) = run(&[], &[b"caf", &e[..1], &e[1..], b"!"]);
        assert_eq!(outs, vec!["caf", "", "é", "!"]);
        assert_eq!(all, "café!");
    }

    #[test]
    fn stop_strings_cut_the_output_even_across_tokens() {
        let (outs, all, stopped) = run(&["\n\n"], &[b"one", b"\n", b"\ntwo"]);
        assert!(stopped);
        assert_eq!(all, "one");
        // The first newline was held back: it could have started the stop string.
        assert_eq!(outs, vec!["one", "", ""]);
        let (_, all, stopped) = run(&["END"], &[b"abc E", b"N", b"D more"]);
        assert!(stopped);
        assert_eq!(all, "abc ");
    }

    #[test]
    fn a_held_back_prefix_that_is_not_a_stop_goes_out() {
        let (outs, all, stopped) = run(&["STOP"], &[b"ST", b"ART", b"S"]);
        assert!(!stopped);
        assert_eq!(outs, vec!["", "START", ""]);
        assert_eq!(all, "STARTS");
    }

    #[test]
    fn the_earliest_stop_wins() {
        let (_, all, _) = run(&["b", "a"], &[b"xxab"]);
        assert_eq!(all, "xx");
    }
}
