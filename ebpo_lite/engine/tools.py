"""A run's tool use, put together: what `engine/run.py` calls (so it needs one line per seam).

- `prepare` (before the model loads): the contract (`contract.load`) and its contained host,
  probed once, so a mistake in the set-up is one line before anything heavy happens;
- `make_runner` (after it loads): the format that reads calls (`formats.TinyFormat` for the
  tiny model, `chat.ChatFormat` through a chat template) and the episode loop (`episodes.py`);
- `reward_inputs`: what reward functions get beside TRL's columns (`environments`) and the
  environments' own rewards (`get_reward`, weight 1, as TRL adds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ebpo_lite.engine.episodes import EpisodeRunner
from ebpo_lite.env import contract
from ebpo_lite.errors import ConfigError


@dataclass
class Tools:
    setup: contract.ToolSetup
    host: Any  # host.ToolHost | host.LocalToolHost

    def line(self) -> str:
        """The start-up line: the environments and their tools."""
        parts = []
        for name in self.setup.names:
            cls = self.setup.factories.get(name)
            what = cls.__name__ if cls is not None else "plain tools"
            label = what if name is None else f"{name}={what}"
            parts.append(f"{label} [{', '.join(self.setup.tool_names(name))}]")
        kind = type(self.host).__name__
        where = "in the trainer's process" if kind.startswith("Local") else "in a contained worker"
        return f"tools: {'; '.join(parts)} ({where})"

    def close(self) -> None:
        self.host.close()


def prepare(cfg: Any, objects: tuple[Any, list] | None = None, log=print) -> Tools | None:
    """`env.factory` / `env.tools` (or the Python API's objects), resolved and probed; None
    when the recipe uses no tools."""
    factory, tools = objects if objects is not None else (cfg.env.factory, list(cfg.env.tools))
    recipe = getattr(cfg, "_origin", (None,))[0]
    recipe_dir = Path(recipe).resolve().parent if recipe and Path(recipe).is_file() else None
    setup = contract.load(factory, tools, recipe_dir)
    if setup is None:
        return None
    from ebpo_lite.env.host import make_host

    host = make_host(dict(setup.factories), list(setup.tools), cfg.env.tool_timeout_s)
    host.describe()  # constructs each class once, in the host: a failing __init__ is one line
    return Tools(setup, host)


def tiny_format(cfg: Any) -> bool:
    """Whether calls are written in the tiny model's tags: `env.format`, where auto means the
    tiny model's tags for the tiny model and the chat template for every other."""
    return cfg.env.format == "tiny" or (cfg.env.format == "auto" and cfg.model.name == "tiny")


def tool_format(cfg: Any, setup: contract.ToolSetup, tokenizer: Any):
    """`env.format` (auto: the tiny model's tags for the tiny model, else the chat template)."""
    if tiny_format(cfg):
        from ebpo_lite.env.formats import TinyFormat

        return TinyFormat(tokenizer, setup.first_params)
    from ebpo_lite.env import chat

    problem = chat.supports_tools(tokenizer, renders_calls=False)  # the history is never
    if problem is not None:  # re-rendered: plain ChatML (SmolLM2's) is read in Hermes form
        raise ConfigError(f"env.format: {cfg.model.name}'s chat template {problem}")
    every = [s for name in setup.names for s in setup.schemas[name]]
    return chat.ChatFormat(tokenizer, every)


def encoder(cfg: Any, tools: Tools, tokenizer: Any):
    """`encode(example, text="")`: an example's prompt ids, `reset`'s text appended to its
    question (TRL appends it to the last user message). The tiny format's prompts are the raw
    text, as without tools; a chat prompt renders the tools through the template (`chat.py`)."""
    import dataclasses

    from ebpo_lite.data.loader import encode_prompt

    if tiny_format(cfg):

        def encode(example, text: str = "") -> list[int]:
            ex = dataclasses.replace(example, prompt=example.prompt + text) if text else example
            return encode_prompt(tokenizer, ex, cfg.data)

        return encode
    from ebpo_lite.env import chat

    schemas = {name: tools.setup.schemas[name] for name in tools.setup.names}

    from ebpo_lite.data.prompts import DEFAULT_SYSTEM_PROMPT

    d = cfg.data
    system = DEFAULT_SYSTEM_PROMPT if d.system_prompt is None else d.system_prompt

    def encode_chat(example, text: str = "") -> list[int]:
        env = contract.environment_of(tools.setup, example.meta, repr(example.prompt[:40]))
        user = {"role": "user", "content": example.prompt + text}
        messages = ([{"role": "system", "content": system}] if system else []) + [user]
        rendered = chat.prompt_text(tokenizer, messages, schemas[env], d.thinking)
        return tokenizer.encode(rendered, add_special_tokens=False)

    return encode_chat


def prompts(cfg: Any, tools: Tools, tokenizer: Any, examples: list, prompt_ids: list[list[int]]):
    """(the training prompts' ids, `encoder`): re-encoded with the tools for a chat model."""
    encode = encoder(cfg, tools, tokenizer)
    if tiny_format(cfg):
        return prompt_ids, encode
    return [encode(ex) for ex in examples], encode


def make_runner(cfg: Any, tools: Tools, policy: Any, backend: Any, encode) -> EpisodeRunner:
    """The episode loop of a run; `encode(example, text)` gives an example's prompt ids with
    `reset`'s text appended."""
    tokenizer = policy.tokenizer
    context = getattr(backend, "max_model_len", 0) or _model_context(policy)
    return EpisodeRunner(
        tools.setup,
        tools.host,
        tool_format(cfg, tools.setup, tokenizer),
        tokenizer,
        cfg.env,
        cfg.rollout.max_new_tokens,
        context,
        encode,
    )


def _model_context(policy: Any) -> int:
    config = getattr(policy.model, "config", None)
    return int(getattr(config, "max_position_embeddings", 0) or 1 << 30)


def reward_inputs(tools: Tools | None, n: int) -> tuple[dict[str, Any], list[float | None]]:
    """({"environments": copies of this draw's n instances} or {}, each episode's `get_reward`
    (None where its environment has none))."""
    if tools is None:
        return {}, [None] * n
    rows = list(range(n))
    extra = {"environments": tools.host.instances(rows)} if tools.setup.factories else {}
    if any(tools.setup.rewarded.values()):
        return extra, tools.host.rewards(rows)
    return extra, [None] * n
