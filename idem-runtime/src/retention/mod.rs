//! How long claims are kept, and how they go: the retention [`floor`] a
//! route's retention may not go below, and the [`expiry`] that rotates the
//! claims table's generations and purges the old ones.

pub(crate) mod background;
pub mod expiry;
pub mod floor;
pub(crate) mod status;

pub use crate::error::retention::{RetentionFloor, Unbounded};
