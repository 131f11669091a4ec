//! Where each part of a model lives in its GGUF file.

use std::ops::Range;
use std::path::Path;

use leap_host::GgufInfo;

/// A part of the model that is resident or streamed as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Section {
    /// Transformer block `i` (`blk.i.*`).
    Block(usize),
    /// The token embeddings (`token_embd.weight`): a call reads only its tokens' rows, unless
    /// the output projection is tied to it.
    Embed,
    /// The output projection (`output.weight`), absent when tied to the embeddings.
    Output,
    /// Everything else (final norm, rope factors, ...).
    Rest,
}

/// Byte ranges of every section of a GGUF model (absolute file offsets, sorted, merged
/// where adjacent).
#[derive(Debug, Clone)]
pub struct LayerMap {
    /// The file's size when mapped.
    pub file_size: u64,
    /// Per section, its ranges.
    pub sections: Vec<(Section, Vec<Range<u64>>)>,
    /// Whether the output projection is the embedding matrix (Gemma): then every target call
    /// reads all of [`Section::Embed`].
    pub tied_output: bool,
}

impl LayerMap {
    /// The map of the GGUF at `path`.
    ///
    /// # Errors
    /// The file cannot be parsed.
    pub fn open(path: &Path) -> crate::Result<Self> {
        Ok(Self::from_info(&GgufInfo::open(path)?))
    }

    /// The map of a parsed GGUF.
    pub fn from_info(info: &GgufInfo) -> Self {
        let mut by: std::collections::BTreeMap<Section, Vec<Range<u64>>> = Default::default();
        let mut tied_output = true;
        for t in &info.tensors {
            let s = match (t.block(), t.name.as_str()) {
                (Some(b), _) => Section::Block(b as usize),
                (None, "token_embd.weight") => Section::Embed,
                (None, "output.weight") => {
                    tied_output = false;
                    Section::Output
                }
                _ => Section::Rest,
            };
            by.entry(s).or_default().push(t.offset..t.offset + t.size);
        }
        let sections = by
            .into_iter()
            .map(|(s, mut r)| {
                r.sort_by_key(|r| r.start);
                let mut merged: Vec<Range<u64>> = Vec::with_capacity(r.len());
                for x in r {
                    match merged.last_mut() {
                        // ggml aligns tensor data to 32 bytes: a gap that small is padding.
                        Some(m) if x.start <= m.end + 64 => m.end = m.end.max(x.end),
                        _ => merged.push(x),
                    }
                }
                (s, merged)
            })
            .collect();
        Self {
            file_size: info.file_size,
            sections,
            tied_output,
        }
    }

    /// Bytes of `s` (0 if the model has no such section).
    pub fn bytes(&self, s: Section) -> u64 {
        self.ranges(s).iter().map(|r| r.end - r.start).sum()
    }

    /// Ranges of `s`.
    pub fn ranges(&self, s: Section) -> &[Range<u64>] {
        self.sections
            .iter()
            .find(|(x, _)| *x == s)
            .map_or(&[], |(_, r)| r.as_slice())
    }

    /// Transformer blocks.
    pub fn blocks(&self) -> usize {
        self.sections
            .iter()
            .filter(|(s, _)| matches!(s, Section::Block(_)))
            .count()
    }

    /// Bytes of every section.
    pub fn total(&self) -> u64 {
        self.sections
            .iter()
            .flat_map(|(_, r)| r)
            .map(|r| r.end - r.start)
            .sum()
    }

    /// Bytes a target call reads: every section of [`LayerMap::per_call`].
    pub fn per_call_bytes(&self) -> u64 {
        self.per_call().iter().map(|&s| self.bytes(s)).sum()
    }

    /// Bytes of the largest block: the streaming unit (the output projection streams in
    /// chunks of that size).
    pub fn largest_block(&self) -> u64 {
        (0..self.blocks())
            .map(|i| self.bytes(Section::Block(i)))
            .max()
            .unwrap_or(0)
    }

    /// The sections a target call reads all of, in the order it reads them: blocks, then the
    /// output projection (the embedding matrix when tied), then the rest (small).
    pub fn per_call(&self) -> Vec<Section> {
        let mut v: Vec<Section> = (0..self.blocks()).map(Section::Block).collect();
        v.push(if self.tied_output {
            Section::Embed
        } else {
            Section::Output
        });
        v.push(Section::Rest);
        v
    }
}
