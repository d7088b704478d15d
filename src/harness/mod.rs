//! The harness SDK: write a brain/harness/v1 harness in Rust with a few blocking calls.
