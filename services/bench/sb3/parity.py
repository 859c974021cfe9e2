"""The anchor side of `relay bench-parity`: Stable-Baselines3 (sb3-contrib
for recurrent PPO) trained on one task with rl-zoo's hyperparameters
(hyperparams/*.yml of DLR-RM/rl-baselines3-zoo, the same ones relay's
preset and the bench's overrides set), one torch thread, evaluated at the
env steps relay's checkpoints are evaluated at: the first vector step at
or past each point, greedy (deterministic) actions, `--episodes` fresh
episodes seeded `--eval-seed`, `--eval-seed` + 1, ... (relay's evaluation
seeds them the same way), observations normalised with the training
statistics frozen where the task normalises. Evaluation time is left out
of the training time.

    python parity.py --task ppo-cartpole --seeds 1,2,3 --points 5120,10240 \
        --episodes 10 --eval-seed 1000003

Prints a line per seed and a last JSON line: `task`, `env_steps_per_s`
(training only, all seeds) and `runs`: per seed `seed`, `curve`
([env steps, mean return] per point), `train_s`, `env_steps`.
"""

import argparse
import ast
import json
import time

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import DQN, PPO, SAC
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize
from sb3_contrib import RecurrentPPO

# rl-zoo's velocity-masked envs and their RecurrentPPO presets, as the
# memory goals of bench-learning run them.
from recurrent_ppo_novel import PRESETS as NOVEL
from recurrent_ppo_novel import evaluate as evaluate_novel
from recurrent_ppo_novel import make as make_novel

# MinAtar as relay's env bridge shows it, and MinAtar's network.
import minatar_anchor


def linear(start):
    """rl-zoo's `lin_<x>`: falls linearly from x to 0 over training."""
    return lambda progress_remaining: progress_remaining * start


# rl-zoo's tuned MuJoCo PPO presets (Hopper, HalfCheetah) share these.
MUJOCO_POLICY_KWARGS = dict(log_std_init=-2, ortho_init=False, activation_fn=torch.nn.ReLU,
                            net_arch=dict(pi=[256, 256], vf=[256, 256]))

MINATAR = ["Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders"]

# rl-zoo's tuned hyperparameters, by task: (algorithm, env id, budget,
# n_envs, normalize, keyword arguments). The budget is rl-zoo's n_timesteps
# unless the bench passes its own points.
TASKS = {
    "ppo-cartpole": (PPO, "CartPole-v1", 100_000, 8, False, dict(
        n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
        ent_coef=0.0, learning_rate=linear(0.001), clip_range=linear(0.2))),
    "ppo-acrobot": (PPO, "Acrobot-v1", 1_000_000, 16, True, dict(
        n_steps=256, gae_lambda=0.94, gamma=0.99, n_epochs=4, ent_coef=0.0)),
    "ppo-lunarlander": (PPO, "LunarLander-v3", 1_000_000, 16, False, dict(
        n_steps=1024, batch_size=64, gae_lambda=0.98, gamma=0.999, n_epochs=4,
        ent_coef=0.01)),
    "dqn-cartpole": (DQN, "CartPole-v1", 50_000, 1, False, dict(
        learning_rate=2.3e-3, batch_size=64, buffer_size=100_000,
        learning_starts=1000, gamma=0.99, target_update_interval=10,
        train_freq=256, gradient_steps=128, exploration_fraction=0.16,
        exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]))),
    "dqn-mountaincar": (DQN, "MountainCar-v0", 120_000, 1, False, dict(
        learning_rate=4e-3, batch_size=128, buffer_size=10_000,
        learning_starts=1000, gamma=0.98, target_update_interval=600,
        train_freq=16, gradient_steps=8, exploration_fraction=0.2,
        exploration_final_eps=0.07, policy_kwargs=dict(net_arch=[256, 256]))),
    "sac-pendulum": (SAC, "Pendulum-v1", 20_000, 1, False, dict(learning_rate=1e-3)),
    "ppo-hopper": (PPO, "Hopper-v5", 1_000_000, 1, True, dict(
        batch_size=32, n_steps=512, gamma=0.999, learning_rate=9.80828e-05,
        ent_coef=0.00229519, clip_range=0.2, n_epochs=5, gae_lambda=0.99,
        max_grad_norm=0.7, vf_coef=0.835671, policy_kwargs=MUJOCO_POLICY_KWARGS)),
    "ppo-halfcheetah": (PPO, "HalfCheetah-v5", 1_000_000, 1, True, dict(
        batch_size=64, n_steps=512, gamma=0.98, learning_rate=2.0633e-05,
        ent_coef=0.000401762, clip_range=0.1, n_epochs=20, gae_lambda=0.92,
        max_grad_norm=0.8, vf_coef=0.58096, policy_kwargs=MUJOCO_POLICY_KWARGS)),
    # rl-zoo's Walker2d-v3 names no policy_kwargs: MlpPolicy's defaults.
    "ppo-walker2d": (PPO, "Walker2d-v5", 1_000_000, 1, True, dict(
        batch_size=32, n_steps=512, gamma=0.99, learning_rate=5.05041e-05,
        ent_coef=0.000585045, clip_range=0.1, n_epochs=20, gae_lambda=0.95,
        max_grad_norm=1, vf_coef=0.871923)),
    "sac-hopper": (SAC, "Hopper-v5", 1_000_000, 1, False, dict(learning_starts=10_000)),
    # The MinAtar suite (configs/minatar-*-{ppo,dqn}.yaml): PPO at
    # gymnax-blines' hyperparameters (the published MinAtar PPO returns), DQN
    # at the MinAtar paper's with SB3's Adam; MinAtar's CNN on both sides.
    **{f"ppo-minatar-{game.lower()}": (PPO, f"MinAtar/{game}-v1", 10_000_000, 64, False, dict(
        n_steps=128, batch_size=1024, n_epochs=4, learning_rate=5e-4, clip_range=0.2,
        gamma=0.999, gae_lambda=0.95, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5,
        policy_kwargs=minatar_anchor.POLICY_KWARGS)) for game in MINATAR},
    **{f"dqn-minatar-{game.lower()}": (DQN, f"MinAtar/{game}-v1", 5_000_000, 1, False, dict(
        learning_rate=2.5e-4, buffer_size=100_000, learning_starts=5000, batch_size=32,
        gamma=0.99, target_update_interval=1000, train_freq=1, gradient_steps=1,
        exploration_fraction=0.02, exploration_final_eps=0.1,
        policy_kwargs=minatar_anchor.POLICY_KWARGS)) for game in MINATAR},
    # hyperparams/ppo_lstm.yml: n_timesteps 1e5 for both.
    "ppo-lstm-cartpole-novel": (RecurrentPPO, "CartPoleNoVel-v1", 100_000, 8, True,
                                NOVEL["CartPoleNoVel-v1"]["kwargs"]),
    "ppo-lstm-pendulum-novel": (RecurrentPPO, "PendulumNoVel-v1", 100_000, 4, True,
                                NOVEL["PendulumNoVel-v1"]["kwargs"]),
}


