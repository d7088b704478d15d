//! Cancellation tokens shared by the harness SDK and Brain's effects.
