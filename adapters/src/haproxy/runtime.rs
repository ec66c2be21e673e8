//! A client for HAProxy's runtime API (the `stats socket`), over a unix socket or TCP.
//!
//! Wire facts (HAProxy 2.6, checked against the Debian build): the client writes one line and HAProxy,
//! in non-interactive mode, answers and closes. `;` chains commands on that line; each command's answer
//! is its output followed by one empty line, so a successful `set server` answers just `\n` and a
//! refused one answers its message (`No such server.`, `Permission denied`, ...) then `\n`. There is no
//! status code: any text in a `set` answer is an error. Every exchange runs under one timeout covering
//! connect, write and read.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::state::{parse_servers_state, ServerState};
use crate::SinkError;

/// Longest command line sent in one connection. HAProxy reads a line into one buffer (`tune.bufsize`,
/// 16 KiB by default); longer chains are split across connections.
const MAX_LINE: usize = 8 * 1024;

/// Largest reply read; a runtime API answer for one backend is far smaller.
const MAX_REPLY: u64 = 16 * 1024 * 1024;

/// Where the runtime API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeAddr {
    Unix(PathBuf),
    Tcp { host: String, port: u16 },
}

impl RuntimeAddr {
    /// `unix:/path`, an absolute path, or `host:port` (`[v6]:port`). The `ipv4@` / `ipv6@` prefixes of
    /// haproxy.cfg's `stats socket` line are accepted so that line can be copied as is.
    pub fn parse(s: &str) -> Result<RuntimeAddr, String> {
        let s = s.trim();
        if let Some(p) = s.strip_prefix("unix:").or_else(|| s.starts_with('/').then_some(s)) {
            if p.is_empty() {
                return Err("`unix:` needs a socket path, e.g. `unix:/var/run/haproxy/admin.sock`".into());
            }
            return Ok(RuntimeAddr::Unix(PathBuf::from(p)));
        }
        let s = s.strip_prefix("ipv4@").or_else(|| s.strip_prefix("ipv6@")).unwrap_or(s);
        let hint =
            "expected `unix:/path/to/admin.sock` or `host:port` (a `stats socket` line with `level admin`)";
        let (host, port) = s.rsplit_once(':').ok_or_else(|| format!("`{s}`: {hint}"))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        let port: u16 =
            port.parse().map_err(|_| format!("`{s}`: port `{port}` is not a number 1-65535; {hint}"))?;
        if host.is_empty() || port == 0 {
            return Err(format!("`{s}`: {hint}"));
        }
        Ok(RuntimeAddr::Tcp { host: host.to_string(), port })
    }
}

impl std::fmt::Display for RuntimeAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            RuntimeAddr::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            RuntimeAddr::Tcp { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

/// One `set server` that HAProxy refused, with its own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub server: String,
    pub weight: u32,
    pub message: String,
}

#[derive(Debug, Clone)]
pub struct RuntimeClient {
    addr: RuntimeAddr,
    timeout: Duration,
}

impl RuntimeClient {
    pub fn new(addr: RuntimeAddr, timeout: Duration) -> Self {
        RuntimeClient { addr, timeout }
    }

    pub fn addr(&self) -> &RuntimeAddr {
        &self.addr
    }

    fn target(&self) -> String {
        format!("haproxy runtime API {}", self.addr)
    }

