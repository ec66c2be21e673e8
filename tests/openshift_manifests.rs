//! Every manifest under deploy/openshift is a valid Kubernetes object (typed deserialization with
//! k8s-openapi, and a round trip that catches fields the schema does not know, i.e. typos), every
//! kustomization points at files that exist, and each overlay, rendered with `kubectl kustomize`,
//! holds together: the controller config inside its ConfigMap passes `check`, and the Deployment,
//! Service, ServiceMonitor, PDB, NetworkPolicy, RBAC and mounts agree with that config and with
//! OpenShift's restricted-v2 SCC.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use llm_load_controller::adapters::{SecretRef, SinkConfig};
use llm_load_controller::config::{self, Config, SourceConfig};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_llm-load-controller");
const NS: &str = "llm-load-controller";
const OVERLAYS: [&str; 4] = ["bigip", "haproxy", "envoy", "epp"];
const SA_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/openshift")
}

/// `monitoring.coreos.com/v1` ServiceMonitor: a CRD, so its fields are checked by this struct
/// (the subset we use; unknown fields are errors).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    endpoints: Vec<SmEndpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SmEndpoint {
    port: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scheme: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
}

/// `monitoring.coreos.com/v1` PrometheusRule (a CRD): the fields prometheus-operator accepts for a
/// rule group and a rule, unknown fields are errors. The rules themselves run in
/// tests/openshift_alerts.rs (promtool).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: PrometheusRuleSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrometheusRuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    rules: Vec<Rule>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[serde(skip_serializing_if = "Option::is_none")]
    alert: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    record: Option<String>,
    expr: String,
    #[serde(rename = "for", skip_serializing_if = "Option::is_none")]
    for_: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
}

