//! Request/reply routes and stored results, against real servers.
//!
//! - `stored_results`: a handler's stored value, and the first reply again for
//!   a retried request.
//! - `routes`: request/reply routes under production's ordinary accidents.

mod routes;
mod stored_results;
