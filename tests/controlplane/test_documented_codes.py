"""Every error code the API or a job can carry is documented: the refusal table (kiln_web.core.http STATUS and
HTTP_CODES), each literal ActionRefused code of kiln_web, each AdmissionError and RunFailed code of the trainer's
run logic and each serving or evaluation error code appear in docs/api.md, and every code of the
.kiln-checkpoint loader in docs/run-checkpoints.md. Read from the sources, so a new code fails here until it is
written down."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LITERAL = re.compile(r"\b(?:ActionRefused\(\s*\d{3},|(?:AdmissionError|RunFailed|ServingError|EvaluationError|"
                     r"TeacherError)\()\s*\"([a-z_]+)\"")


def literal_codes(*folders: str) -> set[str]:
    return {code for folder in folders for path in (ROOT / folder).rglob("*.py")
            for code in LITERAL.findall(path.read_text(encoding="utf-8"))}


def undocumented(codes, page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return sorted(code for code in codes if f"`{code}`" not in text)


def test_every_api_and_job_error_code_is_in_api_md():
    from kiln_web.core.http import HTTP_CODES, STATUS

    codes = set(STATUS) | set(HTTP_CODES.values()) | literal_codes("kiln_web", "trainer/runs", "trainer")
    assert {"resume_drift", "adapter_busy", "non_finite", "teacher_invalid"} <= codes  # the scan finds them
    missing = undocumented(codes, "api.md")
    assert not missing, f"docs/api.md does not document the error code(s) {missing}"


def test_every_checkpoint_loader_code_is_in_run_checkpoints_md():
    from trainer.runs.checkpoint_dir_names import CheckpointError

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    import trainer.runs.checkpoint_dir  # noqa: F401 (defines every subclass)

    codes = {cls.code for cls in subclasses(CheckpointError)}
    assert {"checksum_mismatch", "not_a_checkpoint", "name_exists"} <= codes
    missing = undocumented(codes, "run-checkpoints.md")
    assert not missing, f"docs/run-checkpoints.md does not document the checkpoint code(s) {missing}"
