//! Line framing with a hard memory bound.
//!
//! [`LineReader`] splits a byte stream on LF (a trailing CR is dropped) and never holds more than
//! `limit` bytes of one line plus one fixed read chunk. A line longer than the limit is discarded up
//! to its newline without being buffered whole; the caller learns its length and a short prefix for
//! the log.

use std::io::{self, Read};

/// The read chunk. Lines are assembled from chunks of this size, so memory is `limit + CHUNK`.
const CHUNK: usize = 64 * 1024;

/// How many bytes of an over-long line are kept for the log.
pub const PREFIX_BYTES: usize = 256;

/// Lines above this capacity give their buffer back after use, so that one large line does not pin
/// `limit` bytes for the life of the worker.
const RETAINED_CAPACITY: usize = 1024 * 1024;

/// One frame read from the stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A complete line without its LF (and without a CR before it).
    Line(&'a [u8]),
    /// A line longer than the limit, already discarded.
    TooLong {
        /// The first bytes of the line, at most [`PREFIX_BYTES`].
        prefix: &'a [u8],
        /// The line's full length in bytes (without its terminator).
        length: u64,
    },
}

/// Reads LF-terminated lines of at most `limit` bytes from `R`.
///
/// Guarantees: memory held is at most `limit + 64 KiB` whatever the input; an over-long line is
/// reported once, as [`Frame::TooLong`], and reading resumes at the next line; a final line without a
/// terminator is returned as a line at end of stream. Blocks only inside `R::read`.
pub struct LineReader<R> {
    inner: R,
    chunk: Box<[u8]>,
    start: usize,
    end: usize,
    line: Vec<u8>,
    limit: usize,
    /// `Some(length so far)` while discarding an over-long line.
    discarding: Option<u64>,
    eof: bool,
}

impl<R: Read> LineReader<R> {
    /// A reader that refuses lines longer than `limit` bytes.
    pub fn new(inner: R, limit: usize) -> LineReader<R> {
        LineReader {
            inner,
            chunk: vec![0; CHUNK].into_boxed_slice(),
            start: 0,
            end: 0,
            line: Vec::new(),
            limit,
            discarding: None,
            eof: false,
        }
    }

    /// The capacity currently held for line assembly (for tests of the memory bound).
    pub fn line_capacity(&self) -> usize {
        self.line.capacity()
    }

    /// The next frame, or `Ok(None)` at end of stream. Interrupted reads are retried; any other read
    /// error is returned.
    pub fn next_frame(&mut self) -> io::Result<Option<Frame<'_>>> {
        if self.line.capacity() > RETAINED_CAPACITY {
            self.line = Vec::new();
        }
        self.line.clear();
        loop {
            if self.start == self.end {
                if self.eof {
                    return Ok(self.finish_at_eof());
                }
                self.fill()?;
                continue;
            }
            let available = &self.chunk[self.start..self.end];
            match memchr::memchr(b'\n', available) {
                Some(newline) => {
                    let (from, to) = (self.start, self.start + newline);
                    self.start = to + 1;
                    if self.line.is_empty() && self.discarding.is_none() && newline <= self.limit {
                        // The whole line is inside the chunk: lend it from there, uncopied.
                        return Ok(Some(Frame::Line(without_cr(&self.chunk[from..to]))));
                    }
                    self.take(from, to);
                    return Ok(Some(self.complete()));
                }
                None => {
                    self.take(self.start, self.end);
                    self.start = self.end;
                }
            }
        }
    }

    /// Appends `chunk[from..to]` to the current line, or counts it when discarding.
    fn take(&mut self, from: usize, to: usize) {
        let piece = to - from;
        if let Some(length) = &mut self.discarding {
            *length += piece as u64;
            return;
        }
        if self.line.len() + piece > self.limit {
            let length = (self.line.len() + piece) as u64;
            let keep = PREFIX_BYTES.saturating_sub(self.line.len()).min(piece);
            self.line.extend_from_slice(&self.chunk[from..from + keep]);
            self.line.truncate(PREFIX_BYTES);
            self.discarding = Some(length);
            return;
        }
        let needed = self.line.len() + piece;
        if needed > self.line.capacity() {
            // Grow geometrically but never past the limit, so the bound is `limit`, not `2 * limit`.
            let target = (self.line.capacity() * 2).max(needed).min(self.limit);
            self.line.reserve_exact(target - self.line.len());
        }
        self.line.extend_from_slice(&self.chunk[from..to]);
    }

    fn complete(&mut self) -> Frame<'_> {
        if let Some(length) = self.discarding.take() {
            return Frame::TooLong {
                prefix: &self.line,
                length,
            };
        }
        Frame::Line(without_cr(&self.line))
    }

    fn finish_at_eof(&mut self) -> Option<Frame<'_>> {
        if self.discarding.is_none() && self.line.is_empty() {
            return None;
        }
        Some(self.complete())
    }

    fn fill(&mut self) -> io::Result<()> {
        loop {
            match self.inner.read(&mut self.chunk) {
                Ok(0) => {
                    self.eof = true;
                    self.start = 0;
                    self.end = 0;
                    return Ok(());
                }
                Ok(n) => {
                    self.start = 0;
                    self.end = n;
                    return Ok(());
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            }
        }
    }
}

