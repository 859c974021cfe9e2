"""The anchor of `relay-bench bench-cnn-step`: the same PPO train step in
PyTorch, as Stable-Baselines3 runs it for Atari's `CnnPolicy`: NatureCNN on
4 x 84 x 84 frames scaled by 1/255 (conv 8/4, 4/2, 3/1 with ReLU, a
512-wide linear layer), separate action (6) and value heads on its
features, the clipped surrogate with clipped values and an entropy bonus,
gradient-norm clipping at 0.5 and Adam (lr 2.5e-4, eps 1e-5).

Random frames, actions and advantages; one warm-up step, then `--steps`
timed steps, each ending with the loss read back (which synchronises
CUDA), as relay's step ends. PyTorch's defaults stay as users get them
(cuDNN may use TF32 for convolutions; recorded in the JSON).

Prints a line, then one JSON line.
"""

import argparse
import json
import time

import torch
from torch import nn


def nature_cnn(actions):
    features = nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
    )
    return features, nn.Linear(512, actions), nn.Linear(512, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    actions_n = 6
    features, action_net, value_net = (m.to(device) for m in nature_cnn(actions_n))
    params = [*features.parameters(), *action_net.parameters(), *value_net.parameters()]
    opt = torch.optim.Adam(params, lr=2.5e-4, eps=1e-5)
    n = args.batch
    obs = torch.randint(0, 256, (n, 4, 84, 84), device=device, dtype=torch.uint8)
    actions = torch.randint(0, actions_n, (n,), device=device)
    old_logprob = torch.empty(n, device=device).uniform_(-2.2, -1.4)
    old_values = torch.empty(n, device=device).uniform_(-0.5, 0.5)
    advantages = torch.empty(n, device=device).uniform_(-1.0, 1.0)
    returns = torch.empty(n, device=device).uniform_(-1.0, 1.0)
    clip_range, clip_range_vf, ent_coef, vf_coef = 0.1, 0.1, 0.01, 0.5

    def step():
        h = features(obs.float() / 255.0)
        logits = action_net(h)
        values = value_net(h).flatten()
        dist = torch.distributions.Categorical(logits=logits)
        logprob = dist.log_prob(actions)
        entropy = dist.entropy()
        adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        ratio = torch.exp(logprob - old_logprob)
        policy_loss = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)).mean()
        values_pred = old_values + torch.clamp(values - old_values, -clip_range_vf, clip_range_vf)
        value_loss = ((returns - values_pred) ** 2).mean()
        loss = policy_loss - ent_coef * entropy.mean() + vf_coef * value_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return loss.item()

    step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - started
    steps_per_s = args.steps / seconds
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"PyTorch {torch.__version__} on {name}: {steps_per_s:.2f} steps/s, {steps_per_s * n:.0f} samples/s at batch {n}")
    print(
        json.dumps(
            {
                "bench": "cnn-step-anchor",
                "torch": torch.__version__,
                "device": str(device),
                "device_name": name,
                "batch": n,
                "steps": args.steps,
                "steps_per_s": steps_per_s,
                "samples_per_s": steps_per_s * n,
                "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
                "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
