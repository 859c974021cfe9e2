//! Text runs (`run.env_id` a text game): the learner trains the LoRA
//! adapter `policy` over the base model `llm.model` with an RL objective
//! (`rl`, [`relay_llm::rl`]) on the games the env-runners played.
//!
//! Its loop: take whole games from the replay buffer
//! (`replay.games.sample`, oldest first, none played by an adapter more
//! than `replay.max_policy_lag` versions old) until `rl.batch_size`
//! learning moves are gathered (a game that would pass it waits for the
//! next batch; the continuations of a branched position wait for each
//! other and go together: [`crate::examples::PendingGames`]), turn them
//! into training sequences ([`crate::examples`]),
//! take `rl.epochs` optimizer steps, publish the adapter as version + 1
//! (an [`AdapterUpdate`] on `adapters`, its weights through the one
//! weights transport, `relay_kit::weights`: inline up to
//! `weights.inline_max_bytes`, else from this learner's direct transfer
//! server or the object store; [`crate::publish`] owns publishing), report
//! metrics, and checkpoint every
//! `rl.checkpoint_every` updates. The newest version is also answered on
//! `adapters.latest`, for inference servers and evaluators that start
//! later. Version 0 (the fresh adapter, `B = 0`: exactly the base model)
//! is published at start, so the env-runners' first games have an adapter
//! to ask for.
//!
//! A stop in the middle of an update (tens of seconds for SmolLM2-135M on
//! CPU) ends it between two blocks of a forward or backward pass
//! (the replica driver's stop check tells [`RlTrainer::train_epochs_part`]), and the adapter,
//! AdamW's moments and the moving baselines taken before the update are
//! put back: nothing of it is published, and the final checkpoint holds
//! the last whole update, as if the stop had come between two.
//!
//! With the self-play league on (`text.opponents.league`), every version
//! is also kept in the run's league bucket (`relay-<run>-league`,
//! `policy/v<N>`, even when it is sent inline: [`crate::league`]) so
//! inference servers can serve it as a past opponent
//! long after they heard it, and is admitted to the league pool before it
//! is announced (inheriting the newest version's rating, sigma widened).
//! The learner is the one that deletes the stored versions the pool no
//! longer holds: it is the only writer of versions (one per run), so
//! evictions (which happen when a version is admitted) happen here, and
//! no two env-runners race to delete the same objects. Each pruning
//! compares the bucket with the pool, so objects left by a crash or
//! evicted elsewhere go too.
//!
//! Multi-game runs (`text.games`): games of every listed game are taken
//! (a game of any other is refused, counted as a rejected message), their
//! rewards are normalised per game when `rl.reward.normalize` is set, no
//! group mixes games ([`crate::examples`]), and the mean game reward,
//! legal-move rate and examples of each game are reported with a `game`
//! label (`learner_game_*`).
//!
//! Counters: one env step is one learning move trained on (what text-mode
//! env-runners report as env steps), so `run.total_env_steps` is the
//! budget in moves; `episodes` counts games.
//!
//! Resume and `init_from` work as for the classic learner: the adapter
//! (`adapter/`, PEFT), the optimizer (unless `run.reset_optimizer`), and
//! with resume the counters, the moving-average baseline and the reward
//! normaliser come from the checkpoint; versions continue above every
//! version published before.

use std::path::Path;
use std::time::Instant;

use relay_kit::{Service, ServiceError, Shutdown};
use relay_llm::{CausalLm, LoraAdapter, PeftBytes, RewardNormalizer, RlTrainer};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError};
use crate::evaluated::RunEvents;
use crate::progress::{Metrics, Progress};
use crate::publish::{AdapterFiles, Publisher};

mod games;
mod replica;
mod report;
mod start;

use games::Games;
use relay_replicas::{Next, Replicas, Turn};
use replica::{adapter_values, TextStep, TextTraining};
use report::Report;
#[cfg(test)]
use start::kl_reference;
use start::{start, Start};

/// Publishes the adapter's versions ([`crate::publish`]).
type AdapterPublisher = Publisher<AdapterFiles>;

/// Name of the adapter this learner trains (the one env-runners seat).
pub const ADAPTER_NAME: &str = relay_policy::text::LEARNING_ADAPTER;

