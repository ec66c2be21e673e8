//! The HAProxy door: a stream processing offload agent (SPOA) speaking SPOP 2.0 (HAProxy 2.0 and
//! later, the `spop` crate's frames). HAProxy's SPOE filter sends, per request, the message
//! `pick` with the arguments:
//! - `pool` (string): the controller's pool to pick in (pools may share the agent's address);
//! - `key` (string, may be empty or absent): a client's session or prefix key;
//! - `body` (binary): the first bytes of the request body (`req.body`, up to `tune.bufsize`);
//! - `model` (string, may be empty);
//! - `criticality` (string, may be absent): `sheddable` requests get `shed` (true) instead of a
//!   server while every member is saturated, and the config refuses them with 429.
//!
//! The answer sets, in scope `txn`: `srv`, the HAProxy server name of the pick (when the agent
//! knows the backend's names: read from the pool's HAProxy runtime API), `addr` (`ip:port`) and
//! `id` (the pick, for `done`). The config then reads `var(txn.<var-prefix>.srv)` in `use-server`.
//! The optional message `done` (argument `id`, sent `on-http-response`) marks the answer's
//! start; once a pool has seen one, its picks are counted in flight until their `done` (a minute
//! at most: a client that hangs up before the answer starts never gets one), else
//! each pick loads its member until the member's next reading. An unknown pool, a missing body
//! or an agent that does not answer within `timeout processing` leaves the variables unset, and
//! HAProxy balances by itself with the pushed weights.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use llm_lc_adapters::haproxy::runtime::{RuntimeAddr, RuntimeClient};
use spop::frame::Message;
use spop::frame::{FramePayload, FrameType};
use spop::frames::{Ack, AgentDisconnect, AgentHello, FrameCapabilities, HaproxyHello};
use spop::{SpopCodec, StatusCode, TypedData, VarScope, MAX_FRAME_SIZE_LIMIT};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

use super::pool::{Ask, NoPick, PoolPicker, Settle};
use super::PickCounter;

/// How long a pick waits for its `done`: HAProxy sends it with the response headers, and nothing
/// for a request whose client hung up before them; past this the pick is released (its load by then
/// shows in the engine's own gauges).
const DONE_WITHIN: Duration = Duration::from_secs(60);

/// How often a pool's HAProxy server names are read again.
const NAMES_EVERY: Duration = Duration::from_secs(5);

/// One pool as the agent serves it.
pub struct SpoePool {
    pub picker: Arc<PoolPicker>,
    /// HAProxy server name by member (`ip:port`).
    names: RwLock<HashMap<String, String>>,
    /// Whether HAProxy reports `done` for this pool's picks (then they are tracked).
    done_seen: AtomicBool,
}

impl SpoePool {
    pub fn new(picker: Arc<PoolPicker>) -> SpoePool {
        SpoePool { picker, names: RwLock::new(HashMap::new()), done_seen: AtomicBool::new(false) }
    }

    fn name_of(&self, member: &str) -> Option<String> {
        self.names.read().unwrap_or_else(|p| p.into_inner()).get(member).cloned()
    }
}

/// Keep `pool`'s server names from the backend's `show servers state` until `stop`: the first
/// runtime API that answers wins. Failures are logged once per change.
pub async fn follow_names(pool: Arc<SpoePool>, addrs: Vec<String>, backend: String, stop: CancellationToken) {
    let clients: Vec<RuntimeClient> = addrs
        .iter()
        .filter_map(|a| RuntimeAddr::parse(a).ok())
        .map(|a| RuntimeClient::new(a, Duration::from_secs(2)))
        .collect();
    let mut tick = tokio::time::interval(NAMES_EVERY);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut read = None;
        for c in &clients {
            if let Ok(servers) = c.servers_state(&backend).await {
                read = Some(servers);
                break;
            }
        }
        match read {
            Some(servers) => {
                let names: HashMap<String, String> = servers
                    .into_iter()
                    .filter_map(|s| Some((s.member_id()?.as_str().to_string(), s.name)))
                    .collect();
                *pool.names.write().unwrap_or_else(|p| p.into_inner()) = names;
                if failing {
                    tracing::info!(pool = %pool.picker.name, "SPOE agent reads the backend's server names again");
                }
                failing = false;
            }
            None if !failing => {
                failing = true;
                tracing::warn!(pool = %pool.picker.name, backend = %backend, "SPOE agent cannot read the backend's server names from the runtime API; answering `addr` only");
            }
            None => {}
        }
    }
}

/// Accept HAProxy's connections until `stop`.
pub async fn serve(
    listener: TcpListener,
    pools: Arc<BTreeMap<String, Arc<SpoePool>>>,
    counter: PickCounter,
    stop: CancellationToken,
) {
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "SPOE agent: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (pools, counter, stop) = (pools.clone(), counter.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = connection(stream, &pools, &counter) => {}
            }
        });
    }
}