/// `keda.sh/v1alpha1` ScaledObject (KEDA / OpenShift Custom Metrics Autoscaler): the fields used
/// here, typed as KEDA's CRD defines them; unknown fields are errors.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScaledObject {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ScaledObjectSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScaledObjectSpec {
    pub scale_target_ref: k8s_openapi::api::autoscaling::v2::CrossVersionObjectReference,
    pub min_replica_count: i32,
    pub max_replica_count: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub polling_interval: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cooldown_period: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advanced: Option<ScaledObjectAdvanced>,
    pub triggers: Vec<ScaleTrigger>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScaledObjectAdvanced {
    pub horizontal_pod_autoscaler_config: HpaConfig,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HpaConfig {
    pub behavior: k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScaleTrigger {
    #[serde(rename = "type")]
    pub type_: String,
    pub metric_type: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub authentication_ref: Option<NameRef>,
    /// KEDA trigger metadata is a map of strings (numbers must be quoted).
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameRef {
    pub name: String,
}

/// `keda.sh/v1alpha1` TriggerAuthentication with Secret references.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TriggerAuthentication {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: TriggerAuthSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TriggerAuthSpec {
    pub secret_target_ref: Vec<SecretTargetRef>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretTargetRef {
    pub parameter: String,
    pub name: String,
    pub key: String,
}

/// All YAML documents of a file (or of kubectl's output), as JSON values.
fn yaml_docs(text: &str, origin: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// Paths in `orig` that did not survive deserialize-then-serialize: fields the schema does not know.
fn lost(orig: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (orig, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    None if !v.is_null() => out.push(format!("{path}.{k}")),
                    None => {}
                    Some(w) => lost(v, w, &format!("{path}.{k}"), out),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                lost(v, w, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a != b => out.push(format!("{path}: {a} became {b}")),
        _ => {}
    }
}

fn typed<T: DeserializeOwned + Serialize>(doc: &Value, origin: &str) -> T {
    let t: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{origin}: {e}"));
    let back = serde_json::to_value(&t).expect("serialize");
    let mut out = Vec::new();
    lost(doc, &back, "", &mut out);
    assert!(out.is_empty(), "{origin}: fields unknown to the schema (typos?): {out:?}");
    t
}

/// One object, validated against its kind's schema.
#[derive(Debug)]
enum Obj {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ConfigMap(Box<ConfigMap>),
    Secret(Box<Secret>),
    Service(Box<Service>),
    Deployment(Box<Deployment>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    Pdb(Box<PodDisruptionBudget>),
    NetworkPolicy(Box<NetworkPolicy>),
    ServiceMonitor(Box<ServiceMonitor>),
    PrometheusRule(Box<PrometheusRule>),
    Hpa(Box<k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler>),
    ScaledObject(Box<ScaledObject>),
    TriggerAuthentication(Box<TriggerAuthentication>),
    /// The Gateway API Inference Extension's pool (its CRD is not in k8s-openapi): checked as JSON
    /// when read, nothing kept.
    InferencePool,
}

fn validate(doc: &Value, origin: &str) -> Obj {
    let api = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let o = format!("{origin} ({api} {kind})");
    match (api, kind) {
        ("v1", "Namespace") => Obj::Namespace(typed(doc, &o)),
        ("v1", "ServiceAccount") => Obj::ServiceAccount(typed(doc, &o)),
        ("v1", "ConfigMap") => Obj::ConfigMap(typed(doc, &o)),
        ("v1", "Secret") => Obj::Secret(typed(doc, &o)),
        ("v1", "Service") => Obj::Service(typed(doc, &o)),
        ("apps/v1", "Deployment") => Obj::Deployment(typed(doc, &o)),
        ("rbac.authorization.k8s.io/v1", "Role") => Obj::Role(typed(doc, &o)),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => Obj::RoleBinding(typed(doc, &o)),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => Obj::ClusterRoleBinding(typed(doc, &o)),
        ("policy/v1", "PodDisruptionBudget") => Obj::Pdb(typed(doc, &o)),
        ("networking.k8s.io/v1", "NetworkPolicy") => Obj::NetworkPolicy(typed(doc, &o)),
        ("monitoring.coreos.com/v1", "ServiceMonitor") => Obj::ServiceMonitor(typed(doc, &o)),
        ("autoscaling/v2", "HorizontalPodAutoscaler") => Obj::Hpa(typed(doc, &o)),
        ("keda.sh/v1alpha1", "ScaledObject") => Obj::ScaledObject(typed(doc, &o)),
        ("keda.sh/v1alpha1", "TriggerAuthentication") => Obj::TriggerAuthentication(typed(doc, &o)),
        ("monitoring.coreos.com/v1", "PrometheusRule") => {
            let r: Box<PrometheusRule> = typed(doc, &o);
            check_rules(&r, &o);
            Obj::PrometheusRule(r)
        }
        ("inference.networking.k8s.io/v1", "InferencePool") => {
            let spec = &doc["spec"];
            let picker = &spec["endpointPickerRef"];
            assert!(picker["name"].as_str().is_some_and(|n| !n.is_empty()), "{o}: endpointPickerRef.name");
            assert_eq!(picker["kind"], "Service", "{o}: the picker is a Service");
            assert!(
                picker["port"]["number"].as_u64().is_some_and(|p| p > 0 && p < 65536),
                "{o}: picker port"
            );
            assert!(
                matches!(picker["failureMode"].as_str(), None | Some("FailOpen") | Some("FailClose")),
                "{o}: failureMode"
            );
            assert!(
                spec["selector"]["matchLabels"].as_object().is_some_and(|m| !m.is_empty()),
                "{o}: selector"
            );
            assert!(spec["targetPorts"].as_array().is_some_and(|p| !p.is_empty()), "{o}: targetPorts");
            Obj::InferencePool
        }
        _ => panic!("{o}: unexpected kind; add it to this test's validation"),
    }
}

/// What prometheus-operator would refuse or what would never page anyone.
fn check_rules(r: &PrometheusRule, origin: &str) {
    assert!(!r.spec.groups.is_empty(), "{origin}: no rule groups");
    for g in &r.spec.groups {
        for rule in &g.rules {
            let name = rule.alert.as_deref().or(rule.record.as_deref()).unwrap_or_default();
            assert!(
                rule.alert.is_some() != rule.record.is_some(),
                "{origin}: {name}: a rule is either an alert or a recording rule"
            );
            if rule.alert.is_some() {
                let sev = rule.labels.as_ref().and_then(|l| l.get("severity"));
                assert!(
                    matches!(sev.map(String::as_str), Some("critical" | "warning" | "info")),
                    "{origin}: {name}: severity {sev:?}"
                );
                let ann = rule.annotations.clone().unwrap_or_default();
                assert!(ann.contains_key("summary") && ann.contains_key("description"), "{origin}: {name}");
                if let Some(f) = &rule.for_ {
                    humantime::parse_duration(f).unwrap_or_else(|e| panic!("{origin}: {name}: for {f}: {e}"));
                }
            }
        }
    }
}

fn kustomization(dir: &Path) -> Value {
    let p = dir.join("kustomization.yaml");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    yaml_docs(&text, &p.display().to_string()).pop().expect("one document")
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// Files a kustomization names: (resources, patches, generator files, components).
fn references(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>, Vec<PathBuf>, Vec<PathBuf>) {
    let k = kustomization(dir);
    let res = strs(&k["resources"]).iter().map(|r| dir.join(r)).collect();
    let patches = k["patches"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["path"].as_str().map(|s| dir.join(s))).collect())
        .unwrap_or_default();
    let gen = k["configMapGenerator"]
        .as_array()
        .map(|a| a.iter().flat_map(|g| strs(&g["files"])).map(|f| dir.join(f)).collect())
        .unwrap_or_default();
    let comps = strs(&k["components"]).iter().map(|c| dir.join(c)).collect();
    (res, patches, gen, comps)
}

fn all_yaml(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            all_yaml(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

#[test]
fn kustomizations_name_files_that_exist() {
    let mut dirs = vec![root().join("base"), root().join("components/dry-run")];
    dirs.extend(OVERLAYS.iter().map(|o| root().join("overlays").join(o)));
    for dir in dirs {
        let (res, patches, gen, comps) = references(&dir);
        for r in &res {
            assert!(
                r.is_file() || r.join("kustomization.yaml").is_file(),
                "{}: missing resource {}",
                dir.display(),
                r.display()
            );
        }
        for p in patches.iter().chain(&gen) {
            assert!(p.is_file(), "{}: missing file {}", dir.display(), p.display());
        }
        for c in &comps {
            assert_eq!(kustomization(c)["kind"], "Component", "{}", c.display());
        }
    }
}

#[test]
fn every_manifest_file_is_a_valid_kubernetes_object() {
    let mut files = Vec::new();
    all_yaml(&root(), &mut files);
    // Kustomizations, patches (partial objects) and controller configs are checked elsewhere.
    let mut skip: Vec<PathBuf> = Vec::new();
    for o in OVERLAYS {
        let (_, patches, gen, _) = references(&root().join("overlays").join(o));
        skip.extend(patches);
        skip.extend(gen);
    }
    let mut n = 0;
    for f in files {
        if f.file_name().is_some_and(|n| n == "kustomization.yaml") || skip.contains(&f) {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read");
        for (i, doc) in yaml_docs(&text, &f.display().to_string()).iter().enumerate() {
            if let Obj::Secret(sec) = validate(doc, &format!("{}#{i}", f.display())) {
                if sec.type_.as_deref() == Some("kubernetes.io/service-account-token") {
                    // The autoscaler's Thanos token: filled in by the token controller for this SA.
                    let ann = sec.metadata.annotations.clone().unwrap_or_default();
                    assert!(ann.contains_key("kubernetes.io/service-account.name"), "{}", f.display());
                } else {
                    // The BIG-IP credentials template: the type and keys the F5 sink's mounts expect.
                    assert_eq!(sec.type_.as_deref(), Some("kubernetes.io/basic-auth"), "{}", f.display());
                    let keys = sec.string_data.as_ref().expect("stringData");
                    assert!(
                        keys.contains_key("username") && keys.contains_key("password"),
                        "{}",
                        f.display()
                    );
                }
            }
            n += 1;
        }
    }
    assert!(
        n >= 20,
        "expected the base's 12 objects, the 2 templates and 6 autoscaling objects, validated {n}"
    );
}

#[test]
fn every_overlay_config_passes_check() {
    for o in OVERLAYS {
        let p = root().join("overlays").join(o).join("controller.yaml");
        // Written for the pod: its mounted CA bundle does not exist here.
        let out =
            Command::new(BIN).args(["check", "--offline", "--config"]).arg(&p).output().expect("run check");
        assert!(out.status.success(), "{}: {}", p.display(), String::from_utf8_lossy(&out.stderr));
    }
}

/// `kubectl kustomize DIR`, or `None` when kubectl is not installed.
fn render(dir: &Path) -> Option<String> {
    let out = match Command::new("kubectl").arg("kustomize").arg(dir).output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("cannot run kubectl: {e}"),
    };
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).expect("UTF-8"))
}

fn selects(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    assert!(sel.match_expressions.is_none(), "only matchLabels are used here");
    sel.match_labels
        .as_ref()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

fn dir_of(p: &Path) -> PathBuf {
    p.parent().expect("a file path has a parent").to_path_buf()
}

fn secret_file(s: &SecretRef) -> Option<PathBuf> {
    match s {
        SecretRef::File(p) => Some(p.clone()),
        _ => None,
    }
}

#[test]
fn each_overlay_renders_to_a_consistent_restricted_deployment() {
    for o in OVERLAYS {
        let dir = root().join("overlays").join(o);
        let Some(text) = render(&dir) else {
            // A silent pass would hide that the overlays were never rendered: fail unless the
            // developer says, explicitly, that this machine has no kubectl.
            assert!(
                std::env::var_os("LLMLC_ALLOW_NO_KUBECTL").is_some(),
                "kubectl not found: the overlays cannot be rendered. tests/run.sh installs it; \
                 set LLMLC_ALLOW_NO_KUBECTL=1 to skip this one test on a machine without it"
            );
            eprintln!("WARNING: kubectl not found and LLMLC_ALLOW_NO_KUBECTL set: overlay rendering SKIPPED");
            return;
        };
        let objs: Vec<Obj> =
            yaml_docs(&text, o).iter().enumerate().map(|(i, d)| validate(d, &format!("{o}#{i}"))).collect();
        check_overlay(o, &objs);
    }
}

/// The namespace an overlay deploys into: the endpoint picker joins the model's namespace (an
/// InferencePool names its picker's Service in its own namespace); the others have their own.
fn namespace_of(overlay: &str) -> &'static str {
    if overlay == "epp" {
        "llm-serving"
    } else {
        NS
    }
}

/// The endpoint picker's Role (and binding) to read its InferencePool and pods.
fn is_pool_reader(m: &ObjectMeta) -> bool {
    m.name.as_deref().is_some_and(|n| n.ends_with("-inference-pools"))
}

fn check_overlay(o: &str, objs: &[Obj]) {
    let find = |f: &dyn Fn(&Obj) -> bool| objs.iter().filter(|x| f(x)).count();
    let epp = o == "epp";
    let ns = namespace_of(o);
    // The endpoint picker's overlay: no Namespace of its own, and a Role (and binding) to read
    // its InferencePool's pods besides the Lease's.
    let expected = |kind: &str| match kind {
        "Namespace" if epp => 0,
        "Role" | "RoleBinding" if epp => 2,
        _ => 1,
    };
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "Pdb",
        "NetworkPolicy",
    ] {
        assert_eq!(
            find(&|x| format!("{x:?}").starts_with(&format!("{kind}("))),
            expected(kind),
            "{o}: how many {kind}"
        );
    }
    let mut dep = None;
    let mut cms = BTreeMap::new();
    let (mut svc, mut sm, mut pdb, mut np, mut role, mut crb, mut rb, mut sa) =
        (None, None, None, None, None, None, None, None);
    let mut rule = None;
    for x in objs {
        let meta_ns = |m: &ObjectMeta, cluster: bool| {
            if cluster {
                assert!(m.namespace.is_none(), "{o}: cluster-scoped {:?} has a namespace", m.name);
            } else {
                assert_eq!(m.namespace.as_deref(), Some(ns), "{o}: {:?} in the wrong namespace", m.name);
            }
        };
        match x {
            Obj::Namespace(n) => assert_eq!(n.metadata.name.as_deref(), Some(ns)),
            Obj::ServiceAccount(s) => {
                meta_ns(&s.metadata, false);
                sa = Some(s.metadata.name.clone().expect("name"));
            }
            Obj::ConfigMap(c) => {
                meta_ns(&c.metadata, false);
                cms.insert(c.metadata.name.clone().expect("name"), c.as_ref());
            }
            Obj::Secret(_) => panic!("{o}: Secrets are created by hand, never applied from git"),
            Obj::Service(s) => {
                meta_ns(&s.metadata, false);
                svc = Some(s.as_ref());
            }
            Obj::Deployment(d) => {
                meta_ns(&d.metadata, false);
                dep = Some(d.as_ref());
            }
            Obj::Role(r) if is_pool_reader(&r.metadata) => {
                meta_ns(&r.metadata, false);
                let rules = r.rules.as_deref().unwrap_or_default();
                let grants = |group: &str, res: &str, verb: &str| {
                    rules.iter().any(|x| {
                        x.api_groups.as_ref().is_some_and(|g| g.iter().any(|g| g == group))
                            && x.resources.as_ref().is_some_and(|r| r.iter().any(|r| r == res))
                            && x.verbs.iter().any(|v| v == verb)
                    })
                };
                assert!(
                    grants("inference.networking.k8s.io", "inferencepools", "get"),
                    "{o}: InferencePool RBAC"
                );
                assert!(grants("", "pods", "list"), "{o}: Pod RBAC");
            }
            Obj::RoleBinding(r) if is_pool_reader(&r.metadata) => {
                meta_ns(&r.metadata, false);
                assert_eq!(r.role_ref.name, "llm-load-controller-inference-pools");
            }
            Obj::Role(r) => {
                meta_ns(&r.metadata, false);
                role = Some(r.as_ref());
            }
            Obj::RoleBinding(r) => {
                meta_ns(&r.metadata, false);
                rb = Some(r.as_ref());
            }
            Obj::ClusterRoleBinding(r) => {
                meta_ns(&r.metadata, true);
                crb = Some(r.as_ref());
            }
            Obj::Pdb(p) => {
                meta_ns(&p.metadata, false);
                pdb = Some(p.as_ref());
            }
            Obj::NetworkPolicy(n) => {
                meta_ns(&n.metadata, false);
                np = Some(n.as_ref());
            }
            Obj::ServiceMonitor(s) => {
                meta_ns(&s.metadata, false);
                sm = Some(s.as_ref());
            }
            Obj::PrometheusRule(r) => {
                meta_ns(&r.metadata, false);
                rule = Some(r.as_ref());
            }
            Obj::Hpa(_) | Obj::ScaledObject(_) | Obj::TriggerAuthentication(_) => {
                panic!("{o}: autoscaling belongs to the model's namespace, not to the controller's overlays")
            }
            Obj::InferencePool => panic!("{o}: an InferencePool belongs to whoever serves the model"),
        }
    }
    let (dep, svc, sm, pdb, np, role, crb, rb, sa) = (
        dep.expect("deployment"),
        svc.expect("service"),
        sm.expect("servicemonitor"),
        pdb.expect("pdb"),
        np.expect("networkpolicy"),
        role.expect("role"),
        crb.expect("crb"),
        rb.expect("rb"),
        sa.expect("sa"),
    );

    // The Deployment: two replicas, restricted-v2 security, probes, resources.
    let spec = dep.spec.as_ref().expect("spec");
    assert_eq!(spec.replicas, Some(2), "{o}: two replicas for leader election");
    let pod_labels = spec.template.metadata.as_ref().and_then(|m| m.labels.clone()).expect("pod labels");
    assert!(selects(&spec.selector, &pod_labels), "{o}: the Deployment's selector misses its pods");
    let pod = spec.template.spec.as_ref().expect("pod spec");
    assert_eq!(pod.service_account_name.as_deref(), Some(sa.as_str()));
    assert_ne!(pod.host_network, Some(true));
    let psc = pod.security_context.as_ref().expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(psc.seccomp_profile.as_ref().map(|s| s.type_.as_str()), Some("RuntimeDefault"));
    assert!(
        psc.run_as_user.is_none() && psc.fs_group.is_none(),
        "{o}: restricted-v2 assigns UID and fsGroup itself"
    );
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];
    let csc = c.security_context.as_ref().expect("container securityContext");
    assert_eq!(csc.allow_privilege_escalation, Some(false));
    assert_eq!(csc.read_only_root_filesystem, Some(true));
    assert_ne!(csc.privileged, Some(true));
    assert!(csc.run_as_user.is_none());
    let caps = csc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert!(caps.add.is_none());
    let res = c.resources.as_ref().expect("resources");
    let req = res.requests.as_ref().expect("requests");
    assert!(req.contains_key("cpu") && req.contains_key("memory"), "{o}: requests");
    assert!(res.limits.as_ref().is_some_and(|l| l.contains_key("memory")), "{o}: memory limit");
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().and_then(|p| p.http_get.as_ref()).expect("httpGet probe");
        (g.path.clone().unwrap_or_default(), g.port.clone())
    };
    let http = IntOrString::String("http".into());
    assert_eq!(probe_path(&c.liveness_probe), ("/healthz".to_string(), http.clone()));
    assert_eq!(probe_path(&c.readiness_probe), ("/readyz".to_string(), http.clone()));
    let ports = c.ports.as_ref().expect("ports");
    let port =
        ports.iter().find(|p| p.name.as_deref() == Some("http")).expect("port named http").container_port;
    let env: BTreeMap<String, String> = c
        .env
        .as_ref()
        .expect("env")
        .iter()
        .filter_map(|e| Some((e.name.clone(), e.value_from.as_ref()?.field_ref.as_ref()?.field_path.clone())))
        .collect();
    assert_eq!(env.get("POD_NAME").map(String::as_str), Some("metadata.name"));
    assert_eq!(env.get("POD_NAMESPACE").map(String::as_str), Some("metadata.namespace"));
    assert!(
        c.image
            .as_deref()
            .is_some_and(|i| i.starts_with("image-registry.openshift-image-registry.svc:5000/")),
        "{o}: image {:?}",
        c.image
    );
    // Pinned to the release, not :latest, so IfNotPresent cannot keep a stale image on some nodes.
    let tag = c.image.as_deref().and_then(|i| i.rsplit_once(':')).map(|(_, t)| t).unwrap_or_default();
    assert_eq!(tag, env!("CARGO_PKG_VERSION"), "{o}: image tag");
    assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"), "{o}: pull policy of a pinned tag");

    // Mounts: every mount has a volume; where each one comes from.
    let volumes = pod.volumes.as_ref().expect("volumes");
    let mounts = c.volume_mounts.as_ref().expect("mounts");
    let mut mount_of: BTreeMap<String, &k8s_openapi::api::core::v1::Volume> = BTreeMap::new();
    for m in mounts {
        let v = volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("{o}: mount {} has no volume", m.name));
        assert!(m.sub_path.is_none(), "{o}: subPath mounts never see ConfigMap updates");
        if v.empty_dir.is_none() {
            assert_eq!(m.read_only, Some(true), "{o}: {} should be read-only", m.name);
        }
        mount_of.insert(m.mount_path.clone(), v);
    }
    let volume_at = |file: &Path| -> &k8s_openapi::api::core::v1::Volume {
        mount_of
            .get(dir_of(file).to_str().expect("utf8"))
            .copied()
            .unwrap_or_else(|| panic!("{o}: nothing mounted at {}", dir_of(file).display()))
    };

    // The config: passed by --config, in the ConfigMap the mount points at; the overlay starts dry.
    let args = c.args.clone().expect("args");
    assert_eq!(args.first().map(String::as_str), Some("run"));
    assert!(args.contains(&"--dry-run".to_string()), "{o}: overlays start as a dry run");
    let cfg_path = PathBuf::from(&args[args.iter().position(|a| a == "--config").expect("--config") + 1]);
    let cfg_cm = volume_at(&cfg_path).config_map.as_ref().expect("config from a ConfigMap").name.clone();
    let cm = cms.get(&cfg_cm).unwrap_or_else(|| panic!("{o}: ConfigMap {cfg_cm} not rendered"));
    let key = cfg_path.file_name().and_then(|f| f.to_str()).expect("file name");
    let text =
        cm.data.as_ref().and_then(|d| d.get(key)).unwrap_or_else(|| panic!("{o}: {cfg_cm} has no {key}"));
    let tmp = tempfile::tempdir().expect("tmp");
    let f = tmp.path().join(key);
    std::fs::write(&f, text).expect("write");
    let out = Command::new(BIN).args(["check", "--offline", "--config"]).arg(&f).output().expect("check");
    assert!(
        out.status.success(),
        "{o}: the ConfigMap's config fails check: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Validated by `check` above (without the pod's files); here only its values are looked at.
    let cfg: Config = config::deserialize_yaml(&f, text).expect("valid");
    assert_eq!(cfg.listen.port() as i32, port, "{o}: config listens where the container port is");

    // Thanos: the service-account token and the injected service CA.
    for s in cfg.sources.values() {
        if let SourceConfig::Prometheus(p) = s {
            assert!(
                p.url.starts_with("https://thanos-querier.openshift-monitoring.svc:9091"),
                "{o}: {}",
                p.url
            );
            assert_eq!(p.bearer_token.as_ref().and_then(secret_file), Some(PathBuf::from(SA_TOKEN)));
            let ca = p.ca_file.as_ref().expect("ca_file");
            let v = volume_at(ca).config_map.as_ref().expect("service CA from a ConfigMap");
            let ca_cm = cms.get(&v.name).unwrap_or_else(|| panic!("{o}: {} not rendered", v.name));
            let ann = ca_cm.metadata.annotations.clone().unwrap_or_default();
            assert_eq!(
                ann.get("service.beta.openshift.io/inject-cabundle").map(String::as_str),
                Some("true")
            );
            let file = ca.file_name().and_then(|f| f.to_str()).expect("name");
            assert!(v
                .items
                .as_ref()
                .is_some_and(|i| i.iter().any(|k| k.key == "service-ca.crt" && k.path == file)));
        }
    }
    // BIG-IP credentials and CA come from the hand-made Secret and ConfigMap.
    for p in &cfg.pools {
        if let SinkConfig::F5(f5) = &p.sink {
            let pw = secret_file(&f5.password).expect("password from a file");
            assert_eq!(
                volume_at(&pw).secret.as_ref().and_then(|s| s.secret_name.as_deref()),
                Some("bigip-credentials")
            );
            let ca = f5.ca_file.as_ref().expect("BIG-IP ca_file");
            assert_eq!(volume_at(ca).config_map.as_ref().map(|c| c.name.as_str()), Some("bigip-ca"));
        }
    }

    // Leader election: the Role lets the service account get/update exactly the configured Lease.
    let lease = &cfg.leader_election.lease_name;
    let rules = role.rules.as_ref().expect("rules");
    let allows = |verb: &str, named: bool| {
        rules.iter().any(|r| {
            r.api_groups.as_ref().is_some_and(|g| g.contains(&"coordination.k8s.io".to_string()))
                && r.resources.as_ref().is_some_and(|x| x.contains(&"leases".to_string()))
                && r.verbs.contains(&verb.to_string())
                && (!named || r.resource_names.as_ref().is_some_and(|n| n.contains(lease)))
        })
    };
    assert!(allows("get", true) && allows("update", true) && allows("create", false), "{o}: Lease RBAC");
    assert!(!allows("delete", false) && !allows("list", false), "{o}: Lease RBAC wider than needed");
    let bound = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.as_ref().is_some_and(|s| {
            s.iter().any(|s| s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(ns))
        })
    };
    assert_eq!(rb.role_ref.name, role.metadata.name.clone().expect("role name"));
    assert!(bound(&rb.subjects), "{o}: RoleBinding subject");
    assert_eq!(
        (crb.role_ref.kind.as_str(), crb.role_ref.name.as_str()),
        ("ClusterRole", "cluster-monitoring-view")
    );
    assert!(bound(&crb.subjects), "{o}: Thanos access for the service account");

    // Service, ServiceMonitor, PDB, NetworkPolicy all find the pods and the port.
    let sspec = svc.spec.as_ref().expect("service spec");
    let sel = sspec.selector.clone().expect("service selector");
    assert!(
        sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v)) && !sel.is_empty(),
        "{o}: Service misses the pods"
    );
    let sport = sspec
        .ports
        .as_ref()
        .expect("ports")
        .iter()
        .find(|p| p.target_port == Some(http.clone()))
        .expect("port to http");
    let svc_labels = svc.metadata.labels.clone().unwrap_or_default();
    assert!(selects(&sm.spec.selector, &svc_labels), "{o}: ServiceMonitor misses the Service");
    // Scraped through the ServiceMonitor, the job label is the Service's name: the alerts select it.
    let job = format!("job=\"{}\"", svc.metadata.name.clone().expect("service name"));
    for g in &rule.expect("PrometheusRule").spec.groups {
        for r in &g.rules {
            assert!(r.expr.contains(&job), "{o}: {:?} does not select {job}", r.alert);
        }
    }
    assert!(sm
        .spec
        .endpoints
        .iter()
        .any(|e| Some(&e.port) == sport.name.as_ref() && e.path.as_deref() == Some("/metrics")));
    let pspec = pdb.spec.as_ref().expect("pdb spec");
    assert!(selects(pspec.selector.as_ref().expect("pdb selector"), &pod_labels), "{o}: PDB misses the pods");
    assert!(
        matches!(pspec.min_available, Some(IntOrString::Int(n)) if n < 2),
        "{o}: PDB must allow one eviction"
    );
    let npspec = np.spec.as_ref().expect("np spec");
    assert!(
        selects(npspec.pod_selector.as_ref().expect("podSelector"), &pod_labels),
        "{o}: NetworkPolicy misses the pods"
    );
    let admits = |ns: &str| {
        npspec.ingress.as_ref().is_some_and(|rules| {
            rules.iter().any(|r| {
                let from_ns = r.from.as_ref().is_some_and(|f| {
                    f.iter().any(|p| {
                        p.namespace_selector
                            .as_ref()
                            .and_then(|s| s.match_labels.as_ref())
                            .and_then(|l| l.get("kubernetes.io/metadata.name"))
                            == Some(&ns.to_string())
                    })
                });
                let on_port = r
                    .ports
                    .as_ref()
                    .is_some_and(|ps| ps.iter().any(|p| p.port == Some(IntOrString::Int(port))));
                from_ns && on_port
            })
        })
    };
    assert!(admits("openshift-user-workload-monitoring"), "{o}: monitoring cannot scrape");
    if o == "envoy" {
        assert!(admits("llm-gateway"), "envoy: Envoy cannot poll EDS");
    }
}

