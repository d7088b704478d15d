//! Registrations: the name-to-harness map Brain reads at startup.
