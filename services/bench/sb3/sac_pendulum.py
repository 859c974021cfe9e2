"""Stable-Baselines3's SAC on Pendulum-v1 to -200, timed as relay's
`bench-learning --only SAC` times relay: rl-zoo's hyperparameters (those of
configs/pendulum-sac.yaml), one torch thread, and the same solved rule: a
screening of 10 greedy episodes reaching -200, then a confirmation on 100
fresh episodes whose mean less two standard errors reaches -200. Evaluation
time is excluded from the wall time; SB3 is evaluated every 500 env steps
(relay every 10 s, about 1,300 env steps), which can only favour SB3.

    python sac_pendulum.py --seeds 1,2,3

needs `pip install stable-baselines3 gymnasium` (torch comes with it).
Prints a line per seed and a last JSON line.
"""

import argparse
import json
import math
import time

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import SAC
from stable_baselines3.common.callbacks import BaseCallback

GOAL = -200.0


def evaluate(model, episodes, seed):
    env = gym.make("Pendulum-v1")
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += reward
            done = terminated or truncated
        returns.append(total)
    return np.array(returns)


class SolvedRule(BaseCallback):
    def __init__(self, every, seed):
        super().__init__()
        self.every = every
        self.fresh_seed = seed
        self.train_s = 0.0
        self.last = time.perf_counter()
        self.solved_at = None

    def _on_step(self):
        if self.num_timesteps % self.every:
            return True
        self.train_s += time.perf_counter() - self.last
        screening = evaluate(self.model, 10, 1_000_003)
        solved = False
        if screening.mean() >= GOAL:
            confirmation = evaluate(self.model, 100, self.fresh_seed)
            self.fresh_seed += 100
            bound = confirmation.mean() - 2 * confirmation.std(ddof=1) / math.sqrt(100)
            solved = bound >= GOAL
        self.last = time.perf_counter()
        if solved:
            self.solved_at = (self.num_timesteps, self.train_s)
            return False
        return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--budget", type=int, default=30_000)
    parser.add_argument("--eval-every", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        model = SAC("MlpPolicy", "Pendulum-v1", learning_rate=1e-3, seed=seed, verbose=0)
        rule = SolvedRule(args.eval_every, 4_295_000_000 + 1000 * seed)
        start = time.perf_counter()
        model.learn(total_timesteps=args.budget, callback=rule)
        env_steps, wall = rule.solved_at or (args.budget, rule.train_s)
        print(f"sb3 SAC Pendulum-v1 seed {seed}: solved {rule.solved_at is not None} at {env_steps} env steps, "
              f"{wall:.1f} s training wall ({time.perf_counter() - start:.1f} s with evaluation), "
              f"{env_steps / wall:.1f} env steps/s")
        rows.append({"seed": seed, "solved": rule.solved_at is not None, "env_steps": env_steps, "wall_s": round(wall, 1)})
    walls = sorted(r["wall_s"] for r in rows)
    print(json.dumps({"algo": "sb3-sac", "env": "Pendulum-v1", "median_wall_s": walls[len(walls) // 2], "runs": rows}))


if __name__ == "__main__":
    main()
