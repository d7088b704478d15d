#![no_main]
//! cargo-fuzz target: `brain::fuzzing::journal_segment` (see docs/RELIABILITY.md, "Fuzzing").

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| brain::fuzzing::journal_segment(data));
