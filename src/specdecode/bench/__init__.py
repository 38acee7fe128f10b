"""The benchmark lab: prompt suites, methods run side by side, records, aggregates and reports.

`specdecode bench` runs it (cli_bench.py); `specdecode report DIR` re-renders a saved run.
"""
