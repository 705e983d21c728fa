"""Programs run beside training, never imported by brorl.py: sweeps (ablate), benchmarks (bench,
bench_kernels, bench_trl), the memory check (memcheck), the mass-balance simulation (massbalance)
and the count of the lines one step reads (step_lines). Run each from the repository root as
`python -m tools.<name>`."""
