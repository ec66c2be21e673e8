//! `llmlc_build_info` and the standard `process_*` metrics (Prometheus' client conventions), read
//! from `/proc/self` at scrape time on Linux; other systems export only the start time.

use std::fmt::Error as FmtError;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The git commit the binary was built from: `LLMLC_GIT_COMMIT` in the build's environment (the
/// Containerfiles pass it as a build argument), else "unknown". No build script asks git, so a
/// build from a source tarball works the same.
pub const GIT_COMMIT: &str = match option_env!("LLMLC_GIT_COMMIT") {
    Some(c) if !c.is_empty() => c,
    _ => "unknown",
};

/// Exports the build and process metrics on each scrape.
#[derive(Debug)]
pub struct ProcessCollector {
    /// Fallback start time (this collector's creation) where `/proc` is not available.
    started: f64,
}

impl ProcessCollector {
    pub fn new() -> ProcessCollector {
        ProcessCollector { started: unix_now() }
    }
}

impl Default for ProcessCollector {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// What `/proc` says about this process.
#[derive(Debug, Default, PartialEq)]
pub struct ProcStats {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub start_time_seconds: f64,
    pub open_fds: f64,
    pub max_fds: Option<f64>,
}

/// Linux reports CPU times and the start time in USER_HZ ticks, which the kernel ABI fixes at 100
/// on every architecture (Prometheus' own procfs library hard-codes the same constant).
const USER_HZ: f64 = 100.0;

/// Parse `/proc/self/stat` (fields after the parenthesised command name, which may hold spaces),
/// `VmRSS` of `/proc/self/status`, `btime` of `/proc/stat` and `Max open files` of `/proc/self/limits`.
pub fn parse_proc(
    stat: &str,
    status: &str,
    system_stat: &str,
    limits: &str,
    open_fds: usize,
) -> Option<ProcStats> {
    let after = &stat[stat.rfind(')')? + 1..];
    // Fields from 3 (state) on; utime is field 14, stime 15, starttime 22, vsize 23 (1-based).
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let (utime, stime, start_ticks, vsize) = (field(14)?, field(15)?, field(22)?, field(23)?);
    let btime: f64 =
        system_stat.lines().find_map(|l| l.strip_prefix("btime")).and_then(|v| v.trim().parse().ok())?;
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    let max_fds = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok());
    Some(ProcStats {
        cpu_seconds: (utime + stime) / USER_HZ,
        resident_bytes: rss_kib * 1024.0,
        virtual_bytes: vsize,
        start_time_seconds: btime + start_ticks / USER_HZ,
        open_fds: open_fds as f64,
        max_fds,
    })
}

/// This process's stats, or `None` where `/proc` is missing or unreadable.
pub fn read_proc() -> Option<ProcStats> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
    // read_dir holds one descriptor itself while counting.
    parse_proc(
        &read("/proc/self/stat")?,
        &read("/proc/self/status")?,
        &read("/proc/stat")?,
        &read("/proc/self/limits").unwrap_or_default(),
        fds.saturating_sub(1),
    )
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> Result<(), FmtError> {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), FmtError> {
        {
            let g = ConstGauge::new(1i64);
            let labels = [("version", env!("CARGO_PKG_VERSION")), ("git_commit", GIT_COMMIT)];
            let mut fam = enc.encode_descriptor(
                "llmlc_build_info",
                "Always 1; the labels say which build of the controller runs.",
                None,
                g.metric_type(),
            )?;
            g.encode(fam.encode_family(&labels)?)?;
        }
        let Some(p) = read_proc() else {
            return gauge(
                &mut enc,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                self.started,
            );
        };
        let c = ConstCounter::new(p.cpu_seconds);
        c.encode(enc.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            c.metric_type(),
        )?)?;
        gauge(&mut enc, "process_resident_memory_bytes", "Resident memory size in bytes.", p.resident_bytes)?;
        gauge(&mut enc, "process_virtual_memory_bytes", "Virtual memory size in bytes.", p.virtual_bytes)?;
        gauge(
            &mut enc,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            p.start_time_seconds,
        )?;
        gauge(&mut enc, "process_open_fds", "Number of open file descriptors.", p.open_fds)?;
        if let Some(m) = p.max_fds {
            gauge(&mut enc, "process_max_fds", "Maximum number of open file descriptors.", m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files_with_a_command_name_holding_spaces_and_parens() {
        // Real layout of /proc/self/stat (Linux 6.x) with a hostile comm field.
        let stat = "4242 (llm (load) ctl) S 1 4242 4242 0 -1 4194560 1505 0 0 0 250 50 0 0 20 0 9 0 \
                    123400 1048576000 5000 18446744073709551615 1 1 0 0 0 0 0 4096 17922 0 0 0 17 1 0 0 0 0 0";
        let status = "Name:\tllm\nVmPeak:\t 1024000 kB\nVmRSS:\t   20480 kB\nThreads:\t9\n";
        let system = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1048576              1048576              files     \n";
        let p = parse_proc(stat, status, system, limits, 12).expect("parsed");
        assert_eq!(
            p,
            ProcStats {
                cpu_seconds: 3.0,
                resident_bytes: 20480.0 * 1024.0,
                virtual_bytes: 1048576000.0,
                start_time_seconds: 1700000000.0 + 1234.0,
                open_fds: 12.0,
                max_fds: Some(1048576.0),
            }
        );
        assert_eq!(parse_proc("garbage", status, system, limits, 1), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_reads_plausible_values() {
        let p = read_proc().expect("/proc is readable on Linux");
        let now = unix_now();
        assert!(p.start_time_seconds <= now + 1.0 && p.start_time_seconds > now - 86400.0, "{p:?}");
        assert!(p.resident_bytes > 1e6 && p.open_fds >= 3.0, "{p:?}");
    }
}
