//! Writing handlers: what the macros accept and expand to, and the handler API
//! against real servers.
//!
//! - `api`: application state, handlers written by hand, codecs, keys that see
//!   the delivery, error classes that survive wrapping.
//! - `ui`: compile-time behaviour of the macros (trybuild).
//! - `expand`: snapshots of what `#[idempotent]` expands to (macrotest).
//! - `lint_clean`: the expansion adds no warning, with every lint denied.

mod api;
mod expand;
mod lint_clean;
mod ui;
