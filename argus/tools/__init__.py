"""Programs built on the services, on the top floor beside ``argus.cli``: nothing below them
imports them.

A client of the public endpoint (``client``), live replay against a running cluster (``live``),
real quality tables through the worker and PickScore (``profiler``), and a whole cluster as
local processes (``local_cluster``). Each is what an ``argus`` command runs, kept out of
``argus.cli`` because tests and benchmarks call it too (``tests/test_layers.py``).
"""
