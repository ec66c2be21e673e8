//! Test support shared by the integration tests of every crate in the workspace.
//!
//! Real servers (Prometheus, HAProxy, Envoy) are started on free loopback ports with generated configs
//! in temp dirs and killed on drop; readiness is polled with a deadline, never slept for.

pub mod bigip;
pub mod envoy;
pub mod haproxy;
pub mod kube;
pub mod metrics_target;
pub mod ports;
pub mod prometheus;
pub mod wait;
