"""One run's mechanics, below the loop in `train.py`: building a run, checkpoints, numerical
faults, metrics, the checks made before anything loads, what a run says at start, the
completions it shows.
"""
