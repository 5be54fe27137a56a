"""The serving pool: bases and loaded adapters held in memory for completions.

One model instance per served name (a base, or a base with one PEFT adapter loaded from
the registry). Requests read under the shared side of a readers-writer lock; loading,
unloading and activation take the exclusive side only for the moment they swap the
pool's tables and close what they replaced (so no request computes on a model being
closed), so a slow load never blocks completions; a request pinned to a model that a
reload replaced is served by the new load. Each request owns its KV cache, so concurrent
requests on one model are independent; they take turns token by token (TurnLock).
A pool computes on one backend: the CPU engine, or with backend "cuda" the CUDA library, each
model loaded on the CPU and copied once to a trainer.cuda_model.CudaModel (the CPU copy is closed).
"""

import math
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


from trainer.bases import is_registered, load_base
from trainer.generation import SamplingConfig, SamplingRNG, generate
from trainer.peft import import_adapter, read_adapter_config


class ServingError(Exception):
    """A request the pool cannot serve; `code` is machine-readable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ReadWriteLock:
    """Many readers or one writer; writers wait for readers to drain and block new ones."""

    def __init__(self):
        self._condition = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextmanager
    def read(self):
        with self._condition:
            while self._writer or self._waiting_writers:
                self._condition.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._condition:
                self._readers -= 1
                self._condition.notify_all()

    @contextmanager
    def write(self):
        started = time.perf_counter()
        with self._condition:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._condition.wait()
            self._waiting_writers -= 1
            self._writer = True
        waited = time.perf_counter() - started
        try:
            yield waited
        finally:
            with self._condition:
                self._writer = False
                self._condition.notify_all()


class TurnLock:
    """Requests take turns on the pool's backend, one token each, first come first served.

    The kernels and BLAS already use every core for one forward step; two requests stepping at
    once only fight over the cores (OpenBLAS threads from two callers slow both several times
    over). So one request computes at a time and hands over at each token when another waits:
    every stream keeps moving, and a new request waits one step per active stream, not for
    whole completions.
    """

    def __init__(self):
        self._condition = threading.Condition()
        self._queue = deque()  # tickets waiting for a turn, oldest first
        self._holder = None

    @property
    def waiting(self) -> int:
        """Requests queued for a turn now."""
        with self._condition:
            return len(self._queue)

    def _wait_for_turn(self, ticket) -> None:  # with self._condition held
        self._queue.append(ticket)
        while self._holder is not None or self._queue[0] is not ticket:
            self._condition.wait()
        self._queue.popleft()
        self._holder = ticket

    @contextmanager
    def turn(self):
        """Hold the CPU; the yielded `pass_on()` lets a waiting request take one step first."""
        ticket = object()
        with self._condition:
            self._wait_for_turn(ticket)

        def pass_on():
            with self._condition:
                if not self._queue:
                    return  # nobody waits: keep going
                self._holder = None
                self._condition.notify_all()
                self._wait_for_turn(ticket)

        try:
            yield pass_on
        finally:
            with self._condition:
                if self._holder is ticket:
                    self._holder = None
                self._condition.notify_all()


@dataclass
class Served:
    name: str
    base: str
    model: object
    tokenizer: object
    adapter_path: str | None = None


class ServingPool:
    def __init__(self, bases_root: Path, registry: Path, backend: str = "cpu"):
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend must be cpu or cuda, got {backend!r}")
        self.bases_root = Path(bases_root)
        self.registry = Path(registry)
        self.backend = backend
        self.lock = ReadWriteLock()
        self.turns = TurnLock()  # one request computes at a time, token by token
        self._bases = {}  # name -> Served: registered bases
        self._adapters = {}  # name -> Served: loaded adapters (never a base's name: load_adapter refuses those)
        self._active = None  # the adapter served when a request names no model

    def _place(self, model):
        """MODEL on the pool's backend: itself on cpu; on cuda a CudaModel copy, the CPU model closed either way
        (ServingError backend_unavailable, with the loader's reason, when the library cannot be loaded, or with
        backend selection's when the device cannot run the model's attention: trainer.runs.backend.cuda_unavailable
        of its cached decoding at its head size)."""
        if self.backend != "cuda":
            return model
        from native_ext.cuda import CudaUnavailable
        from trainer.cuda_model import CudaModel
        from trainer.runs.backend import cuda_unavailable, probe_cuda
        from trainer.runs.device_plan import DeviceNeed

        try:
            probe = probe_cuda()  # without a device, CudaModel raises the loader's own error below
            reason = cuda_unavailable(probe, DeviceNeed(0, [(model.config.head_dimension, False)])) \
                if probe.get("available") else None
            if reason is not None:
                raise ServingError("backend_unavailable", f"backend cuda is unavailable here: {reason}")
            return CudaModel(model)
        except CudaUnavailable as error:
            raise ServingError("backend_unavailable", f"backend cuda is unavailable here: {error}") from None
        finally:
            model.close()

    def base(self, name) -> Served:
        """The registered base NAME, loaded on first use (ServingError model_not_found when there is none)."""
        served = self._bases.get(name)
        if served is None:
            try:
                model, tokenizer = load_base(name, self.bases_root)
            except (LookupError, ValueError) as error:
                raise ServingError("model_not_found", str(error)) from None
            model = self._place(model)
            served = Served(name=name, base=name, model=model, tokenizer=tokenizer)
            with self.lock.write():
                kept = self._bases.setdefault(name, served)
            if kept is not served:  # another request loaded it meanwhile
                model.close()
        return self._bases[name]

    def load_adapter(self, adapter: str, base: str) -> Served:
        """Load the PEFT snapshot `registry/adapter` over `base` (a fresh model instance). A base's name is refused:
        bases and adapters answer to the same request field, and a base's name means the base."""
        if is_registered(adapter, self.bases_root):
            raise ServingError("adapter_name_reserved", f"{adapter!r} is the name of a registered base; an adapter "
                                                        "of that name cannot be served (train it under another name)")
        path = self.registry / adapter
        if not (path / "adapter_config.json").is_file():
            raise ServingError("adapter_not_found", f"no PEFT snapshot for adapter {adapter!r} in {self.registry}")
        read_adapter_config(path)
        try:
            model, tokenizer = load_base(base, self.bases_root)
        except (LookupError, ValueError) as error:
            raise ServingError("model_not_found", str(error)) from None
        try:
            import_adapter(model, path)
        except ValueError as error:
            model.close()
            raise ServingError("adapter_incompatible", str(error)) from None
        model = self._place(model)
        served = Served(name=adapter, base=base, model=model, tokenizer=tokenizer, adapter_path=str(path))
        with self.lock.write():  # the replaced model is closed while no request can be computing on it
            previous = self._adapters.get(adapter)
            self._adapters[adapter] = served
            if previous is not None:
                previous.model.close()
        return served

    def unload(self, name: str):
        """Unload the adapter NAME, else the base NAME."""
        with self.lock.write():
            served = self._adapters.pop(name, None)
            if served is None:
                served = self._bases.pop(name, None)
            if self._active == name:
                self._active = None
            if served is not None:
                served.model.close()  # under the lock: no request is computing on it
        if served is None:
            raise ServingError("model_not_found", f"{name!r} is not loaded")

    def activate(self, adapter: str):
        with self.lock.write():
            if adapter not in self._adapters:
                raise ServingError("adapter_not_loaded", f"load adapter {adapter!r} before activating it")
            self._active = adapter

    def deactivate(self):
        """Serve no adapter by default (requests must name a model); nothing is unloaded."""
        with self.lock.write():
            self._active = None

    @property
    def active(self):
        return self._active

    def loaded(self) -> list:
        with self.lock.read():
            return [{"name": s.name, "base": s.base, "adapter": s.adapter_path is not None,
                     "active": s.name == self._active} for s in [*self._bases.values(), *self._adapters.values()]]

    def adapter(self, name: str) -> Served:
        """The loaded adapter NAME (ServingError model_not_found when it is not loaded)."""
        served = self._adapters.get(name)
        if served is None:
            raise ServingError("model_not_found", f"no adapter named {name!r} is loaded")
        return served

    def resolve(self, name: str | None) -> Served:
        """The served model for a request's `model` (None: the active adapter): a registered base by that name
        first (an adapter can never stand in for one), else a loaded adapter."""
        if name is None:
            if self._active is None:
                raise ServingError("model_required", "no adapter is active; name a model")
            return self.adapter(self._active)
        if name in self._bases or is_registered(name, self.bases_root) or name not in self._adapters:
            return self.base(name)
        return self._adapters[name]

    def complete(self, name, prompt_ids, sampling: SamplingConfig, seed=None, echo=False, on_token=None,
                 top_logprobs=0, served=None):
        """Run one completion under the shared lock; returns (Served, Generation).

        `on_token(token, logprob, top)` sees each token as it is chosen (streaming); `served`, a
        model already resolved by the caller, pins the request to it."""
        served = served or self.resolve(name)
        rng = None if sampling.temperature == 0 else SamplingRNG(seed if seed is not None else 0)
        with self.lock.read(), self.turns.turn() as pass_on:
            if served.model.closed:  # unloaded, or reloaded since the caller resolved it: what serves that name now
                table = self._adapters if served.adapter_path is not None else self._bases
                current = table.get(served.name)
                if current is None or current.model.closed:
                    raise ServingError("model_not_found", f"{served.name!r} was unloaded")
                served = current

            def step(token, logprob, top):
                if on_token is not None:
                    on_token(token, logprob, top)
                pass_on()

            return served, generate(served.model, prompt_ids, sampling, rng, tokenizer=served.tokenizer,
                                    echo=echo, on_token=step, top_logprobs=top_logprobs)

    def canary(self, adapter: str) -> tuple:
        """(passed, reason): the adapter loads, generates, and its log-probabilities are finite."""
        try:
            served = self._adapters.get(adapter)
            if served is None:
                raise ServingError("adapter_not_loaded", f"{adapter!r} is not loaded")
            prompt = served.tokenizer.encode(served.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Say hello."}], add_generation_prompt=True))
            _, generation = self.complete(adapter, prompt, SamplingConfig(max_new_tokens=4, temperature=0),
                                          echo=True, served=served)
        except ServingError as error:
            return False, error.message
        values = generation.logprobs + generation.prompt_logprobs
        if not generation.tokens or not all(math.isfinite(v) for v in values):
            return False, "the canary completion has no tokens or non-finite log-probabilities"
        return True, "loaded, generated and scored"

    def close(self):
        with self.lock.write():
            served = [*self._bases.values(), *self._adapters.values()]
            self._bases, self._adapters = {}, {}
            for s in served:
                s.model.close()
