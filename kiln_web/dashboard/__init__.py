"""The browser dashboard: jobs, live progress, checkpoints, prepare-resume, adapters; no models of its own."""
