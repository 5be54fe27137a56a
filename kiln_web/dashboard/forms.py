"""New-job forms generated from the API's request schemas, so the browser offers every field the API does.

A `JobForm` subclass names a request schema (a pydantic model from the API) and the training
kind. Each leaf of the schema's `config` becomes one form field (nested objects become
fieldsets); each other top-level field is a data source: a string is a path, a list of
records is a JSONL upload. A valid form holds `body`, the request as the API would receive
it, already checked by the same schema. Admission then runs in `do_submit_job`, exactly as
for the API; its refusals come back through `add_refusal` and land next to their fields.

Adding a kind: subclass JobForm with its request schema and register it in JOB_FORMS.
"""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import dataclass

import pydantic
from annotated_types import Ge, Gt
from django import forms
from django.conf import settings
from pydantic_core import PydanticUndefined

from kiln_web.core.http import error_location
from kiln_web.jobs.models import JobKind
from kiln_web.jobs.schemas import ADAPTER_NAME, TEACHER_ALIAS, GRPORequest, OPDRequest, SFTRequest

# Labels where the field name alone reads badly; any other field is its name, humanised.
LABELS = {
    "output_name": "Adapter name",
    "lr_schedule": "Learning-rate schedule",
    "lora": "LoRA",
    "use_rslora": "rsLoRA scaling",
    "max_grad_norm": "Max gradient norm",
    "max_sequence_length": "Max sequence length",
    "dataset_path": "Dataset path",
    "data": "Upload a JSONL file",
    "groups": "Upload groups (JSONL)",
    "prompts": "Upload prompts (JSONL or a JSON list)",
    "base_adapter": "Base adapter (warm start)",
    "double_quantization": "Double quantization",
    "type": "Type",
    "resume_checkpoint": "Resume checkpoint",
    "suite": "Gate suite",
}
# Top-level config fields shown in a fieldset of their own instead of "Run".
SECTION_OF = {"seed": "Checkpoints and seed", "checkpoint_interval": "Checkpoints and seed",
              "resume_checkpoint": "Checkpoints and seed"}
# Request fields beside config that are not a data source (auto_load, the gate's object): one fieldset.
PROMOTION = "Promotion"
PROMOTION_HELP = ("After the run succeeds: auto load activates the adapter once its serving canary passes; with a "
                  "gate, only once a held-out evaluation passes (the previous adapter stays active until then).")
# Fields whose null means something other than "the server default": a checkbox sends null.
EXPLICIT_NULL = {"config.max_grad_norm": "No gradient clipping"}
BOOLEAN_CHOICES = [("", "server default"), ("true", "yes"), ("false", "no")]
DEFAULT_HINT = re.compile(r"absent: ([^;]+)")
# What a schema pattern asks for, in words: pydantic's own message quotes the regular expression.
NAME_RULE = "letters, digits, '.', '_' or '-' (at most 100), starting with a letter or digit"
PATTERN_TEXT = {ADAPTER_NAME: f"Use {NAME_RULE}; no spaces or '/'.",
                TEACHER_ALIAS: f"Give a teacher alias as NAME@native, NAME@openai or NAME@vllm, NAME being "
                               f"{NAME_RULE}."}


def _label(name: str) -> str:
    return LABELS.get(name) or name.replace("_", " ").capitalize()