/// Folders of the PEFT adapter and of the KL reference inside a checkpoint.
pub use relay_runs::checkpoint::{ADAPTER_DIR, REFERENCE_DIR};

/// Everything of a text learner's state that is not a tensor (`state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextCheckpointState {
    #[serde(flatten)]
    pub progress: Progress,
    /// The REINFORCE moving-average baselines by stratum (seat), when that
    /// objective keeps them.
    #[serde(default)]
    pub moving_baselines: relay_llm::MovingBaselines,
    /// Running reward statistics of `rl.reward.normalize`.
    #[serde(default)]
    pub reward_normalizer: RewardNormalizer,
    /// Best eval figure heard so far (the confirmation's mean when there is
    /// one) and the version it evaluated.
    #[serde(default)]
    pub best_eval: Option<(f64, u64)>,
    /// The adapter version `adapter/` holds: `progress.version`, or an
    /// earlier version an evaluation played (`best`, `solved`). Absent in
    /// checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_version: Option<u64>,
}

/// Writes a text checkpoint linked as `links` (see [`crate::checkpoint`]);
/// with `evaluated`, `adapter/` holds those files (a published version's,
/// byte for byte) instead of the current adapter.
#[allow(clippy::too_many_arguments)]
pub fn save_checkpoint(
    run_dir: &Path,
    adapter: &LoraAdapter,
    trainer: &RlTrainer,
    state: &TextCheckpointState,
    config: &relay_config::ExperimentConfig,
    base_model: &str,
    links: &[&str],
    evaluated: Option<&PeftBytes>,
) -> Result<std::path::PathBuf, CheckpointError> {
    checkpoint::write(
        run_dir,
        state.progress.updates,
        config,
        config.rl.keep_checkpoints,
        links,
        |tmp| {
            let dir = tmp.join(ADAPTER_DIR);
            match evaluated {
                Some(files) => files.save(&dir),
                None => adapter.save_peft(&dir, Some(base_model)),
            }
            .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            if let Some(reference) = trainer.reference() {
                reference
                    .save_peft(&tmp.join(REFERENCE_DIR), Some(base_model))
                    .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            }
            trainer
                .optimizer()
                .save(&tmp.join("optimizer.safetensors"))
                .map_err(|e| CheckpointError::Tensors(e.to_string()))?;
            checkpoint::write_json(&tmp.join("state.json"), state)
        },
    )
}

/// Reads a text checkpoint's `state.json`.
pub fn load_state(dir: &Path) -> Result<TextCheckpointState, CheckpointError> {
    checkpoint::read_json(&dir.join("state.json"))
}

