"""What the model writes, shown while a run trains: sample completions, `completions.jsonl`, and
warnings when the rewards say nothing (docs/monitoring.md).

Everything comes from the step's own rollout: no extra sampling, and nothing is decoded on a step
that shows, writes and warns nothing.

- Printed samples: `log.show_completions` prompts, the first completion of each, its reward,
  advantage and whether it was cut at `rollout.max_new_tokens`, at the first step of every
  invocation (a resume too) and at every step the loop evaluates after. Texts are cut to
  SHOW_CHARS characters (a prompt keeps its end, where the question is).
- `<output_dir>/completions.jsonl`, every `log.completions_every` steps: the step's first whole
  groups (kept groups, prompt-major), at most ROWS_PER_WRITE rows, texts cut to ROW_CHARS; once
  the file would pass MAX_FILE_BYTES, no more rows are written (one line says so). Fields: `step`,
  `group`, `sample`, `example` (the training example's index), `prompt` (as the model saw it,
  special tokens kept), `answer`, `completion`, `reward` (None: masked, unscorable), `advantage`,
  `truncated`, `completion_tokens` (the model's tokens); with tool use (docs/tools.md) the
  completion is the conversation, tool results marked `<<tool NAME: RESULT>>`, and `messages`,
  `turns`, `tool_calls`, `ended` (answer, max_turns, budget), `environment`. Per-function rewards are not there: the run keeps only the
  weighted total (`Run.score`). Each write is whole lines in one `write`, then a flush; a resumed
  run first drops the rows of steps after its checkpoint, and a line a crash cut short, as
  `metrics.jsonl` does, so the file tells one history.
- Warnings: when every scored reward of a step is the same (all 0, all 1, or every completion
  masked) for FLAT_STEPS steps in a row (a constant, not a setting), or more than TRUNCATED_SHARE
  of the completions stop at `rollout.max_new_tokens` for FLAT_STEPS steps in a row: one warning
  naming the likely causes (no answer the reward could find, truncation, a prompt format the
  model does not know, a failing reward function) with an example. It says so once, and again
  only after the condition has been gone FLAT_STEPS steps in a row; a resumed run counts afresh.
  "Equal" is over every drawn group (`Sample.drawn_rewards`): dynamic sampling keeps mixed ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ebpo_lite.engine.metrics import truncate_after

if TYPE_CHECKING:
    import torch

    from ebpo_lite.config import Config
    from ebpo_lite.engine.run import Run, Sample

FILE = "completions.jsonl"
SHOW_CHARS = 300  # printed prompt / completion, characters
ROW_CHARS = 2000  # completions.jsonl prompt / completion, characters
ROWS_PER_WRITE = 16  # completions.jsonl rows per write (whole groups while they fit)
MAX_FILE_BYTES = 20 * 2**20  # completions.jsonl stops growing here
FLAT_STEPS = 5  # K: steps in a row before a warning (and to re-arm it)
TRUNCATED_SHARE = 0.5  # "most completions" hit rollout.max_new_tokens


# ----------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Signals:
    """One step, as the warnings see it."""

    flat: bool  # every scored reward equal, or none scored
    value: float | None  # that common reward; None when every completion was masked
    truncated: float  # share of completions cut at rollout.max_new_tokens


def signals(rewards: torch.Tensor, mask: torch.Tensor, finished: Sequence[bool]) -> Signals:
    """`rewards`, `mask` [B, G] (every drawn group), `finished` per kept completion."""
    valid = rewards[mask]  # [n] scored rewards
    cut = 1.0 - sum(bool(f) for f in finished) / max(len(finished), 1)
    if valid.numel() == 0:
        return Signals(True, None, cut)
    flat = bool((valid == valid[0]).all())
    return Signals(flat, float(valid[0]) if flat else None, cut)


class Streak:
    """Fires once when a condition has held `k` steps in a row; re-arms after it has been false
    `k` steps in a row (so a warning repeats only after a recovery)."""

    def __init__(self, k: int = FLAT_STEPS):
        self.k, self.on, self.off, self.armed = k, 0, 0, True

    def update(self, condition: bool) -> bool:
        self.on, self.off = (self.on + 1, 0) if condition else (0, self.off + 1)
        if self.off >= self.k:
            self.armed = True
        if self.on >= self.k and self.armed:
            self.armed = False
            return True
        return False


def cut_text(text: str, limit: int, keep_end: bool = False) -> str:
    """`text` within `limit` characters, '...' marking what was cut (the front if `keep_end`)."""
    if len(text) <= limit:
        return text
    return "..." + text[-(limit - 3) :] if keep_end else text[: limit - 3] + "..."


def sample_block(rows: list[dict[str, Any]], step: int, total: int) -> str:
    """The printed samples of one step: a header, then prompt and completion of each row."""
    lines = [f"samples at step {step} ({len(rows)} of {total} completions):"]
    for n, row in enumerate(rows, start=1):
        lines.append(f"  [{n}] prompt:     {cut_text(row['prompt'], SHOW_CHARS, True)!r}")
        lines.append(f"      completion: {cut_text(row['completion'], SHOW_CHARS)!r}")
        lines.append(f"      {outcome(row)}, gold answer {cut_text(str(row['answer']), 80)!r}")
    return "\n".join(lines)


def outcome(row: dict[str, Any]) -> str:
    """'reward 1.000, advantage +0.354, finished' (or masked / cut at max_new_tokens)."""
    reward = "masked (no reward)" if row["reward"] is None else f"reward {row['reward']:.3f}"
    end = "cut at max_new_tokens" if row["truncated"] else "finished"
    return f"{reward}, advantage {row['advantage']:+.3f}, {end}"


@dataclass(frozen=True)
class Context:
    """What the warnings need to know about the run besides the step."""

    model: str  # model.name
    raw_prompts: bool  # the built-in task's raw text, not a prompt format (data.is_arithmetic)
    chat_template: bool  # the tokenizer has one
    reward_names: tuple[str, ...]
    max_new_tokens: int
    reward_errors: int = 0  # this step's masked scores: errors and timeouts of user functions


def warning(step: int, sig: Signals, flat: bool, cut: bool, ctx: Context, rows: list[dict]) -> str:
    """The one warning for step `step` (`flat` / `cut`: which streaks fired); `rows` are some
    of the step's completions, the example is taken from them."""
    k, steps = FLAT_STEPS, f"steps {max(step - FLAT_STEPS + 1, 1)}-{step}"
    if flat:
        what = (
            "every completion was masked (no reward)"
            if sig.value is None
            else f"every reward was {sig.value:g}"
        )
        head = f"warning: {what} for {k} steps in a row ({steps}): no learning signal."
    else:
        head = (
            f"warning: {sig.truncated:.0%} of completions stopped at rollout.max_new_tokens="
            f"{ctx.max_new_tokens} for {k} steps in a row ({steps})."
        )
    causes = likely_causes(sig, flat, ctx, [r["completion"] for r in rows])
    lines = [head, *(f"  likely cause: {c}" for c in causes)]
    if rows:
        ex = next((r for r in rows if r["truncated"]), rows[0]) if cut else rows[0]
        lines.append(f"  example prompt:     {cut_text(ex['prompt'], SHOW_CHARS, True)!r}")
        lines.append(f"  example completion: {cut_text(ex['completion'], SHOW_CHARS)!r}")
        lines.append(f"  ({outcome(ex)}, gold answer {cut_text(str(ex['answer']), 80)!r})")
    return "\n".join(lines)


