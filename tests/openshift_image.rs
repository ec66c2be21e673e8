//! deploy/Containerfile (Debian build, distroless runtime) and deploy/Containerfile.ubi (UBI 9 build,
//! ubi-micro runtime) read as the build would (registries are out of reach here, so the images are
//! not built by the tests): multi-stage, pinned bases, the workspace copied in, the controller-only
//! locked build with the git commit passed through, a minimal non-root runtime stage running the one
//! binary; the binary needs no shared library beyond what those bases have; and .containerignore
//! keeps the build context small (no target/, no .git).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Instructions of a Containerfile: continuation lines joined, comments dropped.
fn instructions(name: &str) -> Vec<String> {
    let p = root().join("deploy").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
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

/// `FROM` image with the global `ARG` defaults substituted.
fn resolve(image: &str, lines: &[String]) -> String {
    let mut out = image.to_string();
    for l in lines.iter().take_while(|l| !l.starts_with("FROM ")) {
        if let Some((k, v)) = l.strip_prefix("ARG ").and_then(|a| a.split_once('=')) {
            out = out.replace(&format!("${{{k}}}"), v);
        }
    }
    out
}

/// Workspace members from `[workspace] members = [...]` (one line).
fn members() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let line = text.lines().find(|l| l.trim_start().starts_with("members")).expect("workspace members");
    let inner = line.split('[').nth(1).and_then(|s| s.split(']').next()).expect("a list");
    inner.split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect()
}

/// `(build base, runtime base)` after checking what both Containerfiles must do.
fn check(name: &str, build_base: &str, runtime_bases: &[&str]) -> (String, String) {
    let lines = instructions(name);
    let froms: Vec<&String> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "{name}: a build stage and a runtime stage: {froms:?}");
    assert!(froms[0].ends_with(" AS build"), "{name}: {}", froms[0]);
    let image = |f: &String| resolve(f.split_whitespace().nth(1).expect("image"), &lines);
    let (build, runtime) = (image(froms[0]), image(froms[1]));
    for img in [&build, &runtime] {
        let tag = img.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
        assert!(
            !tag.is_empty() && !tag.contains('/') && tag != "latest",
            "{name}: {img} is not pinned to a tag"
        );
        assert!(img.split('/').next().is_some_and(|r| r.contains('.')), "{name}: {img}: name the registry");
    }
    assert!(build.contains(build_base), "{name}: build stage {build}");
    assert!(
        runtime_bases.iter().any(|b| runtime.contains(b)),
        "{name}: runtime base must be minimal: {runtime}"
    );

    let last = froms[1];
    let runtime_stage: Vec<&String> = lines.iter().skip_while(|l| *l != last).collect();
    let user = runtime_stage.iter().find_map(|l| l.strip_prefix("USER ")).expect("USER in the runtime stage");
    let uid: u32 =
        user.split(':').next().unwrap_or_default().parse().expect("numeric USER (runAsNonRoot needs it)");
    assert_ne!(uid, 0, "{name}: non-root");
    assert!(runtime_stage
        .iter()
        .any(|l| l.starts_with("COPY --from=build ") && l.ends_with(" /usr/local/bin/llm-load-controller")));
    assert!(
        runtime_stage.iter().any(|l| *l == "ENTRYPOINT [\"/usr/local/bin/llm-load-controller\"]"),
        "{name}: exec-form ENTRYPOINT"
    );
    assert!(!runtime_stage.iter().any(|l| l.starts_with("RUN ")), "{name}: the runtime stage has no shell");
    let cmd = runtime_stage.iter().find_map(|l| l.strip_prefix("CMD ")).expect("CMD");
    let deployment =
        std::fs::read_to_string(root().join("deploy/openshift/base/deployment.yaml")).expect("deployment");
    assert!(
        cmd.contains("/etc/llm-load-controller/config/controller.yaml")
            && deployment.contains("/etc/llm-load-controller/config/controller.yaml")
    );

    // The build stage: the workspace in, the controller-only locked build with the commit passed on.
    let build_stage: Vec<&String> = lines.iter().take_while(|l| *l != last).collect();
    let copied: Vec<String> = build_stage
        .iter()
        .filter_map(|l| l.strip_prefix("COPY "))
        .flat_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            parts[..parts.len() - 1].iter().map(|s| s.to_string()).collect::<Vec<_>>()
        })
        .collect();
    if !copied.iter().any(|c| c == ".") {
        for m in members().iter().filter(|m| *m != ".").chain(&["Cargo.toml".into(), "Cargo.lock".into()]) {
            assert!(copied.iter().any(|c| c == m), "{name}: {m} is not copied into the build: {copied:?}");
        }
    }
    let cargo = build_stage.iter().find(|l| l.contains("cargo build")).expect("a cargo build");
    assert!(
        cargo.contains("cargo build --profile dist --locked --no-default-features -p llm-load-controller"),
        "{name}: controller-only locked build with the dist profile: {cargo}"
    );
    assert!(
        cargo.contains("LLMLC_GIT_COMMIT=${LLMLC_GIT_COMMIT}"),
        "{name}: git commit not passed to the build"
    );
    assert!(
        build_stage.iter().any(|l| l.starts_with("ARG LLMLC_GIT_COMMIT=")),
        "{name}: ARG LLMLC_GIT_COMMIT"
    );
    (build, runtime)
}

