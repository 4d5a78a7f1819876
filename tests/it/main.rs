//! Integration tests against a real RabbitMQ, in one test binary (one link step, one harness).
//! Every test FAILS when no broker answers (`./scripts/test.sh` starts one); each runs under its
//! own random prefix on a small 1 ms-unit topology and deletes what it declared.

mod actions;
mod attacks;
mod batching;
mod cancel;
mod cli;
mod cli_files;
mod core;
mod gateway;
mod harness;
mod hostile;
mod import;
mod isolation;
mod journal;
mod observe;
mod parked;
mod pending;
mod permissions;
mod proxy;
mod recurring;
mod recurring_live;
mod security;
mod transfer;
mod trust;
mod wheel;
mod worker;
