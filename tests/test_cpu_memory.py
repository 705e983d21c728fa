"""A CPU run keeps freed memory for its next tensors (lib/setup.keep_freed_memory): a step's large
temporaries, made and freed again and again, cost their page faults once, not at every pass.
Fast: a subprocess each."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Five log-prob passes over a (256, 49152) chunk of bf16 logits (the fp32 copy and its temporaries
# ~50 MiB each, as a step makes them), after one to warm up; prints their minor page faults.
PASSES = """
import resource, sys, torch
sys.path.insert(0, {root!r})
import kernels
from lib import setup
if {keep}:
    assert setup.keep_freed_memory()
logits = torch.randn(256, 49152).bfloat16()
targets = torch.randint(0, 49152, (256,))
kernels.logprobs_fwd_ref(logits, targets, 0.6, True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    kernels.logprobs_fwd_ref(logits, targets, 0.6, True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep: bool) -> int:
    code = PASSES.format(root=str(Path(__file__).resolve().parent.parent), keep=keep)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def host_changes_the_faults() -> str:
    """Why this host would fault fewer pages without the setting too ('' if it would not): huge
    pages for every allocation, or malloc's thresholds already set from the environment."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[always]" in thp.read_text():
        return "transparent huge pages for every allocation"
    tuned = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
             if k in os.environ]
    return f"{tuned[0]} set" if tuned else ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
@pytest.mark.skipif(bool(host_changes_the_faults()), reason=host_changes_the_faults() or "-")
def test_passes_over_large_temporaries_fault_few_pages_once_freed_memory_is_kept():
    without = faults(keep=False)
    assert without > 5 * 3 * 2**26 // 4096 // 2  # what it guards: each pass faults its temporaries
    assert faults(keep=True) < without // 4
