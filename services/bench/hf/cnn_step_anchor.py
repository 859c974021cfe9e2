"""The anchor of `relay-bench bench-cnn-step`: the same PPO train step in
PyTorch, as Stable-Baselines3 runs it for Atari's `CnnPolicy`: NatureCNN on
4 x 84 x 84 frames scaled by 1/255 (conv 8/4, 4/2, 3/1 with ReLU, a
512-wide linear layer), separate action (6) and value heads on its
features, the clipped surrogate with clipped values and an entropy bonus,
gradient-norm clipping at 0.5 and Adam (lr 2.5e-4, eps 1e-5).

Random frames, actions and advantages; for each setting one warm-up
step, then `--steps` timed steps, each ending with the loss read back
(which synchronises CUDA), as relay's step ends. Two settings, each a row:

- `as-relay` (the comparison with relay): what relay's step does, the
  frames (f32, pixel values 0..255) and actions uploaded from host memory
  every step, and TF32 off for cuDNN's convolutions and for matmuls
  (relay's kernels compute in full f32);
- `defaults`: as SB3 users get PyTorch, the frames already on the device
  as uint8 (converted there), TF32 as PyTorch sets it by default (on for
  cuDNN's convolutions).

Prints a line per setting, then one JSON line (its `samples_per_s` is the
`as-relay` row's).
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


def set_tf32(enabled):
    """The legacy switches, which every PyTorch since 1.7 reads (newer ones
    refuse a mix of these and the `fp32_precision` ones)."""
    torch.backends.cudnn.allow_tf32 = enabled
    torch.backends.cuda.matmul.allow_tf32 = enabled


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    defaults = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    rows = []
    for setting in ["as-relay", "defaults"]:
        if setting == "as-relay":
            set_tf32(False)
        else:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = defaults
        steps_per_s = timed_steps(device, args.batch, args.steps, upload=setting == "as-relay")
        row = {
            "setting": setting,
            "steps_per_s": steps_per_s,
            "samples_per_s": steps_per_s * args.batch,
            "frames": "f32 from the host every step" if setting == "as-relay" else "uint8 on the device",
            "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        }
        rows.append(row)
        print(
            f"PyTorch {torch.__version__} on {name}, {setting} ({row['frames']}, cuDNN TF32 "
            f"{'on' if row['cudnn_tf32'] else 'off'}): {steps_per_s:.2f} steps/s, "
            f"{row['samples_per_s']:.0f} samples/s at batch {args.batch}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "bench": "cnn-step-anchor",
                "torch": torch.__version__,
                "device": str(device),
                "device_name": name,
                "batch": args.batch,
                "steps": args.steps,
                "setting": rows[0]["setting"],
                "steps_per_s": rows[0]["steps_per_s"],
                "samples_per_s": rows[0]["samples_per_s"],
                "settings": rows,
                "threads": torch.get_num_threads(),
            }
        )
    )


def timed_steps(device, n, steps, upload):
    """Steps/s of the PPO step on a fresh model and minibatch; `upload`:
    frames and actions come from host memory every step, as relay's do."""
    torch.manual_seed(0)
    actions_n = 6
    features, action_net, value_net = (m.to(device) for m in nature_cnn(actions_n))
    params = [*features.parameters(), *action_net.parameters(), *value_net.parameters()]
    opt = torch.optim.Adam(params, lr=2.5e-4, eps=1e-5)
    frames_u8 = torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8)
    actions_host = torch.randint(0, actions_n, (n,))
    # relay's learner holds the frames as f32 pixel values in host memory.
    frames_host = frames_u8.to(torch.float32).numpy()
    frames_device = frames_u8.to(device)
    actions_device = actions_host.to(device)
    old_logprob = torch.empty(n, device=device).uniform_(-2.2, -1.4)
    old_values = torch.empty(n, device=device).uniform_(-0.5, 0.5)
    advantages = torch.empty(n, device=device).uniform_(-1.0, 1.0)
    returns = torch.empty(n, device=device).uniform_(-1.0, 1.0)
    clip_range, clip_range_vf, ent_coef, vf_coef = 0.1, 0.1, 0.01, 0.5

    def step():
        if upload:
            obs = torch.from_numpy(frames_host).to(device)
            actions = actions_host.to(device)
        else:
            obs = frames_device.float()
            actions = actions_device
        h = features(obs / 255.0)
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
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - started)


if __name__ == "__main__":
    main()
