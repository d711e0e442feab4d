"""Trace-replay simulation of an Argus cluster: workloads, policies, cluster model, reports."""