/// `line` without the CR that ends it, if one does.
fn without_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line, or the prefix and length of an over-long one.
    type Owned = Result<Vec<u8>, (Vec<u8>, u64)>;

    /// The frames of `input`, which must be the same whether a line arrives in one read (and is
    /// lent from the chunk) or spread over reads of 1, 2 or 3 bytes (and is assembled). An
    /// over-long line's prefix may be shorter when it arrives in pieces: it holds what had arrived
    /// when the line went over the limit.
    fn frames(input: &[u8], limit: usize) -> Vec<Owned> {
        let whole = frames_of(input, limit);
        for step in 1..=3 {
            let dribbled = frames_of(Dribble { rest: input, step }, limit);
            assert_eq!(dribbled.len(), whole.len(), "reads of {step} bytes");
            for (piecemeal, at_once) in dribbled.iter().zip(&whole) {
                match (piecemeal, at_once) {
                    (Err((short, length)), Err((prefix, same))) => {
                        assert_eq!(length, same, "reads of {step} bytes");
                        assert!(
                            prefix.starts_with(short) && short.len() >= limit.min(prefix.len())
                        );
                    }
                    _ => assert_eq!(piecemeal, at_once, "reads of {step} bytes"),
                }
            }
        }
        whole
    }

    /// Gives out its bytes `step` at a time.
    struct Dribble<'a> {
        rest: &'a [u8],
        step: usize,
    }

    impl Read for Dribble<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.step.min(buf.len()).min(self.rest.len());
            buf[..n].copy_from_slice(&self.rest[..n]);
            self.rest = &self.rest[n..];
            Ok(n)
        }
    }

    fn frames_of(input: impl Read, limit: usize) -> Vec<Owned> {
        let mut reader = LineReader::new(input, limit);
        let mut out = Vec::new();
        while let Some(frame) = reader.next_frame().unwrap() {
            out.push(match frame {
                Frame::Line(line) => Ok(line.to_vec()),
                Frame::TooLong { prefix, length } => Err((prefix.to_vec(), length)),
            });
        }
        out
    }

    #[test]
    fn splits_on_lf_and_drops_a_trailing_cr() {
        assert_eq!(
            frames(b"a\nbc\r\n\nd\re\n", 100),
            vec![
                Ok(b"a".to_vec()),
                Ok(b"bc".to_vec()),
                Ok(b"".to_vec()),
                Ok(b"d\re".to_vec())
            ]
        );
    }

    #[test]
    fn a_final_line_without_terminator_is_returned() {
        assert_eq!(
            frames(b"a\nlast", 100),
            vec![Ok(b"a".to_vec()), Ok(b"last".to_vec())]
        );
        assert!(frames(b"", 100).is_empty());
    }

    #[test]
    fn over_long_lines_are_reported_once_and_reading_resumes() {
        let mut input = vec![b'x'; 1000];
        input.extend_from_slice(b"\nok\n");
        let out = frames(&input, 10);
        assert_eq!(out.len(), 2);
        let Err((prefix, length)) = &out[0] else {
            panic!("expected too long")
        };
        assert_eq!(*length, 1000);
        assert_eq!(prefix.len(), 256);
        assert_eq!(out[1], Ok(b"ok".to_vec()));
    }

    #[test]
    fn a_line_of_exactly_the_limit_is_accepted() {
        let mut input = vec![b'y'; 10];
        input.push(b'\n');
        assert_eq!(frames(&input, 10), vec![Ok(vec![b'y'; 10])]);
        let mut input = vec![b'y'; 11];
        input.push(b'\n');
        assert!(frames(&input, 10)[0].is_err());
    }

    /// Yields `remaining` bytes of `x` without ever holding them, then EOF.
    struct Endless {
        remaining: u64,
    }

    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = (buf.len() as u64).min(self.remaining) as usize;
            buf[..n].fill(b'x');
            self.remaining -= n as u64;
            Ok(n)
        }
    }

    #[test]
    fn a_100_mib_line_never_grows_the_buffer_past_the_limit() {
        let limit = 1024 * 1024;
        let total = 100 * 1024 * 1024;
        let mut reader = LineReader::new(Endless { remaining: total }, limit);
        match reader.next_frame().unwrap() {
            Some(Frame::TooLong { length, .. }) => assert_eq!(length, total),
            other => panic!("expected TooLong, got {other:?}"),
        }
        assert!(reader.line_capacity() <= limit);
        assert!(reader.next_frame().unwrap().is_none());
    }
}
