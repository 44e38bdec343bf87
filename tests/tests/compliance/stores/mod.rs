//! One module per database the suite runs on, each with the same items:
//! `Pool`, `Tx`, `RUNAWAY`, `sql`, `bed`, `router_with_state` and
//! `someone_waits_for_a_lock`.

pub mod mariadb;
pub mod postgres;
pub mod sqlite;
