//! The amqp-delay tools' shared code: what only `delay-publisher`, `delay-consumer` and
//! `delay-bench` use — flags, logging and exit codes ([`cli`]), log lines no value can forge ([`logline`]), the worker's business
//! [`actions`], bulk JSONL ([`bulk`], [`jsonl`]), the move off the delayed-message plugin ([`import`], [`plugin_store`]), declare/stats/teardown ([`admin`]) and the
//! metrics endpoint ([`observe`]), the `delay-proxy` ([`proxy`]). Applications use the `amqp-delay` library instead.

pub mod actions;
pub mod admin;
pub mod bulk;
pub mod cli;
pub mod import;
pub mod jsonl;
pub mod logline;
pub mod observe;
pub mod plugin_store;
pub mod proxy;

/// Every tool allocates with mimalloc: with glibc's malloc, about a fifth of delay-bench's CPU on
/// the gateway scenario (its publisher, gateway and consumer) went to `malloc_consolidate`,
/// `unlink_chunk` and the aligned allocations of runtime tasks (`perf record` of
/// `delay-bench --scenarios gateway_long`, docs/PERFORMANCE.md). This also applies to the suites
/// that link this crate.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
