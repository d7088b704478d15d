//! The on-disk format of journal segments, version [`FORMAT_VERSION`] (docs/JOURNAL.md).
//!
//! A segment starts with a 16-byte header: [`MAGIC`], the format version (u32 LE) and the CRC32C
//! of those 12 bytes (u32 LE). Frames follow back to back. All integers are little-endian.
//!
//! ```text
//! offset size
//!  0     4    body length L (at most MAX_BODY_LEN)
//!  4     4    frame CRC32C   over bytes [0,4) ++ [12, 56+L)   (length, address and body)
//!  8     4    address CRC32C over bytes [0,4) ++ [12, 56)     (length and address)
//! 12     1    frame type: 1 record, 2 tombstone
//! 13     3    reserved, zero
//! 16     8    sequence (a tombstone: the deleted stream's last sequence)
//! 24     8    recorded_at_ms
//! 32    24    session id (ASCII)
//! 56     L    body: a record's JSON object {"kind", "origin"?, "data"}; empty for a tombstone
//! ```
//!
//! The address checksum lets recovery trust a frame's length and session even when its body is
//! damaged, so a damaged body refuses exactly one session and the scan goes on past it. A valid
//! frame never ends with a zero byte (a JSON object ends with `}`, a tombstone with the last
//! character of a session id), which the torn-tail rule of recovery relies on.

use super::NewRecord;
use super::crc::{Crc32c, crc32c};
use crate::protocol::harness::{EventOrigin, RecordKind};
use crate::session::SessionId;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The first 8 bytes of every segment.
pub(crate) const MAGIC: [u8; 8] = *b"BRAINJNL";
/// The version of this format, in every segment header.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// The size of a segment header.
pub(crate) const SEGMENT_HEADER_LEN: u64 = 16;
/// The bytes of a frame before its body: the three words and the address.
pub(crate) const FRAME_OVERHEAD: usize = 56;
/// The largest body a frame may declare; checked before anything is allocated.
pub(crate) const MAX_BODY_LEN: u32 = 64 << 20;
/// The size of a session id in a frame.
const SESSION_LEN: usize = 24;

const TYPE_RECORD: u8 = 1;
const TYPE_TOMBSTONE: u8 = 2;

/// The segment header of this format version.
pub(crate) fn segment_header() -> [u8; 16] {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    let crc = crc32c(&header[..12]);
    header[12..].copy_from_slice(&crc.to_le_bytes());
    header
}

/// What is wrong with a segment header.
#[derive(Debug, PartialEq)]
pub(crate) enum HeaderError {
    /// Not a journal segment header (or a damaged one).
    Invalid(String),
    /// A well-formed header of another format version.
    OtherVersion(u32),
}

/// Checks a segment header.
pub(crate) fn check_segment_header(header: &[u8; 16]) -> Result<(), HeaderError> {
    if header[..8] != MAGIC {
        return Err(HeaderError::Invalid("no segment magic".to_owned()));
    }
    let stored = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
    if crc32c(&header[..12]) != stored {
        return Err(HeaderError::Invalid(
            "segment header checksum mismatch".to_owned(),
        ));
    }
    let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if version != FORMAT_VERSION {
        return Err(HeaderError::OtherVersion(version));
    }
    Ok(())
}

/// Whether a frame holds a record or deletes a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameType {
    /// One record of a session's stream.
    Record,
    /// The session was deleted: every earlier frame of it is dead.
    Tombstone,
}

/// The part of a frame recovery reads without its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Address {
    pub(crate) frame_type: FrameType,
    pub(crate) session: SessionId,
    pub(crate) sequence: u64,
    pub(crate) recorded_at_ms: u64,
}

/// The first 12 bytes of a frame: body length and the two checksums.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Head {
    pub(crate) body_len: u32,
    frame_crc: u32,
    address_crc: u32,
}

