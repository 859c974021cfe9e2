"""Stable-Baselines3's PPO `CnnPolicy` on an Atari game, as relay's
`configs/breakout-ppo.yaml` trains it, for its env steps per second:
rl-zoo's Atari hyperparameters (8 envs x 128 steps, 4 epochs of minibatches
of 256, lr 2.5e-4 and clip range 0.1 decaying linearly over 10M steps,
ent_coef 0.01, vf_coef 0.5), SB3's AtariWrapper (30 no-op starts, frame
skip 4, 84x84 grayscale, a life lost ends the episode, FIRE at reset,
rewards clipped) and 4 stacked frames, on the same ale-py env
(`ALE/Breakout-v5` with frameskip 1 and no sticky actions), one torch
thread, SB3's default DummyVecEnv (the envs step in this process).

    python ppo_atari.py --seconds 300 --seed 1

`bench-learning` runs it beside relay (`bash deploy/install.sh --sb3`
installs what it needs into .relay/sb3). Trains until `--seconds` of
training have passed, then prints a last JSON line with the env steps,
the seconds and their ratio.
"""

import argparse
import json
import time

import ale_py
import gymnasium as gym
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.vec_env import VecFrameStack


class Deadline(BaseCallback):
    """Stops training once `seconds` have passed since its first step."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.started = None

    def _on_training_start(self):
        self.started = time.perf_counter()

    def _on_step(self):
        return time.perf_counter() - self.started < self.seconds


def linear(start):
    return lambda progress_remaining: progress_remaining * start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="ALE/Breakout-v5")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    gym.register_envs(ale_py)
    envs = make_atari_env(
        args.env_id,
        n_envs=8,
        seed=args.seed,
        env_kwargs={"frameskip": 1, "repeat_action_probability": 0.0},
    )
    envs = VecFrameStack(envs, n_stack=4)
    model = PPO(
        "CnnPolicy",
        envs,
        n_steps=128,
        n_epochs=4,
        batch_size=256,
        learning_rate=linear(2.5e-4),
        clip_range=linear(0.1),
        ent_coef=0.01,
        vf_coef=0.5,
        seed=args.seed,
        device="cpu",
    )
    deadline = Deadline(args.seconds)
    model.learn(total_timesteps=10_000_000, callback=deadline)
    seconds = time.perf_counter() - deadline.started
    steps = model.num_timesteps
    print(
        json.dumps(
            {
                "anchor": "stable-baselines3 PPO CnnPolicy",
                "env_id": args.env_id,
                "torch_threads": torch.get_num_threads(),
                "env_steps": steps,
                "seconds": round(seconds, 1),
                "env_steps_per_s": round(steps / seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
