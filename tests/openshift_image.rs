//! deploy/Containerfile read as the build would (registries are out of reach here, so the image is
//! not built by the tests): multi-stage, every workspace member copied in, locked build, a minimal
//! non-root runtime stage running the one binary; and the binary needs no shared library beyond
//! what that runtime base (distroless cc: glibc and libgcc_s) has.

use std::path::Path;
use std::process::Command;

fn containerfile() -> Vec<String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/Containerfile");
    let text = std::fs::read_to_string(&p).expect("read deploy/Containerfile");
    // Join continuation lines, drop comments.
    let mut out = Vec::new();
    let mut cur = String::new();
    for l in text.lines() {
        let t = l.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(x) = t.strip_suffix('\\') {
            cur.push_str(x);
            cur.push(' ');
        } else {
            cur.push_str(t);
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

#[test]
fn containerfile_is_multi_stage_minimal_non_root_and_copies_the_workspace() {
    let lines = containerfile();
    let froms: Vec<&String> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "a build stage and a runtime stage: {froms:?}");
    assert!(froms[0].contains("rust:") && froms[0].ends_with(" AS build"), "{}", froms[0]);
    let last = froms[1];
    assert!(
        last.contains("distroless/cc") || last.contains("ubi-micro") || last.contains("ubi9-micro"),
        "runtime base must be minimal: {last}"
    );
    let runtime: Vec<&String> = lines.iter().skip_while(|l| *l != last).collect();
    let user = runtime.iter().find_map(|l| l.strip_prefix("USER ")).expect("USER in the runtime stage");
    let uid: u32 =
        user.split(':').next().unwrap_or_default().parse().expect("numeric USER (runAsNonRoot needs it)");
    assert_ne!(uid, 0, "non-root");
    assert!(runtime
        .iter()
        .any(|l| l.starts_with("COPY --from=build ") && l.ends_with(" /usr/local/bin/llm-load-controller")));
    assert!(
        runtime.iter().any(|l| *l == "ENTRYPOINT [\"/usr/local/bin/llm-load-controller\"]"),
        "exec-form ENTRYPOINT"
    );
    assert!(!runtime.iter().any(|l| l.starts_with("RUN ")), "the runtime stage has no shell to RUN anything");
    let cmd = runtime.iter().find_map(|l| l.strip_prefix("CMD ")).expect("CMD");
    let deployment = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openshift/base/deployment.yaml"),
    )
    .expect("deployment");
    assert!(
        cmd.contains("/etc/llm-load-controller/config/controller.yaml")
            && deployment.contains("/etc/llm-load-controller/config/controller.yaml")
    );

    // The build stage copies every workspace member and builds with the lock file.
    let build: Vec<&String> = lines.iter().take_while(|l| *l != last).collect();
    let copied: Vec<String> = build
        .iter()
        .filter_map(|l| l.strip_prefix("COPY "))
        .flat_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            parts[..parts.len() - 1].iter().map(|s| s.to_string()).collect::<Vec<_>>()
        })
        .collect();
    let manifest: toml_like::Workspace =
        toml_like::members(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
    for m in manifest.0.iter().filter(|m| *m != ".") {
        assert!(
            copied.iter().any(|c| c == m),
            "workspace member {m} is not copied into the build: {copied:?}"
        );
    }
    for f in ["Cargo.toml", "Cargo.lock", "src"] {
        assert!(copied.iter().any(|c| c == f), "{f} is not copied");
    }
    for c in &copied {
        assert!(Path::new(env!("CARGO_MANIFEST_DIR")).join(c).exists(), "COPY source {c} does not exist");
    }
    assert!(build.iter().any(|l| l.contains("cargo build --release --locked")), "locked release build");
}

/// Just enough of Cargo.toml: `[workspace] members = [...]` on one line.
mod toml_like {
    pub struct Workspace(pub Vec<String>);
    pub fn members(path: std::path::PathBuf) -> Workspace {
        let text = std::fs::read_to_string(path).expect("Cargo.toml");
        let line = text.lines().find(|l| l.trim_start().starts_with("members")).expect("workspace members");
        let inner = line.split('[').nth(1).and_then(|s| s.split(']').next()).expect("a list");
        Workspace(
            inner
                .split(',')
                .map(|s| s.trim().trim_matches('"').to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        )
    }
}

#[test]
fn the_binary_needs_only_what_distroless_cc_has() {
    let bin = env!("CARGO_BIN_EXE_llm-load-controller");
    let out = Command::new("readelf")
        .args(["-d", bin])
        .output()
        .expect("readelf (binutils) is needed for this test");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1)?.split(']').next())
        .collect();
    assert!(needed.contains(&"libc.so.6"), "{needed:?}");
    // glibc's libraries and libgcc_s: what gcr.io/distroless/cc ships. No OpenSSL (rustls is used).
    let in_base = ["libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2", "librt.so.1"];
    for n in &needed {
        assert!(in_base.contains(n) || n.starts_with("ld-linux"), "{n} is not in the runtime image");
    }
}
