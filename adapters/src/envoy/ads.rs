//! gRPC xDS, state of the world, for endpoints only: the Aggregated Discovery Service (what service
//! meshes configure, `ads_config`) and the plain Endpoint Discovery Service stream
//! (`api_config_source {api_type: GRPC}`), both served from the same [`EdsRegistry`] as REST polls.
//!
//! Unlike REST polling, a stream is pushed to: a new assignment reaches Envoy as soon as a sink stores
//! it. Per stream, following the xDS protocol:
//! - the first request names the clusters Envoy wants and the version it already holds (non-empty
//!   when it reconnects); it gets an answer only if the registry has something newer;
//! - an ACK or NACK names the nonce it answers; a request carrying an older nonce is stale and only
//!   recorded; a NACK (`error_detail`) is logged and the rejected version is not re-sent;
//! - other resource types (clusters, listeners...) are not served by the controller: they are
//!   answered with nothing and logged once, so a misconfigured bootstrap is visible.
//!
//! Delta xDS is not served (`UNIMPLEMENTED`): configure `api_type: GRPC` (or `ADS`), not `DELTA_GRPC`.

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as ep;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::registry::{self, Discovery, EdsRegistry};
use super::wire::{self, CLA_TYPE_URL};

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The gRPC services, ready to merge into the controller's axum router (which must speak HTTP/2
/// cleartext: axum's `http2` feature, enabled by this crate's `ads` feature).
pub fn router(eds: Arc<EdsRegistry>) -> axum::Router {
    let svc = XdsService { eds };
    tonic::service::Routes::new(AggregatedDiscoveryServiceServer::new(svc.clone()))
        .add_service(EndpointDiscoveryServiceServer::new(svc))
        .into_axum_router()
}

#[derive(Clone)]
struct XdsService {
    eds: Arc<EdsRegistry>,
}

impl XdsService {
    fn open(&self, inbound: Streaming<DiscoveryRequest>) -> ResponseStream<DiscoveryResponse> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(run_stream(self.eds.clone(), inbound, tx));
        Box::pin(ReceiverStream::new(rx))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for XdsService {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.open(req.into_inner())))
    }

    async fn delta_aggregated_resources(
        &self,
        _req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(delta_unimplemented())
    }
}

#[tonic::async_trait]
impl EndpointDiscoveryService for XdsService {
    type StreamEndpointsStream = ResponseStream<DiscoveryResponse>;
    type DeltaEndpointsStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_endpoints(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        Ok(Response::new(self.open(req.into_inner())))
    }

    async fn delta_endpoints(
        &self,
        _req: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Err(delta_unimplemented())
    }

    async fn fetch_endpoints(
        &self,
        req: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let req = to_wire(&req.into_inner());
        match self.eds.discover(&req).map_err(|e| Status::invalid_argument(e.to_string()))? {
            Discovery::Response(r) => Ok(Response::new(to_proto(&r, String::new()))),
            Discovery::NotModified => Ok(Response::new(DiscoveryResponse {
                version_info: req.version_info,
                type_url: CLA_TYPE_URL.to_string(),
                ..Default::default()
            })),
        }
    }
}

fn delta_unimplemented() -> Status {
    Status::unimplemented("delta xDS is not served; configure api_type GRPC or ADS (state of the world)")
}

/// One stream's life: answer requests, push changes, until Envoy hangs up.
async fn run_stream(
    eds: Arc<EdsRegistry>,
    mut inbound: Streaming<DiscoveryRequest>,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
) {
    let mut changes = eds.subscribe();
    // What this Envoy holds (as far as the stream knows), what it asked for, and the last nonce sent.
    let mut held = String::new();
    let mut names: Option<Vec<String>> = None;
    let mut nonce: u64 = 0;
    let mut warned_other_type = false;
    // Envoy may send its node only on the first message (`set_node_on_first_message_only`).
    let mut node_id = String::new();
    loop {
        tokio::select! {
            msg = inbound.message() => {
                let req = match msg {
                    Ok(Some(req)) => req,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "xDS stream ended");
                        break;
                    }
                };
                if let Some(n) = &req.node {
                    // Outside text kept for the stream's life: bounded.
                    node_id = crate::name::shorten(&n.id).into_owned();
                }
                let node = node_id.as_str();
                if req.type_url != CLA_TYPE_URL {
                    if !warned_other_type {
                        tracing::warn!(node, type_url = %crate::name::shorten_text(&req.type_url),
                            "Envoy asked the controller for a resource type it does not serve; \
                             only endpoints (EDS) come from the controller");
                        warned_other_type = true;
                    }
                    continue;
                }
                let mut seen = to_wire(&req);
                seen.node = Some(wire::Node { id: node_id.clone(), cluster: String::new() });
                eds.record(&seen);
                let first = names.is_none();
                if nonce > 0 && req.response_nonce != nonce.to_string() {
                    // Answers an older response than the last one sent: stale, the next ACK will come.
                    // (Before the first response every request counts: Envoy may widen its names.)
                    continue;
                }
                if let Some(err) = &req.error_detail {
                    tracing::warn!(node, nonce = %crate::name::shorten_text(&req.response_nonce),
                        message = %crate::name::shorten_text(&err.message),
                        "Envoy rejected an endpoint update; it keeps version {}",
                        crate::name::shorten_text(&req.version_info));
                }
                if first {
                    // A reconnecting Envoy says what it already holds: no need to send it again.
                    held = req.version_info.clone();
                }
                // Each cluster once, whatever the request repeats; a list no Envoy sends is refused.
                match registry::distinct_names(&req.resource_names) {
                    Ok(distinct) => names = Some(distinct.into_iter().map(str::to_string).collect()),
                    Err(e) => {
                        // The stream ends either way; whether Envoy still reads the reason is its own.
                        let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
                        break;
                    }
                }
            }
            changed = changes.changed() => {
                if changed.is_err() {
                    break;
                }
            }
        }
        let Some(want) = &names else { continue };
        if let Discovery::Response(r) = eds.answer(want, &held) {
            nonce += 1;
            held = r.version_info.clone();
            if tx.send(Ok(to_proto(&r, nonce.to_string()))).await.is_err() {
                break;
            }
        }
    }
}

