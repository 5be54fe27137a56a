"""Evaluation suites and evaluation runs that compare a candidate adapter with the one serving."""
