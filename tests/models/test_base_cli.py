"""`kiln base import|list|show`, called through the CLI's main()."""

import json

import pytest

from kiln_web.cli import main


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    return tmp_path


def test_import_list_show(home, save_tiny_llama, capsys):
    directory, _ = save_tiny_llama(seed=21)
    assert main(["base", "import", str(directory), "--name", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert "importing" in err and "\n  21/21 tensors\n" in err  # not a terminal: the final count only
    assert "imported tiny:" in out and "identity " in out
    identity = out.split("identity ")[1].split()[0]
    assert (home / "bases" / "tiny" / "identity.json").is_file()

    assert main(["base", "list"]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "PARAMETERS", "IDENTITY", "SOURCE"]
    assert lines[1].startswith("kiln-tiny") and "builtin (not yet written)" in lines[1]
    assert lines[2].startswith("tiny ") and identity[:16] in lines[2] and "huggingface" in lines[2]

    assert main(["base", "show", "tiny"]) == 0
    out, _ = capsys.readouterr()
    assert f"identity    {identity}" in out and "model_width         64" in out
    assert main(["base", "show", "tiny", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["identity"] == identity and record["config"]["block_count"] == 2


def test_progress_line_on_a_terminal(home, save_tiny_llama, capsys, monkeypatch):
    import sys

    directory, _ = save_tiny_llama(seed=22)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["base", "import", str(directory), "--name", "tty"]) == 0
    err = capsys.readouterr().err
    assert "\r  1/21 tensors  model.embed_tokens.weight" in err
    assert "\r  21/21 tensors  lm_head.weight" in err and err.endswith("\n")


def test_errors_name_the_problem(home, capsys):
    assert main(["base", "show", "nothing"]) == 1
    assert "no base named 'nothing'" in capsys.readouterr().err
    assert main(["base", "import", str(home / "missing.gguf"), "--name", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    not_a_model = home / "notes.txt"
    not_a_model.write_text("hello")
    assert main(["base", "import", str(not_a_model), "--name", "x"]) == 1
    assert "neither a GGUF file nor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["base", "import", str(not_a_model)])  # --name is required