impl Head {
    /// Reads the first 12 bytes of a frame. Nothing is checked yet.
    pub(crate) fn parse(bytes: &[u8; 12]) -> Head {
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        Head {
            body_len: word(0),
            frame_crc: word(4),
            address_crc: word(8),
        }
    }

    /// The whole frame's length as the head declares it.
    pub(crate) fn frame_len(&self) -> u64 {
        FRAME_OVERHEAD as u64 + u64::from(self.body_len)
    }

    /// Checks the address checksum (which covers the length too) and decodes the address.
    /// `address` is bytes 12..56 of the frame.
    pub(crate) fn check_address(&self, address: &[u8]) -> Result<Address, String> {
        let crc = Crc32c::new()
            .update(&self.body_len.to_le_bytes())
            .update(address)
            .finish();
        if crc != self.address_crc {
            return Err("address checksum mismatch".to_owned());
        }
        if self.body_len > MAX_BODY_LEN {
            return Err(format!(
                "body length {} beyond the maximum {MAX_BODY_LEN}",
                self.body_len
            ));
        }
        decode_address(address)
    }

    /// Checks the frame checksum over length, address and body.
    pub(crate) fn check_body(&self, address: &[u8], body: &[u8]) -> Result<(), String> {
        let crc = Crc32c::new()
            .update(&self.body_len.to_le_bytes())
            .update(address)
            .update(body)
            .finish();
        if crc == self.frame_crc {
            Ok(())
        } else {
            Err("frame checksum mismatch".to_owned())
        }
    }
}

fn decode_address(address: &[u8]) -> Result<Address, String> {
    if address.len() != FRAME_OVERHEAD - 12 {
        return Err(format!("address of {} bytes", address.len()));
    }
    let frame_type = match address[0] {
        TYPE_RECORD => FrameType::Record,
        TYPE_TOMBSTONE => FrameType::Tombstone,
        other => return Err(format!("unknown frame type {other}")),
    };
    // Checksummed, so not damage: a frame of another format. Refused rather than misread.
    if address[1..4] != [0, 0, 0] {
        return Err(format!(
            "reserved bytes {:?} are not zero (a frame of another format)",
            &address[1..4]
        ));
    }
    let u64_at = |at: usize| {
        let mut word = [0u8; 8];
        word.copy_from_slice(&address[at..at + 8]);
        u64::from_le_bytes(word)
    };
    let session = std::str::from_utf8(&address[20..20 + SESSION_LEN])
        .map_err(|_| "session id is not ASCII".to_owned())
        .and_then(SessionId::parse)?;
    Ok(Address {
        frame_type,
        session,
        sequence: u64_at(4),
        recorded_at_ms: u64_at(12),
    })
}

/// A whole frame for `address` and `body`. `body` is at most [`MAX_BODY_LEN`] bytes (the caller
/// checked); the session id has the fixed length of every [`SessionId`].
pub(crate) fn encode(address: &Address, body: &[u8]) -> Vec<u8> {
    let body_len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    debug_assert!(body_len <= MAX_BODY_LEN);
    let mut frame = Vec::with_capacity(FRAME_OVERHEAD + body.len());
    frame.extend_from_slice(&body_len.to_le_bytes());
    frame.extend_from_slice(&[0u8; 8]); // the checksums, filled in below
    frame.push(match address.frame_type {
        FrameType::Record => TYPE_RECORD,
        FrameType::Tombstone => TYPE_TOMBSTONE,
    });
    frame.extend_from_slice(&[0u8; 3]);
    frame.extend_from_slice(&address.sequence.to_le_bytes());
    frame.extend_from_slice(&address.recorded_at_ms.to_le_bytes());
    let id = address.session.as_str().as_bytes();
    debug_assert_eq!(id.len(), SESSION_LEN);
    let mut padded = [0u8; SESSION_LEN];
    let n = id.len().min(SESSION_LEN);
    padded[..n].copy_from_slice(&id[..n]);
    frame.extend_from_slice(&padded);
    let prefix = Crc32c::new()
        .update(&body_len.to_le_bytes())
        .update(&frame[12..FRAME_OVERHEAD]);
    let address_crc = prefix.finish();
    let frame_crc = prefix.update(body).finish();
    frame[4..8].copy_from_slice(&frame_crc.to_le_bytes());
    frame[8..12].copy_from_slice(&address_crc.to_le_bytes());
    frame.extend_from_slice(body);
    frame
}

