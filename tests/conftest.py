"""The tests import the project's modules from the repository root, wherever pytest is started."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub: tests use what we ship
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
