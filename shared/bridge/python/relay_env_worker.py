"""relay's env worker: steps a batch of Python environments for a relay
env-runner or evaluator, which owns this process.

The Rust side (shared/bridge, relay_bridge::worker) starts one interpreter per
worker with this file as the program, writes requests to its stdin and reads
replies from its stdout. Each message is a 4-byte little-endian length and a
MessagePack map. Only the protocol uses the real stdout: the environments'
own prints go to stderr, which the Rust side forwards to its logs.

Requests (``op``):
- ``init``: import what the config names, ``gymnasium.make`` the env
  ``num_envs`` times with its kwargs and wrappers, and describe its spaces.
- ``reset``: reset every env (the first reset of env ``i`` uses ``seeds[i]``).
- ``step``: one action per env, all envs stepped in one round trip. An env
  whose episode ends is reset in the same step (Stable-Baselines3's
  autoreset): its row of ``obs`` is the new episode's first observation and
  the last observation of the ended one is sent under ``final``.
- ``get_attr``: an attribute of one env's unwrapped env (for tests and tools).

A Python exception inside one env's ``step`` does not end the worker: the
traceback travels in ``failed``, the env is reset, and the Rust side drops the
episode. Anything else that goes wrong is an ``error`` reply; a reply that worked is
``{"ok": ...}``.
"""

import importlib
import math
import os
import struct
import sys
import traceback

# The protocol owns the real stdout; everything printed goes to stderr.
_PROTO_OUT = os.fdopen(os.dup(1), "wb", buffering=0)
os.dup2(2, 1)
sys.stdout = sys.stderr
_PROTO_IN = sys.stdin.buffer


