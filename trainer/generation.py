"""KV-cached sampling and log-probability scoring for a DecoderOnlyTransformer.

Sampling draws from an explicit SamplingRNG (numpy PCG64) whose state is plain JSON, so
a rollout can be checkpointed and continued exactly: the same seed or state and the same
model give the same tokens. Log-probabilities reported for tokens are the model's own
(temperature 1, no truncation), which is what GRPO, OPD, serving and evaluation use.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from native_ext import kernels


def check_cache_size(config, batch_size, positions) -> tuple:
    """(batch_size, positions) of a new KV cache, checked; positions None means maximum_context."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if positions is None:
        positions = config.maximum_context
    if isinstance(positions, bool) or not isinstance(positions, int) or not 1 <= positions <= config.maximum_context:
        raise ValueError(f"positions must be an integer in [1, maximum_context {config.maximum_context}], "
                         f"got {positions!r}")
    return batch_size, positions


def check_cache_room(config, cache, B, T) -> None:
    """ValueError unless CACHE holds B sequences and has room for T more tokens."""
    if cache.batch_size != B:
        raise ValueError(f"the cache holds {cache.batch_size} sequences, got {B}")
    if cache.length + T > cache.positions:
        limit = "maximum_context" if cache.positions == config.maximum_context else "the cache's positions"
        raise ValueError(f"{cache.length} cached + {T} new tokens exceed {limit} {cache.positions}")


class KVCache:
    """Rotated keys and values of every block for B sequences, up to `positions` tokens (maximum_context)."""

    def __init__(self, model, batch_size=1, positions=None):
        cfg = model.config
        batch_size, positions = check_cache_size(cfg, batch_size, positions)
        shape = (batch_size * cfg.kv_heads, positions, cfg.head_dimension)  # [G,P,D]
        self.keys = [np.zeros(shape, np.float32) for _ in range(cfg.block_count)]
        self.values = [np.zeros(shape, np.float32) for _ in range(cfg.block_count)]
        self.batch_size, self.positions = batch_size, positions
        self.length = 0


class SamplingRNG:
    """An explicit, serialisable random stream for sampling."""

    def __init__(self, seed=0):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self._generator = np.random.Generator(np.random.PCG64(seed))

    def uniform(self) -> float:
        return float(self._generator.random())

    def state(self) -> dict:
        """Plain JSON data that from_state() turns back into the same stream."""
        return self._generator.bit_generator.state

    @classmethod
    def from_state(cls, state: dict) -> "SamplingRNG":
        if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampling RNG state must be a PCG64 state")
        rng = cls(0)
        try:
            rng._generator.bit_generator.state = state
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(f"malformed sampling RNG state: {error}") from error
        return rng


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")  # chat templates' end-of-turn markers