async fn connection(stream: TcpStream, pools: &BTreeMap<String, Arc<SpoePool>>, counter: &PickCounter) {
    let mut socket = Framed::new(stream, SpopCodec::default());
    while let Some(frame) = socket.next().await {
        // A reset or a cut read is how HAProxy ends idle and health-check connections.
        let Ok(frame) = frame else { return };
        match frame.frame_type() {
            FrameType::HaproxyHello => {
                let Ok(hello) = HaproxyHello::try_from(frame.payload()) else {
                    return disconnect(&mut socket, StatusCode::Invalid).await;
                };
                let Some(version) = hello.negotiate_version() else {
                    return disconnect(&mut socket, StatusCode::BadVersion).await;
                };
                // HAProxy's own frame size, echoed: a smaller one makes it drop and reopen the
                // connection for every message that does not fit (it cannot fragment to us).
                let max_frame_size = match hello.negotiate_max_frame_size(MAX_FRAME_SIZE_LIMIT) {
                    Ok(size) => size,
                    Err(status) => return disconnect(&mut socket, status).await,
                };
                socket.codec_mut().set_max_frame_size(max_frame_size);
                let answer =
                    AgentHello { version, max_frame_size, capabilities: vec![FrameCapabilities::Pipelining] };
                if socket.send(Box::new(answer)).await.is_err() || hello.healthcheck.unwrap_or(false) {
                    return;
                }
            }
            FrameType::HaproxyDisconnect => return disconnect(&mut socket, StatusCode::None).await,
            FrameType::Notify => {
                let meta = frame.metadata();
                let mut ack = Ack::new(meta.stream_id, meta.frame_id);
                if let FramePayload::ListOfMessages(messages) = frame.payload() {
                    for m in messages {
                        ack = answer(m, ack, pools, counter);
                    }
                }
                if socket.send(Box::new(ack)).await.is_err() {
                    return;
                }
            }
            _ => {}
        }
    }
}

async fn disconnect(socket: &mut Framed<TcpStream, SpopCodec>, status: StatusCode) {
    let frame = AgentDisconnect { status_code: status.to_u32(), message: status.message().to_string() };
    let _ = socket.send(Box::new(frame)).await;
    let _ = socket.close().await;
}

/// Bytes of an argument, whatever type HAProxy gave it (`None` when absent or NULL).
fn bytes_of<'a>(m: &'a Message, name: &str) -> Option<&'a [u8]> {
    match m.get(name)? {
        TypedData::String(s) => Some(s.as_bytes()),
        TypedData::Binary(b) => Some(b.as_slice()),
        _ => None,
    }
}

fn int_of(m: &Message, name: &str) -> Option<u64> {
    match m.get(name)? {
        TypedData::Int32(v) => u64::try_from(*v).ok(),
        TypedData::UInt32(v) => Some(u64::from(*v)),
        TypedData::Int64(v) => u64::try_from(*v).ok(),
        TypedData::UInt64(v) => Some(*v),
        TypedData::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// One message's actions added to `ack`.
fn answer(m: &Message, ack: Ack, pools: &BTreeMap<String, Arc<SpoePool>>, counter: &PickCounter) -> Ack {
    let pool_name = bytes_of(m, "pool").map(String::from_utf8_lossy).unwrap_or_default();
    let Some(pool) = pools.get(pool_name.as_ref()) else {
        counter.count(&pool_name, "spoe", "unknown_pool");
        return ack;
    };
    match m.name.as_str() {
        "pick" => {
            let tracked = pool.done_seen.load(Ordering::Relaxed);
            let ask = Ask {
                body: bytes_of(m, "body").unwrap_or_default(),
                key: bytes_of(m, "key"),
                subset: None,
                sheddable: bytes_of(m, "criticality").is_some_and(|c| c.eq_ignore_ascii_case(b"sheddable")),
                with_fallbacks: false,
            };
            let settle = if tracked { Settle::TrackedFor(DONE_WITHIN) } else { Settle::Never };
            match pool.picker.pick(ask, settle) {
                Ok(pick) => {
                    counter.count(&pool.picker.name, "spoe", "picked");
                    let Some(member) = pick.endpoints.first() else { return ack };
                    let mut ack = ack.set_var(VarScope::Transaction, "addr", member.as_str()).set_var(
                        VarScope::Transaction,
                        "id",
                        TypedData::UInt64(pick.id),
                    );
                    if let Some(name) = pool.name_of(member) {
                        ack = ack.set_var(VarScope::Transaction, "srv", name.as_str());
                    }
                    ack
                }
                Err(why) => {
                    counter.count(
                        &pool.picker.name,
                        "spoe",
                        match why {
                            NoPick::NoMembers => "no_members",
                            NoPick::OutsideSubset => "outside_subset",
                            NoPick::Shed => "shed",
                        },
                    );
                    // The config refuses a shed request (`http-request deny` on this variable).
                    if why == NoPick::Shed {
                        return ack.set_var(VarScope::Transaction, "shed", TypedData::Bool(true));
                    }
                    ack
                }
            }
        }
        "done" => {
            pool.done_seen.store(true, Ordering::Relaxed);
            if let Some(id) = int_of(m, "id") {
                pool.picker.first_token(id);
                pool.picker.finished(id);
            }
            ack
        }
        _ => ack,
    }
}
