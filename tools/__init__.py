"""Programs run beside training, never imported by brorl.py: sweeps (ablate), benchmarks (bench,
bench_kernels, bench_trl), the memory check (memcheck) and the mass-balance simulation (massbalance).
Run each from the repository root as `python -m tools.<name>`."""
