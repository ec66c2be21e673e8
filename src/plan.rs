//! The resolved plan `check` prints: for each pool, where its members come from, the exact queries
//! or metric names it reads, the policy and the sink, with every default filled in. What you read
//! here is what `run` will do.
//!
//! The plan is a YAML document (built as a YAML value and printed by the YAML crate, so it always
//! parses), in the config file's own words: field names as the file spells them, enum values as the
//! file writes them (`feedback`, `runtime-api`), durations as `1m 30s`. Secrets show where they come
//! from (`file:/path`), never their value; URLs lose their credentials.

use serde_yaml_ng::{Mapping, Value};

use crate::config::{Config, MembersConfig, PoolConfig, SourceConfig};
use crate::leader::Enabled;
use crate::policy::PolicyConfig;
use crate::source::profile::promql;
use crate::source::redact_url;
use llm_lc_adapters::{SecretRef, SinkConfig};

pub fn describe(cfg: &Config) -> String {
    let mut doc = Mapping::new();
    put(&mut doc, "interval", dur(cfg.interval));
    put(&mut doc, "listen", cfg.listen.to_string());
    put(&mut doc, "log_format", kebab(&cfg.log_format));
    put(&mut doc, "unready_after_cycles", cfg.unready_after_cycles);
    put(&mut doc, "leader_election", leader(cfg));
    let mut sources = Mapping::new();
    for (name, src) in &cfg.sources {
        put(&mut sources, name, source(src));
    }
    put(&mut doc, "sources", sources);
    put(&mut doc, "pools", Value::Sequence(cfg.pools.iter().map(|p| pool(cfg, p)).collect()));
    let body = serde_yaml_ng::to_string(&Value::Mapping(doc))
        .unwrap_or_else(|e| format!("# the plan could not be printed: {e}\n"));
    format!(
        "# config OK: {} source(s), {} pool(s). The plan, defaults filled in:\n{body}",
        cfg.sources.len(),
        cfg.pools.len()
    )
}

fn put(m: &mut Mapping, key: &str, v: impl Into<Value>) {
    m.insert(Value::String(key.to_string()), v.into());
}

fn put_opt(m: &mut Mapping, key: &str, v: Option<impl Into<Value>>) {
    if let Some(v) = v {
        put(m, key, v);
    }
}

