"""The machinery brorl.py imports and a reader of the algorithm may skip, but for step.py (what the
step's phases hand each other): the run harness (flags, run directory, checkpoints, plots, resume),
the model plumbing (policy.py, logprobs.py, lora.py, attention.py), the memory planner and K
processes (distributed.py)."""
