//! A real HAProxy (the Debian build at `/usr/sbin/haproxy`, or `$HAPROXY_BIN`) started on free loopback
//! ports with a generated config in a temp dir, stopped and restarted on demand, killed on drop.
//!
//! Configs are templates. The launcher fills in:
//! - `{{STATS_SOCKETS}}`: three runtime-API sockets: an admin unix socket, an admin TCP port, and a
//!   `level user` unix socket (for permission tests). Put it in the `global` section.
//! - `{{ADMIN_SOCKET}}`, `{{USER_SOCKET}}`, `{{ADMIN_PORT}}`, `{{DIR}}`: the pieces, if you want your own lines.
//! - `{{PORT:name}}`: a free loopback port, the same one for every use of `name` (read it back with
//!   [`Haproxy::port`]). Use it for `bind` lines.
//!
//! [`standard_config`] wraps backend/frontend sections with a `global` and `defaults` that fit tests.
//!
//! This is test support: failures panic with HAProxy's own output so the test log shows why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ports::free_port;

/// How long HAProxy gets to open its runtime socket after being spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// `global` + `defaults` suited to tests (HTTP mode, short timeouts, one thread), then `body`.
pub fn standard_config(body: &str) -> String {
    format!(
        "global\n    {{{{STATS_SOCKETS}}}}\n    nbthread 1\n\ndefaults\n    mode http\n    timeout connect 2s\n    \
         timeout client 10s\n    timeout server 10s\n    timeout check 2s\n\n{body}\n"
    )
}

/// The addresses the shipped deploy/haproxy/*.cfg files use for their three servers.
pub const SHIPPED_SERVERS: [&str; 3] = ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"];

/// deploy/haproxy/haproxy-prefix.cfg pointed at `members` (three `host:port`), its frontend on
/// `{{PORT:fe}}`, the launcher's sockets, health checks every 100 ms. Panics if the shipped file
/// changed so that a rewrite no longer applies.
pub fn shipped_prefix_config(members: &[String]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/haproxy/haproxy-prefix.cfg");
    let mut cfg = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    for (from, to) in [
        ("bind *:8080", "bind 127.0.0.1:{{PORT:fe}}"),
        ("stats socket /var/run/haproxy/admin.sock mode 660 level admin", "{{STATS_SOCKETS}}"),
        ("check inter 2s", "check inter 100ms"),
    ] {
        assert!(cfg.contains(from), "{from:?} not in the shipped haproxy-prefix.cfg");
        cfg = cfg.replace(from, to);
    }
    for (shipped, local) in SHIPPED_SERVERS.iter().zip(members) {
        cfg = cfg.replace(shipped, local);
    }
    assert!(!cfg.contains("10.0.0.1"), "a shipped address was not rewritten:\n{cfg}");
    cfg
}

/// `cfg` (from [`shipped_prefix_config`]) with the opt-in body key turned on, hashing the body's
/// first `bytes` bytes (the shipped length is 512).
pub fn with_body_key(cfg: &str, bytes: usize) -> String {
    let lines = [
        "    # http-request wait-for-body time 1s at-least 512\n",
        "    # http-request set-var(txn.prefix_key) req.body,bytes(0,512)",
    ];
    let mut out = cfg.to_string();
    for l in lines {
        assert!(out.contains(l), "{l:?} not in the shipped haproxy-prefix.cfg");
        out = out.replace(l, &l.replacen("    # ", "    ", 1));
    }
    out.replace("at-least 512", &format!("at-least {bytes}"))
        .replace("bytes(0,512)", &format!("bytes(0,{bytes})"))
}