def make(env_id):
    if env_id.startswith("MinAtar/"):
        return minatar_anchor.make(env_id)
    return gym.make(env_id)


def evaluate(model, env_id, normalizer, episodes, seed):
    if env_id in NOVEL:
        # A recurrent policy: its state is carried through each episode.
        return float(evaluate_novel(model, normalizer, NOVEL[env_id], episodes, seed).mean())
    env = make(env_id)
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        done, total = False, 0.0
        while not done:
            if normalizer is not None:
                obs = normalizer.normalize_obs(obs)
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


class AtPoints(BaseCallback):
    """Evaluates at the first vector step at or past each point."""

    def __init__(self, env_id, points, episodes, eval_seed, normalizer):
        super().__init__()
        self.env_id, self.points = env_id, list(points)
        self.episodes, self.eval_seed = episodes, eval_seed
        self.normalizer = normalizer
        self.curve = []
        self.train_s = 0.0
        self.last = time.perf_counter()

    def _on_step(self):
        if self.points and self.num_timesteps >= self.points[0]:
            self.train_s += time.perf_counter() - self.last
            mean = evaluate(self.model, self.env_id, self.normalizer, self.episodes, self.eval_seed)
            self.curve.append([int(self.num_timesteps), mean])
            while self.points and self.num_timesteps >= self.points[0]:
                self.points.pop(0)
            self.last = time.perf_counter()
        return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--points", required=True, help="env steps to evaluate at, comma separated")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--eval-seed", type=int, default=1_000_003)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one of the task's keyword arguments (a Python literal), "
                             "to measure what one setting does: --set use_sde=False "
                             "(--set normalize=False turns the task's VecNormalize off)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    algo, env_id, _, n_envs, normalize, kwargs = TASKS[args.task]
    kwargs = dict(kwargs)
    for setting in args.set:
        key, value = setting.split("=", 1)
        if key == "normalize":
            # The task's VecNormalize (observations and rewards), not a keyword.
            normalize = ast.literal_eval(value)
        else:
            kwargs[key] = ast.literal_eval(value)
    points = [int(p) for p in args.points.split(",")]
    runs, steps, seconds = [], 0, 0.0
    for seed in [int(s) for s in args.seeds.split(",")]:
        if env_id in NOVEL:
            env = make_novel(NOVEL[env_id], n_envs, seed)
        else:
            env = make_vec_env(lambda: make(env_id), n_envs=n_envs, seed=seed)
        normalizer = None
        if normalize:
            env = normalizer = VecNormalize(env, gamma=kwargs.get("gamma", 0.99))
        if algo is RecurrentPPO:
            policy = "MlpLstmPolicy"
        else:
            policy = "CnnPolicy" if env_id.startswith("MinAtar/") else "MlpPolicy"
        model = algo(policy, env, seed=seed, verbose=0, device="cpu", **kwargs)
        callback = AtPoints(env_id, points, args.episodes, args.eval_seed, normalizer)
        model.learn(total_timesteps=points[-1], callback=callback)
        callback.train_s += time.perf_counter() - callback.last
        if callback.points:
            # Training ended between the last vector step and the last point.
            mean = evaluate(model, env_id, normalizer, args.episodes, args.eval_seed)
            callback.curve.append([int(model.num_timesteps), mean])
        run = dict(seed=seed, curve=callback.curve, train_s=callback.train_s,
                   env_steps=int(model.num_timesteps))
        print(f"seed {seed}: final {callback.curve[-1][1]:.1f} at {run['env_steps']} env steps, "
              f"{run['train_s']:.1f} s training", flush=True)
        runs.append(run)
        steps += run["env_steps"]
        seconds += run["train_s"]
    print(json.dumps(dict(task=args.task, env_steps_per_s=steps / max(seconds, 1e-9), runs=runs)))


if __name__ == "__main__":
    main()