def likely_causes(sig: Signals, flat: bool, ctx: Context, texts: list[str]) -> list[str]:
    """The causes the evidence points to, most likely first."""
    causes = []
    if sig.truncated > TRUNCATED_SHARE:
        causes.append(
            f"truncation: {sig.truncated:.0%} of completions were cut at rollout.max_new_tokens="
            f"{ctx.max_new_tokens} before they ended (a cut answer usually scores 0); raise "
            f"rollout.max_new_tokens (e.g. to {ctx.max_new_tokens * 4})"
        )
    if flat and sig.value is None:
        causes.append(
            f"the reward ({', '.join(ctx.reward_names)}) returned None for every completion: a "
            f"user function that raised or timed out ({ctx.reward_errors} this step; see "
            "reward/errors in metrics.jsonl), or gold answers it cannot parse; call it on the "
            "example below"
        )
    template = template_cause(ctx)
    if flat and template:
        causes.append(template)
    if flat and sig.value == 0:
        causes.append(answer_cause(ctx.reward_names, texts))
    if flat and sig.value:
        causes.append(
            f"every completion scored {sig.value:g}: the prompts are too easy for the model, or "
            f"the reward ({', '.join(ctx.reward_names)}) does not tell completions apart"
        )
    return causes


def template_cause(ctx: Context) -> str | None:
    """A prompt format the model has never seen, or None."""
    if ctx.raw_prompts:
        return None
    if ctx.model == "tiny":
        return (
            "a prompt format the model does not know: the tiny model learnt only the built-in "
            "task's raw prompts ('12+7='), and these prompts go through the 'Question: ... "
            "Answer:' format; send your file's prompts as they are (data.prompt_format=raw) "
            "if they look like '12+7=', or use a model that follows instructions "
            "(model.name=smollm2, or a hub instruct model) for your own data"
        )
    if not ctx.chat_template:
        return (
            "a prompt format the model may not know: its tokenizer has no chat template, so "
            "prompts are plain '{system}\\n\\nQuestion: ...\\nAnswer:' text; use an instruct "
            "model, or set data.system_prompt to the format its answers take"
        )
    return None


