//! PettingZoo's parallel games played by one shared policy: every agent a
//! row of the vector, the agents of a game consecutive rows that end
//! together; an agent done early reads zeros until its game ends (black
//! death); `env.backend: auto` finds PettingZoo's ids.

use relay_bridge::{EnvSection, MultiAgent, VecEnvs};
use relay_envs::VecActions;

/// A parallel game of 3 agents (`a0`, `a1`, `a2`) whose observation is
/// `[agent, t]`, reward `agent + action`; `a2` is done after step 2, the
/// game is cut by its time limit after step 4.
const GAME: &str = r#"
import numpy as np
from gymnasium import spaces
from pettingzoo.utils.env import ParallelEnv

class Trio(ParallelEnv):
    metadata = {"name": "trio_v0"}
    possible_agents = ["a0", "a1", "a2"]
    def observation_space(self, agent):
        return spaces.Box(0.0, 10.0, (2,), np.float32)
    def action_space(self, agent):
        return spaces.Discrete(2)
    def _obs(self):
        return {a: np.array([i, self.t], np.float32) for i, a in enumerate(self.possible_agents) if a in self.agents}
    def reset(self, seed=None, options=None):
        self.t = 0
        self.agents = list(self.possible_agents)
        return self._obs(), {a: {} for a in self.agents}
    def step(self, actions):
        assert set(actions) == set(self.agents), f"actions for {sorted(actions)}, agents {self.agents}"
        self.t += 1
        rewards = {a: float(self.possible_agents.index(a) + actions[a]) for a in self.agents}
        obs = self._obs()
        term = {a: a == "a2" and self.t == 2 for a in self.agents}
        trunc = {a: self.t == 4 for a in self.agents}
        self.agents = [a for a in self.agents if not (term[a] or trunc[a])]
        return obs, rewards, term, trunc, {a: {} for a in rewards}

def trio():
    return Trio()
"#;