/// deploy/haproxy/haproxy-spoe.cfg with its spoe-picker.conf (written into `spoe_dir`, the message's
/// pool renamed `pool`) over three `members`, the agent at `127.0.0.1:agent_port`, the frontend on
/// `{{PORT:fe}}`, the launcher's sockets, health checks every 100 ms, and every answer naming the
/// server that took it (`x-upstream`); returns once every server is UP. Panics if the shipped files
/// changed so that a rewrite no longer applies.
pub async fn start_shipped_spoe(members: &[String], agent_port: u16, spoe_dir: &Path, pool: &str) -> Haproxy {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/haproxy");
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap_or_else(|e| panic!("read {f}: {e}"));
    let spoe_conf = read("spoe-picker.conf");
    assert!(spoe_conf.contains("pool=str(llm)"), "spoe-picker.conf changed");
    let spoe_path = spoe_dir.join("spoe-picker.conf");
    std::fs::write(&spoe_path, spoe_conf.replace("pool=str(llm)", &format!("pool=str({pool})")))
        .expect("write spoe-picker.conf");
    let mut cfg = read("haproxy-spoe.cfg");
    let agent = format!("127.0.0.1:{agent_port}");
    let spoe = spoe_path.display().to_string();
    for (from, to) in [
        ("bind *:8080", "bind 127.0.0.1:{{PORT:fe}}"),
        ("stats socket ipv4@0.0.0.0:9999 level admin", "{{STATS_SOCKETS}}"),
        ("log stdout format raw local0 info", "nbthread 1"),
        ("check inter 2s", "check inter 100ms"),
        ("llm-load-controller:9005", agent.as_str()),
        ("/etc/haproxy/spoe-picker.conf", spoe.as_str()),
        ("    balance leastconn\n", "    balance leastconn\n    http-response set-header x-upstream %s\n"),
    ] {
        assert!(cfg.contains(from), "{from:?} not in the shipped haproxy-spoe.cfg");
        cfg = cfg.replace(from, to);
    }
    for (shipped, local) in SHIPPED_SERVERS.iter().zip(members) {
        cfg = cfg.replace(shipped, local);
    }
    let hx = Haproxy::start(&cfg).await;
    wait_all_up(&hx, "llm", &["vllm-0", "vllm-1", "vllm-2"]).await;
    hx
}

/// Which way a prefix-affinity measurement sends its requests through [`prefix_pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixLb {
    /// deploy/haproxy/haproxy-prefix.cfg as shipped, its body key on.
    PrefixHash,
    /// The same file's `balance leastconn` backend.
    Leastconn,
}

impl PrefixLb {
    /// The frontend port of `hx` (from [`prefix_pair`]) that goes this way.
    pub fn port(self, hx: &Haproxy) -> u16 {
        match self {
            PrefixLb::PrefixHash => hx.port("fe"),
            PrefixLb::Leastconn => hx.port("lc"),
        }
    }
}

/// The shipped prefix config over three `members` with its opt-in body key on (the first 512
/// bytes: the measurements' clients send no key header), plus a frontend `lc` straight to its
/// leastconn backend; returns once every server of both backends is UP.
pub async fn prefix_pair(members: &[String]) -> Haproxy {
    let cfg = format!(
        "{}\nfrontend lc\n    bind 127.0.0.1:{{{{PORT:lc}}}}\n    default_backend llm\n",
        with_body_key(&shipped_prefix_config(members), 512)
    );
    let hx = Haproxy::start(&cfg).await;
    for backend in ["llm_prefix", "llm"] {
        wait_all_up(&hx, backend, &["vllm-0", "vllm-1", "vllm-2"]).await;
    }
    hx
}

/// Poll until every server of `backend` is UP by its health check.
pub async fn wait_all_up(hx: &Haproxy, backend: &str, servers: &[&str]) {
    crate::wait::until(
        Duration::from_secs(5),
        &format!("servers of {backend} UP by health check"),
        || async {
            let mut up = true;
            for s in servers {
                up &= hx.stat(backend, s, "status").await == "UP";
            }
            up.then_some(())
        },
    )
    .await
}

/// A running (or stopped, between [`Haproxy::stop`] and [`Haproxy::start_again`]) HAProxy.
pub struct Haproxy {
    dir: tempfile::TempDir,
    config: String,
    cfg_path: PathBuf,
    log_path: PathBuf,
    admin_socket: PathBuf,
    user_socket: PathBuf,
    admin_port: u16,
    ports: BTreeMap<String, u16>,
    child: Option<Child>,
}

/// The binary to run: `$HAPROXY_BIN`, else the Debian path, else `haproxy` on PATH.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("HAPROXY_BIN") {
        return PathBuf::from(p);
    }
    let debian = Path::new("/usr/sbin/haproxy");
    if debian.exists() {
        debian.to_path_buf()
    } else {
        PathBuf::from("haproxy")
    }
}

