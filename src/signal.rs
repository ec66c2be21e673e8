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

/// SIGHUPs, where daemons take them as "read your config again". Without a config file to reload
/// the signal is still caught (and logged), so it never kills the process.
pub struct Hangups {
    #[cfg(unix)]
    inner: Option<tokio::signal::unix::Signal>,
}

/// Start listening for SIGHUP.
pub fn hangups() -> Hangups {
    #[cfg(unix)]
    {
        Hangups { inner: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok() }
    }
    #[cfg(not(unix))]
    {
        Hangups {}
    }
}

impl Hangups {
    /// The next SIGHUP (never, where signals are not available).
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(s) = self.inner.as_mut() {
            if s.recv().await.is_some() {
                return;
            }
        }
        std::future::pending::<()>().await
    }
}
