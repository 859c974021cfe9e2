"""sb3-contrib's RecurrentPPO on CartPoleNoVel-v1 or PendulumNoVel-v1,
timed to the goal as relay's `bench-learning --only NoVel` times relay:
rl-zoo's tuned hyperparameters (hyperparams/ppo_lstm.yml, those of
configs/cartpole-novel-ppo-lstm.yaml and configs/pendulum-novel-ppo-lstm.yaml),
one torch thread, and the same solved rule: a screening of 20 greedy
episodes reaching the goal (as often in env steps as relay's preset
evaluates), then a confirmation on 100 fresh episodes whose mean less two
standard errors reaches it.
Evaluation time is excluded from the wall time. Observations are
normalised as rl-zoo does (VecNormalize, whose statistics the evaluation
uses frozen).

The envs are rl-zoo's: the Gymnasium env wrapped in its MaskVelocityWrapper,
which zeroes the velocities (CartPole's cart and pole velocities, Pendulum's
angular velocity), as relay's CartPoleNoVel-v1 and PendulumNoVel-v1 do.

    python recurrent_ppo_novel.py --env CartPoleNoVel-v1 --seeds 1,2,3

needs `bash deploy/install.sh --sb3` (Stable-Baselines3, sb3-contrib,
torch). Prints a line per seed and a last JSON line.
"""

import argparse
import json
import math
import time

import gymnasium as gym
import numpy as np
import torch
from sb3_contrib import RecurrentPPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize


class MaskVelocity(gym.ObservationWrapper):
    """rl-zoo's MaskVelocityWrapper: the velocities read as zero."""

    MASKED = {"CartPole-v1": [1, 3], "Pendulum-v1": [2]}

    def __init__(self, env, base):
        super().__init__(env)
        self.mask = np.ones(env.observation_space.shape, dtype=np.float32)
        self.mask[self.MASKED[base]] = 0.0

    def observation(self, obs):
        return obs * self.mask


def linear(start):
    return lambda progress: progress * start


PRESETS = {
    "CartPoleNoVel-v1": dict(
        base="CartPole-v1",
        goal=475.0,
        budget=200_000,
        # relay's preset evaluates every 10 versions of 256 env steps.
        eval_every=2_560,
        n_envs=8,
        kwargs=dict(
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=linear(1e-3),
            clip_range=linear(0.2),
            policy_kwargs=dict(
                ortho_init=False,
                activation_fn=torch.nn.ReLU,
                lstm_hidden_size=64,
                enable_critic_lstm=True,
                net_arch=dict(pi=[64], vf=[64]),
            ),
        ),
    ),
    "PendulumNoVel-v1": dict(
        base="Pendulum-v1",
        goal=-300.0,
        budget=300_000,
        # relay's preset evaluates every 2 versions of 4,096 env steps.
        eval_every=8_192,
        n_envs=4,
        kwargs=dict(
            n_steps=1024,
            gae_lambda=0.95,
            gamma=0.9,
            n_epochs=10,
            ent_coef=0.0,
            learning_rate=1e-3,
            clip_range=0.2,
            use_sde=True,
            sde_sample_freq=4,
            policy_kwargs=dict(
                ortho_init=False,
                activation_fn=torch.nn.ReLU,
                lstm_hidden_size=64,
                enable_critic_lstm=True,
                net_arch=dict(pi=[64], vf=[64]),
            ),
        ),
    ),
}


def make(preset, n, seed):
    base = preset["base"]
    return make_vec_env(lambda: MaskVelocity(gym.make(base), base), n_envs=n, seed=seed)


def evaluate(model, train_env, preset, episodes, seed):
    """Greedy returns of `episodes` episodes, `episodes` envs at once (the
    LSTM state is per env and reset at each episode's start)."""
    env = VecNormalize(make(preset, episodes, seed), norm_obs=True, norm_reward=False, training=False)
    env.obs_rms = train_env.obs_rms
    obs = env.reset()
    state, starts = None, np.ones(episodes, dtype=bool)
    returns, done = np.zeros(episodes), np.zeros(episodes, dtype=bool)
    while not done.all():
        action, state = model.predict(obs, state=state, episode_start=starts, deterministic=True)
        obs, reward, dones, _ = env.step(action)
        returns += np.where(done, 0.0, env.get_original_reward())
        done |= dones
        starts = dones
    env.close()
    return returns


class SolvedRule(BaseCallback):
    def __init__(self, preset, every, seed):
        super().__init__()
        self.preset = preset
        self.every = every
        self.fresh_seed = seed
        self.next_eval = every
        self.train_s = 0.0
        self.last = time.perf_counter()
        self.solved_at = None

    def _on_step(self):
        if self.num_timesteps < self.next_eval:
            return True
        self.next_eval += self.every
        self.train_s += time.perf_counter() - self.last
        goal = self.preset["goal"]
        screening = evaluate(self.model, self.training_env, self.preset, 20, 1_000_003)
        solved = False
        if screening.mean() >= goal:
            confirmation = evaluate(self.model, self.training_env, self.preset, 100, self.fresh_seed)
            self.fresh_seed += 100
            bound = confirmation.mean() - 2 * confirmation.std(ddof=1) / math.sqrt(100)
            solved = bound >= goal
        self.last = time.perf_counter()
        if solved:
            self.solved_at = (self.num_timesteps, self.train_s)
            return False
        return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="CartPoleNoVel-v1", choices=sorted(PRESETS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--budget", type=int, help="env steps (default: the goal's)")
    parser.add_argument("--eval-every", type=int, help="env steps (default: relay's preset's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = PRESETS[args.env]
    budget = args.budget or preset["budget"]
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        env = VecNormalize(make(preset, preset["n_envs"], seed), norm_obs=True, norm_reward=True, gamma=preset["kwargs"]["gamma"])
        model = RecurrentPPO("MlpLstmPolicy", env, seed=seed, verbose=0, **preset["kwargs"])
        rule = SolvedRule(preset, args.eval_every or preset["eval_every"], 4_295_000_000 + 1000 * seed)
        start = time.perf_counter()
        model.learn(total_timesteps=budget, callback=rule)
        rule.train_s += time.perf_counter() - rule.last if rule.solved_at is None else 0.0
        env_steps, wall = rule.solved_at or (model.num_timesteps, rule.train_s)
        print(
            f"sb3-contrib RecurrentPPO {args.env} seed {seed}: solved {rule.solved_at is not None} "
            f"at {env_steps} env steps, {wall:.1f} s training wall "
            f"({time.perf_counter() - start:.1f} s with evaluation), {env_steps / wall:.1f} env steps/s",
            flush=True,
        )
        rows.append({"seed": seed, "solved": rule.solved_at is not None, "env_steps": env_steps, "wall_s": round(wall, 1)})
    steps = sum(r["env_steps"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    walls = sorted(r["wall_s"] for r in rows)
    print(json.dumps({
        "algo": "sb3-contrib-recurrent-ppo",
        "env": args.env,
        "median_wall_s": walls[len(walls) // 2],
        "env_steps_per_s": round(steps / max(wall, 1e-9), 1),
        "runs": rows,
    }))


if __name__ == "__main__":
    main()
