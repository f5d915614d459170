"""Finished A/B experiments, kept with their verdicts (``benchmarks/research/README.md``).

Each script here measured one question once; the answer went into moekit or was recorded as not
adopted, and the raw outputs live in ``benchmarks/results/checks/``. They still run
(``python3 benchmarks/research/<name>.py`` or ``python -m benchmarks.research.<name>``), to repeat
a measurement on new code. What users and CI run (the harness, the GPU checks, the summary) stays
one folder up.
"""
