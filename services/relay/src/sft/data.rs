//! Where `relay sft`'s examples come from: games that fixed bots play
//! against each other ([`bot_game_records`]) or a JSONL file, encoded as
//! the env-runners prompt the policy and split into training and
//! held-out examples.

use anyhow::{bail, Context, Result};
use relay_bridge::EnvSection;
use relay_envs::ObservationView;
use relay_llm::sft::SftRecord;

/// Plays one move sequence per game between `bots` (one per seat) and
/// returns every move as an (observation rendered as `view`, move written
/// in `answer`'s format) pair.
pub fn bot_game_records(
    env: &str,
    section: &EnvSection,
    bots: &[String],
    games: usize,
    seed: u64,
    view: ObservationView,
    answer: &relay_envs::AnswerFormat,
) -> Result<Vec<SftRecord>> {
    let write = |action: &str| {
        answer.write(action).with_context(|| {
            format!("the answer format {answer:?} is a pattern to read answers by, not a way to write the bots' moves; give --data")
        })
    };
    let mut records = Vec::new();
    for game_index in 0..games {
        let game_seed = seed.wrapping_add(game_index as u64);
        let mut game = relay_bridge::make_text_game(env, section)?;
        if bots.len() != game.num_players() {
            bail!(
                "--bots: {env} has {} seats, got {} bots ({})",
                game.num_players(),
                bots.len(),
                bots.join(",")
            );
        }
        let mut players = bots
            .iter()
            .enumerate()
            .map(|(seat, name)| {
                relay_policy::text::make_bot(
                    name,
                    game_seed.wrapping_mul(31).wrapping_add(seat as u64),
                    &Default::default(),
                )
                .map_err(|e| anyhow::anyhow!("--bots: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        game.reset(game_seed);
        while !game.is_done() {
            let player = game.current_player();
            let observation = game.observation_as(player, view);
            let alternatives = players[player]
                .move_support(game.as_ref())
                .unwrap_or_default()
                .iter()
                .map(|m| write(m))
                .collect::<Result<Vec<_>>>()?;
            let action = players[player].choose_move(game.as_ref())?;
            game.step(&action)?;
            records.push(SftRecord::Pair {
                prompt: observation,
                completion: write(&action)?,
                alternatives,
            });
        }
    }
    Ok(records)
}
