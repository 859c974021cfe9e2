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
use std::time::{Duration, Instant};

use relay_kit::{counter, gauge, Service, ServiceError, Shutdown};
use relay_llm::{
    CausalLm, GgufBase, LoraAdapter, PeftBytes, RewardNormalizer, RlStats, RlTrainer, TokenExample,
    TrainError,
};
use relay_proto::{GameSampleReply, GameSampleRequest, SCHEMA_VERSION};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError};
use crate::evaluated::RunEvents;
use crate::examples::games_to_examples;
use crate::examples::Converted;
use crate::progress::{Metrics, Progress};
use crate::publish::{AdapterFiles, Publisher};
use relay_replicas::{Next, Replicas, Replicated, Turn, Undo};

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

/// The KL term's reference adapter (`None`: the base model): with a KL
/// term and `rl.kl_reference: start`, the adapter the run started from. A
/// warm start (`run.init_from`) is that adapter as loaded, before any
/// update; a resumed run takes its checkpoint's `reference/`, and measures
/// against the base model when there is none (the run began from a fresh
/// adapter, which is exactly the base).
fn kl_reference(
    train_config: &relay_llm::rl::RlTrainConfig,
    kind: relay_config::KlReference,
    start_from: Option<&checkpoint::StartFrom>,
    start: &LoraAdapter,
    model: &relay_llm::ModelConfig,
) -> Result<Option<LoraAdapter>, ServiceError> {
    if train_config.objective.kl.is_none() || kind == relay_config::KlReference::Base {
        return Ok(None);
    }
    let Some(from) = start_from else {
        return Ok(None);
    };
    if !from.resume {
        return start
            .deep_copy()
            .map(Some)
            .map_err(|e| from.error(format!("copying the adapter as the KL reference: {e}")));
    }
    let dir = from.dir.join(REFERENCE_DIR);
    if !dir.exists() {
        return Ok(None);
    }
    LoraAdapter::load_peft(&dir, model)
        .map(Some)
        .map_err(|e| from.error(format!("{REFERENCE_DIR}/: {e}")))
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
    let mut train_config = cfg
        .rl
        .train_config(cfg.text.max_turn_tokens as usize)
        .map_err(ServiceError::other)?;
    let lora_config = cfg.lora.lora_config().map_err(ServiceError::other)?;
    let started_loading = Instant::now();
    let spec = model_spec.clone();
    // The fused CPU ops (engine), or the composed forward on llm.device.
    let backend = relay_llm::Backend::open(&cfg.llm.backend_spec())
        .map_err(|e| ServiceError::Other(e.to_string()))?;
    let placed = backend.clone();
    let (model, model_path) = tokio::task::spawn_blocking(move || {
        // Training needs gradients through the base: GGUF weights dequantized.
        relay_llm::load_causal_lm_on(&spec, GgufBase::Dequantized, &placed)
    })
    .await
    .map_err(ServiceError::other)?
    .map_err(|e| ServiceError::Other(format!("llm.model: {e}")))?;
    if !model.supports_training() {
        return Err(ServiceError::Other(format!(
            "llm.model {model_spec}: this base cannot be trained through"
        )));
    }
    // Completions ending on one of these stopped by themselves.
    let eos_ids = model.config().eos_token_ids.clone();
    let context = model.config().max_position_embeddings + 1;
    if train_config.batch.max_seq_len > context {
        tracing::info!(
            max_seq_len = train_config.batch.max_seq_len,
            context,
            "rl.max_seq_len is longer than the model's context; using the context"
        );
        train_config.batch.max_seq_len = context;
    }
    let base_model = model_path.display().to_string();
    tracing::info!(model = %base_model, layers = model.config().num_hidden_layers, backend = %backend.describe(), seconds = started_loading.elapsed().as_secs_f64(), "base model loaded");

    let run_dir = cfg.run.runs_dir.join(cfg.run_id()?);
    let mut state = TextCheckpointState {
        progress: Progress::default(),
        moving_baselines: Default::default(),
        reward_normalizer: RewardNormalizer::default(),
        best_eval: None,
        weights_version: None,
    };
    let mut version_floor = 0u64;
    let mut resumed_at_vec_steps = 0u64;
    let start_from = checkpoint::StartFrom::of(&cfg);
    let adapter = match &start_from {
        Some(from) => LoraAdapter::load_peft(&from.dir.join(ADAPTER_DIR), model.config())
            .map_err(|e| from.error(e))?,
        None => LoraAdapter::new(model.config(), lora_config, cfg.lora.seed)
            .map_err(ServiceError::other)?,
    };
    // On the model's device: the optimizer trains these vars.
    let adapter = model.place_adapter(&adapter).map_err(ServiceError::other)?;
    let reference = kl_reference(
        &train_config,
        cfg.rl.kl_reference,
        start_from.as_ref(),
        &adapter,
        model.config(),
    )?;
    if train_config.objective.kl.is_some() {
        let against = if reference.is_some() {
            "the adapter the run started from"
        } else {
            "the base model"
        };
        tracing::info!(reference = against, "KL term towards {against}");
    }
    let mut trainer = RlTrainer::new(train_config, &adapter).map_err(ServiceError::other)?;
    if let Some(reference) = reference {
        let reference = model
            .place_frozen_adapter(&reference)
            .map_err(ServiceError::other)?;
        trainer
            .set_reference(Some(reference))
            .map_err(ServiceError::other)?;
    }
    if let Some(from) = &start_from {
        let dir = &from.dir;
        if !cfg.run.reset_optimizer {
            trainer
                .optimizer_mut()
                .load(&dir.join("optimizer.safetensors"))
                .map_err(|e| from.error(e))?;
        }
        if from.resume {
            state = load_state(dir).map_err(|e| from.error(e))?;
            trainer.set_moving_baselines(state.moving_baselines.clone());
            resumed_at_vec_steps = state.progress.vec_steps;
            state.progress.version = checkpoint::next_version(state.progress.version, &run_dir);
            version_floor = state.progress.version;
        }
        tracing::info!(from = %dir.display(), resume = from.resume, version = state.progress.version, updates = state.progress.updates, "loaded checkpoint");
    }
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
    let batch_size = cfg.rl.batch_size;
    // The games this run trains on (`text.games`, else `run.env_id`).
    let run_games: Vec<String> = cfg
        .text
        .game_weights(&cfg.run.env_id)
        .into_iter()
        .map(|(game, _)| game)
        .collect();
    let mut pending = crate::examples::PendingGames::default();
    let mut dropped_stale = 0u64;
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
                None => {
                    // Games played by versions too old for this update go.
                    let oldest_ok = lag.oldest_fresh(work.state.progress.version);
                    dropped_stale += pending.drop_stale(oldest_ok) as u64;
                    let held = pending.ready_turns();
                    if held < batch_size {
                        let ask = GameSampleRequest {
                            schema: SCHEMA_VERSION,
                            min_policy_version: oldest_ok,
                            max_turns: (batch_size - held) as u32,
                        };
                        match relay_kit::request::<_, GameSampleReply>(
                            &service.nats,
                            &service.subjects.replay_games_sample(),
                            &ask,
                            service.request_timeout(),
                        )
                        .await
                        {
                            Ok(reply) => {
                                dropped_stale += reply.dropped_stale;
                                if reply.games.is_empty() {
                                    crate::progress::pause(&shutdown, Duration::from_millis(20))
                                        .await;
                                }
                                for game in reply.games {
                                    if !run_games.contains(&game.env_id) {
                                        service.intake.reject(
                                            "replay.games.sample",
                                            &relay_proto::Rejection::Invalid {
                                                kind: "GameRecord",
                                                field: "env_id",
                                                detail: format!(
                                                    "game from {} is of {}, this run plays {}",
                                                    game.runner_id,
                                                    game.env_id,
                                                    run_games.join(", ")
                                                ),
                                            },
                                        );
                                        continue;
                                    }
                                    if !pending.push(game) {
                                        dropped_stale += 1;
                                    }
                                }
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "game sample failed; retrying");
                                crate::progress::pause(&shutdown, Duration::from_millis(50)).await;
                            }
                        }
                        continue;
                    }

                    let games = pending.take_batch(batch_size);
                    for game in &games {
                        metrics.policy_lag.observe(
                            work.state
                                .progress
                                .version
                                .saturating_sub(game.learning_version().unwrap_or(0))
                                as f64,
                        );
                    }
                    let mut converted = games_to_examples(
                        &games,
                        &cfg.rl.reward,
                        &mut work.state.reward_normalizer,
                    );
                    let mut examples: Vec<TokenExample> = std::mem::take(&mut converted.examples);
                    if converted.skipped_moves > 0 {
                        tracing::warn!(
                            skipped = converted.skipped_moves,
                            "moves without usable tokens left out"
                        );
                    }
                    // A single game longer than the batch is cut to it.
                    examples.truncate(batch_size);
                    if examples.is_empty() {
                        continue;
                    }
                    TextStep {
                        updates: work.state.progress.updates,
                        examples,
                        games: games.len() as u64,
                        reward_normalizer: work.state.reward_normalizer.clone(),
                        best_eval: work.state.best_eval,
                        converted: Some(converted),
                    }
                }
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
        let first: RlStats = steps[0];
        let mean = |f: fn(&RlStats) -> f64| steps.iter().map(f).sum::<f64>() / steps.len() as f64;
        let trained_tokens: usize = steps
            .iter()
            .map(|s| (s.mean_seq_len * s.sequences as f64) as usize)
            .sum();
        truncated_total += first.truncated;
        tokens_cut_total += first.tokens_cut;

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
        let reward_mean = if converted.game_rewards.is_empty() {
            0.0
        } else {
            converted.game_rewards.iter().sum::<f64>() / converted.game_rewards.len() as f64
        };
        service
            .report(
                Some(progress.vec_steps),
                crate::progress::report_gauges(progress, budget, sps, resumed_at_vec_steps)
                    .into_iter()
                    .chain([
                        gauge("learner_adapter_version", progress.version as f64),
                        gauge("learner_loss", mean(|s| s.loss)),
                        gauge("learner_policy_loss", mean(|s| s.policy_loss)),
                        gauge("learner_kl_ref", mean(|s| s.kl)),
                        gauge("learner_entropy", mean(|s| s.entropy)),
                        gauge("learner_grad_norm", mean(|s| s.grad_norm)),
                        gauge(
                            "learner_learning_rate",
                            work.trainer.optimizer().config().lr,
                        ),
                        gauge("learner_reward_mean", reward_mean),
                        gauge("learner_shaped_reward_mean", first.reward_mean),
                        gauge("learner_advantage_std", first.advantage_std),
                        gauge("learner_mean_seq_len", first.mean_seq_len),
                        gauge("learner_completion_len", first.mean_completion_len),
                        gauge("learner_kl_penalty", first.kl_penalty),
                        // score minus the KL penalty, TRL's rlhf_reward
                        gauge("learner_rlhf_reward", first.reward_mean - first.kl_penalty),
                        gauge("learner_ratio_mean", mean(|s| s.ratio_mean)),
                        gauge("learner_ratio_var", mean(|s| s.ratio_var)),
                        gauge(
                            "learner_sampler_logprob_diff_mean",
                            first.sampler_logprob_diff_mean,
                        ),
                        gauge(
                            "learner_sampler_logprob_diff_max",
                            first.sampler_logprob_diff_max,
                        ),
                        gauge(
                            "learner_tis_capped_fraction",
                            mean(|s| s.tis_capped_fraction),
                        ),
                        gauge("learner_eos_rate", eos_rate(&examples, &eos_ids)),
                        gauge(
                            "learner_format_rate",
                            rate(converted.well_formatted_moves, converted.moves),
                        ),
                        gauge(
                            "learner_legal_move_rate",
                            1.0 - rate(converted.invalid_moves, converted.moves),
                        ),
                        gauge("learner_sequences", first.sequences as f64),
                        gauge(
                            "learner_tokens_per_second",
                            trained_tokens as f64 / seconds.max(1e-9),
                        ),
                        counter(
                            "learner_truncated_sequences_total",
                            (truncated_total - reported.1) as f64,
                        ),
                        counter(
                            "learner_tokens_cut_total",
                            (tokens_cut_total - reported.2) as f64,
                        ),
                        gauge("learner_last_update_seconds", seconds),
                        counter(
                            "learner_dropped_stale_games_total",
                            (dropped_stale - reported.0) as f64,
                        ),
                    ])
                    .chain(replica_values)
                    // PPO's movement measures, once an update takes several
                    // steps on its batch (in one step the policy is measured
                    // before it moves, so they only show the sampler's
                    // mismatch, reported apart).
                    .chain(
                        (steps.len() > 1)
                            .then(|| {
                                let between = &steps[1..];
                                [
                                    gauge("learner_approx_kl", mean(|s| s.approx_kl)),
                                    gauge("learner_clip_fraction", mean(|s| s.clip_fraction)),
                                    gauge(
                                        "learner_epoch_kl",
                                        between.iter().map(|s| s.epoch_kl).sum::<f64>()
                                            / between.len() as f64,
                                    ),
                                ]
                            })
                            .into_iter()
                            .flatten(),
                    )
                    .chain(converted.per_game.iter().flat_map(|(game, f)| {
                        [
                            gauge("learner_game_reward_mean", f.reward_mean()),
                            gauge("learner_game_legal_move_rate", f.legal_move_rate()),
                            counter("learner_game_examples_total", f.examples as f64),
                        ]
                        .map(|v| v.with_label("game", game))
                    }))
                    .collect(),
            )
            .await;
        reported = (dropped_stale, truncated_total, tokens_cut_total);
        tracing::debug!(
            version = work.state.progress.version,
            loss = first.loss,
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

/// One update as rank 0 hands it to the other replicas: update number
/// `updates` (the count before it) on `examples`, made of `games` games.
#[derive(Serialize, Deserialize)]
struct TextStep {
    updates: u64,
    examples: Vec<TokenExample>,
    games: u64,
    /// The reward statistics after the batch's games, and rank 0's best
    /// evaluation so far, for whoever leads next.
    reward_normalizer: RewardNormalizer,
    best_eval: Option<(f64, u64)>,
    /// What the games became (rank 0's report); not handed out.
    #[serde(skip)]
    converted: Option<Converted>,
}

/// A text learner's whole state, in memory: what rank 0 hands to every
/// replica of a new view, and the rollback point of an update (a
/// replicated step that failed, or one a stop cut short).
#[derive(Serialize, Deserialize)]
struct TextReplicaState {
    adapter: Vec<relay_nn::NamedTensor>,
    /// AdamW's moments and steps ([`relay_llm::AdamW::state_bytes`]).
    optimizer: Vec<u8>,
    moving_baselines: relay_llm::MovingBaselines,
    state: TextCheckpointState,
    version_floor: u64,
}

/// What the replicas hold alike and train together: the adapter (over
/// the frozen base), AdamW and the run's counters.
struct TextTraining<'m> {
    model: &'m CausalLm,
    adapter: &'m LoraAdapter,
    trainer: RlTrainer,
    state: TextCheckpointState,
    /// The oldest version whose games belong to this learner's timeline.
    version_floor: u64,
    /// Passes over each batch (`rl.epochs`).
    epochs: usize,
}

