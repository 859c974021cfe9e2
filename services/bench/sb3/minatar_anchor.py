"""MinAtar for the anchor side of `relay bench-parity`: the env as relay's
env bridge shows it to the policy, and MinAtar's network as an SB3
features extractor, so that both sides train the same network on the same
observations.

relay's Python worker hands MinAtar's bool (H, W, C) observations over
channels first as uint8 pixels of 0 or 255, and its CNN divides them by
255; `Pixels` does the same transpose and scaling, and SB3's image policies
divide by 255 too. Doing the transpose here rather than leaving it to SB3's
`VecTransposeImage` keeps Seaquest's 10x10x10 from being taken for an image
that is already channels first.
"""

import gymnasium as gym
import numpy as np
import torch
from minatar.gym import register_envs
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

# MinAtar sets no time limit; relay's presets cap an episode at this many steps.
MAX_EPISODE_STEPS = 10_000

register_envs()


class Pixels(gym.ObservationWrapper):
    """bool (H, W, C) -> uint8 (C, H, W) of 0 or 255."""

    def __init__(self, env):
        super().__init__(env)
        h, w, c = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (c, h, w), np.uint8)

    def observation(self, obs):
        return np.ascontiguousarray(np.transpose(obs, (2, 0, 1))).astype(np.uint8) * 255


def make(env_id):
    return Pixels(gym.make(env_id, max_episode_steps=MAX_EPISODE_STEPS))


class MinAtarCnn(BaseFeaturesExtractor):
    """MinAtar's network (Young & Tian 2019): one 3x3/1 convolution of 16
    channels with ReLU, then a dense layer of 128 with ReLU."""

    def __init__(self, observation_space, features_dim=128):
        super().__init__(observation_space, features_dim)
        c, h, w = observation_space.shape
        self.cnn = torch.nn.Sequential(torch.nn.Conv2d(c, 16, 3, 1), torch.nn.ReLU(), torch.nn.Flatten())
        self.linear = torch.nn.Sequential(torch.nn.Linear(16 * (h - 2) * (w - 2), features_dim), torch.nn.ReLU())

    def forward(self, obs):
        return self.linear(self.cnn(obs))


# The heads right on the features, as relay's presets (`hidden: []`).
POLICY_KWARGS = dict(features_extractor_class=MinAtarCnn, net_arch=[])
