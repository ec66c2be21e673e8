//! llm-load-controller: reads the load of LLM model servers and keeps load balancers weighted by it.
//!
//! One cycle: [`source`] samples each pool's members, [`policy`] turns samples into integer ratios,
//! and a sink from the `llm-lc-adapters` crate pushes them. [`controller`] runs that cycle forever with
//! fail-static rules; [`telemetry`] exposes what it sees. [`sim`] and [`bench`] are the simulated vLLM
//! fleet and the virtual-time benchmark built on the same engine model.

pub mod bench;
pub mod config;
pub mod controller;
pub mod demo;
pub mod leader;
pub mod picker;
pub mod plan;
pub mod policy;
pub mod proxy;
pub mod quickstart;
pub mod reload;
pub mod report;
pub mod signal;
pub mod sim;
pub mod source;
pub mod telemetry;

pub use llm_lc_adapters as adapters;
