"""A publication the registry's storage refuses part-way ends the job with a code that says so (disk_full,
storage_error), never internal_error with a traceback, and leaves nothing in the registry: the real
publish_checkpoint, made to fail by a full disk (ENOSPC at a write) and by a file-size limit (RLIMIT_FSIZE in a
subprocess: EFBIG, as `ulimit -f` or a filesystem's largest file gives). tests/faults/test_disk_full.py fills a
real tmpfs mid-run (root only)."""

import errno
import subprocess
import sys
import textwrap

import pytest

from kiln_web.jobs.execution import failure_fields
from trainer import fsio
from trainer.runs import checkpoint_dir

FILES = {"adapter.safetensors": b"a" * (1 << 20), "state.json": b"{}"}
MANIFEST = {"progress": {"committed_step": 5}}


def test_a_full_disk_during_a_publication_is_disk_full(tmp_path, monkeypatch):
    real, written = fsio.write_all, []

    def full(fd, view):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(fd)
        return real(fd, view)

    monkeypatch.setattr(fsio, "write_all", full)
    with pytest.raises(OSError) as raised:
        checkpoint_dir.publish_checkpoint(tmp_path, "bot", 5, checkpoint_type="sft", files=FILES, manifest=MANIFEST)
    assert list(tmp_path.iterdir()) == []  # the staging directory is removed; the canonical name never appeared
    fields = failure_fields(raised.value, "sft")
    assert fields["error_code"] == "disk_full" and "resume from the latest" in fields["error_message"]


def test_a_file_size_limit_during_a_publication_is_a_storage_error(tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        from trainer.runs import checkpoint_dir
        try:
            checkpoint_dir.publish_checkpoint({str(tmp_path)!r}, "bot", 5, checkpoint_type="sft",
                                              files={{"adapter.safetensors": b"a" * (1 << 20)}},
                                              manifest={MANIFEST!r})
        except OSError as error:
            print(error.errno)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == errno.EFBIG
    assert list(tmp_path.iterdir()) == []
    fields = failure_fields(OSError(errno.EFBIG, "File too large", str(tmp_path / "x")), "sft")
    assert fields["error_code"] == "storage_error", fields
    assert "File too large" in fields["error_message"] and "ulimit -f" in fields["error_message"] and "traceback" not in (fields.get("error_details") or {})
