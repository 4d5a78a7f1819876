//! The amqp-delay tools' shared code: what only `delay-publisher`, `delay-consumer`,
//! `delay-proxy` and the benchmark (`bench/`, `delay-bench`) use — flags, logging and exit
//! codes ([`cli`]), log lines no value can forge ([`logline`]), the worker's business
//! [`actions`], bulk JSONL ([`bulk`], [`jsonl`]), the move off the delayed-message plugin
//! ([`import`], [`plugin_store`]), declare/stats/teardown ([`admin`]), the metrics endpoint
//! ([`observe`]), the proxy ([`proxy`]), the on-disk index of what is pending
//! ([`pending_index`]) and the web console ([`console`]). Applications use the `amqp-delay` library instead.

pub mod actions;
pub mod admin;
pub mod bulk;
pub mod cli;
pub mod console;
pub mod import;
pub mod jsonl;
pub mod logline;
pub mod observe;
pub mod pending;
pub mod pending_index;
pub mod plugin_store;
pub mod proxy;
pub mod recurring;
pub mod schedules;
pub mod tls;
