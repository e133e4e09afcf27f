"""ddpjob.train.models: built-ins, torchvision names with the CIFAR stem, plugins, pretrained, freezing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpjob.errors import DDPJobError, UsageError
from ddpjob.train.models import build_model, freeze_backbone_, head_name, load_pretrained

torch.set_num_threads(1)
X = torch.randn(2, 3, 32, 32)


@pytest.mark.parametrize("name, max_params", [("cnn_tiny", 100_000), ("resnet8", 100_000),
                                              ("resnet20", 300_000)])
def test_builtins_build_with_any_class_count(name, max_params):
    model = build_model(name, num_classes=7)
    assert model(X).shape == (2, 7)
    assert sum(p.numel() for p in model.parameters()) < max_params
    assert head_name(model) == "fc"


def test_resnet_cifar_stem_keeps_resolution():
    feats = {}
    cifar = build_model("resnet18", num_classes=10)
    imagenet = build_model("resnet18", num_classes=10, cifar_stem=False)
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)
    assert isinstance(cifar.maxpool, nn.Identity)
    assert imagenet.conv1.kernel_size == (7, 7)
    for tag, m in (("cifar", cifar), ("imagenet", imagenet)):
        m.layer4.register_forward_hook(lambda mod, i, o, tag=tag: feats.__setitem__(tag, o.shape))
        assert m(X).shape == (2, 10)
    assert feats["cifar"][-2:] == (4, 4) and feats["imagenet"][-2:] == (1, 1)


def test_non_resnet_torchvision_model_and_its_head():
    model = build_model("squeezenet1_1", num_classes=3)  # cifar_stem does not apply
    assert model(X).shape == (2, 3) and head_name(model) == "classifier"


def test_parameter_counts_known_without_torch_match_the_builders():
    """modelnames.PARAMS (doctor's snapshot estimate): every buildable name, the built-ins as
    built for 10 classes, torchvision's from its weights' metadata (no model is built)."""
    import torchvision.models

    from ddpjob import modelnames

    assert set(modelnames.PARAMS) == {*modelnames.BUILTIN_NAMES, *modelnames.TORCHVISION_NAMES}
    for name in modelnames.BUILTIN_NAMES:
        assert modelnames.PARAMS[name] == sum(p.numel() for p in build_model(name).parameters()), name
    for name in modelnames.TORCHVISION_NAMES:
        meta = torchvision.models.get_model_weights(name).DEFAULT.meta
        assert modelnames.PARAMS[name] == meta["num_params"], name
    # for CIFAR's 10 classes and stem the table is an upper bound, within a few per cent for ResNet-18
    built = sum(p.numel() for p in build_model("resnet18").parameters())
    assert built <= modelnames.PARAMS["resnet18"] <= 1.05 * built


def test_unknown_name_is_a_usage_error_with_suggestions():
    with pytest.raises(UsageError) as err:
        build_model("resnet19")
    line = err.value.line()
    assert "unknown model 'resnet19'" in line and "resnet18" in line and "cnn_tiny" in line
    assert "Hint:" in line and err.value.exit_code == 2
    with pytest.raises(UsageError, match="num_classes is 0"):
        build_model("cnn_tiny", num_classes=0)


PLUGIN = """
import torch
class Net(torch.nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 16),
                                        torch.nn.BatchNorm1d(16), torch.nn.ReLU())
        self.out = torch.nn.Linear(16, num_classes)
    def forward(self, x):
        return self.out(self.body(x))
def build(num_classes):
    return Net(num_classes)
def not_a_model(num_classes):
    return "model"
