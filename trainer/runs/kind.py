"""The one protocol every training kind follows: a `RunKind` the control plane looks up by name."""

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class RunKind:
    """One training kind (sft, grpo, opd): what the control plane calls, all with plain data.

    admit(request, settings) -> admission record: validate, resolve the effective configuration and
    seed, fully validate a resume checkpoint and refuse drift field by field.
    revalidate(admission, settings): the same checkpoint proof again at dequeue.
    run(admission, settings, hooks) -> RunResult: train, publish checkpoints, stop cooperatively.
    check_state(manifest, files) -> None: the semantic validation of one of its checkpoints (files: path ->
    bytes, every size and SHA-256 already proven); a CheckpointError naming the field that does not follow
    from the manifest and the rest of the state. The strict loader runs it before anything is restored.
    """

    name: str
    admit: Callable[..., Any]
    revalidate: Callable[..., None]
    run: Callable[..., Any]
    admission_from_json: Callable[[dict], Any]  # the admission record back from its job-row JSON
    defaults: Mapping = field(default_factory=dict)  # the configuration a request's fields update
    manifest_fields: frozenset = frozenset()  # the top-level manifest fields its checkpoints hold
    check_state: Callable[[dict, dict], None] | None = None  # None: a stand-in whose state is not checked

    def __post_init__(self):
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "manifest_fields", frozenset(self.manifest_fields))