#[test]
fn debian_containerfile_builds_on_rust_and_runs_on_distroless() {
    check("Containerfile", "docker.io/library/rust:", &["gcr.io/distroless/cc"]);
}

#[test]
fn ubi_containerfile_builds_and_runs_on_the_same_ubi_release() {
    let (build, runtime) = check(
        "Containerfile.ubi",
        "registry.access.redhat.com/ubi9/ubi:",
        &["registry.access.redhat.com/ubi9/ubi-micro:"],
    );
    // The binary links against the build stage's glibc: the runtime must be the same UBI release.
    let tag = |i: &str| i.rsplit_once(':').map(|(_, t)| t.to_string()).unwrap_or_default();
    assert_eq!(tag(&build), tag(&runtime), "build {build} vs runtime {runtime}");
}

/// One `.containerignore` pattern as podman/buildah apply the forms used here: `dir/`, `**/dir/`,
/// `name`, `*.ext` (relative to the context root).
fn ignored(rel: &str, is_dir: bool, patterns: &[String]) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    patterns.iter().any(|p| {
        if let Some(d) = p.strip_prefix("**/").and_then(|d| d.strip_suffix('/')) {
            is_dir && name == d
        } else if let Some(d) = p.strip_suffix('/') {
            rel == d && is_dir
        } else if let Some(ext) = p.strip_prefix("*.") {
            !rel.contains('/') && name.ends_with(&format!(".{ext}"))
        } else {
            rel == p
        }
    })
}

fn context_size(dir: &Path, rel: &str, patterns: &[String], files: &mut Vec<String>) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).expect("read dir") {
        let e = e.expect("entry");
        let name = e.file_name().to_string_lossy().to_string();
        let r = if rel.is_empty() { name } else { format!("{rel}/{name}") };
        let ft = e.file_type().expect("type");
        if ignored(&r, ft.is_dir(), patterns) {
            continue;
        }
        if ft.is_dir() {
            total += context_size(&e.path(), &r, patterns, files);
        } else {
            total += e.metadata().map(|m| m.len()).unwrap_or(0);
            files.push(r);
        }
    }
    total
}

#[test]
fn containerignore_keeps_the_context_to_the_sources() {
    let text =
        std::fs::read_to_string(root().join(".containerignore")).expect(".containerignore at the root");
    let patterns: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    for must in ["target/", ".git"] {
        assert!(patterns.iter().any(|p| p == must), "{must} is not excluded");
    }
    let mut files = Vec::new();
    let size = context_size(&root(), "", &patterns, &mut files);
    for need in ["Cargo.toml", "Cargo.lock", "src/main.rs", "src/telemetry/status.html"] {
        assert!(files.iter().any(|f| f == need), "{need} is left out of the context");
    }
    for m in members().iter().filter(|m| *m != ".") {
        assert!(files.iter().any(|f| f == &format!("{m}/Cargo.toml")), "member {m} is left out");
    }
    assert!(
        !files.iter().any(|f| f.starts_with("target/") || f.contains("/target/")),
        "build output in the context"
    );
    eprintln!("build context: {} files, {:.1} MB", files.len(), size as f64 / 1e6);
    assert!(size < 20_000_000, "build context is {size} bytes");
}

#[test]
fn the_binary_needs_only_what_distroless_cc_and_ubi_micro_have() {
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
    // glibc's libraries and libgcc_s: what gcr.io/distroless/cc and ubi9/ubi-micro (glibc, libgcc)
    // ship. No OpenSSL (rustls is used).
    let in_base = ["libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2", "librt.so.1"];
    for n in &needed {
        assert!(in_base.contains(n) || n.starts_with("ld-linux"), "{n} is not in the runtime image");
    }
}
