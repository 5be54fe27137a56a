"""Teacher aliases for on-policy distillation: the alias spec, its two revisions, and the scorers.

A teacher alias `name@route` is configuration the control plane registers; it resolves an alias
to a spec dict and hands it to the OPD run. Routes:

- `native`: a registered base (optionally with a PEFT adapter directory) run in-process;
- `openai`: an OpenAI-compatible `/v1/completions` endpoint (vLLM, Kiln serving) asked for
  prompt log-probabilities with `echo` and `logprobs`.

Each alias has an identity revision, the SHA-256 of its canonical configuration (what the alias
says), and a content revision, the SHA-256 of what it scores with: for `native` the base's
content identity plus the adapter files' digests; for `openai` what the endpoint reports about
the model (its id and root, and a content digest from the `X-Kiln-Content-Digest` header or a
`digest` field of `/v1/models/{model}` when the server reports one). A teacher scores the
student's sampled tokens: log p_teacher(completion_t | prompt, completion_<t), float32.
"""

import hashlib
import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.fsio import file_sha256
from trainer.jsonio import canonical_bytes
from trainer.peft import ADAPTER_FILES

ROUTES = ("native", "openai", "vllm")
ENDPOINT_ROUTES = ("openai", "vllm")  # OpenAI-compatible servers (vLLM is one): /v1/completions with echo + logprobs
# the numeric content probe: fixed token-id prompts whose echoed log-probabilities (rounded to PROBE_DECIMALS, so a
# server's run-to-run noise does not count) are hashed into the content revision; other weights behind the same
# model id give other numbers. Small ids, so they exist in every vocabulary.
PROBES = ((1, 2, 3, 4, 5, 6, 7, 8), (72, 101, 108, 108, 111, 44, 32, 119), (50, 43, 50, 61, 52, 10, 81, 58))
PROBE_DECIMALS = 3
IDENTITY_FIELDS = ("alias", "route", "base", "adapter", "endpoint", "model")
DIGEST_HEADER = "X-Kiln-Content-Digest"
REQUEST_TIMEOUT = 120.0  # seconds per endpoint request; a teacher that hangs must not hang the run
_ALIAS = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,99})@(?P<route>[a-z0-9_-]{1,32})\Z")
_MODEL = re.compile(r"[A-Za-z0-9._:@+=/-]{1,256}\Z")  # a served model id: it becomes a URL path segment
logger = logging.getLogger("kiln.teachers")


def _a(route: str) -> str:
    """'an openai', 'a vllm': the article a route's name takes."""
    return f"{'an' if route[:1] in 'aeiou' else 'a'} {route}"


def _endpoint_ok(endpoint: str) -> bool:
    """Whether ENDPOINT is an http(s) URL of a server's root: a host, perhaps a path, nothing else."""
    try:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.port == 0:  # reading the port raises ValueError for one past 65535 or not a number
            return False
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.query and not parts.fragment
            and "?" not in endpoint and "#" not in endpoint and not re.search(r"[\s\x00-\x1f\x7f]", endpoint))


def _has_credentials(endpoint: str) -> bool:
    """Whether ENDPOINT's authority holds a user name or password (user:password@host)."""
    try:
        return "@" in urllib.parse.urlsplit(endpoint).netloc
    except ValueError:
        return False  # not a URL: _endpoint_ok refuses it


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A teacher endpoint answers at its own address: a redirect is an error (HTTPError), never followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


