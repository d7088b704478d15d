#![no_main]
//! cargo-fuzz target: `brain::fuzzing::create_session` (see docs/RELIABILITY.md, "Fuzzing").

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| brain::fuzzing::create_session(data));
