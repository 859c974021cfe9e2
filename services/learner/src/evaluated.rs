//! What a learner hears of its run's evaluations, and the published
//! versions it keeps so that a checkpoint saved for an evaluation holds
//! exactly the weights that evaluation played.
//!
//! An evaluation of version N reports after the learner has moved on to
//! N+1, N+2, ... (it plays for a while, and the report travels), so the
//! learner's current weights are not N's. Every learner records each
//! version it publishes ([`RunEvents::record`]: the classic learners the
//! [`relay_proto::WeightsUpdate`], the text learner the adapter's PEFT
//! files) and keeps the newest [`RECENT_VERSIONS`]. The evaluator announces
//! each evaluation as it begins ([`relay_proto::EvalStarted`]), and the
//! learner then keeps that version (up to [`PINNED_VERSIONS`] at once, the
//! oldest let go first) until the version's [`EvalReport`] arrives. A report
//! that beats the best eval figure so far ([`eval_figure`]: the lower
//! confidence bound of the confirmation's mean when there is one), or the
//! first that solves the run
//! (screening and confirmation passed), becomes a checkpoint holding that
//! version's weights, linked `best` or `solved` ([`EvaluatedSave`]); the
//! rest of that checkpoint (optimizer, counters, RNG, the algorithm's other
//! networks) is the learner's state when it hears the report. A report for
//! a version no longer held (an evaluator that never announced it, or too
//! many evaluations at once) saves nothing and is logged: a `best` link
//! never points at weights other than those evaluated.
//!
//! A league learner also spares the versions kept here when it deletes
//! evicted versions from the run's object store, so that an evaluation's
//! inference servers can fetch its version until its last game.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use relay_kit::{Service, ServiceError};
use relay_proto::{EvalReport, EvalStarted, RunStatus, RunStatusUpdate};

/// Newest published versions always kept (what an evaluation may start on
/// before its announcement arrives).
pub const RECENT_VERSIONS: usize = 8;

/// Versions kept for evaluations in progress, at most.
pub const PINNED_VERSIONS: usize = 16;

/// What a report says of its version: the mean of its confirmation when
/// it was confirmed (more episodes, and fresh ones), else of its
/// screening, less `z` standard errors (`eval.confirm_z`, the margin a
/// confirmation must clear the threshold by). A version that passed the
/// screening by luck and failed its confirmation is not the best, nor is
/// one whose mean is high only because its returns scatter: the best of
/// many noisy means is the one most likely to fall back. The version that
/// solves the run is thereby also the best so far.
pub fn eval_figure(report: &EvalReport, z: f64) -> f64 {
    let (mean, std, episodes) = match &report.confirmation {
        Some(c) => (c.mean_return, c.std_return, c.returns.len()),
        None => (report.mean_return, report.std_return, report.returns.len()),
    };
    relay_proto::mean_less_standard_errors(mean, std, episodes, z)
}

/// A checkpoint to write for an evaluation: `weights` are version
/// `version`'s, as published; `links` are `best` and/or `solved`.
#[derive(Debug)]
pub struct EvaluatedSave<S> {
    pub version: u64,
    pub weights: Arc<S>,
    pub links: Vec<&'static str>,
}

/// The run's status announcements, evaluation starts and reports, and the
/// published versions kept for them (see the module docs).
pub struct RunEvents<S> {
    statuses: async_nats::Subscriber,
    reports: async_nats::Subscriber,
    starts: async_nats::Subscriber,
    recent: VecDeque<(u64, Arc<S>)>,
    pinned: VecDeque<(u64, Arc<S>)>,
    /// Best eval figure ([`eval_figure`]) whose version's weights were
    /// saved (figure, version).
    pub best_eval: Option<(f64, u64)>,
    /// The detail of the first `solved` announcement heard.
    pub solved: Option<String>,
    /// The first version that solved the run, with its weights.
    pub solved_weights: Option<(u64, Arc<S>)>,
    /// `eval.confirm_z`, for [`eval_figure`].
    confirm_z: f64,
}

