//! deploy/ checked offline: every Kubernetes manifest against the Kubernetes
//! API schemas (PyPI `kubernetes-validate`, strict: unknown fields fail), the
//! kustomizations structurally (and rendered, where `kubectl` is installed),
//! the compose file with the Compose specification parser (PyPI
//! `compose-spec`), nats-server's own config check, and no path of a
//! particular machine anywhere. `deploy/install.sh` installs the validators.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
    out.sort();
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    files(dir, &mut all);
    all.retain(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"));
    all
}

fn python(script: &str, args: &[&Path]) -> Output {
    Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (deploy/install.sh installs it)")
}

fn assert_ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}\n(missing modules? run deploy/install.sh)",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Validates every document of the files given against the Kubernetes schemas.
const K8S_VALIDATE: &str = r#"
import sys, yaml, kubernetes_validate
failures, seen = [], 0
for path in sys.argv[1:]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        seen += 1
        name = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, "1.37.0", strict=True)
        except Exception as e:
            failures.append(f"{name}: {e}")
print(f"{seen} documents validated")
if seen == 0:
    failures.append("no documents")
if failures:
    print("\n".join(failures))
    sys.exit(1)
"#;

#[test]
fn deploy_k8s_manifests_match_the_kubernetes_schemas() {
    let manifests: Vec<PathBuf> = yaml_files(&deploy().join("k8s"))
        .into_iter()
        .filter(|p| p.file_name().unwrap() != "kustomization.yaml")
        .collect();
    assert!(manifests.len() >= 9, "{manifests:?}");
    let args: Vec<&Path> = manifests.iter().map(PathBuf::as_path).collect();
    let out = python(K8S_VALIDATE, &args);
    assert_ok("kubernetes-validate", &out);
    // And a wrong manifest is refused, so the check is real.
    let dir = relay_testkit::TempDir::new("k8s-bad");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n  selector: {}\n  template: {spec: {containers: []}}\n",
    )
    .unwrap();
    assert!(!python(K8S_VALIDATE, &[&bad]).status.success());
}

/// Checks a kustomization: known fields, and every file it names exists.
const KUSTOMIZATION_CHECK: &str = r#"
import sys, os, yaml
KNOWN = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator",
         "secretGenerator", "images", "replicas", "patches", "namePrefix", "nameSuffix"}
failures = []
for path in sys.argv[1:]:
    base = os.path.dirname(path)
    k = yaml.safe_load(open(path))
    if k.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or k.get("kind") != "Kustomization":
        failures.append(f"{path}: apiVersion/kind")
    for key in set(k) - KNOWN:
        failures.append(f"{path}: unknown field {key}")
    named = list(k.get("resources", []))
    for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        if not gen.get("name"):
            failures.append(f"{path}: generator without name")
        for f in gen.get("files", []):
            named.append(f.split("=", 1)[-1])
    for ref in named:
        if not os.path.exists(os.path.join(base, ref)):
            failures.append(f"{path}: {ref} does not exist")
    for patch in k.get("patches", []):
        if "target" not in patch or not isinstance(yaml.safe_load(patch.get("patch", "")), list):
            failures.append(f"{path}: patch needs a target and a JSON 6902 list")
if failures:
    print("\n".join(failures))
    sys.exit(1)
"#;

#[test]
fn deploy_kustomizations_are_complete_and_render_valid_objects() {
    let kustomizations: Vec<PathBuf> = yaml_files(&deploy().join("k8s"))
        .into_iter()
        .filter(|p| p.file_name().unwrap() == "kustomization.yaml")
        .collect();
    assert_eq!(kustomizations.len(), 3, "{kustomizations:?}");
    let args: Vec<&Path> = kustomizations.iter().map(PathBuf::as_path).collect();
    assert_ok("kustomization check", &python(KUSTOMIZATION_CHECK, &args));

    // Rendered overlays, where kubectl (with its built-in kustomize) is installed.
    if Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_err()
    {
        eprintln!("kubectl not installed: overlays checked structurally only");
        return;
    }
    let dir = relay_testkit::TempDir::new("k8s-render");
    for overlay in ["local", "production"] {
        let out = Command::new("kubectl")
            .args(["kustomize", "--load-restrictor", "LoadRestrictionsNone"])
            .arg(deploy().join("k8s/overlays").join(overlay))
            .output()
            .unwrap();
        assert_ok(&format!("kubectl kustomize {overlay}"), &out);
        let rendered = dir.path().join(format!("{overlay}.yaml"));
        std::fs::write(&rendered, &out.stdout).unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for kind in [
            "kind: Namespace",
            "kind: StatefulSet",
            "kind: HorizontalPodAutoscaler",
            "kind: ConfigMap",
        ] {
            assert!(text.contains(kind), "{overlay} renders no {kind}");
        }
        // The learner replicas: a StatefulSet, one per machine or GPU,
        // sharing one run folder (ReadWriteMany except on one node).
        let learner = learner_statefulset(&out.stdout);
        let (replicas, modes) = match overlay {
            "production" => (2, "['ReadWriteMany']"),
            _ => (1, "['ReadWriteOnce']"),
        };
        assert_eq!(learner, format!("{replicas} Parallel {modes}"), "{overlay}");
        if overlay == "production" {
            // The learner and the inference servers on GPUs, from the CUDA image.
            assert_eq!(text.matches("nvidia.com/gpu: \"1\"").count(), 4, "{text}");
            assert_eq!(text.matches("relay:0.1.0-cuda").count(), 2, "{text}");
        }
        assert_ok(
            &format!("kubernetes-validate of rendered {overlay}"),
            &python(K8S_VALIDATE, &[&rendered]),
        );
    }
}

