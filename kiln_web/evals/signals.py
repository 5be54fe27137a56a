"""Signals of the evaluation app; sent only after the database commit."""

from django.dispatch import Signal

# an evaluation run ended (succeeded or failed); keyword argument run_id. Promotion gates listen.
evaluation_finished = Signal()
