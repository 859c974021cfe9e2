//! Every preset in `configs/` loads and validates, and every classic one
//! fits the env it names (made as the services make it, through the env
//! bridge where it is Python's): policy, image observations, fragment size.

use std::path::Path;

#[test]
fn every_preset_loads_and_fits_its_env() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".yaml") || name == "metrics.yaml" {
            continue;
        }
        let config = relay_config::ExperimentConfig::load(&path, &[])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if !config.is_text_game() {
            let spec = config.env_spec().unwrap_or_else(|e| panic!("{name}: {e}"));
            config
                .check_env(&spec)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let policy = relay_policy::spec_for(&config).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(policy.cnn.is_some(), config.policy.cnn.is_some(), "{name}");
        }
        checked += 1;
    }
    assert!(
        checked >= 15,
        "only {checked} presets found in {}",
        dir.display()
    );
}
