"""Model builders: `train.model` name -> torch.nn.Module, before DDP wraps it.

Names: built-ins (below), any torchvision classification model (ResNets get a CIFAR stem), or a
"package.module:function" plugin. Then optional local pretrained weights (the head is skipped
when its shape differs: transfer to another class count) and an optional frozen backbone.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ddpjob.console import print0
from ddpjob.errors import DDPJobError, UsageError


# ------------------------------------------------------------------------------ built-ins
def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class TinyCNN(nn.Sequential):
    """`cnn_tiny`: 4 conv-BN-ReLU layers (16-32-64-64 channels), 3 max-pools, ~62k parameters.

    About 3 MFLOPs per 32x32 image: a CPU core trains it on a few thousand images in seconds,
    which is what tests and the smoke job need.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(*_conv_bn(3, 16), nn.MaxPool2d(2), *_conv_bn(16, 32), nn.MaxPool2d(2),
                         *_conv_bn(32, 64), nn.MaxPool2d(2), *_conv_bn(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, num_classes)  # appended last: Sequential runs it after Flatten


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, cout, stride), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNet of He et al. (2016): 6n+2 layers, 16-32-64 channels, 32x32 input.

    `resnet8` (n=1, ~78k parameters) and `resnet20` (n=3, ~270k parameters).
    """

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:  # a caller's value (the class is public), not an invariant
            raise UsageError(f"CifarResNet depth is {depth}, expected 6n+2 with n >= 1 (8, 14, 20, 32, ...)",
                             "use the models resnet8 or resnet20, or a depth of 6n+2")
        n = (depth - 2) // 6
        layers: list[nn.Module] = [*_conv_bn(3, 16)]
        cin = 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


BUILTIN: dict[str, Callable[[int], nn.Module]] = {
    "cnn_tiny": TinyCNN,
    "resnet8": lambda k: CifarResNet(8, k),
    "resnet20": lambda k: CifarResNet(20, k),
}


def _torchvision_names() -> list[str]:
    import torchvision.models

    return torchvision.models.list_models(module=torchvision.models)  # classification only


def _cifar_stem(model: nn.Module) -> None:
    # Why: ImageNet's 7x7 stride-2 conv + max-pool shrink a 32x32 image to 8x8 before the first
    # block; a 3x3 stride-1 conv and no pool keep the resolution (the standard CIFAR ResNet).
    width = model.conv1.out_channels  # type: ignore[union-attr]
    model.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)  # type: ignore[arg-type]
    model.maxpool = nn.Identity()


def build_model(name: str, num_classes: int = 10, *, cifar_stem: bool = True, pretrained: str = "",
                freeze_backbone: bool = False) -> nn.Module:
    """Build `name` with a `num_classes` head; see the module docstring for the steps.

    `cifar_stem` applies to torchvision ResNet-family models only (resnet*, resnext*,
    wide_resnet*); other families keep their stems.
    """
    if num_classes < 1:
        raise UsageError(f"train.num_classes is {num_classes}, expected >= 1", "e.g. num_classes = 10")
    if ":" in name:
        from ddpjob.train.data import load_plugin

        model = load_plugin(name)(num_classes=num_classes)
        if not isinstance(model, nn.Module):
            raise DDPJobError(f"model plugin {name!r} returned a {type(model).__name__}, expected a "
                              "torch.nn.Module", "return the model instance from the function")
    elif name in BUILTIN:
        model = BUILTIN[name](num_classes)
    elif name in _torchvision_names():
        import torchvision.models

        try:
            model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"torchvision cannot build {name} with num_classes={num_classes}: "
                             f"{exc}", "pick another model") from None
        if cifar_stem and isinstance(model, torchvision.models.ResNet):
            _cifar_stem(model)
    else:
        known = list(BUILTIN) + _torchvision_names()
        close = difflib.get_close_matches(name, known, n=3) or ["resnet18", "resnet50", "cnn_tiny"]
        raise UsageError(f"unknown model {name!r}, expected a built-in ({', '.join(BUILTIN)}), a "
                         f"torchvision classification model (e.g. {', '.join(close)}) or "
                         "\"package.module:function\"",
                         "python -c 'import torchvision; print(torchvision.models.list_models())' "
                         "lists the torchvision names")
    if pretrained:
        report = load_pretrained(model, pretrained)
        print0(report.line())
    if freeze_backbone:
        freeze_backbone_(model)
    return model


# ------------------------------------------------------------------- weights and freezing
def head_name(model: nn.Module) -> str:
    """The classifier head: `fc` (ResNets, built-ins), `classifier`, else the last Linear."""
    for attr in ("fc", "classifier"):
        if isinstance(getattr(model, attr, None), nn.Module):
            return attr
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise DDPJobError(f"cannot find the classifier head of {type(model).__name__}: no `fc`, "
                          "`classifier` or Linear layer", "name the head `fc` in your model")
    return linears[-1]


@dataclass
class PretrainedReport:
    path: str
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # head tensors left freshly initialized

    def line(self) -> str:
        text = f"pretrained: loaded {len(self.loaded)} tensors from {self.path}"
        if self.skipped:
            text += f"; head kept fresh (shape differs or absent): {', '.join(self.skipped)}"
        return text


def _state_dict_of(obj: object, path: Path) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict"):  # checkpoint-style wrappers
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not (isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise DDPJobError(f"{path} holds a {type(obj).__name__}, expected a state_dict of tensors",
                          "save weights with torch.save(model.state_dict(), path)")
    out = {}
    for k, v in obj.items():
        for prefix in ("module.", "_orig_mod."):  # DDP and torch.compile wrappers
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def load_pretrained(model: nn.Module, path: str | Path) -> PretrainedReport:
    """Copy weights from a local file into `model`; only the head may differ or be missing."""
    path = Path(path)
    if not path.is_file():
        raise DDPJobError(f"pretrained weights file {path} not found", "set train.pretrained to "
                          "a local file, e.g. RUN_DIR/final/model.pt (nodes do not download)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated, or pickled objects that weights_only refuses
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DDPJobError(f"cannot read weights file {path} ({msg})",
                          "it must be a torch.save'd state_dict of tensors") from None
    source = _state_dict_of(obj, path)
    head = head_name(model) + "."
    report = PretrainedReport(str(path))
    mismatched: list[str] = []
    missing: list[str] = []
    take: dict[str, torch.Tensor] = {}
    for key, target in model.state_dict().items():
        if key not in source:
            (report.skipped if key.startswith(head) else missing).append(key)
        elif source[key].shape != target.shape:
            if key.startswith(head):
                report.skipped.append(key)
            else:
                mismatched.append(f"{key} {tuple(source[key].shape)} vs {tuple(target.shape)}")
        else:
            take[key] = source[key]
            report.loaded.append(key)
    unexpected = [k for k in source if k not in model.state_dict()]
    if mismatched or missing or unexpected:
        problems = (mismatched + [f"{k} missing" for k in missing]
                    + [f"{k} unexpected" for k in unexpected])
        raise DDPJobError(f"{path} does not fit {type(model).__name__}: {len(problems)} tensors "
                          f"differ, e.g. {'; '.join(problems[:3])}", "use weights of the same "
                          "architecture (train.model) and the same train.cifar_stem setting")
    model.load_state_dict(take, strict=False)
    return report


def _keep_eval(module: nn.Module, _args: object) -> None:
    # Forward pre-hook on frozen BatchNorm: use the (pretrained) running statistics and never
    # update them, even though the trainer calls model.train() on the whole model.
    module.train(False)


def freeze_backbone_(model: nn.Module) -> str:
    """Only the head stays trainable; frozen BatchNorm layers always run in eval mode.

    Returns the head's name. (Choice: a frozen backbone is a fixed feature extractor, so its BN
    statistics must not drift with the new data either.)
    """
    head = head_name(model)
    head_params = {id(p) for p in model.get_submodule(head).parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in head_params)
    for name, m in model.named_modules():
        in_head = name == head or name.startswith(head + ".")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not in_head:
            m.register_forward_pre_hook(_keep_eval)
    return head
