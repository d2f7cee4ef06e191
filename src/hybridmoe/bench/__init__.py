"""The measurement harness: what `hybridmoe bench` and the scripts under benchmarks/ run.

e2e (one model's prefill / decode speed, the `bench` command's), suite (one engine measured row by row
as benchmarks/e2e.py reports it), floor (the decode floor of a loaded placement), layers (per-layer
times for full-depth figures), fit (full depth fitted over several cut depths), anatomy (where a hybrid
decode step's time goes), prompts (random-prompt runs of the quality benchmarks), load_rss (peak RSS of
a load, in a fresh process) and synthetic (a make-model checkpoint written to memory for one run).
"""