def answer_cause(reward_names: Sequence[str], texts: list[str]) -> str:
    """Why a reward of 0 everywhere: what the built-in rewards could not find, or the user's."""
    from ebpo_lite.rewards.extract import extract_answer

    names = ", ".join(reward_names)
    n = max(len(texts), 1)
    if reward_names and reward_names[0] == "math_answer":
        unboxed = sum(extract_answer(t) is None for t in texts)
        return (
            f"no answer found by the reward: {unboxed} of {len(texts)} completions shown have no "
            "\\boxed{} answer and no '####' (math_answer then asks math-verify to find one in "
            "the text); check the prompt asks for \\boxed{} (data.system_prompt)"
        )
    if reward_names and reward_names[0] == "arithmetic_answer":
        plain = sum(t.strip().lstrip("+-").isdigit() for t in texts)
        return (
            f"no answer found by the reward: arithmetic_answer wants the completion to be the "
            f"number and nothing else; {n - plain} of {len(texts)} completions shown are not"
        )
    return (
        f"no answer found by the reward: {names} gave 0 to every completion; check that it "
        "finds the answer in completions like the example below"
    )


# ----------------------------------------------------------------------------- completions.jsonl


def append_rows(path: Path, rows: list[dict[str, Any]], max_bytes: int = MAX_FILE_BYTES) -> bool:
    """Append `rows` as whole lines in one write, then flush; False (nothing written) when the
    file would pass `max_bytes`."""
    text = "".join(json.dumps(row) + "\n" for row in rows)
    size = path.stat().st_size if path.exists() else 0
    if size + len(text.encode("utf-8")) > max_bytes:
        return False
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
    return True


# ----------------------------------------------------------------------------- the loop's side


def printer(metrics) -> Callable[[str], None]:
    """Print above the progress bar when there is one (tqdm's write keeps it whole), else print."""

    def say(text: str) -> None:
        if getattr(metrics, "bar", None) is not None:
            metrics.bar.write(text)
        else:
            print(text, flush=True)

    return say


