//! How `run`'s command-line flags (and their `LLMLC_*` environment variables) combine with a config
//! file.
//!
//! The rule, one line per flag kind:
//! - Flags that name a setting of the file's top level (`--listen`, `--interval`, `--log-format`)
//!   override the file, at start and after every live reload, so an operator can move a port or slow
//!   the loop without editing a ConfigMap.
//! - Flags that build the quick-start pool (`--scrape`, `--prometheus`, `--selector`, `--profile`)
//!   are refused with `--config`: a pool in the file says the same with more precision, and silently
//!   ignoring them (as before) hid typos like `--profile sglang` on a vLLM config.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::config::{self, Config, ConfigError, ConfigErrors};

/// Top-level settings given on the command line; `None` keeps the file's value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub interval: Option<Duration>,
}

impl Overrides {
    /// The file's config with the flags' values in place, checked like the file's own values. Errors
    /// name the flag, since that is where the value came from.
    pub fn apply(&self, path: &Path, mut cfg: Config) -> Result<Config, ConfigErrors> {
        if let Some(listen) = self.listen {
            cfg.listen = listen;
        }
        if let Some(interval) = self.interval {
            if let Err(m) = config::check_interval(interval) {
                return Err(ConfigErrors(vec![ConfigError {
                    file: path.to_path_buf(),
                    location: None,
                    field: "interval (from --interval / LLMLC_INTERVAL)".into(),
                    message: m,
                }]));
            }
            cfg.interval = interval;
        }
        Ok(cfg)
    }
}

/// Which quick-start flags were given (on the command line or through their environment variable).
#[derive(Debug, Clone, Copy, Default)]
pub struct QuickStartFlags {
    pub scrape: bool,
    pub prometheus: bool,
    pub selector: bool,
    pub profile: bool,
}

impl QuickStartFlags {
    /// An error naming each quick-start flag given next to `--config`, and what to write in the file
    /// instead.
    pub fn refuse_with_config(&self, path: &Path) -> Result<(), String> {
        let given: Vec<(&str, &str)> = [
            (
                self.scrape,
                "--scrape (LLMLC_SCRAPE)",
                "a pool with `source:` of kind scrape and `members: { static: [...] }`",
            ),
            (
                self.prometheus,
                "--prometheus (LLMLC_PROMETHEUS)",
                "a source of kind prometheus with its `url:`",
            ),
            (self.selector, "--selector (LLMLC_SELECTOR)", "`members: { prometheus_up: ... }` on the pool"),
            (self.profile, "--profile (LLMLC_PROFILE)", "`profile:` on the pool"),
        ]
        .into_iter()
        .filter(|(on, _, _)| *on)
        .map(|(_, flag, instead)| (flag, instead))
        .collect();
        if given.is_empty() {
            return Ok(());
        }
        let mut msg = format!(
            "{} only build the quick-start pool and cannot be combined with --config {}; write them in the file instead:",
            given.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(", "),
            path.display()
        );
        for (flag, instead) in &given {
            msg.push_str(&format!("\n  {flag}: {instead}"));
        }
        msg.push_str(
            "\n(--listen, --interval and --log-format do combine with --config: they override the file)",
        );
        Err(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        config::parse(
            Path::new("t.yaml"),
            "interval: 2s\nlisten: 0.0.0.0:9090\nsources: { d: { kind: scrape } }\npools: [{ name: p, source: d, members: { static: [\"10.0.0.1:80\"] } }]\n",
        )
        .expect("valid")
    }

    #[test]
    fn flags_override_the_file_and_absent_flags_keep_it() {
        let kept = Overrides::default().apply(Path::new("t.yaml"), cfg()).expect("no flags");
        assert_eq!(kept.interval, Duration::from_secs(2));
        let o = Overrides {
            listen: Some("127.0.0.1:7000".parse().expect("addr")),
            interval: Some(Duration::from_secs(9)),
        };
        let c = o.apply(Path::new("t.yaml"), cfg()).expect("valid flags");
        assert_eq!(c.listen.port(), 7000);
        assert_eq!(c.interval, Duration::from_secs(9));
    }

    #[test]
    fn an_interval_out_of_range_names_the_flag() {
        let o = Overrides { interval: Some(Duration::from_millis(1)), ..Default::default() };
        let e = o.apply(Path::new("t.yaml"), cfg()).expect_err("too short");
        assert!(e.to_string().contains("t.yaml: interval (from --interval / LLMLC_INTERVAL): "), "{e}");
    }

    #[test]
    fn quick_start_flags_are_refused_by_name() {
        assert!(QuickStartFlags::default().refuse_with_config(Path::new("c.yaml")).is_ok());
        let e = QuickStartFlags { profile: true, scrape: true, ..Default::default() }
            .refuse_with_config(Path::new("c.yaml"))
            .expect_err("refused");
        assert!(e.starts_with("--scrape (LLMLC_SCRAPE), --profile (LLMLC_PROFILE) only build"), "{e}");
        assert!(e.contains("`profile:` on the pool"), "{e}");
    }
}
