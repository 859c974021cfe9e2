//! The metric catalogue (`configs/metrics.yaml`, compiled in) and metric
//! registration that checks it: every metric a service registers and every
//! value it reports to the tracker must be listed there.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};

use prometheus::core::Collector;
use prometheus::Registry;
use serde::Deserialize;

/// Kind of a catalogued metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

/// One catalogue entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricSpec {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: MetricType,
    pub unit: String,
    /// Service whose /metrics exports it (`tracker` for reported values it
    /// re-exports; `all` for what every service exports).
    pub exported_by: String,
    pub description: String,
    #[serde(default)]
    pub min: Option<f64>,
    #[serde(default)]
    pub max: Option<f64>,
    /// Shown by the console displays.
    pub console: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogueFile {
    metrics: Vec<MetricSpec>,
}

/// Every metric relay exports or reports.
#[derive(Debug)]
pub struct Catalogue {
    entries: BTreeMap<String, MetricSpec>,
}

/// The text of `configs/metrics.yaml`.
pub const CATALOGUE_YAML: &str = include_str!("../../../configs/metrics.yaml");

impl Catalogue {
    /// Parses a catalogue; names must be unique.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: CatalogueFile =
            serde_yaml::from_str(text).map_err(|e| format!("metrics catalogue: {e}"))?;
        let mut entries = BTreeMap::new();
        for m in file.metrics {
            if let Some(previous) = entries.insert(m.name.clone(), m) {
                return Err(format!("metrics catalogue lists {} twice", previous.name));
            }
        }
        Ok(Self { entries })
    }

    /// The compiled-in catalogue.
    pub fn get() -> &'static Catalogue {
        static CATALOGUE: OnceLock<Catalogue> = OnceLock::new();
        CATALOGUE.get_or_init(|| {
            Catalogue::parse(CATALOGUE_YAML).expect("configs/metrics.yaml is valid")
        })
    }

    pub fn spec(&self, name: &str) -> Option<&MetricSpec> {
        self.entries.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}

static SEEN: OnceLock<Mutex<BTreeSet<String>>> = OnceLock::new();

fn seen() -> &'static Mutex<BTreeSet<String>> {
    SEEN.get_or_init(Default::default)
}

/// Records that this process emits `name` (for the catalogue test).
pub fn record_emitted(name: &str) {
    seen()
        .lock()
        .expect("metric names lock")
        .insert(name.to_string());
}

/// Every metric name this process has registered or reported so far.
pub fn emitted() -> BTreeSet<String> {
    seen().lock().expect("metric names lock").clone()
}

/// Registers a collector, checking each of its metrics against the catalogue
/// (an uncatalogued metric is a bug: logged as an error, still registered).
pub fn register<C: Collector + Clone + 'static>(registry: &Registry, collector: &C) {
    for desc in collector.desc() {
        if Catalogue::get().spec(&desc.fq_name).is_none() {
            tracing::error!(metric = %desc.fq_name, "metric is not in configs/metrics.yaml");
        }
        record_emitted(&desc.fq_name);
    }
    if let Err(e) = registry.register(Box::new(collector.clone())) {
        tracing::error!(error = %e, "metric registration failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_parses_and_counters_end_in_total() {
        let c = Catalogue::get();
        for name in c.names() {
            let spec = c.spec(name).unwrap();
            assert!(name.starts_with("relay_"), "{name}");
            assert_eq!(
                spec.kind == MetricType::Counter,
                name.ends_with("_total"),
                "{name}: counters and only counters end in _total"
            );
            assert!(!spec.description.is_empty(), "{name}");
        }
    }
}

/// A weights version's transfer as a receiver sees it: from the publisher's
/// stamp to the version held ready here (`relay_weights_transfer_seconds`,
/// the two clocks: same machine or NTP), the bytes received
/// (`relay_weights_received_bytes_total`) and the newest version held
/// (`relay_weights_version_held`). Classic policies' followers and
/// inference servers' LoRA adapters record the same three metrics, so a
/// copy shows the version it holds whether or not it has used it since
/// (an env-runner held back by a full replay buffer does not act).
#[derive(Clone)]
pub struct WeightsTransfer {
    seconds: prometheus::Histogram,
    bytes: prometheus::IntCounter,
    held: prometheus::IntGauge,
}

impl WeightsTransfer {
    /// Registers the three metrics in `registry`.
    pub fn register(registry: &Registry) -> Self {
        let seconds = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new(
                "relay_weights_transfer_seconds",
                "From the publisher stamping a weights version to this copy holding it ready (both clocks: same machine or NTP).",
            )
            .buckets(vec![0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]),
        )
        .expect("valid histogram");
        let bytes = prometheus::IntCounter::new(
            "relay_weights_received_bytes_total",
            "Bytes of published weights versions this copy received.",
        )
        .expect("valid counter");
        let held = prometheus::IntGauge::new(
            "relay_weights_version_held",
            "The newest weights version this copy holds ready.",
        )
        .expect("valid gauge");
        register(registry, &seconds);
        register(registry, &bytes);
        register(registry, &held);
        Self {
            seconds,
            bytes,
            held,
        }
    }

    /// Counts `bytes` of weights received.
    pub fn received(&self, bytes: usize) {
        self.bytes.inc_by(bytes as u64);
    }

    /// `version`, stamped at `published_unix_ms` (0: unknown, not timed),
    /// is held ready now: times its transfer, and shows it as the newest
    /// held when it is (an inference server holds several adapters).
    pub fn ready(&self, version: u64, published_unix_ms: u64) {
        if published_unix_ms > 0 {
            let ms = relay_proto::unix_ms().saturating_sub(published_unix_ms);
            self.seconds.observe(ms as f64 / 1000.0);
        }
        let version = i64::try_from(version).unwrap_or(i64::MAX);
        if version > self.held.get() {
            self.held.set(version);
        }
    }
}
