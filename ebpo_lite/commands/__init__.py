"""The `ebpo-lite` subcommands other than train and eval: plot, export, doctor, label difficulty,
and `train --help`'s key list.
"""
