"""The multi-turn rollout: every episode of a step advances turn by turn, one batch per turn.

Written once above the sampler seam: it asks a backend (`ebpo_lite.rollout`) for continuations
of token sequences, so neither the transformers nor the vLLM sampler knows about tools.

One step's episodes (B prompts x G):
1. each gets an environment instance (`host.start`: `random.seed` per group, then
   `reset(**columns)`); a text `reset` returns is appended to the prompt;
2. the first turn is one `generate` of G samples per prompt (B x G rows when `reset` gave a
   group's episodes different prompts);
3. each turn that ended with a stop id is parsed (`formats`): calls are run (all episodes' in one
   `host.call`), each result cut to `env.max_tool_response_tokens`, and the result's tokens
   (`ToolFormat.tool_ids`, never a re-tokenised history) are appended with tool mask 0; the
   episodes that called a tool go on with one `generate` of all of them, each with the token
   budget it has left (`rollout.max_new_tokens` is the whole episode's, as TRL's
   `max_completion_length`);
4. an episode ends at a turn without a call (its answer), at `env.max_turns` model turns, or when
   the budget or the context is spent: a tool result that would not leave room for one more token
   is rolled back, and the episode ends there, unfinished.

The sampler's log-probs (vLLM) are kept for the sampled tokens; tool tokens get 0.0, masked.
Seeds: turn t of a draw samples with a pure function of (the draw's seed, t), so a resumed run
draws what the uninterrupted one did.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ebpo_lite.env.contract import ENV_COLUMN, ToolSetup, environment_of
from ebpo_lite.env.formats import ParsedTurn, ToolFormat
from ebpo_lite.rollout.common import Rollout

CUT_MARKER = "...[cut]"


@dataclass
class Episode:
    """What one episode did: the trainer's metrics and the printed conversation come from here."""

    env: str | None = None
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # a tool raised (or its environment could not be reset)
    tool_timeouts: int = 0
    tool_unknown: int = 0  # no such tool, arguments that do not fit, a malformed call
    tool_cut: int = 0  # results cut to env.max_tool_response_tokens
    tool_seconds: float = 0.0
    ended: str = ""  # answer | max_turns | budget
    messages: list[dict] = field(default_factory=list)  # assistant / tool turns, as text

    @property
    def final_text(self) -> str:
        """The model's last turn: where its answer is (what reward functions score)."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return ""


def columns_of(example: Any) -> dict[str, Any]:
    """The columns `reset(**columns)` gets: the example's `prompt`, `answer` and data fields."""
    return {"prompt": example.prompt, "answer": example.answer, **example.meta}


