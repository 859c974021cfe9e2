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
- With ``action_masks`` asked for at ``init`` and an env whose reset info
  has ``action_mask`` (Taxi's), ``reset`` and ``step`` also send ``masks``
  (one uint8 row per env, 1 = legal) and ``step`` the final observations'
  ``final_masks``; a mask the policy must act on with no legal action is
  the env's fault, like a non-finite observation.
- ``get_attr``: an attribute of one env's unwrapped env (for tests and tools).

PettingZoo games (``init`` with ``pettingzoo``, see ``AgentBatch``) answer
the same ops: one action per env for the agent to move, observations and
masks of the agent to move next (``movers``), every agent's rewards.

TextArena games (``text_*`` ops, see ``TextGames``) are served by the same
program: ``text_init`` once, then ``text_make``, ``text_step``,
``text_reset``, ``text_clone`` and ``text_close`` on numbered games, each
reply a snapshot of the game (see ``TextGame.snapshot``).

A Python exception inside one env's ``step`` does not end the worker: the
traceback travels in ``failed``, the env is reset, and the Rust side drops the
episode. Anything else that goes wrong is an ``error`` reply; a reply that worked is
``{"ok": ...}``.
"""

import copy
import difflib
import importlib
import math
import random
import re
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
    """A wrapper class: ``Name`` from ``default_module`` (or, failing that,
    relay's own below), or ``module:Name``."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    module = importlib.import_module(default_module)
    if not hasattr(module, name) and name in _RELAY_WRAPPERS:
        return _RELAY_WRAPPERS[name]
    return getattr(module, name)


def _fire_reset():
    import gymnasium

    class FireReset(gymnasium.Wrapper):
        """Presses FIRE (then UP, action 2) after every reset, for Atari
        games that wait for it to start (Breakout launches its ball so),
        as Stable-Baselines3's ``FireResetEnv`` in its ``AtariWrapper``:
        a policy never has to learn to start the game, and a greedy one
        that never fires does not idle to the time limit."""

        def __init__(self, env):
            super().__init__(env)
            meanings = env.unwrapped.get_action_meanings()
            if len(meanings) < 3 or meanings[1] != "FIRE":
                raise ValueError(f"FireReset needs FIRE as action 1, the env has {meanings}")

        def reset(self, **kwargs):
            obs, info = self.env.reset(**kwargs)
            for action in (1, 2):
                obs, _, terminated, truncated, info = self.env.step(action)
                if terminated or truncated:
                    obs, info = self.env.reset(**kwargs)
            return obs, info

    return FireReset


class _LazyWrappers(dict):
    """relay's own wrappers, by name, made on first use (gymnasium is
    imported only by workers that make Gymnasium envs)."""

    _makers = {"FireReset": _fire_reset}

    def __contains__(self, name):
        return name in self._makers

    def __missing__(self, name):
        self[name] = self._makers[name]()
        return self[name]


_RELAY_WRAPPERS = _LazyWrappers()


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


def _get_attr(envs, request):
    """An attribute of one env's unwrapped env, as plain Python values."""
    value = getattr(envs[request["index"]].unwrapped, request["name"])
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    return {"value": value}


class UnsupportedSpace(Exception):
    pass


def _action_space(space):
    """How actions of ``space`` travel: Discrete (with its start) or a float
    Box (with its shape and dtype); anything else is refused."""
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


def _decode_actions(action, raw, n):
    """The ``n`` actions of a step request, as the env takes them."""
    if action["kind"] == "discrete":
        actions = np.frombuffer(raw, dtype=np.int64).tolist()
        start = action["start"]
        return [a + start for a in actions] if start else actions
    flat = np.frombuffer(raw, dtype=np.float32)
    return flat.reshape((n,) + tuple(action["shape"])).astype(action["dtype"])


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
        self.action = _action_space(first.action_space)
        self.n = len(self.envs)
        self.obs = np.zeros((self.n, self.flattener.dim), dtype=self.flattener.dtype)
        self.env_id = env_id
        self.steps = [0] * self.n
        self.masks = None
        if request.get("action_masks") and self.action["kind"] == "discrete":
            # Whether the env gives masks shows in a reset's info; the env's
            # first reset repeats this one (same seed).
            _obs, info = first.reset(seed=self.seeds[0])
            if isinstance(info, dict) and "action_mask" in info:
                self.masks = np.ones((self.n, self.action["wire"]["n"]), dtype=np.uint8)
        self.spec = {
            "obs_low": self.flattener.low.tobytes(),
            "obs_high": self.flattener.high.tobytes(),
            "action": self.action["wire"],
            "max_episode_steps": first.spec.max_episode_steps if first.spec else None,
            "reward_threshold": first.spec.reward_threshold if first.spec else None,
            "image": self.flattener.image,
            "action_mask": self.masks is not None,
        }

    def _reset_one(self, i):
        seed = self.seeds[i]
        self.seeds[i] = None
        obs, info = self.envs[i].reset(seed=seed)
        self.flattener.write(obs, self.obs, i)
        self.steps[i] = 0
        if self.masks is not None:
            self._write_mask(info, i)

    def _mask_of(self, info):
        """``info["action_mask"]`` as one uint8 row of the action count."""
        if not isinstance(info, dict) or "action_mask" not in info:
            raise ValueError("the env gave no info['action_mask'] (it did at its first reset)")
        mask = np.asarray(info["action_mask"]).astype(np.uint8).reshape(-1)
        if mask.size != self.masks.shape[1]:
            raise ValueError(f"info['action_mask'] has {mask.size} entries for {self.masks.shape[1]} actions")
        return np.minimum(mask, 1)

    def _write_mask(self, info, i):
        """The mask the policy acts on next: one with no legal action is
        the env's fault, named with the episode step."""
        mask = self._mask_of(info)
        if not mask.any():
            raise ValueError(
                f"{self.env_id}: the action mask at episode step {self.steps[i]} allows no action"
            )
        self.masks[i] = mask

    def _reply(self, reply):
        if self.masks is not None:
            reply["masks"] = self.masks.tobytes()
        return reply

    def reset(self):
        for i in range(self.n):
            self._reset_one(i)
        return self._reply({"obs": self.obs.tobytes()})

    def step(self, request):
        n = self.n
        actions = _decode_actions(self.action, request["actions"], n)
        # Plain lists, packed once: cheaper than NumPy scalar writes per env.
        rewards = [0.0] * n
        terminated = [False] * n
        truncated = [False] * n
        final = {}
        final_masks = {}
        failed = []
        write = self.flattener.write
        rows = self.obs
        masked = self.masks is not None
        for i, env in enumerate(self.envs):
            try:
                obs, reward, term, trunc, info = env.step(actions[i])
                self.steps[i] += 1
                rewards[i] = float(reward)
                terminated[i] = term = bool(term)
                truncated[i] = trunc = bool(trunc)
                write(obs, rows, i)
                if term or trunc:
                    final[i] = rows[i].tobytes()
                    if masked:
                        # A game's last state may allow no move; nothing acts in it.
                        final_masks[i] = self._mask_of(info).tobytes()
                    self._reset_one(i)
                elif masked:
                    self._write_mask(info, i)
            except Exception:
                failed.append([i, traceback.format_exc()])
                rewards[i] = 0.0
                terminated[i] = truncated[i] = False
                final.pop(i, None)
                final_masks.pop(i, None)
                self._reset_one(i)
        self._refuse_non_finite(rows, rewards, terminated, truncated, final, failed)
        reply = {
            "obs": rows.tobytes(),
            "rewards": struct.pack(f"<{n}d", *rewards),
            "terminated": bytes(terminated),
            "truncated": bytes(truncated),
            "final": final,
            "failed": failed,
        }
        if masked:
            reply["final_masks"] = {i: m for i, m in final_masks.items() if i in final}
        return self._reply(reply)

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
        return _get_attr(self.envs, request)


# Where PettingZoo keeps its games: ``connect_four_v3`` is
# ``pettingzoo.classic.connect_four_v3``; the MPE family moved to its own
# package, ``mpe2``, which is looked in first.
_PETTINGZOO_FAMILIES = ("mpe2", "pettingzoo.classic", "pettingzoo.butterfly", "pettingzoo.sisl", "pettingzoo.atari", "pettingzoo.mpe")


def _pettingzoo_module(env_id):
    """The module of a PettingZoo id in one of its families, or None."""
    for family in _PETTINGZOO_FAMILIES:
        try:
            return importlib.import_module(f"{family}.{env_id}")
        except ModuleNotFoundError as exc:
            if exc.name not in (family, f"{family}.{env_id}", family.split(".")[0]):
                raise
    return None


def _is_pettingzoo(request):
    """Whether ``init`` makes a PettingZoo game: ``env.backend: pettingzoo``,
    or ``auto`` and an id that Gymnasium does not know but a PettingZoo
    family does."""
    backend = request.get("backend")
    if backend == "pettingzoo":
        return True
    if backend != "auto" or request.get("entry_point"):
        return False
    env_id = request["env_id"]
    import gymnasium

    if env_id in gymnasium.registry or "/" in env_id:
        return False
    try:
        return _pettingzoo_module(env_id) is not None
    except ModuleNotFoundError:
        # The game is there and a package it needs is not: said by its init.
        return True


def _pettingzoo_env(request, parallel):
    """A PettingZoo game of the request's id (a module of one of its
    families, or ``entry_point`` ``module:function`` returning an AEC or
    parallel env), as an AEC env (parallel games through PettingZoo's own
    ``parallel_to_aec``) or, with ``parallel``, a parallel env (AEC games
    through ``aec_to_parallel``), with ``env.wrappers`` applied (SuperSuit's
    by name: ``color_reduction_v0``, ``frame_stack_v1``, ...)."""
    from pettingzoo.utils import conversions
    from pettingzoo.utils.env import ParallelEnv

    env_id = request["env_id"]
    kwargs = request.get("kwargs") or {}
    entry_point = request.get("entry_point")
    if entry_point:
        module_name, _, function = entry_point.partition(":")
        env = getattr(importlib.import_module(module_name), function or "env")(**kwargs)
    else:
        module = _pettingzoo_module(env_id)
        if module is None:
            raise UnknownPettingZoo(env_id)
        if module.__name__.startswith("pettingzoo.atari.") and "auto_rom_install_path" not in kwargs:
            # The ROMs ale-py ships (roms/<game>.bin), rather than AutoROM's download.
            import ale_py

            kwargs = {**kwargs, "auto_rom_install_path": os.path.dirname(ale_py.__file__)}
        make = getattr(module, "parallel_env", None) if parallel else None
        env = make(**kwargs) if make else module.env(**kwargs)
    for wrapper in request.get("wrappers") or []:
        env = _resolve(wrapper["name"], "supersuit")(env, **(wrapper.get("kwargs") or {}))
    if parallel and not isinstance(env, ParallelEnv):
        env = conversions.aec_to_parallel(env)
    elif not parallel and isinstance(env, ParallelEnv):
        env = conversions.parallel_to_aec(env)
    return env


def _plays_as_team(request):
    """Whether a PettingZoo game is played by one policy shared by all its
    agents acting at once (``env.multi_agent: shared``), rather than by
    self-play taking turns (``self_play``). ``auto``: PettingZoo's classic
    games (turns, two sides) by self-play, every other family and any
    parallel env of a user's ``entry_point`` shared."""
    mode = request.get("multi_agent") or "auto"
    if mode != "auto":
        return mode == "shared"
    entry_point = request.get("entry_point")
    if entry_point:
        from pettingzoo.utils.env import ParallelEnv

        module_name, _, function = entry_point.partition(":")
        if module_name.startswith("pettingzoo.classic."):
            return False
        maker = getattr(importlib.import_module(module_name), function or "env")
        return isinstance(maker(**(request.get("kwargs") or {})), ParallelEnv)
    module = _pettingzoo_module(request["env_id"])
    return module is not None and not module.__name__.startswith("pettingzoo.classic.")


class UnknownPettingZoo(Exception):
    pass


class SeatRows:
    """Observation rows of a multi-agent game: the flattened observation,
    ended with env.seat_feature by a one-hot of the seat (or agent) it
    belongs to, so that one shared policy and its value know the role
    they play (SuperSuit's ``agent_indicator_v0``). Flat observations only."""

    def __init__(self, flattener, seats, enabled, env_id):
        if enabled and flattener.image is not None:
            raise UnsupportedSpace(
                f"env.seat_feature appends the seat to flat observations; {env_id}'s are images"
            )
        self.flattener = flattener
        self.seats = seats if enabled else 0
        self.dim = flattener.dim + self.seats
        self.low, self.high = flattener.low, flattener.high
        if self.seats:
            self.low = np.concatenate([self.low, np.zeros(seats, np.float32)])
            self.high = np.concatenate([self.high, np.ones(seats, np.float32)])

    def write(self, obs, rows, i, seat):
        """Writes ``obs`` of ``seat`` as row ``i`` of ``rows`` (``dim`` wide)."""
        fdim = self.flattener.dim
        self.flattener.write(obs, rows[:, :fdim], i)
        if self.seats:
            rows[i, fdim:] = 0.0
            rows[i, fdim + seat] = 1.0


class AgentBatch:
    """``num_envs`` copies of a PettingZoo game, stepped the way
    ``env.agent_iter()``, ``env.last()`` and ``env.step()`` are: each
    request carries one action per env, for the agent to move there
    (``agent_selection``); agents that are done are stepped with ``None``
    here, and a game whose agents are all done is reset in the same step.

    Every agent shares one observation and one action space; a Dict
    observation with ``observation`` and ``action_mask`` (PettingZoo's
    classic games) gives both, an ``action_mask`` in the agent's info the
    mask too. Rewards are summed per agent over every ``step`` call between
    two requests (``env.rewards`` holds each call's), so each agent's return
    is what ``env.last()`` accumulates."""

    def __init__(self, request):
        self.env_id = request["env_id"]
        self.envs = [_pettingzoo_env(request, parallel=False) for _ in range(request["num_envs"])]
        self.seeds = list(request["seeds"])
        self.n = len(self.envs)
        first = self.envs[0]
        self.agents = list(first.possible_agents)
        self.seat = {a: i for i, a in enumerate(self.agents)}
        spaces = {(repr(first.observation_space(a)), repr(first.action_space(a))) for a in self.agents}
        if len(spaces) != 1:
            raise UnsupportedSpace(
                f"the agents of {self.env_id} have different observation or action spaces; "
                "relay's self-play shares one policy among them"
            )
        space = first.observation_space(self.agents[0])
        from gymnasium import spaces as gym_spaces

        self.dict_obs = isinstance(space, gym_spaces.Dict) and "observation" in space.spaces
        self.flattener = Flattener(space["observation"] if self.dict_obs else space)
        action = first.action_space(self.agents[0])
        if not isinstance(action, gym_spaces.Discrete):
            raise UnsupportedSpace(f"action space is {action!r}; relay's self-play takes Discrete actions")
        self.start = int(action.start)
        self.n_actions = int(action.n)
        self.masked = bool(request.get("action_masks")) and (
            (self.dict_obs and "action_mask" in space.spaces) or self._probe_info_mask(first)
        )
        self.rows = SeatRows(self.flattener, len(self.agents), bool(request.get("seat_feature")), self.env_id)
        self.dim = self.rows.dim
        low, high = self.rows.low, self.rows.high
        self.obs = np.zeros((self.n, self.dim), dtype=self.flattener.dtype)
        self.masks = np.ones((self.n, self.n_actions), dtype=np.uint8)
        self.movers = [0] * self.n
        self.steps = [0] * self.n
        self.spec = {
            "obs_low": low.tobytes(),
            "obs_high": high.tobytes(),
            "action": {"kind": "discrete", "n": self.n_actions},
            "max_episode_steps": None,
            "reward_threshold": None,
            "image": self.flattener.image,
            "action_mask": self.masked,
            "agents": self.agents,
        }

    def _probe_info_mask(self, env):
        env.reset(seed=self.seeds[0])
        info = env.infos.get(env.agent_selection, {})
        return isinstance(info, dict) and "action_mask" in info

    def _observation(self, env, agent):
        obs = env.observe(agent)
        return obs["observation"] if self.dict_obs else obs

    def _mask(self, env, agent, raw):
        if self.dict_obs and "action_mask" in raw:
            mask = raw["action_mask"]
        else:
            mask = env.infos.get(agent, {}).get("action_mask")
            if mask is None:
                raise ValueError(f"{self.env_id}: {agent} has no action mask (the game gave one before)")
        return np.minimum(np.asarray(mask).astype(np.uint8).reshape(-1), 1)

    def _advance(self, i, rewards, finals):
        """Steps done agents with ``None`` until one must act or the game
        is over (then returns False); adds every call's rewards."""
        env = self.envs[i]
        while env.agents:
            agent = env.agent_selection
            if not (env.terminations[agent] or env.truncations[agent]):
                raw = env.observe(agent)
                self.rows.write(raw["observation"] if self.dict_obs else raw, self.obs, i, self.seat[agent])
                self.movers[i] = self.seat[agent]
                if self.masked:
                    mask = self._mask(env, agent, raw)
                    if not mask.any():
                        raise ValueError(
                            f"{self.env_id}: the action mask of {agent} at episode step {self.steps[i]} allows no action"
                        )
                    self.masks[i] = mask
                return True
            if finals is not None:
                row = np.zeros((1, self.dim), dtype=self.flattener.dtype)
                self.rows.write(self._observation(env, agent), row, 0, self.seat[agent])
                finals[self.seat[agent]] = row[0]
                finals["truncated"] = finals.get("truncated", False) or (
                    env.truncations[agent] and not env.terminations[agent]
                )
            env.step(None)
            for agent, r in env.rewards.items():
                rewards[i, self.seat[agent]] += float(r)
        return False

    def _reset_one(self, i, rewards):
        seed = self.seeds[i]
        self.seeds[i] = None
        self.envs[i].reset(seed=seed)
        self.steps[i] = 0
        if not self._advance(i, rewards, None):
            raise ValueError(f"{self.env_id}: a game that is over as it starts")

    def _reply(self, reply):
        reply["obs"] = self.obs.tobytes()
        reply["movers"] = bytes(self.movers)
        if self.masked:
            reply["masks"] = self.masks.tobytes()
        return reply

    def reset(self):
        rewards = np.zeros((self.n, len(self.agents)))
        for i in range(self.n):
            self._reset_one(i, rewards)
        return self._reply({})

    def step(self, request):
        actions = np.frombuffer(request["actions"], dtype=np.int64).tolist()
        n, k = self.n, len(self.agents)
        rewards = np.zeros((n, k))
        terminated = [False] * n
        truncated = [False] * n
        final = {}
        failed = []
        for i, env in enumerate(self.envs):
            try:
                env.step(actions[i] + self.start)
                self.steps[i] += 1
                for agent, r in env.rewards.items():
                    rewards[i, self.seat[agent]] += float(r)
                finals = {}
                if not self._advance(i, rewards, finals):
                    truncated[i] = bool(finals.pop("truncated", False))
                    terminated[i] = not truncated[i]
                    final[i] = b"".join(
                        (finals[s] if s in finals else np.zeros(self.dim, self.flattener.dtype)).tobytes()
                        for s in range(k)
                    )
                    self._reset_one(i, np.zeros((n, k)))
            except Exception:
                failed.append([i, traceback.format_exc()])
                rewards[i] = 0.0
                terminated[i] = truncated[i] = False
                final.pop(i, None)
                self._reset_one(i, np.zeros((n, k)))
        bad = [i for i in range(n) if not np.isfinite(rewards[i]).all()]
        for i in bad:
            failed.append([i, f"ValueError: {self.env_id} returned a non-finite reward {rewards[i].tolist()}"])
            rewards[i] = 0.0
            terminated[i] = truncated[i] = False
            final.pop(i, None)
            self._reset_one(i, np.zeros((n, k)))
        return self._reply({
            "seat_rewards": rewards.astype("<f8").tobytes(),
            "terminated": bytes(terminated),
            "truncated": bytes(truncated),
            "final": final,
            "failed": failed,
        })

    def get_attr(self, request):
        return _get_attr(self.envs, request)


class TeamBatch:
    """Parallel PettingZoo games played by one policy shared by all their
    agents (parameter sharing, as SuperSuit's ``pettingzoo_env_to_vec_env_v1``
    gives Stable-Baselines3): every agent of every game is a row of the
    batch, the ``K`` agents of a game ``K`` consecutive rows in
    ``possible_agents`` order, all acting at once each step, each with its
    own reward. A worker's ``num_envs`` rows are ``num_envs / K`` games.

    An agent done before its game ends is kept as SuperSuit's
    ``black_death_v3`` keeps it: zero observations and rewards, its actions
    ignored, until the game ends. Then every row of the game ends at once
    (truncated where the agent was cut by the time limit, else terminated)
    and the game is reset: one episode per agent, all of the same length."""

    def __init__(self, request):
        from gymnasium import spaces as gym_spaces

        self.env_id = request["env_id"]
        probe = _pettingzoo_env(request, parallel=True)
        self.agents = list(probe.possible_agents)
        k = self.k = len(self.agents)
        # A probe (the spec alone) makes one game, whatever its rows.
        rows = k if request.get("probe") else request["num_envs"]
        if rows % k:
            raise UnsupportedSpace(
                f"{self.env_id} has {k} agents, each one row of the batch: "
                f"a worker's {rows} rows are not whole games; set env_runner.num_envs to a multiple of {k}"
                " (and env.workers to a divisor of the games)"
            )
        spaces = {(repr(probe.observation_space(a)), repr(probe.action_space(a))) for a in self.agents}
        if len(spaces) != 1:
            raise UnsupportedSpace(
                f"the agents of {self.env_id} have different observation or action spaces, and one "
                "policy acts for all of them: pad them as SuperSuit does, with env.wrappers "
                "[{name: pad_observations_v0}, {name: pad_action_space_v0}]"
            )
        self.envs = [probe] + [_pettingzoo_env(request, parallel=True) for _ in range(rows // k - 1)]
        space = probe.observation_space(self.agents[0])
        self.dict_obs = isinstance(space, gym_spaces.Dict) and "observation" in space.spaces
        self.flattener = Flattener(space["observation"] if self.dict_obs else space)
        self.action = _action_space(probe.action_space(self.agents[0]))
        self.masked = bool(request.get("action_masks")) and self.action["kind"] == "discrete" and (
            self.dict_obs and "action_mask" in space.spaces
        )
        self.rows = SeatRows(self.flattener, k, bool(request.get("seat_feature")), self.env_id)
        self.dim = self.rows.dim
        low, high = self.rows.low, self.rows.high
        self.n = rows
        self.obs = np.zeros((rows, self.dim), dtype=self.flattener.dtype)
        self.masks = np.ones((rows, self.action["wire"]["n"]), dtype=np.uint8) if self.masked else None
        # One seed per game: its first row's.
        self.seeds = list(request["seeds"])[::k]
        self.spec = {
            "obs_low": low.tobytes(),
            "obs_high": high.tobytes(),
            "action": self.action["wire"],
            "max_episode_steps": (request.get("kwargs") or {}).get("max_cycles"),
            "reward_threshold": None,
            "image": self.flattener.image,
            "action_mask": self.masked,
            "team": self.agents,
        }

    def _write(self, row, obs, j):
        """Writes agent ``j``'s observation ``obs`` (None: a done agent's
        zeros) as row ``row`` of the batch; its mask too."""
        if obs is None:
            self.obs[row] = 0
            if self.masked:
                self.masks[row] = 1
            return
        self.rows.write(obs["observation"] if self.dict_obs else obs, self.obs, row, j)
        if self.masked:
            mask = np.minimum(np.asarray(obs["action_mask"]).astype(np.uint8).reshape(-1), 1)
            if not mask.any():
                raise ValueError(f"{self.env_id}: the action mask of {self.agents[j]} allows no action")
            self.masks[row] = mask

    def _reset_game(self, g):
        seed = self.seeds[g]
        self.seeds[g] = None
        obs, _infos = self.envs[g].reset(seed=seed)
        for j, agent in enumerate(self.agents):
            self._write(g * self.k + j, obs.get(agent), j)

    def _reply(self, reply):
        reply["obs"] = self.obs.tobytes()
        if self.masked:
            reply["masks"] = self.masks.tobytes()
        return reply

    def reset(self):
        for g in range(len(self.envs)):
            self._reset_game(g)
        return self._reply({})

    def step(self, request):
        n, k = self.n, self.k
        actions = _decode_actions(self.action, request["actions"], n)
        rewards = [0.0] * n
        terminated = [False] * n
        truncated = [False] * n
        final = {}
        final_masks = {}
        failed = []
        for g, env in enumerate(self.envs):
            base = g * k
            try:
                alive = set(env.agents)
                act = {a: actions[base + j] for j, a in enumerate(self.agents) if a in alive}
                obs, rew, term, trunc, _infos = env.step(act)
                over = not env.agents
                for j, agent in enumerate(self.agents):
                    row = base + j
                    rewards[row] = float(rew.get(agent, 0.0))
                    if not math.isfinite(rewards[row]):
                        raise ValueError(f"{self.env_id} returned a non-finite reward {rewards[row]} for {agent}")
                    # An agent done before the game's end reads zeros.
                    self._write(row, obs.get(agent) if over or agent in env.agents else None, j)
                if over:
                    for j, agent in enumerate(self.agents):
                        row = base + j
                        cut = bool(trunc.get(agent, False)) and not bool(term.get(agent, False))
                        truncated[row] = cut
                        terminated[row] = not cut
                        final[row] = self.obs[row].tobytes()
                        if self.masked:
                            final_masks[row] = self.masks[row].tobytes()
                    self._reset_game(g)
                if self.obs.dtype != np.uint8 and not np.isfinite(self.obs[base:base + k]).all():
                    raise ValueError(f"{self.env_id} returned a non-finite observation")
            except Exception:
                detail = traceback.format_exc()
                for row in range(base, base + k):
                    failed.append([row, detail])
                    rewards[row] = 0.0
                    terminated[row] = truncated[row] = False
                    final.pop(row, None)
                    final_masks.pop(row, None)
                self._reset_game(g)
        reply = {
            "rewards": struct.pack(f"<{n}d", *rewards),
            "terminated": bytes(terminated),
            "truncated": bytes(truncated),
            "final": final,
            "failed": failed,
        }
        if self.masked:
            reply["final_masks"] = final_masks
        return self._reply(reply)

    def get_attr(self, request):
        return _get_attr(self.envs, request)


def _agents_init(request):
    try:
        import pettingzoo  # noqa: F401
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "pettingzoo", exc)
    try:
        for folder in reversed(request.get("python_path") or []):
            sys.path.insert(0, folder)
        for target in request.get("imports") or []:
            _import(target)
        batch = TeamBatch(request) if _plays_as_team(request) else AgentBatch(request)
        return batch, None
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "?", exc)
    except UnsupportedSpace as exc:
        return None, {"error": "unsupported_space", "message": str(exc), "traceback": ""}
    except UnknownPettingZoo as exc:
        import pkgutil
        import pettingzoo

        known = []
        for family in _PETTINGZOO_FAMILIES:
            try:
                package = importlib.import_module(family)
            except Exception:
                continue
            known += [m.name for m in pkgutil.iter_modules(package.__path__) if re.search(r"_v\d+$", m.name)]
        close = difflib.get_close_matches(str(exc), known, n=5, cutoff=0.6)
        return None, {
            "error": "unknown_env",
            "message": f"PettingZoo {pettingzoo.__version__} has no game {str(exc)!r}"
            + (f"; similar ids: {', '.join(close)}" if close else ""),
            "traceback": "",
        }


# A heading that TextArena games put before the moves a player may make
# ("Available Moves: '[0]', '[1]'", "Your available actions are: '[check]'",
# "Valid moves: [e2e4], ..."): the bracketed tokens after it are the legal moves.
_LEGAL_HEADING = re.compile(r"(?i)(?:available|valid|legal)\s+(?:moves|actions)[^:\n]{0,20}:")
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def _legal_moves(messages):
    """The moves the newest message with a legal-move heading lists, or []."""
    for _sender, message, _kind in reversed(messages):
        found = None
        for found in _LEGAL_HEADING.finditer(message):
            pass
        if found is not None:
            return _BRACKETED.findall(message[found.end():])
    return []


class TextGame:
    """One TextArena game: ``ta.make(id, **kwargs)`` with the id's registered
    wrappers, reset with ``num_players`` and a seed. Each game keeps its own
    state of Python's ``random`` (TextArena seeds the global one in
    ``reset``), so games interleaved in one worker replay exactly from their
    seeds."""

    def __init__(self, spec, seed):
        self.spec = spec
        self.reset(seed)

    def reset(self, seed):
        import textarena as ta

        self.env = ta.make(self.spec["env_id"], **self.spec["kwargs"])
        self.env.reset(num_players=self.spec["num_players"], seed=seed)
        self.rng = random.getstate()
        self.state = self.env.state
        # Raw messages per player (TextArena's state.observations) sent so
        # far; get_observation() empties the current player's list.
        self.seen = [0] * self.spec["num_players"]
        self.history = [[] for _ in range(self.spec["num_players"])]
        return self.snapshot(None, False)

    def step(self, action):
        random.setstate(self.rng)
        try:
            mover = self.state.current_player_id
            turn = self.state.turn
            self.env.step(action=action)
            info = self.state.game_info.get(mover, {})
            # TextArena's states count a turn only for a move they accept (a
            # forfeit by a repeated invalid move counts, and marks it).
            invalid = self.state.turn == turn or bool(info.get("invalid_move"))
            return self.snapshot(mover, invalid)
        finally:
            self.rng = random.getstate()

    def clone(self):
        other = copy.copy(self)
        other.env = copy.deepcopy(self.env)
        other.state = other.env.state
        other.seen = list(self.seen)
        other.history = [list(h) for h in self.history]
        return other

    def snapshot(self, mover, invalid):
        state = self.state
        n = self.spec["num_players"]
        messages = []
        for pid in range(n):
            queue = state.observations[pid]
            for sender, message, kind in queue[self.seen[pid]:]:
                if sender == -1:
                    name = "GAME"
                else:
                    name = state.role_mapping.get(sender, f"Player {sender}")
                messages.append([pid, name, str(message)])
                self.history[pid].append((sender, str(message), kind))
            self.seen[pid] = len(queue)
        current = int(state.current_player_id)
        wrapped = None
        if not state.done:
            # What the id's own observation wrapper shows the player to move
            # (LLMObservationWrapper's transcript for the default ids).
            pid, observation = self.env.get_observation()
            self.seen[pid] = 0
            if isinstance(observation, str):
                wrapped = observation
        rewards = None
        if state.done and state.rewards is not None:
            rewards = [float(state.rewards.get(pid, 0.0)) for pid in range(n)]
        info = []
        for pid in range(n):
            entry = state.game_info.get(pid, {})
            reason = entry.get("reason")
            info.append({
                "role": str(entry.get("role", f"Player {pid}")),
                "invalid_move": bool(entry.get("invalid_move", False)),
                "turn_count": int(entry.get("turn_count", 0)),
                "reason": None if reason is None else str(reason),
            })
        return {
            "mover": mover,
            "invalid_move": invalid,
            "current_player": current,
            "done": bool(state.done),
            "turn": int(state.turn),
            "rewards": rewards,
            "info": info,
            "messages": messages,
            "wrapped": wrapped,
            "legal": [] if state.done else _legal_moves(self.history[current]),
            "state_key": f"{current}|{state.game_state!r}",
        }


class TextGames:
    """The TextArena games of one worker, by number."""

    def __init__(self, request):
        for folder in reversed(request.get("python_path") or []):
            sys.path.insert(0, folder)
        for target in request.get("imports") or []:
            _import(target)
        import textarena as ta

        env_id = request["env_id"]
        if env_id not in ta.envs.registration.ENV_REGISTRY:
            raise UnknownTextGame(env_id)
        kwargs = request.get("kwargs") or {}
        candidates = [request["num_players"]] if request.get("num_players") else [2, 1, 3, 4, 5, 6]
        refusals = []
        for n in candidates:
            try:
                probe = ta.make(env_id, **kwargs)
                probe.reset(num_players=n, seed=0)
                break
            except Exception as exc:  # the game refuses this many players
                refusals.append(f"{n}: {exc.__class__.__name__}: {exc}")
        else:
            raise PlayerCount(env_id, refusals)
        self.spec = {"env_id": env_id, "kwargs": kwargs, "num_players": n}
        self.games = {}
        self.next = 0

    def add(self, game):
        self.next += 1
        self.games[self.next] = game
        return self.next

    def handle(self, request):
        op = request["op"]
        if op == "text_make":
            game = TextGame(self.spec, request["seed"])
            return {"game": self.add(game), "snapshot": game.snapshot(None, False)}
        game = self.games[request["game"]]
        if op == "text_step":
            return game.step(request["action"])
        if op == "text_reset":
            return game.reset(request["seed"])
        if op == "text_clone":
            return {"game": self.add(game.clone())}
        if op == "text_close":
            del self.games[request["game"]]
            return {}
        raise ValueError(f"unknown op {op!r}")


class UnknownTextGame(Exception):
    pass


class PlayerCount(Exception):
    pass


def _text_init(request):
    try:
        import textarena as ta
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "textarena", exc)
    try:
        return TextGames(request), None
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "?", exc)
    except UnknownTextGame as exc:
        known = sorted(ta.envs.registration.ENV_REGISTRY)
        close = difflib.get_close_matches(str(exc), known, n=5, cutoff=0.6)
        return None, {
            "error": "unknown_env",
            "message": f"TextArena {ta_version()} has no game {str(exc)!r}"
            + (f"; similar ids: {', '.join(close)}" if close else "")
            + f" ({len(known)} ids registered)",
            "traceback": "",
        }
    except PlayerCount as exc:
        env_id, refusals = exc.args
        return None, {
            "error": "unknown_env",
            "message": f"{env_id} refused every player count tried ({'; '.join(refusals)}); set env.num_players",
            "traceback": "",
        }