/// Runs the text learner until shutdown.
pub(crate) async fn run(
    service: Service,
    shutdown: Shutdown,
    metrics: Metrics,
) -> Result<(), ServiceError> {
    let cfg = service.config.clone();
    if let Some(bot) = cfg.text.learner_bot() {
        // A baseline run: the learning side is a bot, there is nothing to train.
        tracing::info!(
            bot,
            "text.learner is a bot; the learner has nothing to train"
        );
        service.health.set_ready(true);
        shutdown.wait().await;
        return service.finish().await;
    }
    let Some(model_spec) = cfg.llm.model.clone() else {
        return Err(ServiceError::Other(format!(
            "llm.model: not set, but run.env_id {} is a text game: give the base model the inference servers serve",
            cfg.run.env_id
        )));
    };
    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let start_from = checkpoint::StartFrom::of(&cfg);
    let Start {
        model,
        base_model,
        eos_ids,
        adapter,
        trainer,
        state,
        version_floor,
        resumed_at_vec_steps,
    } = start(&cfg, model_spec, &run_dir, start_from.as_ref()).await?;
    crate::progress::count_resume(&service, &start_from);

    let micro = service.micro().await?;
    let mut replicas = Replicas::join(&service).await?;
    // Rank 0 alone publishes and takes the run's events (a replica that
    // takes over starts then).
    let mut leading: Option<(AdapterPublisher, RunEvents<PeftBytes>)> = None;
    service.health.set_ready(true);
    tracing::info!(
        env_id = %cfg.run.env_id,
        adapter_params = adapter.vars().iter().map(|v| v.elem_count()).sum::<usize>(),
        objective = %cfg.rl.preset,
        "training starts"
    );

    // A checkpoint of the state as it is now, linked as `links`; with
    // `evaluated` (a version and its files as published) holding that
    // version's adapter.
    let checkpoint = |state: &TextCheckpointState,
                      trainer: &RlTrainer,
                      links: &[&str],
                      evaluated: Option<(u64, &PeftBytes)>| {
        let state = TextCheckpointState {
            moving_baselines: trainer.moving_baselines().clone(),
            weights_version: Some(evaluated.map_or(state.progress.version, |(v, _)| v)),
            ..state.clone()
        };
        checkpoint::log_written(
            save_checkpoint(
                &run_dir,
                &adapter,
                trainer,
                &state,
                &cfg,
                &base_model,
                links,
                evaluated.map(|(_, files)| files),
            ),
            state.weights_version.unwrap_or(state.progress.version),
            links,
        );
    };
    // The checkpoints the run's evaluations ask for (best, solved).
    let checkpoint_evaluations = |events: &mut RunEvents<PeftBytes>,
                                  state: &mut TextCheckpointState,
                                  trainer: &RlTrainer| {
        let saves = events.poll(&service);
        state.best_eval = events.best_eval;
        for save in saves {
            checkpoint(
                state,
                trainer,
                &save.links,
                Some((save.version, &save.weights)),
            );
        }
    };

    let budget = cfg.run.total_env_steps;
    let mut intake = Games::new(&cfg);
    let mut reported = (0u64, 0usize, 0usize);
    let (mut truncated_total, mut tokens_cut_total) = (0usize, 0usize);
    let started = Instant::now();
    let start_env_steps = state.progress.env_steps;
    // The step handed out and not yet applied: kept across a failed step
    // so that the replicas redo it in the next view.
    let mut work = TextTraining {
        model: &model,
        adapter: &adapter,
        trainer,
        state,
        version_floor,
        epochs: cfg.rl.epochs,
    };
    let mut held: Option<TextStep> = None;
    let finish = loop {
        // A new view: rank 0's state goes to every replica.
        match replicas.sync_view(&mut work, &shutdown).await? {
            Next::Go(true) => metrics.version.set(work.state.progress.version as i64),
            Next::Go(false) => {}
            Next::Retry => continue,
            Next::Stop => break crate::progress::Finish::Shutdown,
        }
        if replicas.leads() && leading.is_none() {
            let publisher = AdapterPublisher::serve(&service, &micro, &run_dir).await?;
            let mut events: RunEvents<PeftBytes> =
                RunEvents::subscribe(&service, work.state.best_eval).await?;
            if let Some(files) = publisher
                .publish_adapter(
                    &service,
                    &work.state.progress,
                    &adapter,
                    &base_model,
                    &events.versions_under_evaluation(),
                )
                .await
            {
                events.record(work.state.progress.version, files);
            }
            metrics.version.set(work.state.progress.version as i64);
            leading = Some((publisher, events));
        }
        let lag = relay_proto::PolicyLag {
            max_lag: cfg.replay.max_policy_lag,
            floor: work.version_floor,
        };

        let input = if let Some((_, events)) = leading.as_mut() {
            if let Some(finish) = crate::progress::should_finish(
                &shutdown,
                work.state.progress.env_steps,
                budget,
                &events.solved,
                cfg.run.stop_when_solved,
            ) {
                replicas.announce_stop().await;
                break finish;
            }
            checkpoint_evaluations(events, &mut work.state, &work.trainer);
            Some(match held.take() {
                // A step that failed in the previous view is redone.
                Some(input) => input,
                None => match intake
                    .next_step(&service, &shutdown, &metrics, &cfg, &mut work.state, &lag)
                    .await
                {
                    Some(step) => step,
                    None => continue,
                },
            })
        } else {
            // A follower: the step barrier waits for rank 0's step.
            None
        };
        let update_started = Instant::now();
        let (input, steps) = match replicas
            .run_step(&mut work, input, &mut held, &shutdown)
            .await?
        {
            Turn::Done { step, output } => (step, output),
            Turn::Failed { step, error } => {
                // Bad data must not stop training: drop this batch (and
                // whatever of it was applied) and go on.
                tracing::error!(error = %error, games = step.games, "update failed; batch dropped");
                continue;
            }
            Turn::Again => continue,
            Turn::Stop => break crate::progress::Finish::Shutdown,
        };
        let TextStep {
            examples,
            games,
            reward_normalizer,
            best_eval,
            converted,
            ..
        } = input;
        if leading.is_none() {
            (work.state.reward_normalizer, work.state.best_eval) = (reward_normalizer, best_eval);
        }
        let seconds = update_started.elapsed().as_secs_f64();
        truncated_total += steps[0].truncated;
        tokens_cut_total += steps[0].tokens_cut;

        let progress = &mut work.state.progress;
        progress.updates += 1;
        progress.version += 1;
        progress.env_steps += examples.len() as u64;
        progress.vec_steps += examples.len() as u64;
        progress.episodes += games;
        metrics.version.set(progress.version as i64);
        let replica_values = replicas.gauges(progress.updates);
        let updates = progress.updates;
        replicas
            .check_parameters(updates, || adapter_values(&adapter))
            .await?;
        let progress = &mut work.state.progress;
        let Some((publisher, events)) = leading.as_mut() else {
            tracing::debug!(version = progress.version, seconds, "update");
            service
                .report(Some(progress.vec_steps), replica_values)
                .await;
            continue;
        };
        if let Some(files) = publisher
            .publish_adapter(
                &service,
                progress,
                &adapter,
                &base_model,
                &events.versions_under_evaluation(),
            )
            .await
        {
            events.record(progress.version, files);
        }
        // A step redone after a failed view that rank 0 did not draw
        // carries no figures of its games.
        let converted = converted.unwrap_or_default();
        metrics.update_seconds.observe(seconds);
        let sps = progress.env_steps.saturating_sub(start_env_steps) as f64
            / started.elapsed().as_secs_f64().max(1e-3);
        let report = Report {
            steps: &steps,
            converted: &converted,
            examples: &examples,
            eos_ids: &eos_ids,
            seconds,
            learning_rate: work.trainer.optimizer().config().lr,
        };
        let reward_mean = report.reward_mean();
        service
            .report(
                Some(progress.vec_steps),
                crate::progress::report_gauges(progress, budget, sps, resumed_at_vec_steps)
                    .into_iter()
                    .chain(report.values(
                        progress.version,
                        [
                            intake.dropped_stale - reported.0,
                            (truncated_total - reported.1) as u64,
                            (tokens_cut_total - reported.2) as u64,
                        ],
                    ))
                    .chain(replica_values)
                    .collect(),
            )
            .await;
        reported = (intake.dropped_stale, truncated_total, tokens_cut_total);
        tracing::debug!(
            version = work.state.progress.version,
            loss = steps[0].loss,
            reward_mean,
            seconds,
            "update"
        );
        if work
            .state
            .progress
            .updates
            .is_multiple_of(cfg.rl.checkpoint_every)
        {
            checkpoint(
                &work.state,
                &work.trainer,
                crate::progress::LINKS_LAST,
                None,
            );
        }
    };
    replicas.leave().await;
    let Some((_publisher, mut events)) = leading else {
        // A follower: rank 0 finishes the run; this replica waits for shutdown.
        shutdown.wait().await;
        let _ = micro.stop().await;
        return service.finish().await;
    };

    // Reports that arrived as training stopped, then the last checkpoint.
    checkpoint_evaluations(&mut events, &mut work.state, &work.trainer);
    match crate::publish::final_weights(&cfg, &events) {
        Some((version, files)) => checkpoint(
            &work.state,
            &work.trainer,
            crate::progress::LINKS_LAST_SOLVED,
            Some((version, &files)),
        ),
        None => checkpoint(
            &work.state,
            &work.trainer,
            crate::progress::LINKS_LAST,
            None,
        ),
    }
    crate::progress::finish_run(
        &service,
        &shutdown,
        micro,
        &finish,
        format!("{budget} env steps (learning moves)"),
        work.state.progress.version,
        work.state.progress.env_steps,
        || checkpoint_evaluations(&mut events, &mut work.state, &work.trainer),
    )
    .await
}

