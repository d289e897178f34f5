"""The running empirical-Bayes prior of EBPO: its accumulators, options and per-prompt history.

`EBPrior` holds what docs/algorithm.md section 3 calls W_r and W_mu (and, for the options of
section 4, the within-group variances), globally and per key; `advantages.ebpo_advantages` reads
it.

Options beyond the paper (docs/algorithm.md section 4; each off by default)
    tau2="moments"   tau2 = max(var(W_mu) - sigma2_within * mean(W_inv_n), tau2_min). The
                     subtracted term is the pooled WITHIN-group variance (as docs/algorithm.md
                     section 4 writes), never the total one: var(group means) ~= tau2 + E[within variance / n_b], and
                     the total variance already contains tau2. mean(W_inv_n) is the running mean of
                     1 / n_b, i.e. exactly 1 / G without a mask. tau2_min applies only here.
    sigma2="within"  sigma2 = mean(W_within): a third accumulator that receives each group's
                     unbiased (n_b - 1) variance, one value per group (equal weights).
    center=False     A = A_raw / (std(A_raw) + 1e-6): no re-centring, so mu_glob and the
                     -S * mu_glob / std all-fail signal survive. std is still the centred std.
    decay=gamma      exponentially weighted accumulators: a value observed at step s has weight
                     gamma ** (t - s) at step t, all values of one step share that weight, and
                     mean / var are the weighted mean and weighted population variance
                     (sum w (x - mean)^2 / sum w). t counts observations (calls of ebpo_advantages,
                     or of EBPrior.observe) on the prior. The prompt history decays alike.
                     Update (Chan/Welford merge of a batch of k unit-weight values with mean m_b
                     and sum of squared deviations q_b into (w, mean, M2)):
                         w, M2 <- gamma^(t - t_last) * w, gamma^(t - t_last) * M2
                         d = m_b - mean;  w' = w + k;  mean += d k / w'
                         M2 += q_b + d^2 w k / w';  w = w'
                     gamma = None (paper) is the same merge with no down-weighting: plain Welford.
    keys             one key (str or int) per prompt: one accumulator set per key, updated with
                     that key's rows. A row uses its key's (mu_glob, sigma2, tau2) once the key has
                     >= min_count observations (= group means seen for that key, an unweighted
                     count, current batch included), else the global ones. The global set is
                     always updated with every row. S and mu_glob then differ per prompt.
    leave_one_out    completion i's baseline leaves its own reward out (see `advantages`).
    prompt_prior     a per-prompt history: for each prompt id, the (decayed) number m of its
                     completions scored at earlier steps and their reward sum s. `advantages`
                     turns it into the prompt's posterior (see there). Bounded: at most
                     `prompt_capacity` prompts are kept, the least recently seen evicted first
                     (about 250 bytes each in memory, 25 in prior.json: 100k prompts take
                     25 MB and 2.5 MB).

Where the paper is silent (choices fixed here)
    - Population Welford variance M2 / n (docs/algorithm.md section 9).
    - A step with no valid row updates nothing (the step counter still moves).
    - Keys and prompt ids must be str or int (bool rejected) so the state stores them type-safely
      as "s:<str>" or "i:<int>"; 1 and "1" are different keys.
    - The prompt history read at step t excludes step t's own groups (`prompt_history`), so the
      current group is never counted twice: once as the data, once inside its own prior.
    - load_state_dict adopts the options stored in the state, so a resumed prior is exactly the
      saved one whatever it was constructed with; a state saved before an option existed loads
      with that option off.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from ebpo_lite.algo.groups import F64, Groups, group_stats

__all__ = ["EBPrior", "Welford"]


class Welford:
    """Running (optionally exponentially weighted) mean and population variance.

    State: n (unweighted count), w (sum of weights), mean, m2 (weighted sum of squared
    deviations from mean). var = m2 / w. Batches are merged with Chan's parallel formula; see the
    module docstring for the decayed update.
    """

    __slots__ = ("n", "w", "mean", "m2")

    def __init__(self) -> None:
        self.n, self.w, self.mean, self.m2 = 0, 0.0, 0.0, 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.w if self.w > 0 else 0.0

    def decay(self, factor: float) -> None:
        """Multiply the weight of everything seen so far by factor (mean and var unchanged)."""
        self.w *= factor
        self.m2 *= factor

    def merge(self, k: int, mean: float, m2: float) -> None:
        """Add k unit-weight values with mean `mean` and sum of squared deviations `m2`."""
        if k == 0:
            return
        w_new = self.w + k
        delta = mean - self.mean
        self.mean += delta * k / w_new
        self.m2 += m2 + delta * delta * self.w * k / w_new
        self.w = w_new
        self.n += k

    def update(self, x: torch.Tensor) -> None:
        """Add the values of x (any shape) with unit weight each."""
        x = x.detach().reshape(-1).to(F64)  # [k]
        if x.numel() == 0:
            return
        m = float(x.mean())
        self.merge(x.numel(), m, float((x - m).pow(2).sum()))

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            n, w, mean, m2 = (
                int(state["n"]),
                float(state["w"]),
                float(state["mean"]),
                float(state["m2"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Welford.load_state_dict: bad state {state!r} ({e})") from None
        self.n, self.w, self.mean, self.m2 = n, w, mean, m2


_FIELDS = ("r", "mu", "within", "inv_n")  # rewards, group means, group variances, 1 / n_b


class _AccSet:
    """One set of accumulators (global, or one per key) and the step it was last updated."""

    def __init__(self) -> None:
        self.acc = {f: Welford() for f in _FIELDS}
        self.last_step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, **{f: self.acc[f].state_dict() for f in _FIELDS}}

    def load_state_dict(self, state: dict[str, Any], where: str) -> None:
        if not isinstance(state, dict) or any(f not in state for f in (*_FIELDS, "last_step")):
            raise ValueError(f"EBPrior.load_state_dict: {where} needs keys last_step, {_FIELDS}")
        self.last_step = int(state["last_step"])
        for f in _FIELDS:
            self.acc[f].load_state_dict(state[f])


def _segment_moments(
    x: torch.Tensor, seg: torch.Tensor, nseg: int
) -> tuple[list[int], list[float], list[float]]:
    """Per-segment count, mean and sum of squared deviations of x [k] with ids seg [k]."""
    cnt = torch.zeros(nseg, dtype=F64, device=x.device).index_add_(0, seg, torch.ones_like(x))
    tot = torch.zeros(nseg, dtype=F64, device=x.device).index_add_(0, seg, x)
    mean = tot / cnt.clamp(min=1.0)  # [nseg]
    m2 = torch.zeros(nseg, dtype=F64, device=x.device).index_add_(0, seg, (x - mean[seg]).pow(2))
    return [int(c) for c in cnt.tolist()], mean.tolist(), m2.tolist()


def _key_tag(key: Any, i: int, what: str = "keys") -> str:
    if isinstance(key, str):
        return "s:" + key
    if not isinstance(key, bool):
        try:
            return "i:" + str(operator.index(key))
        except TypeError:
            pass
    raise ValueError(f"ebpo_advantages: {what}[{i}] must be a str or int, got {type(key).__name__}")


class _KeyIds(NamedTuple):
    tags: list[str]  # distinct key tags, in order of first appearance
    ids: torch.Tensor  # [B] long: index of each row's key in tags


def _key_ids(keys: Sequence[Hashable], B: int, device: torch.device, what: str = "keys") -> _KeyIds:
    if isinstance(keys, (str, bytes)) or len(keys) != B:
        raise ValueError(f"ebpo_advantages: {what} must be a sequence of B = {B} {what}")
    seen: dict[tuple[type, Hashable], int] = {}  # (type, key) -> id; type keeps 1 and 1.0 apart
    tag_id: dict[str, int] = {}
    ids = []
    for i, k in enumerate(keys):
        try:
            j = seen.get((type(k), k))
        except TypeError:  # unhashable: neither str nor int
            j = None
        if j is None:
            j = tag_id.setdefault(_key_tag(k, i, what), len(tag_id))
            seen[(type(k), k)] = j
        ids.append(j)
    return _KeyIds(list(tag_id), torch.tensor(ids, dtype=torch.long, device=device))


def _untag(tag: str) -> str | int:
    return tag[2:] if tag.startswith("s:") else int(tag[2:])


class _PromptHistory:
    """Per prompt tag: [m, s, last_step], the decayed completion count and reward sum of its
    visits up to last_step. `before` keeps, for the prompts of the latest step only, the
    (m, s) they had before that step's groups were added. Insertion order = recency (LRU)."""

    def __init__(self, capacity: int, decay: float | None) -> None:
        self.capacity, self.decay = capacity, decay
        self.rows: dict[str, list[float]] = {}
        self.before: dict[str, tuple[float, float]] = {}
        self.step = 0

    def _factor(self, steps: float) -> float:
        return 1.0 if self.decay is None else self.decay**steps

    def add(self, step: int, tags: list[str], counts: list[float], sums: list[float]) -> None:
        """Add one step's groups (a prompt may appear in several); evict beyond capacity."""
        if step != self.step:
            self.before, self.step = {}, step
        for t, k, x in zip(tags, counts, sums):
            row = self.rows.pop(t, None)
            if row is None:
                m, s = 0.0, 0.0
            else:
                f = self._factor(step - row[2])
                m, s = row[0] * f, row[1] * f
            self.before.setdefault(t, (m, s))
            self.rows[t] = [m + k, s + x, float(step)]
        while len(self.rows) > self.capacity:
            old = next(iter(self.rows))
            del self.rows[old]
            self.before.pop(old, None)

    def read(self, step: int, tags: list[str]) -> tuple[list[float], list[float]]:
        """(m, s) of each prompt from the steps before `step`, decayed to `step`."""
        ms, ss = [], []
        for t in tags:
            if step == self.step and t in self.before:
                m, s = self.before[t]
            elif t in self.rows:
                m, s, last = self.rows[t]
                f = self._factor(step - last)
                m, s = m * f, s * f
            else:
                m, s = 0.0, 0.0
            ms.append(m)
            ss.append(s)
        return ms, ss

    def state_dict(self) -> dict[str, Any]:
        cols = list(zip(*self.rows.values())) or [(), (), ()]
        return {
            "tags": list(self.rows),
            "m": list(cols[0]),
            "s": list(cols[1]),
            "last": [int(x) for x in cols[2]],
            "step": self.step,
            "before": {t: list(v) for t, v in self.before.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            tags, m, s, last = state["tags"], state["m"], state["s"], state["last"]
            if not len(tags) == len(m) == len(s) == len(last):
                raise ValueError("columns of unequal length")
            rows = {str(t): [float(a), float(b), float(c)] for t, a, b, c in zip(tags, m, s, last)}
            before = {str(t): (float(v[0]), float(v[1])) for t, v in state["before"].items()}
            step = int(state["step"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"EBPrior.load_state_dict: bad prompts state ({e})") from None
        self.rows, self.before, self.step = rows, before, step


class EBPrior:
    """The running empirical-Bayes prior of EBPO (see the module docstring for each option).

    Defaults are the paper's variant. Updated in place by `ebpo_advantages`; `state_dict()` is
    plain Python (str keys, floats, ints, dicts) for torch.save or json, and round-trips exactly.
    """

    def __init__(
        self,
        tau2: str = "raw",
        sigma2: str = "total",
        center: bool = True,
        decay: float | None = None,
        min_count: int = 8,
        tau2_min: float = 1e-6,
        leave_one_out: bool = False,
        prompt_prior: bool = False,
        prompt_capacity: int = 200_000,
    ) -> None:
        if tau2 not in ("raw", "moments"):
            raise ValueError(f"EBPrior.tau2: expected 'raw' or 'moments', got {tau2!r}")
        if sigma2 not in ("total", "within"):
            raise ValueError(f"EBPrior.sigma2: expected 'total' or 'within', got {sigma2!r}")
        for name, flag in (
            ("center", center),
            ("leave_one_out", leave_one_out),
            ("prompt_prior", prompt_prior),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"EBPrior.{name}: expected a bool, got {flag!r}")
        if decay is not None and (
            isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1
        ):
            raise ValueError(f"EBPrior.decay: expected None or a float in (0, 1), got {decay!r}")
        for name, v in (("min_count", min_count), ("prompt_capacity", prompt_capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EBPrior.{name}: expected an int >= 1, got {v!r}")
        if (
            isinstance(tau2_min, bool)
            or not isinstance(tau2_min, (int, float))
            or not (0 <= tau2_min < math.inf)
        ):
            raise ValueError(f"EBPrior.tau2_min: expected a finite float >= 0, got {tau2_min!r}")
        self.tau2, self.sigma2, self.center = tau2, sigma2, center
        self.decay = None if decay is None else float(decay)
        self.min_count, self.tau2_min = min_count, float(tau2_min)
        self.leave_one_out, self.prompt_prior = leave_one_out, prompt_prior
        self.prompt_capacity = prompt_capacity
        self.step = 0
        self.glob = _AccSet()
        self.by_key: dict[str, _AccSet] = {}
        self.prompts = _PromptHistory(prompt_capacity, self.decay)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"EBPrior({opts}; step={self.step}, keys={len(self.by_key)})"

    def options(self) -> dict[str, Any]:
        return {
            "tau2": self.tau2,
            "sigma2": self.sigma2,
            "center": self.center,
            "decay": self.decay,
            "min_count": self.min_count,
            "tau2_min": self.tau2_min,
            "leave_one_out": self.leave_one_out,
            "prompt_prior": self.prompt_prior,
            "prompt_capacity": self.prompt_capacity,
        }

    def key_counts(self) -> dict[str | int, int]:
        """Observations (group means seen) per key, keys as given (str or int)."""
        return {_untag(t): s.acc["mu"].n for t, s in self.by_key.items()}

    def estimates(self, key: Hashable | None = None) -> tuple[float, float, float]:
        """(mu_glob, sigma2, tau2) a prompt with this key would use now (None: the global ones)."""
        return self._estimates_of(self._set_for(None if key is None else _key_tag(key, 0)))

    def prompt_history(self, prompts: Sequence[Hashable]) -> tuple[list[float], list[float]]:
        """(m, s) per prompt id: completions scored and their reward sum at earlier steps,
        decayed to now; the current step's own groups are excluded. (0, 0) for a new prompt."""
        tags = [_key_tag(p, i, "prompts") for i, p in enumerate(prompts)]
        return self.prompts.read(self.step, tags)

    def _set_for(self, tag: str | None) -> _AccSet:
        s = self.by_key.get(tag) if tag is not None else None
        return s if s is not None and s.acc["mu"].n >= self.min_count else self.glob

    def _estimates_of(self, s: _AccSet) -> tuple[float, float, float]:
        r, mu, within, inv_n = (s.acc[f] for f in _FIELDS)
        sigma2 = r.var if self.sigma2 == "total" else within.mean
        if self.tau2 == "raw":
            tau2 = mu.var
        else:
            tau2 = max(mu.var - within.mean * inv_n.mean, self.tau2_min)
        return r.mean, sigma2, tau2

    def observe(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor | None = None,
        keys: Sequence[Hashable] | None = None,
        prompts: Sequence[Hashable] | None = None,
    ) -> None:
        """Step 1 alone: add rewards [B, G] (mask, keys, prompts as in `ebpo_advantages`).

        For a trainer that scores more groups than it trains on (dynamic sampling): observe every
        drawn group, then `ebpo_advantages(kept, prior, observe=False)` reads the statistics.
        One call is one step of the decay clock.
        """
        g = group_stats(rewards, mask, "EBPrior.observe")
        B = g.R.shape[0]
        kid = None if keys is None else _key_ids(keys, B, g.R.device)
        pid = self._prompt_ids(prompts, B, g.R.device)
        self._observe(g, kid, pid)

    def _prompt_ids(
        self, prompts: Sequence[Hashable] | None, B: int, device: torch.device
    ) -> _KeyIds | None:
        if not self.prompt_prior:
            return None
        if prompts is None:
            raise ValueError("ebpo_advantages: prompt_prior=True needs prompts= (one id per row)")
        return _key_ids(prompts, B, device, "prompts")

    def _observe(self, g: Groups, keys: _KeyIds | None, prompts: _KeyIds | None = None) -> None:
        """Step 1 of the algorithm: add this step's rewards and group statistics."""
        self.step += 1
        if not bool(g.ok.any()):
            return
        ok_rows = g.ok.nonzero().squeeze(1)  # [B_ok]
        if prompts is not None:
            rows = ok_rows.tolist()
            sums = (g.R * g.act).sum(dim=1)  # [B]
            self.prompts.add(
                self.step,
                [prompts.tags[int(prompts.ids[b])] for b in rows],
                g.n[ok_rows].tolist(),
                sums[ok_rows].tolist(),
            )
        seg = torch.zeros_like(g.ok, dtype=torch.long)  # [B] 0 = no key, j + 1 = keys.tags[j]
        if keys is not None:
            seg = keys.ids + 1  # [B]
        per_field = {
            "r": (g.R[g.act], seg[:, None].expand_as(g.act)[g.act]),  # [N]
            "mu": (g.mean_g[ok_rows], seg[ok_rows]),  # [B_ok]
            "within": (g.var_g[ok_rows], seg[ok_rows]),  # [B_ok]
            "inv_n": (1.0 / g.n[ok_rows], seg[ok_rows]),  # [B_ok]
        }
        updated: dict[int, _AccSet] = {0: self.glob}  # segment -> accumulator set
        if keys is not None:
            for j in sorted(set(seg[ok_rows].tolist())):
                updated[j] = self.by_key.setdefault(keys.tags[j - 1], _AccSet())
        for s in updated.values():
            if self.decay is not None and s.last_step > 0:
                factor = self.decay ** (self.step - s.last_step)
                for a in s.acc.values():
                    a.decay(factor)
            s.last_step = self.step
        for f, (x, segs) in per_field.items():
            self.glob.acc[f].merge(*_moments_all(x))
            if keys is not None:
                cnt, mean, m2 = _segment_moments(x, segs, len(keys.tags) + 1)
                for j, s in updated.items():
                    if j > 0:
                        s.acc[f].merge(cnt[j], mean[j], m2[j])

    def snapshot(self) -> tuple:
        """A cheap copy for `restore` (a step undone after a fault): the accumulators deep, the
        prompt histories shallow (`_PromptHistory.add` replaces rows, never mutates them)."""
        p = self.prompts
        hist = (dict(p.rows), dict(p.before), p.step) if self.prompt_prior else None
        return self.step, copy.deepcopy(self.glob), copy.deepcopy(self.by_key), hist

    def restore(self, snap: tuple) -> None:
        self.step, glob, by_key, hist = snap
        self.glob, self.by_key = copy.deepcopy(glob), copy.deepcopy(by_key)
        if hist is not None:
            self.prompts.rows, self.prompts.before, self.prompts.step = (
                dict(hist[0]),
                dict(hist[1]),
                hist[2],
            )

    def state_dict(self) -> dict[str, Any]:
        state = {
            "version": 1,
            "options": self.options(),
            "step": self.step,
            "global": self.glob.state_dict(),
            "keys": {t: s.state_dict() for t, s in self.by_key.items()},
        }
        if self.prompt_prior:
            state["prompts"] = self.prompts.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict exactly, options included (they travel with the state)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("EBPrior.load_state_dict: expected a dict with version 1")
        for k in ("options", "step", "global", "keys"):
            if k not in state:
                raise ValueError(f"EBPrior.load_state_dict: state is missing {k!r}")
        fresh = EBPrior(**state["options"])
        fresh.step = int(state["step"])
        fresh.glob.load_state_dict(state["global"], "global")
        for t, s in state["keys"].items():
            if not (isinstance(t, str) and t[:2] in ("s:", "i:")):
                raise ValueError(f"EBPrior.load_state_dict: bad key tag {t!r}")
            fresh.by_key[t] = _AccSet()
            fresh.by_key[t].load_state_dict(s, f"keys[{t!r}]")
        if fresh.prompt_prior:
            if "prompts" not in state:
                raise ValueError("EBPrior.load_state_dict: prompt_prior=True but no 'prompts'")
            fresh.prompts.load_state_dict(state["prompts"])
        self.__dict__.update(copy.deepcopy(fresh.__dict__))


def _moments_all(x: torch.Tensor) -> tuple[int, float, float]:
    """Count, mean and sum of squared deviations of x [k], k >= 1."""
    m = float(x.mean())
    return x.numel(), m, float((x - m).pow(2).sum())
