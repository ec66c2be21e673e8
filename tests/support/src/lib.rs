//! Test support shared by the integration tests of every crate in the workspace.
//!
//! Real servers (Prometheus, HAProxy, Envoy, llama.cpp, vLLM) are started on free loopback ports with generated configs
//! in temp dirs and killed on drop; readiness is polled with a deadline, never slept for. With the
//! `tools` feature (the root crate's tests), helpers for the proxy and the simulated fleet too.

#![forbid(unsafe_code)]

pub mod bigip;
pub mod controller;
pub mod envoy;
pub mod haproxy;
pub mod irule;
pub mod kube;
pub mod llamacpp;
pub mod load;
pub mod measure;
pub mod metrics_target;
pub mod ports;
pub mod prometheus;
#[cfg(feature = "tools")]
pub mod proxy;
#[cfg(feature = "tools")]
pub mod sim;
pub mod vllm;
pub mod wait;
