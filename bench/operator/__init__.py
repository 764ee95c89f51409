"""Benchmarks of the operator on a real control plane (tests/cluster): `python -m bench.operator.scale`."""