/// Verifies a whole frame read back from disk and splits it into address and body.
pub(crate) fn decode(frame: &[u8]) -> Result<(Address, &[u8]), String> {
    if frame.len() < FRAME_OVERHEAD {
        return Err(format!("a frame of {} bytes is too short", frame.len()));
    }
    let mut head = [0u8; 12];
    head.copy_from_slice(&frame[..12]);
    let head = Head::parse(&head);
    if head.frame_len() != frame.len() as u64 {
        return Err(format!(
            "the frame declares {} bytes where {} were expected",
            head.frame_len(),
            frame.len()
        ));
    }
    let (address, body) = frame[12..].split_at(FRAME_OVERHEAD - 12);
    let decoded = head.check_address(address)?;
    head.check_body(address, body)?;
    Ok((decoded, body))
}

/// A record's body as written.
#[derive(Serialize)]
struct BodyOut<'a, D: ?Sized> {
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    origin: Option<EventOrigin>,
    data: &'a D,
}

/// A record's body as read.
#[derive(Deserialize)]
struct BodyIn {
    kind: String,
    #[serde(default)]
    origin: Option<EventOrigin>,
    data: Value,
}

/// The body of a frame holding `record`, or why it cannot be stored.
pub(crate) fn encode_body(record: &NewRecord) -> Result<Vec<u8>, String> {
    checked_body(
        record.kind,
        &BodyOut {
            kind: record.kind.as_str(),
            origin: record.origin,
            data: &record.data,
        },
    )
}

/// The body of a frame holding a record of `kind` whose data is `data` encoded (no origin). It
/// decodes as the [`NewRecord`] whose data is `data` as a `Value`; for an effect record's
/// data (JSON text, copied as it is) that is [`EffectRecord::to_record`](super::EffectRecord::to_record).
pub(crate) fn encode_typed_body(
    kind: RecordKind,
    data: &(impl Serialize + ?Sized),
) -> Result<Vec<u8>, String> {
    checked_body(
        kind,
        &BodyOut {
            kind: kind.as_str(),
            origin: None,
            data,
        },
    )
}

fn checked_body<D: Serialize + ?Sized>(
    kind: RecordKind,
    body: &BodyOut<'_, D>,
) -> Result<Vec<u8>, String> {
    let body = crate::protocol::to_json_vec(body)
        .map_err(|e| format!("the record cannot be encoded: {e}"))?;
    if body.len() > MAX_BODY_LEN as usize {
        return Err(format!(
            "a {kind} record of {} bytes is larger than the journal's limit of {MAX_BODY_LEN} bytes",
            body.len()
        ));
    }
    Ok(body)
}

