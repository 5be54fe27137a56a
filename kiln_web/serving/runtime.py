"""The one place kiln_web.serving reaches the trainer: this process's serving pool, kept in step
with the database's ServedAdapter rows, scratch pools for canaries and evaluations, and the
PEFT snapshots in the adapter registry.

One ServingRuntime per process, created on first use from the settings: the pool, the
threads completions run on, and what this process has loaded. `reconcile()` makes the pool
match the rows (load, reload on a new generation, unload, activate); a snapshot whose bytes
differ from what was recorded when it was loaded is refused, never served in its place.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from trainer.bases import is_registered, list_bases
from trainer.generation import SamplingConfig  # noqa: F401  (re-exported for the views)
from trainer.serving import ServingError, ServingPool

SNAPSHOT_CONFIG = "adapter_config.json"
SNAPSHOT_WEIGHTS = "adapter_model.safetensors"
HEX12 = "[0-9a-f]{12}"


@dataclass(frozen=True)
class WantedAdapter:
    """One ServedAdapter row, as a process reconciles against it."""

    name: str
    base: str
    generation: int
    sha256: str
    active: bool
    scope: int | None = None  # active for this user's requests that name no model (ServedAdapter.active_for)


def wanted_adapters() -> tuple:
    """The ServedAdapter rows (a database read: call it from synchronous code)."""
    from kiln_web.serving.models import ServedAdapter

    return tuple(WantedAdapter(row.adapter.name, row.base, row.generation, row.adapter_sha256, row.active,
                               row.active_for_id if row.active else None)
                 for row in ServedAdapter.objects.select_related("adapter").order_by("adapter__name"))


def usable_adapters(user, wanted: tuple) -> frozenset:
    """The names among WANTED that USER may be served (a database read, every request: no process keeps who
    may see what, so a share or unshare holds in every process at once)."""
    from kiln_web.adapters.models import Adapter

    names = [w.name for w in wanted]
    return frozenset(Adapter.objects.visible_to(user).filter(name__in=names).values_list("name", flat=True))


# -- the adapter registry's PEFT snapshots --


def registry() -> Path:
    return Path(settings.KILN_ADAPTERS_DIR)


def snapshot_path(name: str) -> Path:
    return registry() / name


def has_snapshot(name: str) -> bool:
    return (snapshot_path(name) / SNAPSHOT_CONFIG).is_file()


def snapshot_sha256(name: str) -> str:
    """SHA-256 of the snapshot's weights; ServingError adapter_not_found when there is none."""
    path = snapshot_path(name) / SNAPSHOT_WEIGHTS
    if not has_snapshot(name) or not path.is_file():
        raise ServingError("adapter_not_found", f"no PEFT snapshot for adapter {name!r} in {registry()}; "
                                                "a training run publishes one when it succeeds")
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def snapshot_base(name: str) -> str | None:
    """The base_model_name_or_path the snapshot's adapter_config.json names, if any."""
    import json

    try:
        value = json.loads((snapshot_path(name) / SNAPSHOT_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def remove_snapshot(name: str) -> list[str]:
    """Remove the snapshot `registry/name` and orphaned staging or retired copies of it; their names. A snapshot is a
    directory: a plain file of that name (another adapter's lineage, say) is left alone, and a link is removed, never
    followed."""
    removed = []
    pattern = re.compile(rf"^\.(?:staging-final|retired)-{re.escape(name)}-{HEX12}$")
    candidates = [snapshot_path(name)] + [p for p in registry().iterdir() if pattern.match(p.name)]
    for path in candidates:
        if path.is_symlink():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        removed.append(path.name)
    return removed


def delete_checkpoints(name: str) -> list[str]:
    """Remove the adapter's own `.kiln-checkpoint` directories (its exact prefix); their names."""
    from kiln_web.jobs import runtime as jobs_runtime

    return [path.name for path in jobs_runtime.checkpoint_module().delete_adapter_checkpoints(registry(), name)]


# -- bases --


def base_names() -> list[str]:
    return [info.name for info in list_bases(settings.KILN_HOME)]


def is_base(name: str) -> bool:
    return is_registered(name, settings.KILN_HOME)


# -- pools --


def serving_backend() -> str:
    """The backend this process's pools compute on: KILN_TRAINING_BACKEND resolved as a request without `backend`
    is (auto: cuda only with a usable device and a passing qualification receipt for this envelope). An explicit
    cuda stays cuda where there is no device: every load is then refused (backend_unavailable, with the loader's
    reason) rather than served on another backend than the one configured."""
    from trainer.runs.admission import choose_backend
    from trainer.runs.backend import BackendUnavailable

    try:
        return choose_backend(None, settings.KILN_TRAINING_BACKEND, settings.KILN_HOME).resolved
    except BackendUnavailable:
        return "cuda"


@contextmanager
def scratch_pool(backend: str | None = None):
    """A pool of this call's own (canaries, evaluations) on BACKEND (None: serving_backend()), closed afterwards."""
    pool = ServingPool(settings.KILN_HOME, registry(), serving_backend() if backend is None else backend)
    try:
        yield pool
    finally:
        pool.close()


def canary(adapter: str, base: str) -> tuple[bool, str, str]:
    """(passed, reason, adapter_sha256): load the snapshot over BASE in a scratch pool and run the
    serving canary (it generates, and its log-probabilities are finite)."""
    try:
        sha = snapshot_sha256(adapter)
    except ServingError as error:
        return False, error.message, ""
    with scratch_pool() as pool:
        try:
            pool.load_adapter(adapter, base)
        except ServingError as error:
            return False, f"{error.code}: {error.message}", sha
        passed, reason = pool.canary(adapter)
    return passed, reason, sha


def _serve_on_openblas():
    from native_ext import blas

    blas.serve_on_openblas()


class ServingRuntime:
    def __init__(self, home: Path, adapters: Path, threads: int, backend: str = "cpu"):
        self.pool = ServingPool(home, adapters, backend)
        # completion threads compute on OpenBLAS and Kiln's pthread pool (native_ext.blas.serve_on_openblas)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kiln-serving",
                                           initializer=_serve_on_openblas)
        self._lock = threading.RLock()  # one load, unload or reconcile at a time
        self._loaded = {}  # name -> (generation, sha256) this process holds
        self._refused = {}  # name -> (generation, ServingError): not retried until the generation changes
        self._synced = None  # the wanted state last reconciled

    @contextmanager
    def exclusive(self):
        with self._lock:
            yield

    def _load(self, wanted: WantedAdapter) -> None:
        if snapshot_sha256(wanted.name) != wanted.sha256:
            raise ServingError("adapter_changed", f"the snapshot of {wanted.name!r} changed since it was loaded "
                                                  "(a newer run published over it); load it again to serve it")
        self.pool.load_adapter(wanted.name, wanted.base)
        if snapshot_sha256(wanted.name) != wanted.sha256:  # replaced while it was being read
            self.pool.unload(wanted.name)
            raise ServingError("adapter_changed", f"the snapshot of {wanted.name!r} changed while it was loading")
        self._loaded[wanted.name] = (wanted.generation, wanted.sha256)
        self._refused.pop(wanted.name, None)

    def load_now(self, name: str, base: str) -> str:
        """Load NAME over BASE into this pool (the caller records it); returns the snapshot's SHA-256."""
        with self._lock:
            sha = snapshot_sha256(name)
            self.pool.load_adapter(name, base)
            return sha

    def mark_loaded(self, name: str, generation: int, sha256: str) -> None:
        with self._lock:
            self._loaded[name] = (generation, sha256)
            self._refused.pop(name, None)
            self._synced = None

    def reconcile(self, wanted: tuple) -> None:
        """Make the pool hold exactly the WANTED adapters. The pool's own single active adapter stays unset:
        activation is per person, so each request names its model, or the view resolves the caller's."""
        if wanted == self._synced:
            return
        with self._lock:
            if wanted == self._synced:
                return
            by_name = {w.name: w for w in wanted}
            for name in list(self._loaded):
                if name not in by_name:
                    self._unload(name)
            for w in wanted:
                if self._loaded.get(w.name, (None,))[0] == w.generation:
                    continue
                if self._refused.get(w.name, (None,))[0] == w.generation:
                    continue
                try:
                    self._load(w)
                except ServingError as error:
                    self._unload(w.name)  # never keep serving an older generation in its place
                    self._refused[w.name] = (w.generation, error)
            if self.pool.active is not None:
                self.pool.deactivate()
            self._synced = wanted

    def _unload(self, name: str) -> None:
        self._loaded.pop(name, None)
        try:
            self.pool.unload(name)
        except ServingError:
            pass

    def refusal(self, name: str) -> ServingError | None:
        """Why a wanted adapter is not served here, if its load failed."""
        refused = self._refused.get(name)
        return refused[1] if refused else None

    def loaded_here(self) -> dict:
        return dict(self._loaded)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()


_RUNTIME_LOCK = threading.Lock()
_RUNTIME: list[ServingRuntime] = []  # at most one: this process's


def serving() -> ServingRuntime:
    """This process's ServingRuntime, created on first use from the settings."""
    with _RUNTIME_LOCK:
        if not _RUNTIME:
            _RUNTIME.append(ServingRuntime(settings.KILN_HOME, registry(), settings.KILN_SERVING_THREADS,
                                           serving_backend()))
        return _RUNTIME[0]


def started() -> ServingRuntime | None:
    """This process's ServingRuntime if one was created, else None (nothing to reconcile)."""
    with _RUNTIME_LOCK:
        return _RUNTIME[0] if _RUNTIME else None


def close_serving() -> None:
    """Close this process's pool (tests, and settings that changed under it)."""
    with _RUNTIME_LOCK:
        runtime = _RUNTIME.pop() if _RUNTIME else None
    if runtime is not None:
        runtime.close()
