"""Shared data: the prompt suites and the task sets that the bench, the calibration and distill
all read (package data beside these modules)."""
