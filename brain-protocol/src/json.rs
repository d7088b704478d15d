//! JSON encoding for the wire and the journal: the compact text `serde_json::to_vec` writes, with
//! strings scanned sixteen bytes at a time (short ones byte by byte, inline).
//!
//! `serde_json` checks every byte of a string against its escape table on its own. A durable model
//! callback carries its ≈1 KiB text through Brain's encoder twice (the started record, the result)
//! and through the harness's once, and that per-byte loop was a quarter of Brain's instructions
//! per callback (docs/BENCHMARKS.md). [`write`] skips over sixteen bytes that need no escape in a
//! few instructions and copies them in runs.
//!
//! The output is byte for byte what `serde_json` writes for the same value (the tests hold it to
//! that over every shape `serde` has): numbers are written by `serde_json`'s own formatter,
//! non-finite floats become `null`, map keys that are numbers or booleans are quoted, and a
//! [`serde_json::value::RawValue`] is copied verbatim. Errors are `serde_json`'s too: a map key
//! that is not a string, number, boolean or char, or a non-finite float key, and whatever a
//! `Serialize` impl itself refuses.

use serde::ser::{self, Impossible, Serialize};
use serde_json::ser::{CompactFormatter, Formatter};
use serde_json::value::RawValue;
use std::fmt;

/// Why a value could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: fmt::Display>(message: T) -> Error {
        Error(message.to_string())
    }
}

/// Appends `value` as compact JSON text to `out`. On an error, `out` may hold part of the value.
///
/// # Errors
/// When `value` holds a map key that JSON cannot have, or its `Serialize` impl fails.
pub fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), Error> {
    value.serialize(&mut Encoder { out })
}

/// `value` as compact JSON text.
///
/// # Errors
/// As [`write`].
pub fn to_string<T: Serialize + ?Sized>(value: &T) -> Result<String, Error> {
    let out = super::to_json_vec(value)?;
    debug_assert!(std::str::from_utf8(&out).is_ok());
    // SAFETY: the encoder writes only whole `&str`s (strings, keys, a `RawValue`'s text, a
    // char's own UTF-8), cut at ASCII bytes where it escapes, and ASCII (punctuation, escapes,
    // `serde_json`'s number formatting): valid UTF-8, which checking again cost ≈ 1,700
    // instructions per durable model callback (docs/BENCHMARKS.md).
    Ok(unsafe { String::from_utf8_unchecked(out) })
}

/// `value` as a [`RawValue`] holding its compact JSON text, in one allocation of its size.
///
/// `RawValue::from_string` would parse the text again to check it, which cost as much as
/// encoding it. `serde_json::value::to_raw_value` copies the text through a buffer that starts
/// at 128 bytes and grows, two or three allocator calls a value (with three values a durable
/// model callback, ≈ 9 % of its instructions). The text is encoded into this thread's buffer and
/// handed to `Box<RawValue>`'s own `Deserialize` as an owned string, the way a `Value` hands one
/// over ([`raw_from_encoded`]), which keeps the string as it is.
///
/// # Errors
/// As [`write`].
pub fn to_raw_value<T: Serialize + ?Sized>(value: &T) -> Result<Box<RawValue>, Error> {
    let text = encode_with(value, |encoded| {
        debug_assert!(std::str::from_utf8(encoded).is_ok());
        // SAFETY: as in `to_string`, the encoder wrote valid UTF-8.
        String::from(unsafe { std::str::from_utf8_unchecked(encoded) })
    })?;
    raw_from_encoded(text)
}

