"""The PettingZoo documentation's own Stable-Baselines3 + SuperSuit recipe
for Pistonball (tutorials/SB3/pistonball/sb3_pistonball_vector.py): one
PPO `CnnPolicy` shared by the 20 pistons (parameter sharing through
SuperSuit's `pettingzoo_env_to_vec_env_v1` and `concat_vec_envs_v1`, 4
games), SuperSuit's preprocessing (grayscale, 84x84, 3 stacked frames) and
the tutorial's hyperparameters (gamma 0.95, n_steps 256, ent_coef
0.0905168, lr 6.2211e-4, vf_coef 0.042202, max_grad_norm 0.9, gae_lambda
0.99, 5 epochs, clip range 0.3, batch size 256), on the tutorial's env
settings with discrete actions, as relay's `configs/pistonball-ppo.yaml`
trains the same game. One torch thread.

    python ppo_pistonball.py --seeds 1,2,3 --steps 81920

After each rollout (20,480 agent steps) the policy plays `--eval-games`
fresh games greedily, every piston acting with it, and the team return
(the sum of the pistons' returns, a game's return in relay's runs) is
recorded. `bench-learning` runs it beside relay (`bash deploy/install.sh
--sb3` installs what it needs into .relay/sb3). Prints a line per
evaluation and a last JSON line: per seed the curve (agent steps, mean team
return), the best and the last evaluation, the wall time, and the agent steps per
second over all seeds.
"""

import argparse
import json
import time

import numpy as np
import supersuit as ss
import torch
from pettingzoo.butterfly import pistonball_v6
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import set_random_seed

ENV_KWARGS = {
    "n_pistons": 20,
    "time_penalty": -0.1,
    "continuous": False,
    "random_drop": True,
    "random_rotate": True,
    "ball_mass": 0.75,
    "ball_friction": 0.3,
    "ball_elasticity": 1.5,
    "max_cycles": 25,
}


def preprocessed():
    """The tutorial's parallel env with SuperSuit's preprocessing."""
    env = pistonball_v6.parallel_env(**ENV_KWARGS)
    env = ss.color_reduction_v0(env, mode="B")
    env = ss.resize_v1(env, x_size=84, y_size=84)
    return ss.frame_stack_v1(env, 3)


def team_return(model, games, seed):
    """Mean team return of `games` fresh games, every piston acting greedily."""
    env = preprocessed()
    totals = []
    for g in range(games):
        obs, _ = env.reset(seed=seed + g)
        total = 0.0
        while env.agents:
            agents = list(env.agents)
            actions, _ = model.predict(np.stack([obs[a] for a in agents]), deterministic=True)
            obs, rewards, _, _, _ = env.step(dict(zip(agents, actions.tolist())))
            total += sum(rewards.values())
        totals.append(total)
    env.close()
    return float(np.mean(totals))


class EvaluateEachRollout(BaseCallback):
    """Plays fresh games after each rollout's update: the learning curve."""

    def __init__(self, games, seed):
        super().__init__()
        self.games = games
        self.seed = seed
        self.curve = []
        self.evaluating = 0.0

    def _on_step(self):
        return True

    def _on_rollout_start(self):
        # After the update of the rollout before (none before the first).
        if self.num_timesteps == 0:
            return
        started = time.perf_counter()
        ret = team_return(self.model, self.games, self.seed)
        self.evaluating += time.perf_counter() - started
        self.curve.append([self.num_timesteps, ret])
        print(f"seed {self.seed - 10_000}: {self.num_timesteps} agent steps: team return {ret:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--steps", type=int, default=81_920)
    parser.add_argument("--eval-games", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    runs = []
    steps, seconds = 0, 0.0
    for seed in [int(s) for s in args.seeds.split(",")]:
        # SB3's own seeding calls the vector env's seed(), which SuperSuit's
        # ConcatVecEnv lacks: torch and NumPy seeded here, the games below.
        set_random_seed(seed)
        env = preprocessed()
        env.reset(seed=seed)
        env = ss.pettingzoo_env_to_vec_env_v1(env)
        env = ss.concat_vec_envs_v1(env, 4, num_cpus=1, base_class="stable_baselines3")
        model = PPO(
            "CnnPolicy",
            env,
            gamma=0.95,
            n_steps=256,
            ent_coef=0.0905168,
            learning_rate=0.00062211,
            vf_coef=0.042202,
            max_grad_norm=0.9,
            gae_lambda=0.99,
            n_epochs=5,
            clip_range=0.3,
            batch_size=256,
            device="cpu",
        )
        # Evaluation games are seeded apart from training's.
        callback = EvaluateEachRollout(args.eval_games, 10_000 + seed)
        started = time.perf_counter()
        model.learn(total_timesteps=args.steps, callback=callback)
        # The last update's policy, as relay's last version.
        callback._on_rollout_start()
        wall = time.perf_counter() - started
        env.close()
        runs.append({
            "seed": seed,
            "curve": callback.curve,
            "best_eval": max((r for _, r in callback.curve), default=None),
            "last_return": callback.curve[-1][1] if callback.curve else None,
            "env_steps": int(model.num_timesteps),
            "wall_s": round(wall, 1),
            "train_s": round(wall - callback.evaluating, 1),
            "solved": None,
        })
        steps += int(model.num_timesteps)
        seconds += wall - callback.evaluating
    print(json.dumps({
        "algo": "SB3 PPO + SuperSuit",
        "runs": runs,
        "env_steps_per_s": steps / max(seconds, 1e-9),
    }))


if __name__ == "__main__":
    main()
