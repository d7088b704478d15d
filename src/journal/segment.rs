//! Segment names, positions in the log, and the table compaction decides from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A segment's file name: `segment-<16 hex digits>.log`.
pub(crate) fn file_name(id: u32) -> String {
    format!("segment-{:016x}.log", u64::from(id))
}

/// The path of segment `id` in `dir`.
pub(crate) fn path(dir: &Path, id: u32) -> PathBuf {
    dir.join(file_name(id))
}

/// The id named by a segment file name: `Ok(None)` for a name of another form, `Err` for a
/// segment name whose id does not fit the 32 bits this implementation addresses.
pub(crate) fn parse_name(name: &str) -> Result<Option<u32>, String> {
    let Some(hex) = name
        .strip_prefix("segment-")
        .and_then(|rest| rest.strip_suffix(".log"))
    else {
        return Ok(None);
    };
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(None);
    }
    let id = u64::from_str_radix(hex, 16).map_err(|e| format!("{name}: {e}"))?;
    u32::try_from(id)
        .map(Some)
        .map_err(|_| format!("{name}: segment id beyond {}", u32::MAX))
}

/// A position in the log: the segment id in the high 32 bits, the byte offset in the low 32, so
/// positions order like the log itself.
pub(crate) fn position(segment: u32, offset: u32) -> u64 {
    (u64::from(segment) << 32) | u64::from(offset)
}

/// Where one frame is: its position and length. 16 bytes per record, kept for every record of
/// every live session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) pos: u64,
    pub(crate) len: u32,
}

impl Loc {
    pub(crate) fn segment(self) -> u32 {
        // The high half of a u64 fits in u32.
        (self.pos >> 32) as u32
    }

    pub(crate) fn offset(self) -> u64 {
        self.pos & 0xFFFF_FFFF
    }

    /// The position just after the frame (same segment: offsets stay far below 2^32).
    pub(crate) fn end(self) -> u64 {
        self.pos + u64::from(self.len)
    }
}

/// What compaction needs to know of one segment.
#[derive(Debug, Default, Clone)]
pub(crate) struct SegmentInfo {
    /// Records of live (or refused, never deleted) sessions in it.
    pub(crate) live: u64,
    /// Earlier segments holding records that a tombstone in this segment kills: this segment
    /// must outlive them, or the records would come back at the next open.
    pub(crate) needs: BTreeSet<u32>,
    /// It holds bytes recovery could not attribute to a session: never removed.
    pub(crate) pinned: bool,
    /// Its size in bytes, as far as known.
    pub(crate) bytes: u64,
}

/// Every segment on disk that compaction has not removed.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    segments: BTreeMap<u32, SegmentInfo>,
}

impl SegmentTable {
    /// The segment's entry, created empty if new.
    pub(crate) fn entry(&mut self, id: u32) -> &mut SegmentInfo {
        self.segments.entry(id).or_default()
    }

    /// A record of a live session was placed in `loc`.
    pub(crate) fn add_record(&mut self, loc: Loc) {
        let info = self.entry(loc.segment());
        info.live += 1;
        info.bytes = info.bytes.max(loc.offset() + u64::from(loc.len));
    }

    /// A tombstone placed in `tombstone` killed the records at `victims`.
    pub(crate) fn kill(&mut self, victims: &[Loc], tombstone: Loc) {
        let mut needs = BTreeSet::new();
        for victim in victims {
            if let Some(info) = self.segments.get_mut(&victim.segment()) {
                info.live = info.live.saturating_sub(1);
            }
            if victim.segment() != tombstone.segment() {
                needs.insert(victim.segment());
            }
        }
        let info = self.entry(tombstone.segment());
        info.bytes = info
            .bytes
            .max(tombstone.offset() + u64::from(tombstone.len));
        info.needs.extend(needs);
    }

    /// The number of segments.
    pub(crate) fn len(&self) -> usize {
        self.segments.len()
    }

    /// Puts back a segment [`SegmentTable::take_removable`] took out but that was not removed.
    pub(crate) fn restore(&mut self, id: u32, info: SegmentInfo) {
        self.segments.insert(id, info);
    }

    /// Removes from the table, and returns oldest first, the segments below `sealed_below` that
    /// hold no live record, are not pinned, and whose tombstones are no longer needed (the
    /// segments they need are gone, or come earlier in the returned list).
    pub(crate) fn take_removable(&mut self, sealed_below: u32) -> Vec<(u32, SegmentInfo)> {
        let candidates: Vec<u32> = self
            .segments
            .range(..sealed_below)
            .map(|(&id, _)| id)
            .collect();
        let mut removed = Vec::new();
        for id in candidates {
            let removable = self.segments.get(&id).is_some_and(|info| {
                info.live == 0
                    && !info.pinned
                    && info.needs.iter().all(|n| !self.segments.contains_key(n))
            });
            if removable && let Some(info) = self.segments.remove(&id) {
                removed.push((id, info));
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(file_name(0x1f), "segment-000000000000001f.log");
        assert_eq!(parse_name(&file_name(77)), Ok(Some(77)));
        assert_eq!(parse_name("segment-1.log"), Ok(None));
        assert_eq!(parse_name("FORMAT"), Ok(None));
        assert!(parse_name("segment-0000000100000000.log").is_err());
    }

    #[test]
    fn tombstones_keep_their_segment_until_the_victims_are_gone() {
        let mut table = SegmentTable::default();
        let at = |segment, offset| Loc {
            pos: position(segment, offset),
            len: 100,
        };
        table.add_record(at(1, 16));
        table.add_record(at(2, 16));
        table.add_record(at(2, 116)); // another session, live
        table.add_record(at(3, 16)); // a live record in the active segment
        // The session with records in 1 and 2 is deleted by a tombstone in 3.
        table.kill(&[at(1, 16), at(2, 16)], at(3, 116));
        assert_eq!(
            table
                .take_removable(3)
                .iter()
                .map(|r| r.0)
                .collect::<Vec<_>>(),
            [1]
        );
        assert_eq!(table.len(), 2);
        // Segment 3 needs 1 (gone) and 2 (still there with a live record): not removable even
        // once sealed, and it has a live record anyway.
        assert!(table.take_removable(4).is_empty());
    }
}
