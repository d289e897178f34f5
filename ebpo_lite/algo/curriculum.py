"""Curriculum: which prompts each training step sees.

One small interface for every sampler (`PromptSampler`):
- `next_batch(n) -> list[int]`: the dataset indices of the next `n` prompts;
- `update(indices, rewards)`: the rewards those prompts received (`[len(indices), G]`, or one mean
  per prompt), so an adaptive sampler learns from what it saw;
- `state_dict()` / `load_state_dict()`: plain-python, JSON-able state; a fresh sampler built with the
  same arguments and loaded with it continues the exact same sequence.

Samplers (`make_sampler(name, ...)`):
- `shuffle`: seeded epochs; every example once per epoch. Batches run on across an epoch boundary,
  so a batch that straddles it may hold an example twice (once per epoch).
- `topic` (the paper's EBPO-topic, docs/algorithm.md section 7): topic-coherent runs of `run_length`
  batches; topics in `topic_order` (default: order of first appearance; topics left out of the
  order follow in order of first appearance, so every topic is visited), cycling. Within a topic the
  examples are shuffled per pass over that topic, and a topic's position carries over between its
  runs. Examples with topic None form the topic "other". Departure: the paper walks one epoch
  through the topics in turn; here a run is a fixed number of batches, so topics get equal numbers
  of batches whatever their sizes (a small topic is revisited more often), and a batch larger than
  its topic repeats examples.
- `difficulty` (the paper's EBPO-diff): easy to hard. With `difficulty_is_pass_rate=True` the value
  is a pass rate in [0, 1] (higher = easier, the paper's ranking by the base model's pass rate);
  with False it is a level where higher = harder (the arithmetic task's 1-3). Ties are shuffled by
  the seed (differently on each pass); examples with a missing value (None or NaN) come last, in a
  seeded random order. One pass then `StopIteration` (`repeat=False`; the last batch may be short),
  or pass after pass (`repeat=True`; a batch may straddle two passes).
- `adaptive` (beyond the paper): a Beta(alpha, beta) posterior over each example's pass rate, from
  the rewards it received (rewards clipped to [0, 1] and counted as Bernoulli trials: successes =
  their sum, trials = their number; NaN rewards are skipped). Each batch takes the `n` examples whose
  pass-rate draw is closest to `target` (0.5: where a group of G carries the most signal), without
  replacement. `adaptive_mode="thompson"` (default) scores a seeded Thompson sample from each
  posterior, which keeps exploring; `"mean"` scores the posterior mean (ties broken by the seed).
  Unseen examples have the prior Beta(`prior`) = Beta(1, 1) by default.

`informative_groups(rewards)` is DAPO's dynamic-sampling filter (a group whose rewards are all
equal gives GRPO a zero gradient). Drawing extra prompts to refill the batch is the trainer's loop.

Randomness is derived, never carried: each permutation or Thompson draw comes from a numpy
generator seeded with (seed, purpose, epoch or draw number), so a state dict holds only counters
(and the adaptive posterior counts) and stays small, exact and JSON-able.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ebpo_lite.errors import ConfigError

SAMPLERS = ("shuffle", "topic", "difficulty", "adaptive")
OTHER_TOPIC = "other"
_TAG = {"shuffle": 1, "topic": 2, "difficulty": 3, "adaptive": 4}  # keeps the streams independent


def _rng(seed: int, *words: int) -> np.random.Generator:
    """A generator fixed by the seed and the words (all taken modulo 2**64, so negatives work)."""
    return np.random.default_rng([int(w) % 2**64 for w in (seed, *words)])


class _Stream:
    """An endless walk through `order(epoch)`, epoch after epoch; position = (epoch, pos)."""

    def __init__(self, order: Callable[[int], list[int]], repeat: bool = True) -> None:
        self._order = order
        self.repeat = repeat
        self.epoch = 0
        self.pos = 0
        self._cache: tuple[int, list[int]] | None = None

    def _current(self) -> list[int]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self._order(self.epoch))
        return self._cache[1]

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._current()
            if self.pos >= len(order):
                if not self.repeat:
                    break
                self.epoch, self.pos = self.epoch + 1, 0
                continue
            chunk = order[self.pos : self.pos + n - len(out)]
            out.extend(chunk)
            self.pos += len(chunk)
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class PromptSampler:
    """Base of all samplers: argument checks and the state header. See the module docstring."""

    name = "base"

    def __init__(self, n_examples: int, seed: int) -> None:
        self.n_examples = n_examples
        self.seed = seed
        self.batches = 0  # next_batch calls so far

    # -- the interface -------------------------------------------------------------------------
    def next_batch(self, n: int) -> list[int]:
        """The dataset indices of the next `n` prompts."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"next_batch: n must be an int >= 1, got {n!r}")
        out = self._next(n)
        self.batches += 1
        return out

    def update(self, indices: Sequence[int], rewards: Any) -> None:
        """Rewards of the prompts `indices`: `[len(indices), G]` or one mean per prompt."""
        idx = [int(i) for i in indices]
        self._learn(idx, _rewards_2d(idx, rewards, self.n_examples))

    def state_dict(self) -> dict[str, Any]:
        """Plain-python, JSON-able state (see `load_state_dict`)."""
        return {
            "sampler": self.name,
            "n_examples": self.n_examples,
            "seed": self.seed,
            "fingerprint": self._fingerprint(),
            "batches": self.batches,
            **self._state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; it must come from a sampler built with the same arguments."""
        for key, mine in (
            ("sampler", self.name),
            ("n_examples", self.n_examples),
            ("seed", self.seed),
            ("fingerprint", self._fingerprint()),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"curriculum state: {key} is {state.get(key)!r} in the checkpoint but "
                    f"{mine!r} here (the sampler must be built with the same arguments to resume)"
                )
        self.batches = int(state["batches"])
        self._load(state)

    def stats(self) -> dict[str, float]:
        """A few plain floats for the metrics log."""
        return {"batches": float(self.batches)}

    # -- what subclasses provide ---------------------------------------------------------------
    def _next(self, n: int) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _learn(self, indices: list[int], rewards: np.ndarray) -> None:
        """Non-adaptive samplers ignore rewards (they were checked already)."""

    def _fingerprint(self) -> int:
        return 0

    def _state(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class _StreamSampler(PromptSampler):
    """A sampler that reads one `_Stream` of epochs (shuffle, difficulty): state is its position."""

    _stream: _Stream

    def _state(self) -> dict[str, Any]:
        return {"stream": self._stream.state()}

    def _load(self, state: dict[str, Any]) -> None:
        self._stream.load(state["stream"])

    def stats(self) -> dict[str, float]:
        s = self._stream
        return {**super().stats(), "epoch": s.epoch + s.pos / self.n_examples}


class ShuffleSampler(_StreamSampler):
    """Seeded epochs: a fresh permutation of all examples per epoch."""

    name = "shuffle"

    def __init__(self, n_examples: int, seed: int) -> None:
        super().__init__(n_examples, seed)
        tag = _TAG["shuffle"]
        self._stream = _Stream(lambda e: _rng(seed, tag, e).permutation(n_examples).tolist())

    def _next(self, n: int) -> list[int]:
        return self._stream.take(n)


class TopicSampler(PromptSampler):
    """Topic-coherent runs of `run_length` batches, topics in a fixed order, cycling."""

    name = "topic"

    def __init__(
        self,
        n_examples: int,
        seed: int,
        topics: Sequence[str | None],
        order: Sequence[str],
        run_length: int,
    ) -> None:
        super().__init__(n_examples, seed)
        labels = [OTHER_TOPIC if t is None else str(t) for t in topics]
        members: dict[str, list[int]] = {}
        for i, t in enumerate(labels):
            members.setdefault(t, []).append(i)
        order = [str(t) for t in order]
        if len(set(order)) != len(order):
            raise ConfigError(f"curriculum.topic_order: repeats a topic: {order}")
        unknown = [t for t in order if t not in members]
        if unknown:
            raise ConfigError(
                f"curriculum.topic_order: {unknown} not among the data's topics "
                f"{list(members)}; name only those, or leave it empty (order of first appearance)"
            )
        self.topic_order = order + [t for t in members if t not in order]
        self.run_length = run_length
        self._members = members
        self._streams = [self._topic_stream(k, t) for k, t in enumerate(self.topic_order)]
        self.topic_pos = 0  # index into topic_order of the current run
        self.in_run = 0  # batches already drawn in the current run
        self._fp: int | None = None

    def _topic_stream(self, k: int, topic: str) -> _Stream:
        items = np.asarray(self._members[topic])
        return _Stream(lambda e: _rng(self.seed, _TAG["topic"], k, e).permutation(items).tolist())

    @property
    def current_topic(self) -> str:
        """The topic of the last batch drawn (of the next one before any is drawn)."""
        return self.topic_order[self.topic_pos]

    def _next(self, n: int) -> list[int]:
        if self.in_run == self.run_length:
            self.topic_pos = (self.topic_pos + 1) % len(self.topic_order)
            self.in_run = 0
        self.in_run += 1
        return self._streams[self.topic_pos].take(n)

    def _fingerprint(self) -> int:
        if self._fp is None:
            self._fp = _crc([self.topic_order, self.run_length, self._members])
        return self._fp

    def _state(self) -> dict[str, Any]:
        return {
            "topic_pos": self.topic_pos,
            "in_run": self.in_run,
            "streams": [s.state() for s in self._streams],
        }

    def _load(self, state: dict[str, Any]) -> None:
        self.topic_pos, self.in_run = int(state["topic_pos"]), int(state["in_run"])
        for stream, s in zip(self._streams, state["streams"], strict=True):
            stream.load(s)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "topic_index": float(self.topic_pos)}


class DifficultySampler(_StreamSampler):
    """Easy to hard by a per-example value; ties shuffled per pass; missing values last."""

    name = "difficulty"

    def __init__(
        self,
        n_examples: int,
        seed: int,
        difficulties: Sequence[float | None],
        is_pass_rate: bool,
        repeat: bool,
    ) -> None:
        super().__init__(n_examples, seed)
        values = np.array([math.nan if d is None else float(d) for d in difficulties])  # [n]
        known = ~np.isnan(values)
        if np.isinf(values).any():
            raise ValueError("difficulties: must be finite (None or NaN for a missing value)")
        if is_pass_rate and ((values[known] < 0) | (values[known] > 1)).any():
            bad = int(np.flatnonzero(known & ((values < 0) | (values > 1)))[0])
            raise ValueError(
                f"difficulties[{bad}] = {values[bad]}: a pass rate must be in [0, 1] "
                "(pass difficulty_is_pass_rate=False for levels where higher = harder)"
            )
        # sort key, ascending = easier first; missing -> +inf (last)
        self._key = np.where(known, -values if is_pass_rate else values, np.inf)  # [n]
        self.is_pass_rate = is_pass_rate
        self._stream = _Stream(self._order, repeat=repeat)
        self._fp: int | None = None

    def _order(self, epoch: int) -> list[int]:
        tie = _rng(self.seed, _TAG["difficulty"], epoch).permutation(self.n_examples)  # [n]
        return np.lexsort((tie, self._key)).tolist()  # primary key: difficulty; then the shuffle

    def _next(self, n: int) -> list[int]:
        out = self._stream.take(n)
        if not out:
            raise StopIteration("difficulty curriculum: one pass done (repeat=False)")
        return out

    def _fingerprint(self) -> int:
        if self._fp is None:
            self._fp = _crc([self._key.tolist(), self._stream.repeat])
        return self._fp


class AdaptiveSampler(PromptSampler):
    """Prompts whose Beta-posterior pass rate is nearest `target` (see the module docstring)."""

    name = "adaptive"

    def __init__(
        self, n_examples: int, seed: int, prior: tuple[float, float], mode: str, target: float
    ) -> None:
        super().__init__(n_examples, seed)
        if len(prior) != 2 or not all(math.isfinite(p) and p > 0 for p in prior):
            raise ValueError(f"prior: expected two finite numbers > 0 (alpha, beta), got {prior!r}")
        if mode not in ("thompson", "mean"):
            raise ValueError(f"adaptive_mode: expected 'thompson' or 'mean', got {mode!r}")
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"target: a pass rate in [0, 1], got {target}")
        self.prior = (float(prior[0]), float(prior[1]))
        self.mode = mode
        self.target = float(target)
        self.successes = np.zeros(n_examples)  # [n] sum of rewards in [0, 1]
        self.trials = np.zeros(n_examples)  # [n] number of rewards
        self._last: list[int] = []

    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) per example, each `[n_examples]`."""
        a0, b0 = self.prior
        return a0 + self.successes, b0 + self.trials - self.successes

    def _next(self, n: int) -> list[int]:
        if n > self.n_examples:
            raise ValueError(
                f"next_batch: n = {n} exceeds the {self.n_examples} examples "
                "(the adaptive sampler draws without replacement)"
            )
        rng = _rng(self.seed, _TAG["adaptive"], self.batches)
        alpha, beta = self.posterior()  # [n_examples] each
        p = rng.beta(alpha, beta) if self.mode == "thompson" else alpha / (alpha + beta)
        score = np.abs(p - self.target)  # [n_examples] smaller = more informative
        perm = rng.permutation(self.n_examples)  # random tie-break
        chosen = perm[np.argsort(score[perm], kind="stable")[:n]]
        self._last = chosen.tolist()
        return self._last

    def _learn(self, indices: list[int], rewards: np.ndarray) -> None:
        valid = ~np.isnan(rewards)  # [B, G]
        r = np.where(valid, np.clip(rewards, 0.0, 1.0), 0.0)  # [B, G]
        np.add.at(self.successes, indices, r.sum(axis=1))
        np.add.at(self.trials, indices, valid.sum(axis=1))

    def _fingerprint(self) -> int:
        return _crc([self.prior, self.mode, self.target])

    def _state(self) -> dict[str, Any]:
        return {"successes": self.successes.tolist(), "trials": self.trials.tolist()}

    def _load(self, state: dict[str, Any]) -> None:
        self.successes = np.array(state["successes"], dtype=np.float64)
        self.trials = np.array(state["trials"], dtype=np.float64)
        if self.successes.shape != (self.n_examples,) or self.trials.shape != (self.n_examples,):
            raise ValueError("curriculum state: adaptive counts do not match n_examples")

    def stats(self) -> dict[str, float]:
        """`seen_frac`: examples with any reward; `batch_mean_p`: posterior mean of the last batch."""
        alpha, beta = self.posterior()
        mean = alpha / (alpha + beta)  # [n_examples]
        out = {**super().stats(), "seen_frac": float((self.trials > 0).mean())}
        if self._last:
            out["batch_mean_p"] = float(mean[self._last].mean())
        return out


def make_sampler(
    name: str,
    n_examples: int,
    seed: int,
    *,
    topics: Sequence[str | None] | None = None,
    difficulties: Sequence[float | None] | None = None,
    topic_order: Sequence[str] = (),
    run_length: int = 4,
    repeat: bool = True,
    difficulty_is_pass_rate: bool = True,
    prior: tuple[float, float] = (1.0, 1.0),
    adaptive_mode: str = "thompson",
    target: float = 0.5,
) -> PromptSampler:
    """Build the sampler `name` (shuffle | topic | difficulty | adaptive) over `n_examples` prompts.

    `topics` / `difficulties` hold one entry per example (None = missing); they are checked for
    length whenever given and required only by the sampler that uses them.
    """
    if isinstance(n_examples, bool) or not isinstance(n_examples, int) or n_examples < 1:
        raise ValueError(f"n_examples: must be an int >= 1, got {n_examples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: must be an int, got {seed!r}")
    for field, values in (("topics", topics), ("difficulties", difficulties)):
        if values is not None and len(values) != n_examples:
            raise ValueError(f"{field}: has {len(values)} entries for {n_examples} examples")
    if name == "shuffle":
        return ShuffleSampler(n_examples, seed)
    if name == "topic":
        if topics is None:
            raise ValueError("topics: the topic sampler needs one topic per example")
        if isinstance(run_length, bool) or not isinstance(run_length, int) or run_length < 1:
            raise ValueError(f"run_length: must be an int >= 1, got {run_length!r}")
        return TopicSampler(n_examples, seed, topics, topic_order, run_length)
    if name == "difficulty":
        if difficulties is None:
            raise ValueError("difficulties: the difficulty sampler needs one value per example")
        return DifficultySampler(n_examples, seed, difficulties, difficulty_is_pass_rate, repeat)
    if name == "adaptive":
        return AdaptiveSampler(n_examples, seed, tuple(prior), adaptive_mode, target)
    raise ValueError(f"sampler: unknown name {name!r}; expected one of {', '.join(SAMPLERS)}")


def informative_groups(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry a GRPO signal.

    rewards `[B, G]`; optional bool `mask` `[B, G]` (True = scorable; others are ignored).
    Returns bool `[B]`: False where all (scorable) rewards of the row are equal, or fewer than two
    are scorable. Exact equality, as DAPO's std == 0 test.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected [B, G], got shape {tuple(rewards.shape)}")
    if mask is None:
        return (rewards != rewards[:, :1]).any(dim=1)  # [B]
    mask = torch.as_tensor(mask, dtype=torch.bool, device=rewards.device)
    if mask.shape != rewards.shape:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} differs from rewards {tuple(rewards.shape)}"
        )
    hi = torch.where(mask, rewards, torch.full_like(rewards, -math.inf)).amax(dim=1)  # [B]
    lo = torch.where(mask, rewards, torch.full_like(rewards, math.inf)).amin(dim=1)  # [B]
    return (mask.sum(dim=1) >= 2) & (hi > lo)


def _rewards_2d(indices: Sequence[int], rewards: Any, n_examples: int) -> np.ndarray:
    """Rewards as float64 `[len(indices), G]` (a per-prompt mean becomes G = 1), checked."""
    if hasattr(rewards, "detach"):
        rewards = rewards.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(rewards, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[:, None]  # [B, 1]
    if arr.ndim != 2 or arr.shape[0] != len(indices):
        raise ValueError(
            f"update: rewards of shape {arr.shape} for {len(indices)} indices "
            "(expected [len(indices), G] or one mean per prompt)"
        )
    for i in indices:
        if not 0 <= int(i) < n_examples:
            raise ValueError(f"update: index {i} outside [0, {n_examples})")
    return arr


def _crc(obj: Any) -> int:
    """A stable fingerprint of plain data (to refuse resuming a different curriculum)."""
    return zlib.crc32(repr(obj).encode())
