//! `llm-load-controller picker haproxy-rules`: the `use-server` rules for HAProxy versions that
//! take a server name only as a literal (before 2.6.12): one rule per server of the backend, each
//! following the SPOE agent's answer when it names that server. The names come from the backend's
//! `show servers state` over the runtime API, as the agent itself reads them.

use std::time::Duration;

use llm_lc_adapters::haproxy::runtime::{RuntimeAddr, RuntimeClient};

/// The rules for `servers`, reading the agent's answer from `txn.<var_prefix>.srv`.
pub fn rules_for(servers: &[String], var_prefix: &str) -> String {
    let mut out =
        format!("    # The endpoint picker's answer (SPOE, var-prefix {var_prefix}): one rule per server.\n");
    for s in servers {
        out.push_str(&format!("    use-server {s} if {{ var(txn.{var_prefix}.srv) -m str {s} }}\n"));
    }
    out
}

/// Read `backend`'s server names at `runtime` (a `stats socket` address) and print its rules.
pub async fn haproxy_rules(runtime: &str, backend: &str, var_prefix: &str) -> Result<String, String> {
    let addr = RuntimeAddr::parse(runtime).map_err(|e| format!("--runtime {runtime:?}: {e}"))?;
    let servers = RuntimeClient::new(addr, Duration::from_secs(5))
        .servers_state(backend)
        .await
        .map_err(|e| format!("cannot read backend {backend:?} at {runtime}: {e}"))?;
    if servers.is_empty() {
        return Err(format!("backend {backend:?} at {runtime} has no servers"));
    }
    let names: Vec<String> = servers.into_iter().map(|s| s.name).collect();
    Ok(rules_for(&names, var_prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rule_per_server_reading_the_agents_variable() {
        let r = rules_for(&["vllm-0".into(), "vllm-1".into()], "llmlc");
        assert_eq!(r.lines().filter(|l| l.trim_start().starts_with("use-server")).count(), 2);
        assert!(r.contains("    use-server vllm-1 if { var(txn.llmlc.srv) -m str vllm-1 }\n"), "{r}");
    }
}
