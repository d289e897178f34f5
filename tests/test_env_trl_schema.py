"""One environment class, two trainers: TRL 1.16's GRPOTrainer and ebpo_lite see the same tools
with the same JSON schemas (issue 41: an environment written for TRL runs here unchanged).

TRL's GRPOTrainer is built for real (tiny model, TRL's own Qwen3 chat template on a local
tokenizer) with `environment_factory=` and `tools=`; the tools it extracted are described with
transformers' `get_json_schema`, as its chat template rendering does, and compared with
`ebpo_lite.env.contract.load`'s. Needs trl (CI tier `.ci/tier_integrations.sh`).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl")

from transformers.utils import get_json_schema  # noqa: E402

from ebpo_lite.env import contract  # noqa: E402
from tests.test_env_trl import tokenizer  # noqa: E402


class Inventory:
    """A TRL-style environment: state, two tools, a reward."""

    def reset(self, **kwargs) -> str | None:
        self.items: dict[str, int] = {}
        return None

    def put(self, name: str, count: int = 1) -> str:
        """Put items on the shelf.

        Args:
            name: what to put
            count: how many of it
        """
        self.items[name] = self.items.get(name, 0) + count
        return str(self.items[name])

    def count(self, name: str) -> int:
        """How many of an item are on the shelf.

        Args:
            name: the item
        """
        return self.items.get(name, 0)

    def get_reward(self) -> float:
        return float(sum(self.items.values()))

    def _private(self) -> None:
        """Not a tool (leading underscore)."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ebpo_lite.model.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("trl_env")
    build_tiny_model(0).save_pretrained(out / "model")
    args = GRPOConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}] * 4)
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(out / "model"),
        processing_class=tokenizer("qwen3.jinja"),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=data,
        environment_factory=Inventory,
        tools=[multiply],
    )


def _by_name(schemas: list[dict]) -> dict[str, dict]:
    return {s["function"]["name"]: s for s in schemas}


def test_trl_and_ebpo_lite_see_the_same_tools_with_the_same_schemas(trl_trainer):
    trl_tools = trl_trainer._env_tools[None]  # TRL's: plain tools + the instance's methods
    trl_schemas = _by_name([get_json_schema(t) for t in trl_tools])
    ours = contract.load(Inventory, [multiply])
    our_schemas = _by_name(ours.schemas[None])
    assert set(trl_schemas) == set(our_schemas) == {"put", "count", "multiply"}
    assert trl_schemas == our_schemas  # descriptions, types, defaults, required: all of it
    assert our_schemas["put"]["function"]["parameters"]["required"] == ["name"]
    assert ours.rewarded[None] is True  # get_reward: a reward source in both (TRL adds one)
    assert "Inventory" in trl_trainer.reward_func_names


def test_the_same_class_by_target_gives_the_same_schemas():
    by_object = contract.load(Inventory, [multiply])
    by_target = contract.load(
        "tests.test_env_trl_schema:Inventory", ["tests.test_env_trl_schema:multiply"]
    )
    assert by_object.schemas == by_target.schemas