#[test]
fn images_are_pinned_to_the_release_in_every_kustomization() {
    for o in OVERLAYS {
        let k = kustomization(&root().join("overlays").join(o));
        let images = k["images"].as_array().expect("images");
        for i in images {
            assert_eq!(i["newTag"].as_str(), Some(env!("CARGO_PKG_VERSION")), "{o}: {i}");
        }
    }
    let mut files = Vec::new();
    all_yaml(&root(), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read");
        for l in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
            assert!(!l.contains(":latest") && !l.contains("newTag: latest"), "{}: {l}", f.display());
        }
    }
}

#[test]
fn autoscaling_examples_agree_with_each_other_and_with_the_controller() {
    let dir = root().join("autoscaling");
    let (mut so, mut hpa, mut ta, mut secrets, mut sa, mut crb) = (None, None, None, Vec::new(), None, None);
    for f in ["keda-scaledobject.yaml", "hpa-external.yaml"] {
        let p = dir.join(f);
        let text = std::fs::read_to_string(&p).expect("read");
        for (i, doc) in yaml_docs(&text, f).iter().enumerate() {
            match validate(doc, &format!("{f}#{i}")) {
                Obj::ScaledObject(x) => so = Some(x),
                Obj::Hpa(x) => hpa = Some(x),
                Obj::TriggerAuthentication(x) => ta = Some(x),
                Obj::Secret(x) => secrets.push(x),
                Obj::ServiceAccount(x) => sa = Some(x),
                Obj::ClusterRoleBinding(x) => crb = Some(x),
                other => panic!("{f}: unexpected {other:?}"),
            }
        }
    }
    let (so, hpa, ta, sa, crb) = (
        so.expect("ScaledObject"),
        hpa.expect("HPA"),
        ta.expect("TriggerAuthentication"),
        sa.expect("ServiceAccount"),
        crb.expect("ClusterRoleBinding"),
    );
    let ns = so.metadata.namespace.clone().expect("namespace");
    for m in [&hpa.metadata, &ta.metadata, &sa.metadata] {
        assert_eq!(m.namespace.as_ref(), Some(&ns), "everything in the model's namespace");
    }
    // Both scale the same Deployment within the same bounds.
    let hs = hpa.spec.as_ref().expect("hpa spec");
    assert_eq!(so.spec.scale_target_ref, hs.scale_target_ref);
    assert_eq!(
        (so.spec.min_replica_count, so.spec.max_replica_count),
        (hs.min_replicas.unwrap_or(1), hs.max_replicas)
    );
    assert!(so.spec.min_replica_count >= 1, "never to zero: the pool would have no member");

    // The KEDA trigger: the saturation metric of a pool some overlay configures, as a Value metric,
    // with the same target as the HPA, and failing (not zero) when the metric is missing.
    assert_eq!(so.spec.triggers.len(), 1);
    let t = &so.spec.triggers[0];
    assert_eq!((t.type_.as_str(), t.metric_type.as_str()), ("prometheus", "Value"));
    let md = &t.metadata;
    let query = &md["query"];
    assert!(query.contains("llmlc_pool_saturation_ratio") && query.contains("llmlc_pool_up"), "{query}");
    let pools: Vec<String> = OVERLAYS
        .iter()
        .flat_map(|o| {
            let p = root().join("overlays").join(o).join("controller.yaml");
            // Only the pool names: deserialized, not validated (its CA path exists inside the pod only).
            let cfg: config::Config =
                config::deserialize_yaml(&p, &std::fs::read_to_string(&p).expect("read")).expect("valid");
            cfg.pools.into_iter().map(|p| p.name)
        })
        .collect();
    assert!(
        pools.iter().any(|p| query.contains(&format!("pool=\"{p}\""))),
        "{query} names no configured pool {pools:?}"
    );
    assert!(query.contains(&format!("namespace=\"{NS}\"")), "the controller's namespace");
    let threshold: f64 = md["threshold"].parse().expect("threshold");
    assert!(threshold > 0.0 && threshold < 1.0, "saturation is 0..1: {threshold}");
    assert_eq!(
        md.get("ignoreNullValues").map(String::as_str),
        Some("false"),
        "a missing metric must not scale in"
    );
    assert!(
        md["serverAddress"].starts_with("https://thanos-querier.openshift-monitoring.svc"),
        "{}",
        md["serverAddress"]
    );
    let ext = hs.metrics.as_ref().expect("metrics")[0].external.as_ref().expect("external metric");
    assert_eq!(ext.metric.name, "llmlc_pool_saturation_ratio");
    assert_eq!(ext.target.type_, "Value");
    let v = ext.target.value.as_ref().expect("value").0.clone();
    let hpa_target: f64 = match v.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().expect("milli") / 1000.0,
        None => v.parse().expect("quantity"),
    };
    assert_eq!(hpa_target, threshold, "KEDA and HPA examples use the same target");
    // Slow scale-down (a replica takes minutes to come back), as docs/openshift.md recommends.
    for b in [
        so.spec.advanced.as_ref().map(|a| &a.horizontal_pod_autoscaler_config.behavior),
        hs.behavior.as_ref(),
    ] {
        let down = b.and_then(|b| b.scale_down.as_ref()).expect("scaleDown behavior");
        assert!(
            down.stabilization_window_seconds.unwrap_or(0) >= 300,
            "scale down after >= 5 min of low load"
        );
    }

    // Authentication: the token Secret of the service account bound to cluster-monitoring-view.
    let token_secret =
        &ta.spec.secret_target_ref.iter().find(|r| r.parameter == "bearerToken").expect("bearer").name;
    let sec = secrets.iter().find(|s| s.metadata.name.as_ref() == Some(token_secret)).expect("token Secret");
    let sa_name = sa.metadata.name.clone().expect("sa name");
    assert_eq!(
        sec.metadata.annotations.as_ref().and_then(|a| a.get("kubernetes.io/service-account.name")),
        Some(&sa_name)
    );
    assert_eq!(crb.role_ref.name, "cluster-monitoring-view");
    assert!(crb
        .subjects
        .as_ref()
        .is_some_and(|s| s.iter().any(|s| s.name == sa_name && s.namespace.as_ref() == Some(&ns))));
    assert_eq!(t.authentication_ref.as_ref().map(|a| a.name.as_str()), ta.metadata.name.as_deref());
}