/// Encodes `value` into this thread's buffer and gives `finish` the text. Encoding into a fresh
/// `Vec` grew it by reallocation, several times for a ≈ 1 KiB text, and started every text above
/// glibc's small-block sizes (docs/BENCHMARKS.md); the callers copy the text out at its size.
pub(crate) fn encode_with<T: Serialize + ?Sized, R>(
    value: &T,
    finish: impl FnOnce(&[u8]) -> R,
) -> Result<R, Error> {
    thread_local! {
        static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// A buffer grown past this by one large value is not kept.
    const KEPT: usize = 64 * 1024;
    let encode = |out: &mut Vec<u8>| {
        out.clear();
        write(out, value)?;
        Ok(finish(out))
    };
    BUFFER.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut out) => {
            let encoded = encode(&mut out);
            if out.capacity() > KEPT {
                *out = Vec::new();
            }
            encoded
        }
        // A `Serialize` impl that encodes a value of its own this way, inside this one.
        Err(_) => encode(&mut Vec::new()),
    })
}

/// `text`, JSON this module wrote, as a `Box<RawValue>` that keeps the string without copying or
/// parsing it: `Box<RawValue>`'s `Deserialize` asks for a map whose one key is
/// [`RAW_VALUE_TOKEN`] and takes the value's owned string as the text, the protocol by which
/// `serde_json`'s own `Value` deserializer hands text over. (The tests hold a raw value to the
/// text `serde_json` writes.)
fn raw_from_encoded(text: String) -> Result<Box<RawValue>, Error> {
    use serde::Deserialize;
    use serde::de::value::{Error as ValueError, MapDeserializer};
    let entry = MapDeserializer::<_, ValueError>::new(std::iter::once((RAW_VALUE_TOKEN, text)));
    Box::<RawValue>::deserialize(entry).map_err(|e| Error(e.to_string()))
}

/// The struct (and field) name through which `serde_json`'s `RawValue` hands its text to a
/// serializer.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

/// Appends `value` as a JSON string.
///
/// Most strings written are keys, tags, roles and ids of a few bytes, too short for a whole block
/// of [`next_escape`]'s scan: those are checked byte by byte here, inlined into the caller, and
/// copied at once; setting up the scan in a call of its own cost ≈ 130 instructions a string, 14 %
/// of a tool-loop turn's (docs/BENCHMARKS.md).
#[inline]
fn write_str(out: &mut Vec<u8>, value: &str) {
    let bytes = value.as_bytes();
    if bytes.len() < 16 && bytes.iter().all(|&byte| ESCAPE[usize::from(byte)] == 0) {
        out.reserve(bytes.len() + 2);
        out.push(b'"');
        out.extend_from_slice(bytes);
        out.push(b'"');
    } else {
        write_long_str(out, bytes);
    }
}

/// [`write_str`] for a string that is long or needs an escape.
#[inline(never)]
fn write_long_str(out: &mut Vec<u8>, bytes: &[u8]) {
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    // `bytes[run..]` needs no escape before the next one found, and is not copied yet.
    let mut run = 0;
    while let Some(at) = next_escape(bytes, run) {
        out.extend_from_slice(&bytes[run..at]);
        let byte = bytes[at];
        push_escape(out, byte, ESCAPE[usize::from(byte)]);
        run = at + 1;
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// Where the first byte at or after `from` that needs escaping is, if one does: sixteen bytes at
/// a time with SSE2 (part of every x86-64 CPU), then as [`next_escape_words`] does for the last
/// few. Eight bytes at a time, this scan was still ≈ 15 % of the instructions per durable model
/// callback (docs/BENCHMARKS.md).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
fn next_escape(bytes: &[u8], from: usize) -> Option<usize> {
    let rest = bytes.get(from..)?;
    // SAFETY: this is compiled only where the target has SSE2 (every x86-64 CPU does).
    let (checked, found) = unsafe { scan_sse2(rest) };
    match found {
        Some(at) => Some(from + at),
        None => next_escape_words(bytes, from + checked),
    }
}

/// The first byte of `rest` that needs escaping among its whole 16-byte blocks, and how many
/// bytes those blocks cover.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[target_feature(enable = "sse2")]
fn scan_sse2(rest: &[u8]) -> (usize, Option<usize>) {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    let quote = _mm_set1_epi8(b'"' as i8);
    let backslash = _mm_set1_epi8(b'\\' as i8);
    let last_control = _mm_set1_epi8(0x1f);
    let mut checked = 0;
    for chunk in rest.chunks_exact(16) {
        // SAFETY: `chunk` holds 16 readable bytes, and `_mm_loadu_si128` needs no alignment.
        let v = unsafe { _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>()) };
        // A byte is at most 0x1f exactly when the unsigned minimum of it and 0x1f is itself.
        let control = _mm_cmpeq_epi8(_mm_min_epu8(v, last_control), v);
        let special = _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash));
        let mask = _mm_movemask_epi8(_mm_or_si128(control, special));
        if mask != 0 {
            return (checked, Some(checked + mask.trailing_zeros() as usize));
        }
        checked += 16;
    }
    (checked, None)
}

