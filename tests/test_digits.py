"""scikit-learn's digits (pipelines/data/digits.py): the transfer splits, and the shifted copies
that only the fine-tuning training split holds."""
import numpy as np

from pipelines.data.digits import BACKGROUND, Config, make, shifted


def config(**fields):
    return Config(**{"kind": "digits", "image_size": 16, "channels": 1,
                     "pretrain_classes": [0, 1], "finetune_classes": [5, 6],
                     "test_fraction": 0.3, **fields})


def test_an_image_moves_and_its_border_is_background():
    image = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    down_right = shifted(image, 1, 2, BACKGROUND)[0, 0]
    assert (down_right[1:, 2:] == image[0, 0, :3, :2]).all()
    assert (down_right[0] == BACKGROUND).all() and (down_right[:, :2] == BACKGROUND).all()
    assert (shifted(image, 0, 0, BACKGROUND) == image).all()


def test_only_the_finetuning_training_split_has_the_copies():
    plain, copied = make(config(), seed=0), make(config(shift=2), seed=0)
    n = len(plain["finetune_train_y"])
    assert copied["finetune_train_x"].shape == (9 * n, 1, 16, 16)
    assert (copied["finetune_train_y"] == np.tile(plain["finetune_train_y"], 9)).all()
    assert (copied["finetune_train_x"][4 * n:5 * n] == plain["finetune_train_x"]).all()  # unmoved
    for name in ("finetune_test", "pretrain_train", "pretrain_test"):  # never shifted
        assert (copied[f"{name}_x"] == plain[f"{name}_x"]).all()
    assert set(np.unique(copied["finetune_train_y"])) == {5, 6}
