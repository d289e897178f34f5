"""The trainable policy (base + LoRA, log-probs), the built-in tiny model, the base model's source,
device and dtype, float16 loss scaling, and the memory planner (`plan`, `memory`, `plan_vllm`,
`gpus`) with the NF4 gradient check.
"""
