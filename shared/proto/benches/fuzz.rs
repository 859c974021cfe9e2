//! `just bench-fuzz`: every wire message type's decoder against 100,000
//! generated payloads (arbitrary bytes, valid encodings, mutations, oversized
//! payloads); see `tests/support/fuzz_engine.rs`. Prints a table and a JSON
//! line; exits non-zero on any panic or broken invariant.
//!
//! `FUZZ_CASES` (default 100000) and `FUZZ_SEED` (default 1) override the
//! run; both types are spread over the available cores.

#[path = "../tests/support/fuzz_engine.rs"]
mod engine;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let cases = env_u64("FUZZ_CASES", 100_000);
    let seed = env_u64("FUZZ_SEED", 1);
    let kinds = engine::declared_kinds();
    let missing: Vec<&String> = kinds
        .iter()
        .filter(|k| !engine::SUBJECTS.iter().any(|(name, _)| name == k))
        .collect();
    if !missing.is_empty() {
        eprintln!("no fuzz generator for {missing:?}: add them to tests/support/fuzz_engine.rs");
        std::process::exit(2);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!(
        "fuzzing {} message types, {cases} cases each, seed {seed}, {threads} threads",
        engine::SUBJECTS.len()
    );
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let results = Mutex::new(vec![None; engine::SUBJECTS.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((_, run)) = engine::SUBJECTS.get(i) else {
                    break;
                };
                let report = run(seed, cases);
                results.lock().unwrap()[i] = Some(report);
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    let reports: Vec<engine::Report> = results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every type ran"))
        .collect();
    print!("{}", engine::table(&reports));
    let mut bad = false;
    for r in &reports {
        for example in &r.examples {
            bad = true;
            println!("{}: {example}", r.kind);
        }
        bad |= r.panics > 0 || r.failures > 0;
    }
    println!("{}", engine::json(&reports, seed, cases, seconds));
    if bad {
        eprintln!("fuzzing found panics or broken invariants (seed {seed})");
        std::process::exit(1);
    }
}
