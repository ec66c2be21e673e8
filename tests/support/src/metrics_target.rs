//! A tiny HTTP server that serves whatever Prometheus text a test sets at `/metrics`: a stand-in for
//! a model server's metrics page when the test is about the controller, not the server.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::get;
use axum::Router;

pub struct MetricsTarget {
    pub addr: std::net::SocketAddr,
    text: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsTarget {
    pub async fn start(text: &str) -> MetricsTarget {
        Self::start_at(([127, 0, 0, 1], 0).into(), text).await.expect("bind metrics target")
    }

    /// [`MetricsTarget::start`] on a given address (another loopback address, a given port: the
    /// pods of one InferencePool all serve on its target port).
    pub async fn start_at(at: std::net::SocketAddr, text: &str) -> std::io::Result<MetricsTarget> {
        let text = Arc::new(Mutex::new(text.to_string()));
        let app = Router::new()
            .route(
                "/metrics",
                get(|State(t): State<Arc<Mutex<String>>>| async move {
                    t.lock().map(|g| g.clone()).unwrap_or_default()
                }),
            )
            .with_state(text.clone());
        let listener = tokio::net::TcpListener::bind(at).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(MetricsTarget { addr, text, task })
    }

    /// A vLLM v1 metrics page with the given load, split over two data-parallel engines.
    pub async fn vllm(waiting: f64, running: f64, kv: f64) -> MetricsTarget {
        Self::start(&vllm_text(waiting, running, kv)).await
    }

    pub fn set(&self, text: &str) {
        if let Ok(mut g) = self.text.lock() {
            *g = text.to_string();
        }
    }

    pub fn member(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for MetricsTarget {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// vLLM v1 exposition with `engine` labels; the load is split evenly over two engines.
pub fn vllm_text(waiting: f64, running: f64, kv: f64) -> String {
    let m = "model_name=\"meta-llama/Llama-3.1-8B-Instruct\"";
    format!(
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",{m}}} {w}\n\
         vllm:num_requests_waiting{{engine=\"1\",{m}}} {w}\n\
         # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",{m}}} {r}\n\
         vllm:num_requests_running{{engine=\"1\",{m}}} {r}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",{m}}} {kv}\n\
         vllm:kv_cache_usage_perc{{engine=\"1\",{m}}} {kv}\n",
        w = waiting / 2.0,
        r = running / 2.0,
    )
}
