//! The `pending` application: what is scheduled and not yet run, seen and steered.
//! [`follow`] reads the journal and the control stream into a [`crate::pending_index`];
//! [`service`] answers and steers for the CLI, the HTTP API ([`http`]) and the console, with
//! the rights of the user who asks; [`auth`] checks an HTTP login against the broker.
//! [`translate`] is the pure part: which record counts for what, by its writer.

pub mod auth;
pub mod client;
pub mod follow;
pub mod http;
pub mod quota;
pub mod service;
pub mod translate;
pub mod when;
pub mod wire;
