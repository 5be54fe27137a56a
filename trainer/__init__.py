"""Kiln's training engine: a Llama-family decoder on numpy BLAS and Cython kernels.

Pure Python + numpy + native_ext; never imports Django.
"""

from trainer.config import TransformerConfig
from trainer.lora import LoraConfig
from trainer.model import DecoderOnlyTransformer
from trainer.optim import Adam

__all__ = ["Adam", "DecoderOnlyTransformer", "LoraConfig", "TransformerConfig"]
