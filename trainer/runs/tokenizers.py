"""A registered base's tokenizer without its weights: what admission needs to tokenize a request.

Built on trainer.bases' public registry functions; loading the model (trainer.bases.load_base) is
left to the worker that trains.
"""

from trainer.tokenizer import Tokenizer, byte_tokenizer


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