    /// Send one line (commands chained with `;`), return the whole reply.
    pub async fn exchange(&self, line: &str) -> Result<String, SinkError> {
        if line.contains('\n') {
            return Err(SinkError::Config(format!("runtime API command contains a newline: {line:?}")));
        }
        let talk = async {
            match &self.addr {
                RuntimeAddr::Unix(path) => talk(tokio::net::UnixStream::connect(path).await?, line).await,
                RuntimeAddr::Tcp { host, port } => {
                    talk(tokio::net::TcpStream::connect((host.as_str(), *port)).await?, line).await
                }
            }
        };
        match tokio::time::timeout(self.timeout, talk).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(SinkError::Unreachable {
                target: self.target(),
                detail: format!(
                    "{e}; check that HAProxy runs and that `address` matches a `stats socket` line in haproxy.cfg"
                ),
            }),
            Err(_) => Err(SinkError::Unreachable {
                target: self.target(),
                detail: format!(
                    "no complete answer within {:?} (the `timeout` setting); HAProxy may be overloaded, or \
                     `address` points at something that is not a runtime API",
                    self.timeout
                ),
            }),
        }
    }

    /// Run `commands`, chained with `;` into as few connections as the line limit allows (one, for any
    /// backend below a few hundred servers). Returns one answer per command, trimmed.
    pub async fn run(&self, commands: &[String]) -> Result<Vec<String>, SinkError> {
        let mut answers = Vec::with_capacity(commands.len());
        for chunk in chunks(commands, MAX_LINE) {
            let reply = self.exchange(&chunk.join(";")).await?;
            let mut got = split_answers(&reply);
            // HAProxy closing before answering everything would be a bug or a crash; never read a
            // missing answer as success.
            got.resize(chunk.len(), "HAProxy closed the connection without answering this command".into());
            got.truncate(chunk.len());
            answers.extend(got);
        }
        Ok(answers)
    }

    /// `show servers state BACKEND`: the backend's servers and their weights now.
    pub async fn servers_state(&self, backend: &str) -> Result<Vec<ServerState>, SinkError> {
        check_name(backend)?;
        let reply = self.exchange(&format!("show servers state {backend}")).await?;
        parse_servers_state(&reply).map_err(|text| {
            let hint = if text.starts_with("Can't find backend") {
                "; check `backend` against haproxy.cfg (`show backend` on the runtime API lists them)"
            } else {
                ""
            };
            SinkError::Rejected {
                target: self.target(),
                detail: format!("`show servers state {backend}` answered \"{text}\"{hint}"),
            }
        })
    }

    /// `set server BACKEND/SERVER weight N` for each pair, chained in one connection. `Ok` holds the
    /// commands HAProxy refused, and the servers whose names no command may carry, which are not
    /// sent (empty when all were applied): one bad name costs its own weight, not the others'.
    pub async fn set_weights(
        &self,
        backend: &str,
        weights: &[(String, u32)],
    ) -> Result<Vec<Refusal>, SinkError> {
        check_name(backend)?;
        let (sendable, unsendable): (Vec<_>, Vec<_>) = weights.iter().partition(|(s, _)| valid_name(s));
        let mut refused: Vec<Refusal> = unsendable
            .into_iter()
            .map(|(server, weight)| Refusal {
                server: server.clone(),
                weight: *weight,
                message: format!("not a valid HAProxy server name ({NAME_RULE}); not sent"),
            })
            .collect();
        let commands: Vec<String> =
            sendable.iter().map(|(s, w)| format!("set server {backend}/{s} weight {w}")).collect();
        let answers = self.run(&commands).await?;
        refused.extend(
            sendable.into_iter().zip(answers).filter(|(_, a)| !a.is_empty()).map(
                |((server, weight), message)| Refusal { server: server.clone(), weight: *weight, message },
            ),
        );
        Ok(refused)
    }

    /// `get weight BACKEND/SERVER` -> `(current, initial)`.
    pub async fn get_weight(&self, backend: &str, server: &str) -> Result<(u32, u32), SinkError> {
        check_name(backend)?;
        check_name(server)?;
        let reply = self.exchange(&format!("get weight {backend}/{server}")).await?;
        let answer = split_answers(&reply).into_iter().next().unwrap_or_default();
        parse_get_weight(&answer).ok_or_else(|| SinkError::Rejected {
            target: self.target(),
            detail: format!("`get weight {backend}/{server}` answered \"{answer}\""),
        })
    }
}

async fn talk<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, line: &str) -> std::io::Result<String> {
    s.write_all(format!("{line}\n").as_bytes()).await?;
    let mut buf = Vec::new();
    (&mut s).take(MAX_REPLY + 1).read_to_end(&mut buf).await?;
    if buf.len() as u64 > MAX_REPLY {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "reply larger than 16 MiB"));
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Split a chained reply into one answer per command: each answer ends at an empty line.
pub fn split_answers(reply: &str) -> Vec<String> {
    if reply.is_empty() {
        return Vec::new();
    }
    let mut answers = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in reply.split('\n') {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            answers.push(current.join("\n"));
            current.clear();
        } else {
            current.push(line);
        }
    }
    // `split` yields a final "" after the last '\n', which closed a phantom answer above; anything
    // left in `current` is an unterminated last answer.
    if reply.ends_with('\n') {
        answers.pop();
    }
    if !current.is_empty() {
        answers.push(current.join("\n"));
    }
    answers
}