/// [`next_escape`] where SSE2 is not there.
#[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
fn next_escape(bytes: &[u8], from: usize) -> Option<usize> {
    next_escape_words(bytes, from)
}

/// Where the first byte at or after `from` that needs escaping is, if one does: a word of eight
/// bytes at a time, then byte by byte in the word that has one (and in the last few bytes).
fn next_escape_words(bytes: &[u8], from: usize) -> Option<usize> {
    let rest = bytes.get(from..)?;
    let mut words = rest.chunks_exact(8);
    let mut checked = 0;
    for word in &mut words {
        let mut eight = [0; 8];
        eight.copy_from_slice(word);
        if any_escape(u64::from_le_bytes(eight)) {
            break;
        }
        checked += 8;
    }
    rest[checked..]
        .iter()
        .position(|&byte| ESCAPE[usize::from(byte)] != 0)
        .map(|at| from + checked + at)
}

/// Whether one of the eight bytes of `word` is below 0x20, `"` or `\`. Bytes of a multi-byte
/// UTF-8 character are all 0x80 or above, so they never match.
fn any_escape(word: u64) -> bool {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    // A byte below n sets its high bit in (x - n) & !x, for n up to 0x80 (and never a false
    // positive in a word with no such byte).
    let control = word.wrapping_sub(ONES * 0x20) & !word;
    let quotes = word ^ (ONES * u64::from(b'"'));
    let quote = quotes.wrapping_sub(ONES) & !quotes;
    let backslashes = word ^ (ONES * u64::from(b'\\'));
    let backslash = backslashes.wrapping_sub(ONES) & !backslashes;
    (control | quote | backslash) & HIGH != 0
}

/// How `serde_json` escapes each byte: 0 for none, `u` for `\u00XX`, else the letter after `\`.
static ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = b'u';
        byte += 1;
    }
    table[0x08] = b'b';
    table[0x09] = b't';
    table[0x0A] = b'n';
    table[0x0C] = b'f';
    table[0x0D] = b'r';
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table
};

fn push_escape(out: &mut Vec<u8>, byte: u8, escape: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    if escape == b'u' {
        out.extend_from_slice(&[
            b'\\',
            b'u',
            b'0',
            b'0',
            HEX[usize::from(byte >> 4)],
            HEX[usize::from(byte & 0xF)],
        ]);
    } else {
        out.extend_from_slice(&[b'\\', escape]);
    }
}

/// Writes a number with `serde_json`'s formatter; a `Vec` never refuses a write.
macro_rules! number {
    ($out:expr, $write:ident, $value:expr) => {{
        let _ = CompactFormatter.$write($out, $value);
    }};
}

struct Encoder<'a> {
    out: &'a mut Vec<u8>,
}

impl Encoder<'_> {
    fn float(&mut self, finite: bool, write: impl FnOnce(&mut Vec<u8>)) {
        if finite {
            write(self.out);
        } else {
            self.out.extend_from_slice(b"null");
        }
    }
}

