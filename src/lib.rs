//! llm-load-controller: reads the load of LLM model servers and keeps load balancers weighted by it.
//!
//! The production controller, one cycle per `interval` for every pool:
//!
//! ```text
//! members  <- membership     static list | Prometheus `up` | the LB's own pool      (controller)
//! samples  <- [`source`]     Prometheus/Thanos PromQL | direct /metrics scrape      per member, with age
//! ratios   <- [`policy`]     pure: samples and its own memory -> integer ratios
//! decision <- [`cycle`]      pure state machine: fail-static, drain guard, backoff, leadership,
//!                            change policy, resync -> push these ratios, or hold and why
//! push     -> a sink of the `llm-lc-adapters` crate: F5 | HAProxy | Envoy | webhook | dry-run
//! ```
//!
//! [`controller`] is the thin async shell around [`cycle`]: it samples, asks the cycle, pushes (each
//! push within its own time budget), and reports to [`telemetry`] (`/metrics`, `/readyz`,
//! `/v1/ratios`). [`control_loop`] runs it on the interval; [`config`] assembles each module's
//! config; [`leader`] and [`reload`] are inputs to the loop (leadership, a new config).
//!
//! Per-member data of a pool (samples, ratios, policy memory, what was last written) is held in
//! member order as `adapters::MemberMap`, so the stages of a cycle line up by position and merge
//! by walking side by side: a cycle's cost grows with members, not with the shape of the pools.
//!
//! The tools live in crates of their own that never depend on this one: `llm-lc-sim` (simulated vLLM
//! fleet), `llm-lc-balance` (pickers), `llm-lc-proxy` (reference proxy), `llm-lc-bench` (virtual-time
//! benchmark) and `llm-lc-demo`. With the `tools` feature (on by default) [`tools`] hands them the
//! controller pieces they drive (the benchmark runs [`cycle::Cycle`] in virtual time); the container
//! image builds with `--no-default-features` and carries none of them.

#![forbid(unsafe_code)]

pub mod config;
pub mod control_loop;
pub mod controller;
pub mod cycle;
pub mod kube;
pub mod leader;
pub mod offline;
pub mod overrides;
pub mod picker;
pub mod plan;
pub mod policy;
pub mod priority;
pub mod quickstart;
pub mod ratio;
pub mod reach;
pub mod reload;
pub mod report;
pub mod signal;
pub mod source;
pub mod telemetry;
#[cfg(feature = "tools")]
pub mod tools;

pub use llm_lc_adapters as adapters;