impl Haproxy {
    /// Fill in the template's placeholders, check the config with `haproxy -c`, start HAProxy in the
    /// foreground and wait until its admin socket answers.
    pub async fn start(template: &str) -> Haproxy {
        let dir =
            tempfile::Builder::new().prefix("haproxy-").tempdir().expect("create a temp dir for HAProxy");
        let admin_socket = dir.path().join("admin.sock");
        let user_socket = dir.path().join("user.sock");
        let admin_port = free_port();
        let mut ports = BTreeMap::new();
        let config = fill(template, dir.path(), &admin_socket, &user_socket, admin_port, &mut ports);
        let cfg_path = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg_path, &config).expect("write haproxy.cfg");
        let log_path = dir.path().join("haproxy.log");

        let check =
            Command::new(binary()).arg("-c").arg("-f").arg(&cfg_path).output().expect("run haproxy -c");
        if !check.status.success() {
            panic!(
                "HAProxy rejected the generated config:\n{}\n{}\n--- config ---\n{config}",
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );
        }

        let mut h = Haproxy {
            dir,
            config,
            cfg_path,
            log_path,
            admin_socket,
            user_socket,
            admin_port,
            ports,
            child: None,
        };
        h.start_again().await;
        h
    }

    /// Start the same config again after [`Haproxy::stop`]. Same sockets, same ports; runtime weights
    /// are gone, as after any real restart.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "HAProxy is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("open the HAProxy log file");
        let log2 = log.try_clone().expect("clone the HAProxy log handle");
        // -db: stay in the foreground so the child is HAProxy itself and killing it stops it.
        let child = Command::new(binary())
            .arg("-db")
            .arg("-f")
            .arg(&self.cfg_path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .expect("spawn haproxy");
        self.child = Some(child);
        self.wait_ready().await;
    }

    /// Kill HAProxy (SIGKILL) and reap it. The unix socket file may remain; nothing listens on it.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A stale socket file would make "connection refused" look different from "no such file";
        // removing it gives the error a real outage gives after a host restart.
        let _ = std::fs::remove_file(&self.admin_socket);
        let _ = std::fs::remove_file(&self.user_socket);
    }

    /// Stop and start again: every runtime change (weights) is lost.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.start_again().await;
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("HAProxy exited during start-up ({status}):\n{}", self.log());
                }
            }
            if let Ok(reply) = raw_command(&self.admin_socket, "show info").await {
                if reply.contains("Pid:") {
                    return;
                }
            }
            if Instant::now() >= deadline {
                panic!("HAProxy did not open its admin socket within {READY_TIMEOUT:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// What HAProxy printed so far (warnings, alerts).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Runtime API address for the sink, admin level: `unix:/tmp/.../admin.sock`.
    pub fn runtime_address(&self) -> String {
        format!("unix:{}", self.admin_socket.display())
    }

    /// Runtime API address for the sink over TCP, admin level: `127.0.0.1:PORT`.
    pub fn runtime_tcp_address(&self) -> String {
        format!("127.0.0.1:{}", self.admin_port)
    }

    /// Runtime API address of the `level user` socket (reads work, `set` answers "Permission denied").
    pub fn user_runtime_address(&self) -> String {
        format!("unix:{}", self.user_socket.display())
    }

    pub fn admin_socket(&self) -> &Path {
        &self.admin_socket
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// The port chosen for `{{PORT:name}}`. Panics if the template did not use that name.
    pub fn port(&self, name: &str) -> u16 {
        *self.ports.get(name).unwrap_or_else(|| panic!("the HAProxy template has no {{{{PORT:{name}}}}}"))
    }

    /// The config HAProxy runs, placeholders filled in.
    pub fn config(&self) -> &str {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// PID of the running HAProxy, if running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Send one runtime-API line over the admin socket and return the raw reply. Written independently
    /// of the adapter's client so tests check the adapter against HAProxy, not against itself.
    pub async fn command(&self, cmd: &str) -> String {
        raw_command(&self.admin_socket, cmd)
            .await
            .unwrap_or_else(|e| panic!("runtime API command {cmd:?} failed: {e}\n{}", self.log()))
    }

    /// Current and initial weight of `backend/server`, from `get weight`.
    pub async fn weight(&self, backend: &str, server: &str) -> (u32, u32) {
        let reply = self.command(&format!("get weight {backend}/{server}")).await;
        parse_get_weight(&reply).unwrap_or_else(|| panic!("unexpected `get weight` reply: {reply:?}"))
    }

    /// One field of `show stat` (CSV) for `backend/server`, e.g. `status` (`UP`, `DOWN`, ...),
    /// `weight`, `check_status`, `agent_status` (`L7OK`, `L4CON`, ...).
    pub async fn stat(&self, backend: &str, server: &str, field: &str) -> String {
        let reply = self.command("show stat").await;
        let mut lines = reply.lines();
        let header: Vec<&str> =
            lines.next().unwrap_or_default().trim_start_matches("# ").split(',').collect();
        let i = header
            .iter()
            .position(|h| *h == field)
            .unwrap_or_else(|| panic!("no column {field} in show stat"));
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .find(|f| f.first() == Some(&backend) && f.get(1) == Some(&server))
            .and_then(|f| f.get(i).map(|v| v.to_string()))
            .unwrap_or_else(|| panic!("no {backend}/{server} in show stat"))
    }

    /// `srv_name -> srv_uweight` of one backend, from `show servers state`.
    pub async fn state_weights(&self, backend: &str) -> BTreeMap<String, u32> {
        let reply = self.command(&format!("show servers state {backend}")).await;
        let mut lines = reply.lines();
        let header: Vec<&str> = lines
            .find(|l| l.starts_with("# "))
            .unwrap_or_else(|| panic!("no header in `show servers state`: {reply:?}"))
            .trim_start_matches("# ")
            .split(' ')
            .collect();
        let col = |name: &str| header.iter().position(|h| *h == name).expect("column in show servers state");
        let (name_i, w_i) = (col("srv_name"), col("srv_uweight"));
        lines
            .filter(|l| !l.is_empty())
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f[name_i].to_string(), f[w_i].parse().expect("numeric srv_uweight"))
            })
            .collect()
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `"10 (initial 100)\n\n"` -> `(10, 100)`.
pub fn parse_get_weight(reply: &str) -> Option<(u32, u32)> {
    let line = reply.lines().next()?;
    let (cur, rest) = line.split_once(" (initial ")?;
    Some((cur.trim().parse().ok()?, rest.trim_end_matches(')').trim().parse().ok()?))
}

async fn raw_command(socket: &Path, cmd: &str) -> std::io::Result<String> {
    let exchange = async {
        let mut s = tokio::net::UnixStream::connect(socket).await?;
        s.write_all(format!("{cmd}\n").as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(5), exchange).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "runtime API did not answer"))
    })
}

