"""A registered base's tokenizer without its weights: what admission needs to tokenize a request; and the
tokenizer identity a run binds, with the instant a clock-reading chat template renders at.

Built on trainer.bases' public registry functions; loading the model (trainer.bases.load_base) is
left to the worker that trains.

A chat template that calls strftime_now (Llama 3's "Today Date: ...") renders the training data with the
date, so a run pins one instant (`pin_template_clock`): a new run the admission's, a resume its checkpoint's.
The run's tokenizer identity records it as `template_clock` (`run_tokenizer_identity`); a template that
reads no clock has no such field, so its identity is the one checkpoints always recorded.
"""

from datetime import datetime

from trainer.tokenizer import Tokenizer, byte_tokenizer

TEMPLATE_CLOCK = "template_clock"


def load_tokenizer(name: str, root=None, verify: bool = True) -> Tokenizer:
    """The Tokenizer of registered base NAME; its shards are checked against the base's identity first
    (as load_base does) unless verify=False, but no tensor is read into a model."""
    from trainer import bases
    info = bases.verify_base(name, root) if verify else bases.show_base(name, root)
    if info.materialised:
        return Tokenizer.from_directory(info.path)
    if info.builtin:  # the built-in base before its first load: the same tokenizer it will write
        return byte_tokenizer(bases.TINY_SPECIALS, bases.TINY_TOKENIZER_CONFIG)
    raise LookupError(f"base {name!r} has no files in {info.path}")


def pin_template_clock(tokenizer: Tokenizer, instant: str | None = None) -> None:
    """Render TOKENIZER's clock-reading chat template at INSTANT (an ISO date and time; None: now, to the second)
    from here on; a template that reads no clock is left as it is. ValueError for an INSTANT that is no ISO
    date and time."""
    if not tokenizer.reads_clock:
        return
    if instant is not None and not isinstance(instant, str):
        raise ValueError(f"{TEMPLATE_CLOCK} must be an ISO date and time, got {instant!r}")
    tokenizer.pin_clock(None if instant is None else datetime.fromisoformat(instant))


def run_tokenizer_identity(tokenizer: Tokenizer) -> dict:
    """TOKENIZER's identity as a run binds it: with `template_clock` where its template reads the clock."""
    identity = tokenizer.identity()
    if tokenizer.reads_clock:
        clock = tokenizer.template_clock
        identity[TEMPLATE_CLOCK] = None if clock is None else clock.isoformat()
    return identity
