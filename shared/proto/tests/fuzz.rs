//! The decoder fuzzer of `just bench-fuzz`, a few thousand cases per message
//! type, on every `cargo test`. `FUZZ_CASES` and `FUZZ_SEED` override it.

mod support {
    pub mod fuzz_engine;
}

use support::fuzz_engine as engine;

#[test]
fn every_wire_message_type_is_fuzzed() {
    let kinds = engine::declared_kinds();
    assert!(kinds.len() >= 14, "found only {kinds:?} in messages.rs");
    for kind in &kinds {
        assert!(
            engine::SUBJECTS.iter().any(|(name, _)| name == kind),
            "no fuzz generator for {kind}: add it to tests/support/fuzz_engine.rs"
        );
    }
}

#[test]
fn decoders_survive_fuzzing() {
    let cases = std::env::var("FUZZ_CASES").map_or(2_000, |v| v.parse().unwrap());
    // A fixed seed keeps `cargo test` deterministic; the bench draws far more.
    let seed = std::env::var("FUZZ_SEED").map_or(5, |v| v.parse().unwrap());
    let reports: Vec<engine::Report> = engine::SUBJECTS
        .iter()
        .map(|(_, run)| run(seed, cases))
        .collect();
    let table = engine::table(&reports);
    let problems: Vec<String> = reports
        .iter()
        .flat_map(|r| r.examples.iter().map(move |e| format!("{}: {e}", r.kind)))
        .collect();
    assert!(
        reports.iter().all(|r| r.panics == 0 && r.failures == 0),
        "seed {seed}:\n{table}{}",
        problems.join("\n")
    );
    for r in &reports {
        assert!(r.cases >= cases, "{}", r.kind);
        assert!(r.accepted > 0, "{}: nothing accepted\n{table}", r.kind);
        for reason in ["oversized", "decode", "schema_version"] {
            assert!(
                r.rejected.get(reason).copied().unwrap_or(0) > 0,
                "{}: no {reason} rejection\n{table}",
                r.kind
            );
        }
    }
}