def group_seed(seed: int, group: int) -> int:
    """The `random.seed` before `reset` of group `group`'s G environments, a draw seeded `seed`."""
    entropy = [seed & 0xFFFF_FFFF_FFFF_FFFF, 0x454E56, group]  # "ENV"
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0: the first) of a draw seeded `seed`."""
    if turn == 0:
        return seed
    state = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, turn]).generate_state(1)
    return int(state[0])


class EpisodeRunner:
    """Runs a step's episodes (module docstring). `encode(example, text)`: the prompt ids of an
    example whose `reset` returned `text`; `context`: the longest sequence the sampler takes."""

    def __init__(
        self,
        setup: ToolSetup,
        host: Any,
        fmt: ToolFormat,
        tokenizer: Any,
        env_cfg: Any,
        max_new_tokens: int,
        context: int,
        encode: Callable[[Any, str], list[int]],
    ):
        self.setup, self.host, self.fmt, self.tokenizer = setup, host, fmt, tokenizer
        self.cfg = env_cfg
        self.max_new_tokens, self.context, self.encode = max_new_tokens, context, encode

    def run(
        self,
        backend: Any,
        examples: Sequence[Any],
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> Rollout:
        G, budget = group_size, max_new_tokens or self.max_new_tokens
        n = len(prompt_ids) * G
        episodes = [Episode() for _ in range(n)]
        # 1. environments: one instance per episode, the G of a group reset alike
        envs, columns = [], []
        for i in range(n):
            ex = examples[i // G]
            cols = columns_of(ex)
            episodes[i].env = environment_of(self.setup, cols, f"example {ex.prompt[:40]!r}")
            envs.append(episodes[i].env)
            if episodes[i].env is not None:  # a control column, not passed on (as TRL)
                cols.pop(ENV_COLUMN, None)
            columns.append(cols)
        group_seeds = [group_seed(seed, g) for g in range(len(prompt_ids))]
        starts = self.host.start(envs, columns, [group_seeds[i // G] for i in range(n)])
        rows = []
        for i, out in enumerate(starts):
            if out.status != "ok":
                episodes[i].tool_errors += 1  # the episode goes on; its tools answer with errors
            rows.append(self.encode(examples[i // G], out.text) if out.text else prompt_ids[i // G])
        shared = all(rows[i] is prompt_ids[i // G] for i in range(n))
        # 2. the first turn
        if shared:
            first = backend.generate(
                prompt_ids, G, seed=seed, temperature=temperature, max_new_tokens=budget
            )
        else:
            first = backend.generate(
                rows, 1, seed=seed, temperature=temperature, max_new_tokens=budget
            )
        comp: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        with_lp = first.sampler_logprobs is not None
        lps: list[list[float]] = [[] for _ in range(n)]
        finished = [False] * n
        live, turn = list(range(n)), first
        # 3. turns
        for t in range(self.cfg.max_turns):
            calls: list[tuple[int, ParsedTurn]] = []
            for j, i in enumerate(live):
                ids = turn.completion_ids[j]
                comp[i] += ids
                mask[i] += [1] * len(ids)
                if with_lp:
                    lps[i] += list(turn.sampler_logprobs[j])
                ep = episodes[i]
                ep.turns += 1
                parsed = self.fmt.parse(ids)
                ep.messages.append({"role": "assistant", "content": parsed.text})
                if not turn.finished[j]:
                    ep.ended = "budget"  # cut by the token budget mid-turn
                elif not parsed.wants_tools:
                    ep.ended, finished[i] = "answer", True
                elif ep.turns >= self.cfg.max_turns:
                    ep.ended, finished[i] = "max_turns", True
                else:
                    calls.append((i, parsed))
            if not calls:
                break
            answers = self._run_tools(calls, episodes)
            live, prompts, left = [], [], []
            for (i, _), results in zip(calls, answers):
                tool = self.fmt.tool_ids(results)
                room = budget - len(comp[i]) - len(tool)
                total = len(rows[i]) + len(comp[i]) + len(tool)
                if room < 1 or total + 1 > self.context:  # no room to answer: rolled back
                    del episodes[i].messages[-len(results) :]
                    episodes[i].ended = "budget"
                    continue
                comp[i] += tool
                mask[i] += [0] * len(tool)
                if with_lp:
                    lps[i] += [0.0] * len(tool)
                live.append(i)
                prompts.append(rows[i] + comp[i])
                left.append(min(room, self.context - total))
            if not live:
                break
            turn = backend.generate(
                prompts,
                1,
                seed=turn_seed(seed, t + 1),
                temperature=temperature,
                max_new_tokens=left,
            )
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=comp,
            sampler_logprobs=lps if with_lp else None,
            finished=finished,
            tool_masks=mask,
            row_prompt_ids=None if shared else rows,
            episodes=episodes,
        )

    def _run_tools(self, calls: list[tuple[int, ParsedTurn]], episodes: list[Episode]):
        """Every call of this turn, all episodes in one `host.call`; [(name, text)] per turn."""
        batch, where = [], []
        for k, (i, parsed) in enumerate(calls):
            for c in parsed.calls:
                batch.append((i, c.name, c.arguments))
                where.append((k, c.name))
        outcomes = self.host.call(batch) if batch else []
        results: list[list[tuple[str, str]]] = [[] for _ in calls]
        for (k, name), out in zip(where, outcomes):
            ep = episodes[calls[k][0]]
            ep.tool_calls += 1
            ep.tool_seconds += out.seconds
            ep.tool_errors += out.status == "error"
            ep.tool_timeouts += out.status == "timeout"
            ep.tool_unknown += out.status == "unknown"
            cut = out.status == "ok"  # a result; an error message is the host's, and short
            results[k].append((name, self._cut(out.text, ep) if cut else out.text))
        for k, (i, parsed) in enumerate(calls):
            if parsed.problem is not None:  # malformed: answered, never run
                episodes[i].tool_calls += 1
                episodes[i].tool_unknown += 1
                results[k].append(("error", json.dumps({"error": parsed.problem})))
        for k, (i, _) in enumerate(calls):
            for name, text in results[k]:
                episodes[i].messages.append({"role": "tool", "name": name, "content": text})
        return results

    def _cut(self, text: str, ep: Episode) -> str:
        """`text` within `env.max_tool_response_tokens` tokens, cut with a marker."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = self.cfg.max_tool_response_tokens
        if len(ids) <= limit:
            return text
        ep.tool_cut += 1
        return self.tokenizer.decode(ids[:limit]) + CUT_MARKER


def episode_metrics(episodes: Sequence[Episode], prefix: str = "env") -> dict[str, float]:
    """Per episode means of what the episodes did (the step line and metrics.jsonl); with
    several environments, each one's turns and calls too."""
    if not episodes:
        return {}
    n = len(episodes)

    def mean(values) -> float:
        values = list(values)
        return sum(values) / max(len(values), 1)

    out = {
        f"{prefix}/turns": mean(e.turns for e in episodes),
        f"{prefix}/tool_calls": mean(e.tool_calls for e in episodes),
        f"{prefix}/tool_errors": mean(e.tool_errors for e in episodes),
        f"{prefix}/tool_timeouts": mean(e.tool_timeouts for e in episodes),
        f"{prefix}/tool_unknown": mean(e.tool_unknown for e in episodes),
        f"{prefix}/tool_cut": mean(e.tool_cut for e in episodes),
        f"{prefix}/tool_seconds": sum(e.tool_seconds for e in episodes),
        f"{prefix}/called_frac": mean(e.tool_calls > 0 for e in episodes),
        f"{prefix}/budget_frac": sum(e.ended == "budget" for e in episodes) / n,
    }
    names = sorted({e.env for e in episodes if e.env is not None})
    for name in names:
        mine = [e for e in episodes if e.env == name]
        out[f"{prefix}/{name}/turns"] = mean(e.turns for e in mine)
        out[f"{prefix}/{name}/tool_calls"] = mean(e.tool_calls for e in mine)
    return out
