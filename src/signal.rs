//! Waiting for the signals that ask a long-running command to stop.

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what Kubernetes sends before killing the pod), and logs
/// which one arrived.
pub async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received, stopping"),
        _ = term => tracing::info!("SIGTERM received, stopping"),
    }
}
