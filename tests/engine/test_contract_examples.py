"""The two examples of the engine checkpoint contract, verbatim with `trainer` for `riftco_transformer`."""

import numpy as np


def contract_example_capture():
    # -- verbatim: "Capture at a clean boundary" --
    from trainer import Adam, DecoderOnlyTransformer, TransformerConfig
    from trainer.checkpoints import TrainingCheckpoint
    from trainer.training import (
        CausalLanguageModelTrainer,
        RandomWindowBatchSource,
        TrainingLoopConfig,
    )

    config = TransformerConfig(
        vocabulary_size=8,
        maximum_context=4,
        model_width=8,
        head_count=2,
        block_count=1,
        feed_forward_width=16,
    )
    tokens = tuple(range(8)) * 16
    source = RandomWindowBatchSource(
        tokens,
        batch_size=2,
        context_size=4,
        random_seed=17,
    )

    with DecoderOnlyTransformer(config) as model:
        with model.parameters() as parameters:
            with Adam(parameters, learning_rate=1.0e-3) as optimizer:
                CausalLanguageModelTrainer(model, optimizer).run(
                    source,
                    TrainingLoopConfig(steps=10),
                )
                checkpoint = TrainingCheckpoint.capture(
                    model,
                    optimizer,
                    source=source,
                    global_step=10,
                    metadata={"run": "example"},
                )
                checkpoint.save("runs/example-step-10.riftckpt")
    # -- end of the verbatim example --
    return config, tokens


def test_capture_example(tmp_path, monkeypatch):
    from trainer.checkpoints import TrainingCheckpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    contract_example_capture()
    loaded = TrainingCheckpoint.load(tmp_path / "runs" / "example-step-10.riftckpt")
    assert (loaded.global_step, loaded.optimizer_step, loaded.metadata) == (10, 10, {"run": "example"})


def test_restore_example_into_paged_adam(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    config, tokens = contract_example_capture()
    from trainer import Adam, DecoderOnlyTransformer
    from trainer.checkpoints import TrainingCheckpoint
    from trainer.training import (
        CausalLanguageModelTrainer,
        RandomWindowBatchSource,
        TrainingLoopConfig,
    )

    # -- verbatim: "Restore into fresh objects" --
    checkpoint = TrainingCheckpoint.load("runs/example-step-10.riftckpt")
    source = RandomWindowBatchSource(
        tokens,
        batch_size=2,
        context_size=4,
        random_seed=17,
    )

    with DecoderOnlyTransformer(config) as model:
        with model.parameters() as parameters:
            with Adam(
                parameters,
                learning_rate=1.0e-3,
                state_storage="paged",
                page_size=4096,
            ) as optimizer:
                restored = checkpoint.restore(model, optimizer, source)
                assert restored.optimizer_step == 10
                CausalLanguageModelTrainer(model, optimizer).run(
                    source,
                    TrainingLoopConfig(steps=10),
                )
                # -- end of the verbatim example --
                resumed = model.state_dict(), optimizer.state_dict()

    # the resumed 10 + 10 steps equal 20 uninterrupted ones
    source = RandomWindowBatchSource(tokens, batch_size=2, context_size=4, random_seed=17)
    with DecoderOnlyTransformer(config) as model:
        with model.parameters() as parameters:
            with Adam(parameters, learning_rate=1.0e-3) as optimizer:
                CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=20))
                for name, value in model.state_dict().items():
                    assert np.array_equal(resumed[0][name], value), name
                expected = optimizer.state_dict()
    assert resumed[1]["step"] == expected["step"] == 20
    assert resumed[1]["beta1_power"] == expected["beta1_power"]
    assert resumed[1]["beta2_power"] == expected["beta2_power"]
    for key in ("first_moment", "second_moment"):
        for name, value in expected[key].items():
            assert np.array_equal(resumed[1][key][name], value), (key, name)