def stop_token_ids(tokenizer, chat: bool) -> tuple:
    """Where an answer ends: end of text, and for a chat prompt the template's end-of-turn marker when it is a
    token of its own (serving and evaluation stop at the same place)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if chat:
        for marker in END_OF_TURN_TOKENS:
            token = tokenizer.token_to_id(marker)
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: smallest set whose probability reaches top_p
    top_k: int = 0  # 0: no limit
    stop_token_ids: tuple = ()  # generation ends after emitting one of these (EOS)
    stop_strings: tuple = ()  # generation ends when the decoded text contains one

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")


@dataclass
class Generation:
    tokens: list  # generated token ids (stop token included, stop-string tail excluded)
    logprobs: list  # model log-probability of each generated token
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    text: str | None = None  # decoded completion when a tokenizer was given
    prompt_logprobs: list = field(default_factory=list)  # with echo: log p of prompt[1:]
    top_logprobs: list = field(default_factory=list)  # with top_logprobs=k: [(id, log p), ...] per token
    prompt_top_logprobs: list = field(default_factory=list)  # with echo and top_logprobs=k: per prompt[1:]


def _log_softmax(logits):  # [V] float32 -> float64
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def choose_token(logits, config: SamplingConfig, rng: SamplingRNG) -> int:
    """Greedy (temperature 0) or a draw after temperature, top-k and top-p."""
    if config.temperature == 0:
        return int(np.argmax(logits))
    logp = _log_softmax(logits / np.float32(config.temperature))
    order = np.argsort(-logp, kind="stable")  # most probable first, ties by id
    probs = np.exp(logp[order])
    keep = len(order)
    if config.top_k:
        keep = min(keep, config.top_k)
    if config.top_p < 1.0:
        cumulative = np.cumsum(probs[:keep])
        keep = min(keep, int(np.searchsorted(cumulative, config.top_p * cumulative[-1])) + 1)
    probs = probs[:keep] / probs[:keep].sum()
    u = rng.uniform()
    index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(index, keep - 1)])


def top_k_logprobs(logp, k: int) -> list:
    """The k most probable (token id, log-probability) pairs of one row, most probable first, ties by id."""
    k = min(k, logp.shape[-1])
    candidates = np.argpartition(-logp, k - 1)[:k]
    order = sorted(candidates.tolist(), key=lambda t: (-logp[t], t))
    return [(int(t), float(logp[t])) for t in order]


def generate(model, prompt_ids, config: SamplingConfig, rng: SamplingRNG | None = None,
             tokenizer=None, echo=False, on_token=None, top_logprobs=0) -> Generation:
    """Sample a completion of one prompt with a KV cache.

    `on_token(token, logprob, top)` is called after each token is chosen (a streaming server
    sends it on; an exception it raises ends the generation). `top_logprobs` > 0 also
    reports that many most probable alternatives per token (`top`, else None), and per
    prompt token with echo.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("the prompt needs at least one token")
    if config.stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the completion")
    if rng is None:
        if config.temperature != 0:
            raise ValueError("sampling with temperature > 0 needs an explicit SamplingRNG")
        rng = SamplingRNG(0)
    budget = model.config.maximum_context - prompt.size
    if budget < 1:
        raise ValueError(f"the prompt ({prompt.size} tokens) leaves no room in maximum_context "
                         f"{model.config.maximum_context}")
    cache = model.kv_cache(1, prompt.size + min(config.max_new_tokens, budget))
    prompt_logprobs, prompt_top, top = [], [], []
    if echo:
        logits = model.forward_cached(prompt[None, :], cache)[0]  # [T,V]
        prompt_logprobs = gather_logprobs(logits[:-1], prompt[1:]).tolist()
        if top_logprobs:
            prompt_top = [top_k_logprobs(_log_softmax(row), top_logprobs) for row in logits[:-1]]
        logits = logits[-1]
    else:
        logits = model.forward_cached(prompt[None, :], cache, last_only=True)[0, -1]  # [V]
    tokens, logprobs, finish = [], [], "length"
    text = None
    for _ in range(min(config.max_new_tokens, budget)):
        token = choose_token(logits, config, rng)
        logp = _log_softmax(logits)  # [V]
        tokens.append(token)
        logprobs.append(float(logp[token]))
        if top_logprobs:
            top.append(top_k_logprobs(logp, top_logprobs))
        if on_token is not None:
            on_token(token, logprobs[-1], top[-1] if top_logprobs else None)
        if token in config.stop_token_ids:
            finish = "stop"
            break
        if config.stop_strings:
            text = tokenizer.decode(tokens)
            hit = min((text.find(s) for s in config.stop_strings if s in text), default=-1)
            if hit >= 0:
                text = text[:hit]
                finish = "stop"
                break
        if cache.length >= model.config.maximum_context:
            break
        logits = model.forward_cached(np.array([[token]]), cache)[0, -1]
    if tokenizer is not None and text is None:
        text = tokenizer.decode(tokens)
    return Generation(tokens=tokens, logprobs=logprobs, finish_reason=finish, text=text,
                      prompt_logprobs=prompt_logprobs, top_logprobs=top, prompt_top_logprobs=prompt_top)


def gather_logprobs(logits, targets) -> np.ndarray:
    """log softmax(logits)[target] per row: logits [N,V], targets [N] -> [N] float32."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    targets = np.ascontiguousarray(targets, dtype=np.int64)
    out = np.empty(targets.shape[0], np.float32)
    kernels.log_softmax_gather(logits, targets, out)
    return out


def score_completion(model, prompt_ids, completion_ids) -> np.ndarray:
    """The model's log-probability of each completion token after the prompt: [len(completion)]."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    completion = np.asarray(completion_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0 or completion.size == 0:
        raise ValueError("prompt and completion need at least one token each")
    sequence = np.concatenate([prompt, completion])[None, :]  # [1,T]
    logits = model.logits(sequence[:, :-1])[0, prompt.size - 1:]  # [len(completion),V]
    return gather_logprobs(logits, completion)