/// The rendered learner StatefulSet's replicas, pod management policy and
/// its run folder's access modes, as one line.
fn learner_statefulset(rendered: &[u8]) -> String {
    const SCRIPT: &str = r#"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "learner")
pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "relay-learner-runs")
print(sts["spec"]["replicas"], sts["spec"]["podManagementPolicy"], pvc["spec"]["accessModes"])
"#;
    let dir = relay_testkit::TempDir::new("k8s-learner");
    let path = dir.path().join("rendered.yaml");
    std::fs::write(&path, rendered).unwrap();
    let out = python(SCRIPT, &[&path]);
    assert_ok("the rendered learner StatefulSet", &out);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const COMPOSE_CHECK: &str = r#"
import sys
from compose_spec import PyCompose
c = PyCompose.from_yaml(open(sys.argv[1]).read())
print(" ".join(sorted(c.service_names())))
"#;

#[test]
fn deploy_compose_file_follows_the_compose_spec() {
    let compose = deploy().join("compose.yaml");
    let out = python(COMPOSE_CHECK, &[&compose]);
    assert_ok("compose-spec", &out);
    let names = String::from_utf8_lossy(&out.stdout);
    for service in [
        "nats",
        "redis",
        "prometheus",
        "env-runner",
        "inference-server",
        "replay-buffer",
        "learner",
        "evaluator",
        "tracker",
    ] {
        assert!(
            names.split_whitespace().any(|n| n == service),
            "{service} missing: {names}"
        );
    }
    // The parser refuses what the spec does not know.
    let dir = relay_testkit::TempDir::new("compose-bad");
    let bad = dir.path().join("compose.yaml");
    std::fs::write(&bad, "services:\n  a:\n    imagee: x\n").unwrap();
    assert!(!python(COMPOSE_CHECK, &[&bad]).status.success());
}

#[test]
fn deploy_services_serve_metrics_on_all_interfaces_in_containers() {
    let compose = std::fs::read_to_string(deploy().join("compose.yaml")).unwrap();
    for service in [
        "env-runner",
        "inference-server",
        "replay-buffer",
        "learner",
        "evaluator",
        "tracker",
    ] {
        let wanted = format!("[\"{service}\", \"--metrics-addr\", \"0.0.0.0:9100\"");
        assert!(compose.contains(&wanted), "compose: {wanted}");
        let k8s =
            std::fs::read_to_string(deploy().join(format!("k8s/base/{service}.yaml"))).unwrap();
        assert!(k8s.contains(&wanted), "k8s {service}: {wanted}");
        assert!(k8s.contains("path: /healthz"), "k8s {service}: probes");
        assert!(k8s.contains("prometheus.io/scrape"), "k8s {service}");
        assert!(k8s.contains("secretKeyRef"), "k8s {service}: credentials");
    }
}

#[test]
fn deploy_nats_config_is_accepted_by_nats_server() {
    let bin = std::env::var("RELAY_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
    let mut command = Command::new(bin);
    command
        .arg("-t")
        .arg("-c")
        .arg(deploy().join("nats/nats-server.conf"))
        .env("NATS_SERVER_NAME", "test");
    for user in [
        "ENV_RUNNER",
        "INFERENCE_SERVER",
        "REPLAY_BUFFER",
        "LEARNER",
        "EVALUATOR",
        "TRACKER",
        "OPERATOR",
    ] {
        command.env(format!("RELAY_NATS_PASSWORD_{user}"), "x");
    }
    let out = command
        .output()
        .expect("nats-server runs (deploy/install.sh)");
    assert_ok("nats-server -t", &out);
}

#[test]
fn deploy_holds_no_path_of_this_machine() {
    let mut all = Vec::new();
    files(&deploy(), &mut all);
    let home = std::env::var("HOME").unwrap_or_default();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .display()
        .to_string();
    for path in all {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        // The checkout's own location, the home folder and the usual
        // per-user and scratch folders.
        for needle in [root.as_str(), home.as_str(), "/root/", "/home/", "/tmp/"] {
            if needle.len() > 1 {
                assert!(
                    !text.contains(needle),
                    "{} contains {needle}",
                    path.display()
                );
            }
        }
    }
}
