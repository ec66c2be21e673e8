//! A sink that pushes nothing and remembers what it was asked, so dry runs still show old -> new.

use std::sync::Mutex;

use async_trait::async_trait;

use crate::{Applied, RatioSink, Ratios, SinkError};

#[derive(Debug, Default)]
pub struct DryRunSink {
    last: Mutex<Option<Ratios>>,
}

#[async_trait]
impl RatioSink for DryRunSink {
    fn kind(&self) -> &'static str {
        "dry-run"
    }

    fn reaches_lb(&self) -> bool {
        false
    }

    fn reconciles(&self) -> bool {
        true
    }

    async fn current(&self) -> Result<Option<Ratios>, SinkError> {
        Ok(self.last.lock().map(|g| g.clone()).unwrap_or(None))
    }

    async fn apply(&self, desired: &Ratios) -> Result<Applied, SinkError> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let changed =
            desired.iter().filter(|(m, r)| last.as_ref().and_then(|l| l.get(m)) != Some(*r)).count();
        *last = Some(desired.clone());
        Ok(Applied { changed, unchanged: desired.len() - changed, warnings: Vec::new() })
    }
}
