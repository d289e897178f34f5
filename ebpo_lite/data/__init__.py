"""Examples and where they come from: the `Example` record, prompts, the built-in arithmetic task
and the held-out split (`loader`), math presets and files, local or hub sources, JSON-lines
files, per-example labels and topics.
"""