def _unwrap(annotation) -> tuple[typing.Any, bool]:
    """(the annotation without None, whether None was allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _allows_strings(annotation) -> bool:
    """list[str | dict]: a record may be a plain string."""
    (item,) = typing.get_args(annotation) or (None,)
    return typing.get_origin(item) in (typing.Union, types.UnionType) and str in typing.get_args(item)


def _is_source(annotation) -> bool:
    """A request field beside config that carries the data: a path (str) or the records themselves (a list)."""
    return annotation is str or typing.get_origin(annotation) is list


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _minimum(info, integer: bool):
    for item in info.metadata:
        if isinstance(item, Ge):
            return item.ge
        if isinstance(item, Gt) and integer:
            return item.gt + 1
    return None


def _placeholder(info, fallback: str = "server default") -> str:
    """What a blank field becomes: the schema default, or the short "absent: X" hint of its description."""
    if info.default is not None and info.default is not PydanticUndefined:
        return str(info.default)
    match = DEFAULT_HINT.search(info.description or "")
    if match and len(match.group(1).strip()) <= 24:
        return match.group(1).strip()
    return fallback


@dataclass
class Fieldset:
    title: str
    help: str
    names: list[str]


@dataclass
class Leaf:
    """One form field and where its value goes in the request."""

    name: str  # form field name: the path with "__" (config. dropped)
    path: tuple[str, ...]  # ("config", "lora", "rank")
    shape: str  # text, int, float, bool, choice, list, records
    strings: bool = False  # records: a record may also be a plain string (OPD prompts)

    @property
    def wide(self) -> bool:
        """Paths and name lists need room."""
        return self.shape == "list" or self.path[-1] in WIDE


WIDE = {"dataset_path", "resume_checkpoint"}


class JobForm(forms.Form):
    """Subclasses set `request_schema` (the API's pydantic request model), `kind`, `title` and `summary`;
    the fields, fieldsets and data sources are derived from the schema when the subclass is defined."""

    request_schema: type[pydantic.BaseModel]
    kind: str
    title: str
    summary: str
    leaves: dict[str, Leaf]
    fieldsets: list[Fieldset]
    source_names: list[str]
    _field_factories: dict

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.leaves, cls.fieldsets, cls.source_names = {}, [], []
        cls._field_factories = {}
        cls._collect(cls.request_schema, (), True, None)
        sections = set(SECTION_OF.values())  # these close the form, after the kind's own fieldsets
        cls.fieldsets.sort(key=lambda fieldset: fieldset.title in sections)

    # -- building the fields from the schema --

    @classmethod
    def _collect(cls, model, path: tuple[str, ...], required: bool, fieldset: Fieldset | None) -> None:
        for name, info in model.model_fields.items():
            annotation, _ = _unwrap(info.annotation)
            here = path + (name,)
            if _is_model(annotation):  # config itself, or an object inside it: a fieldset of its own
                top = here == ("config",)
                if top:
                    child = cls._fieldset("Run", "")
                elif not path:  # the gate, beside config: with auto_load
                    child = cls._fieldset(PROMOTION, PROMOTION_HELP)
                else:
                    child = cls._fieldset(_label(name), info.description or "")
                cls._collect(annotation, here, required and info.is_required(), child)
                continue
            if not path and _is_source(annotation):  # beside config: a data source (a path, or records)
                target = cls._fieldset("Data", "", first=True)
                cls.source_names.append(name)
            elif not path:  # beside config, not data: auto_load
                target = cls._fieldset(PROMOTION, PROMOTION_HELP)
            elif len(path) == 1 and name in SECTION_OF:
                target = cls._fieldset(SECTION_OF[name], "")
            else:
                target = fieldset
            form_name = "__".join(here[1:] if here[0] == "config" else here)
            shape, factory = cls._factory(name, annotation, info, required and info.is_required())
            strings = shape == "records" and _allows_strings(annotation)
            cls.leaves[form_name] = Leaf(form_name, here, shape, strings=strings)
            cls._field_factories[form_name] = factory
            target.names.append(form_name)
            dotted = ".".join(here)
            if dotted in EXPLICIT_NULL:
                cls._field_factories[form_name + "__null"] = (lambda label=EXPLICIT_NULL[dotted]: forms.BooleanField(
                    required=False, label=label))
                target.names.append(form_name + "__null")

    @classmethod
    def _fieldset(cls, title: str, help_text: str, first: bool = False) -> Fieldset:
        for fieldset in cls.fieldsets:
            if fieldset.title == title:
                return fieldset
        fieldset = Fieldset(title, help_text, [])
        cls.fieldsets.insert(0 if first else len(cls.fieldsets), fieldset)
        return fieldset

    @classmethod
    def _factory(cls, name, annotation, info, required):
        common = {"label": _label(name), "help_text": info.description or "", "required": required}
        origin = typing.get_origin(annotation)
        if origin is typing.Literal:
            if info.is_required():  # required inside an optional object: blank leaves the object out
                blank = "none"
            elif info.default is not None:
                blank = f"server default ({info.default})"
            else:
                hint = _placeholder(info, fallback="")
                blank = f"server default ({hint})" if hint else "server default"
            choices = [("", blank)] + [(value, value) for value in typing.get_args(annotation)]
            return "choice", lambda: forms.ChoiceField(choices=choices, **{**common, "required": False})
        if annotation is bool:
            return "bool", lambda: forms.ChoiceField(choices=BOOLEAN_CHOICES, **{**common, "required": False})
        if annotation is int:
            minimum = _minimum(info, integer=True)
            return "int", lambda: forms.IntegerField(
                min_value=minimum, widget=forms.NumberInput(attrs={"placeholder": _placeholder(info)}), **common)
        if annotation is float:
            return "float", lambda: forms.FloatField(
                widget=forms.NumberInput(attrs={"placeholder": _placeholder(info), "step": "any"}), **common)
        if origin is list:
            (item,) = typing.get_args(annotation) or (str,)
            if item is str:
                return "list", lambda: forms.CharField(
                    widget=forms.Textarea(attrs={"rows": 2, "placeholder": _placeholder(info)}),
                    **{**common, "help_text": (info.description or "") + " (one per line, or comma-separated)"})
            return "records", lambda: forms.FileField(
                widget=forms.ClearableFileInput(attrs={"accept": ".jsonl,.json,application/json,text/plain"}),
                **{**common, "required": False,
                   "help_text": "JSONL (one per line) or a JSON list: " + (info.description or "")})
        attrs = {"placeholder": _placeholder(info, fallback="") if not required else ""}
        if name in ("dataset_path", "resume_checkpoint", "output_name", "base_model"):
            attrs |= {"autocomplete": "off", "spellcheck": "false"}
        return "text", lambda: forms.CharField(widget=forms.TextInput(attrs=attrs), **common)

    # -- the form itself --

    def __init__(self, *args, resume_from: str | None = None, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_from = resume_from  # the checkpoint a prepared resume continues (changes the messages)
        self.user = user  # whose values suggest() may offer
        for name, factory in self._field_factories.items():
            self.fields[name] = factory()
        self.suggestions = {}  # field name -> values the browser offers as it is typed (a datalist)
        for name, values in self.suggest().items():
            if name in self.fields and values:
                self.fields[name].widget.attrs["list"] = f"suggest-{name}"
                self.suggestions[name] = values
        self.body: dict | None = None
        self.payload: dict | None = None
        self.refusal: dict | None = None
        self.record_places: dict[str, tuple[str, list[int]]] = {}  # upload field -> ("Line"/"Item", each record's)

    def uploads_to_choose_again(self) -> None:
        """A form shown again after a refusal comes back without its files (a browser never refills a file
        input): each upload field that had one says so, naming the file."""
        for name in self.source_names:
            upload = self.files.get(name) if self.leaves[name].shape == "records" else None
            if upload is not None:
                self.fields[name].choose_again = upload.name

    def suggest(self) -> dict[str, list[str]]:
        """Known values for free-text fields; subclasses add theirs."""
        return {}

    def grouped(self):
        """[(fieldset, [(bound field, wide)])] in schema order, for the template."""
        return [(fieldset, [(self[name], name in self.leaves and self.leaves[name].wide) for name in fieldset.names])
                for fieldset in self.fieldsets if fieldset.names]

    def clean(self):
        cleaned = super().clean()
        supplied = [name for name in self.source_names if self._present(cleaned.get(name))]
        if any(name in self.errors for name in self.source_names):
            return cleaned  # an unreadable upload already says what is wrong
        if not supplied:
            message = ("Supply the training data again: the checkpoint keeps no copy of inline data. Upload the "
                       "identical file (or give the dataset path the run used)."
                       if self.resume_from else "Upload a JSONL file or give a dataset path.")
            uploads = [name for name in self.source_names if self.leaves[name].shape == "records"]
            self.add_error((uploads or self.source_names or [None])[0], message)
            return cleaned
        if len(supplied) > 1:
            self.add_error(supplied[-1], "Give one data source, not both.")
            return cleaned
        if self.errors:
            for name in supplied:  # what is wrong with the file too, now rather than after the next try
                if self.leaves[name].shape == "records":
                    self._records(name, cleaned[name], strings=self.leaves[name].strings)
            return cleaned
        body = self._body(cleaned)
        if body is None:
            return cleaned
        try:
            payload = self.request_schema.model_validate(body)
        except pydantic.ValidationError as exc:
            for error in exc.errors():
                self._add_at(error_location(error), self._error_text(error))
            return cleaned
        self.body, self.payload = body, payload.model_dump(exclude_unset=True)
        return cleaned

    @staticmethod
    def _error_text(error: dict) -> str:
        """A schema error in words a person acts on (a pattern is described, not quoted)."""
        if error.get("type") == "string_pattern_mismatch":
            described = PATTERN_TEXT.get((error.get("ctx") or {}).get("pattern"))
            if described:
                return described
        return error.get("msg", "invalid value")

    @staticmethod
    def _present(value) -> bool:
        return value not in (None, "", [])

    def _body(self, cleaned) -> dict | None:
        body: dict = {}
        for name, leaf in self.leaves.items():
            value = cleaned.get(name)
            if cleaned.get(name + "__null"):
                value = None
                self._put(body, leaf.path, None)
                continue
            if not self._present(value):
                continue
            if leaf.shape == "bool":
                value = value == "true"
            elif leaf.shape == "list":
                lines = [line for line in value.splitlines() if line.strip()]
                items = lines if len(lines) > 1 else value.split(",")
                value = [item.strip() for item in items if item.strip()]
            elif leaf.shape == "records":
                value = self._records(name, value, strings=leaf.strings)
                if value is None:
                    return None
            elif leaf.shape == "text":
                value = value.strip()
            self._put(body, leaf.path, value)
        body.setdefault("config", {})
        return body

    @staticmethod
    def _put(body: dict, path: tuple[str, ...], value) -> None:
        for part in path[:-1]:
            body = body.setdefault(part, {})
        body[path[-1]] = value

    def _records(self, name: str, upload, strings: bool = False) -> list | None:
        """An uploaded file as a list of records: JSONL (one JSON value per non-empty line) or one JSON list.
        Records are JSON objects (or, where the schema allows, strings)."""
        if upload.size > settings.KILN_UPLOAD_MAX_BYTES:
            self.add_error(name, f"The file is larger than KILN_UPLOAD_MAX_BYTES ({settings.KILN_UPLOAD_MAX_BYTES} "
                                 "bytes); put it in a data root and give its dataset path instead.")
            return None
        try:
            text = upload.read().decode("utf-8-sig")  # a Windows editor's byte-order mark is not part of the text
        except UnicodeDecodeError:
            self.add_error(name, "The file is not UTF-8 text.")
            return None
        if text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as exc:
                self.add_error(name, f"The file is not a JSON list: {exc.msg} (line {exc.lineno}).")
                return None
            where = "Item {}"
            numbered = list(enumerate(records, 1))
        else:
            numbered, where = [], "Line {}"
            for number, line in enumerate(re.split(r"\r\n|\r|\n", text), 1):  # not at U+2028 ... as splitlines()
                if not line.strip():
                    continue
                try:
                    numbered.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    self.add_error(name, f"Line {number} is not JSON: {exc.msg}.")
                    return None
        for number, record in numbered:
            if not isinstance(record, dict) and not (strings and isinstance(record, str)):
                kind = "a JSON object or a string" if strings else "a JSON object"
                self.add_error(name, f"{where.format(number)} is not {kind}.")
                return None
        if not numbered:
            self.add_error(name, "The file holds no records.")
            return None
        self.record_places[name] = (where.split()[0], [number for number, _ in numbered])
        return [record for _, record in numbered]

    # -- refusals, from the schema or from admission --

    def field_for(self, path: tuple[str, ...], message: str = "") -> str | None:
        """The form field for a request path (("config", "lora", "rank") or "config.lora.rank"; list indices,
        as in ("groups", "0") or "groups[0]", skipped): the leaf itself, the leaf the path lies inside (an
        upload's records), or, for a path that names a fieldset, its field that MESSAGE names (else its first);
        None when no field matches."""
        names = tuple(part for part in path if not part.isdigit())
        for leaf in self.leaves.values():
            if leaf.path == names:
                return leaf.name
        for leaf in self.leaves.values():
            if names[:len(leaf.path)] == leaf.path:
                return leaf.name
        inside = [leaf for leaf in self.leaves.values() if names and leaf.path[:len(names)] == names]
        for leaf in inside:
            if re.search(rf"\b{re.escape(leaf.path[-1])}\b", message):
                return leaf.name
        return inside[0].name if inside else None

    def _add_at(self, path: tuple[str, ...], message: str, *, elsewhere: bool = True) -> str | None:
        """Show MESSAGE at the field for PATH and return its name; with no such field, above the form (unless
        not ELSEWHERE) and None."""
        where = ".".join(path)
        parts = tuple(part for part in re.split(r"[.\[\]]+", where) if part)
        name = self.field_for(parts, message)
        if name is None:
            if elsewhere:
                self.add_error(None, f"{where}: {message}" if where else message)
            return None
        leaf = self.leaves.get(name)
        if leaf is not None and leaf.shape == "records" and len(parts) > 1 and parts[1].isdigit():
            # a record of an upload: say where it is (its line as an editor numbers them, blank lines counted, or
            # its item of a JSON list) and where inside it
            inner = where.split("]", 1)[1].lstrip(".") if "[" in where.split(".")[0] else ".".join(parts[2:])
            index = int(parts[1])
            kind, numbers = self.record_places.get(name, ("Record", []))
            place = f"{kind} {numbers[index]}" if index < len(numbers) else f"Record {index + 1}"
            message = f"{place}{', ' + inner if inner else ''}: {message}"
        self.add_error(name, message)
        return name

    def add_refusal(self, refusal) -> None:
        """Show an admission refusal (an ActionRefused: code, message, field?, differences?) where it belongs:
        above the form, and next to the field it names (or that its code concerns), linked from above."""
        error = refusal.as_error()
        self.refusal = {"status": refusal.status, **error}
        if error.get("differences"):
            return  # the template shows the drift table
        where, code = error.get("field"), error.get("code", "")
        if where:
            name = self._add_at(tuple(where.split(".")), error["message"], elsewhere=False)
        else:
            name = "resume_checkpoint" if code in CHECKPOINT_CODES else next(
                (field for prefix, field in CODE_FIELDS if code.startswith(prefix)), None)
            if name in self.fields:
                self.add_error(name, error["message"])
            else:
                name = None
        self.refusal["at"] = self[name] if name else None

    # -- prefilling from a job (prepare resume) --

    @classmethod
    def initial_from(cls, config: dict, request: dict, resume_checkpoint: str | None) -> dict:
        """Form values from an effective configuration: every field the schema knows, the data source
        path when the run read a file, no inline records (the checkpoint cannot reconstruct them), and
        the promotion the job asked for (auto_load, gate)."""
        initial: dict = {}
        for name, leaf in cls.leaves.items():
            if leaf.path[0] == "config" or leaf.path[0] not in cls.source_names:
                # the effective configuration; beside it, what is not data (auto_load, the gate) as the job asked
                node, parts = (config, leaf.path[1:]) if leaf.path[0] == "config" else (request, leaf.path)
                found = True
                for part in parts:
                    if not isinstance(node, dict) or part not in node:
                        found = False
                        break
                    node = node[part]
                if not found:
                    continue
                if node is None:
                    if ".".join(leaf.path) in EXPLICIT_NULL:
                        initial[name + "__null"] = True
                    continue
                if leaf.shape == "bool":
                    node = "true" if node else "false"
                elif leaf.shape == "list":
                    node = "\n".join(map(str, node))
                initial[name] = node
            elif leaf.shape != "records" and isinstance(request.get(leaf.path[0]), str):
                initial[name] = request[leaf.path[0]]
        if resume_checkpoint and "resume_checkpoint" in cls.leaves:
            initial["resume_checkpoint"] = resume_checkpoint
        return initial


# Refusals without a field, by their code's prefix: the field that holds what was refused.
CODE_FIELDS = [("backend_", "backend"), ("dataset", "dataset_path"), ("base_adapter", "base_adapter"),
               ("base_", "base_model"), ("teacher_", "teacher")]
CHECKPOINT_CODES = {"not_found", "noncanonical_name", "outside_registry", "not_a_checkpoint", "wrong_kind",
                    "wrong_adapter", "incomplete", "missing_manifest", "missing_file", "extra_file",
                    "size_mismatch", "checksum_mismatch", "inconsistent_state", "symlink", "hard_link",
                    "bad_field", "bad_path", "unknown_field", "untracked_file", "unsupported_schema",
                    "unsupported_type", "planning_schema", "checkpoint_invalid"}


class SFTJobForm(JobForm):
    request_schema = SFTRequest
    kind = JobKind.SFT
    title = "SFT"
    summary = "Supervised fine-tuning on chat ({messages}) or {prompt, completion} records."

    def suggest(self) -> dict[str, list[str]]:
        from kiln_web.evals.actions import visible_suites

        if self.user is None:
            return {}
        return {"gate__suite": list(visible_suites(self.user).order_by("name").values_list("name", flat=True)[:200])}


class GRPOJobForm(JobForm):
    request_schema = GRPORequest
    kind = JobKind.GRPO
    title = "GRPO"
    summary = "Group-relative policy optimisation over prompts with scored completions, as TRL defines it."


class OPDJobForm(JobForm):
    request_schema = OPDRequest
    kind = JobKind.OPD
    title = "OPD"
    summary = ("On-policy distillation: the student samples, a registered teacher alias scores every token, "
               "the loss is the reverse KL.")

    def suggest(self) -> dict[str, list[str]]:
        from kiln_web.teachers.models import TeacherAlias

        return {"teacher": list(TeacherAlias.objects.values_list("name", flat=True)[:200])}


# The new-job pages, by training kind: a JobForm subclass over the kind's API request schema.
JOB_FORMS: dict[str, type[JobForm]] = {JobKind.SFT: SFTJobForm, JobKind.GRPO: GRPOJobForm, JobKind.OPD: OPDJobForm}


class TeacherForm(forms.Form):
    """Register a teacher alias; the help texts are the API schema's (TeacherIn), the checks the action's."""

    name = forms.CharField(max_length=120, widget=forms.TextInput(attrs={"placeholder": "tutor@native",
                                                                          "autocomplete": "off"}))
    base = forms.CharField(required=False, max_length=100)
    adapter = forms.CharField(required=False, max_length=1000)
    endpoint = forms.CharField(required=False, max_length=1000,
                               widget=forms.TextInput(attrs={"placeholder": "http://gpu-1:8000"}))
    model = forms.CharField(required=False, max_length=200)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from kiln_web.teachers.schemas import TeacherIn

        for name, info in TeacherIn.model_fields.items():
            if name in self.fields:
                self.fields[name].help_text = info.description or ""

    def add_refusal(self, exc) -> None:
        field = "name" if exc.code == "teacher_exists" else exc.extra.get("field")
        self.add_error(field if field in self.fields else None, exc.message)