impl<'a, 'b> ser::Serializer for &'b mut Encoder<'a> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'a, 'b>;
    type SerializeTuple = Compound<'a, 'b>;
    type SerializeTupleStruct = Compound<'a, 'b>;
    type SerializeTupleVariant = Compound<'a, 'b>;
    type SerializeMap = Compound<'a, 'b>;
    type SerializeStruct = Compound<'a, 'b>;
    type SerializeStructVariant = Compound<'a, 'b>;

    fn serialize_bool(self, value: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if value { b"true" } else { b"false" });
        Ok(())
    }

    fn serialize_i8(self, value: i8) -> Result<(), Error> {
        number!(self.out, write_i8, value);
        Ok(())
    }

    fn serialize_i16(self, value: i16) -> Result<(), Error> {
        number!(self.out, write_i16, value);
        Ok(())
    }

    fn serialize_i32(self, value: i32) -> Result<(), Error> {
        number!(self.out, write_i32, value);
        Ok(())
    }

    fn serialize_i64(self, value: i64) -> Result<(), Error> {
        number!(self.out, write_i64, value);
        Ok(())
    }

    fn serialize_i128(self, value: i128) -> Result<(), Error> {
        number!(self.out, write_i128, value);
        Ok(())
    }

    fn serialize_u8(self, value: u8) -> Result<(), Error> {
        number!(self.out, write_u8, value);
        Ok(())
    }

    fn serialize_u16(self, value: u16) -> Result<(), Error> {
        number!(self.out, write_u16, value);
        Ok(())
    }

    fn serialize_u32(self, value: u32) -> Result<(), Error> {
        number!(self.out, write_u32, value);
        Ok(())
    }

    fn serialize_u64(self, value: u64) -> Result<(), Error> {
        number!(self.out, write_u64, value);
        Ok(())
    }

    fn serialize_u128(self, value: u128) -> Result<(), Error> {
        number!(self.out, write_u128, value);
        Ok(())
    }

    fn serialize_f32(self, value: f32) -> Result<(), Error> {
        self.float(value.is_finite(), |out| number!(out, write_f32, value));
        Ok(())
    }

    fn serialize_f64(self, value: f64) -> Result<(), Error> {
        self.float(value.is_finite(), |out| number!(out, write_f64, value));
        Ok(())
    }

    fn serialize_char(self, value: char) -> Result<(), Error> {
        write_str(self.out, value.encode_utf8(&mut [0; 4]));
        Ok(())
    }

    fn serialize_str(self, value: &str) -> Result<(), Error> {
        write_str(self.out, value);
        Ok(())
    }

    fn serialize_bytes(self, value: &[u8]) -> Result<(), Error> {
        use ser::SerializeSeq;
        let mut seq = self.serialize_seq(Some(value.len()))?;
        for byte in value {
            seq.serialize_element(byte)?;
        }
        seq.end()
    }

    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }

    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.push(b':');
        value.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'[');
        Ok(Compound::new(self, b"]"))
    }

    fn serialize_tuple(self, len: usize) -> Result<Compound<'a, 'b>, Error> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        len: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.extend_from_slice(b":[");
        Ok(Compound::new(self, b"]}"))
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        Ok(Compound::new(self, b"}"))
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Compound<'a, 'b>, Error> {
        if name == RAW_VALUE_TOKEN {
            // Its one field is the text, to copy as it is.
            return Ok(Compound {
                encoder: self,
                first: true,
                close: b"",
                raw: true,
            });
        }
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        write_str(self.out, variant);
        self.out.extend_from_slice(b":{");
        Ok(Compound::new(self, b"}}"))
    }
}

/// An array or object being written: a comma goes before every element but the first. Or
/// (`raw`) a `RawValue`, whose one field is its text.
struct Compound<'a, 'b> {
    encoder: &'b mut Encoder<'a>,
    first: bool,
    close: &'static [u8],
    raw: bool,
}

impl<'a, 'b> Compound<'a, 'b> {
    fn new(encoder: &'b mut Encoder<'a>, close: &'static [u8]) -> Compound<'a, 'b> {
        Compound {
            encoder,
            first: true,
            close,
            raw: false,
        }
    }

    fn comma(&mut self) {
        if !std::mem::replace(&mut self.first, false) {
            self.encoder.out.push(b',');
        }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.comma();
        value.serialize(&mut *self.encoder)
    }

