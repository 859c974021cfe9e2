//! Parallel games played by one shared policy: the agents of a game are
//! `team` consecutive envs of a vector (rows), which begin and end their
//! episodes together. A game's episode is its agents' episodes put
//! together: each agent's return, and the team's, their sum.

use crate::FinishedEpisode;

/// One finished game of a team of agents.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamEpisode {
    /// The game: envs `game * team .. (game + 1) * team` of the vector.
    pub game: usize,
    /// Each agent's return, in the game's agent order.
    pub returns: Vec<f64>,
    /// Steps of the game.
    pub length: u32,
    /// Some agent ended in a terminal state (else the time limit cut it).
    pub terminated: bool,
}

impl TeamEpisode {
    /// The team's return: the sum of its agents'.
    pub fn team_return(&self) -> f64 {
        self.returns.iter().sum()
    }
}

/// The games of `team` agents each that `finished` (one step's finished
/// episodes of a vector of envs) completes, in game order. A game whose
/// agents did not all finish in `finished` is left out.
pub fn team_episodes(finished: &[FinishedEpisode], team: usize) -> Vec<TeamEpisode> {
    let mut games: std::collections::BTreeMap<usize, Vec<&FinishedEpisode>> = Default::default();
    for e in finished {
        games.entry(e.env_index / team).or_default().push(e);
    }
    games
        .into_iter()
        .filter(|(_, rows)| rows.len() == team)
        .map(|(game, mut rows)| {
            rows.sort_by_key(|e| e.env_index);
            TeamEpisode {
                game,
                returns: rows.iter().map(|e| e.episode_return).collect(),
                length: rows.iter().map(|e| e.length).max().unwrap_or(0),
                terminated: rows.iter().any(|e| e.terminated),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(env_index: usize, episode_return: f64) -> FinishedEpisode {
        FinishedEpisode {
            env_index,
            episode_return,
            length: 25,
            terminated: false,
            truncated: true,
        }
    }

    #[test]
    fn a_game_is_its_agents_together_and_a_partial_one_waits() {
        // Two games of 3 agents: game 1 whole, game 0 missing agent 2.
        let finished = [
            row(4, 2.0),
            row(0, 1.0),
            row(3, -1.0),
            row(1, 0.5),
            row(5, 0.25),
        ];
        let games = team_episodes(&finished, 3);
        assert_eq!(games.len(), 1);
        assert_eq!(games[0].game, 1);
        assert_eq!(games[0].returns, [-1.0, 2.0, 0.25]);
        assert_eq!(games[0].team_return(), 1.25);
        assert!(!games[0].terminated);
    }
}
