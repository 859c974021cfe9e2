"""PyTorch (1 thread) timings of the same CNN actor-critics bench-nn times in
relay: SB3's NatureCNN policy on 4x84x84 frames (6 actions) and MinAtar's
network on 4x10x10 (3 actions), batch 256: a no-grad forward of both heads,
and a PPO train step (forward, clipped loss, backward, grad-norm clip, Adam).
Prints one JSON object of medians in microseconds."""
import json
import sys
import time

import torch
from torch import nn

torch.set_num_threads(1)
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 0.4


class Policy(nn.Module):
    def __init__(self, channels, convs, flat, features, actions):
        super().__init__()
        layers, c = [], channels
        for out, k, s in convs:
            layers += [nn.Conv2d(c, out, k, s), nn.ReLU()]
            c = out
        self.cnn = nn.Sequential(*layers, nn.Flatten())
        self.linear = nn.Sequential(nn.Linear(flat, features), nn.ReLU())
        self.action_net = nn.Linear(features, actions)
        self.value_net = nn.Linear(features, 1)

    def forward(self, x):
        h = self.linear(self.cnn(x.float() / 255.0))
        return self.action_net(h), self.value_net(h).squeeze(-1)


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


def bench(name, shape, convs, flat, features, actions, b=256):
    torch.manual_seed(0)
    model = Policy(shape[0], convs, flat, features, actions)
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


out = {"torch": torch.__version__}
out.update(bench("nature_cnn", (4, 84, 84), [(32, 8, 4), (64, 4, 2), (64, 3, 1)], 3136, 512, 6))
out.update(bench("minatar_cnn", (4, 10, 10), [(16, 3, 1)], 1024, 128, 3))
print(json.dumps(out))
