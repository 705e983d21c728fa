"""The machinery brorl.py imports and a reader of the algorithm may skip, but for step.py (what the
step's phases hand each other): the run harness (flags, run directory, checkpoints, plots, resume),
the model plumbing (policy.py, logprobs.py, lora.py), the memory planner, K processes
(distributed.py) and real datasets by schema (tasks.py)."""