impl Replicated for TextTraining<'_> {
    type State = TextReplicaState;
    type Step = TextStep;
    type Output = Vec<RlStats>;
    type Error = TrainError;
    // An update of an LLM's micro-batches takes seconds to minutes; a
    // failed batch may leave earlier epochs applied.
    const STOPS_PART_WAY: bool = true;
    const UNDO: Undo = Undo::Snapshot;

    fn capture(&self) -> Result<TextReplicaState, String> {
        Ok(TextReplicaState {
            adapter: adapter_values(self.adapter),
            optimizer: self
                .trainer
                .optimizer()
                .state_bytes()
                .map_err(|e| e.to_string())?,
            moving_baselines: self.trainer.moving_baselines().clone(),
            state: self.state.clone(),
            version_floor: self.version_floor,
        })
    }

    /// The adapter's names and shapes must match.
    fn restore(&mut self, held: TextReplicaState) -> Result<(), String> {
        self.trainer
            .optimizer_mut()
            .restore_bytes(&held.optimizer, "rank 0's optimizer state")
            .map_err(|e| e.to_string())?;
        relay_llm::sft::set_var_values(&self.adapter.named_vars(), &held.adapter)
            .map_err(|e| format!("adapter: {e}"))?;
        self.trainer.set_moving_baselines(held.moving_baselines);
        self.state = held.state;
        self.version_floor = held.version_floor;
        Ok(())
    }

    fn took_over(&mut self) {
        // The old rank 0 may have published one version past what this
        // replica holds: skip it.
        self.state.progress.version += 2;
    }

    fn describe(step: &TextStep) -> String {
        step.updates.to_string()
    }

    fn is_next(&self, step: &TextStep) -> bool {
        step.updates == self.state.progress.updates
    }

    fn run(
        &mut self,
        step: &TextStep,
        share: &mut relay_nn::BatchShare<'_>,
    ) -> Result<Vec<RlStats>, TrainError> {
        tracing::debug!(
            step = step.updates,
            examples = step.examples.len(),
            "update starts"
        );
        self.trainer
            .train_epochs_part(self.model, self.adapter, &step.examples, self.epochs, share)
    }

    fn stopped(error: &TrainError) -> bool {
        matches!(error, TrainError::Stopped)
    }
}

/// The adapter's trained values; reading a var back from its own device
/// fails only with the device itself.
fn adapter_values(adapter: &LoraAdapter) -> Vec<relay_nn::NamedTensor> {
    adapter.named_values().expect("an adapter's vars read back")
}

/// Loads a checkpoint's adapter for a model (what `relay_llm` users do
/// with a text run's checkpoint).
pub fn load_checkpoint_adapter(
    dir: &Path,
    model: &CausalLm,
) -> Result<LoraAdapter, relay_llm::ModelError> {
    LoraAdapter::load_peft(&dir.join(ADAPTER_DIR), model.config())
}

/// `part / whole`, 0 when `whole` is 0.
fn rate(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Share of completions that end on an end-of-sequence token (the policy
/// stopped by itself rather than at `text.max_turn_tokens`).
fn eos_rate(examples: &[TokenExample], eos_ids: &[u32]) -> f64 {
    let ended = examples
        .iter()
        .filter(|e| e.completion.last().is_some_and(|t| eos_ids.contains(t)))
        .count();
    rate(ended, examples.len())
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
