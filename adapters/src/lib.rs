//! Push per-member load ratios into load balancers.
//!
//! This crate is the controller's outward edge and is usable on its own: give a [`RatioSink`] a map of
//! member address to integer ratio and it makes the load balancer agree, touching only what differs.
//! It owns the shared vocabulary ([`MemberId`], [`Ratios`]) so the controller depends on it, never the
//! reverse.

#![forbid(unsafe_code)]

pub mod dry_run;
pub mod envoy;
pub mod error;
pub mod f5;
pub mod haproxy;
pub mod label;
pub mod member_map;
pub mod name;
pub mod sink;
pub mod tls;
pub mod types;
pub mod webhook;

pub use error::SinkError;
pub use member_map::{Aligned, MemberMap};
pub use name::InvalidName;
pub use sink::{build_sink, Applied, InstanceStatus, RatioSink, SinkConfig, SinkContext};
pub use types::{MemberId, Ratios, SecretRef, MAX_RATIO};
