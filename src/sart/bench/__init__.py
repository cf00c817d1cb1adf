"""Benchmarks: generative workloads, traces, the experiment runner and ``sart bench``.

Pure parts (workloads, traces, the runner) need only the core; the report
(rich tables, matplotlib plots) needs the ``[bench]`` extra.
"""