"""


def test_plugin_models(tmp_path, monkeypatch):
    (tmp_path / "my_model_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("my_model_plugin:build", num_classes=4)
    assert model(X).shape == (2, 4)
    assert head_name(model) == "out"  # no fc/classifier: the last Linear
    with pytest.raises(DDPJobError, match="returned a str, expected a torch.nn.Module"):
        build_model("my_model_plugin:not_a_model")
    with pytest.raises(DDPJobError, match="has no attribute 'missing'"):
        build_model("my_model_plugin:missing")


def test_pretrained_transfer_skips_a_head_of_another_shape(tmp_path, capsys):
    source = build_model("resnet8", num_classes=10)
    # a DDP-style file: every key has the `module.` prefix
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "w.pt")
    model = build_model("resnet8", num_classes=5, pretrained=str(tmp_path / "w.pt"))
    assert model.fc.weight.shape == (5, 64)
    for k, v in model.state_dict().items():
        if not k.startswith("fc."):
            assert torch.equal(v, source.state_dict()[k]), k
    out = capsys.readouterr().out
    assert "loaded" in out and "fc.weight" in out and "head kept fresh" in out
    report = load_pretrained(build_model("resnet8", num_classes=5), tmp_path / "w.pt")
    assert report.skipped == ["fc.weight", "fc.bias"] and len(report.loaded) > 20


def test_pretrained_same_shape_loads_everything(tmp_path):
    source = build_model("cnn_tiny").eval()
    torch.save(source.state_dict(), tmp_path / "model.pt")  # like RUN_DIR/final/model.pt
    model = build_model("cnn_tiny", pretrained=str(tmp_path / "model.pt")).eval()
    assert torch.equal(model(X), source(X))
    wrapped = {"model": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}, "step": 3}
    torch.save(wrapped, tmp_path / "ckpt.pt")
    assert load_pretrained(build_model("cnn_tiny"), tmp_path / "ckpt.pt").skipped == []


def test_pretrained_errors(tmp_path):
    with pytest.raises(DDPJobError, match="not found"):
        build_model("cnn_tiny", pretrained=str(tmp_path / "none.pt"))
    (tmp_path / "junk.pt").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DDPJobError, match="cannot read weights file"):
        build_model("cnn_tiny", pretrained=str(tmp_path / "junk.pt"))
    torch.save({"net": nn.Linear(2, 2)}, tmp_path / "pickled_module.pt")  # weights_only refuses
    with pytest.raises(DDPJobError, match="cannot read weights file"):
        build_model("cnn_tiny", pretrained=str(tmp_path / "pickled_module.pt"))
    torch.save(build_model("cnn_tiny").state_dict(), tmp_path / "tiny.pt")
    with pytest.raises(DDPJobError, match="does not fit CifarResNet") as err:
        build_model("resnet8", pretrained=str(tmp_path / "tiny.pt"))
    assert "cifar_stem" in err.value.line()
    torch.save(build_model("resnet18", cifar_stem=False).state_dict(), tmp_path / "r18.pt")
    with pytest.raises(DDPJobError, match=r"conv1.weight \(64, 3, 7, 7\) vs \(64, 3, 3, 3\)"):
        build_model("resnet18", pretrained=str(tmp_path / "r18.pt"))
    torch.save({"step": torch.tensor(1), "note": "x"}, tmp_path / "notsd.pt")
    with pytest.raises(DDPJobError, match="expected a state_dict of tensors"):
        build_model("cnn_tiny", pretrained=str(tmp_path / "notsd.pt"))


def test_freeze_backbone_trains_only_the_head():
    model = build_model("resnet8", num_classes=3, freeze_backbone=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    loss = nn.functional.cross_entropy(model(X * 3 + 1), torch.tensor([0, 2]))
    loss.backward()
    opt.step()
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {"fc.weight", "fc.bias"}  # BN running stats of the backbone did not move
    assert model.training and model.fc.training


def test_freeze_without_a_head_is_an_error():
    with pytest.raises(DDPJobError, match="cannot find the classifier head"):
        freeze_backbone_(nn.Sequential(nn.Conv2d(3, 3, 1)))


def test_login_side_model_names_match_the_builders() -> None:
    # config validation checks train.model against ddpjob/modelnames.py without torch
    import torchvision.models

    from ddpjob import modelnames
    from ddpjob.train import models

    assert set(modelnames.BUILTIN_NAMES) == set(models.BUILTIN)
    assert set(modelnames.TORCHVISION_NAMES) <= set(torchvision.models.list_models(module=torchvision.models))
