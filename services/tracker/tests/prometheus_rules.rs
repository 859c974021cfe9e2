//! The Prometheus alerting rules are valid (`promtool check rules`) and
//! name exactly the alerts the tracker raises.

use std::process::Command;

const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/prometheus/rules.yml"
);
const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/prometheus/prometheus.yml"
);

#[test]
fn promtool_accepts_the_rules_and_config() {
    let out = Command::new("promtool")
        .args(["check", "rules", RULES])
        .output()
        .expect("promtool (deploy/install.sh installs it)");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("promtool")
        .args(["check", "config", CONFIG])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_rules_cover_every_tracker_alert() {
    let text = std::fs::read_to_string(RULES).unwrap();
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    let mut expected: Vec<&str> = relay_tracker::alerts::ALERTS.to_vec();
    let mut got = names.clone();
    expected.sort();
    got.sort();
    assert_eq!(got, expected);
}