impl<S> RunEvents<S> {
    /// Subscribes to the run's `status`, `eval` and `eval.started`;
    /// `best_eval` continues a resumed run's.
    pub async fn subscribe(
        service: &Service,
        best_eval: Option<(f64, u64)>,
    ) -> Result<Self, ServiceError> {
        let subscribe = |subject: String| {
            let nats = service.nats.clone();
            async move { nats.subscribe(subject).await.map_err(ServiceError::nats) }
        };
        Ok(Self {
            statuses: subscribe(service.subjects.status()).await?,
            reports: subscribe(service.subjects.eval()).await?,
            starts: subscribe(service.subjects.eval_started()).await?,
            recent: VecDeque::with_capacity(RECENT_VERSIONS + 1),
            pinned: VecDeque::new(),
            best_eval,
            solved: None,
            solved_weights: None,
            confirm_z: service.config.eval.confirm_z,
        })
    }

    /// Keeps what version `version` published (the newest
    /// [`RECENT_VERSIONS`] are kept).
    pub fn record(&mut self, version: u64, published: S) {
        self.recent.push_back((version, Arc::new(published)));
        while self.recent.len() > RECENT_VERSIONS {
            self.recent.pop_front();
        }
    }

    /// The versions under evaluation (announced, not yet reported). A
    /// league learner does not delete these from the run's object store,
    /// where the inference servers fetch them again.
    pub fn versions_under_evaluation(&self) -> std::collections::BTreeSet<u64> {
        self.pinned.iter().map(|(v, _)| *v).collect()
    }

    fn held(&self, version: u64) -> Option<Arc<S>> {
        self.pinned
            .iter()
            .chain(self.recent.iter())
            .find(|(v, _)| *v == version)
            .map(|(_, s)| s.clone())
    }

    /// Takes what arrived without waiting: `solved` announcements,
    /// evaluation starts (their versions kept) and reports; returns the
    /// checkpoints the reports ask for, one per version.
    pub fn poll(&mut self, service: &Service) -> Vec<EvaluatedSave<S>> {
        while let Some(Some(m)) = self.statuses.next().now_or_never() {
            if let Ok(status) = service
                .intake
                .decode::<RunStatusUpdate>("status", &m.payload)
            {
                if status.status == RunStatus::Solved && self.solved.is_none() {
                    tracing::info!(detail = %status.detail, "run solved");
                    self.solved = Some(status.detail);
                }
            }
        }
        while let Some(Some(m)) = self.starts.next().now_or_never() {
            if let Ok(start) = service
                .intake
                .decode::<EvalStarted>("eval.started", &m.payload)
            {
                self.pin(start.policy_version);
            }
        }
        let mut saves: Vec<EvaluatedSave<S>> = Vec::new();
        while let Some(Some(m)) = self.reports.next().now_or_never() {
            let Ok(report) = service.intake.decode::<EvalReport>("eval", &m.payload) else {
                continue;
            };
            if report.returns.is_empty() || !report.mean_return.is_finite() {
                continue;
            }
            let version = report.policy_version;
            let weights = self.held(version);
            self.pinned.retain(|(v, _)| *v != version);
            let figure = eval_figure(&report, self.confirm_z);
            let mut links = Vec::new();
            if self.best_eval.is_none_or(|(b, _)| figure > b) {
                links.push("best");
            }
            if report.solved && self.solved_weights.is_none() {
                links.push("solved");
            }
            if links.is_empty() {
                continue;
            }
            let Some(weights) = weights else {
                tracing::warn!(
                    version,
                    figure,
                    solved = report.solved,
                    "evaluated version's weights no longer held; no checkpoint saved for it"
                );
                continue;
            };
            if links.contains(&"best") {
                self.best_eval = Some((figure, version));
            }
            if links.contains(&"solved") {
                self.solved_weights = Some((version, weights.clone()));
            }
            match saves.iter_mut().find(|s| s.version == version) {
                Some(save) => save.links.extend(links),
                None => saves.push(EvaluatedSave {
                    version,
                    weights,
                    links,
                }),
            }
        }
        // A later best of the same poll replaces an earlier one.
        if let Some(&(_, best)) = self.best_eval.as_ref() {
            for save in &mut saves {
                if save.version != best {
                    save.links.retain(|l| *l != "best");
                }
            }
            saves.retain(|s| !s.links.is_empty());
        }
        saves
    }

    /// Keeps `version` until its report arrives (if it is still held).
    fn pin(&mut self, version: u64) {
        if self.pinned.iter().any(|(v, _)| *v == version) {
            return;
        }
        match self.held(version) {
            Some(weights) => {
                self.pinned.push_back((version, weights));
                if self.pinned.len() > PINNED_VERSIONS {
                    self.pinned.pop_front();
                }
            }
            None => tracing::warn!(
                version,
                "an evaluation started on a version no longer held; its checkpoint cannot be saved"
            ),
        }
    }
}
