//! HAProxy `agent-check` responder: the pull path for users who cannot open the admin socket.
//!
//! HAProxy connects to the agent every `agent-inter`, sends the server's `agent-send` string, reads one
//! line and closes. We answer `N%\n`, which HAProxy applies as N % of the server's configured weight;
//! with `weight 100` on the server lines (as our haproxy.cfg examples do) N% is exactly weight N.
//! HAProxy accepts percentages above 100 as long as the result stays <= 256.
//!
//! HAProxy tells the agent nothing about which server is asking unless `agent-send` says so, so every
//! server line carries its member id: `agent-send "10.0.0.1:8000\n"`. An id we do not know gets an
//! empty line, which HAProxy treats as "no change" (checked on 2.6: a runtime weight survives it).
//!
//! ```text
//! backend llm
//!     balance leastconn
//!     default-server weight 100 agent-check agent-addr 10.0.0.5 agent-port 5555 agent-inter 2s
//!     server vllm-0 10.0.0.1:8000 agent-send "10.0.0.1:8000\n"
//!     server vllm-1 10.0.0.2:8000 agent-send "10.0.0.2:8000\n"
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::{MemberId, Ratios};

/// How long an agent connection may take to send its `agent-send` line.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// After the first bytes, how long to wait for more before taking what came as the whole key (for an
/// `agent-send` written without the trailing `\n`).
const TAIL_TIMEOUT: Duration = Duration::from_millis(100);
/// Longest `agent-send` string accepted.
const MAX_KEY: usize = 512;
/// Concurrent agent connections served; HAProxy opens one per server per `agent-inter`.
const MAX_CONNECTIONS: usize = 1024;

/// Starts responders. See the module docs for the haproxy.cfg side.
pub struct AgentResponder;

impl AgentResponder {
    /// Listen on `addr` (port 0 picks a free port) and answer from a table that starts empty.
    pub async fn bind(addr: impl ToSocketAddrs) -> std::io::Result<(AgentHandle, SocketAddr)> {
        Self::serve(TcpListener::bind(addr).await?)
    }

    /// Serve on an already bound listener (must be called inside a tokio runtime).
    pub fn serve(listener: TcpListener) -> std::io::Result<(AgentHandle, SocketAddr)> {
        let local = listener.local_addr()?;
        let table: Arc<RwLock<BTreeMap<MemberId, u32>>> = Arc::default();
        let task = tokio::spawn(accept_loop(listener, table.clone()));
        Ok((AgentHandle { table, task: Arc::new(AbortOnDrop(task)), local }, local))
    }
}

/// Updates what the responder answers. Cheap to clone; the responder stops when the last clone is
/// dropped or on [`AgentHandle::stop`].
#[derive(Clone)]
pub struct AgentHandle {
    table: Arc<RwLock<BTreeMap<MemberId, u32>>>,
    task: Arc<AbortOnDrop>,
    local: SocketAddr,
}

impl std::fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHandle").field("local", &self.local).finish_non_exhaustive()
    }
}

impl AgentHandle {
    /// Replace the table: from now on member `m` is answered `percentages[m]%`; members not in it get
    /// the "no change" answer. Returns how many members' answers changed.
    pub fn update(&self, percentages: &Ratios) -> usize {
        let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
        let changed = percentages.iter().filter(|(m, p)| table.get(*m) != Some(p)).count();
        *table = percentages.iter().map(|(m, p)| (m.clone(), p)).collect();
        changed
    }

    /// What the responder answers now.
    pub fn table(&self) -> Ratios {
        self.table.read().unwrap_or_else(|p| p.into_inner()).iter().map(|(m, p)| (m.clone(), *p)).collect()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stop accepting connections.
    pub fn stop(&self) {
        self.task.0.abort();
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn accept_loop(listener: TcpListener, table: Arc<RwLock<BTreeMap<MemberId, u32>>>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and friends: back off a little instead of spinning.
                tracing::warn!(error = %e, "haproxy agent responder: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "haproxy agent responder: too many connections, dropping one");
            continue;
        };
        let table = table.clone();
        tokio::spawn(async move {
            answer(sock, &table).await;
            drop(permit);
        });
    }
}

async fn answer(mut sock: TcpStream, table: &RwLock<BTreeMap<MemberId, u32>>) {
    let Some(key) = read_key(&mut sock).await else {
        tracing::debug!(
            "haproxy agent connection sent no `agent-send` line; add agent-send to the server line"
        );
        return;
    };
    let weight = table.read().unwrap_or_else(|p| p.into_inner()).get(&MemberId::new(key.as_str())).copied();
    let reply = match weight {
        Some(w) => format!("{w}%\n"),
        None => {
            tracing::debug!(key, "haproxy agent asked about a member the controller has no ratio for");
            "\n".to_string()
        }
    };
    // HAProxy may already have given up (its `timeout check`); nothing to do about a failed write.
    let _ = tokio::time::timeout(READ_TIMEOUT, sock.write_all(reply.as_bytes())).await;
    let _ = sock.shutdown().await;
}

/// The `agent-send` string, trimmed: up to the first newline, or whatever arrived before the sender
/// paused. `None` when nothing arrived.
async fn read_key(sock: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::with_capacity(64);
    let mut chunk = [0u8; 256];
    loop {
        let wait = if buf.is_empty() { READ_TIMEOUT } else { TAIL_TIMEOUT };
        match tokio::time::timeout(wait, sock.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => break, // EOF, error or pause: take what we have
        }
        if buf.contains(&b'\n') || buf.len() >= MAX_KEY {
            break;
        }
    }
    let line = buf.split(|b| *b == b'\n').next().unwrap_or_default();
    let key = String::from_utf8_lossy(line).trim().to_string();
    (!key.is_empty()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ask(addr: SocketAddr, send: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(send).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn answers_percentages_per_member_and_no_change_for_strangers() {
        let (h, addr) = AgentResponder::bind("127.0.0.1:0").await.unwrap();
        let r: Ratios =
            [(MemberId::from("10.0.0.1:80"), 30), (MemberId::from("10.0.0.2:80"), 150)].into_iter().collect();
        assert_eq!(h.update(&r), 2);
        assert_eq!(ask(addr, b"10.0.0.1:80\n").await, "30%\n");
        assert_eq!(ask(addr, b"10.0.0.2:80\r\n").await, "150%\n");
        assert_eq!(ask(addr, b"10.0.0.9:80\n").await, "\n");
        // agent-send written without "\n": the pause ends the key.
        assert_eq!(ask(addr, b"10.0.0.1:80").await, "30%\n");
        assert_eq!(h.update(&r), 0);
        let r2: Ratios = [(MemberId::from("10.0.0.1:80"), 31)].into_iter().collect();
        assert_eq!(h.update(&r2), 1);
        assert_eq!(ask(addr, b"10.0.0.2:80\n").await, "\n", "replaced, not merged");
        assert_eq!(h.table(), r2);
    }

    #[tokio::test]
    async fn stops_when_dropped() {
        let (h, addr) = AgentResponder::bind("127.0.0.1:0").await.unwrap();
        drop(h);
        let refused = wait_refused(addr).await;
        assert!(refused, "responder still accepting after the handle was dropped");
    }

    /// Aborting the task closes the listener shortly after; poll rather than sleep.
    async fn wait_refused(addr: SocketAddr) -> bool {
        for _ in 0..100 {
            if TcpStream::connect(addr).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}
