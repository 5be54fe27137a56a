"""Adam's hyperparameters are part of the effective configuration (`config.optimizer`): stated once as defaults,
checked at admission, applied by the run, and compared at resume like every other field."""

import pytest

from test_sft import StopAt, final_files, make_settings, request, write_dataset
from trainer.runs import grpo, opd, sft
from trainer.runs.defaults import OPTIMIZER_DEFAULT
from trainer.runs.sft import AdmissionError, RequestError, admit_sft, run_sft


def test_the_effective_configuration_states_adam_s_hyperparameters(tmp_path):
    settings = make_settings(tmp_path)
    admission = admit_sft(request(write_dataset(tmp_path)), settings)
    assert admission.effective_config["optimizer"] == OPTIMIZER_DEFAULT == {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                                                                   "weight_decay": 0.0}
    partial = admit_sft(request(write_dataset(tmp_path), optimizer={"beta2": 0.95}), settings)
    assert partial.effective_config["optimizer"] == {**OPTIMIZER_DEFAULT, "beta2": 0.95}
    for module in (sft, grpo, opd):
        assert module.RUN_KIND.defaults["optimizer"] == OPTIMIZER_DEFAULT


@pytest.mark.parametrize("optimizer, field", [
    ({"beta1": 1.0}, "config.optimizer.beta1"),
    ({"beta2": -0.1}, "config.optimizer.beta2"),
    ({"epsilon": 0.0}, "config.optimizer.epsilon"),
    ({"weight_decay": -1e-3}, "config.optimizer.weight_decay"),
    ({"beta1": True}, "config.optimizer.beta1"),
    ({"momentum": 0.9}, "config.optimizer"),
    ([0.9, 0.999], "config.optimizer"),
])
def test_bad_hyperparameters_are_refused_by_name(tmp_path, optimizer, field):
    settings = make_settings(tmp_path)
    with pytest.raises(RequestError) as info:
        admit_sft(request(write_dataset(tmp_path), optimizer=optimizer), settings)
    assert info.value.field == field


def test_the_run_uses_them_and_a_resume_with_others_is_refused(tmp_path):
    plain_home, tuned_home = tmp_path / "plain", tmp_path / "tuned"
    results = {}
    for home, optimizer in ((plain_home, None), (tuned_home, {"beta1": 0.5, "weight_decay": 0.01})):
        settings = make_settings(home)
        extra = {} if optimizer is None else {"optimizer": optimizer}
        results[home] = run_sft(admit_sft(request(write_dataset(home), epochs=1, **extra), settings), settings,
                                StopAt(None))
    assert final_files(make_settings(plain_home)) != final_files(make_settings(tuned_home))

    settings = make_settings(tmp_path / "resume")
    tuned = {"beta1": 0.5, "weight_decay": 0.01}
    stopped = run_sft(admit_sft(request(write_dataset(tmp_path / "resume"), optimizer=tuned), settings), settings,
                      StopAt(2))
    basename = stopped.latest_checkpoint["resume_checkpoint"]
    with pytest.raises(AdmissionError) as info:
        admit_sft(request(write_dataset(tmp_path / "resume"), optimizer={"beta1": 0.6, "weight_decay": 0.01},
                          resume_checkpoint=basename), settings)
    assert info.value.code == "resume_drift"
    assert any(d["field"].startswith("config.optimizer") for d in info.value.differences), info.value.differences
    admitted = admit_sft(request(write_dataset(tmp_path / "resume"), optimizer=tuned, resume_checkpoint=basename),
                         settings)
    assert admitted.effective_config["optimizer"] == {**OPTIMIZER_DEFAULT, **tuned}