class TeacherError(Exception):
    """A teacher that cannot be used; `code` is stable, `differences` lists what changed."""

    def __init__(self, code: str, message: str, differences=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.differences = list(differences or [])


def identity_revision(config: dict) -> str:
    """SHA-256 of the alias's canonical configuration (the IDENTITY_FIELDS, absent ones null)."""
    return hashlib.sha256(canonical_bytes({k: config.get(k) for k in IDENTITY_FIELDS})).hexdigest()


class SpecError(ValueError):
    """parse_teacher's refusal; `field` names the configuration field at fault (None: the alias as a whole)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TeacherSpec:
    alias: str
    route: str
    base: str | None = None  # native: a registered base name
    adapter: str | None = None  # native: a PEFT adapter directory, or None
    endpoint: str | None = None  # openai, vllm: the server root, e.g. http://host:8000 (…/v1 is appended)
    model: str | None = None  # openai, vllm: the served model id

    def config(self) -> dict:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}

    @property
    def identity_revision(self) -> str:
        return identity_revision(self.config())

    def to_dict(self) -> dict:
        return {**self.config(), "identity_revision": self.identity_revision}


def parse_teacher(value) -> TeacherSpec:
    """The spec of a resolved alias dict; ValueError saying what is wrong.

    A given `identity_revision` must be the one its configuration hashes to (the control plane
    computes it with `identity_revision`); a spec whose revision does not match was edited.
    """
    if not isinstance(value, dict):
        raise ValueError("must be the resolved alias: {alias, route, base, adapter, endpoint, model, "
                         "identity_revision}")
    unknown = sorted(set(value) - set(IDENTITY_FIELDS) - {"identity_revision"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    alias = value.get("alias")
    match = _ALIAS.match(alias) if isinstance(alias, str) else None
    if match is None:
        raise ValueError(f"alias {alias!r} must look like name@route")
    route = value.get("route", match["route"])
    if route not in ROUTES:
        raise ValueError(f"route {route!r} is not one of {', '.join(ROUTES)}")
    if match["route"] in ROUTES and match["route"] != route:
        raise ValueError(f"alias {alias!r} names route {match['route']!r} but the spec says {route!r}")
    for key in ("base", "adapter", "endpoint", "model"):
        if value.get(key) is not None and (not isinstance(value[key], str) or not value[key]):
            raise SpecError(f"{key} must be a non-empty string or null", key)
    if route == "native":
        if not value.get("base"):
            raise SpecError("a native teacher needs base (a registered base name)", "base")
        if value.get("endpoint") or value.get("model"):
            raise SpecError("a native teacher has no endpoint or model",
                            "endpoint" if value.get("endpoint") else "model")
        if value.get("adapter") is not None and not Path(value["adapter"]).is_absolute():
            raise SpecError("adapter must be an absolute path to a PEFT adapter directory", "adapter")
    else:
        endpoint = value.get("endpoint")
        if isinstance(endpoint, str) and _has_credentials(endpoint):
            raise SpecError(f"{_a(route)} teacher's endpoint may hold no user name or password: aliases are listed "
                            "with their endpoint to everyone, and Kiln sends a teacher no credentials; give the "
                            "server's address alone", "endpoint")
        if not endpoint or not _endpoint_ok(endpoint):
            raise SpecError(f"{_a(route)} teacher needs endpoint, an http(s) URL of the server's root (a port "
                            "up to 65535; no query, fragment or spaces)", "endpoint")
        model = value.get("model")
        if not model:
            raise SpecError(f"{_a(route)} teacher needs model (the served model id)", "model")
        if not _MODEL.match(model) or any(part in ("", ".", "..") for part in model.split("/")):
            raise SpecError(f"model {model!r} must be a served model id: letters, digits and . _ - : @ + = /, "
                            "with no empty, '.' or '..' path segment", "model")
        if value.get("base") or value.get("adapter"):
            raise SpecError(f"{_a(route)} teacher has no base or adapter", "base" if value.get("base") else "adapter")
    spec = TeacherSpec(alias=alias, route=route, base=value.get("base"), adapter=value.get("adapter"),
                       endpoint=value.get("endpoint"), model=value.get("model"))
    given = value.get("identity_revision")
    if given is not None and given != spec.identity_revision:
        raise ValueError(f"identity_revision {given!r} is not the revision of this configuration "
                         f"({spec.identity_revision}); the alias spec was edited or resolved incorrectly")
    return spec


# -- content revisions ---------------------------------------------------------------------




def _revision(evidence: dict) -> dict:
    return {"revision": hashlib.sha256(canonical_bytes(evidence)).hexdigest(), "evidence": evidence}


def native_content(spec: TeacherSpec, bases_root) -> dict:
    """{"revision", "evidence"}: the base's recomputed content identity and the adapter file digests."""
    from trainer.bases import verify_base
    try:
        base = verify_base(spec.base, bases_root)
    except (LookupError, ValueError) as error:
        raise TeacherError("teacher_unavailable", f"teacher {spec.alias}: {error}") from None
    adapter = None
    if spec.adapter is not None:
        directory = Path(spec.adapter)
        missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
        if missing:
            raise TeacherError("teacher_unavailable", f"teacher {spec.alias}: adapter {directory} lacks "
                                                      f"{', '.join(missing)}")
        adapter = {name: file_sha256(directory / name) for name in ADAPTER_FILES}
    return _revision({"route": "native", "base_identity": base.identity, "adapter_files": adapter,
                      "tokenizer": base.tokenizer})


def _request(url: str, payload=None):
    """(JSON body, headers) of a GET (payload None) or POST; TeacherError when unreachable or malformed."""
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    request = urllib.request.Request(url, data=data, method="GET" if payload is None else "POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with _OPENER.open(request, timeout=REQUEST_TIMEOUT) as response:
            body, headers = response.read(), response.headers
    except urllib.error.HTTPError as error:
        # the body goes to the server's log, not to the person: an endpoint's error page is not theirs to read
        logger.warning("teacher endpoint %s answered HTTP %s: %r", url, error.code, error.read(300))
        redirect = " (a redirect: give the endpoint's own address)" if 300 <= error.code < 400 else ""
        raise TeacherError("teacher_unavailable", f"{url} answered HTTP {error.code}{redirect}; the server's log "
                                                  "has its answer") from None
    except (urllib.error.URLError, OSError) as error:
        raise TeacherError("teacher_unavailable", f"{url} is unreachable: {error}") from None
    try:
        return json.loads(body), headers
    except json.JSONDecodeError:
        raise TeacherError("teacher_unavailable", f"{url} did not answer JSON") from None


def _v1(spec: TeacherSpec) -> str:
    root = spec.endpoint.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def endpoint_content(spec: TeacherSpec) -> dict:
    """{"revision", "evidence"} of a served teacher: what `/v1/models/{model}` reports (id, root, digest) and
    the numbers it computes, the SHA-256 of its rounded log-probabilities of PROBES, so that other weights
    behind the same name and metadata are told apart."""
    body, headers = _request(f"{_v1(spec)}/models/{urllib.parse.quote(spec.model, safe='/:@+=')}")
    if not isinstance(body, dict) or body.get("id") != spec.model:
        raise TeacherError("teacher_unavailable", f"teacher {spec.alias}: the endpoint does not serve model "
                                                  f"{spec.model!r}")
    digest = headers.get(DIGEST_HEADER) or body.get("digest")
    scorer = OpenAITeacher(spec)
    probes = [[round(float(v), PROBE_DECIMALS) for v in scorer.score(probe[:4], probe[4:])] for probe in PROBES]
    numbers = hashlib.sha256(canonical_bytes({"decimals": PROBE_DECIMALS, "probes": [list(p) for p in PROBES],
                                              "logprobs": probes})).hexdigest()
    return _revision({"route": spec.route, "model": body["id"], "root": body.get("root"), "digest": digest,
                      "probe_logprobs": numbers})


def content_revision(spec: TeacherSpec, bases_root) -> dict:
    """Reconstruct the teacher's content revision now: {"revision", "evidence"}."""
    return native_content(spec, bases_root) if spec.route == "native" else endpoint_content(spec)


# -- scoring ---------------------------------------------------------------------------------


class NativeTeacher:
    """A registered base (with an optional PEFT adapter) scoring in this process: on the CPU engine, or with
    backend "cuda" on a trainer.cuda_model.CudaModel of it (native_ext.cuda.CudaUnavailable when the library
    cannot be loaded)."""

    def __init__(self, spec: TeacherSpec, bases_root, backend="cpu", **execution_options):
        from trainer.bases import load_base
        from trainer.peft import import_adapter
        self.spec = spec
        cpu, self.tokenizer = load_base(spec.base, bases_root, verify=True, **execution_options)
        try:
            if spec.adapter is not None:
                import_adapter(cpu, spec.adapter)
            self.model = cpu
            if backend == "cuda":
                from trainer.cuda_model import CudaModel

                self.model = CudaModel(cpu)  # a copy of the weights on the device
        except (OSError, ValueError) as error:
            cpu.close()
            raise TeacherError("teacher_unavailable", f"teacher {spec.alias}: {error}") from None
        except BaseException:
            cpu.close()
            raise
        if self.model is not cpu:
            cpu.close()

    def score(self, prompt_ids, completion_ids) -> np.ndarray:
        from trainer.generation import score_completion
        return score_completion(self.model, prompt_ids, completion_ids)

    def close(self):
        self.model.close()


class OpenAITeacher:
    """An OpenAI-compatible completions endpoint asked for prompt log-probabilities (echo)."""

    def __init__(self, spec: TeacherSpec):
        self.spec = spec

    def score(self, prompt_ids, completion_ids) -> np.ndarray:
        prompt, completion = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
        if not prompt or not completion:
            raise ValueError("prompt and completion need at least one token each")
        # token ids, not text, so the teacher scores exactly the student's tokens; max_tokens 1
        # because some servers refuse 0; the generated token is ignored
        body, _ = _request(f"{_v1(self.spec)}/completions", {
            "model": self.spec.model, "prompt": prompt + completion, "max_tokens": 1, "echo": True,
            "logprobs": 0, "temperature": 0.0})
        try:
            values = body["choices"][0]["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise TeacherError("teacher_unavailable", f"teacher {self.spec.alias}: the endpoint returned no "
                                                      "prompt log-probabilities (echo + logprobs)") from None
        start, end = len(prompt), len(prompt) + len(completion)
        if not isinstance(values, list) or len(values) < end or any(
                not isinstance(v, (int, float)) or isinstance(v, bool) for v in values[start:end]):
            raise TeacherError("teacher_unavailable", f"teacher {self.spec.alias}: the endpoint's echoed "
                                                      "log-probabilities do not cover the completion")
        return np.asarray(values[start:end], dtype=np.float32)

    def close(self):
        pass


def open_teacher(spec: TeacherSpec, bases_root, backend="cpu", **execution_options):
    """A scorer with score(prompt_ids, completion_ids) -> float32 [n] and close(); a native teacher computes on
    BACKEND (cpu or cuda), an endpoint wherever it runs."""
    if spec.route == "native":
        return NativeTeacher(spec, bases_root, backend, **execution_options)
    return OpenAITeacher(spec)
