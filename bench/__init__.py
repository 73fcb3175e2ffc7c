"""Benchmarks of the agent against the physical floor and its peers (``make bench``)."""