fn dur(d: std::time::Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// The config spelling of a unit enum value: its Rust name in kebab case (`VllmLegacy` ->
/// `vllm-legacy`), which is what the config's `rename_all` attributes accept.
fn kebab(v: &impl std::fmt::Debug) -> String {
    let name = format!("{v:?}");
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Where a secret comes from; `SecretRef`'s Debug already redacts inline values.
fn secret(s: &SecretRef) -> String {
    format!("{s:?}")
}

fn leader(cfg: &Config) -> Value {
    let le = &cfg.leader_election;
    let enabled = match le.enabled {
        Enabled::Auto => "auto (elect when running in a pod or api_url is set)",
        Enabled::Always => "true",
        Enabled::Never => "false (always leader)",
    };
    let mut m = Mapping::new();
    put(&mut m, "enabled", enabled);
    if le.enabled != Enabled::Never {
        put(&mut m, "lease_name", le.lease_name.as_str());
        put(
            &mut m,
            "namespace",
            le.namespace.clone().unwrap_or_else(|| "POD_NAMESPACE or the service account's".into()),
        );
        put(&mut m, "lease_duration", dur(le.lease_duration));
        put(&mut m, "renew_deadline", dur(le.renew_deadline));
        put(&mut m, "retry_period", dur(le.retry_period));
        put_opt(&mut m, "api_url", le.api_url.as_deref().map(redact_url));
    }
    Value::Mapping(m)
}

fn source(src: &SourceConfig) -> Value {
    let mut m = Mapping::new();
    match src {
        SourceConfig::Prometheus(p) => {
            put(&mut m, "kind", "prometheus");
            put(&mut m, "url", redact_url(&p.url));
            put(&mut m, "timeout", dur(p.timeout));
            put(&mut m, "bearer_token", p.bearer_token.as_ref().map(secret).unwrap_or_else(|| "none".into()));
            put(
                &mut m,
                "ca_file",
                p.ca_file.as_ref().map(|c| c.display().to_string()).unwrap_or_else(|| "system roots".into()),
            );
            put(&mut m, "tls_verify", !p.insecure_skip_verify);
            put(&mut m, "rate_window", dur(p.rate_window));
            if !p.headers.is_empty() {
                // Header values may be credentials (a tenant token): names only.
                let names: Vec<Value> = p.headers.keys().map(|k| Value::String(k.clone())).collect();
                put(&mut m, "headers", Value::Sequence(names));
            }
        }
        SourceConfig::Scrape(s) => {
            put(&mut m, "kind", "scrape");
            put(&mut m, "url", format!("{}://MEMBER{}", s.scheme, s.path));
            put(&mut m, "timeout", dur(s.timeout));
            put(&mut m, "concurrency", s.concurrency as u64);
            put(&mut m, "max_body_bytes", s.max_body_bytes as u64);
            put_opt(&mut m, "bearer_token", s.bearer_token.as_ref().map(secret));
            put_opt(&mut m, "ca_file", s.ca_file.as_ref().map(|c| c.display().to_string()));
            put(&mut m, "tls_verify", !s.insecure_skip_verify);
        }
    }
    Value::Mapping(m)
}

fn members(p: &PoolConfig) -> Value {
    let MembersConfig { static_list, prometheus_up, from_lb, kubernetes } = &p.members;
    let mut m = Mapping::new();
    if let Some(list) = static_list {
        put(&mut m, "static", Value::Sequence(list.iter().map(|x| Value::String(x.to_string())).collect()));
    }
    if let Some(sel) = prometheus_up {
        put(&mut m, "discovered_each_cycle_from", format!("up{sel}"));
        put(&mut m, "joined_by_label", p.join.label.as_str());
    }
    if *from_lb {
        put(&mut m, "read_each_cycle_from", format!("the {} sink's pool", p.sink.kind()));
    }
    if let Some(k) = kubernetes {
        let mut km = Mapping::new();
        if let Some(service) = &k.service {
            put(&mut km, "service", service.as_str());
        }
        if let Some(pool) = &k.inference_pool {
            put(&mut km, "inference_pool", pool.as_str());
        }
        put(
            &mut km,
            "namespace",
            k.namespace.clone().unwrap_or_else(|| "POD_NAMESPACE or the service account's".into()),
        );
        let default_port = if k.service.is_some() { "the Service's only port" } else { "every target port" };
        put(&mut km, "port", k.port.as_ref().map(|p| p.to_string()).unwrap_or_else(|| default_port.into()));
        put(&mut km, "api_url", k.api_url.as_deref().map(redact_url).unwrap_or_else(|| "in-cluster".into()));
        put(&mut km, "token", k.token.as_ref().map(secret).unwrap_or_else(|| "the service account's".into()));
        put(&mut km, "timeout", dur(k.timeout));
        put(
            &mut km,
            "read_each_cycle",
            if k.service.is_some() {
                "ready endpoints of the Service's EndpointSlices (label kubernetes.io/service-name)"
            } else {
                "ready pods of the InferencePool's selector (inference.networking.k8s.io/v1), on its target ports"
            },
        );
        put(&mut m, "kubernetes", km);
    }
    Value::Mapping(m)
}

fn pool(cfg: &Config, p: &PoolConfig) -> Value {
    let mut m = Mapping::new();
    put(&mut m, "name", p.name.as_str());
    put(&mut m, "source", p.source.as_str());
    put(&mut m, "profile", kebab(&p.profile));
    put(&mut m, "members", members(p));
    if let Some(re) = &p.join.regex {
        let mut j = Mapping::new();
        put(&mut j, "label", p.join.label.as_str());
        put(&mut j, "regex", re.as_str());
        put(&mut j, "replacement", p.join.replacement.as_deref().unwrap_or("$1"));
        put(&mut m, "join", j);
    }
    let names = p.profile.resolve(&p.metrics);
    match cfg.sources.get(&p.source) {
        Some(SourceConfig::Prometheus(pc)) => {
            let mut q = Mapping::new();
            for (signal, query) in
                promql(&names, &p.queries, &p.join.label, p.selector.as_deref(), pc.rate_window)
            {
                put(&mut q, signal.as_str(), query);
            }
            put(&mut m, "queries", q);
        }
        _ => {
            let list = |v: &[String]| Value::Sequence(v.iter().map(|s| Value::String(s.clone())).collect());
            let mut q = Mapping::new();
            put(&mut q, "waiting", list(&names.waiting));
            put(&mut q, "running", list(&names.running));
            put(&mut q, "kv_usage", list(&names.kv_usage));
            put(&mut q, "latency_histogram", list(&names.latency_histogram));
            put(&mut q, "service_histogram", list(&names.service_histogram));
            put(&mut q, "queue_histogram", list(&names.queue_histogram));
            if !names.prompt_cached_gauge.is_empty() {
                put(&mut q, "prompt_cached", list(&names.prompt_cached_gauge));
            }
            for (key, ratio) in [("token_time", &names.token_time), ("prompt_cached", &names.prompt_cached)] {
                if let Some(r) = ratio {
                    put(
                        &mut q,
                        key,
                        format!("{} per {}", r.numerators.join(" + "), r.denominators.join(" + ")),
                    );
                }
            }
            put(&mut m, "metrics", q);
        }
    }
    if let Some(slots) = slots(cfg, p, &names) {
        put(&mut m, "slots", slots);
    }
    put(&mut m, "policy", policy(&p.policy));
    let mut r = Mapping::new();
    put(&mut r, "min", p.ratio.min);
    put(&mut r, "max", p.ratio.max);
    put(&mut m, "ratio", r);
    put(&mut m, "stale_after", dur(p.stale_after));
    put(&mut m, "grace", format!("{} (then the pool mean)", dur(p.grace)));
    put(&mut m, "on_stale", format!("{} after {}", kebab(&p.on_stale), dur(p.reset_after)));
    let change = p.change_policy();
    let mut c = Mapping::new();
    put(&mut c, "min_change", change.min_change);
    put(&mut c, "max_hold", dur(change.max_hold));
    put(&mut m, "change", c);
    if let Some(pr) = &p.priority {
        let mut t = Mapping::new();
        let tiers: Vec<Value> = pr
            .tiers
            .iter()
            .map(|x| {
                let mut e = Mapping::new();
                put(&mut e, "name", x.name.as_str());
                match (&x.members, x.labels.is_empty()) {
                    (None, true) => put(&mut e, "members", "every member no other tier names"),
                    (m, _) => {
                        if let Some(m) = m {
                            put(&mut e, "members", m.as_str());
                        }
                        if !x.labels.is_empty() {
                            let mut l = Mapping::new();
                            for (k, v) in &x.labels {
                                put(&mut l, k, v.as_str());
                            }
                            put(&mut e, "labels", l);
                        }
                    }
                }
                Value::Mapping(e)
            })
            .collect();
        put(&mut t, "tiers", Value::Sequence(tiers));
        put(&mut t, "spill_at", pr.spill_at);
        put(&mut t, "return_below", pr.return_below);
        let inactive = match &p.sink {
            SinkConfig::Haproxy(_) => "weight 0",
            SinkConfig::Envoy(e) if e.priority_levels => "priority 1 in Envoy's assignment (weight 1)",
            SinkConfig::Envoy(_) => "left out of Envoy's assignment",
            SinkConfig::F5(_) => "priority group 1 (active tiers in group 2)",
            SinkConfig::DryRun | SinkConfig::Webhook(_) => "ratio 0",
        };
        put(&mut t, "inactive_tiers", inactive);
        put(&mut m, "priority", t);
    }
    put(&mut m, "push_timeout", p.push_timeout.map(dur).unwrap_or_else(|| "three intervals".into()));
    put(&mut m, "sink", sink(&p.sink));
    if let Some(pc) = &p.picker {
        put(&mut m, "picker", picker(pc, cfg, &p.source));
    }
    Value::Mapping(m)
}

/// The pool's endpoint picker: its doors, how it reads the engines, its settings in force.
fn picker(pc: &crate::picker::PickerConfig, cfg: &Config, source: &str) -> Value {
    let mut m = Mapping::new();
    let door = |a: Option<std::net::SocketAddr>| a.map(|a| a.to_string());
    put_opt(&mut m, "ext_proc", door(pc.ext_proc));
    put_opt(&mut m, "health", door(pc.health));
    put_opt(&mut m, "spoe", door(pc.spoe));
    put_opt(&mut m, "http", door(pc.http));
    if let Some(t) = &pc.tls {
        put(&mut m, "tls", format!("{} with {}", t.cert_file.display(), t.key_file.display()));
    }
    let page = match cfg.sources.get(source) {
        Some(SourceConfig::Scrape(s)) => format!("{}://MEMBER{}", s.scheme, s.path),
        _ => "http://MEMBER/metrics".to_string(),
    };
    put(&mut m, "reads", format!("{page} every {}", dur(pc.refresh)));
    put(&mut m, "max_open", dur(pc.max_open));
    put(&mut m, "fallbacks", pc.fallbacks as u64);
    if let Ok(st) = pc.settings() {
        let mut sm = Mapping::new();
        put(&mut sm, "affinity", st.affinity);
        put(&mut sm, "saturation_tokens", st.saturation_tokens);
        put(&mut sm, "overload", st.overload);
        put(&mut sm, "home_slack_tokens", st.home_slack_tokens);
        put(&mut sm, "home_prompt", st.home_prompt);
        put(&mut sm, "request_tokens", st.request_tokens);
        put(&mut sm, "kv_tokens", st.kv_tokens);
        put(&mut sm, "max_blocks", st.max_blocks as u64);
        put(&mut sm, "capacity", st.capacity);
        put(&mut m, "settings", sm);
    }
    Value::Mapping(m)
}

/// Where each member's slot count comes from, and which members have none (their capacity is then
/// what they show when full). `None` for pools that neither read nor configure slots.
fn slots(cfg: &Config, p: &PoolConfig, names: &crate::source::profile::MetricNames) -> Option<Value> {
    let from_props =
        names.slots_from_props && matches!(cfg.sources.get(&p.source), Some(SourceConfig::Scrape(_)));
    if p.slots.is_empty() && !names.slots_from_props {
        return None;
    }
    let mut m = Mapping::new();
    if from_props {
        put(
            &mut m,
            "read_from",
            "each member's GET /props (total_slots), again after a restart and every 5m",
        );
    }
    if let Some(d) = p.slots.default {
        put(&mut m, "default", d);
    }
    let mut per = Mapping::new();
    for (member, n) in &p.slots.members {
        put(&mut per, member.as_str(), *n);
    }
    if !per.is_empty() {
        put(&mut m, "members", per);
    }
    if !from_props && p.slots.default.is_none() {
        // Prometheus carries no slot count: say which members run without one.
        let lacking: Vec<Value> = match &p.members.static_list {
            Some(list) => list
                .iter()
                .filter(|x| !p.slots.members.contains_key(*x))
                .map(|x| Value::String(x.to_string()))
                .collect(),
            None => vec![Value::String("every member not listed in slots.members".into())],
        };
        if !lacking.is_empty() {
            put(&mut m, "WARNING", "no slot count for these members: their capacity is what they show when full (set slots.default or slots.members)");
            put(&mut m, "without_slots", Value::Sequence(lacking));
        }
    }
    Some(Value::Mapping(m))
}

fn policy(p: &PolicyConfig) -> Value {
    let mut m = Mapping::new();
    put(&mut m, "kind", p.name());
    match p {
        PolicyConfig::Feedback(f) => {
            for (k, v) in [
                ("gain", f.gain),
                ("smoothing", f.smoothing),
                ("max_step", f.max_step),
                ("deadband", f.deadband),
                ("queue_norm", f.queue_norm),
                ("running_norm", f.running_norm),
                ("idle_load", f.idle_load),
                ("settle_cycles", f.settle_cycles),
                ("latency_weight", f.latency_weight),
            ] {
                put(&mut m, k, v);
            }
        }
        PolicyConfig::Capacity(c) => {
            let mode = match c.mode {
                crate::policy::capacity::Mode::LeastConnections => "least-connections",
                crate::policy::capacity::Mode::RoundRobin => "round-robin",
            };
            put(&mut m, "mode", mode);
            for (k, v) in [
                ("max_num_seqs", c.max_num_seqs),
                ("smoothing", c.smoothing),
                ("delay_tau", c.delay_tau),
                ("gain", c.gain),
                ("trim_band", c.trim_band),
                ("trim_max", c.trim_max),
                ("deadband", c.deadband),
                ("running_norm", c.running_norm),
            ] {
                put(&mut m, k, v);
            }
        }
        PolicyConfig::Headroom(h) => {
            for (k, v) in [
                ("kv_weight", h.kv_weight),
                ("queue_weight", h.queue_weight),
                ("queue_norm", h.queue_norm),
                ("running_norm", h.running_norm),
            ] {
                put(&mut m, k, v);
            }
        }
    }
    Value::Mapping(m)
}

fn sink(s: &SinkConfig) -> Value {
    let mut m = Mapping::new();
    put(&mut m, "kind", s.kind());
    match s {
        SinkConfig::DryRun => {}
        SinkConfig::Webhook(w) => {
            put(&mut m, "url", redact_url(&w.url));
            put_opt(&mut m, "bearer_token", w.bearer_token.as_ref().map(secret));
            put_opt(&mut m, "ca_file", w.ca_file.as_ref().map(|c| c.display().to_string()));
            put(&mut m, "timeout", dur(w.timeout));
        }
        SinkConfig::Haproxy(h) => {
            put(&mut m, "mode", kebab(&h.mode));
            let addrs: Vec<Value> =
                h.address.iter().chain(&h.addresses).map(|a| Value::String(a.clone())).collect();
            if !addrs.is_empty() {
                put(&mut m, "addresses", Value::Sequence(addrs));
            }
            put(&mut m, "backend", h.backend.as_str());
            put(&mut m, "match_by", kebab(&h.match_by));
            put(&mut m, "timeout", dur(h.timeout));
            put(&mut m, "allow_drain", h.allow_drain);
            put(
                &mut m,
                "weights",
                match h.ratio_max {
                    Some(r) => format!("ratio {r} -> weight {}, proportional", h.max_weight),
                    None => format!("weight = ratio, at most {}", h.max_weight),
                },
            );
            put_opt(&mut m, "agent_listen", h.agent_listen.clone());
        }
        SinkConfig::F5(f) => {
            put(&mut m, "mode", kebab(&f.mode));
            if f.urls.is_empty() {
                put(&mut m, "url", redact_url(&f.url));
            } else {
                let units: Vec<Value> = f.urls.iter().map(|u| Value::String(redact_url(u))).collect();
                put(&mut m, "urls", Value::Sequence(units));
            }
            put(&mut m, "pool", f.pool.as_str());
            put(&mut m, "auth", kebab(&f.auth));
            // Username's Debug prints a plain name, or where it comes from.
            put(&mut m, "username", format!("{:?}", f.username).trim_matches('"').to_string());
            put(&mut m, "password", secret(&f.password));
            put(&mut m, "login_provider", f.login_provider.as_str());
            match &f.pinned_cert {
                Some(p) => put(&mut m, "pinned_cert", p.display().to_string()),
                None => put(
                    &mut m,
                    "ca_file",
                    f.ca_file
                        .as_ref()
                        .map(|c| c.display().to_string())
                        .unwrap_or_else(|| "system roots".into()),
                ),
            }
            put(&mut m, "tls_verify", !f.insecure_skip_verify);
            put(&mut m, "timeout", dur(f.timeout));
            put(&mut m, "retries", f.retries);
            put(&mut m, "retry_backoff", dur(f.retry_backoff));
            put(&mut m, "max_ratio", f.max_ratio);
            put(&mut m, "concurrency", f.concurrency as u64);
            put(&mut m, "login_backoff", dur(f.login_backoff));
            put(&mut m, "transactions", f.transactions);
        }
        SinkConfig::Envoy(e) => {
            put(&mut m, "cluster", e.cluster.as_str());
            put(&mut m, "mode", kebab(&e.mode));
            put_opt(&mut m, "directory", e.directory.as_ref().map(|d| d.display().to_string()));
            put_opt(&mut m, "file_name", e.file_name.clone());
            put(&mut m, "resolve_timeout", dur(e.resolve_timeout));
            put_opt(&mut m, "admin", e.admin.as_deref().map(redact_url));
        }
    }
    Value::Mapping(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_values_are_spelt_as_the_config_writes_them() {
        assert_eq!(kebab(&crate::source::profile::ProfileName::VllmLegacy), "vllm-legacy");
        assert_eq!(kebab(&crate::config::OnStale::Hold), "hold");
    }
}
