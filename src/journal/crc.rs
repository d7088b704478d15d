//! CRC32C (Castagnoli), table-driven, one byte at a time. The journal's frames and segment headers
//! carry it (docs/JOURNAL.md).

/// The reflected Castagnoli polynomial.
const POLYNOMIAL: u32 = 0x82F6_3B78;

/// The remainder of every byte value, computed at compile time.
const TABLE: [u32; 256] = table();

const fn table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut crc = byte as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ POLYNOMIAL
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[byte] = crc;
        byte += 1;
    }
    table
}

/// A CRC32C being computed over several slices in turn. Copying it forks the computation, so a
/// checksum of a prefix and of the whole can share the prefix's work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Crc32c(u32);

impl Crc32c {
    /// The checksum of nothing yet.
    pub(crate) fn new() -> Crc32c {
        Crc32c(!0)
    }

    /// Continues over `bytes`.
    pub(crate) fn update(mut self, bytes: &[u8]) -> Crc32c {
        for &byte in bytes {
            self.0 = TABLE[((self.0 ^ u32::from(byte)) & 0xFF) as usize] ^ (self.0 >> 8);
        }
        self
    }

    /// The checksum of everything given so far.
    pub(crate) fn finish(self) -> u32 {
        !self.0
    }
}

/// The CRC32C of `bytes`.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    Crc32c::new().update(bytes).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 (iSCSI) B.4: 32 bytes of zeros and 32 bytes of 0xFF.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn updating_in_pieces_equals_the_whole() {
        let whole = crc32c(b"hello, journal");
        let pieces = Crc32c::new().update(b"hello").update(b", journal").finish();
        assert_eq!(whole, pieces);
    }
}