/// `10 (initial 100)` -> `(10, 100)`.
pub fn parse_get_weight(answer: &str) -> Option<(u32, u32)> {
    let (cur, rest) = answer.trim().split_once(" (initial ")?;
    Some((cur.trim().parse().ok()?, rest.strip_suffix(')')?.trim().parse().ok()?))
}

/// What [`valid_name`] accepts, for messages.
const NAME_RULE: &str = "letters, digits, '-', '_', '.', ':'";

/// HAProxy names hold only letters, digits, `-`, `_`, `.` and `:` (its own `invalid_char` rule), so a
/// name that passes can never smuggle `;`, a space or a newline into a command line.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

fn check_name(name: &str) -> Result<(), SinkError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(SinkError::Config(format!(
            "`{name}` is not a valid HAProxy backend or server name ({NAME_RULE})"
        )))
    }
}

/// Group commands so that each group, joined with `;`, stays under `max` bytes (a single longer
/// command still gets its own group).
fn chunks(commands: &[String], max: usize) -> Vec<&[String]> {
    let mut out = Vec::new();
    let (mut start, mut len) = (0, 0);
    for (i, c) in commands.iter().enumerate() {
        if i > start && len + 1 + c.len() > max {
            out.push(&commands[start..i]);
            (start, len) = (i, 0);
        }
        len += c.len() + usize::from(i > start);
    }
    if start < commands.len() {
        out.push(&commands[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(RuntimeAddr::parse("unix:/run/h.sock"), Ok(RuntimeAddr::Unix("/run/h.sock".into())));
        assert_eq!(RuntimeAddr::parse("/run/h.sock"), Ok(RuntimeAddr::Unix("/run/h.sock".into())));
        assert_eq!(
            RuntimeAddr::parse("127.0.0.1:9999"),
            Ok(RuntimeAddr::Tcp { host: "127.0.0.1".into(), port: 9999 })
        );
        assert_eq!(RuntimeAddr::parse("ipv4@127.0.0.1:9999").unwrap().to_string(), "127.0.0.1:9999");
        assert_eq!(RuntimeAddr::parse("[::1]:9999").unwrap().to_string(), "[::1]:9999");
        assert!(RuntimeAddr::parse("unix:").is_err());
        assert!(RuntimeAddr::parse("haproxy").is_err());
        assert!(RuntimeAddr::parse("h:0").is_err());
        assert!(RuntimeAddr::parse("h:99999").unwrap_err().contains("99999"));
    }

    #[test]
    fn chained_answers_split_per_command() {
        // Captured: `set ... s1 5; set ... zz 3; set ... s2 9` on HAProxy 2.6.
        assert_eq!(split_answers("\nNo such server.\n\n\n"), vec!["", "No such server.", ""]);
        assert_eq!(split_answers("\n"), vec![""]);
        assert_eq!(split_answers("\n50 (initial 10)\n\n"), vec!["", "50 (initial 10)"]);
        assert_eq!(split_answers("Permission denied\n\n"), vec!["Permission denied"]);
        assert_eq!(split_answers(""), Vec::<String>::new());
        assert_eq!(split_answers("cut short"), vec!["cut short"]);
    }

    #[test]
    fn get_weight_answer() {
        assert_eq!(parse_get_weight("10 (initial 100)"), Some((10, 100)));
        assert_eq!(parse_get_weight("No such server."), None);
    }

    #[test]
    fn names_cannot_inject_commands() {
        assert!(valid_name("llm_backend-2.v1:x"));
        for bad in ["", "be;shutdown sessions", "be x", "be\n", "be/srv"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn long_chains_split_under_the_limit() {
        let cmds: Vec<String> = (0..10).map(|i| format!("cmd{i:03}")).collect(); // 6 bytes each
        let groups = chunks(&cmds, 20); // 6+1+6 = 13, +1+6 = 20 fits, next would be 27
        assert_eq!(groups.iter().map(|g| g.len()).collect::<Vec<_>>(), vec![3, 3, 3, 1]);
        assert!(groups.iter().all(|g| g.join(";").len() <= 20));
        assert_eq!(chunks(&cmds, 8192).len(), 1);
        assert!(chunks(&[], 10).is_empty());
    }
}
