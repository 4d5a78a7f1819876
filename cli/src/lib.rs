//! The amqp-delay tools' shared code: what only `delay-publisher`, `delay-consumer` and
//! `delay-bench` use — flags, logging and exit codes ([`cli`]), the worker's business
//! [`actions`], bulk JSONL ([`bulk`], [`jsonl`]), declare/stats/teardown ([`admin`]) and the
//! metrics endpoint ([`observe`]), the `delay-proxy` ([`proxy`]). Applications use the `amqp-delay` library instead.

pub mod actions;
pub mod admin;
pub mod bulk;
pub mod cli;
pub mod jsonl;
pub mod observe;
pub mod proxy;