class Watch:
    """The state the loop keeps for this module: the file, the warning streaks, the cap."""

    def __init__(self, cfg: Config, start: int, say: Callable[[str], None] = print):
        self.cfg, self.say, self.first = cfg, say, start + 1
        self.path = Path(cfg.output_dir) / FILE
        truncate_after(self.path, start)
        self.flat, self.cut = Streak(), Streak()
        self.full = False

    def observe(self, step: int, run: Run, sample: Sample, adv: torch.Tensor) -> None:
        """After a step's advantages: print, write and warn as the module docstring says."""
        log, cfg = self.cfg.log, self.cfg
        sig = signals(sample.drawn_rewards, sample.drawn_mask, sample.rollout.finished)
        flat = self.flat.update(sig.flat)
        cut = self.cut.update(sig.truncated > TRUNCATED_SHARE)
        every = cfg.eval.every
        evals = bool(every and step % every == 0) or step == cfg.train.steps  # as train() does
        show = log.show_completions if step == self.first or evals else 0
        write = bool(log.completions_every and step % log.completions_every == 0) and not self.full
        if not (show or write or flat or cut):
            return
        G, total = cfg.rollout.group_size, len(sample.rollout.completion_ids)
        wanted = list(range(min(total, ROWS_PER_WRITE // G * G or ROWS_PER_WRITE)))
        firsts = list(range(0, min(total, max(show, 1) * G), G))  # each group's first completion
        order = sorted({*wanted, *firsts})
        rows = dict(zip(order, step_rows(run, sample, adv, step, order)))
        if show:
            self.say(sample_block([rows[i] for i in firsts], step, total))
        if write and not append_rows(self.path, [rows[i] for i in wanted]):
            self.full = True
            self.say(
                f"{FILE}: reached its {MAX_FILE_BYTES >> 20} MiB cap at step {step}; no more rows"
            )
        if flat or cut:
            self.say(warning(step, sig, flat, cut, context(run, sample), list(rows.values())))


def step_rows(
    run: Run, sample: Sample, adv: torch.Tensor, step: int, rows: list[int]
) -> list[dict]:
    """The completions.jsonl rows (module docstring) of the kept completions `rows`."""
    roll, tok = sample.rollout, run.policy.tokenizer
    G = len(roll.completion_ids) // max(len(roll.prompt_ids), 1)
    groups = sorted({i // G for i in rows})
    prompts = tok.batch_decode([roll.prompt_ids[b] for b in groups], skip_special_tokens=False)
    prompt = dict(zip(groups, prompts))
    if roll.episodes is not None:  # tool use: the conversation, tool turns marked
        texts = [conversation_text(roll.episodes[i]) for i in rows]
    else:
        texts = tok.batch_decode([roll.completion_ids[i] for i in rows], skip_special_tokens=True)
    rewards, mask, advs = (t.reshape(-1).tolist() for t in (sample.rewards, sample.mask, adv))
    out = []
    for i, text in zip(rows, texts):
        b = i // G
        out.append(
            {
                "step": step,
                "group": b,
                "sample": i % G,
                "example": sample.idx[b],
                "prompt": cut_text(prompt[b], ROW_CHARS, keep_end=True),
                "answer": run.train_examples[sample.idx[b]].answer,
                "completion": cut_text(text, ROW_CHARS),
                "reward": rewards[i] if mask[i] else None,
                "advantage": advs[i],
                "truncated": not roll.finished[i],
                "completion_tokens": roll.loss_tokens(i),  # the model's (not tool results)
                **(episode_row(roll.episodes[i]) if roll.episodes is not None else {}),
            }
        )
    return out


def conversation_text(episode: Any) -> str:
    """An episode as one text: the model's turns as written, each tool result marked
    `<<tool NAME: RESULT>>` (never the model's own words)."""
    parts = [
        m["content"] if m["role"] == "assistant" else f"<<tool {m['name']}: {m['content']}>>"
        for m in episode.messages
    ]
    return " ".join(p for p in parts if p)


def episode_row(episode: Any) -> dict[str, Any]:
    """A tool-use row's extra fields: the conversation's messages, turns, tool calls, how it
    ended (answer, max_turns, budget) and its environment."""
    return {
        "messages": [{**m, "content": cut_text(m["content"], ROW_CHARS)} for m in episode.messages],
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "ended": episode.ended,
        **({"environment": episode.env} if episode.env is not None else {}),
    }


def context(run: Run, sample: Sample) -> Context:
    from ebpo_lite.data.loader import is_arithmetic

    cfg = run.cfg
    return Context(
        model=cfg.model.name,
        raw_prompts=is_arithmetic(cfg.data),
        chat_template=bool(getattr(run.policy.tokenizer, "chat_template", None)),
        reward_names=tuple(name for name, _ in run.reward_fns),
        max_new_tokens=cfg.rollout.max_new_tokens,
        reward_errors=sum(sample.reward_errors.values()),
    )
