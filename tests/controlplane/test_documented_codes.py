"""Every error code the API or a job can carry is documented: the refusal table (kiln_web.core.http STATUS and
HTTP_CODES), each literal ActionRefused code of kiln_web, each AdmissionError and RunFailed code of the trainer's
run logic, each serving or evaluation error code and each code a failed job records (execution.failure_fields)
appear in docs/api.md, and every code of the
.kiln-checkpoint loader in docs/run-checkpoints.md. Read from the sources, so a new code fails here until it is
written down."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LITERAL = re.compile(r"\b(?:ActionRefused\(\s*\d{3},|(?:AdmissionError|RunFailed|ServingError|EvaluationError|"
                     r"TeacherError)\()\s*\"([a-z_]+)\"")
RECORDED = re.compile(r"\"(?:error_)?code\": \"([a-z_]+)\"")  # a job's error, or its latest_checkpoint_error


def literal_codes(pattern: re.Pattern, *folders: str) -> set[str]:
    return {code for folder in folders for path in (ROOT / folder).rglob("*.py")
            for code in pattern.findall(path.read_text(encoding="utf-8"))}


def undocumented(codes, page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return sorted(code for code in codes if f"`{code}`" not in text)


def test_every_api_and_job_error_code_is_in_api_md():
    from kiln_web.core.http import HTTP_CODES, STATUS
    from kiln_web.jobs.execution import STORAGE_ERRORS

    codes = (set(STATUS) | set(HTTP_CODES.values()) | set(STORAGE_ERRORS.values())
             | literal_codes(LITERAL, "kiln_web", "trainer")
             | literal_codes(RECORDED, "kiln_web/jobs", "kiln_web/evals"))
    assert {"resume_drift", "adapter_busy", "non_finite", "teacher_invalid", "database_unavailable"} <= codes
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
