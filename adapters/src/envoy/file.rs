//! Filesystem EDS: the assignment as a `DiscoveryResponse` JSON file in a directory Envoy watches
//! (`path_config_source` with `watched_directory`).
//!
//! Envoy reloads only when a file is moved into the watched directory, so every write goes to a
//! temporary file in the same directory (same filesystem, so the rename is atomic), is fsynced, and
//! is renamed over the target; the directory is fsynced so the rename survives a crash. A file whose
//! content would not change is not rewritten, so Envoy is not made to reload every control cycle.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::assignment::Assignment;
use super::wire::{ClusterLoadAssignment, DiscoveryResponse, CLA_TYPE_URL};

/// A temporary file of a target this old was left by a writer that died mid-write.
pub const LEFTOVER_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// The file Envoy reads and how to write it.
#[derive(Debug, Clone)]
pub struct EdsFile {
    pub dir: PathBuf,
    pub path: PathBuf,
}

impl EdsFile {
    pub fn new(dir: &Path, file_name: &str) -> Self {
        EdsFile { dir: dir.to_path_buf(), path: dir.join(file_name) }
    }

    /// The bytes written for an assignment: a pretty-printed `DiscoveryResponse`, newline-terminated.
    pub fn render(a: &Assignment) -> Vec<u8> {
        let resp = DiscoveryResponse {
            version_info: a.version.clone(),
            resources: vec![a.cla.clone()],
            type_url: CLA_TYPE_URL.to_string(),
        };
        // Plain structs of strings and integers always serialize.
        let mut bytes = serde_json::to_vec_pretty(&resp).unwrap_or_default();
        bytes.push(b'\n');
        bytes
    }

    /// Write the assignment unless the file already holds exactly it. Returns whether it wrote.
    pub fn write(&self, a: &Assignment) -> std::io::Result<bool> {
        let bytes = Self::render(a);
        if std::fs::read(&self.path).map(|old| old == bytes).unwrap_or(false) {
            return Ok(false);
        }
        let name = self.path.file_name().and_then(|n| n.to_str()).unwrap_or("eds.json");
        self.remove_leftovers(name);
        // A dot-name Envoy ignores (it watches for moves onto its file), unique per process.
        let tmp = self.dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            drop(f);
            std::fs::rename(&tmp, &self.path)?;
            // Persist the rename itself. Opening a directory for fsync works on Linux and macOS.
            if let Ok(d) = std::fs::File::open(&self.dir) {
                let _ = d.sync_all();
            }
            Ok(true)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Remove temporary files of this target that a killed writer left (`.NAME.tmp-PID`, written
    /// and renamed within milliseconds): any older than [`LEFTOVER_AGE`]. Best effort; a leftover
    /// costs disk space, never a wrong reload (Envoy ignores dot-names that are not moved).
    fn remove_leftovers(&self, name: &str) {
        let prefix = format!(".{name}.tmp-");
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for e in entries.flatten() {
            let old_enough = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= LEFTOVER_AGE);
            if old_enough && e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// The assignment for `cluster` in the file now; `Ok(None)` when there is no file.
    pub fn read(&self, cluster: &str) -> Result<Option<ClusterLoadAssignment>, String> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", self.path.display())),
        };
        let resp: DiscoveryResponse = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} is not a JSON DiscoveryResponse: {e}", self.path.display()))?;
        Ok(resp.resources.into_iter().find(|r| r.cluster_name == cluster))
    }
}

#[cfg(test)]
mod tests {
    use super::super::assignment::{build, Resolved};
    use super::*;
    use crate::MemberId;

    fn a(w: u32) -> Assignment {
        let r = Resolved {
            member: MemberId::from("10.0.0.1:80"),
            addr: "10.0.0.1:80".parse().unwrap(),
            hostname: None,
        };
        build("vllm", &[(r, w)], false).unwrap().0
    }

    #[test]
    fn a_temporary_file_a_killed_writer_left_is_removed_at_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let f = EdsFile::new(dir.path(), "vllm.json");
        let left = dir.path().join(".vllm.json.tmp-999999");
        let fresh = dir.path().join(".vllm.json.tmp-999998");
        let other = dir.path().join(".other.json.tmp-999999");
        for p in [&left, &fresh, &other] {
            std::fs::write(p, b"{").unwrap();
        }
        let old = std::time::SystemTime::now() - LEFTOVER_AGE * 2;
        for p in [&left, &other] {
            std::fs::File::options().write(true).open(p).unwrap().set_modified(old).unwrap();
        }
        assert!(f.write(&a(3)).unwrap());
        assert!(!left.exists(), "an old leftover of this target is gone");
        assert!(fresh.exists(), "a recent one may be another writer's, mid-write");
        assert!(other.exists(), "another target's files are not ours");
    }

    #[test]
    fn writes_by_rename_and_skips_identical_content() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let f = EdsFile::new(dir.path(), "vllm.json");
        assert_eq!(f.read("vllm").unwrap(), None);
        assert!(f.write(&a(3)).unwrap());
        let ino = std::fs::metadata(&f.path).unwrap().ino();
        assert!(!f.write(&a(3)).unwrap(), "same content is not rewritten");
        assert_eq!(std::fs::metadata(&f.path).unwrap().ino(), ino);
        assert!(f.write(&a(4)).unwrap());
        assert_ne!(std::fs::metadata(&f.path).unwrap().ino(), ino, "a new file was renamed into place");
        let back = f.read("vllm").unwrap().unwrap();
        assert_eq!(back.endpoints[0].lb_endpoints[0].load_balancing_weight, 4);
        assert_eq!(f.read("other").unwrap(), None);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temp file left behind: {names:?}");
    }

    #[test]
    fn unreadable_content_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let f = EdsFile::new(dir.path(), "vllm.json");
        std::fs::write(&f.path, "not json").unwrap();
        let err = f.read("vllm").unwrap_err();
        assert!(err.contains("not a JSON DiscoveryResponse"), "{err}");
    }
}