def _missing(package, exc):
    return {
        "error": "missing_package",
        "package": package,
        "message": f"{exc.__class__.__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }


try:
    import msgpack
    import numpy as np
except ImportError as exc:  # the reply cannot be MessagePack: plain text on stderr, exit 3
    sys.stderr.write(f"relay env worker: missing Python package {exc.name!r} ({exc})\n")
    sys.exit(3)


def read_message():
    header = _PROTO_IN.read(4)
    if len(header) < 4:
        return None
    (length,) = struct.unpack("<I", header)
    body = _PROTO_IN.read(length)
    if len(body) < length:
        return None
    return msgpack.unpackb(body, raw=False)


def write_message(obj):
    body = msgpack.packb(obj, use_bin_type=True)
    _PROTO_OUT.write(struct.pack("<I", len(body)) + body)


# Namespaces whose envs are registered by importing a package (what a user of
# gymnasium.make would otherwise write by hand).
_NAMESPACE_SETUP = {
    "ALE": "ale_py",
    "MinAtar": "minatar.gym:register_envs",
}


def _import(target):
    """``module`` or ``module:function`` (the function is called)."""
    module_name, _, function = target.partition(":")
    module = importlib.import_module(module_name)
    if function:
        getattr(module, function)()
    return module


def _resolve(name, default_module):
    """A wrapper class: ``Name`` from ``default_module`` or ``module:Name``."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return getattr(importlib.import_module(default_module), name)


class Flattener:
    """Observation -> one float32 row, as gymnasium.spaces.flatten does
    (Discrete and MultiDiscrete become one-hot, Dict and Tuple concatenate
    their parts in order), with fast paths for Box and Discrete."""

    def __init__(self, space):
        from gymnasium import spaces

        self.space = space
        supported = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)

        def check(s, path):
            if isinstance(s, spaces.Dict):
                for key, sub in s.spaces.items():
                    check(sub, f"{path}[{key!r}]")
            elif isinstance(s, spaces.Tuple):
                for i, sub in enumerate(s.spaces):
                    check(sub, f"{path}[{i}]")
            elif not isinstance(s, supported):
                raise UnsupportedSpace(
                    f"observation space {path} is {s!r}; relay takes Box, Discrete, "
                    "MultiDiscrete and MultiBinary observations, and Dict or Tuple of them"
                )

        check(space, "")
        self.image = None
        if (
            isinstance(space, spaces.Box)
            and space.dtype in (np.uint8, np.bool_)
            and len(space.shape) in (2, 3)
        ):
            self._init_image(space)
            return
        flat = spaces.flatten_space(space)
        self.dtype = np.float32
        self.low = np.asarray(flat.low, dtype=np.float32).reshape(-1)
        self.high = np.asarray(flat.high, dtype=np.float32).reshape(-1)
        self.dim = self.low.size
        if isinstance(space, spaces.Box):
            self.kind = "box" if len(space.shape) == 1 else "box_nd"
        elif isinstance(space, spaces.Discrete):
            self.kind = "discrete"
            self.start = int(space.start)
        else:
            self.kind = "generic"
            self._flatten = spaces.flatten

    def _init_image(self, space):
        """uint8 (or bool) images travel as bytes, channels first, as
        Stable-Baselines3's VecTransposeImage lays them out: a 2-D image is
        one channel, and a 3-D one whose smallest axis is not the first
        (H, W, C) is transposed. bool images (MinAtar's) become 0/255
        pixels, so the CNN's scaling by 1/255 sees 0 and 1."""
        shape = space.shape
        if len(shape) == 2:
            self.axes = None
            chw = (1,) + tuple(shape)
        elif int(np.argmin(shape)) == 0:
            self.axes = None
            chw = tuple(shape)
        else:
            self.axes = (2, 0, 1)
            chw = (shape[2], shape[0], shape[1])
        self.image = [int(d) for d in chw]
        self.scale = 255 if space.dtype == np.bool_ else 1
        self.kind = "image"
        self.dtype = np.uint8
        self.dim = int(np.prod(chw))
        low = np.asarray(space.low, dtype=np.float32) * self.scale
        high = np.asarray(space.high, dtype=np.float32) * self.scale
        if self.axes:
            low, high = low.transpose(self.axes), high.transpose(self.axes)
        self.low = low.reshape(-1)
        self.high = high.reshape(-1)

    def write(self, obs, rows, i):
        """Writes `obs` as row `i` of `rows`."""
        if self.kind == "image":
            obs = np.asarray(obs)
            if self.scale != 1:
                obs = obs.astype(np.uint8) * np.uint8(self.scale)
            rows[i] = (obs.transpose(self.axes) if self.axes else obs).reshape(-1)
        elif self.kind == "box":
            rows[i] = obs
        elif self.kind == "box_nd":
            rows[i] = np.asarray(obs).reshape(-1)
        elif self.kind == "discrete":
            rows[i] = 0.0
            rows[i, int(obs) - self.start] = 1.0
        else:
            rows[i] = self._flatten(self.space, obs)


class UnsupportedSpace(Exception):
    pass


class Batch:
    def __init__(self, request):
        import gymnasium

        env_id = request["env_id"]
        for folder in reversed(request.get("python_path") or []):
            sys.path.insert(0, folder)
        for target in request.get("imports") or []:
            _import(target)
        namespace = env_id.split("/", 1)[0] if "/" in env_id else None
        if namespace in _NAMESPACE_SETUP:
            target = _NAMESPACE_SETUP[namespace]
            module = _import(target)
            if ":" not in target:
                gymnasium.register_envs(module)
        entry_point = request.get("entry_point")
        if entry_point and env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)
        kwargs = request.get("kwargs") or {}
        wrappers = request.get("wrappers") or []
        self.envs = []
        for _ in range(request["num_envs"]):
            env = gymnasium.make(env_id, **kwargs)
            for wrapper in wrappers:
                cls = _resolve(wrapper["name"], "gymnasium.wrappers")
                env = cls(env, **(wrapper.get("kwargs") or {}))
            self.envs.append(env)
        self.seeds = list(request["seeds"])
        first = self.envs[0]
        self.flattener = Flattener(first.observation_space)
        self.action = self._action_space(first.action_space)
        self.n = len(self.envs)
        self.obs = np.zeros((self.n, self.flattener.dim), dtype=self.flattener.dtype)
        self.spec = {
            "obs_low": self.flattener.low.tobytes(),
            "obs_high": self.flattener.high.tobytes(),
            "action": self.action["wire"],
            "max_episode_steps": first.spec.max_episode_steps if first.spec else None,
            "reward_threshold": first.spec.reward_threshold if first.spec else None,
            "image": self.flattener.image,
        }

    def _action_space(self, space):
        from gymnasium import spaces

        if isinstance(space, spaces.Discrete):
            return {"kind": "discrete", "start": int(space.start), "wire": {"kind": "discrete", "n": int(space.n)}}
        if isinstance(space, spaces.Box) and np.issubdtype(space.dtype, np.floating):
            return {
                "kind": "box",
                "shape": space.shape,
                "dtype": space.dtype,
                "wire": {
                    "kind": "box",
                    "low": np.asarray(space.low, dtype=np.float32).reshape(-1).tobytes(),
                    "high": np.asarray(space.high, dtype=np.float32).reshape(-1).tobytes(),
                },
            }
        raise UnsupportedSpace(
            f"action space is {space!r}; relay's policies take Discrete or float Box actions"
        )

    def _reset_one(self, i):
        seed = self.seeds[i]
        self.seeds[i] = None
        obs, _info = self.envs[i].reset(seed=seed)
        self.flattener.write(obs, self.obs, i)

    def reset(self):
        for i in range(self.n):
            self._reset_one(i)
        return {"obs": self.obs.tobytes()}

    def step(self, request):
        n = self.n
        if self.action["kind"] == "discrete":
            actions = np.frombuffer(request["actions"], dtype=np.int64).tolist()
            start = self.action["start"]
            if start:
                actions = [a + start for a in actions]
        else:
            flat = np.frombuffer(request["actions"], dtype=np.float32)
            actions = flat.reshape((n,) + tuple(self.action["shape"])).astype(self.action["dtype"])
        # Plain lists, packed once: cheaper than NumPy scalar writes per env.
        rewards = [0.0] * n
        terminated = [False] * n
        truncated = [False] * n
        final = {}
        failed = []
        write = self.flattener.write
        rows = self.obs
        for i, env in enumerate(self.envs):
            try:
                obs, reward, term, trunc, _info = env.step(actions[i])
                rewards[i] = float(reward)
                terminated[i] = term = bool(term)
                truncated[i] = trunc = bool(trunc)
                write(obs, rows, i)
                if term or trunc:
                    final[i] = rows[i].tobytes()
                    self._reset_one(i)
            except Exception:
                failed.append([i, traceback.format_exc()])
                rewards[i] = 0.0
                terminated[i] = truncated[i] = False
                self._reset_one(i)
        self._refuse_non_finite(rows, rewards, terminated, truncated, final, failed)
        return {
            "obs": rows.tobytes(),
            "rewards": struct.pack(f"<{n}d", *rewards),
            "terminated": bytes(terminated),
            "truncated": bytes(truncated),
            "final": final,
            "failed": failed,
        }

    def _refuse_non_finite(self, rows, rewards, terminated, truncated, final, failed):
        """NaN or infinity in an observation or a reward is a fault of that
        env (named, and its episode dropped), never data. One check of the
        whole batch in the common case."""
        if rows.dtype == np.uint8 and all(math.isfinite(r) for r in rewards):
            return
        if np.isfinite(rows).all() and all(math.isfinite(r) for r in rewards) and not any(
            not np.isfinite(np.frombuffer(b, dtype=np.float32)).all() for b in final.values()
        ):
            return
        already = {i for i, _ in failed}
        for i in range(self.n):
            if i in already:
                continue
            last = np.frombuffer(final[i], dtype=rows.dtype) if i in final else rows[i]
            bad = None
            if not math.isfinite(rewards[i]):
                bad = f"reward {rewards[i]}"
            elif not np.isfinite(last).all():
                j = int(np.flatnonzero(~np.isfinite(last))[0])
                bad = f"observation component {j} = {last[j]}"
            elif not np.isfinite(rows[i]).all():
                j = int(np.flatnonzero(~np.isfinite(rows[i]))[0])
                bad = f"first observation after reset, component {j} = {rows[i][j]}"
            if bad is None:
                continue
            failed.append([i, f"ValueError: the env returned a non-finite {bad}"])
            rewards[i] = 0.0
            terminated[i] = truncated[i] = False
            final.pop(i, None)
            self._reset_one(i)

    def get_attr(self, request):
        value = getattr(self.envs[request["index"]].unwrapped, request["name"])
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif isinstance(value, np.generic):
            value = value.item()
        return {"value": value}


def _init(request):
    import gymnasium.error

    try:
        return Batch(request), None
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "?", exc)
    except UnsupportedSpace as exc:
        return None, {"error": "unsupported_space", "message": str(exc), "traceback": ""}
    except gymnasium.error.Error as exc:
        return None, {
            "error": "unknown_env",
            "message": f"{exc.__class__.__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }


def main():
    batch = None
    while True:
        request = read_message()
        if request is None:
            return
        op = request.get("op")
        try:
            if op == "init":
                try:
                    import gymnasium  # noqa: F401
                except ModuleNotFoundError as exc:
                    write_message(_missing("gymnasium", exc))
                    continue
                batch, error = _init(request)
                write_message(error if error else {"ok": batch.spec})
            elif batch is None:
                write_message({"error": "protocol", "message": f"{op!r} before init", "traceback": ""})
            elif op == "reset":
                write_message({"ok": batch.reset()})
            elif op == "step":
                write_message({"ok": batch.step(request)})
            elif op == "get_attr":
                write_message({"ok": batch.get_attr(request)})
            else:
                write_message({"error": "protocol", "message": f"unknown op {op!r}", "traceback": ""})
        except Exception as exc:
            write_message({
                "error": "exception",
                "message": f"{exc.__class__.__name__}: {exc}",
                "traceback": traceback.format_exc(),
            })


if __name__ == "__main__":
    main()
