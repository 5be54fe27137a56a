"""Training jobs: submission, the worker that claims and runs them, progress, cancellation."""
