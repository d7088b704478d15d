//! The journal: per-session ordered records and their projections.
