"""A reward function of your own, as `reward.functions: [my_rewards:exact_integer]` names it.

The trainer calls it with one batch at a time: `completions` (the decoded texts) and one list per
column of the data, aligned with them: `answer`, `prompts`, and every other field of the rows
(here `problem` and `solution` are mapped to the prompt and the answer, so they arrive as
`prompts` and `answer`). It returns one score per completion: a float, or None for "cannot
judge" (that completion leaves the loss). It runs in its own worker process
(ebpo_lite/rewards/contained.py): an exception or a hang masks the batch, it does not end the run.
The module is imported by name, so it must be importable from where the script runs (the
script's folder is on the path).
"""

from __future__ import annotations


def exact_integer(completions: list[str], answer: list[str], **columns) -> list[float | None]:
    """1.0 when the completion is the answer's integer (spaces around it allowed), else 0.0;
    None when the row's answer is not an integer (a data error, not the model's)."""
    scores: list[float | None] = []
    for text, gold in zip(completions, answer):
        try:
            want = int(str(gold).strip())
        except ValueError:
            scores.append(None)
            continue
        scores.append(1.0 if text.strip() == str(want) else 0.0)
    return scores