    fn field<T: Serialize + ?Sized>(&mut self, key: &str, value: &T) -> Result<(), Error> {
        if self.raw {
            return value.serialize(StringOnly {
                out: self.encoder.out,
                raw: true,
            });
        }
        self.comma();
        write_str(self.encoder.out, key);
        self.encoder.out.push(b':');
        value.serialize(&mut *self.encoder)
    }

    fn finish(self) -> Result<(), Error> {
        self.encoder.out.extend_from_slice(self.close);
        Ok(())
    }
}

/// The four ways serde hands over an array's elements, all written by [`Compound::element`].
macro_rules! array_like {
    ($($serialize_trait:ident :: $method:ident),*) => {$(
        impl ser::$serialize_trait for Compound<'_, '_> {
            type Ok = ();
            type Error = Error;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
                self.element(value)
            }

            fn end(self) -> Result<(), Error> {
                self.finish()
            }
        }
    )*};
}

array_like!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl ser::SerializeMap for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.comma();
        key.serialize(StringOnly {
            out: self.encoder.out,
            raw: false,
        })?;
        self.encoder.out.push(b':');
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        value.serialize(&mut *self.encoder)
    }

    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

/// The two ways serde hands over a struct's fields, both written by [`Compound::field`].
macro_rules! struct_like {
    ($($serialize_trait:ident),*) => {$(
        impl ser::$serialize_trait for Compound<'_, '_> {
            type Ok = ();
            type Error = Error;

            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), Error> {
                self.field(key, value)
            }

            fn end(self) -> Result<(), Error> {
                self.finish()
            }
        }
    )*};
}

struct_like!(SerializeStruct, SerializeStructVariant);

/// Writes what must be a string: a map key (`raw: false`), or the text of a `RawValue`, which
/// hands it over as a string to be copied as it is (`raw: true`). A map key that is a number,
/// boolean or char is written as a string, as `serde_json` does; anything else is refused.
struct StringOnly<'a> {
    out: &'a mut Vec<u8>,
    raw: bool,
}

impl StringOnly<'_> {
    fn refused(&self) -> Error {
        Error(
            if self.raw {
                "a raw JSON value must be handed over as a string"
            } else {
                "key must be a string"
            }
            .to_owned(),
        )
    }

    fn quoted(self, write: impl FnOnce(&mut Vec<u8>)) -> Result<(), Error> {
        if self.raw {
            return Err(self.refused());
        }
        self.out.push(b'"');
        write(self.out);
        self.out.push(b'"');
        Ok(())
    }

    fn finite_float(self, finite: bool, write: impl FnOnce(&mut Vec<u8>)) -> Result<(), Error> {
        if finite || self.raw {
            self.quoted(write)
        } else {
            Err(Error(
                "float key must be finite (got NaN or +/-inf)".to_owned(),
            ))
        }
    }
}

