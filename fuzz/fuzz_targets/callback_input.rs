#![no_main]
//! cargo-fuzz target: `brain::fuzzing::callback_input` (see docs/RELIABILITY.md, "Fuzzing").

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| brain::fuzzing::callback_input(data));
