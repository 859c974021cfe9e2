//! Replays every match recorded from the Python `trueskill` package 0.4.5 and
//! checks mu and sigma of both players after every match (within 1e-6), the
//! final ratings, and the 1 vs 1 match quality of p0 against p1 at the end.
//!
//! Fixture folder: `$RELAY_TRUESKILL_FIXTURES`, default
//! `shared/fixtures/trueskill` next to the repository (see
//! `shared/fixtures/README.md`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use relay_league::{Outcome, Rating, TrueSkill};
use serde::Deserialize;

const TOLERANCE: f64 = 1e-6;

#[derive(Deserialize)]
struct Scenario {
    env: TrueSkill,
    matches: Vec<Match>,
    #[serde(rename = "final")]
    final_ratings: BTreeMap<String, (f64, f64)>,
    quality_p0_p1_final: f64,
}

#[derive(Deserialize)]
struct Match {
    a: String,
    b: String,
    outcome: String,
    after: BTreeMap<String, (f64, f64)>,
}

fn fixture_dir() -> PathBuf {
    match std::env::var_os("RELAY_TRUESKILL_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/fixtures/trueskill"
        )),
    }
}

fn close(got: Rating, want: (f64, f64)) -> bool {
    (got.mu - want.0).abs() <= TOLERANCE && (got.sigma - want.1).abs() <= TOLERANCE
}

#[test]
fn trueskill_fixtures_replay_identically() {
    let dir = fixture_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read fixture folder {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    files.sort();
    let mut matches_replayed = 0;
    let mut failures = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let scenarios: Vec<Scenario> =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (scenario_index, scenario) in scenarios.iter().enumerate() {
            let env = scenario.env;
            env.validate().unwrap();
            let mut ratings: BTreeMap<&str, Rating> = BTreeMap::new();
            for (match_index, game) in scenario.matches.iter().enumerate() {
                let outcome = match game.outcome.as_str() {
                    "a" => Outcome::Win,
                    "b" => Outcome::Loss,
                    "draw" => Outcome::Draw,
                    other => panic!("{}: unknown outcome {other:?}", file.display()),
                };
                let a = *ratings.entry(&game.a).or_insert_with(|| env.new_rating());
                let b = *ratings.entry(&game.b).or_insert_with(|| env.new_rating());
                let (a_after, b_after) = env.rate_1vs1(a, b, outcome).unwrap();
                ratings.insert(&game.a, a_after);
                ratings.insert(&game.b, b_after);
                for (player, got) in [(&game.a, a_after), (&game.b, b_after)] {
                    let want = game.after[player.as_str()];
                    if !close(got, want) {
                        failures.push(format!(
                            "{} scenario {scenario_index} match {match_index} {player}: got {got:?}, want {want:?}",
                            file.display()
                        ));
                    }
                }
                matches_replayed += 1;
            }
            for (player, want) in &scenario.final_ratings {
                let got = ratings[player.as_str()];
                if !close(got, *want) {
                    failures.push(format!(
                        "{} scenario {scenario_index} final {player}: got {got:?}, want {want:?}",
                        file.display()
                    ));
                }
            }
            assert_eq!(ratings.len(), scenario.final_ratings.len());
            let quality = env.quality_1vs1(ratings["p0"], ratings["p1"]);
            if (quality - scenario.quality_p0_p1_final).abs() > TOLERANCE {
                failures.push(format!(
                    "{} scenario {scenario_index} quality: got {quality}, want {}",
                    file.display(),
                    scenario.quality_p0_p1_final
                ));
            }
        }
    }
    assert!(
        matches_replayed > 0,
        "no match replayed from {} ({} json files)",
        dir.display(),
        files.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
