"""Multi-turn tool use and environments (docs/tools.md).

- `contract`: the user's side, TRL's: `env.factory` (a class, one instance per episode, `reset`,
  public methods as tools, optional `get_reward`), `env.tools` (plain functions); their JSON
  schemas come from transformers' `get_json_schema`.
- `host`: tools and environment instances run contained (a worker process, a time limit per
  call, errors and oversized results turned into messages to the model).
- `formats`: how a turn's tool calls are read and a tool result is written as tokens: the tiny
  model's tag format here, chat models' through their chat template (`chat`).
- `calculator`: the built-in tool of recipes/tiny_tools_cpu.yaml.

The folder sits low (it imports neither the model nor the samplers): the episode loop that uses
it is `engine/episodes.py`, above the sampler seam, and `engine/tools.py` puts a run's together.
"""
