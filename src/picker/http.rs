//! The sideband door, for load balancers that can make one HTTP call per request (a BIG-IP iRule's
//! `SIDEBAND` connection): `POST /pick/{pool}` with the request body, or its first bytes, as the
//! body; the answer is one line, `ip:port` of the member to use, or `fallback` when the picker has
//! nobody to offer (the caller then lets its own load balancing, weighted by the pushed ratios,
//! choose).
//!
//! Optional request headers: `x-llmlc-members`, the members the caller may use (its active
//! members, `ip:port` separated by commas or spaces; others are never answered), and
//! `x-llm-prefix-key`, a client's session or prefix key (hashed, never logged). The door never hears
//! how the request ends: a pick loads its member until the member's next reading.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;

use super::pool::{Ask, NoPick, PoolPicker, Settle};
use super::PickCounter;

/// The most of a body the door reads; a load balancer sends the first bytes, not a whole upload.
pub const MAX_BODY: usize = 1 << 20;

/// The answer when the caller should use its own load balancing.
pub const FALLBACK: &str = "fallback\n";

#[derive(Clone)]
struct Door {
    pools: Arc<BTreeMap<String, Arc<PoolPicker>>>,
    counter: PickCounter,
}

/// The routes for `pools` (those whose `picker.http` is this address).
pub fn router(pools: BTreeMap<String, Arc<PoolPicker>>, counter: PickCounter) -> Router {
    Router::new()
        .route("/pick/{pool}", post(pick))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(Door { pools: Arc::new(pools), counter })
}

fn error(status: StatusCode, message: String) -> Response {
    (status, axum::Json(serde_json::json!({"error": message}))).into_response()
}

async fn pick(
    State(door): State<Door>,
    Path(pool): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(p) = door.pools.get(&pool) else {
        let known: Vec<&str> = door.pools.keys().map(String::as_str).collect();
        return error(
            StatusCode::NOT_FOUND,
            format!("no picker for pool {pool:?} here (pools: {})", known.join(", ")),
        );
    };
    let subset: Option<Vec<String>> = headers.get("x-llmlc-members").map(|v| {
        String::from_utf8_lossy(v.as_bytes())
            .split([',', ' '])
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    });
    let ask = Ask {
        body: &body,
        key: headers.get("x-llm-prefix-key").map(|v| v.as_bytes()),
        subset: subset.as_deref(),
        sheddable: false,
        with_fallbacks: false,
    };
    match p.pick(ask, Settle::Never) {
        Ok(pick) => {
            door.counter.count(&pool, "http", "picked");
            let mut line = pick.endpoints.into_iter().next().unwrap_or_default();
            line.push('\n');
            line.into_response()
        }
        Err(why) => {
            door.counter.count(&pool, "http", outcome(why));
            FALLBACK.into_response()
        }
    }
}

fn outcome(why: NoPick) -> &'static str {
    match why {
        NoPick::NoMembers => "no_members",
        NoPick::OutsideSubset => "outside_subset",
        NoPick::Shed => "shed",
    }
}
