"""Serving: the OpenAI-compatible completions API, the adapter lifecycle and promotion."""