fn trio_section(dir: &std::path::Path) -> EnvSection {
    std::fs::write(dir.join("relay_trio.py"), GAME).unwrap();
    EnvSection {
        python_path: vec![dir.to_path_buf()],
        entry_point: Some("relay_trio:trio".into()),
        backend: relay_bridge::Backend::Pettingzoo,
        ..EnvSection::default()
    }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-team-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_agent_is_a_row_and_a_games_agents_end_together() {
    let dir = tempdir("rows");
    // Two workers, two games: each worker steps one whole game.
    let section = EnvSection {
        workers: 2,
        ..trio_section(&dir)
    };
    let spec = relay_bridge::spec("trio_v0", &section).unwrap();
    assert_eq!(spec.team, ["a0", "a1", "a2"]);
    assert!(spec.agents.is_empty(), "not a game in turns");
    let mut envs = VecEnvs::new("trio_v0", &section, 6, 1).unwrap();
    let obs = envs.reset().unwrap().to_vec();
    assert_eq!(obs, [0., 0., 1., 0., 2., 0., 0., 0., 1., 0., 2., 0.]);
    // Action 1 everywhere: agent i earns i + 1 a step.
    let ones = [1i64; 6];
    let step = envs.step(VecActions::Discrete(&ones)).unwrap();
    assert_eq!(step.rewards, [1., 2., 3., 1., 2., 3.]);
    assert_eq!(&step.obs[..6], &[0., 1., 1., 1., 2., 1.]);
    // a2 is done after step 2: its reward comes, then zeros, not an end.
    let step = envs.step(VecActions::Discrete(&ones)).unwrap();
    assert_eq!(step.rewards, [1., 2., 3., 1., 2., 3.]);
    assert_eq!(&step.obs[4..6], &[0., 0.], "a2 reads zeros after its end");
    assert!(!step.done(2) && step.finished.is_empty());
    let step = envs.step(VecActions::Discrete(&ones)).unwrap();
    assert_eq!(step.rewards, [1., 2., 0., 1., 2., 0.]);
    // The time limit: every agent's episode ends at once, a2's terminated.
    let step = envs.step(VecActions::Discrete(&ones)).unwrap();
    for game in 0..2 {
        let (a0, a1, a2) = (3 * game, 3 * game + 1, 3 * game + 2);
        assert!(step.truncated[a0] && !step.terminated[a0]);
        assert!(step.truncated[a1] && !step.terminated[a1]);
        assert!(step.terminated[a2] && !step.truncated[a2]);
        assert_eq!(step.final_obs(a0).unwrap(), &[0., 4.]);
        assert_eq!(step.final_obs(a2).unwrap(), &[0., 0.]);
    }
    assert_eq!(step.finished.len(), 6);
    let games = relay_envs::team_episodes(&step.finished, 3);
    assert_eq!(games.len(), 2);
    assert_eq!(games[0].returns, [4., 8., 6.]);
    assert_eq!(games[1].team_return(), 18.0);
    assert_eq!(games[0].length, 4);
    // The next games started: step 0 again.
    assert_eq!(&step.obs[..6], &[0., 0., 1., 0., 2., 0.]);

    // Rows that are not whole games are refused, saying what to set.
    let err = VecEnvs::new("trio_v0", &trio_section(&dir), 4, 1).unwrap_err();
    assert!(
        err.to_string()
            .contains("set env_runner.num_envs to a multiple of 3"),
        "{err}"
    );
    // The agent feature: a one-hot of the agent at the end of each row.
    let featured = EnvSection {
        seat_feature: true,
        ..trio_section(&dir)
    };
    let mut envs = VecEnvs::new("trio_v0", &featured, 3, 1).unwrap();
    let obs = envs.reset().unwrap().to_vec();
    assert_eq!(
        obs,
        [0., 0., 1., 0., 0., 1., 0., 0., 1., 0., 2., 0., 0., 0., 1.]
    );
    // Taken in turns on request (PettingZoo's parallel_to_aec).
    let turns = EnvSection {
        multi_agent: MultiAgent::SelfPlay,
        ..trio_section(&dir)
    };
    assert_eq!(
        relay_bridge::spec("trio_v0", &turns).unwrap().agents,
        ["a0", "a1", "a2"]
    );
}

/// Under the default `env.backend: auto` an id PettingZoo knows and
/// Gymnasium does not is PettingZoo's: MPE's (from `mpe2`) shared by its
/// agents, classic games in turns; agents that differ are refused with the
/// wrappers that pad them.
#[test]
fn auto_finds_pettingzoo_ids_and_plays_each_family_as_its_users_do() {
    let auto = EnvSection::default();
    let continuous = EnvSection {
        kwargs: [("continuous_actions".to_string(), serde_json::json!(true))].into(),
        ..EnvSection::default()
    };
    let spec = relay_bridge::spec("simple_spread_v3", &continuous).unwrap();
    assert_eq!(spec.team, ["agent_0", "agent_1", "agent_2"]);
    assert!(!spec.action_space.is_discrete(), "Box actions");
    let mut envs = VecEnvs::new("simple_spread_v3", &continuous, 3, 2).unwrap();
    envs.reset().unwrap();
    let mut ended = 0;
    for t in 0..25 {
        let step = envs.step(VecActions::Continuous(&[0.5; 15])).unwrap();
        if t < 24 {
            assert!(step.finished.is_empty());
        } else {
            ended = step.finished.len();
            assert!((0..3).all(|i| step.truncated[i]), "MPE's 25 cycles");
        }
    }
    assert_eq!(ended, 3);
    let spec = relay_bridge::spec("tictactoe_v3", &auto).unwrap();
    assert_eq!(
        spec.agents,
        ["player_1", "player_2"],
        "classic games in turns"
    );
    let err = relay_bridge::spec("simple_adversary_v3", &auto).unwrap_err();
    assert!(err.to_string().contains("pad_observations_v0"), "{err}");
    // A Gymnasium id stays Gymnasium's.
    assert!(relay_bridge::spec(
        "CartPole-v1",
        &EnvSection {
            backend: relay_bridge::Backend::Gymnasium,
            ..auto
        }
    )
    .unwrap()
    .team
    .is_empty());
}