fn fill(
    template: &str,
    dir: &Path,
    admin_socket: &Path,
    user_socket: &Path,
    admin_port: u16,
    ports: &mut BTreeMap<String, u16>,
) -> String {
    let sockets = format!(
        "stats socket {} mode 600 level admin\n    stats socket ipv4@127.0.0.1:{admin_port} level admin\n    \
         stats socket {} mode 600 level user",
        admin_socket.display(),
        user_socket.display()
    );
    let mut text = template
        .replace("{{STATS_SOCKETS}}", &sockets)
        .replace("{{ADMIN_SOCKET}}", &admin_socket.display().to_string())
        .replace("{{USER_SOCKET}}", &user_socket.display().to_string())
        .replace("{{ADMIN_PORT}}", &admin_port.to_string())
        .replace("{{DIR}}", &dir.display().to_string());
    while let Some(start) = text.find("{{PORT:") {
        let end =
            text[start..].find("}}").map(|e| start + e).expect("unterminated {{PORT:name}} in template");
        let name = text[start + 7..end].to_string();
        let port = *ports.entry(name).or_insert_with(free_port);
        text.replace_range(start..end + 2, &port.to_string());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_filled_and_named_ports_repeat() {
        let mut ports = BTreeMap::new();
        let t = "{{STATS_SOCKETS}}\nbind 127.0.0.1:{{PORT:fe}}\nx {{PORT:fe}} {{PORT:other}}";
        let out = fill(t, Path::new("/d"), Path::new("/d/a.sock"), Path::new("/d/u.sock"), 9, &mut ports);
        assert!(out.contains("stats socket /d/a.sock mode 600 level admin"));
        assert!(out.contains("ipv4@127.0.0.1:9 level admin"));
        assert!(!out.contains("{{"));
        let fe = ports["fe"];
        assert_eq!(out.matches(&fe.to_string()).count(), 2);
        assert_ne!(ports["fe"], ports["other"]);
    }

    #[test]
    fn get_weight_reply() {
        assert_eq!(parse_get_weight("10 (initial 100)\n\n"), Some((10, 100)));
        assert_eq!(parse_get_weight("No such server.\n\n"), None);
    }
}
