//! Rank 0's intake of finished games ([`Games`]): whole games from the
//! replay buffer's game table (oldest first, none played by an adapter
//! more than `replay.max_policy_lag` versions old), checked against the
//! run's games and held until `rl.batch_size` learning moves are ready,
//! then turned into one update's training sequences.

use std::time::Duration;

use relay_config::ExperimentConfig;
use relay_kit::{Service, Shutdown};
use relay_llm::TokenExample;
use relay_proto::{GameSampleReply, GameSampleRequest, PolicyLag, SCHEMA_VERSION};

use super::replica::TextStep;
use super::TextCheckpointState;
use crate::examples::{games_to_examples, PendingGames};
use crate::progress::Metrics;

/// The games taken and not yet trained on, and the counts reported.
pub(super) struct Games {
    pending: PendingGames,
    /// Games dropped as too old (by the replay buffer or here).
    pub(super) dropped_stale: u64,
    /// The games this run trains on (`text.games`, else `run.env_id`).
    run_games: Vec<String>,
    /// Learning moves per update (`rl.batch_size`).
    batch_size: usize,
}

impl Games {
    pub(super) fn new(cfg: &ExperimentConfig) -> Self {
        Self {
            pending: PendingGames::default(),
            dropped_stale: 0,
            run_games: cfg
                .text
                .game_weights(&cfg.run.env_id)
                .into_iter()
                .map(|(game, _)| game)
                .collect(),
            batch_size: cfg.rl.batch_size,
        }
    }

    /// The next update's step from the games held, or `None` when more
    /// must come first (asked for here, waiting a moment when none came).
    pub(super) async fn next_step(
        &mut self,
        service: &Service,
        shutdown: &Shutdown,
        metrics: &Metrics,
        cfg: &ExperimentConfig,
        state: &mut TextCheckpointState,
        lag: &PolicyLag,
    ) -> Option<TextStep> {
        // Games played by versions too old for this update go.
        let oldest_ok = lag.oldest_fresh(state.progress.version);
        self.dropped_stale += self.pending.drop_stale(oldest_ok) as u64;
        let held = self.pending.ready_turns();
        if held < self.batch_size {
            let ask = GameSampleRequest {
                schema: SCHEMA_VERSION,
                min_policy_version: oldest_ok,
                max_turns: (self.batch_size - held) as u32,
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
                    self.dropped_stale += reply.dropped_stale;
                    if reply.games.is_empty() {
                        crate::progress::pause(shutdown, Duration::from_millis(20)).await;
                    }
                    for game in reply.games {
                        if !self.run_games.contains(&game.env_id) {
                            service.intake.reject(
                                "replay.games.sample",
                                &relay_proto::Rejection::Invalid {
                                    kind: "GameRecord",
                                    field: "env_id",
                                    detail: format!(
                                        "game from {} is of {}, this run plays {}",
                                        game.runner_id,
                                        game.env_id,
                                        self.run_games.join(", ")
                                    ),
                                },
                            );
                            return None;
                        }
                        if !self.pending.push(game) {
                            self.dropped_stale += 1;
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "game sample failed; retrying");
                    crate::progress::pause(shutdown, Duration::from_millis(50)).await;
                }
            }
            return None;
        }

        let games = self.pending.take_batch(self.batch_size);
        for game in &games {
            metrics.policy_lag.observe(
                state
                    .progress
                    .version
                    .saturating_sub(game.learning_version().unwrap_or(0)) as f64,
            );
        }
        let mut converted = games_to_examples(&games, &cfg.rl.reward, &mut state.reward_normalizer);
        let mut examples: Vec<TokenExample> = std::mem::take(&mut converted.examples);
        if converted.skipped_moves > 0 {
            tracing::warn!(
                skipped = converted.skipped_moves,
                "moves without usable tokens left out"
            );
        }
        // A single game longer than the batch is cut to it.
        examples.truncate(self.batch_size);
        if examples.is_empty() {
            return None;
        }
        Some(TextStep {
            updates: state.progress.updates,
            examples,
            games: games.len() as u64,
            reward_normalizer: state.reward_normalizer.clone(),
            best_eval: state.best_eval,
            converted: Some(converted),
        })
    }
}
