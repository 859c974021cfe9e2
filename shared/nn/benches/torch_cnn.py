"""PyTorch (1 thread) timings of the same CNN networks bench-nn times in
relay, at batch 256: actor-critics with SB3's NatureCNN on 4x84x84 frames
(6 actions), CleanRL's IMPALA ResNet (`ppo_procgen.py`) on 4x84x84 (6
actions) and MinAtar's network on 4x10x10 (3 actions), each a no-grad
forward of both heads and a PPO train step (forward, clipped loss,
backward, grad-norm clip, Adam); and SB3's DQN `CnnPolicy` (NatureCNN, a
linear layer to 6 actions) on 4x84x84 and MinAtar's network on Seaquest's
10x10x10 (6 actions), at batch 32, a DQN train step (target
values without grad, Huber loss, backward, grad-norm clip 10, Adam).

Arguments: the time budget per case in seconds, then optionally the
comma-separated cases to run (default all). Prints one JSON object of
medians in microseconds, keyed `torch_<case>_<forward|train_step>_b<batch>_us`."""
import json
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

torch.set_num_threads(1)
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 0.4
only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None


def nature_cnn(channels, convs, flat, features):
    """SB3's NatureCNN modules: `cnn` and `linear`."""
    layers, c = [], channels
    for out, k, s in convs:
        layers += [nn.Conv2d(c, out, k, s), nn.ReLU()]
        c = out
    return nn.Sequential(*layers, nn.Flatten()), nn.Sequential(nn.Linear(flat, features), nn.ReLU())


class ResidualBlock(nn.Module):
    """CleanRL's `ppo_procgen.py`."""

    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ConvSequence(nn.Module):
    """CleanRL's `ppo_procgen.py`."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.res_block0 = ResidualBlock(out_channels)
        self.res_block1 = ResidualBlock(out_channels)

    def forward(self, x):
        x = F.max_pool2d(self.conv(x), kernel_size=3, stride=2, padding=1)
        return self.res_block1(self.res_block0(x))


def impala_cnn(channels, shape, stacks, features):
    """IMPALA's ResNet with relay's module names: `cnn` and `linear`."""
    layers, c, (h, w) = [], channels, shape
    for out in stacks:
        layers.append(ConvSequence(c, out))
        c, h, w = out, (h + 1) // 2, (w + 1) // 2
    cnn = nn.Sequential(*layers, nn.Flatten(), nn.ReLU())
    return cnn, nn.Sequential(nn.Linear(c * h * w, features), nn.ReLU())


class Policy(nn.Module):
    def __init__(self, extractor, features, actions):
        super().__init__()
        self.cnn, self.linear = extractor
        self.action_net = nn.Linear(features, actions)
        self.value_net = nn.Linear(features, 1)

    def forward(self, x):
        h = self.linear(self.cnn(x.float() / 255.0))
        return self.action_net(h), self.value_net(h).squeeze(-1)


class QNetwork(nn.Module):
    """SB3's DQN `CnnPolicy` Q-network: features, then `net_arch=[]`."""

    def __init__(self, extractor, features, actions):
        super().__init__()
        cnn, linear = extractor
        self.features_extractor = nn.Module()
        self.features_extractor.cnn, self.features_extractor.linear = cnn, linear
        self.q_net = nn.Sequential(nn.Linear(features, actions))

    def forward(self, x):
        f = self.features_extractor
        return self.q_net(f.linear(f.cnn(x.float() / 255.0)))


def median_us(f):
    for _ in range(3):
        f()
    samples = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(samples) < 5:
        t = time.perf_counter()
        f()
        samples.append((time.perf_counter() - t) * 1e6)
    samples.sort()
    return samples[len(samples) // 2]


def bench_ppo(name, shape, extractor, features, actions, b=256):
    torch.manual_seed(0)
    model = Policy(extractor, features, actions)
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    obs = torch.randint(0, 256, (b,) + shape, dtype=torch.uint8)
    actions_t = torch.randint(0, actions, (b,))
    old_lp = torch.full((b,), -1.0)
    adv = torch.randn(b)
    ret = torch.randn(b)

    def forward():
        with torch.no_grad():
            model(obs)

    def train_step():
        logits, v = model(obs)
        dist = torch.distributions.Categorical(logits=logits)
        lp = dist.log_prob(actions_t)
        ratio = torch.exp(lp - old_lp)
        a = (adv - adv.mean()) / (adv.std() + 1e-8)
        pg = -torch.min(a * ratio, a * torch.clamp(ratio, 0.9, 1.1)).mean()
        loss = pg + 0.5 * ((ret - v) ** 2).mean() - 0.01 * dist.entropy().mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    return {
        f"torch_{name}_forward_b{b}_us": median_us(forward),
        f"torch_{name}_train_step_b{b}_us": median_us(train_step),
    }


def bench_dqn(name, shape, extractor, features, actions, b=32):
    torch.manual_seed(0)
    online = QNetwork(extractor(), features, actions)
    target = QNetwork(extractor(), features, actions)
    target.load_state_dict(online.state_dict())
    opt = torch.optim.Adam(online.parameters(), lr=1e-4)
    obs = torch.randint(0, 256, (b,) + shape, dtype=torch.uint8)
    next_obs = torch.randint(0, 256, (b,) + shape, dtype=torch.uint8)
    actions_t = torch.randint(0, actions, (b, 1))
    rewards = torch.randn(b)
    dones = (torch.rand(b) < 0.1).float()

    def train_step():
        # SB3's DQN.train.
        with torch.no_grad():
            next_q = target(next_obs).max(dim=1).values
            target_q = rewards + (1 - dones) * 0.99 * next_q
        q = torch.gather(online(obs), dim=1, index=actions_t).squeeze(1)
        loss = F.smooth_l1_loss(q, target_q)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(online.parameters(), 10)
        opt.step()

    return {f"torch_{name}_train_step_b{b}_us": median_us(train_step)}


nature = lambda: nature_cnn(4, [(32, 8, 4), (64, 4, 2), (64, 3, 1)], 3136, 512)
cases = {
    "nature_cnn": lambda: bench_ppo("nature_cnn", (4, 84, 84), nature(), 512, 6),
    "impala_cnn": lambda: bench_ppo(
        "impala_cnn", (4, 84, 84), impala_cnn(4, (84, 84), [16, 32, 32], 256), 256, 6
    ),
    "minatar_cnn": lambda: bench_ppo(
        "minatar_cnn", (4, 10, 10), nature_cnn(4, [(16, 3, 1)], 1024, 128), 128, 3
    ),
    "dqn_nature_cnn": lambda: bench_dqn("dqn_nature_cnn", (4, 84, 84), nature, 512, 6),
    "dqn_minatar_cnn": lambda: bench_dqn(
        "dqn_minatar_cnn", (10, 10, 10), lambda: nature_cnn(10, [(16, 3, 1)], 1024, 128), 128, 6
    ),
}
out = {"torch": torch.__version__}
for name, run in cases.items():
    if only is None or name in only:
        out.update(run())
print(json.dumps(out))
