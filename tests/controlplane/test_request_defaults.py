"""One copy of each training kind's request defaults: the RunKind's `defaults` (trainer.runs.defaults).
Admission merges requests over it, the OpenAPI descriptions say "absent: <value>" from it, and the
default requests shown in docs/grpo-opd.md hold the same values."""

import json
import re
from pathlib import Path

import pytest

from kiln_web.api import api as ninja_api
from kiln_web.jobs.schemas import absent
from trainer.runs import RUN_KINDS, run_kind
from trainer.runs.defaults import DEFAULTS, NESTED_DEFAULTS, default_at

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = {"sft": "SFTConfig", "grpo": "GRPOConfig", "opd": "OPDConfig"}


def components():
    return ninja_api.get_openapi_schema()["components"]["schemas"]


def field_schema(kind: str, path: str) -> dict | None:
    """The OpenAPI schema of optional request field PATH of KIND's config, or None when the API has no such
    optional field (a resolved one such as teacher, or a required one such as quantization.type)."""
    schemas = components()
    schema = schemas[REQUESTS[kind]]
    parts = path.split(".")
    for depth, name in enumerate(parts):
        prop = schema.get("properties", {}).get(name)
        if prop is None:
            return None
        if depth == len(parts) - 1:
            return None if name in schema.get("required", ()) else prop
        refs = [option["$ref"] for option in prop.get("anyOf", [prop]) if "$ref" in option]
        if not refs:
            return None
        schema = schemas[refs[0].rsplit("/", 1)[1]]
    return None


def leaves(kind: str):
    """(path, value) of every default of KIND that is a value, nested objects included."""
    for name, value in DEFAULTS[kind].items():
        nested = {**NESTED_DEFAULTS.get(name, {}), **(value if isinstance(value, dict) else {})}
        if nested:
            for inner in nested:
                yield f"{name}.{inner}", default_at(kind, f"{name}.{inner}")
        else:
            yield name, value


@pytest.mark.parametrize("kind", sorted(RUN_KINDS))
def test_each_run_kind_carries_the_one_copy_of_its_defaults(kind):
    assert dict(run_kind(kind).defaults) == DEFAULTS[kind]
    # the LoRA and schedule defaults are one object shared by every kind (the API has one LoRAConfig)
    assert DEFAULTS[kind]["lora"] is DEFAULTS["sft"]["lora"]
    assert DEFAULTS[kind]["lr_schedule"] is DEFAULTS["sft"]["lr_schedule"]


@pytest.mark.parametrize("kind", sorted(RUN_KINDS))
def test_every_default_with_a_value_is_described_in_the_api_schema(kind):
    described = 0
    for path, value in leaves(kind):
        prop = field_schema(kind, path)
        if prop is None or value is None:
            continue  # a field the API does not take (teacher is resolved), or one whose absence is chosen later
        description = prop.get("description", "")
        if "default" in prop:
            assert prop["default"] == value, (kind, path)
        else:
            assert absent(kind, path) in description, (kind, path, description)
        described += 1
    assert described >= 10


def doc_request(heading: str) -> dict:
    """The config of the first JSON request block after HEADING in docs/grpo-opd.md (// comments dropped)."""
    text = (ROOT / "docs" / "grpo-opd.md").read_text()
    after = text[text.index(heading):]
    block = after[after.index("```json") + len("```json"):]
    block = block[:block.index("```")]
    block = re.sub(r"(?<=\s)//[^\n]*", "", block)  # a comment, not the // of a URL
    return json.loads(block)["config"]


def assert_documented(kind: str, documented: dict, prefix: str = ""):
    for name, value in documented.items():
        path = f"{prefix}{name}"
        if name in {"output_name", "teacher"}:
            continue  # the request's own choices
        if isinstance(value, dict):
            assert_documented(kind, value, f"{path}.")
        elif isinstance(value, list) and "..." in value:
            continue  # an elided list
        else:
            assert value == default_at(kind, path), (kind, path, value)


@pytest.mark.parametrize("kind,heading", [("grpo", "## GRPO"), ("opd", "## OPD")])
def test_the_documented_default_requests_hold_the_defaults(kind, heading):
    documented = doc_request(heading)
    assert_documented(kind, documented)
    assert set(documented) <= set(DEFAULTS[kind])