/// Decodes a record's body.
pub(crate) fn decode_body(body: &[u8]) -> Result<NewRecord, String> {
    let body: BodyIn =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a record: {e}"))?;
    let kind = body
        .kind
        .parse::<RecordKind>()
        .map_err(|()| format!("unknown record kind {:?}", body.kind))?;
    Ok(NewRecord {
        kind,
        data: body.data,
        origin: body.origin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::OriginKind;
    use serde_json::json;

    fn address(frame_type: FrameType) -> Address {
        Address {
            frame_type,
            session: SessionId::parse("ses_0123456789abcdefABCD").unwrap(),
            sequence: 42,
            recorded_at_ms: 1_700_000_000_123,
        }
    }

    #[test]
    fn a_frame_round_trips_and_never_ends_with_zero() {
        let record = NewRecord {
            kind: RecordKind::EventEmitted,
            data: json!({"type": "x", "data": [1, 2]}),
            origin: Some(EventOrigin {
                kind: OriginKind::Client,
                sequence: 3,
            }),
        };
        let body = encode_body(&record).unwrap();
        let frame = encode(&address(FrameType::Record), &body);
        assert_eq!(frame.len(), FRAME_OVERHEAD + body.len());
        let (decoded, read_body) = decode(&frame).unwrap();
        assert_eq!(decoded, address(FrameType::Record));
        assert_eq!(decode_body(read_body).unwrap(), record);
        assert_ne!(frame.last(), Some(&0));

        let tombstone = encode(&address(FrameType::Tombstone), &[]);
        assert_eq!(tombstone.len(), FRAME_OVERHEAD);
        assert_eq!(decode(&tombstone).unwrap().0, address(FrameType::Tombstone));
        assert_ne!(tombstone.last(), Some(&0));
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let body = encode_body(&NewRecord {
            kind: RecordKind::KvSet,
            data: json!({"key": "k", "value": 1}),
            origin: None,
        })
        .unwrap();
        let frame = encode(&address(FrameType::Record), &body);
        for byte in 0..frame.len() {
            for bit in 0..8 {
                let mut damaged = frame.clone();
                damaged[byte] ^= 1 << bit;
                assert!(decode(&damaged).is_err(), "byte {byte} bit {bit}");
            }
        }
        // A damaged body leaves the address (and so the length) trustworthy.
        let mut damaged = frame.clone();
        damaged[FRAME_OVERHEAD + 2] ^= 0x10;
        let mut head = [0u8; 12];
        head.copy_from_slice(&damaged[..12]);
        let head = Head::parse(&head);
        assert!(head.check_address(&damaged[12..FRAME_OVERHEAD]).is_ok());
        assert!(
            head.check_body(&damaged[12..FRAME_OVERHEAD], &damaged[FRAME_OVERHEAD..])
                .is_err()
        );
    }

    #[test]
    fn a_checksummed_frame_with_reserved_bytes_set_is_refused() {
        let frame = encode(&address(FrameType::Tombstone), &[]);
        for at in 13..16 {
            let mut other = frame.clone();
            other[at] = 1;
            // Checksums that match, as a writer of another format would compute them.
            let prefix = Crc32c::new()
                .update(&other[..4])
                .update(&other[12..FRAME_OVERHEAD]);
            let crc = prefix.finish().to_le_bytes();
            other[4..8].copy_from_slice(&crc);
            other[8..12].copy_from_slice(&crc);
            let error = decode(&other).unwrap_err();
            assert!(error.contains("reserved bytes"), "byte {at}: {error}");
        }
    }

    #[test]
    fn lengths_are_checked_before_anything_is_allocated() {
        let mut frame = encode(&address(FrameType::Tombstone), &[]);
        frame[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut head = [0u8; 12];
        head.copy_from_slice(&frame[..12]);
        let head = Head::parse(&head);
        // The address checksum covers the length, so a damaged length is caught by it.
        assert!(head.check_address(&frame[12..FRAME_OVERHEAD]).is_err());
        let big = NewRecord {
            kind: RecordKind::KvSet,
            data: json!({"key": "k", "value": "x".repeat(MAX_BODY_LEN as usize)}),
            origin: None,
        };
        assert!(encode_body(&big).unwrap_err().contains("larger than"));
    }

    #[test]
    fn segment_headers() {
        let header = segment_header();
        assert_eq!(check_segment_header(&header), Ok(()));
        let mut other = header;
        other[8..12].copy_from_slice(&7u32.to_le_bytes());
        let crc = Crc32c::new().update(&other[..12]).finish();
        other[12..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            check_segment_header(&other),
            Err(HeaderError::OtherVersion(7))
        );
        let mut damaged = header;
        damaged[9] ^= 1;
        assert!(matches!(
            check_segment_header(&damaged),
            Err(HeaderError::Invalid(_))
        ));
        assert!(matches!(
            check_segment_header(&[0u8; 16]),
            Err(HeaderError::Invalid(_))
        ));
    }
}
