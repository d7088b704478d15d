//! Effects: model providers and environment drivers.