def ta_version():
    try:
        from importlib.metadata import version

        return version("textarena")
    except Exception:
        return "?"


def _init(request):
    import gymnasium.error

    try:
        return Batch(request), None
    except ModuleNotFoundError as exc:
        return None, _missing(exc.name or "?", exc)
    except UnsupportedSpace as exc:
        return None, {"error": "unsupported_space", "message": str(exc), "traceback": ""}
    except gymnasium.error.Error as exc:
        hint = ""
        try:
            import textarena

            if request["env_id"] in textarena.envs.registration.ENV_REGISTRY:
                hint = f"; {request['env_id']} is a TextArena game: set env.backend: textarena"
        except Exception:
            pass
        try:
            if _pettingzoo_module(request["env_id"]) is not None:
                hint = f"; {request['env_id']} is a PettingZoo game: set env.backend: pettingzoo (or auto)"
        except Exception:
            pass
        return None, {
            "error": "unknown_env",
            "message": f"{exc.__class__.__name__}: {exc}{hint}",
            "traceback": traceback.format_exc(),
        }


def main():
    batch = None
    text_games = None
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
                batch, error = _agents_init(request) if _is_pettingzoo(request) else _init(request)
                write_message(error if error else {"ok": batch.spec})
            elif op == "text_init":
                text_games, error = _text_init(request)
                write_message(error if error else {"ok": {"num_players": text_games.spec["num_players"]}})
            elif str(op).startswith("text_"):
                if text_games is None:
                    write_message({"error": "protocol", "message": f"{op!r} before text_init", "traceback": ""})
                else:
                    write_message({"ok": text_games.handle(request)})
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
