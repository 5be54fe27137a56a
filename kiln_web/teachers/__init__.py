"""Teacher aliases for on-policy distillation: name@route, its configuration and revisions."""
