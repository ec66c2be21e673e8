//! The one control loop: a cycle of the [`Controller`] on every tick until shutdown, with a config
//! reload ([`Reloader`], for `run --config FILE`) as a second input applied between two cycles, and
//! each cycle's report printed on stdout. Apart from [`crate::controller`] because the loop drives
//! both the controller and the reloader, and the reloader builds controllers: here both are used,
//! neither uses the other's caller.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::Config;
use crate::controller::Controller;
use crate::reload::Reloader;

/// How each cycle is printed on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// A table per pool per cycle.
    Text,
    /// One JSON object per cycle, on one line.
    Json,
    /// Nothing on stdout (logs still go to stderr).
    Quiet,
}

/// Run cycles on the interval until `shutdown` resolves (or once, with `once`). Returns whether the
/// last cycle computed ratios for every pool. This is the one control loop: a config reload
/// (`reload`, for `run --config FILE`) is an input to it, applied between two cycles. A cycle in
/// flight when `shutdown` fires is abandoned; pushes in flight get a few seconds to finish (sinks
/// apply changes atomically or not at all, so nothing half-done is left behind).
pub async fn run(
    controller: Controller,
    output: Output,
    once: bool,
    shutdown: impl std::future::Future<Output = ()>,
    mut reload: Option<Reloader>,
) -> bool {
    let mut ticker = new_ticker(controller.interval());
    let mut controller = Some(controller);
    tokio::pin!(shutdown);
    // Without a config file to reload, SIGHUP is still caught so that it does not kill the process.
    let mut hangups = crate::signal::hangups();
    let mut last_ok = true;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
            _ = hangups.recv(), if reload.is_none() => {
                tracing::info!("SIGHUP received; no config file to reload (started without --config)");
                continue;
            }
            Some(new_cfg) = next_config(&mut reload) => {
                if let Some(r) = reload.as_mut() {
                    if r.apply(new_cfg, &mut controller).await {
                        ticker = new_ticker(r.cfg.interval);
                    }
                }
                continue;
            }
        }
        if controller.is_none() {
            controller = reload.as_ref().and_then(|r| r.rebuild(&BTreeMap::new()));
        }
        let Some(c) = controller.as_mut() else { continue };
        let (report, ok) = tokio::select! {
            _ = &mut shutdown => break,
            r = c.cycle() => r,
        };
        last_ok = ok;
        if let Some(r) = reload.as_mut() {
            r.after_cycle(&report);
        }
        match output {
            Output::Text => println!("{}", report.to_table()),
            Output::Json => println!("{}", report.to_json_line()),
            Output::Quiet => {}
        }
        if once {
            break;
        }
    }
    if let Some(mut c) = controller {
        c.shutdown().await;
    }
    last_ok
}

/// The next config from the reload input; never resolves without one.
async fn next_config(reload: &mut Option<Reloader>) -> Option<Config> {
    match reload.as_mut() {
        Some(r) => r.configs.recv().await,
        None => std::future::pending().await,
    }
}

fn new_ticker(interval: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(interval);
    // A slow cycle delays the next one instead of firing a burst to catch up.
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}
