"""Capacity and overhead benchmarks: vanilla vLLM and kvserve started by the benchmark, same workload, one run."""