/// Loads a checkpoint's adapter for a model (what `relay_llm` users do
/// with a text run's checkpoint).
pub fn load_checkpoint_adapter(
    dir: &Path,
    model: &CausalLm,
) -> Result<LoraAdapter, relay_llm::ModelError> {
    LoraAdapter::load_peft(&dir.join(ADAPTER_DIR), model.config())
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_config::ExperimentConfig;
    use relay_llm::{init, LoraConfig, TinyVocab};
    use relay_testkit::TempDir;

    fn factors(adapter: &LoraAdapter) -> Vec<Vec<f32>> {
        adapter
            .vars()
            .iter()
            .map(|v| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    }

    #[test]
    fn the_kl_reference_is_the_warm_start_and_survives_a_resume() {
        let dir = TempDir::new("kl-reference");
        let vocab = TinyVocab {
            size: 32,
            bos_token_id: None,
            eos_token_id: Some(2),
            pad_token_id: Some(0),
        };
        let model = init::tiny(&dir.path().join("model"), 1, &vocab).unwrap();
        // A warm start away from the base: B factors set to ones.
        let warm = LoraAdapter::new(&model, LoraConfig::all_projections(2, 4.0), 3).unwrap();
        for (name, var) in warm.named_vars() {
            if name.contains("lora_B") {
                var.set(&var.as_tensor().ones_like().unwrap()).unwrap();
            }
        }
        let init_dir = dir.path().join("sft");
        warm.save_peft(&init_dir.join(ADAPTER_DIR), None).unwrap();
        let config = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            ExperimentConfig::from_layers(
                "run:\n  env_id: TicTacToe-v0\nrl:\n  preset: dr_grpo\n",
                "test",
                &[],
                &sets,
            )
            .unwrap()
        };
        let reference_of = |cfg: &ExperimentConfig, from: Option<&checkpoint::StartFrom>| {
            let train = cfg
                .rl
                .train_config(cfg.text.max_turn_tokens as usize)
                .unwrap();
            kl_reference(&train, cfg.rl.kl_reference, from, &warm, &model).unwrap()
        };
        let init = checkpoint::StartFrom {
            dir: init_dir.clone(),
            resume: false,
        };
        let kl = "rl.kl={coef: 0.05, estimator: k3, mode: loss}";
        // With a KL term, a warm start is its own reference (a copy).
        let reference = reference_of(&config(&[kl]), Some(&init)).expect("a reference");
        assert_eq!(factors(&reference), factors(&warm));
        // Without a KL term, with `base`, or from a fresh adapter: the base.
        assert!(reference_of(&config(&[]), Some(&init)).is_none());
        assert!(reference_of(&config(&[kl, "rl.kl_reference=base"]), Some(&init)).is_none());
        assert!(reference_of(&config(&[kl]), None).is_none());
        // A resumed run reads `reference/` from its checkpoint, and none
        // there means it began at the base.
        let resumed_dir = dir.path().join("checkpoint");
        let resume = checkpoint::StartFrom {
            dir: resumed_dir.clone(),
            resume: true,
        };
        assert!(reference_of(&config(&[kl]), Some(&resume)).is_none());
        let earlier = LoraAdapter::new(&model, LoraConfig::all_projections(2, 4.0), 9).unwrap();
        earlier
            .save_peft(&resumed_dir.join(REFERENCE_DIR), None)
            .unwrap();
        let reloaded = reference_of(&config(&[kl]), Some(&resume)).expect("the saved reference");
        assert_eq!(factors(&reloaded), factors(&earlier));

        // Checkpoints carry the reference, and only when there is one.
        let cfg = config(&[kl]);
        let train = cfg
            .rl
            .train_config(cfg.text.max_turn_tokens as usize)
            .unwrap();
        let mut trainer = RlTrainer::new(train, &warm).unwrap();
        let run_dir = dir.path().join("run");
        let state = TextCheckpointState {
            progress: Progress::default(),
            moving_baselines: Default::default(),
            reward_normalizer: RewardNormalizer::default(),
            best_eval: None,
            weights_version: None,
        };
        let save = |trainer: &RlTrainer| {
            save_checkpoint(&run_dir, &warm, trainer, &state, &cfg, "m", &["last"], None).unwrap()
        };
        assert!(!save(&trainer).join(REFERENCE_DIR).exists());
        trainer.set_reference(Some(reference)).unwrap();
        let saved = save(&trainer);
        let saved = LoraAdapter::load_peft(&saved.join(REFERENCE_DIR), &model).unwrap();
        assert_eq!(factors(&saved), factors(&warm));
    }
}