impl ser::Serializer for StringOnly<'_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Impossible<(), Error>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Impossible<(), Error>;
    type SerializeStruct = Impossible<(), Error>;
    type SerializeStructVariant = Impossible<(), Error>;

    fn serialize_str(self, value: &str) -> Result<(), Error> {
        if self.raw {
            self.out.extend_from_slice(value.as_bytes());
        } else {
            write_str(self.out, value);
        }
        Ok(())
    }

    fn serialize_char(self, value: char) -> Result<(), Error> {
        if self.raw {
            return Err(self.refused());
        }
        self.serialize_str(value.encode_utf8(&mut [0; 4]))
    }

    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        if self.raw {
            return Err(self.refused());
        }
        self.serialize_str(variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        if self.raw {
            return Err(self.refused());
        }
        value.serialize(self)
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        if self.raw {
            return Err(self.refused());
        }
        value.serialize(self)
    }

    fn serialize_bool(self, value: bool) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_bool, value))
    }

    fn serialize_i8(self, value: i8) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_i8, value))
    }

    fn serialize_i16(self, value: i16) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_i16, value))
    }

    fn serialize_i32(self, value: i32) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_i32, value))
    }

    fn serialize_i64(self, value: i64) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_i64, value))
    }

    fn serialize_i128(self, value: i128) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_i128, value))
    }

    fn serialize_u8(self, value: u8) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_u8, value))
    }

    fn serialize_u16(self, value: u16) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_u16, value))
    }

    fn serialize_u32(self, value: u32) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_u32, value))
    }

    fn serialize_u64(self, value: u64) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_u64, value))
    }

    fn serialize_u128(self, value: u128) -> Result<(), Error> {
        self.quoted(|out| number!(out, write_u128, value))
    }

    fn serialize_f32(self, value: f32) -> Result<(), Error> {
        self.finite_float(value.is_finite(), |out| number!(out, write_f32, value))
    }

    fn serialize_f64(self, value: f64) -> Result<(), Error> {
        self.finite_float(value.is_finite(), |out| number!(out, write_f64, value))
    }

    fn serialize_bytes(self, _value: &[u8]) -> Result<(), Error> {
        Err(self.refused())
    }

    fn serialize_none(self) -> Result<(), Error> {
        Err(self.refused())
    }

    fn serialize_unit(self) -> Result<(), Error> {
        Err(self.refused())
    }

    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        Err(self.refused())
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<(), Error> {
        Err(self.refused())
    }

    fn serialize_seq(self, _len: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(self.refused())
    }

    fn serialize_tuple(self, _len: usize) -> Result<Self::SerializeTuple, Error> {
        Err(self.refused())
    }

    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(self.refused())
    }

    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(self.refused())
    }

    fn serialize_map(self, _len: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(self.refused())
    }

    fn serialize_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStruct, Error> {
        Err(self.refused())
    }

    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _len: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(self.refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Serialize, Serializer};
    use serde_json::Value;
    use std::collections::BTreeMap;

    /// Holds `write` to `serde_json::to_vec` for `value`, and returns the text.
    fn same<T: Serialize + ?Sized>(value: &T) -> String {
        let ours = to_string(value).expect("ours encodes");
        let theirs = serde_json::to_string(value).expect("serde_json encodes");
        assert_eq!(ours, theirs);
        ours
    }

    /// A small deterministic generator (xorshift), so that a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// A string of up to `max` characters, dense in what needs escaping and in multi-byte
        /// characters, so that escapes fall at every place of an eight-byte word.
        fn string(&mut self, max: usize) -> String {
            const ALPHABET: &[char] = &[
                'a', 'b', 'z', ' ', '/', '"', '\\', '\n', '\r', '\t', '\u{8}', '\u{c}', '\u{0}',
                '\u{1}', '\u{1f}', '\u{7f}', 'é', '€', '😀', '\u{2028}',
            ];
            let len = self.below(max + 1);
            let plain = self.below(3) == 0;
            (0..len)
                .map(|_| {
                    if plain {
                        'x'
                    } else {
                        ALPHABET[self.below(ALPHABET.len())]
                    }
                })
                .collect()
        }

        fn value(&mut self, depth: usize) -> Value {
            match self.below(if depth == 0 { 6 } else { 8 }) {
                0 => Value::Null,
                1 => Value::Bool(self.below(2) == 0),
                2 => Value::from(self.next() as i64),
                3 => Value::from(self.next() >> self.below(64)),
                4 => Value::from(f64::from_bits(self.next()) % 1e6),
                5 => Value::String(self.string(40)),
                6 => Value::Array((0..self.below(5)).map(|_| self.value(depth - 1)).collect()),
                _ => Value::Object(
                    (0..self.below(5))
                        .map(|_| (self.string(12), self.value(depth - 1)))
                        .collect(),
                ),
            }
        }
    }

    #[test]
    fn the_word_check_finds_exactly_the_bytes_that_need_escaping() {
        for byte in 0..=255u8 {
            let needs = ESCAPE[usize::from(byte)] != 0;
            for place in 0..8 {
                let mut word = [b'a'; 8];
                word[place] = byte;
                assert_eq!(
                    any_escape(u64::from_le_bytes(word)),
                    needs,
                    "{byte:#x} at {place}"
                );
                // Beside bytes that are not escaped but sit just above the thresholds.
                let mut word = [b' '; 8];
                word[place] = byte;
                assert_eq!(
                    any_escape(u64::from_le_bytes(word)),
                    needs,
                    "{byte:#x} at {place}"
                );
                let mut word = [0xFF; 8];
                word[place] = byte;
                assert_eq!(
                    any_escape(u64::from_le_bytes(word)),
                    needs,
                    "{byte:#x} at {place}"
                );
            }
        }
    }

    #[test]
    fn the_block_scan_finds_the_first_byte_that_needs_escaping_wherever_it_is() {
        // Every byte value at every place of texts spanning one to three 16-byte blocks and a
        // tail, beside bytes just above the thresholds and non-ASCII ones.
        for len in [1, 15, 16, 17, 31, 32, 33, 47, 50] {
            for filler in [b'a', b' ', 0xFF] {
                for place in 0..len {
                    for byte in 0..=255u8 {
                        let mut text = vec![filler; len];
                        text[place] = byte;
                        let expected = text.iter().position(|&b| ESCAPE[usize::from(b)] != 0);
                        assert_eq!(
                            next_escape(&text, 0),
                            expected,
                            "{byte:#x} at {place} of {len}"
                        );
                        if place > 0 {
                            assert_eq!(next_escape(&text, 1), expected, "from 1");
                        }
                    }
                }
            }
        }
        assert_eq!(next_escape(b"abc", 3), None);
        assert_eq!(next_escape(b"abc", 4), None);
    }

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for _ in 0..20_000 {
            let text = rng.string(40);
            same(&text);
        }
        same("");
        same(&"m".repeat(1000));
        same(&format!("{}\"{}", "a".repeat(15), "b".repeat(17)));
        let every_ascii: String = (0..128u8).map(char::from).collect();
        same(&every_ascii);
        // Strings shorter than a block of the scan are checked on a path of their own: each
        // length around it, plain and with each kind of escape at each place.
        for len in 0..18 {
            same(&"s".repeat(len));
            for at in 0..len {
                for special in ['"', '\\', '\n', '\u{1}', '\u{1f}', 'é'] {
                    let text: String = (0..len)
                        .map(|i| if i == at { special } else { 's' })
                        .collect();
                    same(&text);
                }
            }
        }
    }

    #[test]
    fn values_encode_as_serde_json_encodes_them() {
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        for _ in 0..5_000 {
            same(&rng.value(4));
        }
        for float in [
            0.0,
            -0.0,
            0.1,
            1e300,
            -1e-300,
            f64::MAX,
            f64::MIN_POSITIVE,
            3.0,
        ] {
            same(&float);
            same(&(float as f32));
        }
        assert_eq!(same(&f64::NAN), "null");
        assert_eq!(same(&f32::INFINITY), "null");
        same(&(i128::MIN, u128::MAX, i64::MIN, u64::MAX, -1i8, 255u8));
        same(&('x', '"', '\u{1}', 'é'));
    }

    #[derive(Serialize)]
    struct Unit;

    #[derive(Serialize)]
    struct Newtype(Vec<u16>);

    #[derive(Serialize)]
    struct Tuple(i32, &'static str, Option<bool>);

    #[derive(Serialize)]
    enum Shape {
        Plain,
        Wrapped(String),
        Pair(u8, char),
        Named { x: f64, y: Option<Unit> },
    }

    #[derive(Serialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Tagged {
        Text { text: String },
        Other(BTreeMap<String, u32>),
    }

    #[derive(Serialize)]
    struct Outer<'a> {
        unit: Unit,
        newtype: Newtype,
        tuple: Tuple,
        shapes: Vec<Shape>,
        tagged: Vec<Tagged>,
        #[serde(flatten)]
        extra: BTreeMap<String, Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        absent: Option<u8>,
        raw: &'a RawValue,
        nested_raw: Vec<Box<RawValue>>,
        int_keys: BTreeMap<i64, &'a str>,
        bool_keys: BTreeMap<bool, u8>,
        char_keys: BTreeMap<char, u8>,
        empty: (Vec<u8>, BTreeMap<String, u8>),
    }

    #[test]
    fn every_serde_shape_encodes_as_serde_json_encodes_it() {
        let raw = RawValue::from_string(r#"{"kept" : [1, "as is"]}"#.to_owned()).unwrap();
        let outer = Outer {
            unit: Unit,
            newtype: Newtype(vec![1, 2, 3]),
            tuple: Tuple(-7, "t\"", None),
            shapes: vec![
                Shape::Plain,
                Shape::Wrapped("w\n".to_owned()),
                Shape::Pair(9, '\\'),
                Shape::Named {
                    x: 1.5,
                    y: Some(Unit),
                },
            ],
            tagged: vec![
                Tagged::Text {
                    text: "hi".to_owned(),
                },
                Tagged::Other(BTreeMap::from([("k".to_owned(), 1)])),
            ],
            extra: BTreeMap::from([("flat".to_owned(), Value::from("tened"))]),
            absent: None,
            raw: &raw,
            nested_raw: vec![RawValue::from_string("null".to_owned()).unwrap()],
            int_keys: BTreeMap::from([(-3, "minus"), (40, "plus")]),
            bool_keys: BTreeMap::from([(false, 0), (true, 1)]),
            char_keys: BTreeMap::from([('"', 1)]),
            empty: (Vec::new(), BTreeMap::new()),
        };
        let text = same(&outer);
        // The raw value is copied, spaces and all.
        assert!(text.contains(r#""raw":{"kept" : [1, "as is"]}"#), "{text}");
        // Bytes handed over as bytes are an array of numbers, as serde_json writes them.
        struct Bytes;
        impl Serialize for Bytes {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_bytes(b"\x00\xff")
            }
        }
        assert_eq!(same(&Bytes), "[0,255]");
    }

    #[test]
    fn a_raw_value_holds_the_text_serde_json_would_write() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for _ in 0..1_000 {
            let value = rng.value(3);
            let raw = to_raw_value(&value).unwrap();
            assert_eq!(raw.get(), serde_json::to_string(&value).unwrap());
            // And it is a RawValue like any other: it parses back to the value.
            let back: Value = serde_json::from_str(raw.get()).unwrap();
            assert_eq!(back, value);
        }
    }

    #[test]
    fn what_serde_json_refuses_is_refused() {
        let vec_key = BTreeMap::from([(vec![1u8], 1)]);
        assert!(serde_json::to_string(&vec_key).is_err());
        let error = to_string(&vec_key).unwrap_err();
        assert_eq!(error.to_string(), "key must be a string");
        let nan_key = vec![(f64::NAN, 1)].into_iter().collect::<Vec<_>>();
        let map = |pairs: &Vec<(f64, i32)>| {
            struct AsMap<'a>(&'a Vec<(f64, i32)>);
            impl Serialize for AsMap<'_> {
                fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                    serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
                }
            }
            (
                to_string(&AsMap(pairs)),
                serde_json::to_string(&AsMap(pairs)),
            )
        };
        let (ours, theirs) = map(&nan_key);
        assert!(ours.is_err() && theirs.is_err());
        let (ours, theirs) = map(&vec![(2.5, 1)]);
        assert_eq!(ours.unwrap(), theirs.unwrap());
        struct Fails;
        impl Serialize for Fails {
            fn serialize<S: Serializer>(&self, _serializer: S) -> Result<S::Ok, S::Error> {
                Err(ser::Error::custom("this value refuses"))
            }
        }
        assert_eq!(
            to_string(&vec![Fails]).unwrap_err().to_string(),
            "this value refuses"
        );
    }
}