fn to_wire(req: &DiscoveryRequest) -> wire::DiscoveryRequest {
    wire::DiscoveryRequest {
        version_info: req.version_info.clone(),
        node: req.node.as_ref().map(|n| wire::Node { id: n.id.clone(), cluster: n.cluster.clone() }),
        resource_names: req.resource_names.clone(),
        type_url: req.type_url.clone(),
        error_detail: None,
    }
}

fn to_proto(r: &wire::DiscoveryResponse, nonce: String) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: r.version_info.clone(),
        resources: r
            .resources
            .iter()
            .map(|cla| Any { type_url: CLA_TYPE_URL.to_string(), value: cla_to_proto(cla).encode_to_vec() })
            .collect(),
        type_url: CLA_TYPE_URL.to_string(),
        nonce,
        ..Default::default()
    }
}

fn cla_to_proto(cla: &wire::ClusterLoadAssignment) -> ep::ClusterLoadAssignment {
    ep::ClusterLoadAssignment {
        cluster_name: cla.cluster_name.clone(),
        endpoints: cla
            .endpoints
            .iter()
            .map(|loc| ep::LocalityLbEndpoints {
                lb_endpoints: loc
                    .lb_endpoints
                    .iter()
                    .map(|e| ep::LbEndpoint {
                        host_identifier: Some(ep::lb_endpoint::HostIdentifier::Endpoint(ep::Endpoint {
                            address: Some(core::Address {
                                address: Some(core::address::Address::SocketAddress(core::SocketAddress {
                                    address: e.endpoint.address.socket_address.address.clone(),
                                    port_specifier: Some(core::socket_address::PortSpecifier::PortValue(
                                        e.endpoint.address.socket_address.port_value as u32,
                                    )),
                                    ..Default::default()
                                })),
                            }),
                            hostname: e.endpoint.hostname.clone().unwrap_or_default(),
                            ..Default::default()
                        })),
                        load_balancing_weight: Some(UInt32Value { value: e.load_balancing_weight }),
                        ..Default::default()
                    })
                    .collect(),
                priority: loc.priority,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_round_trip_keeps_weights_and_addresses() {
        let cla = wire::ClusterLoadAssignment {
            type_url: CLA_TYPE_URL.into(),
            cluster_name: "vllm".into(),
            endpoints: vec![wire::LocalityLbEndpoints {
                lb_endpoints: vec![wire::LbEndpoint {
                    endpoint: wire::Endpoint {
                        address: wire::Address {
                            socket_address: wire::SocketAddress {
                                address: "10.0.0.1".into(),
                                port_value: 8000,
                            },
                        },
                        hostname: Some("vllm-0".into()),
                    },
                    load_balancing_weight: 7,
                }],
                priority: 1,
            }],
        };
        let resp = wire::DiscoveryResponse {
            version_info: "v".into(),
            resources: vec![cla],
            type_url: CLA_TYPE_URL.into(),
        };
        let p = to_proto(&resp, "1".into());
        assert_eq!(p.nonce, "1");
        let back = ep::ClusterLoadAssignment::decode(p.resources[0].value.as_slice()).unwrap();
        assert_eq!(back.endpoints[0].priority, 1, "a standby priority travels over gRPC too");
        let lb = &back.endpoints[0].lb_endpoints[0];
        assert_eq!(lb.load_balancing_weight.as_ref().map(|w| w.value), Some(7));
        let Some(ep::lb_endpoint::HostIdentifier::Endpoint(e)) = &lb.host_identifier else { panic!() };
        assert_eq!(e.hostname, "vllm-0");
        let Some(core::address::Address::SocketAddress(sa)) =
            e.address.as_ref().and_then(|a| a.address.as_ref())
        else {
            panic!()
        };
        assert_eq!(
            (sa.address.as_str(), sa.port_specifier.clone()),
            ("10.0.0.1", Some(core::socket_address::PortSpecifier::PortValue(8000)))
        );
    }
}
